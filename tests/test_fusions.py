"""A product and its bias, and an activation function between two products, each
run as one operation (torch's linear and its fused activation kernels)."""

import importlib
import pathlib
import re
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from conftest import BF16, F16, F32, all_eqns

# `benchmarks/` sits beside `mpjax/` in the repository and is not installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
stablehlo = importlib.import_module("benchmarks.stablehlo")  # its round-trip count


def _w(*shape, seed=0):
    return 0.3 * jax.random.normal(jax.random.key(seed), shape)


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def _mlp(params, x):
    h = _gelu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def _params():
    return {"w1": _w(8, 16), "b1": _w(16, seed=1), "w2": _w(16, 4, seed=2), "b2": _w(4, seed=3)}


def _dot_results(lowered: str) -> list[str]:
    """The result element type of every dot_general of a lowered program."""
    return re.findall(r"stablehlo\.dot_general .*-> tensor<(?:\d+x)*(\w+)>", lowered)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_bias_is_added_in_float32_to_the_products_16_bit_result(dtype):
    x, w, b = _w(4, 8, seed=4), _w(8, 16), _w(16, seed=1)
    f = mpjax.autocast(lambda x, w, b: x @ w + b, dtype=dtype)
    out = f(x, w, b)
    # torch's linear: the activation leaves in 16 bits (autocast's result is
    # returned at the traced float32 dtype, holding 16-bit values)
    assert out.dtype == F32
    chex.assert_trees_all_equal(out, out.astype(dtype).astype(F32))
    product = jax.lax.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=dtype)
    expected = (product.astype(F32) + b).astype(dtype).astype(F32)
    chex.assert_trees_all_close(out, expected, rtol=jnp.finfo(dtype).eps)  # within an ulp
    # The product returns 16 bits, which a GPU writes directly: no float32
    # result for a kernel of its own to round.
    low = "f16" if dtype == F16 else "bf16"
    assert _dot_results(jax.jit(f).lower(x, w, b).as_text()) == [low]
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(1, 2))(x, w, b)
    chex.assert_trees_all_equal_dtypes(grads, (w, b))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_models_products_return_16_bits_where_no_float32_sum_reads_them(dtype):
    # A classifier and its loss, autocast as a whole: the head's logits (its
    # bias added) are read by the loss, and no product writes float32.
    model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.gelu, nn.Dense(10)])
    x, labels = _w(8, 16, seed=4), jnp.arange(8) % 10
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    low = "f16" if dtype == F16 else "bf16"
    f = mpjax.autocast(loss, dtype=dtype)
    assert _dot_results(jax.jit(f).lower(params, x).as_text()) == [low] * 3
    grads = jax.grad(f)(params, x)
    chex.assert_trees_all_equal_dtypes(grads, params)
    reference = jax.grad(loss)(params, x)
    chex.assert_trees_all_close(grads, reference, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_float32_reader_reads_the_16_bit_rounding_as_torchs_do(dtype):
    x, w = _w(4, 8, seed=4), _w(8, 16)
    f = mpjax.autocast(lambda x, w: jnp.exp(x @ w), dtype=dtype)  # exp: float32 list
    rounded = jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=F32).astype(dtype)
    chex.assert_trees_all_close(f(x, w), jnp.exp(rounded.astype(F32)), rtol=1e-6)
    # The product hands on 16 bits: on a GPU it writes half the bytes a float32
    # result would (the logits before a loss's log-softmax are the largest).
    lowered = jax.jit(f).lower(x, w).as_text()
    low = "f16" if dtype == F16 else "bf16"
    assert f"-> tensor<4x16x{low}>" in lowered
    g = jax.grad(lambda w: jnp.sum(f(x, w)))(w)
    expected = jax.grad(lambda w: jnp.sum(jnp.exp(x @ w)))(w)
    chex.assert_trees_all_close(g, expected, atol=4 * jnp.finfo(dtype).eps * np.abs(expected).max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_residual_sum_reads_the_float32_accumulator(dtype, bias):
    x, w, b, y = _w(4, 16, seed=4), _w(16, 8), _w(8, seed=1), _w(4, 8, seed=5)

    def block(x, w, b, y):  # a residual connection: the stream plus a layer's output
        return y + (x @ w + b if bias else x @ w)

    f = mpjax.autocast(block, dtype=dtype)
    accumulator = jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=F32)
    if bias:
        accumulator = accumulator + b
    out = f(x, w, b, y)
    chex.assert_trees_all_close(out, y + accumulator, rtol=1e-6, atol=1e-7)
    rounded = y + accumulator.astype(dtype).astype(F32)
    assert not np.allclose(out, rounded, rtol=1e-6, atol=0)  # one rounding fewer
    # No 16-bit copy of the layer's output is made: on a GPU the sum reads the
    # product's result as it is written, and keeps nothing for the backward pass.
    low = "f16" if dtype == F16 else "bf16"
    assert f"tensor<4x8x{low}>" not in jax.jit(f).lower(x, w, b, y).as_text()
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))(x, w, b, y)
    chex.assert_trees_all_equal_dtypes(grads, (x, w, b, y))
    reference = jax.grad(lambda *a: jnp.sum(block(*a) ** 2), argnums=(0, 1, 2, 3))(x, w, b, y)
    for g, r in zip(grads, reference):
        chex.assert_trees_all_close(g, r, atol=8 * jnp.finfo(dtype).eps * np.abs(r).max())


def test_a_product_read_by_more_than_a_residual_sum_hands_on_its_rounding():
    x, w, y = _w(4, 16, seed=4), _w(16, 8), _w(4, 8, seed=5)

    def f(x, w, y):
        p = x @ w
        return (y + p) * jnp.exp(p)  # exp: a float32 reader that is no sum

    out = mpjax.autocast(f, dtype=BF16)(x, w, y)
    p = jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=F32).astype(BF16)
    chex.assert_trees_all_close(out, (y + p) * jnp.exp(p.astype(F32)), rtol=1e-6)


@pytest.mark.parametrize(
    "constant",
    [lambda: jnp.full((4, 8), 3.0), lambda: jnp.arange(32.0).reshape(4, 8)],
    ids=["full", "arange"],
)
def test_a_constant_added_to_a_product_widens_nothing(constant):
    # A constant of the result's shape is no residual stream: the product and the
    # add stay 16-bit, as with a bias-shaped constant (constants widen nothing).
    x, w = _w(4, 16, seed=4), _w(16, 8)
    f = mpjax.autocast(lambda x, w: x @ w + constant(), dtype=BF16)
    eqns = [
        e for e in all_eqns(jax.make_jaxpr(f)(x, w)) if e.primitive.name in ("add", "dot_general")
    ]
    assert [e.outvars[0].aval.dtype for e in eqns] == [BF16, BF16]
    p = jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=F32).astype(BF16)
    chex.assert_trees_all_equal(f(x, w), p + constant().astype(BF16))


def test_a_sum_of_two_products_stays_16_bit():
    # Each is read only by the sum, but nothing float32 joins them: reading
    # their accumulators would widen what torch's addition of two float16
    # tensors keeps in 16 bits.
    x, w, v = _w(4, 16, seed=4), _w(16, 8), _w(16, 8, seed=5)
    f = mpjax.autocast(lambda x, w, v: x @ v + x @ w, dtype=BF16)
    (add,) = [e for e in all_eqns(jax.make_jaxpr(f)(x, w, v)) if e.primitive.name == "add"]
    assert add.outvars[0].aval.dtype == BF16


def test_a_product_beyond_float16_is_inf_for_its_float32_readers_too():
    # 50 * 40 * 64 = 128000: beyond float16, exact in float32. torch's log widens
    # the float16 result of its matmul: inf, which its GradScaler then skips.
    x, w = jnp.full((2, 64), 50.0), jnp.full((64, 8), 40.0)
    assert np.all(np.isinf(mpjax.autocast(lambda x, w: jnp.log(x @ w))(x, w)))
    assert np.all(np.isinf(mpjax.autocast(lambda x, w: jnp.log(jax.nn.relu(x @ w)))(x, w)))


def test_flax_dense_output_is_16_bit_and_its_bias_gradient_float32():
    model = nn.Dense(16)
    x = _w(4, 8, seed=4)
    params = model.init(jax.random.key(0), x)
    loss = mpjax.autocast(lambda p, x: jnp.sum(model.apply(p, x).astype(F32) ** 2), dtype=BF16)
    jaxpr = jax.make_jaxpr(loss)(params, x)
    adds = [e for e in all_eqns(jaxpr) if e.primitive.name == "add"]
    assert [e.invars[0].aval.dtype for e in adds] == [F32]  # the product, widened, plus the bias
    grads = jax.grad(loss)(params, x)
    chex.assert_trees_all_equal_dtypes(grads, params)
    reference = jax.grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2))(params, x)
    chex.assert_trees_all_close(grads, reference, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_bias_broadcast_to_the_products_shape_joins_it_on_either_side(dtype):
    x, w, b = _w(4, 8, seed=4), _w(8, 16), _w(16, seed=1)

    def first(x, w, b):
        return x @ w + jnp.broadcast_to(b, (4, 16))

    def second(x, w, b):
        return jnp.broadcast_to(b, (4, 16)) + x @ w

    out = mpjax.autocast(first, dtype=dtype)(x, w, b)
    chex.assert_trees_all_equal(out, out.astype(dtype).astype(F32))  # a 16-bit sum
    chex.assert_trees_all_equal(mpjax.autocast(second, dtype=dtype)(x, w, b), out)


@pytest.mark.parametrize("scanned", [False, True], ids=["layer", "scanned-layers"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_an_attention_mask_added_to_the_scores_is_no_bias_and_adds_in_float32(dtype, scanned):
    # A mask of -1e9 (transformers' additive masks) computed from the padding, with
    # fewer elements than the scores it is broadcast to, as a bias has: added in
    # float16 it would be -inf, and a padding query's fully masked row NaN. torch
    # adds it in float32, as a separate operation, as here; in a scan over layers
    # too, where the body gets the mask as it gets the weights.
    x, ws = _w(2, 4, 8, seed=2), _w(3, 8, 8)
    valid = jnp.array([[True, True, False, False]] * 3 + [[False] * 4])

    def layer(h, w, mask):
        scores = jnp.einsum("bqd,bkd->bqk", h @ w, h @ w.T)
        return jax.nn.softmax(scores + mask, axis=-1) @ h

    def attention(x, ws, valid):
        mask = jnp.where(valid, 0.0, -1e9)
        if scanned:
            return jax.lax.scan(lambda h, w: (layer(h, w, mask), None), x, ws)[0]
        return layer(x, ws[0], mask)

    f = mpjax.autocast(attention, dtype=dtype)
    got = f(x, ws, valid)
    np.testing.assert_allclose(got, attention(x, ws, valid), atol=2e-2)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1))(x, ws, valid)
    assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_mask_given_as_an_argument_adds_to_attention_scores_in_float32(dtype):
    # Scores are a product of two activations, which takes no bias in torch: a mask
    # the data pipeline made (-1e9 on padded keys) adds apart, in float32.
    def f(x, wq, wk, mask):
        return jax.nn.softmax((x @ wq) @ (x @ wk).T + mask, axis=-1)

    x, wq, wk = _w(4, 8, seed=2), _w(8, 8), _w(8, 8, seed=1)
    cast = mpjax.autocast(f, dtype=dtype)
    padded = jnp.full(4, -1e9, F32)  # every key: each row uniform, as in float32
    for mask in (jnp.asarray([0.0, 0.0, -1e9, -1e9], F32), padded):
        np.testing.assert_allclose(cast(x, wq, wk, mask), f(x, wq, wk, mask), atol=2e-2)
    g = jax.grad(lambda *a: jnp.sum(cast(*a)[:, 0] ** 2), argnums=(1, 2))
    assert all(np.all(np.isfinite(d)) for d in g(x, wq, wk, padded))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_padding_mask_added_to_scores_of_arguments_adds_in_float32(dtype):
    # Attention autocast on its own: q and k are arguments, as a layer's weights
    # are, but the [B, 1, 1, T] mask varies along the batch, not along the
    # features a weight gives: no bias. The second example is all padding.
    def f(q, k, mask):
        return jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) + mask, axis=-1)

    q, k = _w(2, 3, 4, 8, seed=1), _w(2, 3, 4, 8, seed=2)
    mask = jnp.asarray([[0.0, 0.0, -1e9, -1e9], [-1e9] * 4], F32)[:, None, None, :]
    got = mpjax.autocast(f, dtype=dtype)(q, k, mask)
    np.testing.assert_allclose(got, f(q, k, mask), atol=2e-2)
    np.testing.assert_array_equal(got[1], 0.25)  # uniform, as in float32
    g = jax.grad(lambda *a: jnp.sum(mpjax.autocast(f, dtype=dtype)(*a)[..., 0] ** 2), (0, 1))
    assert all(np.all(np.isfinite(d)) for d in g(q, k, mask))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_mask_scanned_over_with_the_keys_adds_in_float32(dtype):
    # Chunked attention: a scan over blocks of keys and their mask. In the body the
    # block of keys is an input, but no parameter of the caller's reaches it: its
    # scores take no bias, and a fully padded block stays finite.
    x, wq, wk = _w(8, 16, seed=3), _w(16, 16), _w(16, 16, seed=1)
    mask = jnp.where(jnp.arange(8) < 4, -1e9, 0.0).astype(F32)  # the first block padded

    def f(x, wq, wk, mask):
        q, k = x @ wq, (x @ wk).reshape(2, 4, 16)

        def block(carry, kb_mb):
            m, s = carry
            scores = q @ kb_mb[0].T + kb_mb[1]
            new = jnp.maximum(m, scores.max(-1))
            return (new, s * jnp.exp(m - new) + jnp.exp(scores - new[:, None]).sum(-1)), None

        init = (jnp.full(8, -jnp.inf), jnp.zeros(8))
        (m, s), _ = jax.lax.scan(block, init, (k, mask.reshape(2, 4)))
        return jnp.sum(m + jnp.log(s))  # the sum of the rows' logsumexps

    got = jax.jit(mpjax.autocast(f, dtype=dtype))(x, wq, wk, mask)
    np.testing.assert_allclose(got, f(x, wq, wk, mask), rtol=2e-2)
    grads = jax.grad(mpjax.autocast(f, dtype=dtype), (1, 2))(x, wq, wk, mask)
    assert all(np.all(np.isfinite(d)) for d in grads)


def test_a_same_size_float32_operand_still_widens():
    f = mpjax.autocast(lambda x, w, y: x @ w + y, dtype=BF16)
    assert f(_w(4, 8), _w(8, 16), _w(4, 16)).dtype == F32


def test_a_constant_added_to_a_product_does_not_widen_it():
    f = mpjax.autocast(lambda x, w: x @ w + jnp.arange(16.0), dtype=BF16)
    jaxpr = jax.make_jaxpr(f)(_w(4, 8), _w(8, 16))
    (add,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "add"]
    assert add.outvars[0].aval.dtype == BF16


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_activation_between_products_computes_in_float32_and_keeps_16_bits(dtype):
    params, x = _params(), _w(4, 8, seed=4)
    jaxpr = jax.make_jaxpr(mpjax.autocast(_mlp, dtype=dtype))(params, x)
    (tanh,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "tanh"]
    assert tanh.outvars[0].aval.dtype == F32  # inside: torch's float32 opmath
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert [v.aval.dtype for v in dots[1].invars] == [dtype, dtype]
    # the value: the float32 function of the 16-bit activation, rounded once
    h = x.astype(dtype).astype(F32) @ params["w1"].astype(dtype).astype(F32) + params["b1"]
    expected_h = _gelu(h.astype(dtype).astype(F32)).astype(dtype)
    got = mpjax.autocast(lambda p, x: _gelu(x @ p["w1"] + p["b1"]) @ jnp.eye(16), dtype=dtype)
    chex.assert_trees_all_close(
        got(params, x).astype(F32), expected_h.astype(F32), rtol=2 * jnp.finfo(dtype).eps
    )


def test_a_jitted_silu_between_products_and_its_derivative_compute_in_float32():
    # jax.nn.silu is a jit of x * sigmoid(x). Its derivative in 16 bits multiplies
    # the cotangent by x before the sigmoid's derivative (0 here): past 65504 that
    # is inf * 0 = NaN at the initial loss scale. torch's silu backward is one
    # float32 kernel, and so is autocast's: finite, as float32's.
    w1, w2 = _w(32, 32, seed=1) / np.sqrt(32), _w(32, 32, seed=2) / np.sqrt(32)
    x = 300.0 * _w(8, 32, seed=3)

    def loss(w1, w2, x):
        return 65536.0 * jnp.mean(jax.nn.silu(x @ w1) @ w2)

    got = jax.jit(jax.grad(mpjax.autocast(loss), argnums=(0, 1)))(w1, w2, x)
    want = jax.grad(loss, argnums=(0, 1))(w1, w2, x)
    assert all(np.isfinite(g).all() for g in got)
    chex.assert_trees_all_close(got, want, rtol=2e-2, atol=2e-2 * max(np.abs(want[0]).max(), 1))
    jaxpr = jax.make_jaxpr(mpjax.autocast(loss))(w1, w2, x)
    (logistic,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "logistic"]
    assert logistic.outvars[0].aval.dtype == F32


def test_backward_pass_keeps_the_16_bit_activation_not_float32_intermediates():
    params, x = _params(), _w(64, 8, seed=4)
    loss = mpjax.autocast(lambda p, x: jnp.sum(_mlp(p, x).astype(F32)), dtype=BF16)
    _, residuals = jax.vjp(lambda p: loss(p, x), params)
    kept = [
        (leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(residuals) if np.size(leaf) == 64 * 16
    ]
    assert kept and all(dtype == BF16 for _, dtype in kept), kept


def test_a_jitted_gradient_keeps_no_float32_intermediates_either():
    """Compiled as one program, XLA could merge the backward pass's recomputation
    of the activation with the forward pass and keep its float32 intermediates
    (the tanh), a float32 copy of the hidden layer: autocast bars that merge."""
    batch, width, hidden = 1024, 64, 8192
    params = {"w1": _w(width, hidden), "b1": _w(hidden, seed=1), "w2": _w(hidden, width, seed=2)}
    x = _w(batch, width, seed=3)

    def loss(p, x):
        return jnp.mean((_gelu(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2)

    def handcast(p, x):
        p16 = jax.tree.map(lambda a: a.astype(BF16), p)
        return loss(p16, x.astype(BF16)).astype(F32)

    def temp_bytes(f):
        compiled = jax.jit(jax.grad(f)).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    hidden_f32 = batch * hidden * 4
    autocast = temp_bytes(mpjax.autocast(loss, dtype=BF16))
    # A kept float32 tanh leaves 0.5 to 1 float32 hidden layers below float32's
    # allocation (jax 0.10 to 0.12); without it, 1.5 to 2.
    assert autocast <= temp_bytes(loss) - 1.25 * hidden_f32
    with jax.allow_f16_reductions(True):  # the hand-cast model sums in 16 bits
        assert autocast < temp_bytes(handcast)


def _sums_of_widened(module: str) -> list[str]:
    """For each sum in `module` (StableHLO text) of 16-bit values widened, the
    operation that made the 16-bit values."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    found = []

    def visit(op):
        made = op.operands[0].owner if op.name == "stablehlo.reduce" else None
        if isinstance(made, ir.OpView) and made.operation.name == "stablehlo.convert":
            value = made.operands[0]
            if str(ir.RankedTensorType(value.type).element_type) in ("f16", "bf16"):
                owner = value.owner
                found.append(owner.operation.name if isinstance(owner, ir.OpView) else "argument")
        return ir.WalkResult.ADVANCE

    with mlir.make_ir_context():
        ir.Module.parse(module).operation.walk(visit)
    return found


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_gpu_program_sums_a_bias_gradient_from_the_16_bit_cotangent(dtype):
    """A bias's gradient sums the 16-bit cotangent its product's backward pass
    reads too. XLA:GPU computes in excess precision: it reads a widening through
    the rounding just before it, and would sum the float32 cotangent a GELU's
    backward pass computes, which its kernel then writes to memory in float32. In
    the program a GPU receives (exported here without one) the sum reads the
    negated cotangent, widened, and nothing bars XLA from fusing the sum into the
    kernel that computes the cotangent; other backends' programs sum it widened."""
    loss = mpjax.autocast(lambda p, x: jnp.sum(_mlp(p, x).astype(F32)), dtype=dtype)
    grad = jax.jit(jax.grad(loss))

    def module(platform):
        return jax.export.export(grad, platforms=[platform])(_params(), _w(64, 8, seed=4))

    cuda, cpu = module("cuda").mlir_module(), module("cpu").mlir_module()
    # b1's and b2's gradients; both cotangents are roundings of float32 values
    assert _sums_of_widened(cuda) == ["stablehlo.negate"] * 2
    assert _sums_of_widened(cpu) == ["stablehlo.convert"] * 2
    # single-operand barriers: jax.checkpoint's own take several values
    assert not re.findall(r"optimization_barrier %\d+ : tensor", cuda)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_biased_products_backward_pass_takes_the_16_bit_cotangent_as_it_is(dtype):
    """The cotangent of a bias add's rounded sum reaches the product's backward
    products as the 16-bit values it is: the lowered gradient widens none of them
    to float32 only to round it straight back (which XLA would then remove)."""
    loss = mpjax.autocast(lambda p, x: jnp.sum(_mlp(p, x).astype(F32)), dtype=dtype)
    for platform in ("cpu", "cuda"):
        grad = jax.export.export(jax.jit(jax.grad(loss)), platforms=[platform])
        module = grad(_params(), _w(64, 8, seed=4)).mlir_module()
        assert stablehlo.coverage(module).round_trips == 0
        assert len(_sums_of_widened(module)) == 2  # b1's and b2's gradients


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_each_operand_of_a_bias_add_differentiated_alone_gets_its_full_gradient(dtype):
    x, w, b = _w(4, 8, seed=4), _w(8, 16), _w(16, seed=1)
    f = mpjax.autocast(lambda x, w, b: jnp.sum(_gelu(x @ w + b).astype(F32) ** 2), dtype=dtype)
    every = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, b)
    for i in range(3):
        chex.assert_trees_all_equal(jax.jit(jax.grad(f, argnums=i))(x, w, b), every[i])
    tangent = jax.jvp(f, (x, w, b), (jnp.zeros_like(x), jnp.zeros_like(w), b))[1]
    chex.assert_trees_all_close(tangent, jnp.vdot(every[2], b), rtol=4 * jnp.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_the_gpu_programs_bias_gradient_is_the_plain_sum(dtype):
    """``-sum(widen(-ct))``, the GPU program's sum, is the sum, bit for bit: each
    16-bit value alone (zeros of both signs, subnormals, infinities) widens to
    itself, and sums over a bias's broadcast axes are the plain sums."""
    from mpjax import _bias

    every = np.arange(2**16, dtype=np.uint16).view(jnp.dtype(dtype)).reshape(-1, 1)
    alone = _bias._apart(jnp.asarray(every), None, every.shape)  # nothing summed
    widened = every.astype(np.float32)
    nan = np.isnan(widened)
    np.testing.assert_array_equal(np.isnan(alone), nan)
    np.testing.assert_array_equal(
        np.asarray(alone)[~nan].view(np.uint32), widened[~nan].view(np.uint32)
    )
    scales = jnp.asarray([1e-6, 1.0, 300.0, 3e4])[:, None, None, None]
    ct = (scales * jax.random.normal(jax.random.key(0), (4, 64, 8, 4))).astype(dtype)
    for shape in [(1, 8, 1), (8, 1), (4,), (1, 1, 1, 1)]:
        chex.assert_trees_all_equal(
            _bias._apart(ct, None, shape), _bias._summed(ct.astype(F32), shape)
        )


def test_gradients_match_float32_as_before():
    params, x = _params(), _w(32, 8, seed=4)
    loss = lambda p, x: jnp.mean(_mlp(p, x).astype(F32) ** 2)  # noqa: E731
    reference = jax.grad(loss)(params, x)
    grads = jax.grad(mpjax.autocast(loss, dtype=F16))(params, x)
    chex.assert_trees_all_equal_dtypes(grads, params)
    chex.assert_trees_all_close(grads, reference, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("act", [jax.nn.silu, _gelu], ids=["silu", "gelu"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_an_activation_of_a_float32_norm_output_keeps_only_its_input(act, dtype):
    # A norm's output is float32, as torch's; the SiLU or GELU a product reads
    # computes on it in float32 and is made again in the backward pass, which keeps
    # its float32 input (as torch's silu backward does) and the product's 16-bit
    # operand, not float32 intermediates (the sigmoid, its derivative).
    def layer(act):
        def loss(p, x):
            h = x @ p["w1"]
            centred = h - h.mean(-1, keepdims=True)
            normed = centred * jax.lax.rsqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
            return jnp.sum((act(normed * p["g"] + p["b"]) @ p["w2"]).astype(F32) ** 2)

        return loss

    def kept(loss):
        _, residuals = jax.vjp(lambda p: mpjax.autocast(loss, dtype=dtype)(p, x), p)
        return [str(leaf.dtype) for leaf in jax.tree.leaves(residuals) if np.size(leaf) == 64 * 16]

    p = {"w1": _w(8, 16), "g": _w(16, seed=1), "b": _w(16, seed=2), "w2": _w(16, 4, seed=3)}
    x = _w(64, 8, seed=4)
    # What the activation adds to the norm's residuals and the product's operand:
    # its float32 input alone.
    assert sorted(kept(layer(act))) == sorted([*kept(layer(lambda v: v)), "float32"])
    got = jax.grad(mpjax.autocast(layer(act), dtype=dtype))(p, x)
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(jax.grad(layer(act))(p, x))):
        eps = float(jnp.finfo(dtype).eps)
        chex.assert_trees_all_close(g, want, rtol=8 * eps, atol=8 * eps * np.abs(want).max())


@pytest.mark.parametrize("op", [jnp.multiply, jnp.divide], ids=["mul", "div"])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_a_16_bit_activation_a_float32_factor_widens_is_kept_in_16_bits(op, dtype):
    # exp(x @ v) is float32 (exp is on the float32 list), so `gate * message` is
    # float32, as torch's; the backward pass keeps the 16-bit message as computed,
    # as torch's mul keeps its operands, not a float32 copy of it.
    def loss(p, x):
        gate = jnp.exp(x @ p["v"])  # [64, 1]
        return jnp.sum((op(x @ p["w"], gate) @ p["u"]).astype(F32) ** 2)

    p = {"v": _w(8, 1), "w": _w(8, 16, seed=1), "u": _w(16, 4, seed=2)}
    x = _w(64, 8, seed=3)
    f = mpjax.autocast(loss, dtype=dtype)
    _, residuals = jax.vjp(lambda p: f(p, x), p)
    kept = [str(leaf.dtype) for leaf in jax.tree.leaves(residuals) if np.shape(leaf) == (64, 16)]
    assert kept and set(kept) == {np.dtype(dtype).name}, kept
    got, want = jax.grad(f)(p, x), jax.grad(loss)(p, x)
    eps = float(jnp.finfo(dtype).eps)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        chex.assert_trees_all_close(g, w, rtol=16 * eps, atol=16 * eps * np.abs(w).max())


def test_a_16_bit_activation_two_float32_factors_widen_keeps_one_float32_copy():
    # Its two cotangents then add in float32 and round once; widened apart, each
    # would round to 16 bits and they would add in 16 bits.
    def loss(p, x):
        m = x @ p["w"]
        return jnp.sum(((m * jnp.exp(x @ p["v"]) + m * jnp.exp(x @ p["u"])) @ p["o"]) ** 2)

    p = {"w": _w(8, 16), "v": _w(8, 1, seed=1), "u": _w(8, 1, seed=2), "o": _w(16, 4, seed=3)}
    x = _w(64, 8, seed=4)
    _, residuals = jax.vjp(lambda p: mpjax.autocast(loss, dtype=BF16)(p, x), p)
    kept = [str(leaf.dtype) for leaf in jax.tree.leaves(residuals) if np.shape(leaf) == (64, 16)]
    assert kept.count("float32") == 1, kept


_CROSS_ENTROPIES = {  # log-normalizer minus the label's logit, each way a user writes it
    "optax": optax.softmax_cross_entropy_with_integer_labels,
    "take_along_axis": lambda z, y: jax.nn.logsumexp(z, -1)
    - jnp.take_along_axis(z, y[:, None], -1)[:, 0],
    "indexing": lambda z, y: jax.nn.logsumexp(z, -1) - z[jnp.arange(len(y)), y],
}


@pytest.mark.parametrize("form", list(_CROSS_ENTROPIES))
def test_a_label_logit_moved_out_of_widened_logits_is_moved_from_their_float32_copy(form, low):
    # The label's logit comes out of the 16-bit logits by a gather, and the
    # log-normalizer widens them. For a confident prediction the two cotangents,
    # p/n and -1/n, nearly cancel: rounded to 16 bits apart and added in 16 bits,
    # (p - 1)/n kept few correct bits. Gathered from the float32 copy, they add in
    # float32 and round once, as in a model that widens its logits by hand.
    ce = _CROSS_ENTROPIES[form]
    w, x = _w(16, 10) / 0.3, _w(64, 16, seed=1) * 10
    y = jnp.argmax(x @ w, -1)  # predictions right and confident: a trained classifier's
    assert float(jnp.median(jax.nn.softmax(x @ w)[jnp.arange(64), y])) > 0.95

    def loss(x, w):
        return jnp.mean(ce(x @ w, y))

    def by_hand(x, w):
        return jnp.mean(ce((x.astype(low) @ w.astype(low)).astype(F32), y))

    want = jax.grad(loss)(x, w)

    def error(g):  # per example: each row of the input's gradient
        return np.median(np.linalg.norm(g - want, axis=1) / np.linalg.norm(want, axis=1))

    got = error(jax.jit(jax.grad(mpjax.autocast(loss, dtype=low)))(x, w))
    assert got <= 1.1 * error(jax.jit(jax.grad(by_hand))(x, w))  # was 2.5x (float16)
    jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, dtype=low)))(x, w)
    adds = [e for e in all_eqns(jaxpr) if e.primitive.name == "add_any"]
    assert all(e.outvars[0].aval.dtype == F32 for e in adds), adds


def test_an_activation_not_read_by_a_product_keeps_torchs_float32_result():
    f = mpjax.autocast(lambda x, w: jnp.sum(_gelu(x @ w)), dtype=BF16)
    jaxpr = jax.make_jaxpr(f)(_w(4, 8), _w(8, 16))
    (tanh,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "tanh"]
    assert tanh.outvars[0].aval.dtype == F32
    remats = [e for e in all_eqns(jaxpr) if e.primitive.name in ("remat2", "checkpoint")]
    assert not any(e.primitive.name == "tanh" for r in remats for e in all_eqns(r.params["jaxpr"]))


def test_float32_accumulator_is_for_parameters_not_activations():
    def attention(x, wq, wk):
        q, k = x @ wq, x @ wk  # products with a weight: float32 accumulators
        probs = jax.nn.softmax(q @ k.T)  # float32: softmax is on the float32 list
        return probs @ x

    x, wq, wk = _w(4, 8), _w(8, 8, seed=1), _w(8, 8, seed=2)
    f = mpjax.autocast(attention, dtype=BF16)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(1, 2)))(x, wq, wk)
    dots = [e.outvars[0].aval for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    # Every product returns 16 bits but those giving the weights' gradients,
    # float32 sums over the batch; the activations' cotangents are 16-bit.
    assert {(a.dtype, a.shape) for a in dots if a.dtype != BF16} == {(F32, (8, 8))}
    assert sum(a.dtype == BF16 for a in dots) == 7  # 4 forward, 3 for activations


def _lstm_loss(params, xs):
    """An LSTM written as Flax's OptimizedLSTMCell computes it, under lax.scan."""

    def cell(carry, x):
        c, h = carry
        hidden = jnp.split(h @ params["wh"] + params["b"], 4, axis=-1)
        inputs = jnp.split(x @ params["wi"], 4, axis=-1)
        i, f, g, o = (a + b for a, b in zip(hidden, inputs))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h

    zeros = jnp.zeros((xs.shape[1], params["wh"].shape[0]))
    _, hs = jax.lax.scan(cell, (zeros, zeros), xs)
    return jnp.mean(jnp.tanh(hs @ params["wo"] + params["bo"]) ** 2)


def _lstm_params():
    shapes = {"wi": (8, 64), "wh": (16, 64), "b": (64,), "wo": (16, 4), "bo": (4,)}
    return {k: _w(*s, seed=i) for i, (k, s) in enumerate(shapes.items())}


def _squashing(jaxpr):
    return [e for e in all_eqns(jaxpr) if e.primitive.name in ("logistic", "tanh")]


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_recurrent_gates_are_summed_and_squashed_in_float32(dtype):
    # torch's fused LSTM cell adds its two products and the bias in float32 and
    # squashes the sum there: the bias add hands its float32 sum on, unrounded
    params, xs = _lstm_params(), _w(6, 4, 8, seed=9)
    loss = mpjax.autocast(_lstm_loss, dtype=dtype)
    jaxpr = jax.make_jaxpr(loss)(params, xs)
    squashing = _squashing(jaxpr)
    assert len(squashing) == 6  # 3 sigmoids and 2 tanh in the cell, the head's tanh
    assert all(e.invars[0].aval.dtype == F32 for e in squashing)
    dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert all(v.aval.dtype == dtype for e in dots for v in e.invars)  # products in 16 bits
    grads = jax.grad(loss)(params, xs)
    chex.assert_trees_all_equal_dtypes(grads, params)
    reference = jax.grad(_lstm_loss)(params, xs)
    chex.assert_trees_all_close(grads, reference, rtol=0.05, atol=2e-3)


def test_flax_lstm_gates_read_float32():
    cell = nn.OptimizedLSTMCell(16)
    model = nn.RNN(cell)
    xs = _w(4, 6, 8, seed=9)
    params = model.init(jax.random.key(0), xs)
    loss = mpjax.autocast(lambda p, x: jnp.sum(model.apply(p, x).astype(F32) ** 2), dtype=BF16)
    gates = _squashing(jax.make_jaxpr(loss)(params, xs))
    assert gates and all(e.invars[0].aval.dtype == F32 for e in gates)


def test_a_biased_product_read_by_relu_still_leaves_in_16_bits():
    f = mpjax.autocast(lambda x, w, b, w2: jax.nn.relu(x @ w + b) @ w2, dtype=BF16)
    jaxpr = jax.make_jaxpr(f)(_w(4, 8), _w(8, 16), _w(16), _w(16, 4))
    (relu,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "max"]
    assert relu.invars[0].aval.dtype == BF16  # the sum rounded once: relu keeps 16 bits


def test_a_chain_of_adds_deeper_than_pythons_stack_is_read_without_recursion():
    # A model written as a Python loop is a chain of adds as long as it has layers:
    # here the float32 accumulator policy.md describes, summed over 600 products.
    ws = 0.1 * jax.random.normal(jax.random.key(0), (600, 8, 8))
    x = jnp.ones((4, 8))

    def f(ws, x):
        acc = jnp.zeros((4, 8))
        for i in range(ws.shape[0]):
            acc = acc + x @ ws[i]
        return acc

    got = mpjax.autocast(f)(ws, x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, f(ws, x), rtol=2e-2, atol=2e-2)
