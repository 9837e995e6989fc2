"""Everything mpjax needs from JAX internals, in one place (jax 0.10 to 0.12).

The interpreter reads jaxprs and re-binds primitives. The public ways to do that
move between JAX releases; each difference is absorbed here, nowhere else. The one
private optax name mpjax recognises (`is_optax_placeholder`) is here too."""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import weakref

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util

Literal = jex_core.Literal

# Tracebacks and source locations skip mpjax's own frames and name the user's line.
source_info_util.register_exclusion(os.path.dirname(__file__))


def jaxpr_and_consts(jaxpr):
    """(open jaxpr, consts) of a closed or open jaxpr (read from attributes: in jax
    0.12 `ClosedJaxpr` is an alias of `Jaxpr`, whose `.jaxpr` is itself)."""
    return getattr(jaxpr, "jaxpr", jaxpr), tuple(getattr(jaxpr, "consts", ()))


def bind(eqn, *args, **param_updates):
    """Re-binds `eqn`'s primitive on new arguments; always returns a list."""
    params = {**eqn.params, **param_updates}
    if any(_transformed(x) for x in args):
        out = bound(eqn, params)(*args)
    else:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]


def staging_trace(under_others: bool = False):
    """The current trace if jit's or make_jaxpr's (not vmap's, grad's), else None; with
    `under_others`, the one vmap's or grad's current trace runs on (a jit's, a scan's)."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe

    trace = core.trace_ctx.trace
    while under_others and trace is not None and type(trace) is not pe.DynamicJaxprTrace:
        trace = getattr(trace, "parent_trace", None)  # None past the eager one
    return trace if type(trace) is pe.DynamicJaxprTrace else None


def emit(trace, eqn, args):
    """`bind` of `eqn` on `args`, which may hold `Literal`s. With the `trace` of
    `staging_trace` and arguments of the types `eqn` was traced with, the
    equation is added to the trace as it is, as ``jit`` inlines a jaxpr: no type
    inference per equation, which is most of a bind's cost."""
    tracers = None if trace is None or eqn.effects else _staged(trace, eqn, args)
    if tracers is None:
        return bind(eqn, *[a.val if isinstance(a, Literal) else a for a in args])
    out_avals = [v.aval for v in eqn.outvars]
    # Under the caller's scopes (an autocast region is one), as jit's inlining puts it.
    stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    src = eqn.source_info.replace(name_stack=stack)
    return trace.emit_eqn(tracers, out_avals, eqn.primitive, eqn.params, eqn.effects, src, eqn.ctx)


def _staged(trace, eqn, args):
    """`args` as values of `trace`, each of its variable's type in `eqn`, or None."""
    from jax._src.interpreters import partial_eval as pe

    tracers = []
    for x, var in zip(args, eqn.invars):
        if isinstance(x, Literal):
            x = pe.DynamicJaxprTracer(trace, x.aval, x, eqn.source_info)
        elif isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if jax.typeof(x) != var.aval:
                return None
            x = trace.new_const(x, source_info=eqn.source_info)  # a constant, as jit's
        elif not (isinstance(x, jax.core.Tracer) and x._trace is trace and x.aval == var.aval):
            return None
        tracers.append(x)
    return tracers


def without_dead_code(jaxpr):
    """`jaxpr` without the equations no output needs, inside loops too, as jit drops them."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def _transformed(x) -> bool:
    """Whether a transformation (grad, jvp, vmap) sees `x`, not only jit's staging."""
    return isinstance(x, jax.core.Tracer) and type(x).__name__ != "DynamicJaxprTracer"


def bound(eqn, params, jit=None):
    """``primitive.bind(*args, **params)`` as a function of `args`: a jit of it (`jit`,
    default `inline_jit`) cached where the params can be a key (`_plain`). `grad`
    linearizes a bare bind at every equation, a jit's once per input types."""
    primitive = eqn.primitive
    key = tuple(sorted(params.items())) if all(map(_plain, params.values())) else None
    if key is None or eqn.effects or sub_jaxprs(params):
        bind_params = primitive.get_bind_params(params)
        return lambda *args: primitive.bind(*args, **bind_params)
    return _jit_of_bind(primitive, key, jit or inline_jit)


def _plain(value) -> bool:
    """A param `bound` keys its cache on, or a tuple of them (dimension numbers); not
    jax 0.12's objects (``call_hi_primitive``'s ``SearchSorted[...]``: equal at any shape)."""
    return all(map(_plain, value)) if isinstance(value, tuple) else isinstance(value, _PLAIN)


_PLAIN = (type(None), bool, int, float, complex, str, np.dtype, np.generic, enum.Enum)
_PLAIN += (jax.sharding.Sharding,)


@functools.lru_cache(maxsize=4096)
def _jit_of_bind(primitive, params_key, jit):
    bind_params = primitive.get_bind_params(dict(params_key))
    return jit(lambda *args: primitive.bind(*args, **bind_params))


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


def with_weak_type(x, weak: bool):
    """`x`, weakly typed (as ``s * 2`` of a weak `s`) or not: jax.lax has no public way."""
    return jax.lax.convert_element_type_p.bind(x, new_dtype=x.dtype, weak_type=weak, sharding=None)


def fast_compile_options() -> dict:
    """XLA options that compile a small CPU program run once 2-3x faster: LLVM's cheapest
    code generation (values may differ by a few ulps); jaxlib 0.10's older emitters."""
    if jax.default_backend() != "cpu":
        return {}
    old = {"xla_cpu_use_fusion_emitters": False} if jax.lib.__version__[:5] == "0.10." else {}
    return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True, **old}


@contextlib.contextmanager
def equation_context(eqn):
    """Binds under `eqn`'s user traceback, name scope and context (an `auto_axes`
    region's mesh), as `jax.core.eval_jaxpr` does: errors point at the user's line,
    for an equation of a library's jit (`jnp.linalg.cholesky`'s) its caller's."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    own = source_info_util.summarize(eqn.source_info)  # "" where no frame is the user's
    traceback = eqn.source_info.traceback if own else source_info_util.current().traceback
    with source_info_util.user_context(traceback, name_stack=name_stack), eqn.ctx.manager:
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
    manual = params.get("newly_manual_axes", params.get("manual_axes", ()))
    check_vma = params.get("check_vma", params.get("check_rep", True))
    specs = dict(in_specs=tuple(params["in_specs"]), out_specs=tuple(params["out_specs"]))
    return dict(mesh=params["mesh"], **specs, axis_names=frozenset(manual), check_vma=check_vma)


def retype_scalar_jaxpr(params, dtype):
    """A scatter's scalar combiner (`update_jaxpr`) re-traced at `dtype` (XLA checks it)."""
    update_jaxpr = params.get("update_jaxpr")
    if update_jaxpr is None:
        return {}
    consts, scalar = params.get("update_consts", ()), jax.ShapeDtypeStruct((), dtype)
    run = lambda a, b: jax.core.eval_jaxpr(update_jaxpr, consts, a, b)  # noqa: E731
    new_jaxpr, new_consts = jaxpr_and_consts(jax.make_jaxpr(run)(scalar, scalar))
    return dict(update_jaxpr=new_jaxpr, update_consts=new_consts)


def custom_jvp_rule(params, zeros):
    """A custom_jvp equation's jvp rule at the original dtypes (`zeros`: flags of zero tangents).

    Returns ``(jaxpr, consts, leading, out_zeros)``: the jaxpr maps ``(*leading,
    *primals, *nonzero_tangents)`` (jax 0.12's detached consts lead) to
    ``(*primal_outs, *nonzero_tangent_outs)``; ``out_zeros[i]``: the i-th is zero."""
    jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*zeros)
    if len(jaxpr.constvars) < len(consts):
        return jaxpr, [], list(consts), list(out_zeros)
    return jaxpr, consts, [], list(out_zeros)


def sub_jaxprs(params):
    """The jaxprs held in an equation's params (bodies, branches, callees)."""
    return list(jex_core.jaxprs_in_params(params))


def is_optax_placeholder(params) -> bool:
    """Whether `params` is the stand-in `optax.tree_map_params` inits optimizers on:
    a private optax class (``optax.tree_utils._state_utils._ParamsPlaceholder``),
    recognised by name so that a move between optax releases cannot break imports."""
    cls = type(params)
    return cls.__name__ == "_ParamsPlaceholder" and cls.__module__.startswith("optax")


def is_tracer(x) -> bool:
    """Whether `x` is a value of a trace in progress (jit, grad, vmap, ...)."""
    return isinstance(x, jax.core.Tracer)


def trace_context():
    """What changes what tracing gives (x64, matmul precision, axes), as jit's cache key."""
    from jax._src import config

    return config.trace_context()


def is_stale_tracer(x) -> bool:
    """Whether `x` is a value of a jaxpr trace that has ended (``jax.make_jaxpr``'s,
    whose end clears its frame's constant table to a dict from a WeakValueDictionary)."""
    frame = getattr(getattr(x, "_trace", None), "frame", None)
    table = getattr(frame, "constid_to_tracer", None)
    return table is not None and not isinstance(table, weakref.WeakValueDictionary)


def wrapped_like(fun, like):
    """`fun` as a `WrappedFun` (a custom_vjp's bwd parameter), with `like`'s debug info."""
    from jax._src import linear_util as lu

    return lu.wrap_init(fun, debug_info=like.debug_info)


def varying_axes(aval) -> tuple:
    """The manual mesh axes (inside `shard_map`) that values of `aval` vary over."""
    return tuple(getattr(getattr(aval, "manual_axis_type", None), "varying", ()))


def zeros(aval, dtype):
    """Zeros of `aval`'s shape at `dtype`, varying as `aval` does (`varying_axes`)."""
    out, varying = jax.numpy.zeros(aval.shape, dtype), varying_axes(aval)
    return jax.lax.pcast(out, varying, to="varying") if varying else out


def abstract(x, dtype, slice_leading: bool = False):
    """The type of `x` (of one slice along its first axis) at `dtype`, with its
    sharding and the manual mesh axes it varies over: what a loop body is probed
    at. Inside `shard_map`, a bare shape and dtype would be a replicated value."""
    aval = jax.typeof(x)
    if slice_leading:
        aval = jax.eval_shape(lambda v: jax.lax.index_in_dim(_nonempty(v), 0, keepdims=False), x)
    return aval.update(dtype=dtype, weak_type=False)


def _nonempty(v):
    """`v`, padded to one element along an empty first axis (a scan of zero steps)."""
    config = [(0, 1, 0)] + [(0, 0, 0)] * (v.ndim - 1)
    return v if v.shape[0] else jax.lax.pad(v, jax.numpy.zeros((), v.dtype), config)


def custom_vmap_parts(params):
    """The function and the vmap rule of a `custom_vmap_call` equation.

    Returns ``(call, rule)``: `call`, the closed jaxpr of the function over the flat
    inputs; ``rule(axis_size, in_batched, args)`` runs the user's rule on flat inputs
    (batch axis first) to ``(flat_outs, flat_out_batched)``, as JAX's batching does."""
    in_tree, rule = params["in_tree"], params["rule"]

    def flat_rule(axis_size, in_batched, args):
        batched = jax.tree.unflatten(in_tree, list(in_batched))
        out, out_batched = rule(axis_size, list(batched), *jax.tree.unflatten(in_tree, list(args)))
        return jax.tree.leaves(out), jax.tree.leaves(out_batched)

    return params["call"], flat_rule


# -- a linear function with a custom transpose (`mpjax._products`) ------------
# `jax.custom_derivatives.linear_call` lets a JVP rule say how its tangent
# transposes; JAX has no batching rule for it, so vmap of a gradient would fail.
# The rule below is registered only where JAX has none: it rebuilds the call
# with the callee and its transpose vmapped, a cotangent of an unbatched linear
# input summed over the batch (in float32 for 16-bit values).
from jax.custom_derivatives import SymbolicZero  # noqa: E402, F401
from jax.custom_derivatives import linear_call as _linear_call  # noqa: E402
from jax._src.custom_derivatives import linear_call_p as _linear_call_p  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402


def linear_call(fun, fun_transpose, residual_args, linear_args):
    """`jax.custom_derivatives.linear_call`, given its arguments as lists (to which
    `fun_transpose` answers with a list), which hold no tracer once the call is made:
    jax 0.12's transpose, kept in the program, keeps them to name them in errors."""
    args = [list(residual_args), list(linear_args)]
    try:
        return _linear_call(fun, fun_transpose, *args)
    finally:
        for a in args:
            a.clear()


def _unmapped(d) -> bool:
    return d is None or d is getattr(_batching, "not_mapped", None)


def _batch_linear_call(args, dims, *, callee, transpose_thunk, num_callee_consts, num_res):
    size = next(a.shape[d] for a, d in zip(args, dims) if not _unmapped(d))
    axes = [None if _unmapped(d) else d for d in dims]
    n = num_callee_consts + num_res
    fixed, lin, fixed_axes, lin_axes = list(args[:n]), list(args[n:]), axes[:n], axes[n:]
    f_jaxpr, f_consts = jaxpr_and_consts(callee)

    def fun(fixed, lin):
        run = lambda fx, ln: jax.core.eval_jaxpr(f_jaxpr, f_consts, *fx, *ln)  # noqa: E731
        return jax.vmap(run, in_axes=(fixed_axes, lin_axes), axis_size=size)(fixed, lin)

    def fun_transpose(fixed, cts):
        transpose, t_consts = transpose_thunk()
        t_jaxpr, t_jaxpr_consts = jaxpr_and_consts(transpose)
        res, res_axes = fixed[num_callee_consts:], fixed_axes[num_callee_consts:]
        run = lambda r, c: jax.core.eval_jaxpr(t_jaxpr, t_jaxpr_consts, *t_consts, *r, *c)  # noqa: E731
        axes_out = [0 if ax is None else ax for ax in lin_axes]  # each on its input's axis
        outs = jax.vmap(run, (res_axes, 0), axes_out, axis_size=size)(res, cts)
        return [o if ax is not None else _batch_sum(o) for o, ax in zip(outs, lin_axes)]

    outs = linear_call(fun, fun_transpose, fixed, lin)
    return outs, [0] * len(outs)


def _batch_sum(x):  # in float32 for 16-bit values
    return x.sum(0, dtype=jax.numpy.promote_types(x.dtype, jax.numpy.float32)).astype(x.dtype)


# JAX's JVP rule for it asserts that the residuals have no tangents, which
# forward-over-reverse differentiation (a Hessian-vector product) gives them.
# Where they have, the callee is differentiated as the function it is.
from jax._src.interpreters import ad as _ad  # noqa: E402

_jax_linear_call_jvp = _ad.primitive_jvps[_linear_call_p]


def _linear_call_jvp(primals, tangents, **params):
    fixed = params["num_callee_consts"] + params["num_res"]
    if all(type(t) is _ad.Zero for t in tangents[:fixed]):
        return _jax_linear_call_jvp(primals, tangents, **params)
    jaxpr, consts = jaxpr_and_consts(params["callee"])
    tangents = [_ad.instantiate_zeros(t) for t in tangents]
    run = lambda *args: jax.core.eval_jaxpr(jaxpr, consts, *args)  # noqa: E731
    _, tangents_out = jax.jvp(run, tuple(primals), tuple(tangents))
    return _linear_call_p.bind(*primals, **params), list(tangents_out)


if getattr(_jax_linear_call_jvp, "__name__", "") == "_linear_call_jvp_rule":
    _ad.primitive_jvps[_linear_call_p] = _linear_call_jvp

if _linear_call_p not in getattr(_batching, "fancy_primitive_batchers", {}) and (
    _linear_call_p not in getattr(_batching.primitive_batchers, "keys", lambda: ())()
):
    _batching.primitive_batchers[_linear_call_p] = _batch_linear_call


def called_name(eqn) -> str:
    """The name of the function a call-like equation calls (its `name` param, or
    the name its jaxpr's debug info records for a custom_jvp_call)."""
    return str(eqn.params["name"]) if "name" in eqn.params else called_source(eqn).split(" ")[0]


def called_source(eqn) -> str:
    """``"name at file:line"`` of a custom_jvp_call's function, from its jaxpr's debug info."""
    for sub in sub_jaxprs(eqn.params):
        info = getattr(getattr(sub, "jaxpr", sub), "debug_info", None)
        return getattr(info, "func_src_info", None) or ""
    return ""
