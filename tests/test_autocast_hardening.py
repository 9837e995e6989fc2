"""Corner cases of autocast a user meets in real programs: infinities in masks,
explicit accumulation dtypes, Flax NNX's functional API, repeated eager calls,
deeply nested loops, custom_vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from conftest import F32, rel_tol


def _xw(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (4, 8)), 0.3 * jax.random.normal(k2, (8, 5))


# --- infinities the user wrote stay infinite ---------------------------------------


def test_minus_inf_mask_stays_minus_inf(low):
    x, w = _xw()
    mask = jnp.arange(20).reshape(4, 5) % 3 != 0

    def f(x, w):
        return jnp.where(mask, x @ w, -jnp.inf)

    out = jax.jit(mpjax.autocast(f, dtype=low))(x, w)
    ref = f(x, w)
    assert out.dtype == F32
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=rel_tol(low), atol=rel_tol(low))


def test_fully_masked_logsumexp_row_is_minus_inf(low):
    x, w = _xw()
    mask = jnp.array([[False] * 5, [True] * 5, [True, False] * 2 + [True], [True] * 5])

    def f(x, w):
        return jax.nn.logsumexp(jnp.where(mask, x @ w, -jnp.inf), axis=-1)

    out = mpjax.autocast(f, dtype=low)(x, w)
    ref = f(x, w)
    assert out[0] == -jnp.inf and ref[0] == -jnp.inf
    np.testing.assert_allclose(out[1:], ref[1:], rtol=rel_tol(low))


def test_weak_constants_saturate_but_keep_inf_and_nan(low):
    # The huge finite constant saturates to the low dtype's max (a -1e9 mask must
    # not become -inf); the infinities and the NaN are kept as written.
    def f(x, w):
        i = jnp.arange(4)  # `held` is computed from literals only: weak
        held = jnp.where(
            i == 0, -1e9, jnp.where(i == 1, -jnp.inf, jnp.where(i == 2, jnp.inf, jnp.nan))
        )
        return (x @ w)[0] + held  # the add runs in `low`: `held` is cast to it

    x, w = jnp.zeros((2, 3)), jnp.zeros((3, 4))
    out = mpjax.autocast(f, dtype=low)(x, w)
    saturated = float(jnp.asarray(max(-1e9, -float(jnp.finfo(low).max)), low))
    np.testing.assert_array_equal(out[:3], [saturated, -np.inf, np.inf])
    assert np.isnan(out[3])
