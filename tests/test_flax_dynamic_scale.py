"""mpjax.grad_scaler against Flax's own loss scaler, `flax.training.dynamic_scale.DynamicScale`.

Both are fed the same random sequences of gradients, finite or with an inf, a -inf
or a NaN in some leaves, through their own ``value_and_grad``, in one `lax.scan` per
setting. Where docs/jmp_and_flax.md says the two agree, the scale sequences must be
equal bit for bit; where it says they differ, the test asserts that difference:

* Flax grows after ``growth_interval + 1`` finite steps in a row, mpjax after
  ``growth_interval``: ``DynamicScale(growth_interval=n)`` is
  ``grad_scaler(growth_interval=n + 1)``.
* Flax's default floor is float32's smallest normal number, 2**-126; mpjax's is
  2**-14 (``min_scale=2.0**-126`` gives Flax's).
* At the top, Flax clamps a grown scale to float32's largest finite value; mpjax
  refuses the growth and keeps the scale, 2**127.
* A factor float32 cannot hold (1.1): Flax multiplies in float32 by the rounded
  factor, mpjax rounds the double-precision product (torch's rule).

It also checks mpjax's side of a skip: on a non-finite step the parameters and the
optimizer state are left bit for bit, where the Flax user selects them by hand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale

import mpjax

SHAPES = {"a": (3,), "b": (2, 2), "c": ()}
TINY = float(jnp.finfo(jnp.float32).tiny)  # 2**-126, DynamicScale's default floor
F32_MAX = float(jnp.finfo(jnp.float32).max)


def _sequence(seed: int, n: int, p_bad: float, finite_run: int = 0):
    """n steps of gradients (each leaf uniform in [-1, 1], so that scale * g never
    overflows float32), then `finite_run` finite steps. A bad step puts inf, -inf or
    NaN in one element of one or more leaves. Returns (gradients stacked by step,
    the bad-step flags)."""
    rng = np.random.default_rng(seed)
    total = n + finite_run
    grads = {k: rng.uniform(-1, 1, (total, *s)).astype(np.float32) for k, s in SHAPES.items()}
    bad = np.zeros(total, bool)
    bad[:n] = rng.random(n) < p_bad
    for t in np.flatnonzero(bad):
        for k in rng.choice(list(SHAPES), rng.integers(1, len(SHAPES) + 1), replace=False):
            flat = grads[k].reshape(total, -1)  # a view: writes land in grads[k]
            flat[t, rng.integers(flat.shape[1])] = rng.choice([np.inf, -np.inf, np.nan])
    return jax.tree.map(jnp.asarray, grads), bad


def _loss(params, g):
    """A loss whose gradient with respect to `params` is `g`, inf and NaN included."""
    return sum(jnp.sum(params[k] * g[k]) for k in SHAPES)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _replay(ds_kw: tuple, mp_kw: tuple, grads):
    """Both scalers, adam inside, over the stacked gradients; the scales after every
    step, and mpjax's parameters/state checks."""
    ds = DynamicScale(**dict(ds_kw))
    # As after its first jitted step: a scan's carry keeps its types.
    ds = ds.replace(fin_steps=jnp.int32(ds.fin_steps), scale=jnp.float32(ds.scale))
    tx = mpjax.grad_scaler(optax.adam(0.1), **dict(mp_kw))
    inner = optax.adam(0.1)
    params = {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}

    def step(carry, g):
        ds, fparams, fstate, params, opt_state = carry
        # Flax: DynamicScale's value_and_grad, then the step selected by hand.
        ds, is_fin, _, fgrads = ds.value_and_grad(_loss)(fparams, g)
        updates, new_fstate = inner.update(fgrads, fstate, fparams)
        new_fparams = optax.apply_updates(fparams, updates)
        fparams = jax.tree.map(functools.partial(jnp.where, is_fin), new_fparams, fparams)
        fstate = jax.tree.map(functools.partial(jnp.where, is_fin), new_fstate, fstate)
        # mpjax: the skip is the optimizer's.
        _, grads = mpjax.scaled_value_and_grad(_loss, opt_state)(params, g)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        unchanged = _bitwise_equal((new_params, new_opt_state.inner_state),
                                   (params, opt_state.inner_state))
        out = {
            "flax_scale": ds.scale,
            "flax_finite": is_fin,
            "mpjax_scale": mpjax.get_scale(new_opt_state),
            "mpjax_skipped": mpjax.scaler_stats(new_opt_state)["last_step_skipped"],
            "mpjax_unchanged": unchanged,
            "grads_equal": _bitwise_equal(fgrads, grads),
        }
        return (ds, fparams, fstate, new_params, new_opt_state), out

    carry = (ds, params, inner.init(params), params, tx.init(params))
    (_, fparams, _, params, _), out = jax.lax.scan(step, carry, grads)
    return out, fparams, params


def _bitwise_equal(a, b):
    same = [jnp.all(jax.lax.bitcast_convert_type(x, jnp.int32)
                    == jax.lax.bitcast_convert_type(y, jnp.int32))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
            if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 4]
    same += [jnp.all(x == y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
             if not jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(same))


def _run(ds_kw: dict, mp_kw: dict, grads):
    static = tuple(sorted(ds_kw.items())), tuple(sorted(mp_kw.items()))
    out, fparams, params = _replay(*static, grads)
    return jax.tree.map(np.asarray, jax.device_get(out)), fparams, params


def _bits(x):
    return np.asarray(x, np.float32).view(np.int32)


# (DynamicScale's arguments, and grad_scaler's that agree with them), a sequence.
AGREEING = {
    "flax_defaults": (
        {},
        dict(init_scale=65536.0, growth_interval=2001, min_scale=TINY),
        dict(seed=0, n=300, p_bad=0.2, finite_run=4100),
    ),
    "interval_1": (
        dict(growth_interval=1),
        dict(growth_interval=2, min_scale=TINY),
        dict(seed=1, n=400, p_bad=0.3),
    ),
    "factors_4_and_0.25_floor_1": (
        dict(growth_interval=3, growth_factor=4.0, backoff_factor=0.25, scale=2.0**10,
             minimum_scale=1.0),
        dict(init_scale=2.0**10, growth_interval=4, growth_factor=4.0, backoff_factor=0.25,
             min_scale=1.0),
        dict(seed=2, n=400, p_bad=0.35),
    ),
    "factors_1.5_and_0.75": (  # not powers of two, but held exactly by float32
        dict(growth_interval=2, growth_factor=1.5, backoff_factor=0.75, scale=3.0),
        dict(init_scale=3.0, growth_interval=3, growth_factor=1.5, backoff_factor=0.75,
             min_scale=TINY),
        dict(seed=3, n=400, p_bad=0.3),
    ),
    "down_to_the_floor": (
        dict(growth_interval=1),
        dict(growth_interval=2, min_scale=TINY),
        dict(seed=4, n=400, p_bad=0.6),
    ),
}


@pytest.mark.parametrize("name", list(AGREEING))
def test_scale_sequences_are_equal_bit_for_bit(name):
    ds_kw, mp_kw, seq = AGREEING[name]
    grads, bad = _sequence(**seq)
    out, fparams, params = _run(ds_kw, mp_kw, grads)
    # Both saw the same steps as non-finite, and only those.
    np.testing.assert_array_equal(~out["flax_finite"], bad)
    np.testing.assert_array_equal(out["mpjax_skipped"], bad)
    # The scales, bit for bit, after every step.
    np.testing.assert_array_equal(_bits(out["mpjax_scale"]), _bits(out["flax_scale"]))
    # The sequence exercised the rule: growth and backoff both happened.
    scale = out["mpjax_scale"]
    prev = np.concatenate([[mp_kw.get("init_scale", 65536.0)], scale[:-1]])
    assert (scale > prev).any() and (scale < prev).any(), name
    assert (scale == TINY).any() == (name == "down_to_the_floor")
    # A skipped step left mpjax's parameters and adam's state bit for bit; an applied
    # one changed them.
    assert out["mpjax_unchanged"][bad].all()
    assert not out["mpjax_unchanged"][~bad].any()
    # The unscaled gradients agree on finite steps at a power-of-two scale (divided
    # out exactly by both) ...
    power_of_two = np.frexp(prev)[0] == 0.5
    assert out["grads_equal"][~bad & power_of_two].all()
    # ... and the Flax loop's hand-written selection ends where mpjax's skip does.
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                 fparams, params)


def test_floor_reached_exactly():
    grads, bad = _sequence(seed=5, n=200, p_bad=1.0)
    out, _, _ = _run({}, dict(growth_interval=2001, min_scale=TINY), grads)
    assert out["flax_scale"][-1] == out["mpjax_scale"][-1] == TINY
    np.testing.assert_array_equal(_bits(out["mpjax_scale"]), _bits(out["flax_scale"]))


def test_defaults_differ_by_one_step_of_growth_and_by_the_floor():
    """Both default to 65536, x2 and x0.5; Flax grows one finite step later, and its
    floor is 2**-126 where mpjax's is 2**-14."""
    grads, _ = _sequence(seed=6, n=0, p_bad=0.0, finite_run=4002)
    out, _, _ = _run({}, {}, grads)
    flax_growth = np.flatnonzero(np.diff(out["flax_scale"], prepend=65536.0) > 0) + 1
    mpjax_growth = np.flatnonzero(np.diff(out["mpjax_scale"], prepend=65536.0) > 0) + 1
    np.testing.assert_array_equal(mpjax_growth, [2000, 4000])   # step numbers, from 1
    np.testing.assert_array_equal(flax_growth, [2001, 4002])    # every 2001 steps
    assert out["mpjax_scale"][-1] == out["flax_scale"][-1] == 2.0**18

    grads, _ = _sequence(seed=7, n=200, p_bad=1.0)
    out, _, _ = _run({}, {}, grads)
    halvings = 65536.0 * 0.5 ** np.arange(1, 201)
    np.testing.assert_array_equal(out["flax_scale"], np.maximum(halvings, TINY))
    np.testing.assert_array_equal(out["mpjax_scale"], np.maximum(halvings, 2.0**-14))


def test_same_interval_grows_one_step_apart():
    """With the same growth_interval on both, the first growth after a backoff comes
    one finite step later in Flax (a period of n + 1 steps, against n)."""
    n = 5
    grads, bad = _sequence(seed=8, n=1, p_bad=1.0, finite_run=3 * (n + 1))
    assert bad[0]
    out, _, _ = _run(dict(growth_interval=n), dict(growth_interval=n, min_scale=TINY), grads)
    first = lambda s: int(np.argmax(s > 32768.0))  # noqa: E731 - the index of the first growth
    assert first(out["mpjax_scale"]) == n
    assert first(out["flax_scale"]) == n + 1


def test_at_the_top_flax_clamps_and_mpjax_refuses():
    grads, _ = _sequence(seed=9, n=0, p_bad=0.0, finite_run=12)
    kw = dict(scale=2.0**124, growth_interval=1)
    out, _, _ = _run(kw, dict(init_scale=2.0**124, growth_interval=2, min_scale=TINY), grads)
    # Equal on the way up: growth every other step, 2**125, 2**126, 2**127 ...
    np.testing.assert_array_equal(out["flax_scale"][:6], out["mpjax_scale"][:6])
    assert out["mpjax_scale"][5] == 2.0**127
    # ... then Flax's min(2 * 2**127, float32 max) is float32's largest value, not a
    # power of two; mpjax keeps 2**127 (growth refused, the tracker reset).
    assert out["flax_scale"][7] == F32_MAX
    assert (out["mpjax_scale"][5:] == 2.0**127).all()
    # One overflow later the two still differ: max / 2 against 2**126.
    grads, _ = _sequence(seed=9, n=1, p_bad=1.0)
    more = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), _sequence(10, 0, 0, 12)[0], grads)
    out, _, _ = _run(kw, dict(init_scale=2.0**124, growth_interval=2, min_scale=TINY), more)
    assert out["flax_scale"][-1] == np.float32(F32_MAX) * np.float32(0.5) != 2.0**126
    assert out["mpjax_scale"][-1] == 2.0**126


def test_a_factor_float32_cannot_hold_rounds_differently():
    """growth_factor=1.1: Flax multiplies the float32 scale by float32(1.1) in float32;
    mpjax rounds the double-precision product (torch's rule). Both make the same
    decisions; each scale follows its own product, and the two sequences part."""
    grads, bad = _sequence(seed=11, n=300, p_bad=0.2)
    ds_kw = dict(growth_interval=1, growth_factor=1.1, backoff_factor=0.9, scale=1000.0)
    mp_kw = dict(init_scale=1000.0, growth_interval=2, growth_factor=1.1, backoff_factor=0.9,
                 min_scale=TINY)
    out, _, _ = _run(ds_kw, mp_kw, grads)
    np.testing.assert_array_equal(~out["flax_finite"], bad)
    np.testing.assert_array_equal(out["mpjax_skipped"], bad)

    def replay(mul):
        scale, tracker, seq = np.float32(1000.0), 0, []
        for b in bad:
            if b:
                scale, tracker = mul(scale, 0.9), 0
            elif tracker + 1 >= 2:
                scale, tracker = mul(scale, 1.1), 0
            else:
                tracker += 1
            seq.append(scale)
        return np.array(seq, np.float32)

    flax_model = replay(lambda s, f: np.float32(s) * np.float32(f))
    torch_model = replay(lambda s, f: np.float32(np.float64(s) * f))
    np.testing.assert_array_equal(_bits(out["flax_scale"]), _bits(flax_model))
    np.testing.assert_array_equal(_bits(out["mpjax_scale"]), _bits(torch_model))
    assert not np.array_equal(_bits(flax_model), _bits(torch_model))
    np.testing.assert_allclose(out["mpjax_scale"], out["flax_scale"], rtol=1e-5)
