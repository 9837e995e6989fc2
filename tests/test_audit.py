"""mpjax.audit: the report users debug precision with."""

import chex
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import mpjax


def test_report_lists_dtypes_casts_and_flops():
    def f(w, x):
        return jnp.sum(jnp.exp(x @ w))

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    report = mpjax.audit(mpjax.autocast(f), w, x)
    (dot,) = report.find("dot_general")
    # float16 operands and result: no reader takes the float32 accumulator
    assert dot.in_dtypes == ("float16", "float16") and dot.out_dtypes == ("float16",)
    assert "test_audit.py" in dot.source
    assert report.find("exp")[0].in_dtypes == ("float32",)
    assert report.matmul_flops == 2 * 2 * 4 * 3
    assert report.low_precision_fraction == 1.0
    # w, x down; the product's float16 result widened for exp (a float32
    # operation reads the 16-bit result, as torch's do).
    assert report.float_casts == report.casts_inserted == 3
    # autocast of an autocast function: the same program, the same casts its own
    twice = mpjax.audit(mpjax.autocast(mpjax.autocast(f)), w, x)
    assert twice.summary() == report.summary() and twice.casts_inserted == 3
    text = str(report)
    assert "dot_general" in text and "float16, float16 -> float16" in text
    assert "100.0%" in text
    # The wrapper autocast puts around a product of a parameter is not the user's:
    # its equations are listed, itself not.
    assert report.find("custom_jvp_call") == [] and "custom_jvp_call" not in text


def test_disabled_region_shows_in_the_flop_share():
    def f(w, x):
        h = x @ w
        return mpjax.autocast(lambda h: h @ w.T, enabled=False)(h)

    report = mpjax.audit(mpjax.autocast(f), jnp.ones((8, 8)), jnp.ones((2, 8)))
    assert report.low_precision_fraction == pytest.approx(0.5)


def test_scan_flops_count_every_iteration_and_paths_nest():
    def f(w, xs):
        return lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), xs[0], xs)[0]

    report = mpjax.audit(mpjax.autocast(f), jnp.ones((4, 4)), jnp.ones((5, 2, 4)))
    assert report.matmul_flops == 5 * 2 * 2 * 4 * 4
    assert report.find("dot_general")[0].path == "scan"


def test_integer_products_are_not_counted_as_floating_point_work():
    def f(w, x, idx):
        onehot = jax.nn.one_hot(idx, 4, dtype=jnp.int32)
        return jnp.sum(x @ w) + (onehot.T @ onehot).sum()

    report = mpjax.audit(mpjax.autocast(f), jnp.ones((4, 3)), jnp.ones((2, 4)), jnp.arange(4))
    assert report.matmul_flops == report.low_precision_flops == 2 * 2 * 4 * 3
    assert report.low_precision_fraction == 1.0
    assert len(report.find("dot_general")) == 2  # still listed


def test_ragged_and_transposed_products_count_the_products_they_make():
    # Each of ragged_dot's three products (forward, both gradients) is 2*6*8*5.
    lhs, rhs, sizes = jnp.ones((6, 8)), jnp.ones((3, 8, 5)), jnp.array([2, 2, 2], jnp.int32)
    f = lambda l, r: jnp.sum(jnp.tanh(jax.lax.ragged_dot(l, r, sizes)))
    report = mpjax.audit(jax.grad(mpjax.autocast(f), argnums=(0, 1)), lhs, rhs)
    assert report.matmul_flops == 3 * 2 * 6 * 8 * 5
    # A stride-2 transposed convolution: each input element meets each tap once
    # (VALID), but for a tap beyond the output's edge (SAME: 8 * 3 - 1 = 23 pairs
    # per dimension); the zeros it inserts are not multiplied. XLA counts the same.
    dims = ("NHWC", "HWIO", "NHWC")
    for padding, x, k, pairs in (
        ("VALID", jnp.ones((1, 4, 4, 3)), jnp.ones((3, 3, 3, 5)), (4 * 3) ** 2),
        ("SAME", jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 4)), (8 * 3 - 1) ** 2),
    ):
        convt = lambda x, k, p=padding: lax.conv_transpose(x, k, (2, 2), p, dimension_numbers=dims)
        features = x.shape[-1] * k.shape[-1]
        assert mpjax.audit(mpjax.autocast(convt), x, k).matmul_flops == 2 * pairs * features


def test_conv_flops():
    def f(x, k):
        return lax.conv_general_dilated(
            x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    report = mpjax.audit(f, jnp.ones((1, 5, 5, 3)), jnp.ones((3, 3, 3, 8)))
    assert report.matmul_flops == 2 * (3 * 3 * 8) * (3 * 3 * 3)
    assert report.low_precision_fraction == 0.0 and report.casts_inserted is None
    # SAME: a tap on the padding multiplies nothing (8 * 3 - 2 pairs per dimension).
    same = lambda x, k: lax.conv_general_dilated(  # noqa: E731
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    report = mpjax.audit(same, jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 8)))
    assert report.matmul_flops == 2 * 2 * (8 * 3 - 2) ** 2 * 3 * 8


def test_a_program_with_no_16_bit_product_says_what_to_audit():
    def f(w, x):
        return jnp.sum(x @ w)

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    assert "audit(autocast(f), ...)" in str(mpjax.audit(f, w, x))
    # ... and not where products do run in 16 bits, or where there are none.
    assert "no product" not in str(mpjax.audit(jax.grad(mpjax.autocast(f)), w, x))
    assert "no product" not in str(mpjax.audit(jnp.sin, w))
    # float8 products are narrower than 16 bits by their author's choice: no hint
    def fp8(w, x):
        f8 = jnp.float8_e4m3fn
        return jnp.matmul(x.astype(f8), w.astype(f8), preferred_element_type=jnp.float32)

    assert "no product" not in str(mpjax.audit(fp8, w, x))


def test_audit_of_a_gradient_is_not_confused_with_the_autocast_function():
    report = mpjax.audit(jax.grad(mpjax.autocast(lambda w: jnp.sum(w @ w))), jnp.ones((3, 3)))
    assert report.casts_inserted is None
    assert report.low_precision_fraction == 1.0


def test_audit_rejects_non_callables():
    with pytest.raises(TypeError, match="audit\\(fun, ...\\): fun must be callable"):
        mpjax.audit("f", 1)


def test_bfloat16_casts_are_counted():
    report = mpjax.audit(
        mpjax.autocast(lambda w: jnp.sum(w @ w), dtype=jnp.bfloat16), jnp.ones((3, 3))
    )
    # w down, once for both operands; the product's bfloat16 result widened for
    # the sum.
    assert report.float_casts == report.casts_inserted == 2


def test_a_cond_counts_the_flops_of_its_costliest_branch():
    """One branch runs. mpjax's own bfloat16 weight-gradient product is a cond
    (`lax.platform_dependent`): its gradient counts as float16's does."""
    w, x = jnp.ones((64, 10)), jnp.ones((32, 64))
    one = 2 * 32 * 64 * 10

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    for dtype in (jnp.float16, jnp.bfloat16):
        report = mpjax.audit(jax.grad(mpjax.autocast(loss, dtype=dtype)), w, x)
        assert report.matmul_flops == 2 * one  # the forward product, the weight gradient
        assert report.low_precision_fraction == 1.0

    def switch(w, x, i):
        branches = [
            lambda: jnp.sum(x @ w),
            lambda: jnp.sum(x @ w @ w.T @ w),  # three products: the costliest
            lambda: jnp.sum(x),
        ]
        return lax.switch(i, branches)

    report = mpjax.audit(mpjax.autocast(switch), w, x, jnp.int32(0))
    assert report.matmul_flops == 3 * one
    assert sum(e.primitive == "dot_general" for e in report.equations) == 4  # all listed


def test_a_product_nothing_reads_is_not_counted_inside_a_loop_either():
    # jit drops a scan's output nobody reads, and the product that makes it.
    w = jnp.ones((4, 4))

    def f(c, xs):
        c, _ = lax.scan(lambda c, x: (jnp.tanh(c + x), x @ w), c, xs)
        return c

    report = mpjax.audit(mpjax.autocast(f), jnp.ones(4), jnp.ones((3, 4)))
    assert report.matmul_flops == 0 and not report.find("dot_general")


def test_audit_takes_shapes_alone_and_passes_a_keyword_named_fun():
    f = mpjax.autocast(lambda w, x: x @ w)
    shapes = jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((2, 4), jnp.float32)
    assert mpjax.audit(f, *shapes).matmul_flops == 2 * 2 * 4 * 3
    g = mpjax.autocast(lambda w, fun: fun @ w)
    assert mpjax.audit(g, jnp.ones((4, 3)), fun=jnp.ones((2, 4))).matmul_flops == 48


def test_an_nnx_module_is_audited_as_it_runs():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dense(x))

    model = Net(nnx.Rngs(0))
    before = nnx.state(model)
    assert mpjax.audit(model, jnp.ones((2, 4))).matmul_flops == 2 * 2 * 4 * 8
    chex.assert_trees_all_equal(nnx.state(model), before)


def test_a_sparse_product_is_named_not_counted_as_a_share():
    # jax.experimental.sparse's products run as traced, in float32: "100.0% of 0"
    # would read as full 16-bit coverage.
    from jax.experimental import sparse

    m = sparse.BCOO.fromdense(jnp.eye(8) * 2.0)
    text = str(mpjax.audit(mpjax.autocast(lambda m, x: jnp.tanh(m @ x).sum()), m, jnp.ones((8, 4))))
    assert "100.0%" not in text and "none, no dense product or convolution" in text
    assert "not counted: bcoo_dot_general, run as traced" in text


def test_no_16_bit_product_says_why_for_an_autocast_function_and_for_another():
    a = 2 * jnp.eye(4)
    # jnp.linalg asks its products for HIGHEST precision: autocast keeps them as written.
    kept = str(mpjax.audit(mpjax.autocast(jnp.linalg.inv), a)).splitlines()[-1]
    assert "autocast ran each as written" in kept and "HIGHEST" in kept
    plain = str(mpjax.audit(lambda a: a @ a, a)).splitlines()[-1]
    assert "audit the function autocast returns" in plain
