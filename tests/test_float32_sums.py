"""Sums are float32, forward and backward: no 16-bit accumulation anywhere in
``jax.grad(autocast(f))`` or ``jax.jvp(autocast(f))``.

JAX builds sums into derivatives: the transpose of a broadcast is a reduce_sum,
of a gather a scatter-add, the JVP of reduce_max counts ties with a reduce_sum,
a max-pool transposes to select_and_scatter_add. `sixteen_bit_sums` walks a
jaxpr, every sub-jaxpr included, and lists each equation that accumulates
16-bit values; the programs autocast makes, differentiated, must have none, and
must trace and lower with JAX's own guard, ``jax_allow_f16_reductions=False``
(which tests/conftest.py sets for the whole suite).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import mpjax
from conftest import BF16, F16, F32, all_eqns, rel_tol
from models import MODELS, model_case

from benchmarks.models import SIZES
from benchmarks.variants import VARIANTS, value_fn

SUMS = frozenset(
    {
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
        "reduce_window_sum",
        "scatter-add",
        "scatter_add",
        "select_and_scatter_add",
        "psum",
        "psum_invariant",
        "psum_scatter",
        "reduce_scatter",
    }
)
"""Primitives that accumulate their floating operands."""

COLLECTIVES = frozenset({"psum", "psum_invariant", "psum_scatter", "reduce_scatter"})
"""The all-reduces ``autocast(..., reduce_dtype=dtype)`` asks for in 16 bits."""


def _is_16_bit(atom) -> bool:
    dtype = getattr(atom.aval, "dtype", None)
    return dtype is not None and dtype in (F16, BF16)


def _sums_nothing(eqn) -> bool:
    """A reduction over axes of size 1 only (JAX's guard lets it pass too)."""
    if eqn.primitive.name not in ("reduce_sum", "reduce_prod"):
        return False
    shape = eqn.invars[0].aval.shape
    return all(shape[a] == 1 for a in eqn.params["axes"])


def sixteen_bit_sums(jaxpr, reduce_low: bool = False) -> list[str]:
    """Every equation of `jaxpr` (sub-jaxprs included) that sums 16-bit values.

    With `reduce_low` (``autocast(..., reduce_dtype=dtype)``), 16-bit all-reduces
    are what was asked for, and are not listed.
    """
    found = []
    for eqn in all_eqns(jaxpr):
        name = eqn.primitive.name
        if name not in SUMS or (reduce_low and name in COLLECTIVES):
            continue
        if any(_is_16_bit(v) for v in eqn.invars) and not _sums_nothing(eqn):
            ins = ", ".join(str(v.aval) for v in eqn.invars)
            found.append(f"{name}({ins}) at {mpjax._compat.user_frame(eqn)}")
    return found


@pytest.fixture
def f16_reductions_rejected():
    """JAX's own guard: a 16-bit reduce_sum is an error while tracing."""
    with jax.allow_f16_reductions(False):
        yield


def test_the_guard_is_on_for_the_suite():
    assert jax.config.jax_allow_f16_reductions is False
    with pytest.raises(ValueError, match="jax_allow_f16_reductions"):
        jax.make_jaxpr(jax.grad(lambda x: jnp.max(x).astype(jnp.float32)))(jnp.ones(4, F16))
    # ... and the helper finds what the guard rejects, with the guard lifted.
    with jax.allow_f16_reductions(True):
        jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.max(x).astype(jnp.float32)))(jnp.ones(4, F16))
    assert sixteen_bit_sums(jaxpr)


# --------------------------------------------------------------------------
# Whole models: tests/models.py, and the benchmark models (GPT, ViT, ResNet with
# GroupNorm and with BatchNorm) at their smallest size, every policy and dtype.

POLICIES = ["torch", "lean"]
LOWS = [jnp.float16, jnp.bfloat16]
BENCH_FAMILIES = list(SIZES["smoke"])


def _bench_case(family):
    """``(params, state, batch)``; `state` holds BatchNorm's statistics, or is empty."""
    spec = SIZES["smoke"][family]
    return (*spec.init(), spec.batch(jax.random.key(1)))


@functools.cache
def _bench_cases():
    return {family: _bench_case(family) for family in BENCH_FAMILIES}


def _bench_loss(family, low, policy):
    spec = SIZES["smoke"][family]
    suffix = "" if policy == "torch" else "-lean"
    variant = VARIANTS[f"autocast-{'f16' if low == jnp.float16 else 'bf16'}{suffix}"]
    return value_fn(spec, variant)


PROGRAMS = list(MODELS) + [f"bench-{family}" for family in BENCH_FAMILIES]
"""Every model by name: tests/models.py's, then the benchmark models'."""


def _model_loss(name, low, policy):
    """The model's loss under autocast."""
    if name.startswith("bench-"):
        return _bench_loss(name.removeprefix("bench-"), low, policy)
    return mpjax.autocast(MODELS[name], dtype=low, policy=policy)


def _args(name):
    """The model's arguments, drawn once, when a test first asks."""
    if name.startswith("bench-"):
        return _bench_cases()[name.removeprefix("bench-")]
    _, params, inputs = model_case(name)
    return (params, *inputs)


@pytest.mark.parametrize("low", LOWS, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", PROGRAMS)
def test_no_16_bit_sum_in_the_gradient(name, policy, low, f16_reductions_rejected):
    # Traced and lowered with JAX's guard on, and no 16-bit sum of any kind found
    # in the traced program (scatter-adds and cumulative sums too, which the
    # guard does not look at).
    traced = jax.jit(jax.grad(_model_loss(name, low, policy))).trace(*_args(name))
    assert sixteen_bit_sums(traced.jaxpr) == []
    assert "stablehlo" in traced.lower().as_text()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", PROGRAMS)
def test_forward_mode_has_no_16_bit_sum(name, policy):
    params, *rest = _args(name)
    fun = _model_loss(name, jnp.bfloat16, policy)
    tangent = jax.tree.map(jnp.ones_like, params)
    jaxpr = jax.make_jaxpr(lambda p: jax.jvp(lambda q: fun(q, *rest), (p,), (tangent,)))(params)
    assert sixteen_bit_sums(jaxpr) == []


@functools.cache
def _float32_gradients(family):
    """The float32 reference, compiled once per model for the four cases below."""
    spec = SIZES["smoke"][family]
    return jax.jit(jax.grad(value_fn(spec, VARIANTS["float32"])))(*_bench_cases()[family])


@pytest.mark.parametrize("low", LOWS, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", BENCH_FAMILIES)
def test_benchmark_model_gradients_close_to_float32(family, policy, low):
    """The benchmark models' gradients against float32's, in the tolerance
    tests/test_autocast_models.py uses, over all parameters together: at this
    size (a batch of 2) single GroupNorm gradients nearly cancel, and their
    relative error is noise."""
    params, state, batch = _bench_cases()[family]
    ref = _float32_gradients(family)
    got = jax.jit(jax.grad(_bench_loss(family, low, policy)))(params, state, batch)
    chex.assert_trees_all_equal_dtypes(got, params)
    diff = sum(
        float(jnp.sum((g - r) ** 2)) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
    )
    norm = sum(float(jnp.sum(r**2)) for r in jax.tree.leaves(ref))
    assert (diff / norm) ** 0.5 < 4 * rel_tol(low)


# --------------------------------------------------------------------------
# One primitive at a time. Each `forward` gets 16-bit inputs (or float32 ones
# that the policy casts); the loss differentiated is the float32 sum of its result.


def _max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _min_pool(x):
    return lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _avg_pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "VALID")


def _scan_max(x):
    return lax.scan(lambda c, y: (jnp.maximum(c, jnp.max(y)) + y, None), x[0], x)[0]


_X = jax.random.normal(jax.random.key(0), (8, 16))
_IMG = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
_IDX = jnp.array([1, 3, 3, 0, 1, 1])
_UNIQUE = jnp.array([1, 4, 2])
_ROW = jax.random.normal(jax.random.key(2), (16,))

# (id, forward, arguments, whether the forward pass does no arithmetic of its own)
PRIMITIVES = [
    ("broadcast", lambda x: jnp.broadcast_to(x, (5, 8, 16)), (_X,), True),
    ("add-row", lambda x, r: x + r, (_X, _ROW), True),
    ("sub-column", lambda x: x - jnp.sum(x, -1, keepdims=True), (_X,), False),
    ("mul-row", lambda x, r: x * r, (_X, _ROW), True),
    ("div-row", lambda x, r: x / (r * r + 1), (_X, _ROW), False),
    ("max-row", lambda x, r: jnp.maximum(x, r), (_X, _ROW), True),
    ("gather", lambda t: t[_IDX], (_X,), True),
    ("take_along_axis", lambda x: jnp.take_along_axis(x, _IDX[:, None] % 8, 0), (_X,), True),
    ("reduce_max", lambda x: jnp.max(x, -1), (_X,), True),
    ("reduce_min", lambda x: jnp.min(x, 0), (_X,), True),
    ("softmax", lambda x: jax.nn.softmax(x) * x, (_X,), False),
    ("cummax", lambda x: lax.cummax(x, 1), (_X,), True),
    ("cummin", lambda x: lax.cummin(x, 0), (_X,), True),
    ("max_pool", _max_pool, (_IMG,), True),
    ("min_pool", _min_pool, (_IMG,), True),
    ("avg_pool", _avg_pool, (_IMG,), False),
    ("sort", lambda x: jnp.sort(x, -1)[:, :3], (_X,), True),
    ("top_k", lambda x: lax.top_k(x, 3)[0], (_X,), True),
    ("approx_max_k", lambda x: lax.approx_max_k(x, 3)[0], (_X,), True),
    ("cumsum", lambda x: jnp.cumsum(x, 0), (_X,), False),
    ("cumprod", lambda x: jnp.cumprod(x, 0), (_X,), False),
    ("scatter-add", lambda x, r: x.at[_IDX].add(r), (_X, _ROW), False),
    ("scatter", lambda x, r: x.at[_IDX].set(r), (_X, _ROW), True),
    ("scatter-max", lambda x, r: x.at[_IDX].max(r), (_X, _ROW), True),
    ("scatter-mul", lambda x, r: x.at[_UNIQUE].mul(r, unique_indices=True), (_X, _ROW), False),
    ("tile", lambda x: jnp.tile(x, (2, 3)), (_X,), True),
    ("pad", lambda x, r: jnp.pad(x, 2, constant_values=r[0]), (_X, _ROW), True),
    ("dynamic_slice", lambda x: lax.dynamic_slice(x, (2, 0), (3, 16)), (_X,), True),
    ("checkpoint", lambda x: jax.checkpoint(lambda y: jnp.max(y, 0) * y)(x), (_X,), False),
    ("scan", _scan_max, (_X,), False),
]
PRIM_IDS = [p[0] for p in PRIMITIVES]
EXACT = [p for p in PRIMITIVES if p[3]]


def _loss(forward):
    return lambda *a: jnp.sum(forward(*a).astype(jnp.float32))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,forward,args,exact", PRIMITIVES, ids=PRIM_IDS)
def test_primitive_sums_in_float32(name, forward, args, exact, policy, low):
    auto = mpjax.autocast(_loss(forward), dtype=low, policy=policy)
    # 16-bit inputs, and float32 ones the policy casts.
    for inputs in (tuple(a.astype(low) for a in args), args):
        argnums = tuple(range(len(inputs)))
        assert sixteen_bit_sums(jax.make_jaxpr(jax.grad(auto, argnums))(*inputs)) == []
        jvp = jax.make_jaxpr(lambda *a: jax.jvp(auto, a, a))(*inputs)
        assert sixteen_bit_sums(jvp) == []


@pytest.mark.parametrize("scan", [lax.cummax, lax.cummin], ids=["cummax", "cummin"])
def test_running_max_gradient_adds_no_16_bit_cotangents(scan, low):
    # JAX differentiates cummax by an associative scan whose transpose adds the
    # cotangents in a tree of `add`s: element 0's gradient is the sum of all n.
    n = 1 << 12
    c = jnp.asarray(np.random.default_rng(5).uniform(0.9, 1.1, n) * 1000 / n, F32)
    sign = 1.0 if scan is lax.cummax else -1.0
    w, x = jnp.ones((1, n)).at[0, 0].set(2.0 * sign), jnp.full((1, 1), sign)

    def f(w, x):
        return jnp.sum(scan(x @ w, axis=1) * c)

    auto = mpjax.autocast(f, dtype=low)
    adds = [
        e
        for e in all_eqns(jax.make_jaxpr(jax.grad(auto))(w, x))
        if e.primitive.name in ("add", "add_any") and _is_16_bit(e.outvars[0])
    ]
    assert adds == []
    if scan is lax.cummax:  # cummin's program mirrors it; compiling one costs seconds
        want = float(jnp.asarray(jax.jit(jax.grad(f))(w, x)[0, 0], low))  # rounded once
        assert float(jax.jit(jax.grad(auto))(w, x)[0, 0]) == want


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,forward,args,exact", EXACT, ids=[p[0] for p in EXACT])
def test_primitive_forward_is_bit_identical(name, forward, args, exact, policy, low):
    """Run at float32 and rounded back, a primitive that does no arithmetic gives
    the 16-bit program's values exactly."""
    inputs = tuple(a.astype(low) for a in args)
    want = forward(*inputs)
    got = mpjax.autocast(forward, dtype=low, policy=policy)(*inputs)
    assert got.dtype == want.dtype == low
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --------------------------------------------------------------------------
# What float32 sums change in the numbers, and the collectives.


def test_lean_embedding_gradient_is_summed_in_float32():
    """A token seen 4096 times: its embedding gradient is 4096. Scattered into a
    16-bit table it stopped at 256 in bfloat16 (256 + 1 rounds to 256)."""
    table, tokens = jnp.ones((4, 8)), jnp.zeros(4096, jnp.int32)
    loss = mpjax.autocast(lambda t: jnp.sum(t[tokens]), dtype=jnp.bfloat16, policy="lean")
    grad = jax.grad(loss)(table)
    assert grad.dtype == F32
    np.testing.assert_array_equal(grad[0], 4096.0)
    np.testing.assert_array_equal(grad[1:], 0.0)


def test_lean_bias_gradient_is_summed_in_float32():
    """A float32 bias added to a [batch, features] bfloat16 activation: its
    gradient is a float32 sum over the batch of the rounded cotangents."""
    x = jnp.ones((4096, 8), jnp.bfloat16)
    w, b = jnp.full((8, 8), 1 / 8), jnp.zeros(8)
    loss = mpjax.autocast(
        lambda b, x: jnp.sum(jnp.tanh(x @ w + b)), dtype=jnp.bfloat16, policy="lean"
    )
    want = 4096 * (1 - np.tanh(1.0) ** 2)
    np.testing.assert_allclose(jax.grad(loss)(b, x), want, rtol=2e-3)


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))


def _collectives(x, w):
    def body(v, w):
        gathered = lax.all_gather(v * 2, "d", tiled=True)  # transposes to psum_scatter
        return lax.psum(v * w + gathered[: v.shape[0]], "d")  # w: replicated, made varying

    mapped = jax.shard_map(body, mesh=_mesh(), in_specs=(P("d"), P()), out_specs=P())
    return jnp.sum(mapped(x, w))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest)")
def test_collectives_sum_in_float32_unless_reduce_dtype_asks(low):
    x, w = jnp.arange(16.0, dtype=low).reshape(16, 1), jnp.full((1,), 3.0, low)

    def fun(x, w):
        return _collectives(x, w).astype(jnp.float32)

    def grad_jaxpr(**kw):
        return jax.make_jaxpr(jax.grad(mpjax.autocast(fun, dtype=low, **kw), (0, 1)))(x, w)

    default = grad_jaxpr()
    assert sixteen_bit_sums(default) == []
    sums = [e for e in all_eqns(default) if e.primitive.name in COLLECTIVES]
    assert len(sums) >= 3  # the forward psum, the transposes of all_gather and pvary
    assert all(e.invars[0].aval.dtype == F32 for e in sums)
    # The one exception: 16-bit all-reduces, asked for.
    asked = grad_jaxpr(reduce_dtype=low)
    assert sixteen_bit_sums(asked, reduce_low=True) == []
    assert any(e.primitive.name in COLLECTIVES and _is_16_bit(e.invars[0]) for e in all_eqns(asked))
    # The values: summed in float32, rounded once.
    np.testing.assert_array_equal(
        jax.jit(mpjax.autocast(fun, dtype=low))(x, w), jax.jit(fun)(x.astype(F32), w.astype(F32))
    )


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest)")
@pytest.mark.parametrize("collective", ["psum", "psum_scatter"])
def test_a_sum_over_devices_hands_on_float32_as_a_sum_over_an_axis_does(collective, low):
    # A row-parallel layer: each device's product (16000) fits in float16, the sum
    # of eight (128000) does not. Rounded back to 16 bits it was inf, and its
    # gradient through a tanh exactly 0; jnp.sum of the same products is float32.
    x, w = jnp.full((8, 4), 100.0), jnp.full((4, 8), 40.0)

    def body(x, w):
        if collective == "psum":
            return lax.psum(x @ w, "d")
        return lax.psum_scatter(x @ w, "d", scatter_dimension=1, tiled=True)

    spec = P() if collective == "psum" else P(None, "d")
    parallel = jax.shard_map(body, mesh=_mesh(), in_specs=(P("d"), P()), out_specs=spec)

    def loss(w, x):  # scaled, as a loss scaler would: its cotangents are normal numbers
        return 1024 * jnp.sum(jnp.tanh(parallel(x, w) / 128000))

    want = jax.jit(parallel)(x, w)
    got = jax.jit(mpjax.autocast(parallel, dtype=low))(x, w)
    assert got.dtype == F32
    np.testing.assert_array_equal(got, want)  # 16-bit products, exact here; summed in float32
    chex.assert_trees_all_close(
        jax.jit(jax.grad(mpjax.autocast(loss, dtype=low)))(w, x),
        jax.grad(loss)(w, x),
        rtol=1e-2,
    )
    # The one exception: a 16-bit all-reduce, asked for.
    asked = mpjax.autocast(parallel, dtype=low, reduce_dtype=low)
    names = {"psum": ("psum", "psum_invariant"), "psum_scatter": ("psum_scatter", "reduce_scatter")}
    eqns = all_eqns(jax.make_jaxpr(asked)(x, w))
    sums = [e for e in eqns if e.primitive.name in names[collective]]
    assert sums and all(_is_16_bit(e.invars[0]) for e in sums)


def test_vmap_inside_autocast_or_grad_inside_vmap_sums_in_float32(low):
    # The documented ways to batch: an unbatched 16-bit activation (tanh(s @ w))
    # meets batched ones; its gradient's sum over the batch stays float32.
    w = 0.3 * jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    s = jax.random.normal(jax.random.key(2), (8,))

    def per_example(s, x):
        return jnp.sum(jnp.tanh(x @ w) * jnp.tanh(s @ w))

    def inside(s):
        return jnp.mean(mpjax.autocast(jax.vmap(per_example, (None, 0)), dtype=low)(s, x))

    outside = jax.vmap(jax.grad(mpjax.autocast(per_example, dtype=low)), (None, 0))
    want = jax.grad(lambda s: jnp.mean(jax.vmap(per_example, (None, 0))(s, x)))(s)
    for got in (jax.grad(inside)(s), jnp.mean(outside(s, x), 0)):
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    for program in (jax.make_jaxpr(jax.grad(inside))(s), jax.make_jaxpr(outside)(s, x)):
        assert sixteen_bit_sums(program) == []


@jax.custom_jvp
def _scale_rows(h, c):
    return h * c[:, None]


@_scale_rows.defjvp
def _scale_rows_jvp(primals, tangents):
    (h, c), (dh, dc) = primals, tangents
    return _scale_rows(h, c), dh * c[:, None] + h * dc[:, None]  # broadcasts a tangent


@pytest.mark.parametrize(
    "loss",
    [
        lambda w, v, x: jnp.sum(_scale_rows(x @ w, (x @ v)[:, 0])),
        lambda w, v, x: jnp.sum(jax.scipy.special.zeta(2.0 + jnp.abs(x @ w), 1.0)),
        lambda w, v, x: jnp.linalg.det((x @ w)[:, :8].T @ (x @ w)[:, :8] / 4 + jnp.eye(8)),
    ],
    ids=["user rule", "zeta", "det"],
)
def test_a_custom_jvp_rule_that_broadcasts_a_tangent_sums_in_float32(loss, low):
    """JAX differentiates a custom_jvp's rule itself: the transpose of a broadcast
    or gather of a 16-bit tangent was a 16-bit sum (bf16[1, 64] reduce_sum here).
    Such a rule gets float32 tangents."""
    w, v, x = jnp.full((2, 64), 0.5), jnp.ones((2, 1)), jnp.ones((2, 2))
    step = jax.grad(mpjax.autocast(loss, dtype=low), argnums=(0, 1))
    assert sixteen_bit_sums(jax.make_jaxpr(step)(w, v, x).jaxpr) == []
    want = jax.grad(loss, argnums=(0, 1))(w, v, x)
    chex.assert_trees_all_close(jax.jit(step)(w, v, x), want, rtol=rel_tol(low), atol=1e-3)


def test_a_scatter_subtract_of_repeated_indices_sums_in_float32(low):
    # x.at[i].subtract: bfloat16 counting stopped at -256 for 4096 repeats.
    def f(table, idx):
        return table.at[idx].subtract(jnp.ones(idx.shape, table.dtype)).astype(jnp.float32)

    table, idx = jnp.zeros((4,), low), jnp.zeros((4096,), jnp.int32)
    np.testing.assert_array_equal(mpjax.autocast(f, dtype=low)(table, idx), [-4096.0, 0, 0, 0])
