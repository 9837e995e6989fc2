"""The loss scaler with the rest of the ecosystem: optimizer-state helpers
(optax combinators, nnx.Optimizer), gradient accumulation, shard_map and
checkpointing (mpjax/scaler.py)."""

import doctest
import os
import re
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_fresh_python
from flax import nnx, serialization
from jax.sharding import PartitionSpec as P

import mpjax.scaler
from mpjax.scaler import (
    GradScalerState,
    get_scale,
    grad_scaler,
    scaled_value_and_grad,
    scaler_stats,
    set_scale,
)

PARAMS = {"a": jnp.ones(3), "b": jnp.zeros((2, 2))}


def test_docstring_examples_run():
    results = doctest.testmod(mpjax.scaler, optionflags=doctest.ELLIPSIS)
    assert results.attempted >= 20 and results.failed == 0


# --------------------------------------------------------------------------
# Finding the scaler state.


def _wrapped_optimizers():
    scaled = grad_scaler(optax.adam(1e-3), init_scale=2.0**8)
    return {
        "bare": scaled,
        "chain_of_one": optax.chain(scaled),
        "named_chain_of_one": optax.named_chain(("opt", scaled)),
        "inject_hyperparams": optax.inject_hyperparams(
            lambda learning_rate: grad_scaler(optax.sgd(learning_rate), init_scale=2.0**8)
        )(learning_rate=0.1),
        "around_multi_transform": grad_scaler(
            optax.multi_transform(
                {"s": optax.adam(1e-3), "n": optax.set_to_zero()}, {"a": "s", "b": "n"}
            ),
            init_scale=2.0**8,
        ),
        "around_multi_steps": grad_scaler(
            optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2).gradient_transformation(),
            init_scale=2.0**8,
        ),
    }


def _misplaced_scalers():
    """Wrappers a scaler trains wrongly inside, without an error of its own:
    name -> (optimizer, the wrapper the error names)."""
    scaled = grad_scaler(optax.adam(1e-3))
    return {
        # MultiSteps' reset (acc * 0) turns one overflowing micro-batch into NaN for good.
        "multi_steps": (optax.MultiSteps(scaled, every_k_schedule=2), "MultiSteps"),
        "chain_in_multi_steps": (
            optax.MultiSteps(optax.chain(optax.identity(), scaled), 3),
            "MultiSteps",
        ),
        # Only part of the parameters checked; the loss is scaled for all of them.
        "multi_transform": (
            optax.multi_transform({"s": scaled, "n": optax.sgd(0.1)}, {"a": "s", "b": "n"}),
            "multi_transform",
        ),
        # Skips the overflowing steps before the scaler sees them: no backoff.
        "apply_if_finite": (
            optax.apply_if_finite(scaled, max_consecutive_errors=5),
            "apply_if_finite",
        ),
        # clip turns an inf into 1.0 before the scaler checks it: no skip, no backoff.
        "after_clip_in_chain": (
            optax.chain(optax.clip(1.0), scaled),
            r"one of 2 transforms of an optax.chain.*grad_scaler\(optax.chain",
        ),
        # Momentum still moves the parameters on a skipped step's zero updates.
        "before_trace_in_chain": (
            optax.chain(grad_scaler(optax.sgd(0.1)), optax.trace(0.9)),
            "optax.chain",
        ),
        # Weight decay still moves the parameters on a skipped step's zero updates.
        "before_decay_in_named_chain": (
            optax.named_chain(
                ("opt", grad_scaler(optax.sgd(0.1))), ("decay", optax.add_decayed_weights(0.1))
            ),
            r"one of 2 transforms of an optax.named_chain",
        ),
        # Lookahead's slow weights still sync on a skipped step.
        "lookahead": (optax.lookahead(scaled, sync_period=2, slow_step_size=0.5), "LookaheadState"),
    }


@pytest.mark.parametrize("kind", list(_misplaced_scalers()))
def test_a_scaler_inside_a_wrapper_that_breaks_it_is_an_error(kind):
    tx, wrapper = _misplaced_scalers()[kind]
    state = tx.init(PARAMS)
    for helper in (get_scale, scaler_stats, lambda s: set_scale(s, 2.0)):
        with pytest.raises(ValueError, match=wrapper):
            helper(state)
    with pytest.raises(ValueError, match=f"scaled_value_and_grad: .*{wrapper}"):
        scaled_value_and_grad(lambda p: jnp.sum(p["a"] ** 2), state)


@pytest.mark.parametrize("kind", list(_wrapped_optimizers()))
def test_helpers_find_the_state(kind):
    tx = _wrapped_optimizers()[kind]
    state = tx.init(PARAMS)
    assert float(get_scale(state)) == 2.0**8

    new = set_scale(state, 32.0)
    chex.assert_trees_all_equal_structs(new, state)
    assert float(get_scale(new)) == 32.0 and float(get_scale(state)) == 2.0**8
    stats = scaler_stats(new)
    assert float(stats["scale"]) == 32.0 and int(stats["growth_tracker"]) == 0
    # Everything but the scale is untouched.
    chex.assert_trees_all_equal(set_scale(new, 2.0**8), state)

    loss, grads = scaled_value_and_grad(lambda p: jnp.sum(p["a"] ** 2), new)(PARAMS)
    chex.assert_trees_all_equal(loss, jnp.float32(3.0))
    chex.assert_trees_all_equal(grads["a"], jnp.full(3, 2.0))  # the loss's own
    # The update still runs after set_scale, under jit.
    jax.jit(tx.update)(grads, new, PARAMS)


def test_helpers_find_the_state_in_the_users_own_tuples():
    # A (params, opt_state) carry, or (opt_state, step), is not an optax.chain.
    state = grad_scaler(optax.sgd(0.1), init_scale=2.0**8).init(PARAMS)
    for carry in ((PARAMS, state), (state, jnp.int32(3)), (state, 3), (PARAMS, (state, 0.5))):
        assert float(get_scale(carry)) == 2.0**8
        new = set_scale(carry, 32.0)
        chex.assert_trees_all_equal_structs(new, carry)
        assert float(get_scale(new)) == 32.0
        assert float(scaler_stats(carry)["scale"]) == 2.0**8


def test_set_scale_keeps_the_tracker_and_works_under_jit():
    tx = grad_scaler(optax.sgd(0.1), growth_interval=10)
    state = tx.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    for _ in range(3):
        _, state = tx.update(grads, state, PARAMS)
    state = jax.jit(set_scale)(state, jnp.float32(3.0))
    assert int(state.growth_tracker) == 3 and float(state.scale) == 3.0


def test_set_scale_on_an_ensemble_state_keeps_a_scale_per_member():
    tx = grad_scaler(optax.sgd(0.1), init_scale=2.0**8)
    members = jax.tree.map(lambda x: jnp.stack([x, 2 * x, 3 * x]), PARAMS)
    state = jax.vmap(tx.init)(members)
    chex.assert_trees_all_equal(get_scale(state), jnp.full(3, 2.0**8))
    every = set_scale(state, 32.0)
    chex.assert_trees_all_equal_structs(every, state)
    chex.assert_trees_all_equal(get_scale(every), jnp.full(3, 32.0))
    each = set_scale(state, jnp.array([1.0, 2.0, 4.0]))
    chex.assert_trees_all_equal(get_scale(each), jnp.array([1.0, 2.0, 4.0]))
    with pytest.raises(ValueError, match=r"scalar or of the state's scale shape \(3,\)"):
        set_scale(state, jnp.ones(2))
    # The ensemble's vmapped update still runs, each member at its own scale.
    grads = jax.tree.map(jnp.ones_like, members)
    _, new = jax.jit(jax.vmap(tx.update))(grads, each, members)
    chex.assert_trees_all_equal(new.growth_tracker, jnp.ones(3, jnp.int32))


def test_an_ensemble_state_names_each_members_nonfinite_subtrees_and_round_trips():
    # Three subtrees, two members: the subtree axis is the last, not the first.
    tx = grad_scaler(optax.sgd(0.1), init_scale=4.0)
    members = {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 2)), "c": jnp.ones((2, 1))}
    grads = {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 2)), "c": jnp.array([[jnp.inf], [1.0]])}
    _, state = jax.jit(jax.vmap(tx.update))(grads, jax.vmap(tx.init)(members), members)
    want = {"['a']": [False, False], "['b']": [False, False], "['c']": [True, False]}
    for name, flags in want.items():
        chex.assert_trees_all_equal(state.nonfinite_subtrees[name], jnp.array(flags))
        chex.assert_trees_all_equal(
            scaler_stats(state)["nonfinite_subtrees"][name], jnp.array(flags)
        )
    restored = serialization.from_bytes(state, serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored, state)
    chex.assert_trees_all_equal_structs(restored, state)
    _, again = jax.vmap(tx.update)(grads, restored, members)
    chex.assert_trees_all_equal(again.skipped_steps, jnp.array([2, 0], jnp.int32))


def test_scaled_value_and_grad_with_aux_and_argnums():
    state = grad_scaler(optax.sgd(0.1), init_scale=4.0).init(PARAMS)

    def loss_fn(x, p):
        return jnp.sum(p["a"] * x), {"n": jnp.float32(7.0)}

    (loss, aux), grads = scaled_value_and_grad(loss_fn, state, argnums=(0, 1), has_aux=True)(
        jnp.float32(2.0), PARAMS
    )
    assert float(loss) == 6.0 and float(aux["n"]) == 7.0
    # the loss's own gradients: the scale is divided out again
    chex.assert_trees_all_equal(grads[0], jnp.float32(3.0))
    chex.assert_trees_all_equal(grads[1]["a"], jnp.full(3, 2.0))


def test_float16_losses_are_scaled_in_float32():
    # 65536 is above float16's maximum: a float16 product would be inf.
    state = grad_scaler(optax.sgd(0.1)).init(PARAMS)
    f16_loss = lambda w: (w * w).astype(jnp.float16)
    loss, grad = scaled_value_and_grad(f16_loss, state)(jnp.float32(3.0))
    chex.assert_type(loss, jnp.float16)
    assert float(loss) == 9.0
    # ... but the float16 backward pass does overflow at that scale, as torch's
    # would: the scaler skips the step and backs off. At 2**8 it does not.
    assert not np.isfinite(float(grad))
    state = set_scale(state, 2.0**8)
    assert float(scaled_value_and_grad(f16_loss, state)(jnp.float32(3.0))[1]) == 6.0


def test_no_scaler_state_is_a_clear_error():
    state = optax.adam(1e-3).init(PARAMS)
    for helper in [
        get_scale,
        scaler_stats,
        lambda s: set_scale(s, 2.0),
        lambda s: scaled_value_and_grad(lambda x: x, s),
    ]:
        with pytest.raises(
            ValueError, match=r"no GradScalerState found in `opt_state`.*grad_scaler"
        ):
            helper(state)


@pytest.mark.parametrize(
    "tx",
    [
        optax.chain(grad_scaler(optax.sgd(0.1)), grad_scaler(optax.sgd(0.1))),
        optax.multi_transform(
            {"s": grad_scaler(optax.sgd(0.1)), "t": grad_scaler(optax.sgd(0.1))},
            {"a": "s", "b": "t"},
        ),
        grad_scaler(grad_scaler(optax.sgd(0.1))),  # nested: would unscale twice
    ],
    ids=["chain", "multi_transform", "nested"],
)
def test_two_scaler_states_are_a_clear_error(tx):
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"found 2 GradScalerStates in `opt_state` \(at .*\)"):
        get_scale(state)
    with pytest.raises(ValueError, match="single grad_scaler"):
        set_scale(state, 2.0)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), 1e-40])
def test_set_scale_refuses_bad_values(value):
    state = grad_scaler(optax.sgd(0.1)).init(PARAMS)
    with pytest.raises(ValueError, match="new_scale"):
        set_scale(state, value)


def test_extra_args_reach_inner():
    def times(factor):  # an inner transform that needs an extra argument
        return optax.GradientTransformationExtraArgs(
            lambda params: optax.EmptyState(),
            lambda updates, state, params=None, *, factor=factor: (
                jax.tree.map(lambda u: u * factor, updates),
                state,
            ),
        )

    tx = grad_scaler(optax.chain(times(1.0), optax.sgd(1.0)), init_scale=4.0)
    state = tx.init(jnp.zeros(2))
    updates, _ = jax.jit(tx.update)(jnp.array([1.0, 2.0]), state, None, factor=3.0)
    chex.assert_trees_all_equal(updates, jnp.array([-3.0, -6.0]))
    # A plain GradientTransformation is wrapped and ignores them.
    plain = grad_scaler(optax.sgd(1.0), init_scale=4.0)
    updates, _ = plain.update(jnp.array([1.0]), plain.init(jnp.zeros(1)), None, factor=3.0)
    chex.assert_trees_all_equal(updates, jnp.array([-1.0]))


# --------------------------------------------------------------------------
# flax.nnx.Optimizer.


class _Linear(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_nnx_optimizer():
    model = _Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, grad_scaler(optax.adam(1e-3), init_scale=2.0**10, growth_interval=2), wrt=nnx.Param
    )
    # The state is stored as nnx Variables inside the GradScalerState.
    assert float(get_scale(optimizer.opt_state)) == 2.0**10
    assert float(get_scale(optimizer)) == 2.0**10

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = scaled_value_and_grad(
            loss_fn, optimizer.opt_state, value_and_grad=nnx.value_and_grad
        )(model, x, y)
        optimizer.update(model, grads)
        return loss

    x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
    expected_loss = loss_fn(model, x, y)
    loss = train_step(model, optimizer, x, y)
    assert float(loss) == float(expected_loss)  # the unscaled loss
    assert int(scaler_stats(optimizer.opt_state)["growth_tracker"]) == 1

    before_params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    before_inner = jax.tree.map(jnp.copy, nnx.as_pure(optimizer.opt_state).inner_state)
    train_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
    chex.assert_trees_all_equal(nnx.state(model, nnx.Param), before_params)
    chex.assert_trees_all_equal(nnx.as_pure(optimizer.opt_state).inner_state, before_inner)
    stats = scaler_stats(optimizer.opt_state)
    assert bool(stats["last_step_skipped"]) and float(stats["scale"]) == 2.0**9

    with pytest.raises(TypeError, match=r"optimizer.opt_state = mpjax.set_scale\(optimizer"):
        set_scale(optimizer, 8.0)  # torch's scaler.update(8.0) changes it in place; this cannot
    assert float(get_scale(optimizer)) == 2.0**9
    optimizer.opt_state = set_scale(optimizer.opt_state, 8.0)
    assert float(get_scale(optimizer.opt_state)) == 8.0
    train_step(model, optimizer, x, y)
    assert float(get_scale(optimizer)) == 8.0
    assert not bool(scaler_stats(optimizer)["last_step_skipped"])
    assert int(nnx.as_pure(optimizer.opt_state).inner_state[0].count) == 2


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_tree_map_params_maps_every_parameter_shaped_part(accumulation_steps):
    # optax.tree_map_params is how a sharded model gives its optimizer state the
    # parameters' shardings: the moments (and the accumulator) get the
    # parameters', everything else what transform_non_params says.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharded = jax.sharding.NamedSharding(mesh, P("data"))
    replicated = jax.sharding.NamedSharding(mesh, P())
    params = {"w": jnp.arange(8.0 * jax.device_count()).reshape(-1, 4), "b": jnp.ones(4)}
    param_shardings = {"w": sharded, "b": replicated}
    params = jax.device_put(params, param_shardings)
    tx = grad_scaler(optax.adam(1e-3), accumulation_steps=accumulation_steps, accumulation="mean")
    abstract = jax.eval_shape(tx.init, params)

    shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract, param_shardings, transform_non_params=lambda _: replicated
    )

    state = jax.jit(tx.init, out_shardings=shardings)(params)
    moments = [state.inner_state[0].mu, state.inner_state[0].nu]
    if accumulation_steps > 1:
        moments.append(state.grad_accumulator)
    for tree in moments:
        assert tree["w"].sharding == sharded and tree["b"].sharding == replicated
    assert state.scale.sharding == replicated
    assert state.nonfinite_subtrees["['w']"].shape == ()
    grads = jax.tree.map(jnp.ones_like, params)

    def effective_step(update, state):
        for _ in range(accumulation_steps):
            updates, state = update(grads, state, params)
        return updates, state

    updates, state = effective_step(
        jax.jit(tx.update, out_shardings=(param_shardings, shardings)), state
    )
    expected, expected_state = effective_step(jax.jit(tx.update), tx.init(params))
    assert updates["w"].sharding == sharded
    chex.assert_trees_all_equal(updates, expected)
    chex.assert_trees_all_equal(state, expected_state)


# --------------------------------------------------------------------------
# Gradient accumulation.


def test_accumulation_skips_the_effective_batch_with_an_inf():
    tx = grad_scaler(
        optax.sgd(1.0),
        init_scale=2.0**4,
        growth_interval=1,
        accumulation_steps=3,
        accumulation="mean",
    )
    update = jax.jit(tx.update)
    params = jnp.zeros(2)
    state = tx.init(params)
    micro_batches = [
        [16.0, 32.0],
        [jnp.inf, 16.0],
        [16.0, 16.0],  # skipped
        [16.0, 32.0],
        [-48.0, 16.0],
        [32.0, 64.0],  # applied
        [32.0, 32.0],
        [0.0, 32.0],
        [jnp.nan, 32.0],
    ]  # skipped
    scales, skipped, all_updates = [], [], []
    for grads in micro_batches:
        updates, state = update(jnp.array(grads), state, params)
        scales.append(float(state.scale))
        skipped.append(int(state.skipped_steps))
        all_updates.append(np.asarray(updates))
        assert int(state.micro_step) == len(scales) % 3
    # The scale changes only at the end of an effective batch.
    assert scales == [16.0, 16.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 8.0]
    assert skipped == [0, 0, 1, 1, 1, 1, 1, 1, 2]
    expected = np.zeros((9, 2), np.float32)
    # Each micro-batch times float32(1 / 3), summed in float32 (XLA may fuse the
    # multiply-adds: equal to an ulp of the terms).
    expected[5] = -np.float32([16 - 48 + 32, 32 + 16 + 64]) / 3
    np.testing.assert_allclose(np.stack(all_updates), expected, rtol=0, atol=48 * 2**-23)
    assert bool(state.last_step_skipped)
    # The accumulator was reset by selection: no NaN left behind.
    chex.assert_trees_all_equal(state.grad_accumulator, jnp.zeros(2))
    for _ in range(3):
        updates, state = update(jnp.array([0.5, 0.5]), state, params)
    chex.assert_trees_all_equal(updates, jnp.array([-0.5, -0.5]))


def test_accumulated_float16_gradients_are_checked_and_applied_as_their_float32_sum():
    # Two finite float16 micro-batches whose sum float16 cannot hold: the step
    # takes the float32 sum (no skip, no backoff); bfloat16 ones keep their dtype.
    tx = grad_scaler(optax.adam(1.0), init_scale=1.0, accumulation_steps=2, accumulation="sum")
    params = {"w": jnp.zeros(2), "h": jnp.zeros(2, jnp.bfloat16)}
    grads = {"w": jnp.array([40000.0, 1.0], jnp.float16), "h": jnp.ones(2, jnp.bfloat16)}
    state = tx.init(params)
    for _ in range(2):
        updates, state = jax.jit(tx.update)(grads, state, params)
    assert not bool(state.last_step_skipped) and float(state.scale) == 1.0
    want, want_state = optax.adam(1.0).update(
        {"w": jnp.array([80000.0, 2.0]), "h": jnp.full(2, 2.0, jnp.bfloat16)},
        optax.adam(1.0).init(params),
    )
    chex.assert_trees_all_close(updates, want, rtol=1e-6)  # an ulp: XLA fuses adam
    chex.assert_trees_all_close(state.inner_state, want_state, rtol=1e-6)
    chex.assert_trees_all_equal_dtypes(state.inner_state, want_state)


def test_accumulation_matches_one_big_batch_and_leaves_inner_alone_in_between():
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    acc = grad_scaler(inner, init_scale=2.0**6, accumulation_steps=4, accumulation="mean")
    one = grad_scaler(inner, init_scale=2.0**6)
    params = {"w": jnp.linspace(0.0, 1.0, 5), "h": jnp.ones(2, jnp.bfloat16)}
    acc_state, one_state = acc.init(params), one.init(params)
    assert acc_state.grad_accumulator["h"].dtype == jnp.float32  # float32 sums
    rng = np.random.default_rng(4)
    micro = [
        jax.tree.map(lambda p: jnp.asarray(rng.integers(-8, 8, p.shape) * 4.0, p.dtype), params)
        for _ in range(4)
    ]
    update = jax.jit(acc.update)
    for i, grads in enumerate(micro):
        before = acc_state
        updates, acc_state = update(grads, acc_state, params)
        if i < 3:
            chex.assert_trees_all_equal(acc_state.inner_state, before.inner_state)
            chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
    # Multiples of 4 below 32: their means are exact in every dtype here.
    mean = jax.tree.map(
        lambda *g: (sum(x.astype(jnp.float32) for x in g) / 4).astype(g[0].dtype), *micro
    )
    want, one_state = jax.jit(one.update)(mean, one_state, params)
    chex.assert_trees_all_equal(updates, want)
    chex.assert_trees_all_equal(acc_state.inner_state, one_state.inner_state)
    chex.assert_trees_all_equal_dtypes(updates, want)


def test_multi_steps_pitfall_is_avoided():
    # The same schedule as optax.MultiSteps(grad_scaler(...), 2): an inf in the
    # first effective batch must not leak into the later ones.
    tx = grad_scaler(optax.sgd(1.0), init_scale=1.0, accumulation_steps=2, accumulation="mean")
    params, state = jnp.zeros(2), tx.init(jnp.zeros(2))
    skipped = []
    for g in [1.0, jnp.inf, 1.0, 1.0, 1.0, 1.0]:
        updates, state = tx.update(jnp.array([g, 1.0]), state, params)
        skipped.append(int(state.skipped_steps))
    assert skipped == [0, 1, 1, 1, 1, 1]
    chex.assert_trees_all_equal(updates, jnp.array([-1.0, -1.0]))  # the mean of [1, 1]


def test_accumulation_with_enabled_false_still_averages():
    tx = grad_scaler(optax.sgd(1.0), enabled=False, accumulation_steps=2, accumulation="mean")
    params, state = jnp.zeros(1), tx.init(jnp.zeros(1))
    u1, state = tx.update(jnp.array([1.0]), state, params)
    u2, state = tx.update(jnp.array([jnp.inf]), state, params)
    chex.assert_trees_all_equal(u1, jnp.zeros(1))
    chex.assert_trees_all_equal(u2, jnp.array([-jnp.inf]))  # no checks when disabled


# --------------------------------------------------------------------------
# shard_map.


def _state_specs(state):
    """Parameter-shaped state sharded, the rest (scalars, the subtree flags) replicated."""
    specs = jax.tree.map(lambda x: P("d") if jnp.ndim(x) else P(), state)
    return specs._replace(nonfinite_subtrees=jax.tree.map(lambda _: P(), state.nonfinite_subtrees))


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_axis_name_inside_shard_map(accumulation_steps):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    tx = grad_scaler(
        optax.sgd(1.0, momentum=0.5),
        init_scale=4.0,
        axis_name="d",
        accumulation_steps=accumulation_steps,
        accumulation="mean",
    )
    params = jnp.arange(4.0)
    state = tx.init(params)
    specs = _state_specs(state)
    step = jax.jit(
        jax.shard_map(
            lambda g, s, p: tx.update(g, s, p),
            mesh=mesh,
            in_specs=(P("d"), specs, P("d")),
            out_specs=(P("d"), specs),
        )
    )
    for _ in range(accumulation_steps):
        updates, state = step(jnp.full(4, 1.0), state, params)
    chex.assert_trees_all_equal(updates, -jnp.ones(4))
    before = state
    for _ in range(accumulation_steps):
        updates, state = step(jnp.array([4.0, jnp.nan, 4.0, 4.0]), state, params)
    chex.assert_trees_all_equal(updates, jnp.zeros(4))
    chex.assert_trees_all_equal(state.inner_state, before.inner_state)
    assert float(state.scale) == 2.0 and int(state.skipped_steps) == 1


def test_gradients_that_differ_between_devices_need_axis_name():
    """Sharded gradients and a replicated scaler state (a ZeRO layout) without
    axis_name: each device would decide alone, so update refuses; a state that
    differs between devices too (one independent run per device) is theirs to skip."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    tx = grad_scaler(optax.adam(0.1))
    params = jnp.arange(4.0)
    state = tx.init(params)
    specs = _state_specs(state)
    step = jax.shard_map(
        lambda g, s, p: tx.update(g, s, p),
        mesh=mesh,
        in_specs=(P("d"), specs, P("d")),
        out_specs=(P("d"), specs),
    )
    with pytest.raises(ValueError, match=r"mesh axes \('d',\).*Pass axis_name"):
        jax.jit(step)(jnp.ones(4), state, params)
    per_device = jax.tree.map(lambda _: P("d"), jax.tree.map(lambda x: x[None], state))
    stacked = jax.tree.map(lambda x: x[None], state)
    run = jax.jit(
        jax.shard_map(
            lambda g, s, p: jax.tree.map(
                lambda x: x[None], tx.update(g, jax.tree.map(lambda x: x[0], s), p)
            ),
            mesh=mesh,
            in_specs=(P("d"), per_device, P("d")),
            out_specs=(P("d"), per_device),
        )
    )
    updates, new = run(jnp.array([1.0, jnp.inf, 1.0, 1.0]), stacked, params)
    chex.assert_trees_all_equal(updates, jnp.zeros((1, 4)))
    assert bool(new.last_step_skipped[0]) and float(new.scale[0]) == 2.0**15


def test_axis_name_gives_one_decision_on_four_devices(tmp_path):
    # A fresh process: the host platform is split into 4 devices only at startup.
    script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, optax
      from jax.sharding import PartitionSpec as P
      from mpjax.scaler import grad_scaler
      assert jax.device_count() == 4
      mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
      tx = grad_scaler(optax.sgd(1.0, momentum=0.5), init_scale=4.0, axis_name="d")
      params = jnp.arange(8.0)
      state = tx.init(params)
      specs = jax.tree.map(lambda x: P("d") if jnp.ndim(x) else P(), state)
      # one flag per parameter subtree, the same on every device: replicated
      flags = jax.tree.map(lambda _: P(), state.nonfinite_subtrees)
      specs = specs._replace(nonfinite_subtrees=flags)
      step = jax.jit(jax.shard_map(lambda g, s, p: tx.update(g, s, p), mesh=mesh,
          in_specs=(P("d"), specs, P("d")), out_specs=(P("d"), specs)))
      updates, state = step(jnp.full(8, 4.0), state, params)
      before = np.asarray(state.inner_state[0].trace)
      bad = jnp.full(8, 4.0).at[5].set(jnp.inf)  # on the third device only
      updates, state = step(bad, state, params)
      assert np.all(np.asarray(updates) == 0), updates
      assert np.array_equal(np.asarray(state.inner_state[0].trace), before)
      assert float(state.scale) == 2.0 and int(state.skipped_steps) == 1
      print("OK")
  """)
    run_fresh_python(script, devices=4, timeout=120)


# --------------------------------------------------------------------------
# Checkpointing.


def _trajectory_tx(accumulation_steps):
    return grad_scaler(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.inject_hyperparams(optax.adam)(
                learning_rate=optax.cosine_decay_schedule(1e-2, 20)
            ),
        ),
        init_scale=2.0**5,
        growth_factor=1.1,
        backoff_factor=0.9,
        growth_interval=2,
        accumulation_steps=accumulation_steps,
        accumulation="mean",
    )


def _run(tx, params, state, grads_seq):
    update = jax.jit(tx.update)
    for grads in grads_seq:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _grads_seq(n, seed=5):
    rng = np.random.default_rng(seed)
    seq = []
    for i in range(n):
        g = {
            "w": jnp.asarray(rng.normal(size=(2, 3)) * 32, jnp.float32),
            "h": jnp.asarray(rng.normal(size=3) * 32, jnp.float16),
        }
        if i % 4 == 2:
            g["w"] = g["w"].at[0, 0].set(jnp.inf)
        seq.append(g)
    return seq


def _params():
    # float32 parameters with float16 gradients for "h" (as under autocast).
    return {"w": jnp.ones((2, 3)), "h": jnp.ones(3)}


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_flax_serialization_round_trip_resumes_identically(accumulation_steps):
    tx = _trajectory_tx(accumulation_steps)
    seq = _grads_seq(13)
    params0 = _params()
    full_params, full_state = _run(tx, params0, tx.init(params0), seq)

    params, state = _run(tx, params0, tx.init(params0), seq[:7])
    blob = serialization.to_bytes({"params": params, "opt_state": state})
    target = {"params": _params(), "opt_state": tx.init(params0)}
    restored = serialization.from_bytes(target, blob)
    assert isinstance(restored["opt_state"], GradScalerState)
    chex.assert_trees_all_equal(restored["opt_state"], state)
    params, state = _run(tx, restored["params"], restored["opt_state"], seq[7:])
    chex.assert_trees_all_equal(params, full_params)
    chex.assert_trees_all_equal(state, full_state)
    assert int(full_state.skipped_steps) > 0
    # The state dict names its fields, for readable checkpoints.
    state_dict = serialization.to_state_dict(state)
    assert {"scale", "growth_tracker", "skipped_steps", "inner_state"} <= set(state_dict)


@pytest.mark.parametrize("accumulation_steps", [1, 3])
def test_orbax_round_trip_resumes_identically(tmp_path, accumulation_steps):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = _trajectory_tx(accumulation_steps)
    seq = _grads_seq(11)
    params0 = _params()
    full_params, full_state = _run(tx, params0, tx.init(params0), seq)

    params, state = _run(tx, params0, tx.init(params0), seq[:5])
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(
            ocp.utils.to_shape_dtype_struct, {"params": params0, "opt_state": tx.init(params0)}
        )
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert isinstance(restored["opt_state"], GradScalerState)
    chex.assert_trees_all_equal(restored["opt_state"], state)
    params, state = _run(tx, restored["params"], restored["opt_state"], seq[5:])
    chex.assert_trees_all_equal(params, full_params)
    chex.assert_trees_all_equal(state, full_state)


@pytest.mark.parametrize("params", [{}, {"step": jnp.int32(3)}], ids=["empty", "integer"])
def test_orbax_saves_the_state_of_parameters_without_a_floating_leaf(tmp_path, params):
    # No subtree to flag: no zero-size array, which orbax refuses to save.
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = grad_scaler(optax.sgd(1e-3))
    _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt", tx.init(params))
    chex.assert_trees_all_equal(restored, state)
    assert dict(restored.nonfinite_subtrees) == {}


def test_user_guide_examples_run(tmp_path, monkeypatch):
    """docs/loss_scaling.md: every python block runs, in order, as printed."""
    monkeypatch.chdir(tmp_path)  # the checkpointing block writes under the cwd
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "loss_scaling.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 5
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:  # only the checkpointing block needs it
        blocks = [b for b in blocks if "orbax" not in b]
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"loss_scaling.md block {i}", "exec"), namespace)
        if i == 0:  # the lead example: two float16 overflows, then a step
            stats = namespace["stats"]
            assert (float(stats["scale"]), int(stats["skipped_steps"])) == (16384.0, 2)
    assert int(namespace["state"].inner_opt_state.skipped_steps) == 3  # MultiSteps
    assert np.isnan(namespace["state"].acc_grads[0])
