"""A max-pool of a ReLU is evaluated as the ReLU of the max-pool: the same values
and gradients, with a CNN stem's full-size float32 ReLU output and cotangent gone."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpjax
from conftest import BF16, F16, F32, all_eqns


class Stem(nn.Module):
    """A ResNet's stem: convolution, GroupNorm, ReLU, max-pool (pool, then ReLU, if `swapped`)."""

    swapped: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.GroupNorm(num_groups=4)(nn.Conv(8, (3, 3), (2, 2), use_bias=False)(x))
        if self.swapped:
            return nn.relu(nn.max_pool(x, (3, 3), (2, 2), padding="SAME"))
        return nn.max_pool(nn.relu(x), (3, 3), (2, 2), padding="SAME")


def _images():
    # few distinct values: ties within windows, and windows whose maximum is 0
    return jnp.round(2 * jax.random.normal(jax.random.key(0), (2, 17, 17, 3))) / 2


def _relu_operands(fun, *args):
    return [
        e.invars[0].aval.shape
        for e in all_eqns(jax.make_jaxpr(fun)(*args).jaxpr)
        if e.primitive.name == "custom_jvp_call"
    ]


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_relu_before_a_max_pool_runs_after_it_with_the_same_values_and_gradients(dtype):
    x = _images()
    params = Stem().init(jax.random.key(1), x)
    cotangent = jax.random.normal(jax.random.key(2), (2, 5, 5, 8))

    def loss(model):
        f = mpjax.autocast(lambda p, x: model.apply(p, x), dtype=dtype)
        return lambda p, x: jnp.sum(f(p, x) * cotangent)

    written, by_hand = loss(Stem()), loss(Stem(swapped=True))
    # the ReLU reads the pooled (2, 5, 5, 8) values, not the (2, 9, 9, 8) norm output
    assert _relu_operands(written, params, x) == [(2, 5, 5, 8)]
    chex.assert_trees_all_equal(written(params, x), by_hand(params, x))
    chex.assert_trees_all_equal(
        jax.grad(written, argnums=(0, 1))(params, x), jax.grad(by_hand, argnums=(0, 1))(params, x)
    )
    # the norm's output is float32 (torch's), and so is everything the pool keeps
    pooled = [
        e
        for e in all_eqns(jax.make_jaxpr(written)(params, x).jaxpr)
        if e.primitive.name == "reduce_window_max"
    ]
    assert [e.invars[0].aval.dtype for e in pooled] == [F32]


def test_the_backward_pass_keeps_the_pools_operand_and_a_pooled_mask_only():
    """JAX keeps the ReLU's output, a full-size mask and its zeros; autocast the pool's
    operand and the mask of the pooled values (their zeros made again, not kept)."""
    x = jax.random.normal(jax.random.key(0), (2, 17, 17, 3))
    f = mpjax.autocast(
        lambda x: nn.max_pool(nn.relu(2 * x), (3, 3), (2, 2), padding="SAME"), dtype=BF16
    )
    _, backward = jax.vjp(f, x)
    kept = sorted((leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(backward))
    assert [k for k in kept if k[0]] == [((2, 9, 9, 3), "bool"), ((2, 17, 17, 3), "float32")]


def _pool_and_keep(r):
    return r, nn.max_pool(r, (3, 3), (2, 2), padding="SAME")


@pytest.mark.parametrize(
    "fun",
    [
        # the ReLU's output is read twice: it is computed at full size anyway
        lambda x: _pool_and_keep(jax.nn.relu(x)),
        # windows wholly in the padding: the pool's -inf, where a ReLU first gives 0
        lambda x: nn.max_pool(jax.nn.relu(x), (2, 2), (2, 2), padding=((0, 0), (0, 5))),
        # lax.max's derivative splits a tie at 0 in halves: which element ties matters
        lambda x: nn.max_pool(jnp.maximum(x, 0.0), (3, 3), (2, 2), padding="SAME"),
    ],
    ids=["read-twice", "padding-only-windows", "lax-max"],
)
def test_a_pool_that_would_change_the_result_keeps_its_relu_before_it(fun):
    x = _images()
    f = mpjax.autocast(fun, dtype=BF16)
    chex.assert_trees_all_equal(f(x), fun(x))

    def grad(g):
        return jax.grad(lambda x: sum(jnp.sum(y * y) for y in jax.tree.leaves(g(x))))(x)

    chex.assert_trees_all_equal(grad(f), grad(fun))
    assert all(shape == x.shape for shape in _relu_operands(f, x))


def test_a_dilated_pool_whose_windows_can_straddle_the_operand_keeps_its_relu_before_it():
    # Taps 20 apart on 17 rows: some windows have both in the padding, where the
    # pool gives -inf and a ReLU moved after it 0. (JAX differentiates no dilated
    # max-pool.)
    def fun(x):
        return lax.reduce_window(
            jax.nn.relu(x), -jnp.inf, lax.max, (1, 2, 1, 1), (1, 1, 1, 1),
            padding=((0, 0), (10, 10), (0, 0), (0, 0)), window_dilation=(1, 20, 1, 1),
        )

    x = _images()
    want = fun(x)
    assert np.any(np.isneginf(want)) and np.any(want == 0)
    chex.assert_trees_all_equal(mpjax.autocast(fun, dtype=BF16)(x), want)
    assert _relu_operands(mpjax.autocast(fun, dtype=BF16), x) == [x.shape]
