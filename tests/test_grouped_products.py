"""Grouped matrix products (``jax.lax.ragged_dot``, a mixture of experts' expert
layers) get what ``dot_general`` gets: 16-bit operands forward and backward, a
float32 accumulator, and float32 gradients for float32 weights, never rounded to
16 bits."""

import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import F32, all_eqns, assert_obeys_policy, rel_tol
from jax import lax

import mpjax

SIZES = (50, 0, 78, 128)  # an expert may get no token
GROUP_SIZES = jnp.array(SIZES, jnp.int32)


def _experts(seed=0, tokens=256, features=64, out=32):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (tokens, features))
    w = jax.random.normal(k2, (len(GROUP_SIZES), features, out)) / np.sqrt(features)
    head = jax.random.normal(k3, (out,))
    return w, x, head


def _grouped(w, x, head):
    return jnp.sum(jnp.tanh(lax.ragged_dot(x, w, GROUP_SIZES)) * head)


def _dense(w, x, head):
    """The same layer as one dot_general per expert."""
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    parts = [x[a:b] @ w[g] for g, (a, b) in enumerate(itertools.pairwise(starts))]
    return jnp.sum(jnp.tanh(jnp.concatenate(parts)) * head)


def test_expert_weights_get_float32_gradients_as_dense_products_do(low):
    # The experts' gradient sums 16-bit products in float32 and is returned
    # unrounded: most of its values lie between two 16-bit numbers. Its error
    # against float32 is the per-expert dot_generals' (rounded to 16 bits, it
    # would be about twice theirs in float16). Not jitted: XLA may drop a rounding
    # followed by a widening (excess precision), and the test would not see one.
    args = _experts()
    grouped = jax.grad(mpjax.autocast(_grouped, dtype=low), argnums=(0, 1))(*args)
    dense = jax.jit(jax.grad(mpjax.autocast(_dense, dtype=low), argnums=(0, 1)))(*args)
    reference = jax.grad(_grouped, argnums=(0, 1))(*args)
    chex.assert_trees_all_equal_dtypes(grouped, reference)
    w_grad = np.asarray(grouped[0])
    assert np.mean(w_grad != w_grad.astype(low).astype(F32)) > 0.5
    for got, dense_got, want in zip(grouped, dense, reference):
        error = float(jnp.max(jnp.abs(got - want)))
        dense_error = float(jnp.max(jnp.abs(dense_got - want)))
        assert error <= 1.25 * dense_error, (error, dense_error)


def test_grouped_products_multiply_16_bit_values_backward_too(low):
    args = _experts()
    f = mpjax.autocast(_grouped, dtype=low)
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(*args)
    assert_obeys_policy(jaxpr, low)
    products = [e for e in all_eqns(jaxpr) if e.primitive.name == "ragged_dot_general"]
    # The forward product returns 16 bits, as a dot_general does; the tokens' and
    # the experts' gradients (both of float32 arguments) are float32 sums (twice
    # for bfloat16: a platform_dependent branch for the CPU, whose dot kernel
    # multiplies bfloat16 values as exact float32 ones).
    shapes = {e.outvars[0].aval.shape for e in products}
    assert shapes == {(256, 32), args[1].shape, args[0].shape}
    assert len(products) == (3 if low == jnp.float16 else 5)
    for e in products:
        forward = e.outvars[0].aval.shape == (256, 32)
        assert e.params["preferred_element_type"] == (low if forward else F32)


@pytest.mark.parametrize("low", [jnp.float16, jnp.bfloat16])
def test_an_activation_between_grouped_products_keeps_16_bits_for_the_backward_pass(low):
    # An expert MLP: as between two dot_generals, the GELU computes in float32 and
    # its internals are made again in the backward pass, not kept in float32.
    w1, x, _ = _experts(tokens=256, features=64, out=128)
    w2 = jax.random.normal(jax.random.key(7), (len(SIZES), 128, 64)) / np.sqrt(128)

    def loss(w1, w2, x):
        h = jax.nn.gelu(lax.ragged_dot(x, w1, GROUP_SIZES))
        return jnp.sum(lax.ragged_dot(h, w2, GROUP_SIZES).astype(F32) ** 2)

    _, residuals = jax.vjp(lambda w1, w2: mpjax.autocast(loss, dtype=low)(w1, w2, x), w1, w2)
    hidden = [leaf.dtype for leaf in jax.tree.leaves(residuals) if np.shape(leaf) == (256, 128)]
    assert hidden and set(hidden) == {np.dtype(low)}, hidden


@pytest.mark.parametrize("dtype, low", [(jnp.float16, "f16"), (jnp.bfloat16, "bf16")])
def test_gpu_program_multiplies_16_bit_groups(dtype, low):
    """The program a GPU receives, exported here without one: each grouped product
    (a ``chlo.ragged_dot``) multiplies 16-bit operands; the forward one returns 16
    bits, the gradients of float32 arguments float32."""
    grad = jax.jit(jax.grad(mpjax.autocast(_grouped, dtype=dtype), argnums=(0, 1)))
    module = jax.export.export(grad, platforms=["cuda"])(*_experts()).mlir_module()
    impls = re.findall(r"func.func private @chlo.ragged_dot\.impl\S*\((.*)", module)
    types = [
        re.findall(r"%arg\d+: tensor<[\dx]*x(\w+)>", impl)[:2]
        + re.findall(r"\) -> \(?tensor<[\dx]*x(\w+)>", impl)
        for impl in impls
    ]
    # the forward product; the tokens' gradient and the experts' (float32 arguments)
    assert sorted(types) == sorted([[low, low, low]] + [[low, low, "f32"]] * 2), types


@pytest.mark.parametrize("transform", ["scan", "checkpoint"])
def test_grouped_products_compose(low, transform):
    w, x, head = _experts(tokens=256)
    xs = jnp.stack([x, 0.5 * x])

    def loss(w, xs):
        if transform == "scan":
            return lax.scan(lambda c, x: (c + _grouped(w, x, head), None), 0.0, xs)[0]
        return jnp.sum(jax.checkpoint(lambda xs: jnp.stack([_grouped(w, x, head) for x in xs]))(xs))

    got = jax.jit(jax.value_and_grad(mpjax.autocast(loss, dtype=low)))(w, xs)
    want = jax.value_and_grad(loss)(w, xs)
    chex.assert_trees_all_equal_dtypes(got, want)
    scale = float(jnp.max(jnp.abs(want[1])))
    np.testing.assert_allclose(got[1], want[1], atol=rel_tol(low) * scale)


def test_grouped_product_with_batch_dimensions(low):
    # ragged_dot_general with a batch dimension on both operands.
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.random.normal(k1, (2, 256, 16))
    w = jax.random.normal(k2, (2, 4, 16, 8)) / 4
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((2,), (2,)), ((0,), (0,))),
        lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[1],
    )

    def loss(w, x):
        return jnp.sum(jnp.sin(lax.ragged_dot_general(x, w, GROUP_SIZES, dims)))

    got = jax.jit(jax.grad(mpjax.autocast(loss, dtype=low), argnums=(0, 1)))(w, x)
    want = jax.grad(loss, argnums=(0, 1))(w, x)
    chex.assert_trees_all_equal_dtypes(got, want)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, atol=rel_tol(low) * float(jnp.max(jnp.abs(r))))


def test_a_grouped_product_jax_cannot_differentiate_still_runs_forward(low):
    # Ragged along the contraction (the form of an expert's weight gradient): JAX
    # defines no derivative, and autocast runs it as a 16-bit product.
    k1, k2 = jax.random.split(jax.random.key(2))
    x, y = jax.random.normal(k1, (256, 16)), jax.random.normal(k2, (256, 8))
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )

    def f(x, y):
        return lax.ragged_dot_general(x, y, GROUP_SIZES, dims)

    got, want = jax.jit(mpjax.autocast(f, dtype=low))(x, y), f(x, y)
    assert got.shape == want.shape == (4, 16, 8) and got.dtype == F32
    np.testing.assert_allclose(got, want, atol=rel_tol(low) * float(jnp.max(jnp.abs(want))))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest)")
def test_a_grouped_products_out_sharding_is_kept(low):
    # Explicit sharding cannot infer a ragged product's result sharding: the
    # program gives it, and the float32-accumulating product keeps it.
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("a",), axis_types=(AxisType.Explicit,))
    use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
    w, x, _ = _experts()
    with use_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P("a")))
        w = jax.device_put(w, NamedSharding(mesh, P()))

        def f(w, x):
            return jnp.tanh(lax.ragged_dot(x, w, GROUP_SIZES, out_sharding=P("a")))

        jaxpr = jax.make_jaxpr(mpjax.autocast(f, dtype=low))(w, x)
        reference = jax.make_jaxpr(f)(w, x)
    assert [v.aval for v in jaxpr.jaxpr.outvars] == [v.aval for v in reference.jaxpr.outvars]
    assert "a" in str(jaxpr.jaxpr.outvars[0].aval)
