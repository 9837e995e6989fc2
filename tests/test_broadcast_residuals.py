"""What the backward pass keeps of a broadcast: never the full-size array.

JAX's linearization keeps every value the backward pass reads that depends on
no tangent: relu's rule makes zeros (``select(x > 0, t, zeros)``), and so does
the JVP of a select with a constant case (a causal mask's fill, dropout), and a
causal mask is broadcast to every batch and head. Under autocast these are made
again in the backward pass from their (T, T) or scalar sources instead.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from conftest import BF16, F16, F32


def _w(*shape, seed=0):
    return 0.3 * jax.random.normal(jax.random.key(seed), shape)


def _residuals(f, *args):
    _, vjp = jax.vjp(f, *args)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(vjp)]


def _relu_mlp(p, x):
    return jnp.sum((jax.nn.relu(x @ p["w1"]) @ p["w2"]).astype(F32) ** 2)


def _params():
    return {"w1": _w(8, 32, seed=1), "w2": _w(32, 4, seed=2)}


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_relu_keeps_its_mask_not_a_full_size_array_of_zeros(dtype):
    x = _w(16, 8, seed=3)
    kept = _residuals(lambda p: mpjax.autocast(_relu_mlp, dtype=dtype)(p, x), _params())
    zeros = [r.shape for r in kept if r.size == 16 * 32 and not np.any(r)]
    assert not zeros, zeros
    assert any(r.dtype == bool and r.shape == (16, 32) for r in kept)  # relu's mask
    # without autocast, JAX keeps the zeros: the case this guards
    plain = _residuals(lambda p: _relu_mlp(p, x), _params())
    assert any(r.size == 16 * 32 and not np.any(r) for r in plain)


def test_relu_keeps_its_derivative_at_zero():
    grad = jax.grad(mpjax.autocast(lambda x: jnp.sum(jax.nn.relu(x)), dtype=F16))
    chex.assert_trees_all_equal(grad(jnp.array([-1.0, 0.0, 2.0])), jnp.array([0.0, 0.0, 1.0]))


def _causal_scores(q, k):
    b, t, _ = q.shape
    scores = jnp.einsum("bqd,bkd->bqk", q, k)
    mask = jnp.tril(jnp.ones((t, t), bool))
    masked = jnp.where(mask, scores, -jnp.inf)
    return jnp.sum(jax.nn.softmax(masked.astype(F32), axis=-1) ** 2)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_causal_mask_is_kept_once_not_per_batch(dtype):
    q, k = _w(4, 16, 8, seed=4), _w(4, 16, 8, seed=5)
    kept = _residuals(lambda q, k: mpjax.autocast(_causal_scores, dtype=dtype)(q, k), q, k)
    masks = [r.shape for r in kept if r.dtype == bool]
    assert masks == [(16, 16)], masks
    assert not [r.shape for r in kept if r.size == 4 * 16 * 16 and np.all(r == 0)]
    grads = jax.grad(mpjax.autocast(_causal_scores, dtype=dtype), argnums=(0, 1))(q, k)
    reference = jax.grad(_causal_scores, argnums=(0, 1))(q, k)
    chex.assert_trees_all_close(grads, reference, rtol=0.05, atol=5e-3)


class _Dropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32)(x)
        return nn.Dense(4)(nn.Dropout(0.5, deterministic=False)(h))


def test_dropout_keeps_no_zeros():
    model, x = _Dropout(), _w(16, 8, seed=6)
    params = model.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(1)}

    def loss(p):
        return jnp.sum(model.apply(p, x, rngs=rngs).astype(F32) ** 2)

    kept = _residuals(mpjax.autocast(loss, dtype=BF16), params)
    assert not [r.shape for r in kept if r.size == 16 * 32 and not np.any(r)]
    chex.assert_trees_all_close(
        jax.grad(mpjax.autocast(loss, dtype=BF16))(params),
        jax.grad(loss)(params),
        rtol=0.05,
        atol=0.02,
    )


def _gpt_block(p, x):
    h = jax.nn.relu(x @ p["w1"])
    b, t = 2, x.shape[0] // 2
    q = h.reshape(b, t, -1)
    s = jnp.einsum("bqd,bkd->bqk", q, q)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    probs = jax.nn.softmax(s.astype(F32), axis=-1).astype(s.dtype)
    out = jnp.einsum("bqk,bkd->bqd", probs, q).reshape(x.shape[0], -1)
    return jnp.sum((out @ p["w2"]).astype(F32) ** 2)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_values_are_those_of_the_selects_without_a_checkpoint(dtype, monkeypatch):
    x = _w(16, 8, seed=7)
    grad = jax.jit(jax.value_and_grad(mpjax.autocast(_gpt_block, dtype=dtype)))
    with_checkpoint = grad(_params(), x)
    from mpjax import fusions

    plain = lambda rule, broadcasts, read, ctx, eqn, vals, weak: rule(ctx, eqn, vals, weak)  # noqa: E731
    monkeypatch.setattr(fusions, "select", plain)
    without = jax.jit(jax.value_and_grad(mpjax.autocast(_gpt_block, dtype=dtype)))(_params(), x)
    chex.assert_trees_all_equal(with_checkpoint, without)
    # the patch took: without the checkpoint, relu's zeros are kept again
    kept = _residuals(lambda p: mpjax.autocast(_gpt_block, dtype=dtype)(p, x), _params())
    assert [r.shape for r in kept if r.size == 16 * 32 and not np.any(r)]
