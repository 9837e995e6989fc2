"""`mpjax.diagnose`'s arguments: their checks, and the loss as a function of the
floating leaves of the parameters (a Flax NNX module's ``nnx.Param`` state)."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _nnx
from mpjax import policy as policy_module
from mpjax._autocast import POLICIES
from mpjax._casting import dtype_named
from mpjax._marks import original_of, region_of
from mpjax._float32 import MAX_F32, MIN_NORMAL_F32
from mpjax.scaler_state import get_scale

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
_DEFAULT_SCALE = {"float16": 2.0**16, "bfloat16": 1.0}


def check_options(loss_fn, dtype, has_aux, policy) -> list[str]:
    if not callable(loss_fn):
        raise TypeError(
            f"diagnose(loss_fn, params, *batch): loss_fn must be callable, got "
            f"{type(loss_fn).__name__}. Pass the loss function first: "
            "diagnose(loss_fn, params, x, y)."
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"diagnose(has_aux={has_aux!r}): has_aux must be a Python bool.")
    if policy not in POLICIES:
        raise ValueError(f"diagnose(policy={policy!r}): policy must be one of {POLICIES}.")
    if isinstance(dtype, str) and dtype == "both":
        return ["float16", "bfloat16"]
    resolved = dtype_named(dtype, "diagnose(dtype")
    name = None if resolved is None else resolved.name
    if name not in DTYPES:
        raise ValueError(
            f"diagnose(dtype={dtype!r}): dtype must be jnp.float16, jnp.bfloat16 or "
            '"both", the precision autocast runs matrix products in.'
        )
    return [name]


_EAGER = (
    "diagnose runs one step eagerly, on concrete values: call it outside jax.jit, "
    "grad or vmap, on the arrays you would pass to your training step (not "
    "jax.ShapeDtypeStruct: mpjax.audit takes shapes alone)."
)


def check_scale(scale, dtype: str) -> float:
    if scale is None:
        return _DEFAULT_SCALE[dtype]
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"diagnose(scale={scale!r}): scale must be a number, not a bool.")
    if isinstance(scale, (numbers.Real, np.ndarray, jax.Array)):
        if np.ndim(scale) != 0:
            raise ValueError(
                f"diagnose(scale=...): scale must be a scalar, got an array of shape "
                f"{np.shape(scale)}. Pass one number, or the optimizer state."
            )
        value = _concrete(scale)
    else:
        try:
            value = _concrete(get_scale(scale))
        except ValueError as e:
            raise ValueError(
                f"diagnose(scale=...): scale must be a number or an optimizer state holding "
                f"mpjax.grad_scaler's state; got a {type(scale).__name__} without one. "
                f"({e})"
            ) from None
    if not (math.isfinite(value) and MIN_NORMAL_F32 <= value <= MAX_F32):
        raise ValueError(
            f"diagnose(scale={value!r}): the loss scale must be a finite float32 number, "
            f">= 2**-126 and <= {MAX_F32!r}."
        )
    return value


def _concrete(x) -> float:
    if isinstance(x, jax.core.Tracer):  # diagnose(scale=opt_state) under jit
        raise TypeError(_EAGER)
    return float(x)


def unwrap(fun, dtype, policy) -> tuple[Callable, object, str]:
    """`fun` without its autocast (inside a ``functools.partial`` too), and the dtype and
    policy to run it at: those given (None: not given), else the autocast function's,
    else float16 and "torch". A ValueError where both are given and differ."""
    if isinstance(fun, functools.partial):
        inner, dtype, policy = unwrap(fun.func, dtype, policy)
        fun = functools.partial(inner, *fun.args, **fun.keywords)
        return fun, dtype, policy
    region, original = region_of(fun), original_of(fun)
    if region is None or region.dtype is None:  # no autocast function, or a disabled one
        fun = fun if original is None else original
        return fun, jnp.float16 if dtype is None else dtype, policy or "torch"
    own_dtype, own_policy = region.dtype.name, "lean" if region.lean else "torch"
    given = None if isinstance(dtype, str) and dtype == "both" else dtype
    given = getattr(dtype_named(given), "name", None)  # checked later
    for name, asked, own in [("dtype", given, own_dtype), ("policy", policy, own_policy)]:
        if asked in (*DTYPES, *POLICIES) and asked != own:
            shown = f"jnp.{asked}" if name == "dtype" else repr(asked)
            raise ValueError(
                f"diagnose({name}={shown}): loss_fn is an autocast function of {name} "
                f"{own}, and diagnose unwraps it to run it at {asked}. Leave {name} "
                "out to diagnose it as it runs, or pass the function autocast wraps."
            )
    return original, own_dtype if dtype is None else dtype, policy or own_policy


def is_float(x) -> bool:
    """Whether `x` is a floating array (or aval); not any object with a `dtype`
    field: a Flax Linen layer's is None."""
    dtype = getattr(x, "dtype", None)
    return isinstance(dtype, np.dtype) and jnp.issubdtype(dtype, jnp.floating)


class Problem(NamedTuple):
    pure: Callable  # (float leaves, *batch) -> scalar loss
    leaves: list
    paths: list[str]
    batch: tuple


def problem(loss_fn, params, batch, has_aux) -> Problem:
    """`loss_fn` as a function of the floating leaves of `params` (an NNX module's
    ``nnx.Param`` state)."""
    rebuild = None
    if _nnx.has_nnx_objects(params) and not isinstance(params, (dict, list, tuple)):
        from flax import nnx  # imported already: params holds NNX objects

        graphdef, state, rest = nnx.split(params, nnx.Param, ...)
        rest_leaves, rest_def = jax.tree.flatten(rest)

        def rebuild(tree):  # fresh Variables, created inside the trace that uses them
            return nnx.merge(graphdef, tree, jax.tree.unflatten(rest_def, rest_leaves))

        params = state
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [*(x for _, x in flat), *jax.tree.leaves(batch)]
    if any(isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)) for x in leaves):
        raise TypeError(_EAGER)
    where = [i for i, (_, x) in enumerate(flat) if is_float(x)]
    if not where:
        raise ValueError(
            f"diagnose(loss_fn, params, ...): params (a {type(params).__name__}) holds no "
            "floating-point arrays to differentiate. Pass the parameters (a pytree, Linen "
            "variables or an NNX module) second: diagnose(loss_fn, params, *batch)."
        )

    def pure(float_leaves, *batch):
        full = [x for _, x in flat]
        for i, x in zip(where, float_leaves):
            full[i] = x
        tree = jax.tree_util.tree_unflatten(treedef, full)
        out = loss_fn(rebuild(tree) if rebuild else tree, *batch)
        return _loss_of(out, has_aux)

    paths = [jax.tree_util.keystr(flat[i][0]).removesuffix(".value") for i in where]
    return Problem(pure, [flat[i][1] for i in where], paths, tuple(batch))


def _loss_of(out, has_aux):
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):  # as jax.value_and_grad
            got = "an array" if isinstance(out, jax.Array) else type(out).__name__
            raise TypeError(
                f"diagnose(has_aux=True): loss_fn must return a pair (loss, aux), got {got}."
                " Pass has_aux=False if it returns the loss alone."
            )
        out = out[0]
    elif isinstance(out, tuple):
        raise TypeError(
            f"diagnose: loss_fn returned a tuple of {len(out)}; if it returns (loss, aux), "
            "pass has_aux=True."
        )
    if not isinstance(out, (jax.Array, np.ndarray, np.generic, numbers.Number)):
        raise TypeError(
            f"diagnose: loss_fn must return a floating-point scalar loss, got a "
            f"{type(out).__name__}. Pass the loss function itself, not its gradient "
            "function (jax.grad(f)); to return metrics too, return (loss, metrics) and "
            "pass has_aux=True."
        )
    loss = jnp.asarray(out)
    if loss.dtype == jnp.float16:
        raise TypeError(
            "diagnose: loss_fn returns a float16 loss. Its gradient's seed, the loss "
            "scale, is then rounded to float16, and overflows past 65504: return the "
            "loss in float32 (loss.astype(jnp.float32)); mpjax.autocast's reductions "
            "return float32 by themselves."
        )
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        fix = (
            "Reduce it (e.g. .mean()) inside loss_fn."
            if loss.shape != ()
            else "Return a floating-point loss (a cross-entropy, not a count): only a "
            "floating-point value has gradients."
        )
        raise TypeError(
            f"diagnose: loss_fn must return a floating-point scalar loss, got "
            f"{loss.dtype}{list(loss.shape)}. {fix}"
        )
    return loss
