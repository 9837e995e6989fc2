"""Fault injection in real training loops.

The loop: a float32 MLP, its loss under ``mpjax.autocast`` (float16 matmuls),
``scaled_value_and_grad``, and
``grad_scaler(chain(clip_by_global_norm(1.0), inject_hyperparams(adam)(schedule)))``
with ``growth_interval=4``, ``init_scale=2**10`` and the default floor
``min_scale=2**-14``. A whole fault program (hundreds of steps) runs inside one
jitted ``lax.scan``; faults come in as step inputs: a multiplier of the loss, a
value added to one element of the batch, and a factor on one parameter's
cotangent (a ``custom_vjp`` identity, standing for a bad custom op).

| fault injected                                         | what the library guarantees (and what is asserted)                     |
|--------------------------------------------------------|------------------------------------------------------------------------|
| loss * 1e30: the loss is finite, the float16 backward overflows | the step is skipped                                          |
| loss * inf (inf in the loss itself)                    | the step is skipped; the logged loss is the unscaled ``inf``          |
| loss * -inf                                            | the step is skipped                                                   |
| NaN in one element of the batch                        | the step is skipped                                                   |
| NaN in one parameter's gradient only (others finite)   | the whole step is skipped (every leaf, not only the bad one)          |
| any of the above, isolated (every 5th step)            | every skipped step leaves params and every leaf of the inner state (adam moments and count, the schedule's count and learning rate) bit-identical; every clean step is applied; the scale follows torch's rule exactly (x0.5 per skip, x2 after 4 clean steps) |
| an overflow storm: 300 consecutive bad steps of all kinds, then 100 clean | the scale halves down to ``min_scale`` and stays there (never 0); parameters and optimizer state stay finite and bit-identical through the whole storm; afterwards the scale doubles exactly every ``growth_interval`` clean steps (``min_scale * 2**(n // 4)`` after n clean steps) |
| (all of the above)                                     | parameters and optimizer state are finite after every step; the schedule's step count and adam's count advance on applied steps only; the inner optimizer is never run on a non-finite gradient (it gets zeros on skipped steps) |
| the inner optimizer itself returns a NaN update while the gradients are finite | by default the step is applied, as torch's GradScaler applies it; with ``check_updates=True`` it is skipped too (parameters and inner state unchanged, counted in ``skipped_steps``), and the scale is not backed off, since it is not at fault |
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import mpjax
from mpjax import grad_scaler, scaled_value_and_grad

IN, HIDDEN, BATCH, N_BATCHES = 4, 16, 8, 4
INIT_SCALE, GROWTH_INTERVAL, MIN_SCALE = 2.0**10, 4, 2.0**-14
LENGTH = 410  # every fault program has this many steps: one compiled scan for all
SCHEDULE = optax.warmup_cosine_decay_schedule(
    init_value=1e-4, peak_value=1e-2, warmup_steps=20, decay_steps=400, end_value=1e-3
)

# Step inputs: (loss multiplier, value added to one batch element, factor on b2's cotangent).
CLEAN = (1.0, 0.0, 1.0)
FAULTS = {
    "loss*1e30": (1e30, 0.0, 1.0),
    "inf_loss": (np.inf, 0.0, 1.0),
    "-inf_loss": (-np.inf, 0.0, 1.0),
    "nan_in_batch": (1.0, np.nan, 1.0),
    "nan_in_one_gradient": (1.0, 0.0, np.nan),
}

# Whether the inner optimizer's input was finite, per call (a host callback).
_INNER_SAW_FINITE = []


def _observer():
    """An identity transform that reports whether its gradients are finite."""

    def update(updates, state, params=None):
        del params
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
        jax.debug.callback(lambda f: _INNER_SAW_FINITE.append(bool(f)), finite, ordered=True)
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _inner():
    return optax.chain(
        _observer(),
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE),
    )


def _scaler(**kwargs):
    return grad_scaler(_inner(), init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, **kwargs)


TX = _scaler()


@jax.custom_vjp
def _cotangent_times(x, factor):
    return x


def _ct_fwd(x, factor):
    return x, factor


def _ct_bwd(factor, g):
    return g * factor, jnp.zeros_like(factor)


_cotangent_times.defvjp(_ct_fwd, _ct_bwd)


@mpjax.autocast
def _mse(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def _loss(params, x, y, multiplier, grad_factor):
    params = {**params, "b2": _cotangent_times(params["b2"], grad_factor)}
    return _mse(params, x, y) * multiplier


def _init():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / 2.0,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / 4.0,
        "b2": jnp.zeros(1),
    }
    xs = jax.random.normal(k3, (N_BATCHES, BATCH, IN))
    ys = jnp.sum(jnp.sin(xs), axis=-1, keepdims=True)
    return params, xs, ys


def _all_finite(tree):
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _bits_equal(a, b):
    """Bitwise equality of two pytrees (tells -0.0 from 0.0, unlike ==)."""

    def one(x, y):
        if jnp.issubdtype(x.dtype, jnp.floating):
            as_int = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
            x, y = lax.bitcast_convert_type(x, as_int), lax.bitcast_convert_type(y, as_int)
        return jnp.all(x == y)

    return jnp.all(jnp.stack([one(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


@functools.lru_cache(maxsize=None)
def _compiled_program(check_updates: bool = False):
    _, xs, ys = _init()
    tx = _scaler(check_updates=check_updates)

    def body(carry, inputs):
        params, state = carry
        i, multiplier, poison, grad_factor = inputs
        x = xs[i % N_BATCHES].at[0, 0].add(poison)
        loss, grads = scaled_value_and_grad(_loss, state)(
            params, x, ys[i % N_BATCHES], multiplier, grad_factor
        )
        updates, new_state = tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        out = {
            "params": new_params,
            "state": new_state,
            "loss": loss,
            "unchanged": _bits_equal(
                (new_params, new_state.inner_state), (params, state.inner_state)
            ),
            "finite": _all_finite((new_params, new_state)),
        }
        return (new_params, new_state), out

    @jax.jit
    def run(params, state, multipliers, poisons, grad_factors):
        steps = jnp.arange(LENGTH)
        return lax.scan(body, (params, state), (steps, multipliers, poisons, grad_factors))[1]

    return run


def _run_program(program, check_updates: bool = False):
    """Runs a list of LENGTH step inputs; returns the per-step outputs as numpy."""
    assert len(program) == LENGTH
    params, _, _ = _init()
    columns = [jnp.asarray(c, jnp.float32) for c in zip(*program)]
    _INNER_SAW_FINITE.clear()
    out = _compiled_program(check_updates)(params, TX.init(params), *columns)
    out = jax.device_get(out)
    jax.effects_barrier()
    return params, out


def _reference_scales(faulty):
    """torch's rule with the floor, in exact Python floats (all powers of two)."""
    scale, tracker, scales, trackers = INIT_SCALE, 0, [], []
    for bad in faulty:
        if bad:
            scale, tracker = max(scale * 0.5, MIN_SCALE), 0
        else:
            tracker += 1
            if tracker == GROWTH_INTERVAL:
                scale, tracker = scale * 2.0, 0
        scales.append(scale)
        trackers.append(tracker)
    return np.array(scales, np.float32), np.array(trackers, np.int32)


def _step(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _check_invariants(params0, out, faulty):
    """What holds for every fault program."""
    faulty = np.asarray(faulty)
    state = out["state"]
    n_applied = np.cumsum(~faulty)

    # Never non-finite: parameters and every leaf of the optimizer state.
    assert out["finite"].all(), np.flatnonzero(~out["finite"])[:10]
    # Exactly the faulty steps are skipped, and counted.
    np.testing.assert_array_equal(state.last_step_skipped, faulty)
    np.testing.assert_array_equal(state.skipped_steps, np.cumsum(faulty))
    # Skipped steps change nothing, bit for bit; applied steps do move the parameters.
    np.testing.assert_array_equal(out["unchanged"][faulty], True)
    moved = [
        not np.array_equal(
            out["params"]["w1"][i], out["params"]["w1"][i - 1] if i else params0["w1"]
        )
        for i in np.flatnonzero(~faulty)
    ]
    assert all(moved)
    # The scale follows the documented rule exactly.
    scales, trackers = _reference_scales(faulty)
    np.testing.assert_array_equal(state.scale, scales)
    np.testing.assert_array_equal(state.growth_tracker, trackers)
    # The schedule's step count (and adam's) advance on applied steps only, and
    # the learning rate in force is the schedule's at that count.
    inject_state = state.inner_state[2]
    np.testing.assert_array_equal(inject_state.count, n_applied)
    np.testing.assert_array_equal(inject_state.inner_state[0].count, n_applied)
    want_lr = np.array([SCHEDULE(max(n - 1, 0)) for n in n_applied], np.float32)
    np.testing.assert_allclose(inject_state.hyperparams["learning_rate"], want_lr, rtol=1e-6)
    # The inner optimizer ran on every step, on the gradients as they were (under
    # jit no select stands in front of it, so its finite steps are its own, bit for
    # bit): non-finite exactly on the skipped steps, whose result it discarded.
    assert _INNER_SAW_FINITE == [not f for f in faulty]


def test_isolated_faults_of_every_kind():
    kinds = list(FAULTS.values())
    program = [kinds[(i // 5) % len(kinds)] if i % 5 == 4 else CLEAN for i in range(LENGTH)]
    faulty = [p != CLEAN for p in program]
    params0, out = _run_program(program)
    _check_invariants(params0, out, faulty)
    # Four clean steps, growth; one bad step, backoff: the scale stays in [2**10, 2**11].
    assert set(out["state"].scale.tolist()) == {2.0**10, 2.0**11}
    losses = out["loss"][4::5]  # the unscaled loss is what scaled_value_and_grad returns
    assert len(losses) == 82
    for j, loss in enumerate(losses):
        name = list(FAULTS)[j % len(FAULTS)]
        if name == "inf_loss":
            assert loss == np.inf
        elif name == "-inf_loss":
            assert loss == -np.inf
        elif name == "nan_in_batch":
            assert np.isnan(loss)
        else:  # the loss itself is finite; only the gradients are not
            assert np.isfinite(loss)


def test_checking_the_updates_too_skips_the_same_steps():
    # With an inner optimizer that never makes a non-finite update from finite
    # gradients, check_updates=True decides every step as the default does:
    # every invariant holds, and the two runs agree (up to XLA fusing the two
    # programs' arithmetic differently: a few ulps).
    kinds = list(FAULTS.values())
    program = [kinds[(i // 3) % len(kinds)] if i % 3 == 2 else CLEAN for i in range(LENGTH)]
    faulty = [p != CLEAN for p in program]
    params0, out = _run_program(program, check_updates=True)
    _check_invariants(params0, out, faulty)
    checked = _run_program(program)[1]
    chex.assert_trees_all_equal(out["state"].scale, checked["state"].scale)
    chex.assert_trees_all_equal(out["state"].skipped_steps, checked["state"].skipped_steps)
    chex.assert_trees_all_close(out["params"], checked["params"], rtol=1e-5, atol=1e-7)


def test_overflow_storm_then_recovery_at_the_documented_rate():
    warmup, storm = 10, 300
    kinds = list(FAULTS.values())
    program = (
        [CLEAN] * warmup
        + [kinds[i % len(kinds)] for i in range(storm)]
        + [CLEAN] * (LENGTH - warmup - storm)
    )
    faulty = [p != CLEAN for p in program]
    params0, out = _run_program(program)
    _check_invariants(params0, out, faulty)

    scales = out["state"].scale
    # Down to the floor in 24 halvings (2**10 -> 2**-14), and never below it.
    first_bad = warmup
    assert scales[first_bad - 1] == INIT_SCALE * 2.0**2  # grew twice during warm-up
    np.testing.assert_array_equal(
        scales[first_bad : first_bad + 26], [2.0 ** (11 - i) for i in range(26)]
    )
    np.testing.assert_array_equal(scales[first_bad + 25 : warmup + storm], MIN_SCALE)
    # The whole storm changed nothing: state before it == state after it.
    before, after = first_bad - 1, warmup + storm - 1
    chex.assert_trees_all_equal(_step(out["params"], after), _step(out["params"], before))
    chex.assert_trees_all_equal(
        _step(out["state"].inner_state, after), _step(out["state"].inner_state, before)
    )
    # Recovery: x2 after every growth_interval clean steps, from the floor.
    n_clean = np.arange(1, LENGTH - warmup - storm + 1)
    np.testing.assert_array_equal(
        scales[warmup + storm :], MIN_SCALE * 2.0 ** (n_clean // GROWTH_INTERVAL)
    )
    assert scales[-1] == 2.0**11  # 100 clean steps: 25 doublings from 2**-14


def test_nan_in_one_gradient_leaves_the_others_finite():
    # The fault "nan_in_one_gradient" above really is confined to one leaf.
    params, xs, ys = _init()
    state = TX.init(params)
    loss, grads = jax.jit(lambda s, *a: scaled_value_and_grad(_loss, s)(*a))(
        state, params, xs[0], ys[0], 1.0, np.float32(np.nan)
    )
    assert np.isfinite(loss)
    assert np.isnan(grads["b2"]).all()
    assert all(np.isfinite(grads[k]).all() for k in ("w1", "b1", "w2"))


# --------------------------------------------------------------------------
# An inner optimizer that itself produces NaN updates.


def _nan_updates_when_told():
    """An identity transform whose output is NaN when ``poison_updates=True``."""

    def update(updates, state, params=None, *, poison_updates=False):
        del params
        factor = jnp.where(poison_updates, jnp.nan, 1.0)
        return jax.tree.map(lambda u: u * factor, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _poisoned_step(**kwargs):
    """Three clean steps, then one whose inner optimizer makes NaN updates."""
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),
        _nan_updates_when_told(),
        optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE),
    )
    tx = grad_scaler(
        inner,
        init_scale=INIT_SCALE,
        growth_interval=GROWTH_INTERVAL,
        **kwargs,
    )
    params, xs, ys = _init()

    @jax.jit
    def step(params, state, x, y, poison):
        _, grads = scaled_value_and_grad(_loss, state)(params, x, y, 1.0, 1.0)
        updates, state = tx.update(grads, state, params, poison_updates=poison)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for i in range(3):
        params, state = step(params, state, xs[i], ys[i], jnp.array(False))
    new_params, new_state = step(params, state, xs[3], ys[3], jnp.array(True))
    return step, (params, state), (new_params, new_state)


def test_nan_update_from_the_inner_optimizer_is_skipped():
    step, (params, state), (new_params, new_state) = _poisoned_step(check_updates=True)
    _, xs, ys = _init()
    # The demanding guarantee: parameters and optimizer state never become
    # non-finite, whoever produced the NaN; the step is skipped exactly.
    assert bool(_all_finite((new_params, new_state))), "a NaN update was applied"
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    assert bool(new_state.last_step_skipped) and int(new_state.skipped_steps) == 1
    # ... and training goes on with the next clean step.
    after, after_state = step(new_params, new_state, xs[0], ys[0], jnp.array(False))
    assert not bool(after_state.last_step_skipped)
    assert not np.array_equal(np.asarray(after["w1"]), np.asarray(params["w1"]))


def test_by_default_a_nan_update_from_the_inner_optimizer_is_applied_as_torch_does():
    # By default the scaler trusts the inner optimizer, as torch's GradScaler
    # does: finite gradients, so the step is taken, NaN and all.
    step, (params, state), (new_params, new_state) = _poisoned_step()
    assert not bool(new_state.last_step_skipped) and int(new_state.skipped_steps) == 0
    assert np.isnan(np.asarray(new_params["w1"])).all()
    # ... and the step counts as a success: the 4th in a row grows the scale.
    assert float(new_state.scale) == 2 * float(state.scale) == 2 * INIT_SCALE
    # It is loud: every later step's gradients are NaN, and the step is skipped.
    _, xs, ys = _init()
    _, later = step(new_params, new_state, xs[0], ys[0], jnp.array(False))
    assert bool(later.last_step_skipped) and int(later.skipped_steps) == 1
