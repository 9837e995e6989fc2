"""Everything mpjax needs from JAX internals, in one place (jax 0.10 to 0.12).

The interpreter reads jaxprs and re-binds primitives. The public ways to do that
move between JAX releases; each difference is absorbed here, nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
from jax.extend import core as jex_core
from jax.extend import source_info_util

Literal = jex_core.Literal

# Tracebacks and source locations skip mpjax's own frames and name the user's line.
source_info_util.register_exclusion(os.path.dirname(__file__))


def jaxpr_and_consts(jaxpr):
    """(open jaxpr, consts) of a closed or open jaxpr.

    In jax 0.12 `ClosedJaxpr` is an alias of `Jaxpr` and `.jaxpr` is the object
    itself, so closedness is read from attributes, never from `isinstance`.
    """
    return getattr(jaxpr, "jaxpr", jaxpr), tuple(getattr(jaxpr, "consts", ()))


def bind(eqn, *args, **param_updates):
    """Re-binds `eqn`'s primitive on new arguments; always returns a list."""
    params = {**eqn.params, **param_updates}
    if any(_transformed(x) for x in args):
        out = _bound(eqn, params)(*args)
    else:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _transformed(x) -> bool:
    """Whether `x` is seen by a transformation (grad, jvp, vmap), not only staged
    out by jit or make_jaxpr."""
    return isinstance(x, jax.core.Tracer) and type(x).__name__ != "DynamicJaxprTracer"


def _bound(eqn, params):
    """``primitive.bind(*args, **params)`` as a function of `args`, for a bind
    that a transformation sees.

    A jit of the bind, inlined where it is traced, for a primitive whose params
    can be a cache key. Under `grad`, JAX linearizes a bare bind anew at every
    equation; a jit's linearization it caches per input types, so the repeated
    layers of a model are linearized once, as JAX's own `jnp` functions are.
    Where only jit traces the bind, a bare bind is cheaper.
    """
    primitive = eqn.primitive
    try:
        key = tuple(sorted(params.items()))
        hash(key)
    except TypeError:  # an unhashable param (a numpy array): bind it as it is
        key = None
    if key is None or eqn.effects or sub_jaxprs(params):
        bind_params = primitive.get_bind_params(params)
        return lambda *args: primitive.bind(*args, **bind_params)
    return _inline_jit_of_bind(primitive, key)


@functools.lru_cache(maxsize=4096)
def _inline_jit_of_bind(primitive, params_key):
    bind_params = primitive.get_bind_params(dict(params_key))
    return inline_jit(lambda *args: primitive.bind(*args, **bind_params))


def inline_jit(fun):
    """`jax.jit(fun)` inlined into the program that calls it: no `jit` equation
    is left, but JAX caches its trace and its derivatives."""
    inline = getattr(jax, "Inline", None)  # jax 0.12: jit(inline=True) keeps the call
    return jax.jit(fun, inline=True if inline is None else inline.JAX_EARLY)


@functools.cache
def _converter(dtype):
    return inline_jit(lambda x: jax.lax.convert_element_type(x, dtype))


def convert_element_type(x, dtype):
    """``lax.convert_element_type(x, dtype)``, cached under `grad` as `bind` is."""
    if _transformed(x):
        return _converter(dtype)(x)
    return jax.lax.convert_element_type(x, dtype)


@contextlib.contextmanager
def equation_context(eqn):
    """Binds under `eqn`'s user traceback and name scope.

    New equations then point at the user's source line, and errors raised by a
    bind are reported against it, as `jax.core.eval_jaxpr` does.
    """
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        yield


def name_stack(eqn) -> str:
    """The equation's scope path, e.g. ``"block/mpjax_autocast_off/attn"``."""
    return str(eqn.source_info.name_stack)


def user_frame(eqn) -> str:
    """``file:line (function)`` of the user code that produced `eqn`."""
    return source_info_util.summarize(eqn.source_info)


def scan_counts(params) -> tuple[int, int]:
    """(number of consts, number of carries) of a scan equation."""
    if "num_consts" in params:  # jax <= 0.11
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax 0.12
    return len(consts), len(carry)


def shard_map_kwargs(params) -> dict:
    """Keyword arguments that rebuild a shard_map equation with `jax.shard_map`."""
    return dict(
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=frozenset(params.get("newly_manual_axes", params.get("manual_axes", ()))),
        check_vma=params.get("check_vma", params.get("check_rep", True)),
    )


def retype_scalar_jaxpr(params, dtype):
    """Re-traces a scatter's scalar combiner (`update_jaxpr`) at `dtype`.

    XLA checks the combiner's types against the operands', so a scatter whose
    operands change precision needs its combiner re-traced.
    """
    update_jaxpr = params.get("update_jaxpr")
    if update_jaxpr is None:
        return {}
    consts = params.get("update_consts", ())
    scalar = jax.ShapeDtypeStruct((), dtype)
    closed = jax.make_jaxpr(lambda a, b: jax.core.eval_jaxpr(update_jaxpr, consts, a, b))(
        scalar, scalar
    )
    new_jaxpr, new_consts = jaxpr_and_consts(closed)
    return dict(update_jaxpr=new_jaxpr, update_consts=new_consts)


def custom_jvp_rule(params, num_args: int):
    """The jvp rule of a custom_jvp equation, traced at the original dtypes.

    Returns ``(jaxpr, consts, out_zeros)``: the jaxpr maps ``(*primals,
    *tangents)`` to ``(*primal_outs, *nonzero_tangent_outs)``; ``out_zeros[i]``
    says the i-th output tangent is a symbolic zero left out of the jaxpr.
    """
    jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*[False] * num_args)
    return jaxpr, consts, list(out_zeros)


def sub_jaxprs(params):
    """The jaxprs held in an equation's params (bodies, branches, callees)."""
    return list(jex_core.jaxprs_in_params(params))


def low_precision_dot_algorithm(low):
    """The dot algorithm that multiplies `low` operands into a float32 result.

    Products given a float32 result type also transpose to products with a
    float32 cotangent (exactly representable in `low`); this algorithm makes the
    backend round it back to `low` and use its 16-bit units. Only on GPUs of
    compute capability 8.0 or above: the CPU backend rejects ``F16_F16_F32``, and
    older GPUs lack the bfloat16 one. Elsewhere None: the backend's default.
    """
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    if device.platform != "gpu":
        return None
    major = str(getattr(device, "compute_capability", "0")).split(".")[0]
    if not major.isdigit() or int(major) < 8:
        return None
    presets = jax.lax.DotAlgorithmPreset
    return presets.BF16_BF16_F32 if low == jax.numpy.bfloat16 else presets.F16_F16_F32


def is_default_precision(precision) -> bool:
    """Whether a dot's `precision` param leaves the choice to the backend."""
    if precision is None:
        return True
    if isinstance(precision, tuple):
        return all(p in (None, jax.lax.Precision.DEFAULT) for p in precision)
    return precision == jax.lax.Precision.DEFAULT


def is_tracer(x) -> bool:
    """Whether `x` is a value of a trace in progress (jit, grad, vmap, ...)."""
    return isinstance(x, jax.core.Tracer)


def trace_context():
    """The configuration that changes what tracing a function gives, as `jax.jit`
    keys its cache on it (x64, default matmul precision, the axis environment)."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - a JAX without it: the public x64 flag
        return (jax.config.jax_enable_x64,)
    return config.trace_context()


def zeros(aval, dtype):
    """Zeros of `aval`'s shape at `dtype`, varying over the same manual mesh axes
    (inside `shard_map`), so that they combine with the values `aval` stood for."""
    out = jax.numpy.zeros(aval.shape, dtype)
    varying = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return jax.lax.pcast(out, tuple(varying), to="varying") if varying else out


def abstract(x, dtype, slice_leading: bool = False):
    """The type of `x` (of one slice along its first axis) at `dtype`, with its
    sharding and the manual mesh axes it varies over: what a loop body is probed
    at. Inside `shard_map`, a bare shape and dtype would be a replicated value."""
    aval = jax.typeof(x)
    if slice_leading:
        aval = jax.eval_shape(lambda v: jax.lax.index_in_dim(v, 0, keepdims=False), x)
    return aval.update(dtype=dtype, weak_type=False)


def custom_vmap_parts(params):
    """The function and the vmap rule of a `custom_vmap_call` equation.

    Returns ``(call, rule)``: `call` is the closed jaxpr of the function over the
    equation's flat inputs; ``rule(axis_size, in_batched, args)`` runs the user's
    rule on flat inputs (batched ones with the batch axis first) and returns
    ``(flat_outs, flat_out_batched)``, as JAX's own batching of the primitive does.
    """
    in_tree, rule = params["in_tree"], params["rule"]

    def flat_rule(axis_size, in_batched, args):
        batched = jax.tree.unflatten(in_tree, list(in_batched))
        out, out_batched = rule(axis_size, list(batched), *jax.tree.unflatten(in_tree, list(args)))
        return jax.tree.leaves(out), jax.tree.leaves(out_batched)

    return params["call"], flat_rule
