"""`autocast`: re-evaluates a traced program under the precision policy.

The wrapped function is traced to a jaxpr (`trace_arrays`), and the jaxpr is
evaluated by `mpjax.interpreter`, equation by equation, binding each primitive
again on inputs cast as `mpjax.policy` says. This module holds the public
transform: its argument checks, how it nests (a named scope per call, which the
interpreter reads back as the equations' region), and Flax NNX state.

(A module named `autocast` would shadow the function `mpjax.autocast` for the API
reference's tools, which then show the module: hence the underscore.)
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat, _constants, _leaves, _linen, _marks, _nnx, _pytree_fun, _trace_cache
from mpjax import control_flow  # noqa: F401  (registers the higher-order rules)
from mpjax import custom_rules  # noqa: F401  (registers the custom-derivative rules)
from mpjax import policy
from mpjax import policy as policy_module  # `policy` is also autocast's argument
from mpjax._casting import F32, dtype_named
from mpjax._regions import Region
from mpjax.interpreter import Context, Scope, eval_jaxpr

POLICIES = ("torch", "lean")


def _check_dtype(dtype, enabled=True) -> np.dtype:
    resolved = dtype_named(dtype, "autocast(dtype")
    if resolved not in policy.LOW_DTYPES:
        wide = enabled and resolved is not None and jnp.issubdtype(resolved, jnp.floating)
        spell = "Spell it jnp.float16, jnp.bfloat16, 'float16' or 'bfloat16'"  # 'bf16', int8
        fix = "To run a region in float32, use autocast(fun, enabled=False)" if wide else spell
        raise ValueError(
            f"autocast(dtype={dtype!r}): dtype must be jnp.float16 or jnp.bfloat16, the "
            f"precision that matrix products run in. {fix}{' (or jnp.float32)' * (not enabled)}."
        )
    return resolved


def _check_reduce_dtype(reduce_dtype, low: np.dtype | None) -> bool:
    """Validates `reduce_dtype`; returns whether gradients are summed in `low` (None: a
    region disabled with dtype=jnp.float32, which has no 16-bit dtype)."""
    resolved = None if reduce_dtype is None else dtype_named(reduce_dtype, "autocast(reduce_dtype")
    if resolved not in (F32, low):
        low_too = "" if low is None else f" or jnp.{low.name}, the autocast dtype (16-bit sums)"
        raise ValueError(
            f"autocast(reduce_dtype={reduce_dtype!r}): reduce_dtype must be jnp.float32 "
            f"(the default: weight gradients summed and all-reduced in float32){low_too}."
        )
    return resolved == low


def autocast(
    fun: Callable | None = None,
    *,
    dtype=jnp.float16,
    enabled: bool = True,
    policy: str = "torch",
    reduce_dtype=jnp.float32,
):
    """Runs `fun` in mixed precision, like ``torch.autocast``.

    Matrix products and convolutions run in `dtype`; transcendental functions and
    reductions run in float32; operations with several floating inputs run in the
    widest of them; everything else runs in the dtype it receives. The tables are
    in `mpjax.policy`. Results keep the dtypes `fun` returns without autocast, so
    ``autocast(fun)`` is a drop-in replacement for `fun`.

    Array arguments are traced; every other leaf of the arguments (Python bools,
    ints, floats, strings) is passed to `fun` as it is, so it may steer Python
    control flow. Flax NNX modules may be passed too: what `fun` does to them is
    kept, as under ``nnx.jit`` (BatchNorm statistics and RNG counters at the
    variables' own dtypes, Python attributes, ``model.eval()``, new submodules).

    As with ``jax.jit``, `fun` is traced once per new argument signature (the
    arrays' shapes and dtypes, the pytree structure, the static values), and
    eager calls with that signature reuse the trace: Python side effects in
    `fun` (a print, a counter) run once per new signature, not at every call.

    Calls nest: inside an autocast function, ``autocast(g, enabled=False)`` runs
    `g` as written and ``autocast(g, dtype=jnp.bfloat16)`` runs it in bfloat16.

    Args:
      fun: the function, an NNX module (what it writes is kept), or an Equinox one
        (a pytree, so is its autocast: a model holding ``autocast(mlp)`` trains
        ``mlp``). Omit it to use ``autocast(dtype=...)`` as a decorator.
      dtype: ``jnp.float16`` (default) or ``jnp.bfloat16``; ``jnp.float32`` if not `enabled`.
      enabled: if False, `fun` runs as written (and so does any region nested in
        it that does not enable autocast again).
      policy: ``"torch"`` (default) hands on the dtype each operation computes in,
        as ``torch.autocast`` does: a float32-list operation returns float32; a
        product plus its bias, and an activation function between two products,
        each run as torch's single operation would and return `dtype` (see
        `mpjax.fusions`). ``"lean"`` keeps activations in `dtype` between
        operations, as a model written with Flax's ``dtype=`` does: float32-list
        operations compute in float32 and return
        `dtype` (rematerialized, so no float32 copy is kept for the backward
        pass); reductions stay float32; the largest operand of a multi-input
        operation sets its precision; embedding lookups gather from a
        low-precision table. It keeps fewer and smaller activations, at the cost
        of rounding more intermediate results to 16 bits.
      reduce_dtype: the dtype gradients of float32 values (the weights) are summed
        in, as torch FSDP's ``reduce_dtype``. ``jnp.float32`` (default): the
        weight gradient of a matrix product with a float32 input (under
        ``jax.grad(autocast(f))``) multiplies 16-bit operands into a float32
        sum over the batch, never rounded to `dtype`, so data-parallel ``jit`` all-reduces
        it in float32 (a convolution returns `dtype`). Pass `dtype` itself to all-reduce
        in 16 bits, for half the bandwidth (a residual sum then adds such a product rounded).

    Returns:
      A function with the signature of `fun`.

    Examples:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> grads = jax.grad(mpjax.autocast(loss))(w, x)
      >>> grads.dtype  # gradients of float32 parameters stay float32
      dtype('float32')
    """
    low, reduce_low = _check_options(dtype, enabled, policy, reduce_dtype)
    enabled = bool(enabled)  # a NumPy bool too
    if fun is None:
        return _Decorator(
            functools.partial(
                autocast, dtype=low, enabled=enabled, policy=policy, reduce_dtype=reduce_dtype
            )
        )
    _check_fun(fun)
    region = Region(low if enabled else None, enabled and policy == "lean", reduce_low)
    return _wrap(fun, region, enabled)


class _Decorator:
    """``autocast(dtype=...)`` without a function: a decorator, and a clear error
    for ``with autocast(...):``, torch's spelling."""

    def __init__(self, apply):
        self._apply = apply

    def __call__(self, fun, *args, **kwargs):
        if args or kwargs:  # autocast(dtype=...)(params, x): the function forgotten
            raise TypeError(
                "autocast(dtype=...) without a function returns a decorator, which takes the "
                "function alone. Pass the function first: autocast(loss_fn, dtype=...)(params, x)."
            )
        return self._apply(fun)

    def __enter__(self):
        raise TypeError(
            "mpjax.autocast is a function transform, not a context manager: wrap the "
            "function that computes the loss, autocast(loss_fn)(params, batch), or "
            "decorate it with @autocast or @autocast(dtype=jnp.bfloat16)."
        )

    def __exit__(self, *exc):  # pragma: no cover - __enter__ always raises
        return False


def _check_options(dtype, enabled, policy, reduce_dtype) -> tuple[np.dtype, bool]:
    """Validates autocast's keyword arguments; returns the low dtype and `reduce_low`."""
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"autocast(enabled={enabled!r}): enabled must be a Python bool.")
    # torch's autocast(dtype=float32, enabled=False): a disabled region runs as
    # written, which is what float32 says too.
    float32_off = not enabled and dtype_named(dtype) == F32
    low = np.dtype(jnp.float16) if float32_off else _check_dtype(dtype, enabled)
    if policy not in POLICIES:
        raise ValueError(f"autocast(policy={policy!r}): policy must be one of {POLICIES}.")
    return low, _check_reduce_dtype(reduce_dtype, None if float32_off else low)


def _check_fun(fun) -> None:
    if isinstance(fun, type) and policy_module.is_castable(fun):
        name = np.dtype(fun).name
        fix = (
            f"pass the dtype by keyword: autocast(dtype=jnp.{name}) or "
            f"autocast(fun, dtype=jnp.{name})"
            if np.dtype(fun) in policy_module.LOW_DTYPES
            else "autocast runs products in jnp.float16 or jnp.bfloat16 (by keyword: "
            "autocast(fun, dtype=jnp.bfloat16)); to run a region in float32, use "
            "autocast(fun, enabled=False)"
        )
        raise TypeError(f"autocast(fun): got the dtype {name} as the function; {fix}.")
    if inspect.isgeneratorfunction(fun) or inspect.iscoroutinefunction(fun):
        raise TypeError(
            f"autocast(fun): fun must return its results, got the generator or coroutine "
            f"function {getattr(fun, '__qualname__', fun)!r}, whose results would be "
            "computed after autocast returns. Return a list of the values instead."
        )
    _linen.check_function(fun)
    if isinstance(fun, (staticmethod, classmethod)):
        kind = type(fun).__name__
        raise TypeError(
            f"autocast(fun): got a {kind} object, which a class would no longer bind as "
            f"one. Put @{kind} above @autocast, as the outermost decorator."
        )
    if isinstance(fun, str) and dtype_named(fun) is not None:
        raise TypeError(
            f"autocast({fun!r}): autocast takes the function to transform first; {fun!r} "
            f"looks like a dtype. Pass it by keyword: autocast(fun, dtype={fun!r}), "
            "or autocast(dtype=...) as a decorator."
        )
    if isinstance(fun, str):  # torch's autocast("cuda", dtype=...)
        raise TypeError(
            f"autocast({fun!r}): autocast takes the function to transform, not a device "
            "type: a JAX program runs where its arrays are, under the same policy on "
            "every backend. Wrap the loss: autocast(loss_fn, dtype=jnp.float16)."
        )
    if not callable(fun):
        raise TypeError(
            f"autocast(fun): fun must be callable, got {type(fun).__name__}. Wrap the "
            "function that computes your loss: autocast(loss_fn)(params, batch), or use "
            "@autocast / @autocast(dtype=jnp.bfloat16) as a decorator."
        )


def _wrap(fun, region: Region, enabled: bool):
    """`fun` run under `region`, in a named scope that nested calls read back."""
    bound = _nnx.bound_module(fun)
    if bound is not None:
        return _wrap_module(fun, bound, region, enabled)
    if _pytree_fun.holds_arrays(fun):  # an Equinox module: a pytree of its own
        return _pytree_fun.PytreeFunction(fun, _wrap(_pytree_fun.call, region, enabled))

    cache = _trace_cache.TraceCache()  # eager calls: one trace per argument signature

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        with jax.named_scope(region.scope_name):
            if not enabled:
                return fun(*args, **kwargs)
            if _linen.in_module():
                _linen.check_arguments(args, kwargs)
                if _linen.initializing():  # creates the parameters, in float32 anyway
                    return fun(*args, **kwargs)
                with _linen.no_leaks():
                    return _autocast_call(fun, region, args, kwargs)
            if _nnx.has_nnx_objects((args, kwargs)):
                return _nnx.call_with_state(
                    lambda pure, state_args: _autocast_call(
                        pure, region, state_args, {}, shown=(fun, args, kwargs)
                    ),
                    fun,
                    args,
                    kwargs,
                )
            with _linen.checked_call(fun):
                return _autocast_call(fun, region, args, kwargs, cache)

    return _marks.marked(wrapped, fun, region)


def _wrap_module(fun, bound, region: Region, enabled: bool):
    """``autocast(model)`` or ``autocast(model.method)``: the module is passed as an
    argument, so that what the call writes to it (BatchNorm's statistics) is kept."""
    module, method = bound
    inner = _wrap(method, region, enabled)

    @functools.wraps(method)
    def call(*args, **kwargs):
        return inner(module, *args, **kwargs)

    try:  # the module's call, as `fun` is called: without `self`
        call.__signature__ = inspect.signature(fun)
    except (TypeError, ValueError):
        pass
    call.__mpjax_module__ = (inner, module)  # `audit` traces `inner` with the module passed
    return _marks.marked(call, fun, region)


_STATIC_HINT = (
    "mpjax.autocast traces `fun` with its array arguments abstract, as jax.jit does, "
    "so Python control flow (if, while, bool(), int()) and NumPy (np.asarray, "
    ".item()) must not depend on array values. Pass such flags as Python bools or "
    "ints (autocast hands non-array arguments to `fun` unchanged), close over them, "
    "or use lax.cond / jnp.where and jnp in place of np."
)

_CLOSED_OVER_HINT = (
    "mpjax.autocast traces `fun` as jax.jit does: an NNX module `fun` closes over "
    "cannot be changed from inside (BatchNorm statistics, RNG counters). Pass the "
    "module as an argument, autocast(loss)(model, x), or make it the function, "
    "autocast(model)(x); or call model.eval() first if the call should change nothing."
)


def trace_arrays(fun, args, kwargs, cache: _trace_cache.TraceCache | None = None):
    """Traces ``fun(*args, **kwargs)`` with the array leaves abstract.

    A `jax.ShapeDtypeStruct` is traced as the array it describes (`mpjax.audit` on
    shapes alone). Every other leaf (Python scalars, strings, None) is passed to
    `fun` as it is.
    Returns the closed jaxpr, the output shapes, and the array leaves. With a
    `cache`, a call of a signature traced before reuses its trace.
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _leaves.is_value(x)]
    dynamic_leaves = [leaves[i] for i in dynamic]
    key = None if cache is None else cache.key(leaves, treedef, dynamic)
    hit = None if cache is None else cache.get(key)
    if hit is not None:
        return (*hit, dynamic_leaves)

    returned = []  # the output's structure, with its non-array leaves

    @functools.wraps(fun)  # JAX's errors then name `fun`, not this wrapper
    def flat_fun(*dynamic_leaves):
        full = list(leaves)
        for i, x in zip(dynamic, dynamic_leaves):
            full[i] = x
        a, k = jax.tree.unflatten(treedef, full)
        out_leaves, out_tree = jax.tree.flatten(fun(*a, **k))
        # Arrays are the program's outputs; anything else (a string tag) is
        # handed back as it is, as `fun` returns it without autocast.
        for x in out_leaves:
            if not _leaves.is_output(x):
                _leaves.check_returned(fun, x)
        returned[:] = [out_tree, [None if _leaves.is_output(x) else x for x in out_leaves]]
        return [x for x in out_leaves if _leaves.is_output(x)]

    # JAX's errors name `fun` and its line, but not its parameters: this takes
    # the array leaves only, not `fun`'s arguments.
    flat_fun.__signature__ = inspect.signature(lambda *array_arguments: None)

    try:
        closed, shapes = jax.make_jaxpr(flat_fun, return_shape=True)(*dynamic_leaves)
    except Exception as e:
        # Python control flow or shapes depending on an array: say how to fix it.
        if isinstance(
            e,
            (
                jax.errors.ConcretizationTypeError,
                jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError,
                jax.errors.TracerArrayConversionError,
            ),
        ) or re.search(r"Traced<|Tracer\(", str(e)):
            e.add_note(_STATIC_HINT)
        elif type(e).__name__ == "TraceContextError":  # Flax's: a module closed over
            e.add_note(_CLOSED_OVER_HINT)
        raise
    out_tree, statics = returned
    shapes = iter(shapes)
    out_shape = jax.tree.unflatten(out_tree, [next(shapes) if x is None else x for x in statics])
    if cache is not None:
        cache.put(key, closed, out_shape, [x for x in statics if x is not None])
    return closed, out_shape, dynamic_leaves


def _autocast_call(fun, region: Region, args, kwargs, cache=None, shown=None):
    """`fun` traced and evaluated under `region`; `shown`: the user's ``(fun, args,
    kwargs)`` that errors name, where `fun` is mpjax's own (NNX modules' state)."""
    closed, out_shape, dynamic_leaves = trace_arrays(fun, args, kwargs, cache)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in dynamic_leaves):
        _leaves.refuse_shapes(*(shown or (fun, args, kwargs)))
    # The gradient of a weakly typed argument (a Python float) is weak, as without
    # autocast: as jnp's promotions do, a cast to a strong type, whose transpose
    # makes the cotangent weak again.
    dynamic_leaves = [
        _compat.with_weak_type(x, False) if _compat.is_tracer(x) and jax.typeof(x).weak_type else x
        for x in dynamic_leaves
    ]
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    consts = [_constants.read_closed_over(c) for c in consts]
    ctx = Context(region, Scope(), memo={})
    try:
        outs, _ = eval_jaxpr(ctx, jaxpr, consts, dynamic_leaves, [False] * len(dynamic_leaves))
        out_leaves, out_tree = jax.tree.flatten(out_shape)
        outs = iter(outs)
        out = [_output(ctx, next(outs), s) if _leaves.is_output(s) else s for s in out_leaves]
        return jax.tree.unflatten(out_tree, out)
    finally:
        ctx.scope.release()


def _output(ctx: Context, out, shape):
    """An output at the dtype `fun` returns it in (`shape`'s)."""
    # jnp.asarray: an output that is a literal comes back a jax.Array, as from `fun`.
    out = jnp.asarray(ctx.scope.cast(out, shape.dtype))
    # A weakly typed output (``s * 2`` of a weak `s`) stays weak, for what it meets next.
    weaken = shape.weak_type and not jax.typeof(out).weak_type
    return _compat.with_weak_type(out, True) if weaken else out
