"""Corner cases of autocast a user meets in real programs: infinities in masks,
explicit accumulation dtypes, Flax NNX's functional API, repeated eager calls,
deeply nested loops, custom_vmap."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import checkify
import pytest
from flax import nnx
from conftest import BF16, F16, F32, all_eqns, rel_tol

import mpjax


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


def test_a_mask_fill_is_kept_as_written_and_so_are_infinities_and_nan(low):
    # A finite fill the low dtype cannot hold (-1e9 in float16) runs its selection
    # in float32, exactly: neither -inf nor -65504, which a later comparison with
    # the same constant would tell from it. Infinities and NaN are kept as written.
    def f(x, w):
        i = jnp.arange(4)  # computed from literals only: weak
        fill = jnp.where(
            i == 0, -1e9, jnp.where(i == 1, -jnp.inf, jnp.where(i == 2, jnp.inf, jnp.nan))
        )
        y = x @ w
        return jnp.where(y[0] > 0, y[0], fill)

    x, w = jnp.zeros((2, 3)), jnp.zeros((3, 4))
    out = mpjax.autocast(f, dtype=low)(x, w)
    held = float(jnp.finfo(low).max) > 1e9  # bfloat16 holds -1e9, rounded
    fill = float(jnp.asarray(-1e9, low)) if held else -1e9
    np.testing.assert_array_equal(out[:3], [fill, -np.inf, np.inf])
    assert np.isnan(out[3])


@pytest.mark.parametrize("source", [F32, BF16], ids=["f32", "bf16"])
def test_a_saturating_cast_to_float16_stays_finite(source):
    # The bound in the source dtype rounds down: 65504 in bfloat16 is 65536,
    # which float16 holds as inf.
    from mpjax._casting import convert

    top = 65504.0 if source == F32 else 65280.0  # the largest bfloat16 below 65504
    x = np.array([1e5, -1e5, 7e4, np.inf, -np.inf], source)
    for value in (x, jnp.asarray(x)):  # a literal, an array
        out = np.asarray(convert(value, F16, saturate=True), np.float32)
        np.testing.assert_array_equal(out, [top, -top, top, np.inf, -np.inf])


def test_a_sentinel_fill_still_equals_itself_later(low):
    """``min(where(valid, d, 1e9))`` then ``d >= 1e9``: the fill and the
    comparison must see the same number (a saturated fill never reached 1e9)."""
    x, w = _xw()
    valid = jnp.array([[True] * 5, [False] * 5, [True, False] * 2 + [True], [False] * 5])

    def nearest(x, w):
        d = jnp.min(jnp.where(valid, jnp.abs(x @ w), 1e9), axis=1)
        return jnp.where(d >= 1e9, 0.0, d), jnp.where(valid, x @ w, 1e6) / 1e6

    (got, scaled), (want, scaled_want) = mpjax.autocast(nearest, dtype=low)(x, w), nearest(x, w)
    np.testing.assert_array_equal(np.asarray(got)[[1, 3]], 0.0)
    np.testing.assert_allclose(got, want, rtol=4 * rel_tol(low), atol=1e-3)
    np.testing.assert_array_equal(np.asarray(scaled)[~np.asarray(valid)], 1.0)


_CONSTANTS = {
    "full_tiny": lambda y: y * jnp.full(y.shape, 1e-8),
    "full_huge": lambda y: y * jnp.full(y.shape, 1e9),
    "divide": lambda y: y / jnp.full(y.shape, 1e-6),
    "log_where": lambda y: jnp.log(jnp.where(y > 0, y, 1e-10)),
    "add_computed": lambda y: y[0] + jnp.where(jnp.arange(3) == 0, -1e9, jnp.arange(3) * 1e-9),
    "large_broadcast": lambda y: jnp.tile(y, (1, 400)) * jnp.full((4, 1200), 1e-8),
    # arithmetic on constants too large to evaluate at trace time, followed as sets
    "large_arithmetic": lambda y: jnp.tile(y, (1, 400)) * (jnp.ones((4, 1200)) * 1e5),
    "large_mask_bias": lambda y: (
        jnp.tile(y, (1, 400)) + (1.0 - jnp.tril(jnp.ones((4, 1200)))) * -1e9
    ),
    # within a body a higher-order primitive traces again, the values are known
    "in_a_checkpoint": lambda y: _in_checkpoint(jnp.full(y.shape, 1e-8), jnp.multiply, y),
    "scanned_over": lambda y: lax.scan(
        lambda h, c: (h, h * c), y, jnp.full((2, *y.shape), 1e-8)
    )[1],
    # a sum of a constant too large to evaluate at trace time, unknown: divided by
    # in float32, not cast (81920 and 131328, a large mask's count, saturate)
    "sum_of_a_large_constant": lambda y: (y * 1024.0) / jnp.sum(jnp.full(2048, 40.0)),
    "count_of_a_large_mask": lambda y: (y * 1024.0) / jnp.sum(jnp.tril(jnp.ones((512, 512)))),
}


def _in_checkpoint(c, f, x):
    return jax.checkpoint(lambda x: f(c, x))(x)


def _times(c, x):
    return x @ c


@pytest.mark.parametrize("name", list(_CONSTANTS))
def test_constants_the_low_dtype_cannot_hold_are_computed_as_written(low, name):
    # As for a literal (``y * 1e-8``): a constant the program makes from literals
    # (``jnp.full``, ``jnp.where``'s fill, arithmetic on them) and the low dtype
    # cannot hold runs its operation in float32 instead of flushing it to 0 or inf.
    x, w = _xw()
    f = lambda x, w: _CONSTANTS[name](x @ w[:, :3])
    got, want = jax.jit(mpjax.autocast(f, dtype=low))(x, w), f(x, w)
    assert np.all(np.isfinite(want)) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=4 * rel_tol(low))


@pytest.mark.parametrize("policy", ["torch", "lean"])
def test_a_count_autocast_cannot_know_divides_in_float32_under_either_policy(policy):
    # A mean over a large causal mask: its count, 131328, is a sum too large to
    # evaluate at trace time, which float16 cannot hold; cast, it would saturate to
    # 65504 and double the result. The lean policy rounds a constant it knows, as
    # Flax's dtype= does, but applies one it does not know in float32 too.
    x, w = _xw()
    f = lambda x, w: ((x @ w) * 1024.0) / jnp.sum(jnp.tril(jnp.ones((512, 512))))  # noqa: E731
    got = jax.jit(mpjax.autocast(f, dtype=jnp.float16, policy=policy))(x, w)
    np.testing.assert_allclose(got, f(x, w), rtol=4 * rel_tol(jnp.float16))


# A frozen weight closed over as a jax.Array, as a NumPy one: its values are known.
_TINY, _HUGE = jnp.full((8, 3), 1e-8), jnp.linspace(1e5, 2e5, 24).reshape(8, 3)
_PRODUCT_CONSTANTS = {
    "tiny": lambda x: x @ jnp.full((8, 3), 1e-8),
    "huge": lambda x: (x * 1e-3) @ jnp.full((8, 3), 1e5),
    "closed_over": lambda x: x @ np.linspace(1e5, 2e5, 24, dtype=np.float32).reshape(8, 3),
    "closed_over_tiny_array": lambda x: x @ _TINY,
    "closed_over_huge_array": lambda x: (x * 1e-3) @ _HUGE,
    "conv_tiny": lambda x: lax.conv_general_dilated(
        x[None, None], jnp.full((1, 1, 3, 3), 1e-8), (1, 1), "SAME"
    ),
    # within a body a higher-order primitive traces again, the values are known
    "tiny_in_a_checkpoint": lambda x: _in_checkpoint(jnp.full((8, 3), 1e-8), _times, x),
    "tiny_in_a_cond": lambda x: _in_cond(jnp.full((8, 3), 1e-8), x),
    "tiny_in_a_custom_jvp": lambda x: _custom_product(x, jnp.full((8, 3), 1e-8)),
    # a power of two moved from the scale onto the constant keeps it known
    "tiny_then_scaled": lambda x: (x @ jnp.full((8, 3), 1e-8)) * 0.125,
    "huge_then_scaled": lambda x: (x @ jnp.full((8, 3), 1e6)) * 0.125,
}


def _in_cond(c, x):
    return lax.cond(jnp.all(jnp.isfinite(x)), lambda h: h @ c, lambda h: h[:, :3], x)


@jax.custom_jvp
def _custom_product(x, c):
    return x @ c


_custom_product.defjvp(lambda p, t: (_custom_product(*p), t[0] @ p[1] + p[0] @ t[1]))


@pytest.mark.parametrize("name", list(_PRODUCT_CONSTANTS))
def test_a_product_of_a_constant_the_low_dtype_cannot_hold_runs_as_written(low, name):
    # Cast to float16, 1e-8 is 0 and 1e5 saturates to 65504: the product would be 0,
    # or finite and wrong, and a loss scaler would see nothing to skip.
    x = jax.random.normal(jax.random.key(0), (4, 8))
    f = _PRODUCT_CONSTANTS[name]
    got, want = jax.jit(mpjax.autocast(f, dtype=low))(x), f(x)
    assert np.all(np.isfinite(want)) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=4 * rel_tol(low))


def test_a_constant_weight_with_some_tiny_elements_stays_a_16_bit_product(low):
    # A constant's scale decides, not its smallest element: a frozen weight closed
    # over by the loss has elements below float16's normal range, as a trained
    # parameter does, and its product runs in 16 bits as the parameter's would.
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = 0.3 * np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    w[0, 0], w[1, 1] = 1e-9, 0.0
    jaxpr = jax.make_jaxpr(mpjax.autocast(lambda x: x @ w, dtype=low))(x)
    assert _dot_operand_dtypes(jaxpr) == [(low, low)]


def test_a_sum_started_from_float32_zeros_runs_in_float32(low):
    # acc = jnp.zeros(...), then acc + x @ w in a Python loop: the zeros are float32,
    # so the sum is, as in torch (and as a lax.fori_loop's float32 carry is).
    x = jax.random.normal(jax.random.key(0), (4, 8))
    ws = jax.random.normal(jax.random.key(1), (64, 8, 8)) * 0.3 + 0.2

    def unrolled(x, ws, start):
        acc = start(x)
        for i in range(64):
            acc = acc + x @ ws[i]
        return acc

    def looped(x, ws):
        return jax.lax.fori_loop(0, 64, lambda i, a: a + x @ ws[i], jnp.zeros((4, 8)))

    want = unrolled(x, ws, jnp.zeros_like)
    run = lambda f: jax.jit(mpjax.autocast(f, dtype=low))(x, ws)
    loop_error = np.max(np.abs(run(looped) - want))
    for start in (lambda x: jnp.zeros((4, 8)), jnp.zeros_like):
        f = functools.partial(unrolled, start=start)
        assert np.max(np.abs(run(f) - want)) <= 1.1 * loop_error
        adds = [e for e in all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=low))(x, ws))]
        adds = [e for e in adds if e.primitive.name == "add" and e.outvars[0].aval.ndim == 2]
        assert len(adds) == 64 and all(e.outvars[0].aval.dtype == F32 for e in adds)
    # A Python 0.0 is weakly typed: it starts nothing and widens no add.
    f = lambda x, w: (x @ w[0] + 0.0) @ w[1]
    eqns = all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=low))(x, ws))
    (add,) = [e for e in eqns if e.primitive.name == "add"]
    assert add.outvars[0].aval.dtype == low


# --- an explicit preferred_element_type is kept ------------------------------------


def _halves(*shapes):
    keys = jax.random.split(jax.random.key(1), len(shapes))
    return [jax.random.normal(k, s).astype(jnp.float16) for k, s in zip(keys, shapes)]


def test_explicit_float32_accumulation_of_a_dot_is_kept():
    a, b = _halves((64, 512), (512, 64))
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)

    def f(a, b):
        return jax.lax.dot(a, b, preferred_element_type=jnp.float32)

    for low in (jnp.float16, jnp.bfloat16):
        out = jax.jit(mpjax.autocast(f, dtype=low))(a, b)
        assert out.dtype == F32
        if low == jnp.float16:  # float16 operands, float32 sums: as without autocast
            np.testing.assert_allclose(out, f(a, b), rtol=1e-6, atol=1e-5)
            assert np.max(np.abs(out - ref)) < 1e-4  # a float16 result is off by 3e-3
    # jnp's own default (float32 x float32 -> float32) still multiplies in float16.
    (dot,) = [
        e
        for e in all_eqns(
            jax.make_jaxpr(mpjax.autocast(lambda a, b: a @ b))(a.astype(F32), b.astype(F32))
        )
        if e.primitive.name == "dot_general"
    ]
    assert dot.invars[0].aval.dtype == jnp.float16


def test_explicit_float32_accumulation_of_a_conv_is_kept():
    x, k = _halves((2, 16, 12, 12), (8, 16, 3, 3))
    ref = jax.lax.conv(np.asarray(x, np.float32), np.asarray(k, np.float32), (1, 1), "SAME")

    def f(x, k):
        return jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", preferred_element_type=jnp.float32
        )

    out = jax.jit(mpjax.autocast(f))(x, k)
    assert out.dtype == F32
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


# --- precision=HIGHEST on a product is kept ----------------------------------------


def test_explicit_highest_precision_product_runs_as_written():
    x, w = jnp.full((2, 3), 1.0 + 2**-12), jnp.ones((3, 2))
    precise = lambda w, x: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    algorithm = lambda w, x: jnp.dot(x, w, precision=jax.lax.DotAlgorithmPreset.F32_F32_F32)
    for f in (precise, algorithm):
        np.testing.assert_array_equal(jax.jit(mpjax.autocast(f))(w, x), f(w, x))
        assert mpjax.audit(mpjax.autocast(f), w, x).casts_inserted == 0
        grads = jax.grad(lambda w, x: mpjax.autocast(f)(w, x).sum(), (0, 1))(w, x)
        chex.assert_trees_all_equal(grads, jax.grad(lambda w, x: f(w, x).sum(), (0, 1))(w, x))
    # jax.default_matmul_precision sets every product's precision; autocast still
    # runs them in 16 bits, as torch.autocast does under allow_tf32=False.
    with jax.default_matmul_precision("highest"):
        (dot,) = [
            e
            for e in all_eqns(jax.make_jaxpr(mpjax.autocast(lambda w, x: x @ w))(w, x))
            if e.primitive.name == "dot_general"
        ]
    assert dot.invars[0].aval.dtype == F16

    # The context inside the function writes HIGHEST into its products, as an
    # explicit precision= does: they run as written (documented in policy.md).
    def inside(w, x):
        with jax.default_matmul_precision("float32"):
            return x @ w

    np.testing.assert_array_equal(jax.jit(mpjax.autocast(inside))(w, x), inside(w, x))


@pytest.mark.parametrize("low", [F16, BF16], ids=["f16", "bf16"])
def test_an_activation_read_by_a_highest_precision_product_is_not_rounded(low):
    # A GELU read only by products runs as one function that rounds its result for
    # them, unless a product runs as written: it reads the float32 GELU, unrounded.
    shapes = [(8, 32), (32, 32), (32, 4)]
    x, w1, w2 = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate(shapes))

    def f(x, w1, w2):
        return jnp.dot(jax.nn.gelu(x @ w1), w2, precision=jax.lax.Precision.HIGHEST)

    h = jax.nn.gelu((x.astype(low) @ w1.astype(low)).astype(F32))
    want = jnp.dot(h, w2, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(mpjax.autocast(f, dtype=low)(x, w1, w2), want, rtol=1e-6, atol=1e-6)
    eqns = all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=low))(x, w1, w2))
    rounded = [
        e.invars[0]
        for e in eqns
        if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == low
    ]
    assert len(rounded) == 2  # x and w1, for the first product; nothing after it


# --- Flax NNX's functional API: nnx.State arguments and outputs are pytrees --------


def _nnx_split_loss():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.head = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.bn(self.linear(x))))

    graphdef, params, rest = nnx.split(Model(nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest, copy=True)
        value = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        return value, nnx.state(model, nnx.BatchStat)

    x = 2.0 * jax.random.normal(jax.random.key(1), (32, 8)) + 1.0
    y = jax.random.randint(jax.random.key(2), (32,), 0, 3)
    return nnx, loss, (params, rest, x, y)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nnx_split_state_through_autocast(jit):
    nnx, loss, args = _nnx_split_loss()
    rest = args[1]
    step = jax.value_and_grad(mpjax.autocast(loss), has_aux=True)
    step = jax.jit(step) if jit else step
    (value, stats), grads = step(*args)
    (ref_value, ref_stats), ref_grads = jax.value_and_grad(loss, has_aux=True)(*args)

    assert isinstance(stats, nnx.State) and isinstance(grads, nnx.State)
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert g.dtype == F32
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-3)
    old = jax.tree.leaves(nnx.filter_state(rest, nnx.BatchStat))
    for s, r, o in zip(jax.tree.leaves(stats), jax.tree.leaves(ref_stats), old, strict=True):
        assert s.dtype == F32
        assert not np.allclose(s, o)  # the running statistics moved
        np.testing.assert_allclose(s, r, rtol=1e-2, atol=1e-3)


# --- weakly typed outputs stay weak -----------------------------------------------


def test_weakly_typed_outputs_stay_weak():
    # A schedule value built from Python floats is weak; what autocast returns
    # from it must promote as plain JAX's does (float16 * weak float32 = float16).
    def f(s, x):
        return s * 2, x * 2, s * x, jnp.sum(x) * s

    s, x = jnp.asarray(3.0), jnp.ones(3)
    want = f(s, x)
    assert [o.weak_type for o in want] == [True, False, False, False]
    for g in (mpjax.autocast(f), jax.jit(mpjax.autocast(f))):
        got = g(s, x)
        assert [o.weak_type for o in got] == [o.weak_type for o in want]
        assert [(jnp.ones(3, jnp.float16) * o).dtype for o in got] == [F16, F32, F32, F32]
    batched = jax.vmap(mpjax.autocast(f), in_axes=(None, 0))(s, jnp.ones((2, 3)))
    assert batched[0].weak_type


def test_the_gradient_of_a_weakly_typed_argument_is_weak():
    # As without autocast: a step ``p16 - lr * g`` on it stays float16.
    def f(s, x):
        return jnp.sum(jnp.tanh(x @ x.T)) * s * 2.0

    x = jnp.ones((2, 3))
    for s in (0.7, jnp.asarray(0.7)):
        got, want = jax.grad(mpjax.autocast(f))(s, x), jax.grad(f)(s, x)
        assert want.weak_type and got.weak_type
        assert (jnp.ones(2, jnp.float16) - 0.1 * got).dtype == F16
        np.testing.assert_allclose(got, want, rtol=1e-2)


# --- eager calls trace once per argument signature ---------------------------------


def _counting(fn):
    calls = []

    def f(*args, **kwargs):
        calls.append(1)  # a Python side effect: runs at trace time only
        return fn(*args, **kwargs)

    return f, calls


def _mlp(x, w, scale=1.0):
    return jnp.tanh(x @ w) * scale, jnp.sum(x @ w)


def test_eager_calls_trace_once_per_signature():
    f, calls = _counting(_mlp)
    g = mpjax.autocast(f)
    x, w = _xw()
    outs = [g(x, w) for _ in range(5)]
    assert len(calls) == 1
    fresh = mpjax.autocast(_mlp)(x, w)  # a first call: traced, never cached
    for out in outs:
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(fresh), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    g(x[:2], w)  # a new shape
    g(x.astype(jnp.bfloat16), w)  # a new dtype
    g(x, w, scale=2.0)  # a new static value
    g(x, w, scale=2)  # an int traces differently from a float
    assert len(calls) == 5
    g(x[:2], w), g(x, w, scale=2.0)
    assert len(calls) == 5


def test_eager_cache_tells_signed_zeros_and_nan_apart():
    f, calls = _counting(lambda x, s: x / s)
    g = mpjax.autocast(f)
    x = jnp.ones(2)
    for s in (0.0, -0.0, 0.0, -0.0):
        np.testing.assert_array_equal(g(x, s), x / s)
    assert len(calls) == 2
    assert np.isnan(g(x, float("nan"))).all() and np.isnan(g(x, float("nan"))).all()
    assert len(calls) == 3  # one NaN signature, whatever the NaN object


def test_eager_cache_is_bounded_and_skips_unhashable_statics():
    f, calls = _counting(lambda x, opts: x * opts["k"])
    g = mpjax.autocast(f)
    g(jnp.ones(3), {"k": 2.0}), g(jnp.ones(3), {"k": 2.0})
    assert len(calls) == 1
    h, h_calls = _counting(lambda x, table: x * table[0])
    k = mpjax.autocast(h)
    unhashable = type("Table", (), {"__hash__": None, "__getitem__": lambda s, i: 2.0})()
    k(jnp.ones(3), unhashable), k(jnp.ones(3), unhashable)
    assert len(h_calls) == 2  # an unhashable static leaf: traced at every call
    for n in range(10, 74):  # 64 new signatures: with shape 3, one more than it holds
        g(jnp.ones(n), {"k": 2.0})
    before = len(calls)
    g(jnp.ones(3), {"k": 2.0})  # shape 3 was used longest ago: evicted
    assert len(calls) == before + 1


def test_eager_cache_tells_apart_which_arguments_are_arrays():
    # Two leaves in both calls: an array and a static 2, swapped. Each is its own
    # signature, positionally or by keyword.
    x = jnp.array([10.0, 20.0])
    sub = lambda a, b: a - b  # noqa: E731
    g = mpjax.autocast(sub)
    for args in ((x, 2), (2, x), (x, 2)):
        chex.assert_trees_all_equal(g(*args), sub(*args))
    for kwargs in ({"a": x, "b": 2}, {"a": 2, "b": x}):
        chex.assert_trees_all_equal(g(**kwargs), sub(**kwargs))
    lerp = lambda a, b, t: a + (b - a) * t  # noqa: E731
    h = mpjax.autocast(lerp)
    for args in ((x, 0.0, 0.25), (0.0, x, 0.25)):
        chex.assert_trees_all_equal(h(*args), lerp(*args))


def test_eager_calls_return_objects_of_their_own():
    # A returned NumPy buffer or set is fresh at every call, as `fun` returns it.
    def f(x):
        return x * 2, np.zeros(3), set()

    g = mpjax.autocast(f)
    _, counts, tags = g(jnp.ones(3))
    counts += 1
    tags.add("seen")
    _, counts2, tags2 = g(jnp.ones(3))
    np.testing.assert_array_equal(counts2, np.zeros(3))
    assert tags2 == set() and counts2 is not counts
    h, calls = _counting(lambda x: (x * 2, "tag", 3))  # immutable: the trace is reused
    k = mpjax.autocast(h)
    assert k(jnp.ones(3))[1:] == k(jnp.ones(3))[1:] == ("tag", 3)
    assert len(calls) == 1


def test_eager_calls_see_a_rebound_global_with_simplified_jaxpr_constants():
    # With this JAX option a closed-over array is a literal of the jaxpr, not a
    # constant: the trace that holds it must not be reused either.
    x = jnp.ones((2, 3))
    box = {"b": jnp.ones(3)}
    jax.config.update("jax_use_simplified_jaxpr_constants", True)
    try:
        g = mpjax.autocast(lambda x: x * box["b"])
        np.testing.assert_array_equal(g(x), x)
        box["b"] = jnp.full(3, 7.0)
        np.testing.assert_array_equal(g(x), 7 * x)
    finally:
        jax.config.update("jax_use_simplified_jaxpr_constants", False)


def test_eager_cache_never_keeps_values_of_an_outer_trace():
    # Under jit, `fn` closes over a tracer; the next trace must not see the old one.
    @jax.jit
    def outer(y):
        return mpjax.autocast(lambda x: x * y)(jnp.ones(3))

    np.testing.assert_array_equal(outer(2.0), 2.0)
    np.testing.assert_array_equal(outer(3.0), 3.0)
    inner = mpjax.autocast(lambda x: x + 1.0)
    np.testing.assert_array_equal(jax.jit(lambda y: inner(jnp.ones(3)) * y)(2.0), 4.0)
    np.testing.assert_array_equal(inner(jnp.ones(3)), 2.0)


def test_eager_calls_see_arrays_and_objects_that_changed_since_the_last_call():
    """A trace is reused only where nothing it read can have changed: a model
    object wrapped as the function, a global array, a config object argument."""
    x = jnp.ones((1, 2))
    weights = {"w": jnp.ones((2, 2))}
    predict = mpjax.autocast(lambda x: x @ weights["w"])
    np.testing.assert_array_equal(predict(x), [[2.0, 2.0]])
    weights["w"] = weights["w"] * 10  # trained further
    np.testing.assert_array_equal(predict(x), [[20.0, 20.0]])

    config = type("Config", (), {"temperature": 1.0})()
    scaled = mpjax.autocast(lambda x, c: x / c.temperature)
    np.testing.assert_array_equal(scaled(x, config), x)
    config.temperature = 4.0
    np.testing.assert_array_equal(scaled(x, config), x / 4)

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    forward = mpjax.autocast(model)
    forward(x)
    model.kernel[...] = model.kernel[...] * 10
    np.testing.assert_allclose(forward(x), model(x), rtol=1e-2)


# --- nested loops: trace time linear in the depth ----------------------------------


def _nested(depth, kind):
    def loop(c, d):
        if d == 0:
            return jnp.tanh(c)
        if kind == "scan":
            return jax.lax.scan(
                lambda c, x: (loop(c * x, d - 1), None), c, jnp.ones((2, *c.shape))
            )[0]
        if kind == "while":
            return jax.lax.while_loop(lambda c: c.sum() < 0, lambda c: loop(c, d - 1), c)
        return jax.lax.cond(c.sum() > 0, lambda c: loop(c, d - 1), lambda c: c, c)

    return lambda c, w: loop(c @ w, depth).sum()


@pytest.mark.parametrize("kind", ["scan", "while", "cond"])
def test_nested_loop_bodies_are_evaluated_linearly_often(kind, monkeypatch):
    # How often autocast evaluates the innermost body (its one `tanh`) when
    # tracing 1 to 5 nested loops. Each loop probes its body for its dtypes,
    # then traces it; done naively, an inner loop is probed and traced again in
    # each evaluation of the outer body: 2**depth.
    from mpjax import first_order

    evaluations = []
    rule = first_order.policy_rule

    def counting(ctx, eqn, vals, weak):
        evaluations.append(eqn.primitive.name == "tanh")
        return rule(ctx, eqn, vals, weak)

    monkeypatch.setattr(first_order, "policy_rule", counting)
    counts = []
    c, w = jnp.ones((4, 4)), jnp.ones((4, 4))
    for depth in range(1, 6):
        evaluations.clear()
        jax.make_jaxpr(mpjax.autocast(_nested(depth, kind)))(c, w)
        counts.append(sum(evaluations))
    assert np.all(np.diff(counts, 2) == 0) and counts[-1] <= 2 * 5, counts  # not 2**depth
    # The result is the same program, in float32 where it should be.
    f = _nested(3, kind)
    np.testing.assert_allclose(mpjax.autocast(f)(c, w), f(c, w), rtol=1e-2)


def test_one_loop_called_with_two_literals_solves_each():
    # A jitted helper's jaxpr is shared by its call sites; its loop's carry dtype
    # depends on the literal it gets (1e-8 is not a float16 number: float32).
    @jax.jit
    def helper(c, eps):
        return jax.lax.fori_loop(0, 3, lambda i, c: c * eps + c, c)

    def f(x, w):
        h = x @ w
        return helper(h, 1e-8), helper(h, 0.5)

    x, w = _xw()
    (tiny, half), (tiny_ref, half_ref) = mpjax.autocast(f)(x, w), f(x, w)
    np.testing.assert_allclose(tiny, tiny_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(half, half_ref, rtol=2e-2, atol=2e-2)
    carries = [
        e.outvars[1].aval.dtype
        for e in jax.make_jaxpr(mpjax.autocast(f))(x, w).eqns
        if e.primitive.name in ("scan", "while")
    ]
    assert carries == [F32, jnp.float16]


# --- loops inside shard_map: probes keep the varying manual axes -------------------


def test_loops_inside_shard_map_mix_replicated_and_sharded_values():
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))

    def local(w, x):  # w replicated, x sharded: the loops mix both
        def step(c, _):
            c = jax.lax.cond(c.sum() > 0, lambda c: jnp.tanh(c @ w), lambda c: c, c)
            c = jax.lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ w), c)
            return c, c.sum()

        c, ys = jax.lax.scan(step, x, None, length=3)
        return jax.lax.psum(c.sum() + ys.sum(), "data")

    def run(wrap):
        specs = {"mesh": mesh, "in_specs": (P(), P("data")), "out_specs": P()}
        return jax.jit(jax.shard_map(lambda w, x: wrap(local)(w, x), **specs))

    w = 0.5 * jnp.eye(4) + 0.1
    x = jax.random.normal(jax.random.key(0), (8, 4))
    out = run(mpjax.autocast)(w, x)
    assert out.dtype == F32
    np.testing.assert_allclose(out, run(lambda f: f)(w, x), rtol=2e-2)


# --- custom_vmap: function and rule both under the policy --------------------------


def _dot_operand_dtypes(jaxpr):
    return [
        tuple(v.aval.dtype for v in e.invars)
        for e in all_eqns(jaxpr)
        if e.primitive.name == "dot_general"
    ]


def test_custom_vmap_function_and_rule_run_under_the_policy(low):
    rule_calls = []

    @jax.custom_batching.custom_vmap
    def layer(x, w):
        return jnp.tanh(x @ w)

    @layer.def_vmap
    def layer_rule(axis_size, in_batched, x, w):
        rule_calls.append(in_batched)
        return jnp.tanh(jnp.einsum("bij,jk->bik", x, w)), in_batched[0]

    xs, w = jax.random.normal(jax.random.key(0), (4, 2, 8)), _xw()[1]
    # Unbatched: the function's product runs in `low`.
    assert _dot_operand_dtypes(jax.make_jaxpr(mpjax.autocast(layer, dtype=low))(xs[0], w)) == [
        (low, low)
    ]
    # Batched: the user's rule runs, and its product runs in `low` too.
    batched = jax.vmap(mpjax.autocast(layer, dtype=low), in_axes=(0, None))
    assert _dot_operand_dtypes(jax.make_jaxpr(batched)(xs, w)) == [(low, low)]
    assert rule_calls == [[True, False]]
    out, ref = jax.jit(batched)(xs, w), jax.vmap(layer, in_axes=(0, None))(xs, w)
    assert out.dtype == F32
    np.testing.assert_allclose(out, ref, rtol=rel_tol(low), atol=rel_tol(low))
    # Forward-mode derivatives go through the rebuilt function too.
    tangent = jax.jvp(mpjax.autocast(layer, dtype=low), (xs[0], w), (xs[0], w))[1]
    ref_tangent = jax.jvp(layer, (xs[0], w), (xs[0], w))[1]
    assert tangent.dtype == F32
    np.testing.assert_allclose(tangent, ref_tangent, rtol=rel_tol(low), atol=rel_tol(low))


def test_stack_runs_in_the_widest_input(low):
    # jnp.stack is the `stack` primitive on these JAX versions: a policy op like
    # concatenate, so stacking two low-precision products stays low precision.
    def f(x, w, b):
        h = x @ w
        return jnp.stack([h, 2 * h]), jnp.stack([h, b])

    x, w = _xw()
    b = jnp.ones((4, 5))
    jaxpr = jax.make_jaxpr(mpjax.autocast(f, dtype=low))(x, w, b)
    stacks = [e for e in jaxpr.eqns if e.primitive.name == "stack"]
    if not stacks:
        pytest.skip(f"jnp.stack is not a primitive on jax {jax.__version__}")
    assert [e.outvars[0].aval.dtype for e in stacks] == [low, F32]
    for got, ref in zip(mpjax.autocast(f, dtype=low)(x, w, b), f(x, w, b)):
        assert got.dtype == F32
        np.testing.assert_allclose(got, ref, rtol=rel_tol(low), atol=rel_tol(low))


# --- re-bound primitives under grad ----------------------------------------------


def test_grad_of_autocast_leaves_no_calls_of_its_own():
    # Under grad, autocast binds each primitive through an inlined jit (so JAX
    # linearizes each distinct one once); nothing of it may stay in the program.
    def f(w, x):
        for _ in range(3):
            x = jnp.tanh(jax.lax.dot(x, w)) * 0.5
        return jnp.sum(x * x)

    x, w = jax.random.normal(jax.random.key(0), (4, 8)), 0.3 * jnp.eye(8)
    jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(f)))(w, x)
    assert not [e for e in all_eqns(jaxpr) if e.primitive.name in ("jit", "pjit")]
    grads = jax.jit(jax.grad(mpjax.autocast(f)))(w, x)
    np.testing.assert_allclose(grads, jax.grad(f)(w, x), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(
    "pattern, a_shape, b_shape",
    [
        ("ij,jk->ik", (24, 16), (16, 16)),  # a square weight keeps its shape transposed
        ("bti,io->bto", (2, 6, 16), (16, 16)),
        ("ijk,kl->ijl", (3, 5, 16), (16, 12)),
        ("ik,jk->ij", (24, 16), (12, 16)),
        ("ki,kj->ij", (24, 16), (24, 16)),
        ("bik,bkj->bij", (3, 8, 16), (3, 16, 16)),
        ("ibk,kj->bij", (8, 3, 16), (16, 12)),
        ("bqhd,bkhd->bhqk", (2, 8, 2, 16), (2, 6, 2, 16)),
    ],
)
def test_product_gradients_of_every_layout_match_float32(low, pattern, a_shape, b_shape):
    # Each operand's gradient is a product laid out as the operand where its operands
    # can be ordered so (a weight's), else a product transposed after: an axis put in
    # the wrong place would keep a square operand's shape, and be wrong.
    ka, kb, kc = jax.random.split(jax.random.key(0), 3)
    a, b = jax.random.normal(ka, a_shape), jax.random.normal(kb, b_shape)
    c = jax.random.normal(kc, jnp.einsum(pattern, a, b).shape)  # no symmetry to hide in

    def loss(a, b):
        return jnp.sum(jnp.einsum(pattern, a, b) * c)

    got = jax.grad(mpjax.autocast(loss, dtype=low), argnums=(0, 1))(a, b)
    for g, want in zip(got, jax.grad(loss, argnums=(0, 1))(a, b)):
        assert g.dtype == F32 and g.shape == want.shape
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(g, want, rtol=0, atol=rel_tol(low) * scale)


# --- values whose meaning depends on their dtype -------------------------------------


def test_complex_times_float32_product_keeps_the_imaginary_part(low):
    """complex values are never cast; a product of one with a float32 weight runs
    as written (a complex x 16-bit product to a float32 result drops the imaginary part)."""
    x = jnp.array([[1 + 2j, 3 - 1j]], jnp.complex64)
    w = jnp.array([[1.0, 0.0], [0.0, 2.0]])
    for f in [lambda x, w: x @ w, lambda x, w: w @ x.T, lambda x, w: jnp.einsum("ij,jk->ik", x, w)]:
        chex.assert_trees_all_equal(mpjax.autocast(f, dtype=low)(x, w), f(x, w))

    def loss(w, x):
        return jnp.sum(jnp.abs(x @ w) ** 2)

    chex.assert_trees_all_close(
        jax.grad(mpjax.autocast(loss, dtype=low))(w, x), jax.grad(loss)(w, x), rtol=1e-6
    )


def test_the_conjugate_of_a_real_16_bit_result_is_complex64_as_without_autocast(low):
    # lax.conj accepts real float32 and returns complex64; it refuses 16-bit floats.
    w, x = jnp.eye(4) * 0.5, jnp.arange(8.0).reshape(2, 4)

    def f(w, x):
        return lax.conj(x @ w)

    got = mpjax.autocast(f, dtype=low)(w, x)
    assert got.dtype == jnp.complex64
    chex.assert_trees_all_equal(got, f(w, x))
    g = jax.grad(lambda w: jnp.sum(jnp.real(mpjax.autocast(f, dtype=low)(w, x))))(w)
    chex.assert_trees_all_equal(g, jax.grad(lambda w: jnp.sum(jnp.real(f(w, x))))(w))


@pytest.mark.parametrize("fill", [1e6, -1e5, 1e-9])
def test_gather_fill_value_the_low_dtype_cannot_hold_is_kept(low, fill):
    x, w = _xw()
    index = jnp.array([0, 3, 7, -9])

    def f(x, w):
        return (x @ w).at[index].get(mode="fill", fill_value=fill)

    out, ref = mpjax.autocast(f, dtype=low)(x, w), f(x, w)
    assert out.dtype == F32
    np.testing.assert_allclose(out[2:], ref[2:], rtol=rel_tol(low), atol=0)  # no inf, no 0
    np.testing.assert_allclose(out[:2], ref[:2], rtol=rel_tol(low), atol=rel_tol(low))


def test_a_value_times_itself_is_a_float32_square():
    """``x * x`` squares as ``x ** 2`` does, in float32: jnp.linalg.norm and an RMSNorm
    written ``h * rsqrt(mean(h * h))`` of a float16 activation above 256 were inf or 0."""
    x = jnp.array([[300.0, 1.0, 2.0, 3.0], [10.0, 20.0, 30.0, 40.0]])

    def norm(x, w):
        return jnp.linalg.norm(x @ w, axis=-1)

    def rmsnorm(x, w):
        h = x @ w
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

    w = jnp.eye(4)
    for f in [norm, rmsnorm]:
        out, ref = mpjax.autocast(f)(x, w), f(x, w)
        np.testing.assert_allclose(out, ref, rtol=rel_tol(F16))
        g = jax.grad(lambda x: jnp.sum(mpjax.autocast(f)(x, w)[0]))(x)
        g_ref = jax.grad(lambda x: jnp.sum(f(x, w)[0]))(x)
        np.testing.assert_allclose(g, g_ref, rtol=5e-3, atol=1e-3)
    program = jax.make_jaxpr(mpjax.autocast(norm))(x, w)
    squares = [e for e in all_eqns(program) if e.primitive.name == "mul"]
    assert squares and all(e.outvars[0].aval.dtype == F32 for e in squares)


def test_nextafter_steps_in_the_precision_the_program_asks(low):
    x, w = _xw()

    def f(x, w):
        h = x @ w
        return jnp.nextafter(h, jnp.inf) - h

    out = mpjax.autocast(f, dtype=low)(x, w)
    np.testing.assert_allclose(out, f(x, w), rtol=0.5)  # float32 ulps, not float16's


def test_a_products_out_sharding_is_kept():
    """Under explicit sharding, ``out_sharding=`` on a product whose contracting
    dimension is sharded is required, and the result is sharded as asked."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1, 1), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
    with use_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("a", "b")))
        w = jax.device_put(jnp.full((4, 4), 0.5), NamedSharding(mesh, P("b", None)))

        def f(w, x):
            return jnp.einsum("ij,jk->ik", x, w, out_sharding=P("a", None))

        out, ref = jax.jit(mpjax.autocast(f))(w, x), jax.jit(f)(w, x)
    assert jax.typeof(out) == jax.typeof(ref)
    chex.assert_trees_all_equal(out, ref)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest)")
def test_a_cast_that_reshards_keeps_its_sharding(low):
    """``jnp.astype(x, dtype, device=...)`` to the dtype autocast holds the value
    in (or its own), and ``jnp.linspace(..., device=...)``: the dtype may be left
    alone, the sharding asked for may not."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
    with use_mesh(mesh):
        x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("a", None)))
        columns = NamedSharding(mesh, P(None, "b"))
        cases = {
            "same dtype": lambda x: jnp.astype(x, F32, device=columns) * 2.0,
            "after a product": lambda x: jnp.astype(x @ jnp.ones((4, 4)), F32, device=columns),
            "linspace": lambda x: jnp.linspace(0.0, 1.0, 8, device=NamedSharding(mesh, P("a"))),
        }
        for name, f in cases.items():
            out, ref = jax.jit(mpjax.autocast(f, dtype=low))(x), jax.jit(f)(x)
            assert out.sharding.spec == ref.sharding.spec, name
            np.testing.assert_allclose(out, ref, rtol=rel_tol(low), err_msg=name)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest)")
def test_gradients_under_explicit_sharding_are_sharded_as_plain_jax(low):
    """Data parallelism with explicit sharding: the weight gradient of a product
    contracting over the sharded batch needs the weight's sharding (JAX's
    transpose supplies it), and an embedding lookup with ``out_sharding=`` runs its
    index arithmetic in an ``auto_axes`` region, whose mesh its equations keep."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
    k = jax.random.split(jax.random.key(0), 4)
    with use_mesh(mesh):
        x = jax.device_put(jax.random.normal(k[0], (8, 6, 4)), NamedSharding(mesh, P("a")))
        ids = jax.device_put(jnp.arange(48).reshape(8, 6) % 10, NamedSharding(mesh, P("a")))
        params = {
            name: jax.device_put(jax.random.normal(key, shape) / 2, NamedSharding(mesh, spec))
            for name, key, shape, spec in [
                ("embed", k[1], (10, 4), P()),
                ("w1", k[2], (4, 8), P(None, "b")),
                ("w2", k[3], (8, 4), P("b")),
            ]
        }

        def loss(p, x, ids):
            h = x + p["embed"].at[ids].get(out_sharding=P("a", None, None))
            h = jnp.einsum("btd,df->btf", h, p["w1"], out_sharding=P("a", None, None))
            out = jnp.einsum("btf,fd->btd", jax.nn.gelu(h), p["w2"], out_sharding=P("a"))
            return jnp.mean(jnp.square(out - x))

        step = jax.jit(jax.value_and_grad(mpjax.autocast(loss, dtype=low)))
        (value, grads), (value_ref, grads_ref) = (
            step(params, x, ids),
            jax.jit(jax.value_and_grad(loss))(params, x, ids),
        )
    np.testing.assert_allclose(value, value_ref, rtol=2e-2)
    for name in params:
        assert jax.typeof(grads[name]) == jax.typeof(grads_ref[name]), name
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=5e-2, atol=2e-2)


# --- derivatives taken inside the autocast function ---------------------------------


def test_a_product_with_a_literal_operand():
    """Differentiating a full contraction inside the function makes a product
    of the literal cotangent 1.0 (``jnp.vdot``, ``v @ S @ v``, a BFGS solve)."""
    a, b = jnp.arange(3.0), jnp.ones(3)
    grad = jax.grad(lambda a, b: jnp.einsum("i,i->", a, b))
    np.testing.assert_array_equal(mpjax.autocast(grad)(a, b), grad(a, b))


def _custom_jvp_reading(w):
    @jax.custom_jvp
    def f(y):
        return jnp.sin(y) * w[0]

    @f.defjvp
    def f_jvp(primals, tangents):
        (y,), (ty,) = primals, tangents
        return f(y), jnp.cos(y) * ty * w[0] * 2  # not autodiff's: the rule must run

    return f


def test_custom_jvp_closing_over_a_value_of_an_outer_trace():
    w, x = jnp.eye(3) * 0.5, jnp.ones((2, 3))

    @jax.jit
    def grads(w, x):
        f = _custom_jvp_reading(w)
        loss = lambda x: jnp.sum(f(x @ w))
        return jax.grad(mpjax.autocast(loss))(x), jax.grad(loss)(x)

    got, want = grads(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-3)


def test_custom_jvp_closing_over_a_value_of_the_function_itself_is_a_clear_error():
    """Its rule, read back from the traced program, holds that trace's value:
    no interpreter can run it again (jax.core.eval_jaxpr fails too)."""

    def loss(w, x):
        return jnp.sum(_custom_jvp_reading(w)(x @ w))

    w, x = jnp.eye(3) * 0.5, jnp.ones((2, 3))
    mpjax.autocast(loss)(w, x)  # the forward pass runs
    with pytest.raises(TypeError, match=r"custom_jvp function called at .*ordinary argument"):
        jax.grad(mpjax.autocast(loss), argnums=1)(w, x)


def test_custom_jvp_closing_over_a_value_of_the_function_is_refused_under_jit_too():
    """Under jit the stale value would be lifted as a hidden input: the export of
    such a gradient returned wrong numbers. It is refused while jit traces."""

    def loss(w, x):
        return jnp.sum(_custom_jvp_reading(w)(x @ w))

    w, x = jnp.eye(3) * 0.5, jnp.ones((2, 3))
    step = jax.jit(jax.grad(mpjax.autocast(loss), argnums=1))
    with pytest.raises(TypeError, match=r"custom_jvp function called at .*ordinary argument"):
        step.lower(w, x)


def _reversal(lam):
    """A gradient-reversal layer whose bwd rule reads `lam`."""

    @jax.custom_vjp
    def reverse(h):
        return h

    reverse.defvjp(lambda h: (h, None), lambda _, g: (-lam * g,))
    return reverse


def _scaled_by(c):
    @jax.custom_gradient
    def f(h):
        return h * c, lambda g: (g * c * 0.5,)

    return f


@pytest.mark.parametrize("layer", [_reversal, _scaled_by])
def test_custom_vjp_reading_a_value_of_the_function_is_a_clear_error(layer):
    """Its rules, read back from the traced program, hold that trace's value. Under
    jax.export the gradient came out wrong (1.25e-3 for 6.25e-3) with no error."""

    def loss(w, x, lam):
        return jnp.mean(jnp.tanh(layer(lam)(x @ w)) ** 2)

    w, x, lam = jnp.full((4, 4), 0.1), jnp.ones((2, 4)), jnp.float32(0.5)
    # The forward pass runs, as without autocast.
    np.testing.assert_allclose(mpjax.autocast(loss)(w, x, lam), loss(w, x, lam), rtol=1e-2)
    message = r"custom_vjp function called at .*ordinary argument"
    with pytest.raises(TypeError, match=message):
        jax.grad(mpjax.autocast(loss))(w, x, lam)
    with pytest.raises(TypeError, match=message):
        jax.jit(jax.grad(mpjax.autocast(loss))).lower(w, x, lam)


def test_custom_vjp_whose_rule_holds_but_does_not_read_a_value_of_the_function_trains():
    """The check is what the rule reads, not what it can reach: a config dict beside
    the inputs, read for its float alone, trains as without autocast."""

    def loss(w, x):
        cfg = {"clip": 0.5, "inputs": x}

        @jax.custom_vjp
        def clip_grad(h):
            return h

        clip_grad.defvjp(
            lambda h: (h, None), lambda _, g: (jnp.clip(g, -cfg["clip"], cfg["clip"]),)
        )
        return jnp.sum(clip_grad(x @ w))

    w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))
    np.testing.assert_allclose(jax.grad(mpjax.autocast(loss))(w, x), jax.grad(loss)(w, x))


def test_custom_vjp_reading_a_value_through_an_object_is_a_clear_error():
    class Scale:
        def __init__(self, s):
            self.s = s

    def loss(w, x):
        state = Scale(jnp.sum(x))

        @jax.custom_vjp
        def f(h):
            return h

        f.defvjp(lambda h: (h, None), lambda _, g: (g * state.s,))
        return jnp.sum(f(x @ w))

    w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))
    with pytest.raises(TypeError, match=r"custom_vjp function called at .*ordinary argument"):
        jax.jit(jax.grad(mpjax.autocast(loss))).lower(w, x)


def test_custom_vjp_reading_a_value_of_an_outer_jit_trains():
    w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))

    @jax.jit
    def grads(w, x, lam):
        loss = lambda w: jnp.mean(jnp.tanh(_reversal(lam)(x @ w)) ** 2)
        return jax.grad(mpjax.autocast(loss))(w), jax.grad(loss)(w)

    got, want = grads(w, x, jnp.float32(0.5))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-5)


def test_custom_jvp_with_an_integer_output_is_differentiated():
    """Its tangent is float0, as JAX requires; it was cast to int32 (ValueError)."""

    @jax.custom_jvp
    def with_count(x):
        return jnp.sin(x), jnp.sum(x > 0).astype(jnp.int32)

    @with_count.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        out = with_count(x)
        return out, (jnp.cos(x) * t, np.zeros((), jax.dtypes.float0))

    def loss(w, x):
        y, n = with_count(x @ w)
        return jnp.sum(y) * n.astype(jnp.float32)

    w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))
    want = jax.grad(loss)(w, x)
    for step in (jax.grad(mpjax.autocast(loss)), jax.jit(jax.grad(mpjax.autocast(loss)))):
        np.testing.assert_allclose(step(w, x), want, rtol=1e-2)


def test_export_with_a_symbolic_batch_dimension(low):
    """`jax.export` shape polymorphism: sizes are symbolic, and compare only
    where they can (a bias add, a softmax, an arange over the batch, a scale after
    a product of two arguments). The exported program is the jitted one's, bit for
    bit: a bias of n elements against b * n is a bias for any batch b."""
    from jax import export

    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (4, 8)) / 2,
        "b1": jnp.full((8,), 0.1, jnp.float32),
        "w2": jax.random.normal(k[1], (8, 3)) / 3,
        "b2": jnp.full((3,), -0.2, jnp.float32),
    }

    def loss(params, x):
        h = jax.nn.gelu((x @ params["w1"]) / 8.0 + params["b1"])
        h = (h - h.mean(-1, keepdims=True)) + jnp.arange(x.shape[0])[:, None] * 1e-3
        logits = jax.nn.log_softmax(h @ params["w2"] + params["b2"])
        return -jnp.mean(logits[:, 0])

    (batch,) = export.symbolic_shape("b")
    x_spec = jax.ShapeDtypeStruct((batch, 4), jnp.float32)
    step = jax.jit(jax.value_and_grad(mpjax.autocast(loss, dtype=low)))
    exported = export.export(step)(params, x_spec)
    for n in (3, 5):
        x = jax.random.normal(k[2], (n, 4))
        (value, grads), (value_ref, grads_ref) = (
            exported.call(params, x),
            jax.value_and_grad(loss)(params, x),
        )
        np.testing.assert_allclose(value, value_ref, rtol=2e-2)
        chex.assert_trees_all_close(grads, grads_ref, rtol=5e-2, atol=2e-2)
        chex.assert_trees_all_equal((value, grads), step(params, x))


# --- operations torch keeps in float32 or promotes ---------------------------------


_MASK = jnp.array([[True, True, False, True], [True, True, True, True]])


def _logits(low):
    """16-bit logits from a product, and the float32 values they hold."""
    x = jnp.array([[5.0, -0.0123, 4.9, 1.3], [0.5, 2.25, -3.0, 0.1]])
    eye = jnp.eye(4)
    return x, eye, x.astype(low).astype(F32)


@pytest.mark.parametrize(
    "fn",
    [
        lambda s: jax.nn.log_softmax(s),
        lambda s: jax.nn.softmax(s),
        lambda s: optax.softmax_cross_entropy(s, jnp.eye(4)[jnp.array([1, 2])]),
        lambda s: jax.nn.logsumexp(s, axis=-1),
        lambda s: jax.scipy.special.logsumexp(s, axis=-1, b=jnp.array([1.0, 2.0, 0.5, 1.0])),
        lambda s: optax.softmax_cross_entropy_with_integer_labels(s, jnp.array([1, 2])),
        lambda s: jax.nn.log_softmax(s, where=_MASK),
        lambda s: jax.nn.softmax(s, where=_MASK),
        lambda s: optax.softmax_cross_entropy(s, jnp.eye(4)[jnp.array([1, 3])], where=_MASK),
    ],
    ids=[
        "log_softmax",
        "softmax",
        "softmax_cross_entropy",
        "logsumexp",
        "scipy_logsumexp_b",
        "integer_labels",
        "log_softmax_where",
        "softmax_where",
        "softmax_cross_entropy_where",
    ],
)
def test_the_softmax_shift_by_the_maximum_runs_in_float32(fn, low):
    # torch's softmax and log_softmax compute in float32 on 16-bit logits: the
    # difference x - max(x) keeps all its bits (-5.0123 is -5.0 in bfloat16).
    x, eye, held = _logits(low)
    out = mpjax.autocast(lambda x, w: fn(x @ w), dtype=low)(x, eye)
    np.testing.assert_allclose(out.astype(F32), fn(held), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", None])
def test_dot_product_attention_shifts_its_logits_in_float32(implementation):
    # It shifts the transpose of its logits by their maximum, transposed alike.
    # Here one logit is 9 and 8191 are -0.03: the output is the others' total weight,
    # 0.4952, which a bfloat16 shift (-9.03 as -9.0) moves by 1.8%.
    n = 8192
    q = jnp.ones((1, 1, 1, 1))
    k = jnp.full((1, n, 1, 1), -0.03).at[0, 0].set(9.0)
    v = jnp.ones((1, n, 1, 1)).at[0, 0].set(0.0)
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation)  # noqa: E731
    g = mpjax.autocast(f, dtype=jnp.bfloat16)
    shifts = mpjax.audit(g, q, k, v).find("reduce_max") + mpjax.audit(g, q, k, v).find("sub")
    assert shifts and all(set(e.in_dtypes) == {"float32"} for e in shifts), shifts
    np.testing.assert_allclose(g(q, k, v).astype(F32), f(q, k, v), rtol=4e-3)


def test_a_masked_softmax_cross_entropy_is_finite_where_float32_is():
    # Invalid classes filled with float16's lowest number, and a where= mask of the
    # examples (all valid here): in 16 bits the shift -65504 - max overflows to
    # -inf, and optax's 0 * log_softmax is NaN. The shift runs in float32: finite.
    k1, k2 = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(k1, (8, 64)), 2 * jax.random.normal(k2, (64, 32))  # logits ~30
    invalid = jnp.zeros((8, 32), bool).at[:, -4:].set(True)
    labels = jax.nn.one_hot(jnp.arange(8) % 28, 32)

    def loss(w, x):
        logits = jnp.where(invalid, jnp.finfo(jnp.float16).min, x @ w)
        return optax.softmax_cross_entropy(logits, labels, where=jnp.ones_like(invalid)).mean()

    value, grads = jax.jit(jax.value_and_grad(mpjax.autocast(loss)))(w, x)
    value_ref, grads_ref = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, value_ref, rtol=1e-3)
    chex.assert_trees_all_close(grads, grads_ref, rtol=1e-2, atol=1e-2 * jnp.abs(grads_ref).max())


def test_the_softmax_maximum_is_of_the_values_the_shift_reads(low):
    # Of a 16-bit product's result, XLA may read its float32 accumulator in one
    # place and the rounded value in another: a maximum of the rounded logits
    # below an unrounded one makes x - max(x) > 0, and exp overflows (jax 0.10 on
    # CPU: NaN loss and gradients at logits of 1e5, bfloat16).
    k1, k2 = jax.random.split(jax.random.key(2))
    scale = 1e5 if low == jnp.bfloat16 else 5e3  # logits within float16's range
    x, w = scale * jax.random.normal(k1, (8, 16)), 0.3 * jax.random.normal(k2, (16, 4))

    def loss(w, x):
        return jnp.mean(jax.nn.log_softmax(x @ w))

    value, grads = jax.jit(jax.value_and_grad(mpjax.autocast(loss, dtype=low)))(w, x)
    value_ref, grads_ref = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, value_ref, rtol=1e-2)
    chex.assert_trees_all_close(grads, grads_ref, rtol=5e-2, atol=5e-2 * jnp.abs(grads_ref).max())
    # The maximum reads the float32 values: no 16-bit reduce_max is left.
    jaxpr = jax.make_jaxpr(mpjax.autocast(loss, dtype=low))(w, x).jaxpr
    maxima = [e for e in all_eqns(jaxpr) if e.primitive.name == "reduce_max"]
    assert maxima and all(e.invars[0].aval.dtype == F32 for e in maxima)


def test_a_vector_dot_product_runs_as_written(low):
    # torch's dot is on its promote list; a float16 sum of squares overflows.
    w = jnp.full(8, 95.0)  # |w|**2 = 72200

    def f(w, x, v):
        return jnp.mean(x @ v) + 1e-4 * jnp.vdot(w, w) + 1e-4 * jnp.dot(w, w)

    x, v = _xw()
    out = mpjax.autocast(f, dtype=low)(w, x, v[:, :1].repeat(8, 0)[:8])
    np.testing.assert_allclose(out, f(w, x, v[:, :1].repeat(8, 0)[:8]), rtol=rel_tol(low))


def test_a_batch_of_vector_dot_products_runs_as_written(low):
    # einsum("bn,bn->b") is one vector dot per row, as optax.ctc_loss picks each
    # sequence's final log-probability with a one-hot: in float16 its log(eps) of
    # -1e5 was -inf, and -inf * 0 a NaN loss where float32 is finite.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(k1, (2, 30, 16)), 0.3 * jax.random.normal(k2, (16, 12))
    lengths = jnp.array([5, 8])
    paddings = (jnp.arange(20)[None] >= lengths[:, None]).astype(jnp.float32)
    labels = jnp.where(paddings > 0, 0, jax.random.randint(k3, (2, 20), 1, 12))

    def loss(w, x):
        return optax.ctc_loss(x @ w, jnp.zeros((2, 30)), labels, paddings)

    got, want = jax.jit(mpjax.autocast(loss, dtype=low))(w, x), loss(w, x)
    np.testing.assert_allclose(got, want, rtol=rel_tol(low))
    grads = jax.jit(jax.grad(lambda w: mpjax.autocast(loss, dtype=low)(w, x).sum()))(w)
    assert np.isfinite(grads).all()
    # The rows' products, and a 1-D dot under vmap, keep the dtypes they were given.
    rows = lambda a, b: jnp.einsum("bn,bn->b", a, b)  # noqa: E731
    for f in (rows, jax.vmap(jnp.dot)):
        jaxpr = jax.make_jaxpr(mpjax.autocast(f, dtype=low))(x[0], x[0])
        (dot,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
        assert [v.aval.dtype for v in (*dot.invars, *dot.outvars)] == [F32] * 3


def test_a_number_divided_by_a_value_is_a_float32_reciprocal(low):
    x = jnp.full((2, 4), 1e-5)

    def f(x, w):
        h = x @ w
        return 1.0 / h, 3 / h

    w = jnp.eye(4)
    for got, want in zip(mpjax.autocast(f, dtype=low)(x, w), f(x.astype(low).astype(F32), w)):
        assert got.dtype == F32
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nextafter_steps_in_the_dtype_of_its_16_bit_operands(low):
    x16 = jnp.array([1.0, 2.0, 0.1], F16)
    nxt = lambda x: jnp.nextafter(x, jnp.inf)
    chex.assert_trees_all_equal(mpjax.autocast(nxt, dtype=low)(x16), nxt(x16))
    chex.assert_trees_all_equal(mpjax.autocast(jnp.spacing, dtype=low)(x16), jnp.spacing(x16))
    key, bf16 = jax.random.key(0), jnp.bfloat16
    sample = lambda k: jax.random.truncated_normal(k, -1.0, 1.0, (20000,), dtype=bf16)
    assert jnp.all(jnp.abs(mpjax.autocast(sample, dtype=low)(key).astype(F32)) < 1.0)


def test_a_scatter_add_into_float32_zeros_sums_in_float32(low):
    # jax.ops.segment_sum and .at[].add start from zeros of the traced dtype.
    def f(x, w):
        h = x @ w  # 4096 rows of 20
        seg = jnp.zeros(4096, jnp.int32)
        return jax.ops.segment_sum(h, seg, 2), jnp.zeros((2, 4)).at[seg].add(h)

    x, w = jnp.full((4096, 4), 20.0), jnp.eye(4)
    for got in mpjax.autocast(f, dtype=low)(x, w):
        assert got.dtype == F32
        np.testing.assert_array_equal(got[0], jnp.full(4, 81920.0))


def test_a_nan_under_a_maximum_reaches_the_gradient(low):
    # As JAX's own derivative of max: the gradient scaler must see the step's NaN.
    def f(x, w):
        return jnp.sum(jnp.max(x @ w, axis=-1))

    x = jnp.ones((2, 4)).at[0, 1].set(jnp.nan)
    want = jax.grad(f, argnums=1)(x, jnp.eye(4))
    got = jax.grad(mpjax.autocast(f, dtype=low), argnums=1)(x, jnp.eye(4))
    assert not jnp.isfinite(want).all()
    chex.assert_trees_all_equal(jnp.isnan(got), jnp.isnan(want))


def test_a_callback_without_operands_is_a_run_time_value(low):
    # Not a constant computed from literals: it runs when the program does, and
    # its value (1e5, beyond float16) is what the program computes with.
    calls = []

    def read():
        calls.append(1)
        return np.full((3, 4), 1e5, np.float32)

    def f(w, x):
        s = jax.pure_callback(read, jax.ShapeDtypeStruct((3, 4), F32))
        return jnp.where(x > 0, x @ w, s)

    w, x = jnp.eye(4), -jnp.ones((3, 4))
    jax.make_jaxpr(mpjax.autocast(f, dtype=low))(w, x)
    assert not calls  # tracing runs no callback
    np.testing.assert_array_equal(jax.jit(mpjax.autocast(f, dtype=low))(w, x), f(w, x))


# --- the lean policy's float32 chains ---------------------------------------------


@pytest.mark.parametrize(
    "f",
    [
        lambda w, x: jnp.sum(jax.jit(jnp.square)(x @ w)),
        lambda w, x: jnp.sum(jax.checkpoint(jnp.square)(x @ w)),
        lambda w, x: jax.jit(jnp.sum)(jnp.square(x @ w)),
        lambda w, x: lax.cond(True, jnp.sum, lambda s: jnp.sum(s) * 2, jnp.square(x @ w)),
        lambda w, x: mpjax.autocast(lambda s: jnp.sum(s), enabled=False)(jnp.square(x @ w)),
    ],
    ids=["jit", "checkpoint", "jit reader", "cond reader", "disabled reader"],
)
def test_lean_keeps_a_float32_chain_across_calls_and_regions(f):
    # h is about 300: its square overflows float16, and stays float32 when only
    # float32-list operations read it, whatever call or region they sit in.
    w, x = jnp.eye(4) * 30.0, jnp.array([[10.0, -12.0, 9.0, 11.0]])
    got = mpjax.autocast(f, policy="lean")(w, x)
    np.testing.assert_allclose(got, f(w, x), rtol=1e-2)


def test_rows_unstacked_from_a_product_stay_16_bit(low):
    """jnp.unstack, and `for r in h` on jax 0.12, bind `unstack`: it had no table
    line, so each row was cast back to float32 and what followed ran in float32."""

    def f(x, w):
        return [jnp.tanh(r) for r in jnp.unstack(x @ w)]

    x, w = jnp.ones((3, 4)), jnp.full((4, 4), 0.1)
    eqns = [e for e in all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=low))(x, w).jaxpr)]
    tanh = [e for e in eqns if e.primitive.name == "tanh"]
    assert len(tanh) == 3 and all(e.invars[0].aval.dtype == low for e in tanh)


def test_a_custom_jvp_rule_is_traced_only_when_differentiated():
    """As JAX does. A rule that cannot be traced broke the forward pass; and on
    jax 0.12 jax.scipy.special.erfcx's second-order rule does not trace, which broke
    the gradient of any function calling it (mpjax traced the rule of the erfcx
    called inside erfcx's own rule)."""

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def _(primals, tangents):
        raise NotImplementedError("this rule is only for a later release")

    x, w = jnp.ones((2, 3)), jnp.full((3, 3), 0.2)
    np.testing.assert_allclose(mpjax.autocast(lambda x: f(x @ w))(x), f(x @ w), rtol=1e-2)

    def loss(x):
        return jnp.sum(jax.scipy.special.erfcx(x @ w))

    np.testing.assert_allclose(jax.grad(mpjax.autocast(loss))(x), jax.grad(loss)(x), rtol=1e-2)


def test_the_derivative_in_a_float16_divisor_does_not_square_it():
    """JAX's derivative of x / y in y is -x * y**-2, with y**-2 in y's dtype: in
    float16 0 past |y| = 256 and inf below 2**-8. A softsign h / (|h| + 1) of
    activations near 300 had a gradient 250 times float32's (the term was lost)."""
    x, w = jnp.linspace(250.0, 350.0, 8).reshape(2, 4), jnp.eye(4)

    def softsign(x, w):
        h = x @ w
        return jnp.sum(h / (jnp.abs(h) + 1.0))

    for policy in ("torch", "lean"):
        got = jax.grad(mpjax.autocast(softsign, policy=policy))(x, w)
        np.testing.assert_allclose(got, jax.grad(softsign)(x, w), rtol=0.2)  # 16-bit cancellation

    # A small divisor: y**-2 = 2**18 overflows float16; (x / y) / y does not.
    def ratio(y):
        return jnp.sum(((y * 0.5) / y).astype(jnp.float32))  # 0.5: its gradient is 0

    y = jnp.full((4,), 2.0**-9, jnp.float16)
    np.testing.assert_array_equal(jax.grad(mpjax.autocast(ratio))(y), jnp.zeros(4, jnp.float16))


# --- a product scaled by a constant: attention's logits ----------------------------


def _attention_inputs(magnitude):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 16, 2, 64)) for key in (kq, kk, kv))
    return magnitude * q, magnitude * k, v


@pytest.mark.parametrize("where", ["arguments", "activations"])
def test_attention_logits_past_float16s_range_before_scaling_stay_finite(where):
    # Raw q . k up to ~8e4 (past 65504), scaled by 1/8 to ~1e4: JAX's own attention
    # on float16 inputs keeps float32 logits and is finite; so must autocast be, and
    # a float16 step with it must not be skipped.
    q, k, v = _attention_inputs(56.0)
    raw = jnp.max(jnp.abs(jnp.einsum("btnh,bsnh->bnts", q, k)))
    assert raw > 65504 and raw / 8 < 65504

    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def loss(w, q, k, v):  # q and k made inside, as a model's projections are
        return jnp.mean((attention(q @ w, k @ w, v) - v) ** 2)

    if where == "arguments":
        got, want = jax.jit(mpjax.autocast(attention))(q, k, v), attention(q, k, v)
        # logits of 1e4 rounded to float16 (spacing 8): a few weights move
        np.testing.assert_allclose(got, want, atol=0.15)
    else:
        w = jnp.eye(64)
        (value, grads), want = (
            jax.jit(jax.value_and_grad(mpjax.autocast(loss)))(w, q, k, v),
            loss(w, q, k, v),
        )
        assert np.isfinite(grads).all() and grads.dtype == F32
        np.testing.assert_allclose(value, want, rtol=1e-2)


_EIGHTH = jnp.float32(0.125)  # a constant the scaled function closes over

_COMPUTED_SCALES = {
    "/ jnp.sqrt(head_dim)": lambda s: s / jnp.sqrt(64),
    "* lax.rsqrt(float32(head_dim))": lambda s: s * lax.rsqrt(jnp.float32(64)),
    "* jnp.power(head_dim, -0.5)": lambda s: s * jnp.power(64.0, -0.5),
    "* a closed-over array": lambda s: s * _EIGHTH,
    "/ sqrt(head_dim), cast": lambda s: s / jnp.sqrt(64.0).astype(s.dtype),
}


@pytest.mark.parametrize("written", list(_COMPUTED_SCALES))
def test_attention_scaled_by_a_number_the_program_computes_stays_finite(written, monkeypatch):
    # Hand-written attention divides by jnp.sqrt(head_dim), computed in the program
    # from a literal, or multiplies by a constant it closes over: the scale is known
    # before the program runs all the same, and its power of two moves as a
    # literal's does. Raw q . k past 65504 in float16, scaled logits ~1e4.
    q, k, v = _attention_inputs(56.0)
    scaled = _COMPUTED_SCALES[written]

    def loss(w, q, k, v):
        s = scaled(jnp.einsum("btnh,bsnh->bnts", q @ w, k @ w))
        mask = jnp.tril(jnp.ones((16, 16), bool))
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        return jnp.mean((jnp.einsum("bnts,bsnh->btnh", p, v) - v) ** 2)

    w = jnp.eye(64)
    value, grads = jax.jit(jax.value_and_grad(mpjax.autocast(loss)))(w, q, k, v)
    assert np.isfinite(value) and np.isfinite(grads).all() and grads.dtype == F32
    np.testing.assert_allclose(value, loss(w, q, k, v), rtol=1e-2)

    # Where nothing overflows, no bit of the result changes.
    q, k, _ = _attention_inputs(1.0)
    f = mpjax.autocast(lambda q, k: scaled(jnp.einsum("btnh,bsnh->bnts", q, k)))
    moved = f(q, k), jax.jit(f)(q, k)
    monkeypatch.setattr(mpjax._prescale, "find", lambda *args: {})
    chex.assert_trees_all_equal(moved, (f(q, k), jax.jit(f)(q, k)))


@pytest.mark.parametrize("scale", [0.125, 1 / np.sqrt(128), "divide by 8"])
def test_a_scaled_products_result_is_the_product_as_written_where_it_is_finite(
    low, scale, monkeypatch
):
    # Where nothing overflows, moving the scale's power of two onto the operands
    # changes no bit of the result: eagerly, and jitted here (where the product's
    # result is only widened to float32 after, XLA may skip its 16-bit rounding).
    q, k, _ = _attention_inputs(1.0)

    def logits(q, k):
        s = jnp.einsum("btnh,bsnh->bnts", q, k)
        return s / 8 if scale == "divide by 8" else s * scale

    def run():
        f = mpjax.autocast(logits, dtype=low)
        return f(q, k), jax.jit(f)(q, k), jax.make_jaxpr(f)(q, k)

    *moved, jaxpr = run()
    monkeypatch.setattr(mpjax._prescale, "find", lambda *args: {})
    *as_written, jaxpr_as_written = run()
    chex.assert_trees_all_equal(moved, as_written)
    # The scale's power of two multiplies an operand (float32 here: before its
    # cast; one operand at most 2**-3), and what is left of it the product's result
    # (1/sqrt(2) of 1/sqrt(128) = 2**-3 / sqrt(2)), in float32 as torch multiplies
    # by a Python scalar: 16 bits hold 1/sqrt(2) only rounded.
    scales = sorted(
        (e.primitive.name, float(e.invars[1].val), e.outvars[0].aval.dtype == F32)
        for e in all_eqns(jaxpr)
        if e.primitive.name in ("mul", "div")
    )
    left = float(np.float32(1 / np.sqrt(2)))
    rest = [("mul", left, True)] if scale == 1 / np.sqrt(128) else []
    assert scales == sorted([("mul", 0.125, True), *rest])


@pytest.mark.parametrize("c", [1 / 3, 0.1, 1e-3])
def test_a_factor_16_bits_hold_only_rounded_multiplies_in_float32(low, c):
    # torch multiplies a 16-bit tensor by a Python scalar in float32 and rounds
    # once; the factor rounded first (0.1 as 0.099976 in float16) would move every
    # element by the same relative amount, a bias no average removes. (Results
    # below float16's normal range may differ: the product's scale moves onto its
    # operands, `test_a_scaled_products_result_is_the_product_as_written...`.)
    w = jax.random.normal(jax.random.key(0), (64, 256)) / 8
    x = jax.random.normal(jax.random.key(1), (32, 64))
    h = mpjax.autocast(lambda w, x: x @ w, dtype=low)(w, x).astype(F32)  # the 16-bit product
    for f, want in (
        (lambda w, x: c * (x @ w), (np.float32(c) * h).astype(low)),
        (lambda w, x: (x @ w) / c, (h / np.float32(c)).astype(low)),
    ):
        normal = np.abs(want.astype(F32)) >= jnp.finfo(low).smallest_normal
        got = mpjax.autocast(f, dtype=low)(w, x)
        chex.assert_trees_all_equal(got[normal], want[normal].astype(F32))
        got = mpjax.autocast(f, dtype=low, policy="lean")(w, x)  # lean: as Flax's dtype=
        chex.assert_trees_all_equal(got[normal], f(w.astype(low), x.astype(low))[normal])


@pytest.mark.parametrize("c", [3, 10, 7.0])
def test_a_divisor_whose_reciprocal_16_bits_hold_only_rounded_divides_in_float32(low, c):
    # 3 is held exactly, but XLA divides by a constant as a product with its
    # reciprocal, rounded to the operand's dtype: 1/3 as 0.33325 in float16, a
    # relative bias of -2.5e-4 on every element. In float32 the quotient is
    # rounded once, as torch divides a 16-bit tensor by a Python scalar.
    w = jax.random.normal(jax.random.key(0), (64, 256)) / 8
    x = jax.random.normal(jax.random.key(1), (32, 64))
    product = mpjax.autocast(lambda w, x: x @ w, dtype=low)
    f = mpjax.autocast(lambda w, x: (x @ w) / c, dtype=low)
    (div,) = [e for e in all_eqns(jax.make_jaxpr(f)(w, x)) if e.primitive.name == "div"]
    assert div.outvars[0].aval.dtype == F32
    # (Jitted, XLA:CPU may keep a bfloat16 product's float32 result: each against its own.)
    for run in (lambda g: g, jax.jit):
        h = np.asarray(run(product)(w, x).astype(F32), np.float64)
        got = np.asarray(run(f)(w, x).astype(F32), np.float64)
        normal = np.abs(got) >= jnp.finfo(low).smallest_normal
        once = (h / c).astype(low).astype(np.float64)
        assert np.mean(got[normal] == once[normal]) > 0.999
        bias = [np.mean(y[normal] / (h[normal] / c) - 1) for y in (got, once)]
        assert abs(bias[0] - bias[1]) < 1e-5, bias  # by a rounded 1/c: 2.4e-4 and more


def test_a_scale_below_one_sixty_fourth_or_above_one_stays_after_the_product():
    # 1e-5 would push the operands' small values into float16's subnormals; 2 would
    # only make them larger. Both scale the product's result, as written.
    q, k, _ = _attention_inputs(1.0)
    for scale in (1e-5, 2.0):
        f = lambda q, k: jnp.einsum("btnh,bsnh->bnts", q, k) * scale  # noqa: E731
        jaxpr = jax.make_jaxpr(mpjax.autocast(f))(q, k)
        (mul,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "mul"]
        assert mul.invars[1].val == np.float32(scale)


@pytest.mark.parametrize("constant", [0.0, 0.125 + 0j, np.nan, -0.125])
def test_a_product_scaled_by_a_constant_it_cannot_move_runs_as_written(constant):
    # A division by zero (a temperature of 0), a complex or NaN scale, a negative
    # one: nothing is moved, and the program runs as plain JAX does.
    x, w = _xw()
    if isinstance(constant, complex):
        x, w = x.astype(jnp.complex64), w.astype(jnp.complex64)
    f = lambda x, w: (x @ w) / constant  # noqa: E731
    got, want = jax.jit(mpjax.autocast(f))(x, w), f(x, w)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_a_scale_that_autocast_runs_as_written_is_float32():
    # The product in float16, its scale in a region autocast is off for: the scale
    # runs as written, in float32, whatever moved onto the product's operands.
    q, k, a, b = (jax.random.normal(key, (8, 64)) for key in jax.random.split(jax.random.key(0), 4))

    def f(q, k, a, b):
        t = mpjax.autocast(lambda s: s * 0.125, enabled=False)(q @ k.T)
        return t + a @ b.T  # a float32 sum: t is float32

    (add,) = [
        e
        for e in all_eqns(jax.make_jaxpr(mpjax.autocast(f))(q, k, a, b))
        if e.primitive.name == "add"
    ]
    assert add.outvars[0].aval.dtype == F32
    s16 = jnp.matmul(q.astype(F16), k.astype(F16).T, preferred_element_type=F16)
    want = s16.astype(F32) * 0.125 + jnp.matmul(
        a.astype(F16), b.astype(F16).T, preferred_element_type=F32
    )
    np.testing.assert_allclose(jax.jit(mpjax.autocast(f))(q, k, a, b), want, atol=1e-3)


def test_a_scale_is_not_moved_onto_an_operand_other_products_read_too():
    # Flax's attention divides the query projection by jnp.sqrt(head_dim): the
    # layer's input, read by the key and value projections too, would be scaled
    # into a copy the backward pass keeps beside it (and a parameter scaled, into
    # a float32 copy). The scale stays after the product: the residuals are those
    # of the program as written.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(k1, (4, 8)), 0.3 * jax.random.normal(k2, (8, 8))
    wq, wk, wv = 0.3 * jax.random.normal(k3, (3, 8, 8))

    def layer(w, wq, wk, wv, x):
        h = jnp.tanh(x @ w)  # an activation, read by the three projections
        q = (h @ wq) / jnp.sqrt(8.0)
        return jnp.sum(jax.nn.softmax(q * (h @ wk), axis=-1) * (h @ wv))

    def residual_bytes(f):
        shapes = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], w, wq, wk, wv, x)
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))

    moved = residual_bytes(mpjax.autocast(layer))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mpjax._prescale, "find", lambda *args: {})
        assert moved == residual_bytes(mpjax.autocast(layer))


def test_a_moved_scale_costs_the_backward_products_at_most_eight_times_their_headroom():
    # (h @ W) / 64 with W a parameter: h alone may take at most 2**-3 of the scale,
    # so the backward product of h's cotangent grows at most 8x against as written
    # (here 2048 as written, 16384 moved: finite; 131072, inf, with all of 2**-6).
    w, x = jnp.full((64, 64), 0.5), jnp.ones((4, 64))

    def loss(w, x):
        return 2.0**12 * jnp.sum((jnp.tanh(x) @ w) * (1 / 64))

    grads = jax.grad(mpjax.autocast(loss), argnums=(0, 1))(w, x)
    assert all(np.isfinite(g).all() for g in grads)
    np.testing.assert_allclose(grads[1], jax.grad(loss, argnums=1)(w, x), rtol=1e-2)


# --- constants too large to evaluate, and products whose precision the user chose ---


def _table(n):
    return jnp.arange(n * n, dtype=jnp.float32).reshape(n, n)


# n = 64: evaluated at trace time; n = 300 (90,000 elements): too large, unknown.
_LARGE_CONSTANTS = {
    "added": lambda h, n: h + _table(n) * 30.0,  # up to 2.7e6: saturated, 65504
    "tiny_factor": lambda h, n: h * (_table(n) * 1e-11),  # flushed towards 0
    "product": lambda h, n: jnp.ones((4, n)) @ (jnp.linspace(1e-9, 2e-9, n * n).reshape(n, n)),
    "in_a_cond": lambda h, n: lax.cond(h[0, 0] > 0, lambda: h, lambda: _table(n) * 30.0),
}


@pytest.mark.parametrize("n", [64, 300])
@pytest.mark.parametrize("name", list(_LARGE_CONSTANTS))
def test_a_large_constant_made_from_arange_keeps_its_values(low, name, n):
    # A constant computed from literals is evaluated at trace time up to 65536
    # elements; a larger one, whose values autocast does not know, runs its
    # operation in float32 rather than cast blind (saturated to 65504, or 0).
    x = jnp.full((n, n), 0.01)
    f = lambda x, w: _LARGE_CONSTANTS[name](x @ w, n)  # noqa: E731
    got, want = jax.jit(mpjax.autocast(f, dtype=low))(x, jnp.eye(n)), f(x, jnp.eye(n))
    assert got.dtype == want.dtype and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=4 * rel_tol(low), atol=1e-30)


def test_random_values_the_function_draws_from_a_literal_key_are_known(low):
    # jax.random.normal(jax.random.key(0), ...) inside the function is a constant:
    # its values are evaluated through the typed key, and its product runs in 16 bits.
    def f(w):
        return jax.random.normal(jax.random.key(1), (3, 64)) @ w

    jaxpr = jax.make_jaxpr(mpjax.autocast(f, dtype=low))(jnp.ones((64, 4)))
    assert _dot_operand_dtypes(jaxpr) == [(low, low)]


def test_a_product_asked_for_a_float64_result_runs_as_written():
    # 257 products of 9 summed: 2313 in float64, 2312 rounded to float16; 30 * 30 *
    # 256 = 230400 is inf in float16.
    dims = (((1,), (0,)), ((), ()))
    f = lambda w, x: lax.dot_general(x, w, dims, preferred_element_type=jnp.float64)  # noqa: E731
    with jax.enable_x64(True):
        for v, k in ((3.0, 257), (30.0, 256)):
            x, w = jnp.full((4, k), v, jnp.float32), jnp.full((k, 8), v, jnp.float32)
            got = jax.jit(mpjax.autocast(f))(w, x)
            assert got.dtype == jnp.float64
            np.testing.assert_array_equal(got, f(w, x))


def test_a_product_with_an_integer_operand_runs_as_written(low):
    # A weight-only quantized layer: x @ int8 into float32, scaled after. In
    # float16 the product, 204800, would be inf; fp8 weights run as written too.
    dims = (((1,), (0,)), ((), ()))
    f = lambda x, q, s: lax.dot_general(x, q, dims, preferred_element_type=F32) * s  # noqa: E731
    x, s = jnp.full((2, 4096), 0.5), jnp.full((8,), 1e-3)
    q = jnp.full((4096, 8), 100, jnp.int8)
    got = jax.jit(mpjax.autocast(f, dtype=low))(x, q, s)
    np.testing.assert_array_equal(got, f(x, q, s))
    (dot,) = [e for e in all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=low))(x, q, s))
              if e.primitive.name == "dot_general"]  # fmt: skip
    assert [v.aval.dtype for v in dot.invars] == [F32, jnp.int8]


@pytest.mark.parametrize("config", ["bfloat16", "tensorfloat32"])
def test_highest_precision_is_kept_under_a_default_matmul_precision_that_is_not(config):
    # "bfloat16" writes DEFAULT into every product, so a user's HIGHEST (or a dot
    # algorithm) is told apart from it, and runs as written; "float32" writes
    # HIGHEST everywhere and asks nothing (test_explicit_highest_precision_...).
    x = jax.random.normal(jax.random.key(0), (16, 256))
    w = jax.random.normal(jax.random.key(1), (256, 32))
    dims = (((1,), (0,)), ((), ()))
    for precision in (lax.Precision.HIGHEST, lax.DotAlgorithmPreset.F32_F32_F32):
        f = lambda x, w: lax.dot_general(x, w, dims, precision=precision)  # noqa: B023, E731
        with jax.default_matmul_precision(config):
            got, want = jax.jit(mpjax.autocast(f))(x, w), f(x, w)
            plain = jax.make_jaxpr(mpjax.autocast(lambda x, w: x @ w))(x, w)
        np.testing.assert_array_equal(got, want)
        assert _dot_operand_dtypes(plain) == [(F16, F16)]  # the config's own: 16 bits


def test_lean_rounds_a_float32_mask_bias_to_the_low_dtype_saturated(low):
    # Hugging Face's Flax models add where(mask, 0, finfo(float32).min) to the
    # scores. The lean policy rounds that smaller float32 operand to the scores'
    # 16 bits: saturated to -max, as a hand-cast model writes finfo(float16).min,
    # not -inf, which made a fully masked (padding) row NaN.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (1, 4, 8))
    wq, wk = jax.random.normal(k2, (8, 2, 4)), jax.random.normal(k3, (8, 2, 4))
    keep = jnp.tril(jnp.ones((4, 4), bool)).at[:, 0].set(False)  # query 0 sees nothing
    bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min)[None, None]

    def attn(x, wq, wk, bias):
        q, k = jnp.einsum("btd,dhe->bhte", x, wq), jnp.einsum("btd,dhe->bhte", x, wk)
        return jax.nn.softmax(q @ k.swapaxes(-1, -2) + bias, -1)

    got = jax.jit(mpjax.autocast(attn, dtype=low, policy="lean"))(x, wq, wk, bias)
    want = attn(x, wq, wk, bias)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:, :, 1:], want[:, :, 1:], atol=4 * rel_tol(low))
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=rel_tol(low))


@pytest.mark.parametrize("fill", [-1e9, -1e30])
def test_lean_saturates_other_mask_fills_too(fill):
    x, w = jnp.ones((2, 8)), jnp.ones((8, 8))
    bias = jnp.where(jnp.arange(8) < 4, 0.0, jnp.float32(fill))
    got = mpjax.autocast(lambda x, w, b: x @ w + b, policy="lean")(x, w, bias)
    np.testing.assert_array_equal(got[:, 4:], -65504.0)  # float16's lowest, not -inf


def test_lean_overflows_a_float32_value_beyond_16_bits_rather_than_saturate_it():
    # A bias of 1e5 (a regression's target mean) is a value, not a mask's fill:
    # saturated to 65504 the loss was finite and 1000x off, its gradient of the
    # wrong sign, and a loss scaler applied the step. Overflowed, the loss is inf,
    # as under the default policy and in a model cast by hand: loud, and skipped.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x, y = jax.random.normal(k1, (256, 64)), 1e5 + 1e3 * jax.random.normal(k2, (256, 1))
    params = (0.05 * jax.random.normal(k3, (64, 1)), jnp.array([1e5]))

    def mse(p, x, y):
        w, b = p
        return jnp.mean((x @ w + b - y) ** 2)

    loss, grads = jax.value_and_grad(mpjax.autocast(mse, policy="lean"))(params, x, y)
    assert not np.isfinite(loss) and not np.all(np.isfinite(grads[1]))


def test_lean_keeps_a_running_sum_float32(low):
    # A decay's log, summed along a sequence (Mamba-2's segment sums): its later
    # elements reach -2500, where 16 bits hold only whole multiples of 2 (float16)
    # or 16 (bfloat16), and the differences of neighbours were rounded away.
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    x, w = jax.random.normal(k1, (4096, 32)), 0.1 * jax.random.normal(k2, (32, 1))
    r = jax.random.normal(k3, (4095,))

    def loss(w, x):
        cs = jnp.cumsum(-jnp.abs((x @ w)[:, 0]))
        return jnp.sum(jnp.exp(cs[1:] - cs[:-1]) * r)

    lean = mpjax.autocast(loss, dtype=low, policy="lean")
    (scan,) = [e for e in all_eqns(jax.make_jaxpr(lean)(w, x)) if e.primitive.name == "cumsum"]
    assert scan.outvars[0].aval.dtype == F32
    np.testing.assert_allclose(lean(w, x), mpjax.autocast(loss, dtype=low)(w, x), rtol=1e-6)


def _dense_norm(p, x):
    h = x @ p["w1"]
    mean = jnp.mean(h, axis=0)
    var = jnp.mean(lax.square(h), axis=0) - lax.square(mean)  # Flax's fast variance
    h = (h - mean) * lax.rsqrt(var + 1e-5)
    return jnp.sum((h @ p["w2"]).astype(F32) ** 2)


@pytest.mark.parametrize("low", [F16, BF16], ids=["f16", "bf16"])
def test_lean_adds_a_norms_cotangents_in_float32_before_rounding(low):
    # On activations around 50 with a spread of 3, the cotangents that
    # mean(h * h) and mean(h) send to h are each about 50 times their sum: rounded
    # to 16 bits apart, the first layer's gradient had 25 times the error.
    k = jax.random.split(jax.random.key(0), 3)
    x = 3 * jax.random.normal(k[0], (32, 16)) + 50
    p = {"w1": jax.random.normal(k[1], (16, 32)), "w2": jax.random.normal(k[2], (32, 4))}
    p = jax.tree.map(lambda w: 0.3 * w, p)
    lean = mpjax.autocast(_dense_norm, dtype=low, policy="lean")
    want = jax.grad(_dense_norm)(p, x)["w1"]
    err = {
        name: float(jnp.linalg.norm(jax.grad(f)(p, x)["w1"] - want) / jnp.linalg.norm(want))
        for name, f in [("lean", lean), ("default", mpjax.autocast(_dense_norm, dtype=low))]
    }
    assert err["lean"] < 1.5 * err["default"], err
    # and the backward pass still keeps 16-bit activations only, no float32 copy
    _, vjp = jax.vjp(lambda p: lean(p, x), p)
    assert {leaf.dtype for leaf in jax.tree.leaves(vjp) if leaf.size >= 32 * 32} == {low}


def _gram_nll(x, y):
    gram = x @ x.T + 1e-2 * jnp.eye(x.shape[0])
    chol = jnp.linalg.cholesky(gram)
    return 0.5 * y @ jax.scipy.linalg.cho_solve((chol, True), y) + jnp.sum(jnp.log(jnp.diag(chol)))


def _rbf_nll(x, y):
    sq = jnp.sum(x**2, -1)
    gram = jnp.exp(-0.125 * (sq[:, None] + sq[None, :] - 2 * x @ x.T)) + 1e-3 * jnp.eye(len(x))
    return jnp.linalg.slogdet(gram)[1] + y @ jnp.linalg.solve(gram, y)


def _gram_nll_observed(x, y):  # a callback looking at the Gram matrix changes nothing
    gram = x @ x.T + 1e-2 * jnp.eye(x.shape[0])
    jax.debug.callback(lambda g: None, gram)
    chol = jnp.linalg.cholesky(gram)
    return 0.5 * y @ jax.scipy.linalg.cho_solve((chol, True), y) + jnp.sum(jnp.log(jnp.diag(chol)))


def _ridge(x, y):
    return jnp.sum(jnp.linalg.solve(x.T @ x + jnp.eye(x.shape[1]), x.T @ y[:, None]) ** 2)


def _gram_nll_through(jitted):  # jnp's clip, where, tril, nan_to_num are nested jits
    def f(x, y):
        gram = jitted(x @ x.T) + 1e-2 * jnp.eye(x.shape[0])
        chol = jnp.linalg.cholesky(gram)
        return 0.5 * y @ jax.scipy.linalg.cho_solve((chol, True), y) + jnp.log(chol[0, 0])

    return f


def _gram_nll_with_dead_code(x, y):  # a value computed and never used reads nothing
    gram = x @ x.T + 1e-2 * jnp.eye(x.shape[0])
    _ = jnp.trace(gram) * gram
    chol = jnp.linalg.cholesky(gram)
    return 0.5 * y @ jax.scipy.linalg.cho_solve((chol, True), y) + jnp.sum(jnp.log(jnp.diag(chol)))


def _condition_number(x, y):  # jax 0.12's jnp.linalg.cond also tests its input for NaN
    return jnp.log(jnp.linalg.cond(x @ x.T + 1e-2 * jnp.eye(x.shape[0]))) + jnp.sum(y)


def _gram_nll_checked(x, y):  # a test of its own reads the matrix too
    gram = x @ x.T + 1e-2 * jnp.eye(x.shape[0])
    chol = jnp.linalg.cholesky(gram)
    nll = 0.5 * y @ jax.scipy.linalg.cho_solve((chol, True), y) + jnp.log(chol[0, 0])
    return jnp.where(jnp.isfinite(gram).all(), nll, jnp.nan)


@pytest.mark.parametrize(
    "fun",
    [
        _condition_number,
        _gram_nll_checked,
        _gram_nll,
        _rbf_nll,
        _ridge,
        _gram_nll_observed,
        _gram_nll_through(lambda k: jnp.clip(k, -100.0, 100.0)),
        _gram_nll_through(lambda k: jnp.where(jnp.eye(k.shape[0], dtype=bool), k, 1.0 * k)),
        _gram_nll_through(jnp.tril),
        _gram_nll_through(jnp.nan_to_num),
        _gram_nll_with_dead_code,
    ],
    ids=["cond", "checked", "gram", "rbf", "ridge", "observed", "clip", "where", "tril",
         "nan_to_num", "dead"],
)
def test_a_product_only_a_factorization_reads_runs_as_written(fun):
    # Rounded to bfloat16, the Gram matrix of 64 points was indefinite (an
    # eigenvalue of 0.01 became -0.06): its Cholesky factor, loss and gradient NaN.
    k1, k2 = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(k1, (64, 4)), jax.random.normal(k2, (64,))
    auto = mpjax.autocast(fun, dtype=BF16)
    np.testing.assert_allclose(jax.jit(auto)(x, y), jax.jit(fun)(x, y), rtol=1e-6)
    chex.assert_trees_all_close(
        jax.jit(jax.grad(auto))(x, y), jax.jit(jax.grad(fun))(x, y), rtol=1e-5, atol=1e-5
    )
    eqns = all_eqns(jax.make_jaxpr(auto)(x, y))
    products = [e for e in eqns if e.primitive.name == "dot_general"]
    assert products and all(e.invars[0].aval.dtype == F32 for e in products)


def test_a_product_a_factorization_and_another_operation_read_stays_16_bit():
    def fun(x, w):
        h = x @ w  # a layer's product: read by the next layer too
        return jnp.linalg.slogdet(h.T @ h + jnp.eye(4))[1] + jnp.sum(jnp.tanh(h))

    x, w = jax.random.normal(jax.random.key(0), (32, 8)), jnp.ones((8, 4))
    (layer, gram) = [e for e in all_eqns(jax.make_jaxpr(mpjax.autocast(fun))(x, w))
                     if e.primitive.name == "dot_general"]
    assert layer.outvars[0].aval.dtype == F16 and gram.outvars[0].aval.dtype == F32


# --- a print or a check changes nothing autocast computes -------------------------


def _scores(q, k, v, observe):
    s = q @ k.T  # up to 8e4 raw: inf in float16, unless the scale moves onto q and k
    observe(s)
    return jax.nn.softmax(s / 8.0, axis=-1) @ v


def _silu_mlp_of(act):
    def f(w1, x, w2, observe):
        a = act(x @ w1)  # fused between its two products
        observe(a)
        return jnp.mean(a @ w2) * 65536.0  # a loss scaler's scale

    return f


_silu_mlp = _silu_mlp_of(jax.nn.silu)


def _residual(x, w, observe):
    o = x @ w
    observe(o)
    return x + o  # reads the product's float32 accumulator


def _observed_args(name):
    k = jax.random.split(jax.random.key(0), 3)
    if name == "scores":
        q, kk = (jax.random.normal(key, (4, 64)) * 6 + 35 for key in k[:2])
        return _scores, (q, kk, jax.random.normal(k[2], (4, 64)))
    if name == "silu":
        x, w1 = jax.random.normal(k[0], (8, 32)) * 20, jax.random.normal(k[1], (32, 64)) * 2
        return _silu_mlp, (w1, x, jax.random.normal(k[2], (64, 8)) / 8)
    return _residual, (jax.random.normal(k[0], (16, 64)), jax.random.normal(k[1], (64, 64)) / 8)


@pytest.mark.parametrize("name", ["scores", "silu", "residual"])
def test_printing_a_value_changes_nothing_autocast_computes(name):
    # autocast's rewrites (a scale moved onto a product's operands, an activation
    # between two products computed as one, a residual sum of the float32
    # accumulator) want a value read once; a print or a checkify check of it is
    # no reader, and sees the value the program holds, as a float32 program's.
    f, args = _observed_args(name)
    seen = []

    def printed(x):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), x)

    def checked(x):
        checkify.check(jnp.all(jnp.isfinite(x)), "not finite")

    run = lambda observe: jax.jit(jax.value_and_grad(mpjax.autocast(  # noqa: E731
        lambda *a: jnp.sum(f(*a, observe)))))(*args)  # fmt: skip
    plain = run(lambda x: None)
    chex.assert_trees_all_equal(run(printed), plain)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(plain))
    want = []
    jax.jit(lambda *a: f(*a, lambda x: jax.debug.callback(lambda v: want.append(v), x)))(*args)
    # float32, rounded as the 16-bit program rounds it (not inf, nor scaled by 2**e)
    assert seen[0].dtype == F32
    np.testing.assert_allclose(seen[0], want[0], rtol=2e-2, atol=2e-2 * np.max(np.abs(want[0])))
    err, checked_out = checkify.checkify(lambda: run(checked))()
    err.throw()  # no check fails: the value checked is finite
    chex.assert_trees_all_equal(checked_out, plain)


@pytest.mark.parametrize("written", ["checkpoint_name", "weak_inputs"])
def test_the_scale_of_attention_scores_moves_through_a_name_or_a_weak_types_convert(written):
    # (q @ k.T) of 78400 is inf in float16; scaled by 1/8 it is 9800. The scale
    # moves onto q and k through checkpoint_name (saved by its name, as a checkpoint
    # policy asks) and through the convert jnp puts after a weak-typed product.
    from jax.ad_checkpoint import checkpoint_name

    if written == "checkpoint_name":
        q = jnp.full((4, 64), 35.0, F32)
        scores = lambda q, k: checkpoint_name(q @ k.T, "scores") / 8.0  # noqa: E731
    else:
        q = jnp.full((4, 64), 35.0)  # weak-typed
        scores = lambda q, k: (q @ k.T) / jnp.sqrt(64).astype(F32)  # noqa: E731
    k, v = q + 0.5, jnp.linspace(0.5, 1.5, 256).reshape(4, 64)
    f = jax.checkpoint(lambda q, k, v: jnp.sum(jax.nn.softmax(scores(q, k)) @ v),
                       policy=jax.checkpoint_policies.save_only_these_names("scores"))  # fmt: skip
    np.testing.assert_allclose(jax.jit(mpjax.autocast(scores))(q, k), scores(q, k), rtol=1e-3)
    value, grads = jax.jit(jax.value_and_grad(mpjax.autocast(f), (0, 1, 2)))(q, k, v)
    want_value, want_grads = jax.value_and_grad(f, (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-3)
    chex.assert_trees_all_close(grads, want_grads, rtol=2e-2, atol=1e-3)


def test_a_jit_of_jax_nn_silu_fuses_as_silu_does():
    # jax.nn.silu is a jit; a jit around it is a jit of a jit, still one activation
    # between two products: its derivative in float32, no inf * 0 at a loss scale.
    _, args = _observed_args("silu")
    losses = {"silu": _silu_mlp, "jit(silu)": _silu_mlp_of(jax.jit(jax.nn.silu))}
    grads = {
        name: jax.jit(jax.grad(mpjax.autocast(functools.partial(f, observe=lambda x: None))))(
            *args
        )
        for name, f in losses.items()
    }
    chex.assert_trees_all_equal(grads["jit(silu)"], grads["silu"])
    assert np.all(np.isfinite(grads["silu"]))


_FLOAT32_PROGRAMS = {
    "bias add": lambda w, b, x: jnp.sum(x @ w + b),
    "standardize": lambda w, b, x: jnp.sum(jax.nn.standardize(x @ w, -1) * b),
    "logsumexp": lambda w, b, x: jnp.sum(jax.nn.logsumexp(x @ w + b, -1)),
    "zeros accumulator": lambda w, b, x: jnp.sum(jnp.zeros((2, 4)) + x @ w + b),
}


@pytest.mark.parametrize("policy", ["torch", "lean"])
@pytest.mark.parametrize("name", sorted(_FLOAT32_PROGRAMS))
def test_strict_dtype_promotion_runs_what_plain_jax_runs(name, policy, low):
    # The user's program is all float32, which "strict" accepts; the 16-bit values
    # next to float32 ones are autocast's, and its own casts settle them.
    f = mpjax.autocast(_FLOAT32_PROGRAMS[name], dtype=low, policy=policy)
    args = (jnp.linspace(-1.0, 1.0, 32).reshape(8, 4), jnp.full((4,), 0.5), jnp.ones((2, 8)))
    expected = f(*args), jax.jit(jax.grad(f, argnums=(0, 1)))(*args)
    with jax.numpy_dtype_promotion("strict"):
        got = f(*args), jax.jit(jax.grad(f, argnums=(0, 1)))(*args)
    chex.assert_trees_all_equal(got, expected)


def test_strict_dtype_promotion_still_checks_the_users_own_code():
    f = mpjax.autocast(lambda x, y: jnp.sum(x + y))
    with jax.numpy_dtype_promotion("strict"):
        with pytest.raises(jax.dtypes.TypePromotionError):
            f(jnp.ones(3, jnp.float16), jnp.ones(3, jnp.float32))
