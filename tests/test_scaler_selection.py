"""How the scaler keeps or drops a step, whatever optimizer it wraps.

The scaler traces the wrapped optimizer's update and selects each new state leaf
against the old one where the optimizer computes it (so that XLA computes each
moment once). These tests hold what that must never change: a kept step is the
optimizer's own (up to XLA rounding the same operations a few ulps apart in another
program), and a dropped one leaves its state bit for bit.
"""

import collections
import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax import _finite
from mpjax.scaler import SubtreeFlags, scaler_stats


def _params():
    rng = np.random.default_rng(0)
    return {
        "dense": {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3)},
        "scale": jnp.ones(3),
        "embed": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
    }


def _grads(seed: int):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), _params())


def _data(tree):
    """`tree` with PRNG keys as their integer data, which chex can compare."""

    def data(x):
        is_key = jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)
        return jax.random.key_data(x) if is_key else x

    return jax.tree.map(data, tree)


INNER = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-3),
    "clipped adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "injected adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "noisy sgd": lambda: optax.noisy_sgd(0.1, key=0),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-3), "s": optax.sgd(0.1)},
        {"dense": "a", "scale": "s", "embed": "a"},
    ),
}


ULPS = 1e-5
"""How far a kept step may be from the optimizer's own run: a few float32 ulps. Any
mistake in the selection (an old moment read where the new one was due) is orders of
magnitude larger; a skipped step is held to bit identity."""


@pytest.mark.parametrize("name", list(INNER))
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_kept_step_is_the_optimizers_own_and_a_skipped_one_keeps_its_state(name, jit):
    params = _params()
    inner = INNER[name]()
    tx = mpjax.grad_scaler(INNER[name]())
    inner_update = jax.jit(inner.update) if jit else inner.update
    update = jax.jit(tx.update) if jit else tx.update
    inner_state, state = inner.init(params), tx.init(params)
    for seed in range(3):
        grads = _grads(seed)
        expected_updates, inner_state = inner_update(grads, inner_state, params)
        updates, state = update(grads, state, params)
        assert not bool(state.last_step_skipped)
        # The same operations as inner's own, compiled into another program: XLA may
        # fuse, and so round, an operation differently (an ulp or a few).
        chex.assert_trees_all_close(updates, expected_updates, rtol=ULPS, atol=0)
        chex.assert_trees_all_close(_data(state.inner_state), _data(inner_state), rtol=ULPS, atol=0)
        params = optax.apply_updates(params, updates)
    for bad in (np.inf, np.nan):
        grads = _grads(9)
        grads["dense"]["w"] = grads["dense"]["w"].at[1, 2].set(bad)
        updates, new_state = update(grads, state, params)
        assert bool(new_state.last_step_skipped)
        chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))


@pytest.mark.parametrize("name", ["adam", "clipped adam"])
def test_accumulation_keeps_the_optimizers_step_on_the_last_micro_batch_only(name):
    params = _params()
    inner = INNER[name]()
    tx = mpjax.grad_scaler(INNER[name](), accumulation_steps=2, accumulation="sum")
    update = jax.jit(tx.update)
    inner_state, state = inner.init(params), tx.init(params)
    first, second = _grads(1), _grads(2)
    updates, state = update(first, state, params)
    chex.assert_trees_all_equal(state.inner_state, inner.init(params))
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
    updates, state = update(second, state, params)
    total = jax.tree.map(lambda a, b: a + b, first, second)
    expected_updates, inner_state = jax.jit(inner.update)(total, inner_state, params)
    chex.assert_trees_all_close(updates, expected_updates, rtol=ULPS, atol=0)
    chex.assert_trees_all_close(_data(state.inner_state), _data(inner_state), rtol=ULPS, atol=0)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_debug_nans_stays_quiet_on_a_skipped_step(jit):
    # JAX's NaN checks stop at the user's overflow, not inside adam (adam on an
    # infinite gradient divides inf by inf): under jit they check the outputs, and
    # a skipped step's are selected; eagerly they check each operation, and there
    # the optimizer runs on zeros when the step is skipped.
    params = _params()
    tx = mpjax.grad_scaler(optax.adam(1e-3))
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    grads = _grads(0)
    grads["scale"] = grads["scale"].at[0].set(jnp.inf)
    with jax.debug_nans(True):
        updates, new_state = update(grads, state, params)
    assert bool(new_state.last_step_skipped)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)


@pytest.mark.parametrize("name", ["adam", "clipped adam", "adafactor"])
def test_under_jit_the_optimizers_equations_are_staged_as_traced(name, monkeypatch):
    # The selection re-evaluates the optimizer's jaxpr; under jit it adds each
    # equation to the trace as it is, with no second type inference per equation
    # (a bind each would cost the update's trace time once more), and the program
    # is the optimizer's, plus one select per state leaf and one broadcast of the
    # skip per shape of the state's arrays.
    from mpjax import _compat, _skip

    rebound = []
    bind = _compat.bind
    monkeypatch.setattr(
        _compat, "bind", lambda eqn, *a, **k: rebound.append(eqn) or bind(eqn, *a, **k)
    )
    params, inner = _params(), INNER[name]()
    state = inner.init(params)

    def selected(grads, state, drop):
        return _skip.update_selected(inner, drop, grads, state, params, {})

    staged = jax.make_jaxpr(selected)(_grads(0), state, jnp.array(False))
    assert [eqn.primitive.name for eqn in rebound] == []
    own = jax.make_jaxpr(lambda g, s: inner.update(g, s, params))(_grads(0), state)

    def counts(jaxpr):
        return collections.Counter(e.primitive.name for e in jaxpr.eqns)

    leaves = jax.tree.leaves(state)
    shapes = {jnp.shape(x) for x in leaves if jnp.ndim(x)}
    added = {"select_n": len(leaves), "broadcast_in_dim": len(shapes)}
    assert counts(staged) - counts(own) == added
    assert counts(own) - counts(staged) == collections.Counter()


def test_an_optimizer_that_changes_its_states_structure_is_refused():
    def update(updates, state, params=None):
        return updates, {"count": state}  # a dict where init made an array

    inner = optax.GradientTransformation(lambda p: jnp.zeros([]), update)
    tx = mpjax.grad_scaler(inner)
    params = _params()
    with pytest.raises(ValueError, match="structure"):
        tx.update(_grads(0), tx.init(params), params)


@pytest.mark.parametrize("bad_leaf", [0, 255, 256, 299, 300, 301])
def test_many_leaves_of_one_size_are_checked_in_stacks(bad_leaf):
    # 300 leaves of one size are checked by two stacked reductions (at most
    # _finite._STACK leaves each), the two of other sizes by their own; a bad
    # element anywhere skips the step and is named in nonfinite_subtrees.
    assert _finite._STACK == 256
    params = {f"p{i:03d}": jnp.ones(5) for i in range(300)}
    params["p300"], params["p301"] = jnp.ones(7), jnp.ones(_finite.LARGE)
    tx = mpjax.grad_scaler(optax.sgd(0.1))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    name = f"p{bad_leaf:03d}"
    grads[name] = grads[name].at[-1].set(jnp.nan)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert bool(state.last_step_skipped)
    flags = scaler_stats(state)["nonfinite_subtrees"]
    assert [k for k, v in flags.items() if bool(v)] == [f"['{name}']"]


def test_subtree_flags_are_a_mapping_held_in_one_vector():
    params = {"params": {"Dense_0": {"w": jnp.ones(3)}, "Dense_1": {"w": jnp.ones(2)}}}
    state = mpjax.grad_scaler(optax.sgd(0.1)).init(params)
    flags = state.nonfinite_subtrees
    assert isinstance(flags, SubtreeFlags)
    assert list(flags) == ["['params']['Dense_0']", "['params']['Dense_1']"]
    assert len(jax.tree.leaves(flags)) == 1 and flags.flags.dtype == jnp.bool_
    assert not bool(flags["['params']['Dense_1']"])
    with pytest.raises(KeyError):
        flags["['Dense_0']"]


@pytest.mark.parametrize("derivative", [jax.jacfwd, jax.grad], ids=["forward", "reverse"])
def test_hypergradients_through_a_kept_step_are_the_optimizers_own(derivative):
    # A learning rate's derivative through the update (what a hyper-gradient method
    # or a learned optimizer takes), through the state's scalars too (the injected
    # learning rate is one): the scaler's wrapping adds nothing to it.
    params, grads = _params(), _grads(1)

    def objective(lr, wrapped):
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
        tx = mpjax.grad_scaler(tx) if wrapped else tx
        updates, state = tx.update(grads, tx.init(params), params)
        inner = state.inner_state if wrapped else state
        new = optax.apply_updates(params, updates)
        total = sum(jnp.sum(x**2) for x in jax.tree.leaves(new))
        return total + 3.0 * inner.hyperparams["learning_rate"]

    lr = jnp.float32(0.01)
    got = jax.jit(derivative(lambda lr: objective(lr, True)))(lr)
    want = jax.jit(derivative(lambda lr: objective(lr, False)))(lr)
    chex.assert_trees_all_close(got, want, rtol=ULPS)
    assert abs(float(want)) > 3.0  # the parameters' part is not zero


def test_the_states_types_are_the_same_after_an_update():
    # A jitted step is compiled for its arguments' types, weak types included: a
    # state that came back of other types would compile the step a second time.
    def counting():  # an optimizer whose scalars are weakly typed, as jnp.asarray(0.0)
        return optax.GradientTransformation(
            lambda p: (jnp.asarray(0.0), jnp.asarray(0)),
            lambda g, s, p=None: (g, (s[0] + 1.0, s[1] + 1)),
        )

    params = _params()
    for tx in (
        mpjax.grad_scaler(optax.chain(counting(), optax.adam(1e-3))),
        mpjax.grad_scaler(optax.adam(1e-3), accumulation_steps=2, accumulation="mean"),
    ):
        state = tx.init(params)
        _, new = jax.jit(tx.update)(_grads(1), state, params)
        assert jax.tree.structure(new) == jax.tree.structure(state)
        assert [jax.typeof(x) for x in jax.tree.leaves(new)] == [
            jax.typeof(x) for x in jax.tree.leaves(state)
        ]


ODD_SHAPES = [(127,), (128,), (4, 32), (300, 1), (1, 200, 1), (2, 3, 64)]
"""Leaves on either side of `_skip.LOOPED`, and with axes of length one last."""


def _spread(x, mesh):
    """`x` split over the mesh's 8 devices along its last axis that 8 divides, if any."""
    axes = [None] * x.ndim
    split = [i for i, n in enumerate(x.shape) if n % 8 == 0]
    if split:
        axes[split[-1]] = "x"
    return jax.device_put(x, jax.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes)))


@pytest.mark.parametrize("sharded", [False, True])
def test_leaves_of_every_shape_are_kept_or_dropped_whole(sharded):
    # On a CPU the selection of a leaf of _skip.LOOPED elements or more compares an
    # iota along its last axis longer than one: every element must follow the skip,
    # whatever the shape, and on a mesh whatever the shards each device holds.
    params = {f"p{i}": jnp.linspace(-1, 1, np.prod(s)).reshape(s) for i, s in enumerate(ODD_SHAPES)}
    grads = jax.tree.map(lambda p: p * 0.5 + 0.25, params)
    if sharded:
        mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        params, grads = (jax.tree.map(lambda x: _spread(x, mesh), t) for t in (params, grads))
    tx, adam = mpjax.grad_scaler(optax.adam(1e-3)), optax.adam(1e-3)
    update = jax.jit(tx.update)
    state = update(grads, tx.init(params), params)[1]  # moments that are not zero
    updates, kept = update(grads, state, params)
    own_updates, own_state = jax.jit(adam.update)(grads, state.inner_state, params)
    chex.assert_trees_all_equal(updates, own_updates)
    chex.assert_trees_all_equal(kept.inner_state, own_state)
    for name, g in grads.items():
        bad = {**grads, name: g.reshape(-1).at[-1].set(jnp.nan).reshape(g.shape)}
        updates, dropped = update(bad, state, params)
        assert bool(dropped.last_step_skipped), name
        chex.assert_trees_all_equal(dropped.inner_state, state.inner_state)
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_the_scalers_state_and_updates_are_laid_out_as_the_parameters(axes):
    # The accumulator made by init is sharded as its parameter (a replicated one was
    # a whole copy of the model on each device), and the updates of an eager step
    # keep each leaf's sharding (zeros shared by leaves of one type took the
    # first's layout under a mesh of automatic axes, whose types omit it).
    P = jax.sharding.PartitionSpec
    kind = getattr(jax.sharding.AxisType, axes.capitalize())
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(kind, kind))
    specs = {"row": P("x", None), "col": P(None, "y"), "rep": P()}
    params = {
        k: jax.device_put(jnp.linspace(-1.0, 1.0, 32).reshape(8, 4), jax.NamedSharding(mesh, s))
        for k, s in specs.items()
    }
    grads = jax.tree.map(lambda p: p * 0.5, params)
    use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
    with use_mesh(mesh) if axes == "explicit" else contextlib.nullcontext():
        tx = mpjax.grad_scaler(optax.adam(1e-3), accumulation_steps=2, accumulation="mean")
        state = tx.init(params)
        for name, spec in specs.items():
            assert state.grad_accumulator[name].sharding.spec == spec, name
        updates, _ = mpjax.grad_scaler(optax.adam(1e-3)).update(
            grads, mpjax.grad_scaler(optax.adam(1e-3)).init(params), params
        )
    for name, spec in specs.items():
        assert updates[name].sharding.is_equivalent_to(params[name].sharding, 2), name
