"""The loss scaler's rule, skipping and validation (mpjax/scaler.py).

Scale and tracker are compared, step by step and bit for bit, with a pure
Python transcription of torch's ``_amp_update_scale_`` (multiply in double,
round to float32 with numpy), plus mpjax's floor at ``min_scale``.
"""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from jax import lax

import mpjax
from mpjax._float32 import _mul_f32_by_f64
from mpjax.scaler import (
    GradScalerState,
    get_scale,
    grad_scaler,
    noop_scaler,
    scaled_value_and_grad,
    scaler_stats,
    set_scale,
    static_scaler,
)

OK, INF, NEG_INF, NAN = 0, 1, 2, 3
EVENT_VALUE = {OK: 1.0, INF: np.inf, NEG_INF: -np.inf, NAN: np.nan}
F32_MAX = float(np.finfo(np.float32).max)
DEFAULT_MIN_SCALE = 2.0**-14  # the documented default floor


# --------------------------------------------------------------------------
# The reference: torch's rule in plain Python.


def torch_update(
    scale, tracker, found_inf, *, growth_factor, backoff_factor, growth_interval, min_scale=None
):
    """torch._amp_update_scale_ (amp-semantics.md), plus mpjax's floor."""
    scale = np.float32(scale)
    if found_inf:
        new = np.float32(np.float64(scale) * backoff_factor)
        if min_scale is not None:
            new = max(new, np.float32(min_scale))
        return new, 0
    successful = tracker + 1
    if successful == growth_interval:
        with np.errstate(over="ignore"):
            grown = np.float32(np.float64(scale) * growth_factor)
        return (grown if np.isfinite(grown) else scale), 0
    return scale, successful


def torch_trajectory(events, init_scale, tracker=0, **rule):
    out, scale = [], np.float32(init_scale)
    for event in events:
        scale, tracker = torch_update(scale, tracker, event != OK, **rule)
        out.append((scale, tracker))
    return out


def grads_for(events, width=4):
    grads = np.ones((len(events), width), np.float32)
    grads[:, 1] = [EVENT_VALUE[e] for e in events]
    return jnp.asarray(grads)


@functools.lru_cache(maxsize=None)
def runner(**kwargs):
    """A jitted scan of `grad_scaler(optax.sgd(0.5), **kwargs).update`."""
    tx = grad_scaler(optax.sgd(0.5), **kwargs)

    @jax.jit
    def run(state, params, grads_seq):
        def body(carry, g):
            state, params = carry
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
            return (state, params), (state.scale, state.growth_tracker, state.last_step_skipped)

        return lax.scan(body, (state, params), grads_seq)

    return tx, run


def run_events(events, *, state=None, **kwargs):
    tx, run = runner(**kwargs)
    params = jnp.zeros(4)
    state = tx.init(params) if state is None else state
    (state, params), (scales, trackers, skipped) = run(state, params, grads_for(events))
    return state, params, np.asarray(scales), np.asarray(trackers), np.asarray(skipped)


def assert_matches_torch(events, scales, trackers, init_scale, tracker=0, **rule):
    expected = torch_trajectory(events, init_scale, tracker, **rule)
    for i, ((want_scale, want_tracker), scale, tracker_) in enumerate(
        zip(expected, scales, trackers)
    ):
        # Bit pattern comparison: exact, and NaN-proof.
        assert np.float32(scale).view(np.uint32) == np.float32(want_scale).view(np.uint32), (
            f"step {i} (event {events[i]}): scale {scale!r} != torch {want_scale!r}"
        )
        assert tracker_ == want_tracker, f"step {i}: tracker {tracker_} != torch {want_tracker}"


DEFAULT_RULE = dict(
    growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, min_scale=DEFAULT_MIN_SCALE
)


# --------------------------------------------------------------------------
# The scale update rule.


def test_defaults_mixed_sequence():
    events = [OK, OK, INF, OK, NAN, NEG_INF, OK, OK, NAN, OK]
    state, _, scales, trackers, skipped = run_events(events)
    assert_matches_torch(events, scales, trackers, 2.0**16, **DEFAULT_RULE)
    np.testing.assert_array_equal(skipped, [e != OK for e in events])
    assert int(state.skipped_steps) == 4
    assert scales[-1] == 2.0**12 and trackers[-1] == 1


def test_growth_on_the_2000th_finite_step():
    events = [OK] * 2001
    _, _, scales, trackers, _ = run_events(events)
    assert_matches_torch(events, scales, trackers, 2.0**16, **DEFAULT_RULE)
    assert scales[1998] == 2.0**16 and trackers[1998] == 1999
    assert scales[1999] == 2.0**17 and trackers[1999] == 0  # the 2000th step
    assert scales[2000] == 2.0**17 and trackers[2000] == 1


@pytest.mark.parametrize("interval", [1, 3])
def test_growth_interval(interval):
    events = [OK, OK, OK, OK, INF, OK, OK, NAN, OK, OK, OK, OK, OK, NEG_INF, OK]
    rule = dict(DEFAULT_RULE, growth_interval=interval)
    _, _, scales, trackers, _ = run_events(events, growth_interval=interval)
    assert_matches_torch(events, scales, trackers, 2.0**16, **rule)
    if interval == 1:
        assert scales[0] == 2.0**17 and trackers[0] == 0
    else:
        assert scales[1] == 2.0**16 and scales[2] == 2.0**17


def test_repeated_overflows_go_below_one_down_to_the_floor():
    events = [INF, NAN, NEG_INF] * 12  # 36 overflows from 2**16
    _, params, scales, trackers, _ = run_events(events)
    # torch's own values above the floor: 2**16 * 0.5**n after n overflows.
    unfloored = torch_trajectory(
        events, 2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    )
    np.testing.assert_array_equal(scales[:30], [s for s, _ in unfloored[:30]])
    assert scales[15] == 1.0 and scales[16] == 0.5
    assert_matches_torch(events, scales, trackers, 2.0**16, **DEFAULT_RULE)
    assert scales[29] == DEFAULT_MIN_SCALE == 2.0**-14
    np.testing.assert_array_equal(scales[29:], DEFAULT_MIN_SCALE)
    chex.assert_trees_all_equal(params, jnp.zeros(4))


def test_growth_refused_at_float32_maximum():
    init = float(np.float32(3e38))
    events = [OK, OK, OK, INF, OK, OK]
    for factor, backoff in [(2.0, 0.5), (1.1, 0.9)]:
        state = runner(growth_factor=factor, backoff_factor=backoff, growth_interval=1)[0].init(
            jnp.zeros(4)
        )
        state = set_scale(state, init)
        _, _, scales, trackers, _ = run_events(
            events, state=state, growth_factor=factor, backoff_factor=backoff, growth_interval=1
        )
        assert_matches_torch(
            events,
            scales,
            trackers,
            init,
            growth_factor=factor,
            backoff_factor=backoff,
            growth_interval=1,
        )
        assert np.all(np.isfinite(scales)) and np.all(trackers == 0)
        if factor == 2.0:  # refused at once: the scale stays put
            assert scales[0] == init and scales[2] == init
        else:  # 1.1: one growth fits below the maximum, the next is refused
            assert init < scales[0] == scales[1] <= F32_MAX


@pytest.mark.parametrize("factors", [(3.0, 0.25), (1.1, 0.9)])
def test_non_power_of_two_factors_bit_exact(factors):
    growth, backoff = factors
    events = ([OK] * 9 + [INF]) * 3 + [OK] * 20 + [NAN, NEG_INF] * 3 + [OK] * 15
    kwargs = dict(growth_factor=growth, backoff_factor=backoff, growth_interval=2)
    _, _, scales, trackers, _ = run_events(events, **kwargs)
    assert_matches_torch(events, scales, trackers, 2.0**16, min_scale=DEFAULT_MIN_SCALE, **kwargs)
    if factors == (1.1, 0.9):
        # The sequence does go through values where one float32 multiply would
        # differ from torch's double multiply: the test can tell them apart.
        previous = np.concatenate([[np.float32(2.0**16)], scales[:-1]])
        differ = sum(
            np.float32(s) * np.float32(f) != np.float32(np.float64(s) * f)
            for s in previous
            for f in (growth, backoff)
        )
        assert differ > 0


@pytest.mark.parametrize("factors", [(2.0, 0.5), (3.0, 0.25), (1.1, 0.9)])
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    events=st.lists(st.sampled_from([OK, OK, OK, OK, INF, NEG_INF, NAN]), min_size=40, max_size=40),
    init=st.one_of(st.sampled_from([2.0**16, 1.0, 3e38, 2.0**-13, 7.0]), st.floats(1e-3, 1e30)),
    tracker=st.integers(0, 2),
)
def test_random_sequences_match_torch(factors, events, init, tracker):
    growth, backoff = factors
    kwargs = dict(growth_factor=growth, backoff_factor=backoff, growth_interval=3)
    tx, _ = runner(**kwargs)
    state = set_scale(tx.init(jnp.zeros(4)), init)
    state = state._replace(growth_tracker=jnp.int32(tracker))
    _, _, scales, trackers, _ = run_events(events, state=state, **kwargs)
    assert_matches_torch(
        events, scales, trackers, np.float32(init), tracker, min_scale=DEFAULT_MIN_SCALE, **kwargs
    )


def test_set_scale_mid_run_keeps_tracker():
    events = [OK, OK, OK, INF, OK, OK]
    state, _, scales, trackers, _ = run_events(events, growth_interval=3)
    assert int(state.growth_tracker) == 2
    state = set_scale(state, 1000.0)  # not a power of two: any float32 is allowed
    assert float(get_scale(state)) == 1000.0 and int(state.growth_tracker) == 2
    more = [OK, OK, INF, OK]
    _, _, scales2, trackers2, _ = run_events(more, state=state, growth_interval=3)
    rule = dict(DEFAULT_RULE, growth_interval=3)
    assert_matches_torch(more, scales2, trackers2, 1000.0, tracker=2, **rule)
    assert scales2[0] == 2000.0  # tracker 2 + 1 == interval: grows at once


def test_mul_f32_by_f64_matches_double_then_float32():
    rng = np.random.default_rng(0)
    # Normal positive float32 values over the whole exponent range, plus
    # significands where rounding twice differs from rounding once.
    bits = rng.integers(0x00800000, 0x7F800000, size=20_000, dtype=np.uint32)
    double_rounding = np.array([8388615, 8388635, 9320685, 9320705], np.float32) * 2.0**-23
    xs = np.concatenate(
        [
            bits.view(np.float32),
            double_rounding,
            np.float32([F32_MAX, 3e38, 2.0**-126, 1.0, 2.0**16]),
        ]
    )
    for factor in [1.1, 0.9, 3.0, 0.25, 1 / 3, 1.0001, 7.3e10, 1e-30]:
        got = np.asarray(jax.jit(jax.vmap(lambda x: _mul_f32_by_f64(x, factor)))(xs))
        with np.errstate(over="ignore"):
            want = (xs.astype(np.float64) * factor).astype(np.float32)
        want[want < np.finfo(np.float32).tiny] = 0  # documented: flushed, then floored
        np.testing.assert_array_equal(
            got.view(np.uint32), want.view(np.uint32), err_msg=f"factor {factor}"
        )
    # Those significands (found by exhaustive search) are where rounding the
    # exact product once to float32 differs from torch's double-then-float32.
    for x, factor in zip(double_rounding, [1.1, 1.1, 0.9, 0.9]):
        assert round_product_once(x, factor) != np.float32(np.float64(x) * factor)


def round_product_once(x, factor):
    """The exact product x * factor rounded once, to nearest even, to float32."""
    mx, ex = np.frexp(np.float64(x))
    mf, ef = np.frexp(factor)
    product = int(mx * 2**53) * int(mf * 2**53)  # exact
    drop = product.bit_length() - 24
    kept, rest = product >> drop, product & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    kept += rest > half or (rest == half and kept & 1)
    return np.float32(np.ldexp(np.float64(kept), drop + int(ex) + int(ef) - 106))


def test_reciprocal_matches_torch_double_reciprocal():
    rng = np.random.default_rng(1)
    bits = rng.integers(0x00800000, 0x7E800000, size=50_000, dtype=np.uint32)
    xs = bits.view(np.float32)
    got = np.asarray(jax.jit(lambda s: 1.0 / s)(xs))
    want = (1.0 / xs.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# --------------------------------------------------------------------------
# Skipped steps.


def _schedule_adam():
    schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=10)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adam)(learning_rate=schedule),
    )


@functools.lru_cache(maxsize=None)
def _scaled_schedule_adam():
    tx = grad_scaler(_schedule_adam(), init_scale=2.0**8)
    return tx, jax.jit(tx.update)  # compiled once for all the cases below


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_skipped_step_leaves_params_and_inner_state_bit_identical(bad):
    tx, update = _scaled_schedule_adam()
    params = {
        "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3),
        "h": jnp.arange(3, dtype=jnp.bfloat16),
    }
    state = tx.init(params)
    rng = np.random.default_rng(2)
    for _ in range(3):  # non-trivial moments, counts and learning rate first
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 256, p.dtype), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert int(state.inner_state[1].count) == 3
    finite_updates = updates

    grads = jax.tree.map(lambda p: jnp.ones(p.shape, p.dtype), params)
    grads["w"] = grads["w"].at[1, 2].set(bad)
    updates, new_state = update(grads, state, params)
    new_params = optax.apply_updates(params, updates)

    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    # Zeros of the inner's own update dtypes (adam's bfloat16 leaf updates are float32).
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, finite_updates))
    assert float(new_state.scale) == 2.0**7 and int(new_state.growth_tracker) == 0
    assert bool(new_state.last_step_skipped) and int(new_state.skipped_steps) == 1
    # The next finite step goes through.
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, p.dtype), params)
    updates, after = update(grads, new_state, params)
    assert not bool(after.last_step_skipped) and int(after.inner_state[1].count) == 4
    expected, _ = _schedule_adam().update(
        jax.tree.map(lambda p: jnp.ones(p.shape, p.dtype), params), state.inner_state, params
    )
    chex.assert_trees_all_close(updates["w"], expected["w"], rtol=1e-6)
    chex.assert_trees_all_close(updates["h"], expected["h"], rtol=2**-7)  # bfloat16 moments


@pytest.mark.parametrize(
    "kwargs, skipped",
    [
        ({}, (2, 3)),
        ({"check_updates": True}, (2, 3)),
        # Steps 2 and 3 are one effective batch: the step at its last micro-batch is
        # skipped.
        ({"accumulation_steps": 2, "accumulation": "mean"}, (3,)),
    ],
    ids=["default", "check_updates", "accumulation"],
)
def test_a_donated_step_skips_and_steps_as_an_undonated_one(kwargs, skipped):
    """A training step jitted with its parameters and state donated, as it should
    be: XLA writes the new state over the old. A skipped step must still leave
    every bit, and a kept one be the undonated step's, bit for bit."""
    tx = grad_scaler(optax.adam(1e-2), init_scale=2.0**8, **kwargs)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    donated = jax.jit(step, donate_argnums=(0, 1))
    plain = jax.jit(step)
    params = {  # a leaf checked on its own (2**14 elements or more) and stacked ones
        "big": jax.random.normal(jax.random.key(0), (128, 160)),
        "w": jax.random.normal(jax.random.key(1), (4, 3)),
        "b": jnp.zeros(3),
    }
    state = tx.init(params)
    rng = np.random.default_rng(0)
    for i in range(6):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        if i in (2, 3):  # an overflow, in the large leaf and then in a stacked one
            leaf = "big" if i == 2 else "w"
            grads[leaf] = grads[leaf].at[1, 2].set(np.inf if i == 2 else np.nan)
        # Copies: a zero-copy view of a buffer (jax.device_get on a CPU) keeps
        # jit from donating it.
        before = jax.tree.map(lambda x: np.array(x, copy=True), (params, state))
        expected = jax.device_get(plain(params, state, grads))
        old = params
        params, state = donated(params, state, grads)
        assert old["big"].is_deleted()  # donated: written over, not copied
        chex.assert_trees_all_equal(jax.device_get((params, state)), expected)
        if i in skipped:
            assert bool(state.last_step_skipped)
            chex.assert_trees_all_equal(jax.device_get(params), before[0])
            chex.assert_trees_all_equal(
                jax.device_get(state.inner_state), before[1].inner_state
            )
    assert int(state.skipped_steps) == len(skipped)


def test_a_skipped_step_keeps_every_bit_of_the_parameters_negative_zeros_included():
    tx = grad_scaler(optax.adam(1e-3))
    params = {"w": jnp.array([-0.0, 0.0, -1.5], jnp.float32), "h": jnp.array([-0.0], jnp.bfloat16)}
    grads = {"w": jnp.array([1.0, jnp.inf, 2.0]), "h": jnp.ones(1, jnp.bfloat16)}
    for update in (tx.update, jax.jit(tx.update)):
        updates, state = update(grads, tx.init(params), params)
        assert bool(state.last_step_skipped)
        new = optax.apply_updates(params, updates)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
            bits = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
            np.testing.assert_array_equal(np.asarray(a).view(bits), np.asarray(b).view(bits))


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adam(1e-3),
        lambda: optax.adamw(1e-3, weight_decay=0.1),
        lambda: optax.lamb(1e-3),
        lambda: optax.rmsprop(1e-3),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    ],
    ids=["adam", "adamw", "lamb", "rmsprop", "clip+adam"],
)
def test_finite_steps_are_the_bare_optimizers_bit_for_bit_under_jit(make):
    # With nothing to skip the scaler is invisible: not a few ulps off.
    params = {
        "a": jax.random.normal(jax.random.key(0), (64, 33)),
        "b": jax.random.normal(jax.random.key(1), (20000,)),
    }
    bare, scaled = make(), grad_scaler(make())
    bare_state, scaled_state = bare.init(params), scaled.init(params)
    bare_update, scaled_update = jax.jit(bare.update), jax.jit(scaled.update)
    p_bare = p_scaled = params
    for i in range(4):
        grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), p_bare)
        u_bare, bare_state = bare_update(grads, bare_state, p_bare)
        u_scaled, scaled_state = scaled_update(grads, scaled_state, p_scaled)
        p_bare = optax.apply_updates(p_bare, u_bare)
        p_scaled = optax.apply_updates(p_scaled, u_scaled)
    chex.assert_trees_all_equal(p_scaled, p_bare)
    chex.assert_trees_all_equal(scaled_state.inner_state, bare_state)


def test_unscaling_keeps_each_leaf_dtype():
    # The gradients of float16 inputs (an activation, a bfloat16 parameter) are
    # unscaled in float32 and cast back.
    state = grad_scaler(optax.identity(), init_scale=2.0**10).init(jnp.zeros(3))
    inputs = {
        "f32": jnp.full(3, 2.0, jnp.float32),
        "f16": jnp.full(3, 2.0, jnp.float16),
        "bf16": jnp.full(3, 2.0, jnp.bfloat16),
    }
    loss = lambda t: sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in t.values())
    _, grads = jax.jit(lambda s, x: scaled_value_and_grad(loss, s)(x))(state, inputs)
    chex.assert_trees_all_equal_dtypes(grads, inputs)
    chex.assert_trees_all_equal(grads, jax.tree.map(lambda x: 2 * x, inputs))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("loss_dtype", [jnp.bfloat16, jnp.float32])
def test_a_bfloat16_step_under_strict_dtype_promotion(loss_dtype, jit):
    # bfloat16 parameters and loss, all the user's dtypes agreeing: "strict" accepts
    # the program, and the scaler's own float32 arithmetic must not trip it.
    params = {"w": jnp.full((8, 4), 0.1, jnp.bfloat16), "v": jnp.full((4, 2), 0.5, jnp.bfloat16)}
    x = jnp.ones((2, 8), jnp.bfloat16)

    def loss_fn(p, x):
        return jnp.mean(x @ p["w"] @ p["v"], dtype=jnp.float32).astype(loss_dtype)

    tx = grad_scaler(optax.sgd(0.1), init_scale=2.0**10)

    def step(params, state, x):
        loss, grads = scaled_value_and_grad(loss_fn, state)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    step = jax.jit(step) if jit else step
    expected = step(params, tx.init(params), x)
    with jax.numpy_dtype_promotion("strict"):
        got = step(params, tx.init(params), x)
    chex.assert_trees_all_equal(got, expected)
    assert not bool(got[1].last_step_skipped)


@pytest.mark.parametrize("flag", ["debug_nans", "debug_infs"])
def test_eager_debug_checks_skip_the_scalers_overflow_and_report_the_models(flag):
    # At 2**24 the float16 backward pass overflows: inf, and NaN where an inf meets
    # an input's zeros. That is the scaler's probing; the step is skipped. An inf or
    # NaN the model makes at any scale is still reported, at the model's line.
    def loss_fn(p, x, fault):
        y = mpjax.autocast(lambda p, x: x @ p["w"])(p, x).astype(jnp.float32)
        return jnp.sum(y**2) + (jnp.sum(jnp.log(p["b"] - 1.0)) if fault else 0.0)

    params = {"w": jnp.full((8, 4), 0.5), "b": jnp.zeros(4)}
    x = jnp.full((2, 8), 100.0).at[:, 0].set(0.0)
    tx = grad_scaler(optax.sgd(0.1), init_scale=2.0**24)
    state = tx.init(params)
    with getattr(jax, flag)(True):
        _, grads = scaled_value_and_grad(loss_fn, state)(params, x, False)
        updates, new_state = tx.update(grads, state, params)
        with pytest.raises(FloatingPointError, match=r"(nan|inf)\) encountered in log"):
            params["b"] = params["b"] + (1.0 if flag == "debug_infs" else 0.0)  # log(0): -inf
            scaled_value_and_grad(loss_fn, state)(params, x, True)
    assert bool(new_state.last_step_skipped) and float(new_state.scale) == 2.0**23
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))


def test_scale_below_one_overflowing_on_unscaling_is_skipped():
    # A finite float16 gradient that overflows once divided by a scale < 1: torch
    # (which checks the scaled values) would apply inf; the scaler skips.
    tx = grad_scaler(optax.sgd(1.0), init_scale=2.0**-4)
    x = jnp.array([60000.0, 1.0], jnp.float16)
    state = tx.init(jnp.zeros(2))
    # The true gradient, 16 * 60000, is beyond float16; scaled by 2**-4 it is not.
    loss = lambda x: 16.0 * jnp.sum(x.astype(jnp.float32) ** 2) / 2
    _, grads = scaled_value_and_grad(loss, state)(x)
    assert not np.isfinite(np.asarray(grads)).all()  # overflowed once unscaled
    updates, state = jax.jit(tx.update)(grads.astype(jnp.float32), state)
    chex.assert_trees_all_equal(updates, jnp.zeros(2))
    assert bool(state.last_step_skipped)


def test_thousands_of_overflows_never_reach_zero():
    events = [INF, NAN, NEG_INF, INF] * 1250
    for min_scale in [DEFAULT_MIN_SCALE, 2.0**-126]:
        state, params, scales, _, skipped = run_events(
            events, backoff_factor=0.5, min_scale=min_scale
        )
        assert np.all(scales > 0) and np.all(np.isfinite(scales))
        assert scales[-1] == np.float32(min_scale)
        assert skipped.all() and int(state.skipped_steps) == 5000
        chex.assert_trees_all_equal(params, jnp.zeros(4))
        # Recovery: a finite step afterwards is applied, with finite parameters.
        _, params, _, _, skipped = run_events([OK], state=state, min_scale=min_scale)
        assert not skipped[0] and bool(jnp.all(jnp.isfinite(params)))
        assert bool(jnp.all(params != 0))


# --------------------------------------------------------------------------
# Training gives the same parameters as without scaling.


def test_linear_model_same_as_unscaled_sgd():
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(7, 8, 3)).astype(np.float32)
    ys = rng.normal(size=(7, 8)).astype(np.float32)
    xs[2, 4, 1] = np.inf  # batches 2 and 5 overflow: skipped steps
    xs[5, 0, 0] = np.nan

    def loss_fn(params, x, y):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    def make_step(tx):
        @jax.jit
        def step(params, state, x, y):
            _, grads = scaled_value_and_grad(loss_fn, state)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return step

    @jax.jit
    def plain_step(params, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        sgd = optax.sgd(0.1)
        updates, _ = sgd.update(grads, sgd.init(params), params)
        return optax.apply_updates(params, updates)

    init = {"w": jnp.array([0.5, -0.25, 1.0], jnp.float32), "b": jnp.array(0.1, jnp.float32)}
    tx = grad_scaler(optax.sgd(0.1), init_scale=2.0**10, growth_interval=2)
    unit = static_scaler(optax.sgd(0.1), 1.0)  # the same program, unscaled
    scaled_step, unit_step = make_step(tx), make_step(unit)
    params, state = init, tx.init(init)
    unit_params, unit_state = init, unit.init(init)
    plain, scales = init, []
    for i in range(7):
        params, state = scaled_step(params, state, xs[i], ys[i])
        scales.append(float(state.scale))
        if i not in (2, 5):  # the references never see the overflowing batches
            unit_params, unit_state = unit_step(unit_params, unit_state, xs[i], ys[i])
            plain = plain_step(plain, xs[i], ys[i])
        # Multiplying and dividing by a power of two commutes with every rounding,
        # so against the same program at scale 1 equality is exact (tolerance 0).
        chex.assert_trees_all_equal(params, unit_params)
        # A program without any scaler compiles to other fusions that may sum in
        # another order: equal to within about one float32 ulp of 1 (the size of
        # the parameters; `b` passes near 0, where a relative bound means nothing).
        chex.assert_trees_all_close(params, plain, rtol=1e-6, atol=1e-7)
    assert int(state.skipped_steps) == 2 and int(unit_state.skipped_steps) == 0
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10]


# --------------------------------------------------------------------------
# enabled=False and the static scaler.


def test_enabled_false_is_a_no_op():
    for tx in [grad_scaler(optax.sgd(1.0), enabled=False), noop_scaler(optax.sgd(1.0))]:
        params = jnp.zeros(3)
        state = tx.init(params)
        assert float(get_scale(state)) == 1.0
        chex.assert_trees_all_equal_structs(state, grad_scaler(optax.sgd(1.0)).init(params))
        update = jax.jit(tx.update)
        updates, state = update(jnp.array([1.0, 2.0, 3.0]), state, params)
        chex.assert_trees_all_equal(updates, jnp.array([-1.0, -2.0, -3.0]))
        updates, state = update(jnp.array([1.0, jnp.inf, 3.0]), state, params)
        chex.assert_trees_all_equal(updates, jnp.array([-1.0, -jnp.inf, -3.0]))
        stats = scaler_stats(state)
        assert float(stats["scale"]) == 1.0 and int(stats["skipped_steps"]) == 0
        assert not bool(stats["last_step_skipped"])
        assert int(stats["growth_tracker"]) == -1  # a disabled scaler counts no steps


@pytest.mark.parametrize("scaling_on", [True, False])
def test_a_checkpoint_restored_with_scaling_switched_takes_the_new_setting(scaling_on):
    """Saved with scaling off and restored with it on, the scale starts from
    init_scale (not the disabled scaler's 1.0, which would let float16 gradients
    underflow for 16 growth intervals); the other way round, it becomes 1.0."""
    params = {"w": jnp.ones(3)}
    on = grad_scaler(optax.sgd(0.1), init_scale=2.0**12, growth_interval=2)
    off = noop_scaler(optax.sgd(0.1))
    saved, restored_into = (off, on) if scaling_on else (on, off)
    blob = serialization.to_bytes(saved.init(params))
    state = serialization.from_bytes(restored_into.init(params), blob)
    grads = {"w": jnp.full(3, 0.5)}
    updates, state = jax.jit(restored_into.update)(grads, state, params)
    chex.assert_trees_all_close(updates, {"w": jnp.full(3, -0.05)})
    if scaling_on:
        assert float(get_scale(state)) == 2.0**12 and int(state.growth_tracker) == 1
        # and it is a working dynamic scaler from there: a skip backs it off
        _, state = jax.jit(on.update)({"w": jnp.full(3, jnp.inf)}, state, params)
        assert float(get_scale(state)) == 2.0**11 and bool(state.last_step_skipped)
    else:
        assert float(get_scale(state)) == 1.0 and int(state.growth_tracker) == -1
        # a state written by the disabled scaler restores into it unchanged
        again = serialization.from_bytes(off.init(params), serialization.to_bytes(state))
        chex.assert_trees_all_equal(jax.jit(off.update)(grads, again, params)[1], state)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_skipped_step_restored_with_scaling_off_is_not_reported_again(accumulation_steps):
    # The enabled scaler's last step was skipped; the disabled one applies every
    # step, and says so from its first effective step: a count of optimizer steps
    # kept with `step_applied` (a schedule outside the optimizer) goes on.
    params = {"w": jnp.ones(3), "b": jnp.ones(2)}
    kw = {} if accumulation_steps == 1 else {"accumulation_steps": 2, "accumulation": "mean"}
    on, off = grad_scaler(optax.sgd(0.1), **kw), noop_scaler(optax.sgd(0.1), **kw)
    state = on.init(params)
    for _ in range(accumulation_steps):
        _, state = on.update({"w": jnp.full(3, jnp.inf), "b": jnp.ones(2)}, state, params)
    assert bool(state.last_step_skipped) and bool(state.nonfinite_subtrees["['w']"])
    grads = {"w": jnp.full(3, 0.5), "b": jnp.ones(2)}
    for step in range(2 * accumulation_steps):
        _, state = jax.jit(off.update)(grads, state, params)
        stats = scaler_stats(state)
        effective = (step + 1) % accumulation_steps == 0
        assert bool(stats["step_applied"]) == effective
        assert bool(stats["last_step_skipped"]) == (step < accumulation_steps - 1)
        assert any(map(bool, stats["nonfinite_subtrees"].values())) == (
            step < accumulation_steps - 1
        )


def test_static_scaler_never_moves_but_still_skips():
    tx = static_scaler(optax.sgd(1.0), 2.0**5)
    update = jax.jit(tx.update)
    params = jnp.zeros(2)
    state = tx.init(params)
    for g in [[32.0, 64.0], [jnp.inf, 1.0], [32.0, 32.0], [jnp.nan, 1.0]]:
        updates, new_state = update(jnp.array(g), state, params)
        if np.all(np.isfinite(g)):
            chex.assert_trees_all_equal(updates, -jnp.array(g))
        else:
            chex.assert_trees_all_equal(updates, jnp.zeros(2))
        state = new_state
        assert float(state.scale) == 32.0 and int(state.growth_tracker) == -2  # counts none
    assert int(state.skipped_steps) == 2
    assert isinstance(state, GradScalerState)


# --------------------------------------------------------------------------
# Constructor validation.


@pytest.mark.parametrize(
    "name, value",
    [
        ("growth_factor", 1.0),
        ("growth_factor", 0.5),
        ("growth_factor", float("inf")),
        ("growth_factor", float("nan")),
        ("growth_factor", "2"),
        ("growth_factor", True),
        ("backoff_factor", 0.0),
        ("backoff_factor", 1.0),
        ("backoff_factor", 1.5),
        ("backoff_factor", -0.5),
        ("backoff_factor", float("nan")),
        ("growth_interval", 0),
        ("growth_interval", -3),
        ("growth_interval", 2.5),
        ("growth_interval", 2000.0),
        ("growth_interval", True),
        ("growth_interval", 2**31),
        ("init_scale", 0.0),
        ("init_scale", -1.0),
        ("init_scale", float("inf")),
        ("init_scale", float("nan")),
        ("init_scale", 1e39),
        ("init_scale", None),
        ("min_scale", 0.0),
        ("min_scale", 1e-40),
        ("min_scale", float("inf")),
        ("min_scale", float("nan")),
        ("min_scale", -1.0),
        ("accumulation_steps", 0),
        ("accumulation_steps", 1.5),
        ("accumulation_steps", False),
    ],
)
def test_bad_constructor_argument_is_named(name, value):
    with pytest.raises(ValueError, match=name) as info:
        grad_scaler(optax.sgd(0.1), **{name: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_min_scale_above_init_scale_is_refused():
    with pytest.raises(ValueError, match="init_scale=1.0 is below min_scale=2.0"):
        grad_scaler(optax.sgd(0.1), init_scale=1.0, min_scale=2.0)


def test_numpy_numbers_are_accepted():
    tx = grad_scaler(
        optax.sgd(0.1),
        init_scale=np.float32(1024),
        growth_interval=np.int64(5),
        growth_factor=np.float64(2.0),
    )
    assert float(get_scale(tx.init(jnp.zeros(1)))) == 1024.0


@pytest.mark.parametrize("scale", [0.0, -2.0, float("inf"), 1e39, 1e-40])
def test_static_scaler_bad_scale(scale):
    with pytest.raises(ValueError, match="scale"):
        static_scaler(optax.sgd(0.1), scale)


def test_noop_scaler_bad_accumulation_steps():
    with pytest.raises(ValueError, match="accumulation_steps"):
        noop_scaler(optax.sgd(0.1), accumulation_steps=0)


def test_scaler_stats_say_which_subtrees_were_not_finite():
    params = {
        "params": {
            "Embed_0": {"embedding": jnp.ones((4, 2))},
            "Block_0": {"Dense_0": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}},
            "Block_1": {"Dense_0": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}},
        }
    }
    tx = grad_scaler(optax.adam(1e-3))
    update = jax.jit(tx.update)
    state = tx.init(params)
    names = ["['params']['Block_0']", "['params']['Block_1']", "['params']['Embed_0']"]
    assert sorted(scaler_stats(state)["nonfinite_subtrees"]) == names
    grads = jax.tree.map(jnp.ones_like, params)
    grads["params"]["Block_1"]["Dense_0"]["bias"] = jnp.array([1.0, jnp.nan])
    _, state = update(grads, state, params)
    flags = {k: bool(v) for k, v in scaler_stats(state)["nonfinite_subtrees"].items()}
    assert bool(state.last_step_skipped)
    assert flags == {names[0]: False, names[1]: True, names[2]: False}
    _, state = update(jax.tree.map(jnp.ones_like, params), state, params)
    assert not any(bool(v) for v in scaler_stats(state)["nonfinite_subtrees"].values())
