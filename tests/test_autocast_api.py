"""The autocast API: call forms, pytrees, dtypes kept, regions, transforms, errors."""

import functools
import inspect
import traceback

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpjax
from conftest import BF16, F16, F32, all_eqns, rel_tol, value_dtypes


def _w(*shape, seed=0):
    return 0.3 * jax.random.normal(jax.random.key(seed), shape)


def _dots(fun, *args, **kwargs):
    return [
        e
        for e in all_eqns(jax.make_jaxpr(fun)(*args, **kwargs))
        if e.primitive.name == "dot_general"
    ]


def _out_dtypes(eqns):
    return [e.outvars[0].aval.dtype for e in eqns]


def _precisions(fun, *args, **kwargs):
    """The dtype each matrix product multiplies in: the values its operands hold."""
    jaxpr = jax.make_jaxpr(fun)(*args, **kwargs)
    held = value_dtypes(jaxpr)
    out = []
    for e in all_eqns(jaxpr):
        if e.primitive.name == "dot_general":
            (dtype, *others) = held[e]
            out.append(dtype if all(o == dtype for o in others) else tuple(held[e]))
    return out


# --- call forms and pytrees ------------------------------------------------------


def _mm(a, b):
    return a @ b


@pytest.mark.parametrize(
    "make",
    [
        lambda: mpjax.autocast(_mm),
        lambda: mpjax.autocast(_mm, dtype=jnp.bfloat16),
        lambda: mpjax.autocast()(_mm),
        lambda: mpjax.autocast(dtype="bfloat16")(_mm),
    ],
    ids=["plain", "dtype", "decorator", "decorator-dtype"],
)
def test_call_forms(make):
    f = make()
    assert f.__name__ == "_mm"
    assert _precisions(f, _w(2, 2), _w(2, 2))[0] in (F16, BF16)


def test_an_autocast_function_ships_by_value_with_cloudpickle():
    # As Ray or a spawned process receives a function defined in a script: by value.
    import cloudpickle

    loss = mpjax.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), dtype=BF16)
    w, x = _w(4, 3), _w(2, 4)
    loss(w, x)  # a call fills the trace cache, which is not shipped
    for shipped in (loss, jax.jit(loss)):
        copy = cloudpickle.loads(cloudpickle.dumps(shipped))
        chex.assert_trees_all_equal(copy(w, x), shipped(w, x))
    copy = cloudpickle.loads(cloudpickle.dumps(loss))
    assert str(mpjax.audit(copy, w, x)) == str(mpjax.audit(loss, w, x))


def test_decorator_syntax():
    @mpjax.autocast
    def f(a):
        return a @ a

    @mpjax.autocast(dtype=jnp.bfloat16)
    def g(a):
        return a @ a

    assert _precisions(f, _w(2, 2)) == [F16]
    assert _precisions(g, _w(2, 2)) == [BF16]


def test_pytree_arguments_keyword_arguments_and_results():
    def f(params, x, *, scale, training):
        h = x @ params["w"] * scale
        if training:  # a Python bool steers Python control flow
            h = h + 1.0
        return {"out": h, "aux": (params["b"], jnp.sum(h))}

    params = {"w": _w(3, 3), "b": jnp.arange(3)}
    got = mpjax.autocast(f)(params, _w(2, 3), scale=2.0, training=True)
    want = f(params, _w(2, 3), scale=2.0, training=True)
    chex.assert_trees_all_equal_structs(got, want)
    chex.assert_trees_all_equal_dtypes(got, want)  # results keep their dtypes
    chex.assert_trees_all_close(got, want, rtol=2e-2, atol=1e-2)


def test_results_keep_dtypes_even_half_inputs():
    # A function of float16 data that returns float16 still returns float16.
    f = mpjax.autocast(lambda x: jnp.exp(x) @ x)
    assert f(jnp.ones((2, 2), jnp.float16)).dtype == F16


# --- what is and is not cast ------------------------------------------------------


def test_weak_constants_do_not_widen():
    def f(w, x):
        h = x @ w
        return 0.5 * h + 1.0, jnp.where(h > 0, h, -1e9), h + jnp.arange(3.0)

    eqns = list(all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=jnp.bfloat16))(_w(3, 3), _w(2, 3))))
    for name in ("mul", "add", "select_n"):
        assert all(e.outvars[0].aval.dtype == BF16 for e in eqns if e.primitive.name == name), name


def test_strong_float32_input_widens():
    def f(w, x, bias):
        return x @ w + bias

    (add,) = [
        e
        for e in all_eqns(jax.make_jaxpr(mpjax.autocast(f))(_w(3, 3), _w(2, 3), _w(3)))
        if e.primitive.name == "add"
    ]
    assert [v.aval.dtype for v in add.invars] == [F32, F32]


def test_float16_and_bfloat16_inputs_meet_at_float32():
    f = mpjax.autocast(lambda a, b: a * b)
    assert f(jnp.ones(2, jnp.float16), jnp.ones(2, jnp.bfloat16)).dtype == F32
    jaxpr = jax.make_jaxpr(f)(jnp.ones(2, jnp.float16), jnp.ones(2, jnp.bfloat16))
    (mul,) = [e for e in all_eqns(jaxpr) if e.primitive.name == "mul"]
    assert [v.aval.dtype for v in mul.invars] == [F32, F32]


def test_explicit_user_casts_are_respected():
    def f(w, x16):
        up = jnp.tanh(x16.astype(jnp.float32))  # float16 data, upcast by the user
        down = jnp.sin(jnp.exp(x16 @ w).astype(jnp.float16))  # float32 exp, downcast by the user
        return up, down

    jaxpr = jax.make_jaxpr(mpjax.autocast(f))(_w(3, 3), _w(2, 3).astype(jnp.float16))
    eqns = list(all_eqns(jaxpr))
    assert _out_dtypes([e for e in eqns if e.primitive.name == "tanh"]) == [F32]
    assert _out_dtypes([e for e in eqns if e.primitive.name == "exp"]) == [F32]
    assert _out_dtypes([e for e in eqns if e.primitive.name == "sin"]) == [F16]


def test_integers_bools_and_keys_are_untouched():
    def f(w, idx, key, flags):
        noise = jax.random.normal(key, w.shape)
        rows = w[idx] @ w
        return jnp.sum(rows) + jnp.sum(noise * flags), jnp.cumsum(idx), idx * 2

    args = (_w(4, 4), jnp.array([0, 2]), jax.random.key(1), jnp.array([True, False, True, True]))
    got = jax.jit(mpjax.autocast(f))(*args)
    want = f(*args)
    chex.assert_trees_all_equal_dtypes(got, want)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


def test_float64_is_never_touched():
    with jax.enable_x64(True):
        x = jnp.ones((3, 3), jnp.float64)
        f = lambda a: jnp.exp(a @ a).sum()
        eqns = list(all_eqns(jax.make_jaxpr(mpjax.autocast(f))(x)))
        assert all(v.aval.dtype == np.float64 for e in eqns for v in e.outvars)
        assert not [e for e in eqns if e.primitive.name == "convert_element_type"]


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_float8_products_run_as_written(dtype):
    # A float8 product's precision was chosen by the user: e4m3 x e5m2 into float32
    # (the two kinds have no common type), and float8 x float32.
    e4m3 = jnp.arange(8.0).reshape(2, 4).astype(jnp.float8_e4m3fn)
    e5m2 = jnp.linspace(-2.0, 2.0, 12).reshape(4, 3).astype(jnp.float8_e5m2)
    w = jnp.linspace(0.1, 1.3, 12).reshape(4, 3)
    dims = (((1,), (0,)), ((), ()))

    def f(a, b, w):
        scaled = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32) * 0.5
        return scaled, lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)

    args = (e4m3, e5m2, w)
    got, want = mpjax.autocast(f, dtype=dtype)(*args), f(*args)
    chex.assert_trees_all_equal(got, want)
    eqns = list(all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=dtype))(*args)))
    assert not [e for e in eqns if e.primitive.name == "convert_element_type"]


# --- nested regions ---------------------------------------------------------------


def test_disabled_region_runs_as_written():
    def g(h, w):
        return h @ w  # traced with float32 inputs

    def f(w, x):
        h = x @ w
        return mpjax.autocast(g, enabled=False)(h, w) @ w

    dots = _dots(mpjax.autocast(f), _w(3, 3), _w(2, 3))
    assert _precisions(mpjax.autocast(f), _w(3, 3), _w(2, 3)) == [F16, F32, F16]
    assert [v.aval.dtype for v in dots[1].invars] == [F32, F32]  # inputs cast back


def test_inner_region_with_another_dtype_overrides():
    def f(w, x):
        inner = mpjax.autocast(lambda h: jnp.tanh(h @ w), dtype=jnp.bfloat16)
        return inner(x @ w) @ w

    assert _precisions(mpjax.autocast(f), _w(3, 3), _w(2, 3)) == [F16, BF16, F16]
    # ... and leaving it restores the outer region.
    np.testing.assert_allclose(
        jax.jit(mpjax.autocast(f))(_w(3, 3), _w(2, 3)), f(_w(3, 3), _w(2, 3)), rtol=5e-2, atol=1e-2
    )


@pytest.mark.parametrize("outer, inner", [(F16, F16), (F16, BF16), (BF16, F16)])
def test_gradient_through_a_region_nested_in_another(outer, inner):
    """The inner region's products are made once, by the inner region: the outer
    one differentiates them as they are (it failed with an empty AssertionError)."""

    def f(w, x):
        h = mpjax.autocast(lambda x, w: jnp.tanh(x @ w), dtype=inner)(x, w)
        return jnp.sum(h @ w)

    w, x = _w(3, 3), _w(2, 3)
    for argnums in [1, (0, 1)]:  # the weight not differentiated, or both
        expected = jax.grad(f, argnums=argnums)(w, x)
        for wrap in [lambda g: g, jax.jit]:
            grads = wrap(jax.grad(mpjax.autocast(f, dtype=outer), argnums=argnums))(w, x)
            assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
            chex.assert_trees_all_close(grads, expected, rtol=5e-2, atol=1e-2)
    assert _precisions(mpjax.autocast(f, dtype=outer), w, x) == [inner, outer]


@pytest.mark.parametrize(
    "inner", [dict(enabled=False), dict(dtype=jnp.bfloat16)], ids=["disabled", "bfloat16"]
)
def test_activation_read_only_by_an_inner_region_is_not_rounded_to_the_outer_dtype(inner):
    # exp(12.5) = 268337 overflows float16; the product that reads it runs in a
    # region that never rounds its operand to float16.
    def f(w1, w2, x):
        a = jnp.exp((x @ w1) * 0.5)
        return mpjax.autocast(lambda a: a @ w2, **inner)(a)

    x, w1, w2 = jnp.full((1, 4), 6.25), jnp.ones((4, 2)), jnp.full((2, 1), 1e-3)
    got, want = jax.jit(mpjax.autocast(f))(w1, w2, x), f(w1, w2, x)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-2)


def test_disabled_region_inside_nested_jit():
    def f(w, x):
        off = mpjax.autocast(lambda a: jnp.sin(a @ w), enabled=False)
        return jax.jit(lambda a: off(a @ w))(x).sum()

    assert _precisions(mpjax.autocast(f), _w(3, 3), _w(2, 3)) == [F16, F32]


def test_disabled_region_covers_the_loss_scalers_update():
    # A step autocast as a whole, its optimizer update in a disabled region: the
    # scaler evaluates its optimizer's program again (selecting the state where it
    # is computed), and that program is in the region too. Products an optimizer
    # makes (an orthogonalizing one's) stay float32.
    import optax

    def orthogonalize(g, state, params=None):
        return jax.tree.map(lambda x: 1.5 * x - 0.5 * x @ x.T @ x, g), state

    inner = optax.chain(
        optax.GradientTransformation(lambda p: optax.EmptyState(), orthogonalize),
        optax.scale_by_adam(),
    )
    tx = mpjax.grad_scaler(inner)
    params = {"w": _w(4, 4), "v": _w(4, 3, seed=1)}
    grads, state = jax.tree.map(jnp.sin, params), tx.init(params)

    def step(grads, state, params):
        return mpjax.autocast(tx.update, enabled=False)(grads, state, params)

    assert set(_precisions(mpjax.autocast(step), grads, state, params)) == {F32}
    chex.assert_trees_all_equal(
        jax.jit(mpjax.autocast(step))(grads, state, params), jax.jit(tx.update)(grads, state, params)
    )


def test_enabled_false_at_top_level_is_identity():
    f = lambda a: jnp.exp(a @ a)
    assert _precisions(mpjax.autocast(f, enabled=False), _w(2, 2)) == [F32]


# --- composition with transforms -----------------------------------------------------


def _loss(w, x):
    return jnp.sum(jax.nn.softmax(jnp.tanh(x @ w) @ w) ** 2)


def _biased_loss(w, x):
    """Two biased products with a GELU between them: the bias adds autocast runs
    as one operation each, differentiated by a rule of its own."""
    h = jax.nn.gelu(x @ w + w[0], approximate=True)
    return jnp.sum(jax.nn.softmax(h @ w + w[1]) ** 2)


def _grad_of_vmapped_jvp(ac, f):
    """The gradient of directional derivatives, the directions stacked on a last
    axis: the transpose of a batched JVP, each cotangent on its input's axis."""

    def g(w, x):
        def weighted(directions):
            jvp = lambda d: jax.jvp(lambda v: ac(f)(v, x), (w,), (d,))[1]  # noqa: E731
            return jnp.sum(jnp.arange(1.0, 4.0) * jax.vmap(jvp, in_axes=2)(directions))

        return jax.grad(weighted)(jnp.stack([w, 2 * w, -w], axis=2))

    return g


TRANSFORMS = {
    "jit": lambda ac, f: jax.jit(ac(f)),
    "grad": lambda ac, f: jax.grad(ac(f)),
    "jit(grad)": lambda ac, f: jax.jit(jax.grad(ac(f))),
    "grad(jit)": lambda ac, f: jax.grad(jax.jit(ac(f))),
    "autocast(grad)": lambda ac, f: ac(jax.grad(f)),
    "autocast(jit(grad))": lambda ac, f: ac(jax.jit(jax.grad(f))),
    "value_and_grad": lambda ac, f: lambda w, x: jax.value_and_grad(ac(f))(w, x)[1],
    "vmap": lambda ac, f: jax.vmap(ac(f), in_axes=(None, 0)),
    "autocast(vmap)": lambda ac, f: ac(jax.vmap(f, in_axes=(None, 0))),
    "vmap(grad)": lambda ac, f: jax.vmap(jax.grad(ac(f)), in_axes=(None, 0)),
    "grad(vmap)": lambda ac, f: jax.grad(lambda w, x: jax.vmap(ac(f), (None, 0))(w, x).sum()),
    "jvp": lambda ac, f: lambda w, x: jax.jvp(ac(f), (w, x), (jnp.ones_like(w), x))[1],
    "autocast(jvp)": lambda ac, f: ac(lambda w, x: jax.jvp(f, (w, x), (jnp.ones_like(w), x))[1]),
    "hessian-vector": lambda ac, f: (
        lambda w, x: jax.jvp(jax.grad(ac(f)), (w, x), (jnp.ones_like(w), x))[1]
    ),    "grad(vmap(jvp)) on a last axis": _grad_of_vmapped_jvp,
}


@pytest.mark.parametrize("loss", [_loss, _biased_loss], ids=["plain", "biased"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_composes_with_transforms(name, loss, low):
    make = TRANSFORMS[name]
    w, x = _w(4, 4), _w(3, 4, seed=1)
    if name.startswith(("vmap", "autocast(vmap)", "grad(vmap)")):
        x = _w(5, 3, 4, seed=1)
    got = make(functools.partial(mpjax.autocast, dtype=low), loss)(w, x)
    want = make(lambda f: f, loss)(w, x)
    chex.assert_trees_all_equal_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=8 * rel_tol(low), atol=3e-2)
    precisions = _precisions(make(functools.partial(mpjax.autocast, dtype=low), loss), w, x)
    assert precisions and set(precisions) == {low}


# --- errors --------------------------------------------------------------------------


def test_non_callable_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"autocast\(fun\): fun must be callable, got int"):
        mpjax.autocast(3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.int8, "half-ish", None, 3])
def test_bad_dtype_is_a_value_error_at_wrap_time(dtype):
    with pytest.raises(ValueError, match=r"autocast\(dtype=.*jnp.float16 or jnp.bfloat16"):
        mpjax.autocast(lambda x: x, dtype=dtype)


def test_enabled_must_be_a_bool():
    with pytest.raises(TypeError, match="enabled must be a Python bool"):
        mpjax.autocast(lambda x: x, enabled=jnp.array(True))


def test_python_scalars_are_static():
    def f(x, n, training):
        for _ in range(n):
            x = x @ x
        return x * 2 if training else x

    out = mpjax.autocast(f)(_w(2, 2), 3, training=False)
    np.testing.assert_allclose(out, f(_w(2, 2), 3, False), rtol=2e-2, atol=1e-3)


def test_array_in_python_control_flow_explains_the_fix():
    def f(x, flag):
        return x * 2 if flag else x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        mpjax.autocast(f)(_w(2), jnp.array(True))
    assert "Pass such flags as Python bools or ints" in "".join(info.value.__notes__)


def test_numpy_on_an_array_argument_explains_the_fix():
    with pytest.raises(jax.errors.TracerArrayConversionError) as info:
        mpjax.autocast(lambda x: np.asarray(x) * 2)(_w(2))
    assert "jnp in place of np" in "".join(info.value.__notes__)


def test_failures_are_reported_against_the_users_line():
    def f(x, idx):
        return jnp.sum(x @ x) + jax.pure_callback(
            lambda i: 1 / 0, jax.ShapeDtypeStruct((), jnp.float32), idx
        )

    with pytest.raises(Exception) as info:
        jax.block_until_ready(mpjax.autocast(f)(_w(2, 2), 0))
    text = "".join(traceback.format_exception(info.value))
    assert "test_autocast_api.py" in text
    assert "mpjax.autocast, while evaluating `pure_callback`" in text


@pytest.mark.parametrize("constant", [1e5, 1e-8, -7e4])
def test_literals_outside_the_low_range_run_in_float32(constant):
    # float16 holds neither 1e5 (max 65504) nor 1e-8 (below its normal range):
    # the operation runs in float32 instead of dividing by inf or by 0.
    f = lambda w, x: jnp.sum((x @ w) / constant)
    w, x = _w(3, 3), _w(2, 3, seed=1)
    (div,) = [
        e for e in all_eqns(jax.make_jaxpr(mpjax.autocast(f))(w, x)) if e.primitive.name == "div"
    ]
    assert div.outvars[0].aval.dtype == F32
    np.testing.assert_allclose(mpjax.autocast(f)(w, x), f(w, x), rtol=2e-2)
    # bfloat16 has float32's range: the quotient is handed on in bfloat16 (divided
    # in float32, as torch divides by a Python scalar, since bfloat16 holds 1e5,
    # 1e-8 and -7e4 only rounded).
    eqns = list(all_eqns(jax.make_jaxpr(mpjax.autocast(f, dtype=jnp.bfloat16))(w, x)))
    (div,) = [e for e in eqns if e.primitive.name == "div"]
    (read,) = [e for e in eqns if div.outvars[0] in e.invars]
    assert read.primitive.name == "convert_element_type" and read.outvars[0].aval.dtype == BF16


# --- the eager trace cache never returns a stale result --------------------------


class _Config:
    scale = 2.0


def test_a_class_passed_as_a_static_argument_is_read_at_every_call():
    g = mpjax.autocast(lambda x, cfg: x * cfg.scale)
    x = jnp.ones(2)
    g(x, _Config)
    _Config.scale = 5.0
    try:
        np.testing.assert_array_equal(g(x, _Config), jnp.full(2, 5.0))
    finally:
        _Config.scale = 2.0


def test_static_fields_of_a_pytree_node_are_keyed_as_static_arguments():
    import flax.struct

    @flax.struct.dataclass
    class P:
        a: jax.Array
        k: object = flax.struct.field(pytree_node=False)

    g = mpjax.autocast(lambda p: p.a * p.k)
    ints = jnp.ones(2, jnp.int32)
    g(P(ints, 1))
    assert g(P(ints, 1.0)).dtype == jnp.float32  # 1 == 1.0, but they trace apart
    cfg = _Config()
    h = mpjax.autocast(lambda p: p.a * p.k.scale)
    h(P(jnp.ones(2), cfg))
    cfg.scale = 9.0
    np.testing.assert_array_equal(h(P(jnp.ones(2), cfg)), jnp.full(2, 9.0))
    s = mpjax.autocast(lambda x, z: x * 0 + jnp.angle(z))
    s(jnp.ones(2), complex(0.0, 0))
    np.testing.assert_allclose(s(jnp.ones(2), complex(-0.0, 0)), jnp.full(2, np.pi))


_W = jnp.full(2, 2.0)


def test_a_global_array_read_by_a_nested_jit_is_read_at_every_call():
    global _W
    g = mpjax.autocast(lambda x: jax.jit(lambda x: x * _W)(x))
    g(jnp.ones(2))
    old, _W = _W, jnp.full(2, 5.0)
    try:
        np.testing.assert_array_equal(g(jnp.ones(2)), jnp.full(2, 5.0))
    finally:
        _W = old


def test_a_dropped_autocast_function_frees_what_it_closes_over_at_once():
    import gc
    import weakref

    def make():
        w = jnp.ones((3, 2))
        g = mpjax.autocast(lambda x: x @ w)
        g(jnp.ones((2, 3)))
        return g, weakref.ref(w)

    gc.disable()
    try:
        g, ref = make()
        del g
        assert ref() is None  # no reference cycle holds it until the collector runs
    finally:
        gc.enable()


def test_numpy_values_fun_returns_come_back_as_they_are():
    out = mpjax.autocast(lambda x: (x.sum(), np.float64(1e300), np.prod(np.int64([2**20] * 2))))(
        jnp.ones(2)
    )
    assert out[1] == 1e300 and out[2] == 2**40 and out[0].dtype == jnp.float32


def test_an_nnx_model_keeps_its_call_signature_for_static_argnames():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

        def __call__(self, x, train: bool):
            return self.dense(x) * (2.0 if train else 1.0)

    model = Net()
    casted = mpjax.autocast(model)
    assert list(inspect.signature(casted).parameters) == ["x", "train"]
    got = jax.jit(casted, static_argnames="train")(jnp.ones((1, 3)), True)
    np.testing.assert_allclose(got, model(jnp.ones((1, 3)), True), rtol=1e-2, atol=1e-2)


def test_a_primitive_bound_under_grad_is_not_reused_at_other_shapes():
    # jnp.digitize and jnp.interp both search sorted values (on jax 0.12 a primitive
    # whose parameter, equal for every shape, fixes its result's shape): the first,
    # differentiated, must not hand its bind to the second.
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def digitized(x):
        return jnp.digitize(x, jnp.array([-1.0, 0.0, 1.0])).astype(jnp.float32) * x

    def interpolated(x):
        return jnp.interp(x[0], jnp.sort(x[1]), x[2])

    jax.grad(lambda x: jnp.sum(mpjax.autocast(digitized)(x)))(x)
    got = jax.jit(jax.grad(lambda x: jnp.sum(mpjax.autocast(interpolated)(x))))(x)
    chex.assert_trees_all_close(got, jax.grad(lambda x: jnp.sum(interpolated(x)))(x), rtol=1e-6)


@jax.tree_util.register_pytree_node_class
class _Layer:
    """A callable pytree, as an Equinox module is."""

    def __init__(self, w, b):
        self.w, self.b = w, b

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)

    def tree_flatten(self):
        return (self.w, self.b), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def test_autocast_of_a_callable_pytree_is_a_pytree_whose_parameters_train():
    # Stored as a model's field (Equinox's `self.mlp = autocast(mlp)`), a plain
    # function would hide the layer's arrays: no gradient for them, no training.
    k1, k2 = jax.random.split(jax.random.key(0))
    layer = _Layer(jax.random.normal(k1, (8, 4)), jnp.zeros(4))
    x = jax.random.normal(k2, (16, 8))
    model = {"layer": mpjax.autocast(layer, dtype=jnp.bfloat16)}
    assert jax.tree.leaves(model) == [layer.w, layer.b]

    def loss(model):
        return jnp.mean(model["layer"](x) ** 2)

    grads = jax.tree.leaves(jax.jit(jax.grad(loss))(model))  # the layer's w and b
    want = jax.tree.leaves(jax.grad(lambda p: jnp.mean(p(x) ** 2))(layer))
    assert [g.dtype for g in grads] == [jnp.float32] * 2
    chex.assert_trees_all_close(grads, want, rtol=0.05, atol=1e-3)
    report = mpjax.audit(model["layer"], x)
    assert report.low_precision_fraction == 1.0 and report.casts_inserted
