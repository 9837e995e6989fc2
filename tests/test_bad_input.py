"""Bad input: each gives a clear error naming the argument and the fix, or runs untouched.

Cases already covered elsewhere are not repeated here: non-callables and bad
dtypes for autocast (test_autocast_api.py), out-of-range constructor arguments
by name (test_scaler.py), helpers on a state with no scaler or two
(test_scaler_integration.py). This file adds the messages' *fixes* and the
remaining inputs.

| bad input                                                        | what the library does                                              |
|------------------------------------------------------------------|--------------------------------------------------------------------|
| ``autocast(3)``, ``autocast(array)``                            | TypeError at wrap time: "autocast(fun): fun must be callable, got int. Wrap the function ... or use @autocast(dtype=...)" |
| ``autocast("cuda", dtype=...)`` (torch's spelling), any string   | TypeError at wrap time: autocast takes the function, not a device type, and how to wrap |
| ``autocast(jnp.float16)`` (dtype positionally, the torch habit)  | TypeError at wrap time: "autocast(fun): got the dtype float16 as the function; pass the dtype by keyword: autocast(dtype=jnp.float16)" |
| ``autocast(jnp.float32)``                                        | TypeError at wrap time, pointing to ``dtype=jnp.bfloat16`` and to ``enabled=False`` for a float32 region |
| ``grad_scaler(optax.adamw)`` (the factory, not an optimizer), or any non-optimizer ``inner`` | TypeError at wrap time: "grad_scaler(inner): inner must be an optax GradientTransformation, got 'adamw'; it makes one: pass grad_scaler(adamw(...))" |
| ``fun`` returning non-arrays beside arrays (a string tag)        | handed back as returned, as without autocast |
| an array used as a shape or slice bound                          | JAX's error, naming ``fun`` (not an mpjax wrapper), with mpjax's note on static arguments |
| ``audit(3)``, ``audit(array)``                                   | TypeError: "audit(fun, ...): fun must be callable, got int" |
| ``autocast(f, dtype=jnp.int8 / jnp.float64 / jnp.float32 / "half-ish")``, and as ``@autocast(dtype=...)`` | ValueError at wrap time naming ``dtype``, the two valid dtypes, and ``enabled=False`` for float32 regions (for a misspelling such as ``"bf16"``, or an integer dtype, how to spell the two); dtype names ``"float16"``, ``"bfloat16"`` are accepted; a tuple or list of dtypes is refused (NumPy would read it as its first), by ``diagnose`` too; ``dtype=jnp.float32`` with ``enabled=False`` is accepted (both say "as written") |
| ``autocast(f, reduce_dtype=...)`` other than ``jnp.float32`` or the autocast dtype (``None``, bfloat16 under float16, float64, int8, an unknown name), and as ``@autocast(reduce_dtype=...)`` | ValueError at wrap time naming ``reduce_dtype`` and its two choices, with what each does |
| NumPy dates and durations (``datetime64``, ``timedelta64``: arrays or scalars), strings, bytes, objects | passed to ``fun`` unchanged, as JAX cannot trace them; a scalar keys the eager trace by its value |
| Python bool / int / float / str arguments (positional, keyword, inside pytrees) | passed to ``fun`` unchanged, as Python objects: they may steer control flow and shapes; ``jax.jit(..., static_argnames=...)`` around autocast works |
| a JAX array (or a NumPy scalar, which counts as an array) in Python control flow: ``if x``, ``range(n)``, ``float(x)`` | JAX's error, with mpjax's note: "Pass such flags as Python bools or ints ..., close over them, or use lax.cond / jnp.where" |
| ``audit(autocast(f), x, True)`` with a static Python flag          | works: audit passes non-array leaves to ``fun`` unchanged, as autocast does |
| get_scale / set_scale / scaled_value_and_grad / scaler_stats on the optimizer itself (``tx``), on params, on ``None``, on an ``nnx.Optimizer`` without a scaler | ValueError: "no GradScalerState found in `opt_state` (a <type>). Build the optimizer with mpjax.grad_scaler(inner) ... Pass the state its init returned." |
| (any helper)                                                     | the message starts with the name of the helper called |
| the same helpers on a state holding two scalers                  | ValueError: "found 2 GradScalerStates ... (at <paths>) ... Wrap the whole optimizer in a single grad_scaler" |
| ``grad_scaler(...).update`` on a state that holds no scaler (e.g. a pre-mpjax checkpoint) | TypeError naming ``state`` and GradScalerState, and how to restore into ``tx.init(params)`` |
| the same on a scaler's checkpoint restored without a target (a plain dict of its fields) | TypeError saying the restore lacked a target structure, and how to restore into ``tx.init(params)`` |
| the helpers on such a restored checkpoint                          | ValueError saying the restore lacked a target structure |
| ``set_scale(state, None / "1024" / True / [2.0])``                 | TypeError naming ``new_scale`` |
| ``autocast(dtype=...)(params, x)`` (the function forgotten) | TypeError: ``autocast(dtype=...)`` returns a decorator; ``autocast(loss_fn, dtype=...)(params, x)`` |
| ``with autocast():`` (torch's spelling)                            | TypeError: autocast is a function transform, not a context manager, and how to wrap |
| ``rule_for(42)``; ``rule_for(jax.lax.exp_p)``                        | TypeError naming ``primitive_name``; a primitive is read by its name |
| ``rule_for("matmul")``, ``rule_for("conv2d")``, ``rule_for("softplus")``: any name on torch's CUDA autocast op lists that is no JAX primitive's | ValueError naming the JAX primitive to look up instead of answering ORIGINAL; ``AuditReport.find("matmul")`` likewise, rather than an empty list |
| ``rule_for("gather", lean="False")``, ``lean=1``; ``AuditReport.find(1)`` | TypeError naming ``lean`` (a string is truthy); naming ``primitive`` |
| ``autocast(f, dtype=jnp.ones(3, jnp.bfloat16))``, ``dtype=np.float16(3)``, ``reduce_dtype=jnp.zeros(2)``, ``diagnose(..., dtype=array)``: a value for a dtype | TypeError at wrap time naming the argument: a dtype, not a value (NumPy would read the value as its dtype); ``x.dtype`` for a value's |
| ``autocast(LinenModel)`` (a class) | TypeError at wrap time: autocast ``model.apply`` |
| ``autocast(LinenModel())`` unbound, a module bound with ``mutable=`` whose call writes a collection | TypeError when called: autocast ``model.apply`` (a call Flax can run unbound, or one that writes nothing, runs) |
| ``static_scaler``'s init on float16 parameters, its update on a wrong state | the errors name ``static_scaler``, not ``grad_scaler`` |
| ``scaled_value_and_grad(f, state, argnums=np.int64(1))``; ``argnums="0"`` | taken as ``jax.value_and_grad`` takes it; a TypeError naming ``argnums`` |
| ``scaled_value_and_grad(jax.value_and_grad(f), state)``                  | ValueError: looks like ``jax.value_and_grad(f)``, pass ``f`` |
| a scaler setting injected by ``optax.inject_hyperparams`` (traced)   | the traced-setting ValueError names ``static_args`` |
| a scaler inside a scaler                                          | the helpers' ValueError gives the inner one's path, ``.inner_state`` included |
| ``enabled`` or ``check_updates`` other than True / False (``"false"`` from a config file, ``None``, ``0.0``) | ValueError naming the argument |
| settings as 0-d JAX or NumPy arrays (``init_scale=jnp.float32(4.0)``)  | taken as the numbers they hold; a traced one is a ValueError: settings are fixed when the scaler is built (``set_scale`` changes the scale) |
| ``grad_scaler`` without ``axis_name`` inside ``shard_map`` on gradients that differ between devices, with a state they share | ValueError naming the mesh axes and ``axis_name`` |
| ``grad_scaler(..., axis_name="data")`` where no mapped axis of that name is bound (a mesh of other names, a sharded ``jit``, an eager call) | ValueError naming ``axis_name`` and where to call ``update`` |
| ``grad_scaler(..., axis_name=0 / 1 / {} / ["data"])``, likewise ``static_scaler`` | ValueError at construction naming ``axis_name``, what an axis name is, and a correct call (``lax.psum`` would read an integer as an array axis) |
| hyperparameters out of range (``growth_factor``, ``backoff_factor``, ``growth_interval``, ``init_scale``, ``min_scale``, ``accumulation_steps``, static ``scale``, ``set_scale``'s ``new_scale``) | ValueError naming the function, the argument, the valid range and the value given |
| a restored scale that is a float64 / float16 / bfloat16 / int / NumPy / Python scalar | accepted: the step is bit-identical to the one from a float32 scale and the new state's scale is a float32 scalar again |
| the same, read with ``get_scale`` / ``scaler_stats`` before any step | returned as a float32 scalar, as documented |
| a restored scale of 0                                            | the step is skipped and the scale backs off to ``min_scale``: training resumes |
| a restored scale of shape (1,)                                   | ValueError at ``update`` naming ``scale``, its shape, and how to restore |
| a scaler state made for another inner optimizer or other parameters (an earlier run's checkpoint) | ValueError at ``update`` naming the first leaf of ``state.inner_state`` that differs from ``inner.init(params)``'s, and how to restore |
| gradients shaped unlike the parameters given to ``update`` | ValueError naming the first leaf that differs, in both trees |
| a restored scale of NaN or inf                                   | the scale restarts from ``min_scale`` and training resumes |
| integer inputs (int8 matmuls included), float64 inputs under ``jax.enable_x64`` | run untouched: same values bit for bit, same dtypes, no cast inserted; float64 gradients stay float64 |
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import mpjax
from mpjax import (
    get_scale,
    grad_scaler,
    scaled_value_and_grad,
    scaler_stats,
    set_scale,
    static_scaler,
)

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.zeros(2)}

# --------------------------------------------------------------------------
# autocast / audit: the function and the dtype.


@pytest.mark.parametrize("fun", [3, jnp.ones(2)], ids=["int", "array"])
def test_non_callable_names_fun_and_the_fix(fun):
    with pytest.raises(
        TypeError,
        match=r"autocast\(fun\): fun must be callable, got "
        r"(int|ArrayImpl)\. Wrap the function",
    ) as info:
        mpjax.autocast(fun)
    assert "@autocast(dtype=jnp.bfloat16)" in str(info.value)


@pytest.mark.parametrize("device", ["cuda", "cpu", "loss"])
def test_a_device_type_first_as_torch_takes_it_says_autocast_takes_the_function(device):
    with pytest.raises(TypeError, match=r"not a device type.*autocast\(loss_fn, dtype="):
        mpjax.autocast(device, dtype=jnp.float16)


def test_dtype_passed_positionally_is_refused_at_wrap_time():
    # torch.autocast(device, dtype) habits: autocast(jnp.float16) wraps the
    # float16 *constructor*, and @autocast(jnp.bfloat16) breaks the function.
    with pytest.raises(TypeError, match=r"dtype="):
        mpjax.autocast(jnp.bfloat16)


def test_float32_passed_as_the_function_points_to_a_fix_that_works():
    # The advice must not be autocast(dtype=jnp.float32), which is refused.
    with pytest.raises(TypeError) as info:
        mpjax.autocast(jnp.float32)
    message = str(info.value)
    assert "enabled=False" in message and "dtype=jnp.float32" not in message
    mpjax.autocast(lambda x: x, enabled=False)  # what it advises for float32
    np.testing.assert_array_equal(
        mpjax.autocast(jnp.sin, enabled=np.bool_(False))(1.0), jnp.sin(1.0)
    )
    mpjax.autocast(lambda x: x, dtype=jnp.bfloat16)


@pytest.mark.parametrize("make", ["grad_scaler", "static_scaler", "noop_scaler"])
def test_scaler_given_an_optimizer_factory_says_to_call_it(make):
    build = {
        "grad_scaler": mpjax.grad_scaler,
        "static_scaler": lambda inner: mpjax.static_scaler(inner, 128.0),
        "noop_scaler": mpjax.noop_scaler,
    }[make]
    with pytest.raises(TypeError, match=rf"{make}\(inner\): .*pass {make}\(adamw\(\.\.\.\)\)"):
        build(optax.adamw)
    with pytest.raises(TypeError, match=rf"{make}\(inner\): .*got 'int'"):
        build(3)


def test_non_array_outputs_come_back_as_returned():
    # As without autocast: a tag or a config beside the loss is handed back.
    # Python numbers come back as the numbers themselves, whatever their size.
    def f(x, n):
        return x.sum(), "tag", {"n": n + 1, "big": 1e300, "flag": True, "none": None}

    x = jnp.ones((2, 3))
    for n in (2, 2**40):
        got, want = mpjax.autocast(f)(x, n), f(x, n)
        assert got[1:] == want[1:]
        assert {k: type(v) for k, v in got[2].items()} == {k: type(v) for k, v in want[2].items()}
        np.testing.assert_array_equal(got[0], want[0])
    grad = jax.grad(lambda x: mpjax.autocast(f)(x, 2)[0])(x)
    np.testing.assert_array_equal(grad, jnp.ones((2, 3)))


@pytest.mark.filterwarnings("ignore:Python iterable type 'generator'")
def test_an_object_holding_arrays_that_is_no_pytree_is_refused_when_returned():
    # Handed back as it is, it would hold values of the finished trace.
    @dataclasses.dataclass
    class Out:
        y: object

    class Layer:  # no pytree: its bound method holds the layer
        def __init__(self, w):
            self.w = w

        def __call__(self, v):
            return v @ self.w

    x = jnp.ones((2, 3))
    for f in (
        lambda x: Out(x @ x.T),
        lambda x: (v for v in [x @ x.T]),
        lambda x: (lambda v: v @ x.T),  # a closure over a value of the trace
        lambda x: Layer(x.T).__call__,
    ):
        with pytest.raises(
            TypeError, match=r"autocast\(<lambda>\): .* not a pytree.*register_dataclass"
        ):
            mpjax.autocast(f)(x)
    assert mpjax.autocast(lambda x: (x.sum(), Out(5)))(x)[1] == Out(5)  # no arrays: as returned
    assert mpjax.autocast(lambda x: (x.sum(), jnp.tanh))(x)[1] is jnp.tanh


def test_shapes_given_to_a_call_name_the_argument_and_the_ways_to_shapes():
    w, x = jax.ShapeDtypeStruct((4, 3), jnp.float32), jnp.ones((2, 4))
    matmul = mpjax.autocast(lambda p, x: x @ p["w"])
    with pytest.raises(TypeError, match=r"args\[0\]\['w'\] is a jax.ShapeDtypeStruct.*eval_shape"):
        matmul({"w": w}, x)
    assert jax.eval_shape(matmul, {"w": w}, x).shape == (2, 3)  # shapes alone: as jax's
    assert mpjax.audit(matmul, {"w": w}, x).find("dot_general")


def test_an_abstract_nnx_module_given_to_a_call_is_named_as_the_user_passed_it():
    def loss(model, x):
        return jnp.sum(model(x))

    model = nnx.eval_shape(lambda: nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"autocast\(loss\): args\[0\]\.bias\.value is a jax"):
        mpjax.autocast(loss)(model, jnp.ones((2, 8)))


def test_numpy_strings_reach_fun_unchanged():
    def f(x, names):
        return x * len(names) if names[0] == "a" else x

    x = jnp.ones(3)
    for names in (np.array(["a", "b"]), np.str_("a"), np.array(["b"])):
        chex.assert_trees_all_equal(mpjax.autocast(f)(x, names), f(x, names))


def test_numpy_dates_and_durations_reach_fun_unchanged():
    """JAX cannot trace them: they are handed over as they are, as to `fun` without
    autocast; a date scalar keys the eager trace by its value, an array is traced anew."""
    traces = []

    def f(x, when):
        return x * (when > np.datetime64("2021-01-01"))

    def traced(x, when):
        traces.append(when)
        return f(x, when)

    x = jnp.ones(2)
    dates = np.array(["2020-01-01", "2022-01-01"], dtype="datetime64[D]")
    later, earlier = np.datetime64("2022-01-01"), np.datetime64("2020-01-01")
    for when in [dates, dates, later, later, earlier]:
        chex.assert_trees_all_equal(mpjax.autocast(traced)(x, when), f(x, when))
    autocast_traced = mpjax.autocast(traced)
    traces.clear()
    for when in [dates, dates, later, later, earlier]:
        autocast_traced(x, when)
    assert [type(t) for t in traces] == [np.ndarray, np.ndarray, np.datetime64, np.datetime64]
    durations = mpjax.autocast(lambda x, d: x * (d / np.timedelta64(1, "h")))
    chex.assert_trees_all_close(durations(x, np.timedelta64(2, "D")), x * 48.0)


def test_a_generator_function_is_refused_when_wrapped():
    # Its body would run after autocast returns, on tracers of a finished trace.
    def batches(x):
        yield x @ x.T

    with pytest.raises(TypeError, match="generator or coroutine function.*batches"):
        mpjax.autocast(batches)


@pytest.mark.parametrize("kind", [staticmethod, classmethod])
def test_autocast_under_a_method_decorator_says_which_goes_outside(kind):
    with pytest.raises(TypeError, match=f"Put @{kind.__name__} above @autocast"):
        mpjax.autocast(kind(lambda x: x))
    with pytest.raises(TypeError, match=f"Put @{kind.__name__} above @autocast"):
        mpjax.autocast(dtype=jnp.bfloat16)(kind(lambda x: x))

    class Model:  # the order that works
        @kind
        @mpjax.autocast
        def f(*args):
            return args[-1] @ args[-1]

    x = jnp.ones((2, 2))
    chex.assert_trees_all_equal(Model().f(x), Model.f(x), (x @ x).astype(jnp.float16))


def test_array_used_as_a_shape_names_the_users_function_and_carries_the_hint():
    def loss(flag, params, n):
        return params["a"].sum() * jnp.ones(n) if flag else 0.0

    with pytest.raises(TypeError) as info:
        mpjax.autocast(loss)(True, {"a": jnp.ones(2)}, jnp.int32(3))
    assert "the function loss at" in str(info.value) and "flat_fun" not in str(info.value)
    assert HINT in "".join(info.value.__notes__)
    with pytest.raises(IndexError) as info:  # a slice bound from an array
        mpjax.autocast(lambda n, a: a[:, :n])(jnp.int32(2), jnp.ones((2, 4)))
    assert HINT in "".join(info.value.__notes__)


@pytest.mark.parametrize("fun", [3, jnp.ones(2)], ids=["int", "array"])
def test_audit_non_callable_names_fun(fun):
    with pytest.raises(
        TypeError,
        match=r"audit\(fun, \.\.\.\): fun must be callable, got "
        r"(int|ArrayImpl)",
    ):
        mpjax.audit(fun, jnp.ones(2))


@pytest.mark.parametrize(
    "dtype", [jnp.int8, jnp.float64, jnp.float32, "half-ish", "int8", "bf16", "fp16"]
)
def test_bad_dtype_names_the_valid_ones_and_the_float32_route(dtype):
    for make in [
        lambda: mpjax.autocast(lambda x: x, dtype=dtype),
        lambda: mpjax.autocast(dtype=dtype),
    ]:  # the decorator form fails as early
        with pytest.raises(
            ValueError,
            match=r"autocast\(dtype=.*\): dtype must be jnp\.float16 "
            r"or jnp\.bfloat16",
        ) as info:
            make()
        if dtype in (jnp.float64, jnp.float32):  # a wider float: the float32 route
            assert "autocast(fun, enabled=False)" in str(info.value)
        else:  # a misspelling, or no float at all: how to spell the two
            assert "Spell it jnp.float16, jnp.bfloat16, 'float16' or 'bfloat16'." in str(
                info.value
            )


@pytest.mark.parametrize(
    "dtype", [(jnp.float16, jnp.bfloat16), ("bfloat16", "float16"), [jnp.float16], {"a": 1}]
)
def test_a_collection_of_dtypes_is_refused_not_read_as_its_first(dtype):
    # NumPy reads (float16, bfloat16) as a float16 sub-array type: taken for its
    # base, it ran one dtype where the user asked for two.
    with pytest.raises(ValueError, match=r"autocast\(dtype=.*\): dtype must be jnp\.float16"):
        mpjax.autocast(lambda x: x, dtype=dtype)
    with pytest.raises(ValueError, match=r"diagnose\(dtype=.*\): dtype must be .*\"both\""):
        mpjax.diagnose(lambda w, x: jnp.sum(x @ w), jnp.ones((4, 2)), jnp.ones((3, 4)), dtype=dtype)


def test_a_disabled_region_takes_float32_as_its_dtype():
    # torch's autocast(dtype=torch.float32, enabled=False): both say "as written".
    x = jnp.ones((2, 2))
    f = mpjax.autocast(lambda a: a @ a, dtype=jnp.float32, enabled=False)
    report = mpjax.audit(f, x)
    assert [e.in_dtypes for e in report.find("dot_general")] == [("float32", "float32")]
    with pytest.raises(ValueError, match=r"autocast\(dtype=.*int8.*\): dtype must be"):
        mpjax.autocast(lambda a: a, dtype=jnp.int8, enabled=False)


@pytest.mark.parametrize("reduce_dtype", [jnp.bfloat16, jnp.float64, jnp.int8, "quarter", None])
def test_bad_reduce_dtype_names_the_two_choices(reduce_dtype):
    for make in [
        lambda: mpjax.autocast(lambda x: x, reduce_dtype=reduce_dtype),
        lambda: mpjax.autocast(reduce_dtype=reduce_dtype),
    ]:  # float16 autocast: bfloat16 is neither float32 nor the autocast dtype
        with pytest.raises(
            ValueError,
            match=r"autocast\(reduce_dtype=.*\): reduce_dtype must be jnp\.float32 .* or "
            r"jnp\.float16, the autocast dtype",
        ):
            make()


@pytest.mark.parametrize("low", [jnp.float16, jnp.bfloat16])
def test_reduce_dtype_in_16_bits_keeps_16_bit_product_results(low):
    report = mpjax.audit(
        mpjax.autocast(lambda a: a @ a, dtype=low, reduce_dtype=low), jnp.ones((2, 2))
    )
    assert [e.out_dtypes for e in report.find("dot_general")] == [(np.dtype(low).name,)]


@pytest.mark.parametrize(
    "value", [jnp.ones(3, jnp.bfloat16), np.float16(3), jnp.float16(1), np.zeros(2, np.float16)]
)
def test_a_value_given_for_a_dtype_is_refused_naming_the_argument(value):
    # NumPy reads an array or a scalar as its dtype: data passed by mistake for a
    # setting would run as if its dtype had been given.
    for name in ["dtype", "reduce_dtype"]:
        with pytest.raises(TypeError, match=rf"autocast\({name}=\.\.\.\): {name} must be a "
                           r"dtype.* not a value.*pass x\.dtype"):  # fmt: skip
            mpjax.autocast(lambda x: x, **{name: value})
    with pytest.raises(TypeError, match=r"diagnose\(dtype=\.\.\.\): dtype must be a dtype"):
        mpjax.diagnose(lambda w, x: jnp.sum(x @ w), jnp.ones((4, 2)), jnp.ones((3, 4)), dtype=value)


@pytest.mark.parametrize(
    "dtype",
    [jnp.bfloat16, np.float16, ml_dtypes.bfloat16, np.dtype("bfloat16"), jnp.dtype("float16")],
)
def test_dtype_likes_are_accepted(dtype):
    report = mpjax.audit(mpjax.autocast(lambda a: a @ a, dtype=dtype), jnp.ones((2, 2)))
    assert [e.in_dtypes for e in report.find("dot_general")] == [(np.dtype(dtype).name,) * 2]


@pytest.mark.parametrize("name, low", [("float16", jnp.float16), ("bfloat16", jnp.bfloat16)])
def test_dtype_names_are_accepted(name, low):
    x = jnp.ones((2, 2))
    report = mpjax.audit(mpjax.autocast(lambda a: a @ a, dtype=name), x)
    assert [e.in_dtypes for e in report.find("dot_general")] == [(np.dtype(low).name,) * 2]


# --------------------------------------------------------------------------
# Static Python arguments, and arrays where Python values are needed.


def test_python_scalars_and_strings_reach_fun_unchanged():
    seen = {}

    def f(x, n, *, training, eps, act, sizes):
        seen.update(n=n, training=training, eps=eps, act=act, sizes=sizes)
        h = x
        for _ in range(n):  # an int steers a Python loop
            h = getattr(jnp, act)(h @ x)
        h = h + jnp.zeros(sizes["cols"])  # an int inside a pytree gives a shape
        if training and eps > 0:  # a bool and a float steer a branch
            h = h + eps
        return jnp.sum(h)

    x = jnp.full((3, 3), 0.5)
    kwargs = dict(training=True, eps=0.25, act="tanh", sizes={"cols": 3})
    got = mpjax.autocast(f)(x, 2, **kwargs)
    assert seen == dict(n=2, **kwargs)
    assert type(seen["n"]) is int and type(seen["training"]) is bool
    assert type(seen["eps"]) is float
    np.testing.assert_allclose(got, f(x, 2, **kwargs), rtol=2e-2)
    # Under jit the same values must be static, as for any jitted function.
    jitted = jax.jit(
        mpjax.autocast(f), static_argnums=1, static_argnames=("training", "eps", "act", "sizes")
    )
    np.testing.assert_allclose(
        jitted(x, 2, training=True, eps=0.25, act="tanh", sizes=_Hashable(cols=3)), got, rtol=1e-6
    )


class _Hashable(dict):
    """A dict usable as a static jit argument."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


HINT = "Pass such flags as Python bools or ints"


@pytest.mark.parametrize("case", ["range(array)", "float(array)", "numpy int scalar"])
def test_array_where_python_needs_a_value_carries_the_hint(case):
    x = jnp.ones(2)
    if case == "range(array)":
        f, args, error = (
            lambda x, n: sum(x for _ in range(n)),
            (x, jnp.array(3)),
            jax.errors.TracerIntegerConversionError,
        )
    elif case == "float(array)":
        f, args, error = (
            lambda x, s: x * float(s),
            (x, jnp.array(2.0)),
            jax.errors.ConcretizationTypeError,
        )
    else:  # NumPy scalars count as arrays (they are traced), as documented
        f, args, error = (
            lambda x, n: sum(x for _ in range(n)),
            (x, np.int64(3)),
            jax.errors.TracerIntegerConversionError,
        )
    with pytest.raises(error) as info:
        mpjax.autocast(f)(*args)
    assert HINT in "".join(getattr(info.value, "__notes__", []))


def test_audit_keeps_python_flags_static_like_autocast():
    def f(x, training):
        return x @ x if training else x

    x = jnp.ones((2, 2))
    mpjax.autocast(f)(x, True)  # fine
    report = mpjax.audit(mpjax.autocast(f), x, True)
    assert report.find("dot_general")


# --------------------------------------------------------------------------
# The optimizer-state helpers.

HELPERS = {
    "get_scale": get_scale,
    "set_scale": lambda s: set_scale(s, 2.0),
    "scaled_value_and_grad": lambda s: scaled_value_and_grad(lambda p: 0.0, s),
    "scaler_stats": scaler_stats,
}


def _nnx_optimizer_without_scaler():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    return nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


WRONG_STATES = {
    # what was passed: (object, the type the message names)
    "the optimizer itself": (grad_scaler(optax.adam(1e-3)), "GradientTransformationExtraArgs"),
    "params": (PARAMS, "dict"),
    "None": (None, "NoneType"),
    "nnx.Optimizer without scaler": (_nnx_optimizer_without_scaler(), "Optimizer"),
}


@pytest.mark.parametrize("helper", list(HELPERS))
@pytest.mark.parametrize("wrong", list(WRONG_STATES))
def test_helpers_on_something_else_name_it_and_the_fix(helper, wrong):
    obj, type_name = WRONG_STATES[wrong]
    with pytest.raises(
        ValueError,
        match=rf"{helper}: no GradScalerState "
        r"found in `opt_state` "
        rf"\(a {type_name}\)\. Build the optimizer with "
        r"mpjax\.grad_scaler\(inner\)",
    ) as info:
        HELPERS[helper](obj)
    assert "Pass the state its init returned." in str(info.value)


@pytest.mark.parametrize("helper", list(HELPERS))
def test_helpers_on_two_scalers_name_both_paths_and_the_fix(helper):
    state = optax.chain(grad_scaler(optax.sgd(0.1)), grad_scaler(optax.sgd(0.1))).init(PARAMS)
    with pytest.raises(
        ValueError,
        match=r"found 2 GradScalerStates in `opt_state` "
        r"\(at \[0\], \[1\]\).*single grad_scaler",
    ):
        HELPERS[helper](state)


@pytest.mark.parametrize("helper", list(HELPERS))
def test_helper_errors_name_the_helper_that_was_called(helper):
    with pytest.raises(ValueError) as info:
        HELPERS[helper](optax.adam(1e-3).init(PARAMS))
    assert str(info.value).startswith(f"{helper}: "), str(info.value)[:40]


def test_update_on_a_state_without_scaler_is_a_clear_error():
    # E.g. an optimizer state restored from a checkpoint written before mpjax.
    tx = grad_scaler(optax.adam(1e-3))
    with pytest.raises((TypeError, ValueError), match="GradScalerState"):
        tx.update(PARAMS, optax.adam(1e-3).init(PARAMS), PARAMS)


# --------------------------------------------------------------------------
# Hyperparameters out of range: the message gives the valid range.

OUT_OF_RANGE = [
    (
        grad_scaler,
        dict(growth_factor=1.0),
        r"grad_scaler: growth_factor must be a finite number > 1, got 1\.0",
    ),
    (
        grad_scaler,
        dict(backoff_factor=1.5),
        r"grad_scaler: backoff_factor must be a number in \(0, 1\), got 1\.5",
    ),
    (
        grad_scaler,
        dict(growth_interval=0),
        r"grad_scaler: growth_interval must be an integer in \[1, 2147483647\], got 0",
    ),
    (
        grad_scaler,
        dict(growth_interval=10.0),
        r"grad_scaler: growth_interval must be an integer >= 1, got 10\.0 \(a float\)",
    ),
    (
        grad_scaler,
        dict(init_scale=-1.0),
        r"grad_scaler: init_scale must be a finite number > 0, got -1\.0",
    ),
    (
        grad_scaler,
        dict(init_scale=1e39),
        r"grad_scaler: init_scale=1e\+39 overflows float32; it must be at most 3\.4",
    ),
    (
        grad_scaler,
        dict(min_scale=1e-40),
        r"grad_scaler: min_scale must be a finite number >= 2\*\*-126 \(a normal float32\)",
    ),
    (
        grad_scaler,
        dict(init_scale=1.0, min_scale=4.0),
        r"init_scale=1\.0 is below min_scale=4\.0; raise init_scale or lower min_scale",
    ),
    (
        grad_scaler,
        dict(accumulation_steps=0),
        r"grad_scaler: accumulation_steps must be an integer in \[1, ",
    ),
    (
        static_scaler,
        dict(scale=0.0),
        r"static_scaler: scale must be a finite float32 number >= 2\*\*-126",
    ),
    (
        static_scaler,
        dict(scale=float("inf")),
        r"static_scaler: scale must be a finite float32 number >= 2\*\*-126",
    ),
    (
        static_scaler,
        dict(scale=1.0, accumulation_steps=-2),
        r"static_scaler: accumulation_steps must be an integer in \[1, ",
    ),
    (
        mpjax.noop_scaler,
        dict(accumulation_steps=2),
        r"noop_scaler\(accumulation_steps=2\): pass accumulation='mean'",
    ),
    (
        grad_scaler,
        dict(check_updates="no"),
        r"grad_scaler: check_updates must be True or False, got 'no'",
    ),
    (
        static_scaler,
        dict(scale=1.0, check_updates=None),
        r"static_scaler: check_updates must be True or False, got None",
    ),
    # A string from a config file is truthy: "false" would switch scaling on.
    (grad_scaler, dict(enabled="false"), r"grad_scaler: enabled must be True or False, got 'f"),
    (grad_scaler, dict(enabled=None), r"grad_scaler: enabled must be True or False, got None"),
    (grad_scaler, dict(enabled=0.0), r"grad_scaler: enabled must be True or False, got 0\.0"),
]


@pytest.mark.parametrize(
    "make, kwargs, message",
    OUT_OF_RANGE,
    ids=[next(iter(k)) + "=" + str(list(k.values())[-1]) for _, k, _ in OUT_OF_RANGE],
)
def test_out_of_range_hyperparameter_gives_the_valid_range(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(optax.sgd(0.1), **kwargs)


def test_settings_given_as_jax_or_numpy_scalars_are_taken_as_numbers():
    as_numbers = grad_scaler(optax.sgd(0.1), init_scale=4.0, growth_factor=3.0, growth_interval=5)
    makers = [(jnp.asarray, jnp.asarray), (np.asarray, np.asarray), (jnp.float32, jnp.int32)]
    for real, integer in makers:
        tx = grad_scaler(
            optax.sgd(0.1),
            init_scale=real(4.0),
            growth_factor=real(3.0),
            growth_interval=integer(5),
            enabled=integer(True).astype(bool),
        )
        chex.assert_trees_all_equal(tx.init(PARAMS), as_numbers.init(PARAMS))
    assert float(get_scale(static_scaler(optax.sgd(0.1), jnp.float32(128.0)).init(PARAMS))) == 128


def test_a_traced_setting_says_settings_are_fixed_when_the_scaler_is_built():
    with pytest.raises(ValueError, match=r"grad_scaler: init_scale must be a concrete number"):
        jax.jit(lambda s: grad_scaler(optax.sgd(0.1), init_scale=s).init(PARAMS))(4.0)
    # inject_hyperparams traces every hyperparameter: the message names its fix.
    tx = optax.inject_hyperparams(
        lambda learning_rate, init_scale: grad_scaler(
            optax.sgd(learning_rate), init_scale=init_scale
        )
    )(learning_rate=0.1, init_scale=1024.0)
    with pytest.raises(ValueError, match=r"static_args=\('init_scale',\)"):
        jax.jit(tx.update)(PARAMS, tx.init(PARAMS), PARAMS)


def test_a_scaler_inside_a_scaler_is_reported_at_its_path():
    state = grad_scaler(grad_scaler(optax.sgd(0.1))).init(PARAMS)
    with pytest.raises(ValueError, match=r"2 GradScalerStates in `opt_state` \(at <root>, \.inner"):
        get_scale(state)
    inner = optax.chain(optax.identity(), grad_scaler(optax.sgd(0.1)))
    state = optax.chain(optax.identity(), grad_scaler(inner)).init(PARAMS)
    with pytest.raises(ValueError, match=r"\(at \[1\], \[1\]\.inner_state\[1\]\)"):
        get_scale(state)


def test_a_checkpoint_restored_without_a_target_says_so():
    from flax import serialization

    tx = grad_scaler(optax.adam(1e-3))
    raw = serialization.msgpack_restore(serialization.to_bytes(tx.init(PARAMS)))
    with pytest.raises(TypeError, match=r"restored without a target structure.*tx\.init\(param"):
        tx.update(PARAMS, raw, PARAMS)
    for helper in (get_scale, scaler_stats, lambda s: scaled_value_and_grad(jnp.sum, s)):
        with pytest.raises(ValueError, match=r"restored without a target structure"):
            helper(raw)


def test_helpers_on_an_nnx_optimizers_states_name_the_fix():
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, grad_scaler(optax.adam(1e-3)), wrt=nnx.Param)
    for state in (nnx.state(optimizer), nnx.split(optimizer)[1]):
        for helper in (get_scale, scaler_stats, lambda s: set_scale(s, 2.0)):
            with pytest.raises(ValueError, match=r"flax\.nnx\.State .*optimizer\.opt_state"):
                helper(state)
    assert float(get_scale(optimizer.opt_state)) == 2.0**16
    # Through nnx.Optimizer's wrappers, a scaler beside a clip in a chain is found out.
    chained = optax.chain(optax.clip(1.0), grad_scaler(optax.adam(1e-3)))
    optimizer = nnx.Optimizer(model, chained, wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"one of 2 transforms of an optax\.chain"):
        scaled_value_and_grad(lambda m: jnp.sum(m.kernel[...]), optimizer.opt_state)


@pytest.mark.parametrize("value", [None, "1024", True, [2.0]])
def test_set_scale_of_something_else_than_a_number_names_new_scale(value):
    state = grad_scaler(optax.sgd(0.1)).init(PARAMS)
    with pytest.raises(TypeError, match=r"set_scale: new_scale must be a number"):
        set_scale(state, value)
    with pytest.raises(ValueError, match=r"new_scale must be a scalar, got shape \(2,\)"):
        set_scale(state, jnp.array([2.0, 4.0]))


def test_autocast_as_a_context_manager_says_it_is_a_function_transform():
    for made in (mpjax.autocast(), mpjax.autocast(dtype=jnp.bfloat16)):
        with pytest.raises(TypeError, match=r"function transform, not a context manager"):
            with made:
                pass


def test_the_decorator_form_called_with_arrays_shows_the_call_with_the_function():
    with pytest.raises(TypeError, match=r"returns a decorator.*autocast\(loss_fn, dtype=\.\.\.\)"):
        mpjax.autocast(dtype=jnp.bfloat16)(PARAMS, jnp.ones(2))
    loss = mpjax.autocast(dtype=jnp.bfloat16)(lambda p: jnp.sum(p["w"]))  # as a decorator
    assert loss(PARAMS).dtype == jnp.float32


def test_messages_name_what_the_user_passed():
    f = lambda x: x
    with pytest.raises(ValueError, match=r"must be jnp.float32 \(the default[^)]*\)\.$") as e:
        mpjax.autocast(f, dtype=jnp.float32, enabled=False, reduce_dtype=jnp.bfloat16)
    assert "jnp.float16" not in str(e.value)  # no autocast dtype the user never gave
    with pytest.raises(ValueError, match=r"dtype='fp16'.*Spell it jnp.float16") as e:
        mpjax.autocast(f, dtype="fp16", enabled=False)
    assert "enabled=False)" not in str(e.value)  # not the fix already taken
    with pytest.raises(TypeError, match=r"'float16' looks like a dtype.*dtype='float16'"):
        mpjax.autocast("float16")
    updates_only = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda g, s, p: g)
    tx = grad_scaler(updates_only)
    for update in [tx.update, jax.jit(tx.update)]:
        with pytest.raises(ValueError, match=r"must return \(updates, new_state\).*a dict"):
            update(PARAMS, tx.init(PARAMS), PARAMS)


def test_rule_for_takes_a_name_or_a_primitive():
    assert mpjax.rule_for(jax.lax.exp_p) is mpjax.rule_for("exp") is mpjax.Rule.FLOAT32
    with pytest.raises(TypeError, match=r"rule_for\(primitive_name\): expected a primitive"):
        mpjax.rule_for(42)


@pytest.mark.parametrize(
    "name, primitive",
    [("matmul", "dot_general"), ("linear", "dot_general"), ("conv2d", "conv_general_dilated"),
     ("sigmoid", "logistic"), ("softmax", "mpjax.audit")],
)  # fmt: skip
def test_rule_for_a_torch_name_points_to_the_jax_primitive(name, primitive):
    with pytest.raises(ValueError, match=rf"rule_for\('{name}'\): .*torch's name.*{primitive}"):
        mpjax.rule_for(name)


@pytest.mark.parametrize("lean", ["False", "True", 1, None])
def test_rule_for_lean_must_be_a_bool(lean):
    # "False" is truthy: read as a flag, it answered the lean rule.
    with pytest.raises(TypeError, match=r"rule_for\(lean=.*\): lean must be a bool"):
        mpjax.rule_for("gather", lean=lean)
    assert mpjax.rule_for("gather", lean=np.True_) is mpjax.rule_for("gather", lean=True)


def test_audit_find_of_a_torch_name_points_to_the_jax_primitive():
    report = mpjax.audit(mpjax.autocast(lambda w, x: x @ w), jnp.ones((4, 2)), jnp.ones((3, 4)))
    assert report.find(jax.lax.dot_general_p) == report.find("dot_general") != []
    assert report.find("exp") == []  # a JAX primitive the program does not run
    with pytest.raises(ValueError, match=r"find\('matmul'\): .*torch's name.*dot_general"):
        report.find("matmul")
    with pytest.raises(TypeError, match=r"AuditReport\.find\(primitive\): expected a primitive"):
        report.find(1)


# torch's CUDA autocast op lists, as its documentation gives them.
_TORCH_LOW = """__matmul__ addbmm addmm addmv addr baddbmm bmm chain_matmul multi_dot conv1d
    conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d GRUCell linear LSTMCell
    matmul mm mv prelu RNNCell""".split()
_TORCH_FLOAT32 = """__pow__ __rdiv__ __rpow__ __rtruediv__ acos asin
    binary_cross_entropy_with_logits cosh cosine_embedding_loss cdist cosine_similarity
    cross_entropy cumprod cumsum dist erfinv exp expm1 group_norm hinge_embedding_loss kl_div
    l1_loss layer_norm log log_softmax log10 log1p log2 margin_ranking_loss mse_loss
    multilabel_margin_loss multi_margin_loss nll_loss norm normalize pdist poisson_nll_loss pow
    prod reciprocal rsqrt sinh smooth_l1_loss soft_margin_loss softmax softmin softplus sum
    renorm tan triplet_margin_loss""".split()
_TORCH_WIDEST = "addcdiv addcmul atan2 bilinear cross dot grid_sample index_put scatter_add tensordot"


@pytest.mark.parametrize("name", _TORCH_LOW + _TORCH_FLOAT32 + _TORCH_WIDEST.split())
def test_rule_for_answers_no_name_on_torchs_lists_with_runs_as_written(name):
    # ORIGINAL for "addmv" or "softplus" would read as "autocast leaves it alone",
    # where it runs a 16-bit product or in float32: a name JAX has no primitive of
    # points to the primitives to look up; one it has (exp, cumsum) is answered.
    try:
        rule = mpjax.rule_for(name)
    except ValueError as e:
        assert f"rule_for({name!r}): {name!r} is torch's name" in str(e)
    else:
        assert rule is not mpjax.Rule.ORIGINAL


def test_a_linen_module_as_the_function_points_to_its_apply():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.BatchNorm(use_running_average=not train)(nn.Dense(3)(x)).sum()

    class Scaled(nn.Module):  # no variables: Flax runs it unbound
        def __call__(self, x):
            return jax.nn.gelu(x @ jnp.eye(4)) * 2.0

    model, x = MLP(), jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(
        TypeError, match=r"autocast\(fun\): got the .*module class MLP.*model\.apply"
    ):
        mpjax.autocast(MLP)
    with pytest.raises(TypeError, match=r"got the unbound Flax Linen module MLP\(\).*model\.apply"):
        mpjax.autocast(model)(x)
    chex.assert_trees_all_close(mpjax.autocast(Scaled())(x), Scaled()(x), rtol=1e-2)
    # Bound with a mutable collection: a call that writes it leaves it holding values
    # of autocast's trace, and is refused; one that writes nothing runs.
    for method in (lambda m: m, lambda m: m.__call__):
        bound = model.bind(variables, mutable=["batch_stats"])
        want = model.apply(variables, x)
        chex.assert_trees_all_close(mpjax.autocast(method(bound))(x), want, rtol=1e-2)
        with pytest.raises(
            TypeError,
            match=r"MLP bound with mutable collections, and the call "
            r"wrote them \(\['batch_stats'\].*model\.apply",
        ):
            mpjax.autocast(method(bound))(x, train=True)
    assert mpjax.autocast(model.bind(variables))(x).dtype == jnp.float32  # read-only: runs
    # the way that works
    chex.assert_trees_all_close(
        mpjax.autocast(model.apply)(variables, x), model.apply(variables, x), atol=1e-2
    )
    # and Flax's own error through it, for a mistake of its own kind (no mutable=)
    import flax.errors

    with pytest.raises(flax.errors.ModifyScopeVariableError, match="batch_stats"):
        mpjax.autocast(model.apply)(variables, x, train=True)


def test_static_scaler_errors_name_static_scaler():
    tx = mpjax.static_scaler(optax.sgd(0.1), 8.0)
    with pytest.raises(ValueError, match=r"^static_scaler init: the parameters at \['w'\]"):
        tx.init({"w": jnp.ones(3, jnp.float16)})
    with pytest.raises(TypeError, match=r"^static_scaler update: `state` must be"):
        tx.update(PARAMS, optax.sgd(0.1).init(PARAMS))


@pytest.mark.parametrize("make", ["grad_scaler", "static_scaler"])
@pytest.mark.parametrize("axis_name", [0, 1, {}, ["data"], ("data", 1), True])
def test_an_axis_name_that_is_no_name_is_refused_at_construction(make, axis_name):
    """An integer would be read by lax.psum as an array axis, a dict or list is no
    name at all: each failed only at the first update, inside lax.psum."""
    args = (8.0,) if make == "static_scaler" else ()
    with pytest.raises(ValueError, match=rf"^{make}: axis_name must be.*axis_name='data'"):
        getattr(mpjax, make)(optax.sgd(0.1), *args, axis_name=axis_name)
    for good in ["data", ("data", "model")]:
        getattr(mpjax, make)(optax.sgd(0.1), *args, axis_name=good)


def test_argnums_takes_numpy_integers_and_names_itself_otherwise():
    state = grad_scaler(optax.sgd(0.1), init_scale=4.0).init(PARAMS)
    loss = lambda x, p: x * sum(jnp.sum(v**2) for v in jax.tree.leaves(p))
    want = jax.value_and_grad(loss, argnums=1)(2.0, PARAMS)
    for argnums in [np.int64(1), (np.int32(1),)]:
        got = scaled_value_and_grad(loss, state, argnums=argnums)(2.0, PARAMS)
        grads = got[1][0] if isinstance(argnums, tuple) else got[1]
        chex.assert_trees_all_close((got[0], grads), want)
    for bad in ["0", 1.0, None]:
        with pytest.raises(TypeError, match=r"argnums=.*must be an integer or a tuple"):
            scaled_value_and_grad(loss, state, argnums=bad)


def test_scaled_value_and_grad_of_value_and_grad_says_to_pass_the_loss():
    state = grad_scaler(optax.sgd(0.1)).init(PARAMS)
    loss = lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p))
    with pytest.raises(ValueError, match=r"looks like jax\.value_and_grad\(f\)\. Pass"):
        mpjax.scaled_value_and_grad(jax.value_and_grad(loss), state)(PARAMS)


@pytest.mark.parametrize(
    "value",
    [0.0, -2.0, float("nan"), 1e39, jnp.float32(jnp.nan), np.float32(-2.0), jnp.array(0.0)],
)
def test_set_scale_out_of_range_gives_the_valid_range(value):
    state = grad_scaler(optax.sgd(0.1)).init(PARAMS)
    with pytest.raises(
        ValueError,
        match=r"set_scale: new_scale=.* must (be a finite|hold finite) float32 "
        r"numbers? >= 2\*\*-126",
    ):
        set_scale(state, value)


# --------------------------------------------------------------------------
# A restored state whose scale is not a float32 scalar.

_TX = grad_scaler(optax.adam(1e-2), init_scale=1024.0, growth_interval=2)


def _loss(params, x):
    return jnp.sum((x @ params["w"] + params["b"]) ** 2)


@jax.jit
def _step(params, state, x):
    _, grads = scaled_value_and_grad(_loss, state)(params, x)
    updates, state = _TX.update(grads, state, params)
    return optax.apply_updates(params, updates), state


X = jnp.array([[1.0, 2.0, -1.0], [0.5, 0.0, 1.0]])

RESTORED_SCALES = {
    "numpy float64": np.float64(1024.0),
    "numpy 0-d float64 array": np.array(1024.0),
    "python float": 1024.0,
    "python int": 1024,
    "numpy int64": np.int64(1024),
    "jax int32": jnp.array(1024, jnp.int32),
    "float16": jnp.array(1024, jnp.float16),
    "bfloat16": jnp.array(1024, jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(RESTORED_SCALES))
def test_restored_scalar_scale_of_another_dtype_is_accepted_and_cast(name):
    state = _TX.init(PARAMS)
    want_params, want_state = _step(PARAMS, state, X)
    params, new_state = _step(PARAMS, state._replace(scale=RESTORED_SCALES[name]), X)
    chex.assert_trees_all_equal(params, want_params)
    chex.assert_trees_all_equal(new_state, want_state)
    chex.assert_trees_all_equal_dtypes(new_state, want_state)
    assert new_state.scale.shape == () and new_state.scale.dtype == jnp.float32


@pytest.mark.parametrize("name", list(RESTORED_SCALES))
def test_helpers_read_a_restored_scale_as_float32(name):
    # get_scale is documented to return "the float32 scalar scale".
    state = _TX.init(PARAMS)._replace(scale=RESTORED_SCALES[name])
    assert float(get_scale(state)) == 1024.0
    assert get_scale(state).dtype == jnp.float32, get_scale(state).dtype
    assert scaler_stats(state)["scale"].dtype == jnp.float32


def test_restored_zero_scale_recovers():
    params, state = _step(PARAMS, _TX.init(PARAMS)._replace(scale=jnp.float32(0.0)), X)
    chex.assert_trees_all_equal(params, PARAMS)  # 0 * inf: skipped, not applied
    assert bool(state.last_step_skipped)
    assert float(state.scale) == 2.0**-14  # the floor
    params, state = _step(params, state, X)
    assert not bool(state.last_step_skipped)
    assert bool(jnp.all(jnp.isfinite(params["w"]))) and not np.array_equal(params["w"], PARAMS["w"])


@pytest.mark.parametrize(
    "scale", [np.array([1024.0], np.float32), jnp.ones((1, 1))], ids=["shape (1,)", "shape (1, 1)"]
)
def test_restored_non_scalar_scale_is_a_clear_error_at_update(scale):
    state = _TX.init(PARAMS)._replace(scale=scale)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    with pytest.raises(ValueError, match=r"scale.*shape \(1,? ?1?\)"):
        _TX.update(grads, state, PARAMS)


@pytest.mark.parametrize(
    "inner, made_by, params",
    [
        (optax.adamw(1e-2), optax.sgd(0.1), PARAMS),  # another optimizer: no moments at all
        (optax.adam(1e-2), optax.sgd(0.1), PARAMS),  # as long a chain: EmptyState has no mu
        (optax.adamw(1e-2), optax.adamw(1e-2), {"w": jnp.zeros((3, 3)), "b": jnp.zeros(2)}),
    ],
    ids=["another optimizer", "another optimizer, as many parts", "other parameters"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_state_made_for_another_optimizer_is_a_clear_error(inner, made_by, params, jit):
    # The restored checkpoint of an earlier run: optax alone says "The number of
    # updates and states has to be the same in chain", "'EmptyState' object has no
    # attribute 'mu'", or a broadcasting error.
    tx = grad_scaler(inner)
    old = grad_scaler(made_by).init(params)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=r"^grad_scaler update: the state is not one .* it "
                       r"holds .* where inner.init\(params\) makes state\.inner_state\[0\]\."
                       r".*tx.init\(params\)"):
        update(jax.tree.map(jnp.ones_like, PARAMS), old, PARAMS)


def test_gradients_shaped_unlike_the_parameters_are_a_clear_error():
    tx = grad_scaler(optax.adamw(1e-2))
    grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(4)}
    with pytest.raises(ValueError, match=r"^grad_scaler update: the gradients are not shaped "
                       r"as the parameters: they hold updates\['b'\] of shape \(4,\) where "
                       r"the parameters hold params\['b'\] of shape \(2,\)"):
        tx.update(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_restored_non_finite_scale_recovers(bad):
    params, state = _step(PARAMS, _TX.init(PARAMS)._replace(scale=jnp.float32(bad)), X)
    chex.assert_trees_all_equal(params, PARAMS)
    assert bool(jnp.isfinite(state.scale)), f"the scale stays {float(state.scale)}"
    params, state = _step(params, state, X)
    assert not bool(state.last_step_skipped)


# --------------------------------------------------------------------------
# Integer and float64 inputs run untouched.


def test_integer_programs_run_untouched():
    def f(a, b, idx):
        return (a @ b) * 3 + jnp.cumsum(idx), jnp.max(a, axis=0), a.astype(jnp.int32) // 2

    a = jnp.arange(-8, 8, dtype=jnp.int8).reshape(4, 4)
    b = jnp.eye(4, dtype=jnp.int8)
    idx = jnp.arange(4, dtype=jnp.int32)
    got, want = mpjax.autocast(f)(a, b, idx), f(a, b, idx)
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_equal_dtypes(got, want)
    report = mpjax.audit(mpjax.autocast(f), a, b, idx)
    assert report.casts_inserted == 0
    assert report.find("dot_general")[0].out_dtypes == ("int8",)


def test_float64_activation_times_float32_weight_runs_in_float64():
    # Plain JAX promotes the product to float64. Rounding the float32 weight (or
    # the result) to 16 bits would lose precision for no gain, or overflow.
    def f(w, k, x):
        conv = jax.lax.conv_general_dilated(x[None, None], k.astype(x.dtype), (1,), "SAME")
        return x @ w, conv

    with jax.enable_x64(True):
        x = jnp.array([1.0 + 2**-30, 1000.0, 1e-3, 1e5], jnp.float64)
        w = jnp.full((4, 2), 1.1, jnp.float32)
        k = jnp.full((1, 1, 3), 1.1, jnp.float32)
        for fun in (f, jax.grad(lambda w, k, x: sum(jnp.sum(o) for o in f(w, k, x)), (0, 1, 2))):
            got = jax.jit(mpjax.autocast(fun))(w, k, x)
            want = jax.jit(fun)(w, k, x)
            chex.assert_trees_all_equal_dtypes(got, want)
            chex.assert_trees_all_close(got, want, rtol=1e-15)


def test_float64_programs_run_untouched_values_and_gradients():
    def f(w, x):
        return jnp.sum(jnp.exp(jnp.tanh(x @ w)) ** 2)

    with jax.enable_x64(True):
        w = jnp.linspace(-1.0, 1.0, 9, dtype=jnp.float64).reshape(3, 3)
        x = jnp.linspace(0.0, 2.0, 6, dtype=jnp.float64).reshape(2, 3)
        got = jax.jit(jax.value_and_grad(mpjax.autocast(f)))(w, x)
        want = jax.jit(jax.value_and_grad(f))(w, x)
        chex.assert_trees_all_equal(got, want)
        chex.assert_trees_all_equal_dtypes(got, want)
        assert got[1].dtype == jnp.float64
        assert mpjax.audit(mpjax.autocast(f), w, x).casts_inserted == 0


def test_a_differentiated_argument_holding_a_function_is_named_with_the_filtering_fix():
    # An Equinox model holds its activation functions among its arrays.
    state = mpjax.grad_scaler(optax.sgd(0.1)).init({"w": jnp.ones(3)})
    model = {"w": jnp.ones(3), "act": jnp.tanh}

    def loss(model, x):
        return jnp.sum(model["act"](model["w"] * x))

    with pytest.raises(TypeError, match=r"args\[0\]\['act'\] is a .*eqx.filter_value_and_grad"):
        mpjax.scaled_value_and_grad(loss, state)(model, jnp.ones(3))
