"""autocast on whole models: dtype of every equation, and numbers against float32."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from conftest import (
    BF16,
    F16,
    F32,
    all_eqns,
    assert_obeys_policy,
    product_ok,
    rel_tol,
    value_dtypes,
)
from models import MODELS, model_case


@pytest.fixture(params=["torch", "lean"])
def policy(request):
    return request.param


@pytest.mark.parametrize("name", MODELS)
def test_every_equation_obeys_policy(name, low, policy):
    loss, params, inputs = model_case(name)
    jaxpr = jax.make_jaxpr(mpjax.autocast(loss, dtype=low, policy=policy))(params, *inputs)
    by_name = assert_obeys_policy(jaxpr, low)
    matmuls = by_name.get("dot_general", []) + by_name.get("conv_general_dilated", [])
    assert matmuls, "every model has matrix products"
    # The loss is returned in float32, as the function returns it without autocast.
    assert jaxpr.out_avals[0].dtype == F32


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_grads_close_to_float32(name, low, policy):
    loss, params, inputs = model_case(name)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(params, *inputs)
    out_loss, grads = jax.jit(jax.value_and_grad(mpjax.autocast(loss, dtype=low, policy=policy)))(
        params, *inputs
    )
    assert out_loss.dtype == F32
    np.testing.assert_allclose(out_loss, ref_loss, rtol=rel_tol(low))
    # Gradients of float32 parameters are float32, whatever ran inside.
    chex.assert_trees_all_equal_dtypes(grads, params)
    # Compare each gradient in norm: elementwise relative error of tiny entries is noise.
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        err = float(jnp.linalg.norm(g - r) / (jnp.linalg.norm(r) + 1e-6))
        assert err < 4 * rel_tol(low), (name, err)


@pytest.mark.parametrize("name", MODELS)
def test_backward_matmuls_run_in_low_precision(name, low):
    loss, params, inputs = model_case(name)
    jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, dtype=low)))(params, *inputs)
    matmuls = [
        e for e in all_eqns(jaxpr) if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]
    forward = [
        e
        for e in all_eqns(jax.make_jaxpr(loss)(params, *inputs))
        if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]
    assert len(matmuls) > len(forward), "the backward pass has its own products"
    held = value_dtypes(jaxpr)
    for e in matmuls:
        assert product_ok(e, held[e], low), e
    report = mpjax.audit(jax.grad(mpjax.autocast(loss, dtype=low)), params, *inputs)
    assert report.low_precision_fraction == 1.0


def test_transformer_attention_details(low):
    loss, params, (tokens,) = model_case("transformer")
    jaxpr = jax.make_jaxpr(mpjax.autocast(loss, dtype=low))(params, tokens)
    eqns = list(all_eqns(jaxpr))
    # The -1e9 mask is a weak literal: where the low dtype holds it (bfloat16) the
    # masked scores stay in low precision; float16 cannot, and the select runs in
    # float32, keeping -1e9 (the softmax reading it computes in float32 anyway).
    selects = [
        e for e in eqns if e.primitive.name == "select_n" and len(e.outvars[0].aval.shape) == 4
    ]
    held = low if float(jnp.finfo(low).max) > 1e9 else F32
    assert selects and all(e.outvars[0].aval.dtype == held for e in selects)
    # softmax, layer norm and the loss accumulate in float32.
    assert all(
        e.outvars[0].aval.dtype == F32
        for e in eqns
        if e.primitive.name in ("exp", "reduce_sum", "rsqrt", "log", "integer_pow", "square")
    )


def test_masked_attention_fully_masked_row_stays_finite():
    # -1e9 overflows float16 to -inf; autocast runs the select in float32 instead.
    def f(scores, mask):
        return jax.nn.softmax(jnp.where(mask, scores, -1e9), -1)

    scores = jnp.ones((2, 4))
    mask = jnp.array([[True, True, False, False], [False] * 4])
    out = jax.jit(mpjax.autocast(f))(scores, mask)
    np.testing.assert_allclose(out, f(scores, mask), atol=1e-3)


def _residual_bytes(f, *args):
    """Bytes a vjp keeps for the backward pass: the activation memory of training."""
    residuals = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))


def test_both_policies_keep_fewer_residual_bytes():
    loss, params, _ = model_case("transformer")
    tokens = jax.random.randint(jax.random.key(1), (8, 65), 0, 11)
    f32 = _residual_bytes(loss, params, tokens)
    torch_style = _residual_bytes(mpjax.autocast(loss), params, tokens)
    lean = _residual_bytes(mpjax.autocast(loss, policy="lean"), params, tokens)
    # The default policy's activation between products stays 16-bit (rematerialized);
    # the lean policy also rounds the attention probabilities and norms.
    assert torch_style <= 0.6 * f32, (torch_style, f32)
    assert lean <= 0.6 * f32, (lean, f32)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_lean_policy_looks_up_single_elements_exactly(dtype):
    # Only an embedding's rows are rounded: an element looked up by a binary search,
    # an interpolation, a quantile or x[i] is compared or returned as it is.
    edges = jnp.linspace(1.0, 1.001, 50)
    table = jnp.array([1.0, 3001.0, 1e5, 1e-6])
    cases = [
        (lambda e, q: jnp.searchsorted(e, q), (edges, jnp.array([1.0003, 1.0007]))),
        (lambda x: jnp.median(x, axis=1), (jnp.array([[1.0003, 1.0007, 1.0001]]),)),
        (lambda xp, x: jnp.interp(x, xp, xp**2), (edges, jnp.array([1.00031, 1.00077]))),
        (lambda t, i: t[i], (table, jnp.arange(4))),
    ]
    for f, args in cases:
        chex.assert_trees_all_equal(mpjax.autocast(f, dtype=dtype, policy="lean")(*args), f(*args))


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_lean_policy_gathers_data_along_an_axis_exactly(dtype):
    # A quantile along an axis gathers rows of the values it sorted: data returned,
    # not the rows of an embedding's table, and past 65504 they were inf in float16.
    x = jnp.array([[1.0001, 1e5, 7e4, 2.5, 3.0], [1.0007, 2.0, 3.0, 4.0, 8e4]])
    cases = [
        lambda x: jnp.median(x, axis=1),
        lambda x: jnp.quantile(x, 0.3, axis=0),
        lambda x: jnp.nanpercentile(x, 70.0, axis=1),
    ]
    for f in cases:
        lean = mpjax.autocast(f, dtype=dtype, policy="lean")
        chex.assert_trees_all_equal(jax.jit(lean)(x), jax.jit(f)(x))
        chex.assert_trees_all_equal(
            jax.grad(lambda x: jnp.sum(lean(x)))(x), jax.grad(lambda x: jnp.sum(f(x)))(x)
        )


def _gather_in_scan_carry(x, rows):
    def body(c, _):
        return c, jnp.take(c, rows, axis=0) + 0.5

    return jax.lax.scan(body, x * 1.0001, None, length=2)[1]


def _gather_in_scan_const(x, rows):
    y = x * 1.0001
    return jax.lax.scan(lambda c, _: (c, jnp.take(y, rows, axis=0) + 0.5), 0.0, None, length=2)[1]


def _gather_in_while_carry(x, rows):
    def body(s):
        i, c, acc = s
        return i + 1, c, acc + jnp.take(c, rows, axis=0)

    init = (0, x * 1.0001, jnp.zeros((3, 3)))
    return jax.lax.while_loop(lambda s: s[0] < 2, body, init)[2]


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize(
    "f",
    [
        lambda x, rows: jnp.take(x * 1.0001, rows, axis=0),
        lambda x, rows: jax.jit(lambda y: y[rows])(x * 1.0001),
        _gather_in_scan_carry,
        _gather_in_scan_const,
        _gather_in_while_carry,
    ],
    ids=["take", "jit", "scan_carry", "scan_const", "while_carry"],
)
def test_lean_policy_gathers_computed_values_exactly_inside_a_nested_jit_or_loop(f, dtype):
    # jnp.take is a jit: its operand, computed here, is no parameter inside it, so
    # its gather reads data, not an embedding's table, and returns it unrounded.
    # Likewise a loop's carry, and a value computed outside the loop.
    x = jnp.array([[1.0001, 1e5, 7e4], [2.0, 3.0, 8e4]])
    rows = jnp.array([1, 0, 1])
    lean = mpjax.autocast(f, dtype=dtype, policy="lean")
    chex.assert_trees_all_equal(lean(x, rows), f(x, rows))
    chex.assert_trees_all_equal(jax.jit(lean)(x, rows), jax.jit(f)(x, rows))


@pytest.mark.parametrize("scanned", [False, True], ids=["closed_over", "scanned_over"])
def test_lean_policy_rounds_the_rows_of_an_embedding_table_inside_a_loop(scanned):
    # The table is the function's parameter, closed over by the loop's body or
    # scanned over as a layer's: its gathered rows are rounded, as outside a loop.
    table = jnp.array([[1.0001, 2.0], [3.0, 4.0001]])
    ids = jnp.array([[0, 1], [1, 0]])

    def f(table):
        if scanned:  # a stack of two layers' tables
            return jax.lax.scan(lambda c, t: (c, t[ids[0]]), 0.0, table)[1]
        return jax.lax.scan(lambda c, i: (c, jnp.take(table, i, axis=0)), 0.0, ids)[1]

    table = jnp.stack([table, table[::-1]]) if scanned else table

    got = mpjax.autocast(f, policy="lean")(table)
    chex.assert_trees_all_equal(got, f(table.astype(F16)).astype(got.dtype))
    assert not np.array_equal(got, f(table))


def test_lean_policy_keeps_the_users_float16_data_out_of_bfloat16():
    # A float32-list operation on float16 data in a bfloat16 region computes in
    # float32 and hands on float16, the program's own dtype: no bfloat16 rounding.
    a = jnp.array([1.0009765625, 3.0009765625, 0.1, -2.5], jnp.float16)
    for f in (jnp.exp, jnp.cumsum, jnp.log1p, jax.nn.softplus):
        got = mpjax.autocast(f, dtype=BF16, policy="lean")(a)
        chex.assert_trees_all_equal(got, f(a.astype(F32)).astype(jnp.float16))


def test_lean_policy_details():
    loss, params, (tokens,) = model_case("transformer")
    eqns = list(all_eqns(jax.make_jaxpr(mpjax.autocast(loss, policy="lean"))(params, tokens)))
    # The embedding lookup hands on float16 rows: it gathers from the float32 table
    # and rounds the rows (no float16 copy of the table; its gradient, a scatter-add,
    # is float32 all the way).
    (gather,) = [
        e
        for e in eqns
        if e.primitive.name == "gather"
        and e.invars[0].aval.ndim == 2
        and e.invars[0].aval.shape[0] == 11
        and e.outvars[0].aval.ndim == 3
    ]
    assert gather.invars[0].aval.dtype == gather.outvars[0].aval.dtype == F32
    (rows,) = [e for e in eqns if gather.outvars[0] in e.invars]
    assert rows.primitive.name == "convert_element_type"
    assert rows.outvars[0].aval.dtype == jnp.float16
    # The residual stream stays float16 (per-row statistics, [B, T, 1], stay
    # float32; the scores behind the -1e9 mask, which float16 cannot hold, are
    # selected and normalized in float32 and rounded for the next product) ...
    activations = [
        e
        for e in eqns
        if e.primitive.name == "add"
        and e.outvars[0].aval.ndim >= 3
        and e.outvars[0].aval.shape[-1] > 1
        and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)
    ]
    assert len(activations) >= 4
    assert all(e.outvars[0].aval.dtype == jnp.float16 for e in activations)
    # ... while exp itself computes in float32, inside a rematerialized region.
    assert all(e.outvars[0].aval.dtype == F32 for e in eqns if e.primitive.name == "exp")


def test_policy_is_validated():
    with pytest.raises(ValueError, match=r"autocast\(policy='fast'\): policy must be one of"):
        mpjax.autocast(lambda x: x, policy="fast")


def test_a_products_cotangent_is_cast_once_for_both_backward_products(low):
    f = mpjax.autocast(lambda w, x: jnp.sum(jnp.sin(x @ w)), dtype=low)
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(jnp.ones((8, 16)), jnp.ones((4, 8)))
    down = [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name == "convert_element_type"
        and e.outvars[0].aval.shape == (4, 16)
        and (e.invars[0].aval.dtype, e.outvars[0].aval.dtype) == (F32, low)
    ]
    # the transpose of sin's float32 upcast, once: the product returns 16 bits,
    # so its cotangent arrives in 16 bits for the products giving the gradients
    # of w and of x, and nothing casts it again
    assert len(down) == 1, down
