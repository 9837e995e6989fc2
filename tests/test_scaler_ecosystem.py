"""The loss scaler among the optax and Flax tools users combine it with: resumes
with changed settings, optimizers whose gradients are not shaped as what init
saw, frozen parameters, checkpoints written in a fresh process."""

import subprocess
import sys
import textwrap
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx, serialization

import mpjax
from mpjax import get_scale, grad_scaler, noop_scaler, scaled_value_and_grad, scaler_stats

PARAMS = {"w": jnp.ones(3)}
GRADS = {"w": jnp.ones(3)}


def _resumed(old, new, steps):
    """`new`'s state restored from `old`'s after `steps` updates."""
    state = old.init(PARAMS)
    for _ in range(steps):
        _, state = old.update(GRADS, state, PARAMS)
    return serialization.from_bytes(new.init(PARAMS), serialization.to_bytes(state))


def test_a_run_resumed_with_a_shorter_growth_interval_grows_at_its_next_step():
    old = grad_scaler(optax.sgd(1e-3), init_scale=2.0**10, growth_interval=100)
    new = grad_scaler(optax.sgd(1e-3), init_scale=2.0**10, growth_interval=10)
    state = _resumed(old, new, 50)  # the tracker, 50, is past the new interval
    _, state = jax.jit(new.update)(GRADS, state, PARAMS)
    assert float(get_scale(state)) == 2.0**11 and int(state.growth_tracker) == 0


def test_a_run_resumed_with_fewer_accumulation_steps_steps_at_its_next_micro_batch():
    old = grad_scaler(optax.sgd(0.1), accumulation_steps=4, accumulation="mean")
    new = grad_scaler(optax.sgd(0.1), accumulation_steps=2, accumulation="mean")
    state = _resumed(old, new, 3)  # saved at micro-step 3 of 4
    updates, state = jax.jit(new.update)(GRADS, state, PARAMS)
    assert int(state.micro_step) == 0 and float(updates["w"][0]) != 0.0
    for _ in range(2):  # and every second one after
        updates, state = jax.jit(new.update)(GRADS, state, PARAMS)
    chex.assert_trees_all_close(updates, {"w": jnp.full(3, -0.1)})


@pytest.mark.parametrize("accumulation", ["sum", "mean"])
def test_a_run_resumed_without_accumulation_steps_at_its_next_micro_batch(accumulation):
    old = grad_scaler(optax.sgd(1.0), accumulation_steps=2, accumulation=accumulation)
    new = grad_scaler(optax.sgd(1.0))
    state = old.init(PARAMS)
    _, state = old.update(GRADS, state, PARAMS)  # saved at micro-step 1 of 2
    weight = 0.5 if accumulation == "mean" else 1.0  # the saved micro-batch's, as saved
    for step in range(3):
        updates, state = jax.jit(new.update)({"w": jnp.full(3, 2.0)}, state, PARAMS)
        # The saved micro-batch is in the first step's gradients, and only there.
        want = -(2.0 + weight) if step == 0 else -2.0
        chex.assert_trees_all_equal(updates, {"w": jnp.full(3, want)})
        assert int(state.micro_step) == 0 and bool(scaler_stats(state)["step_applied"])


def test_set_scale_on_a_disabled_scalers_state_is_kept():
    state = _resumed(noop_scaler(optax.sgd(0.1)), grad_scaler(optax.sgd(0.1)), 1)
    state = mpjax.set_scale(state, 1024.0)
    _, state = grad_scaler(optax.sgd(0.1)).update(GRADS, state, PARAMS)
    assert float(get_scale(state)) == 1024.0


def test_a_state_unpickled_in_a_fresh_process_can_be_serialized(tmp_path):
    path = tmp_path / "state.pkl"
    make = f"""
        import pickle, jax.numpy as jnp, optax, mpjax
        state = mpjax.grad_scaler(optax.adam(1e-3)).init({{"w": jnp.ones(2)}})
        pickle.dump(state, open({str(path)!r}, "wb"))
    """
    save = f"""
        import pickle
        from flax import serialization
        import mpjax
        state = pickle.load(open({str(path)!r}, "rb"))
        restored = serialization.from_bytes(state, serialization.to_bytes(state))
        assert bool(restored.nonfinite_subtrees["['w']"]) is False
    """
    for code in (make, save):
        run = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, check=False
        )
        assert run.returncode == 0, run.stderr.decode()[-2000:]


def test_the_scalers_state_types_are_registered_for_jax_export():
    # Exported.serialize() of a step whose arguments hold the state needs every
    # pytree type registered; mpjax registers its own at import.
    for register, kwargs in [
        (jax.export.register_namedtuple_serialization, {}),
        (
            jax.export.register_pytree_node_serialization,
            {"serialize_auxdata": repr, "deserialize_auxdata": str},
        ),
    ]:
        kind = mpjax.GradScalerState if not kwargs else mpjax.SubtreeFlags
        with pytest.raises(ValueError, match=f"Previous registration .* `mpjax.{kind.__name__}`"):
            register(kind, serialized_name="again", **kwargs)


def test_an_nnx_optimizer_over_one_variable_names_its_subtree():
    class OneParam(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((3, 2)))

    model = OneParam()
    optimizer = nnx.Optimizer(model, grad_scaler(optax.adam(1e-3)), wrt=nnx.Param)
    x = jnp.full((2, 3), jnp.inf)  # every gradient is inf
    _, grads = scaled_value_and_grad(lambda m: jnp.sum((x @ m.w) ** 2), optimizer)(model)
    optimizer.update(model, grads)
    stats = scaler_stats(optimizer.opt_state)
    assert bool(stats["last_step_skipped"])
    assert {k: bool(v) for k, v in stats["nonfinite_subtrees"].items()} == {"['w']": True}


def test_a_parameter_field_named_value_is_a_subtree_of_its_own():
    # Only an nnx.Variable's `.value` is left out of a subtree's name: a field of
    # the user's own named `value` (attention's query, key and value) is one.
    class Attention(NamedTuple):
        query: jax.Array
        key: jax.Array
        value: jax.Array

    params = Attention(jnp.ones(2), jnp.ones(2), jnp.ones(2))
    tx = grad_scaler(optax.sgd(0.1))
    grads = Attention(jnp.ones(2), jnp.ones(2), jnp.array([1.0, jnp.inf]))
    _, state = tx.update(grads, tx.init(params), params)
    flags = {k: bool(v) for k, v in scaler_stats(state)["nonfinite_subtrees"].items()}
    assert flags == {".key": False, ".query": False, ".value": True}


def test_an_nnx_state_of_variables_names_the_parameters_not_their_value():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    tx = grad_scaler(optax.sgd(0.1))
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
    grads["bias"] = jax.tree.map(jnp.ones_like, params["bias"])
    _, state = tx.update(grads, state, params)
    flags = {k: bool(v) for k, v in scaler_stats(state)["nonfinite_subtrees"].items()}
    assert flags == {"['bias']": False, "['kernel']": True}


def _eager_only_schedule(count):
    return 0.1 if count < 2 else 0.01  # Python control flow: fine eagerly, not under jit


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nonfinite"])
def test_an_eager_update_runs_the_optimizer_once_as_written(bad):
    # Called without jit, the wrapped optimizer runs as it does bare: a schedule
    # with Python control flow works, and host-side code runs once per update.
    # (A step with a non-finite gradient traces it, to tell which gradients it
    # reads; where it cannot be traced, every gradient counts.)
    seen = []

    def log(updates, state, params=None):
        seen.append(optax.tree.norm(updates))
        return updates, state

    inner = optax.chain(
        optax.GradientTransformation(lambda p: optax.EmptyState(), log),
        optax.sgd(_eager_only_schedule),
    )
    bare, tx = inner, grad_scaler(inner)
    bare_state, state = bare.init(PARAMS), tx.init(PARAMS)
    for step in range(4):
        skip = bad and step == 1
        grads = {"w": jnp.array([1.0, jnp.inf if skip else 2.0, 3.0])}
        updates, state = tx.update(grads, state, PARAMS)
        if not skip:  # (a skipped step leaves the schedule's count where it was)
            expected, bare_state = bare.update(grads, bare_state, PARAMS)
            chex.assert_trees_all_equal(updates, expected)
    assert int(scaler_stats(state)["skipped_steps"]) == int(bad)
    if not bad:
        assert len(seen) == 8 and not any(isinstance(x, jax.core.Tracer) for x in seen)


def _lookahead(**kwargs):
    params = optax.LookaheadParams.init_synced({"w": jnp.ones(3), "b": jnp.zeros(2)})
    inner = optax.lookahead(optax.adam(1e-3), sync_period=2, slow_step_size=0.5)
    return params, grad_scaler(inner, **kwargs)


def test_lookahead_names_the_subtrees_of_its_fast_parameters():
    params, tx = _lookahead()
    bad = {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.ones(2)}
    _, state = jax.jit(tx.update)(bad, tx.init(params), params)
    flags = {k: bool(v) for k, v in scaler_stats(state)["nonfinite_subtrees"].items()}
    assert flags == {"['b']": False, "['w']": True}


def test_lookahead_accumulates_the_fast_gradients():
    params, tx = _lookahead(accumulation_steps=2, accumulation="mean")
    plain_params, plain = _lookahead()
    state, plain_state = tx.init(params), plain.init(plain_params)
    grads = {"w": jnp.ones(3), "b": jnp.ones(2)}
    _, state = tx.update(grads, state, params)
    updates, state = tx.update(grads, state, params)
    expected, _ = plain.update(grads, plain_state, plain_params)
    chex.assert_trees_all_close(updates, expected)


@pytest.mark.parametrize(
    "grads, message",
    [
        ({"w": jnp.ones((4, 3))}, r"gradient at \['w'\] has shape \(4, 3\)"),  # per-example
        ({"w": jnp.ones(3), "b": jnp.ones(2)}, "not structured as the parameters"),
    ],
)
def test_accumulating_gradients_not_shaped_as_the_parameters_is_an_error(grads, message):
    tx = grad_scaler(optax.sgd(0.1), accumulation_steps=2, accumulation="mean")
    with pytest.raises(ValueError, match=message):
        tx.update(grads, tx.init(PARAMS), PARAMS)


def test_an_accumulating_scaler_given_a_state_made_without_accumulation_is_an_error():
    tx = grad_scaler(optax.sgd(0.1), accumulation_steps=2, accumulation="mean")
    with pytest.raises(TypeError, match="made by a scaler without accumulation"):
        tx.update(GRADS, grad_scaler(optax.sgd(0.1)).init(PARAMS), PARAMS)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_of_frozen_float16_parameters_take_no_part_in_the_check(jit):
    # torch computes no gradient for a frozen parameter, and checks none.
    params = {"base": jnp.full((4, 4), 0.5, jnp.float16), "lora": jnp.full((4, 4), 0.01)}
    labels = {"base": "frozen", "lora": "train"}
    inner = optax.multi_transform({"frozen": optax.set_to_zero(), "train": optax.sgd(0.1)}, labels)
    tx = grad_scaler(inner)
    state = tx.init(params)
    x = jnp.full((8, 4), 1.0, jnp.float16)

    def loss_fn(p, x):
        h = x @ p["base"]  # its float16 gradient, times the scale, overflows
        return jnp.mean((h.astype(jnp.float32) @ (jnp.eye(4) + p["lora"])) ** 2)

    _, grads = scaled_value_and_grad(loss_fn, state)(params, x)
    assert not jnp.isfinite(grads["base"]).all() and jnp.isfinite(grads["lora"]).all()
    update = jax.jit(tx.update) if jit else tx.update
    updates, state = update(grads, state, params)
    assert not bool(state.last_step_skipped) and float(get_scale(state)) == 2.0**16
    assert float(jnp.abs(updates["lora"]).max()) > 0
    # A trained parameter's inf still skips the step.
    grads = {**grads, "lora": grads["lora"].at[0, 0].set(jnp.inf)}
    _, state = update(grads, state, params)
    assert bool(state.last_step_skipped)


def _carries():
    tx = grad_scaler(optax.adam(1e-3), init_scale=4.0)
    for params in ([jnp.ones(3), jnp.ones(2)], [(jnp.ones((2, 2)), jnp.ones(2))]):
        yield (params, tx.init(params))
    state = tx.init(PARAMS)
    yield from ((state, "tag"), (state, (1, 2)), (PARAMS, state))


@pytest.mark.parametrize("carry", list(_carries()))
def test_helpers_read_the_scale_from_the_users_tuples(carry):
    assert float(get_scale(carry)) == 4.0


def test_a_tuple_of_two_optimizers_states_is_told_apart_from_a_chain_by_the_message():
    # A generator's scaler state beside a discriminator's adam state: as a tuple it is
    # a chain's state to look at, so the helpers refuse it, and say how to pass it.
    states = [
        grad_scaler(optax.adam(1e-3), init_scale=4.0).init(PARAMS),
        optax.adam(1e-3).init(PARAMS),
    ]
    with pytest.raises(
        ValueError, match=r"optax\.chain.*the scaler's own state, or hold them in a list"
    ):
        get_scale(tuple(states))
    assert float(get_scale(states)) == float(get_scale(states[0])) == 4.0


def test_check_updates_skips_a_step_that_makes_the_optimizer_state_not_finite():
    # A finite gradient of 1e20 squares to inf in adam's nu, while the update
    # mu / sqrt(nu) is a finite 0: kept, the parameter would never move again.
    tx = grad_scaler(optax.adam(1e-3), check_updates=True, init_scale=4.0)
    state = tx.init(PARAMS)
    _, new = jax.jit(tx.update)({"w": jnp.array([1e20, 1.0, 1.0])}, state, PARAMS)
    assert bool(new.last_step_skipped) and float(get_scale(new)) == 4.0
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)


class _MasterState(NamedTuple):
    master: dict
    inner: optax.OptState


def _float32_master_weights(inner):
    """bfloat16 parameters, their float32 master copy and inner's moments in the state."""

    def init(params):
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return _MasterState(master, inner.init(master))

    def update(grads, state, params):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        updates = jax.tree.map(lambda m, p: m.astype(p.dtype) - p, master, params)
        return updates, _MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)


_BIG = jnp.ones((4, 5)).at[0, 0].set(1e20)


@pytest.mark.parametrize(
    "params, inner, grads",
    [
        (
            {"temperature": jnp.float32(1.0), "w": jnp.ones(3)},
            optax.adam(1e-2),
            {"temperature": jnp.float32(1e20), "w": jnp.ones(3)},
        ),
        ({"w": jnp.ones((4, 5))}, optax.sm3(1e-2), {"w": _BIG}),
        (
            {"w": jnp.ones(3, jnp.bfloat16)},
            _float32_master_weights(optax.adam(1e-2)),
            {"w": jnp.array([1e20, 1.0, 1.0], jnp.bfloat16)},
        ),
    ],
    ids=["scalar-parameter", "factored-moments", "float32-moments-of-bfloat16"],
)
def test_check_updates_skips_a_step_that_makes_any_moment_not_finite(params, inner, grads):
    # adam's nu of a scalar parameter, sm3's accumulators (one per axis) and a float32
    # moment of a bfloat16 parameter are shaped or typed unlike every update.
    tx = grad_scaler(inner, check_updates=True, init_scale=4.0)
    state = tx.init(params)
    _, new = jax.jit(tx.update)(grads, state, params)
    assert bool(new.last_step_skipped) and float(get_scale(new)) == 4.0
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)
    _, applied = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
    assert not bool(applied.last_step_skipped)


def test_check_updates_keeps_steps_of_a_state_that_holds_an_inf_by_design():
    # reduce_on_plateau starts its best loss at inf.
    inner = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())
    tx = grad_scaler(inner, check_updates=True)
    state = tx.init(PARAMS)
    _, state = jax.jit(tx.update)(GRADS, state, PARAMS, value=jnp.float32(1.0))
    assert not bool(state.last_step_skipped)


def test_a_value_and_grad_that_takes_no_argnums_differentiates_the_first_argument():
    # As eqx.filter_value_and_grad(f, has_aux=...), which refuses argnums=.
    def filter_value_and_grad(f, *, has_aux=False):
        return jax.value_and_grad(f, has_aux=has_aux)

    def loss(p, x):
        return jnp.sum(p["w"] * x) ** 2

    state = grad_scaler(optax.adam(1e-3), init_scale=8.0).init(PARAMS)
    p, x = {"w": jnp.arange(3.0)}, jnp.ones(3)
    got = scaled_value_and_grad(loss, state, value_and_grad=filter_value_and_grad)(p, x)
    chex.assert_trees_all_equal(got, jax.value_and_grad(loss)(p, x))
    with pytest.raises(TypeError, match="argnums"):
        scaled_value_and_grad(loss, state, argnums=1, value_and_grad=filter_value_and_grad)(p, x)
