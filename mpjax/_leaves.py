"""Which leaves of an autocast function's arguments it traces, and which leaves of
its results are outputs of the traced program; every other leaf is handed over as
it is, as the function gives or returns it without autocast."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat


def is_value(x) -> bool:
    """Whether an argument leaf is traced: an array of numbers or bools (JAX's or
    NumPy's, bfloat16 included: NumPy strings, objects, dates and durations, which JAX
    cannot trace, are not), or the shape of one."""
    if isinstance(x, (np.ndarray, np.generic)):
        kind = x.dtype.kind  # ml_dtypes' (bfloat16, float8) are "V", as structured ones
        return kind in "biufc" or (kind == "V" and jnp.issubdtype(x.dtype, np.number))
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def is_output(x) -> bool:
    """Whether a result leaf is an output of the traced program (its shape, once traced).

    A Python number or a NumPy value `fun` returns depends on no traced value:
    it comes back as it is (``2**40`` or ``1e300`` would not survive a float32 or
    int32 array).
    """
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def check_returned(fun, x) -> None:
    """Refuses a result leaf that is not an output but holds one: an object JAX does
    not see into (a dataclass that is no pytree) would come back holding values of
    the trace, which fail when used. As `jax.jit`, a TypeError; it names the fix."""
    if inspect.isgenerator(x):
        held = True
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        held = any(_traced(getattr(x, f.name, None)) for f in dataclasses.fields(x))
    elif callable(x) and not isinstance(x, type):  # a closure, a bound method
        held = _traced([*parts(x), *parts(getattr(x, "__self__", None))])
    else:
        held = any(_traced(v) for v in getattr(x, "__dict__", {}).values())
    if held:
        name = getattr(fun, "__name__", "fun")
        raise TypeError(
            f"autocast({name}): it returned a {type(x).__name__}, which holds or yields "
            "arrays but is not a pytree: autocast cannot hand its arrays back. Register "
            "the class as a pytree (jax.tree_util.register_dataclass, "
            "flax.struct.dataclass), or return the arrays in a tuple, list or dict "
            "(a function: return the arrays it closes over, and make it outside)."
        )


def parts(x) -> list:
    """What an object holds one level down: a container's items, a partial's function
    and arguments, a callable's function (``f``), bound ``__self__`` and closure
    cells, an object's attributes."""
    if isinstance(x, (list, tuple)):
        return list(x)
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, functools.partial):
        return [x.func, x.args, x.keywords]
    fields = getattr(x, "__dict__", None) if not isinstance(x, type) else None
    if not (callable(x) or hasattr(x, "call_wrapped")):  # a WrappedFun is not callable
        return list(fields.values()) if isinstance(fields, dict) else []
    cells = getattr(x, "__closure__", None) or ()
    return [
        getattr(x, "f", None),
        getattr(x, "__self__", None),
        *(c.cell_contents for c in cells if _filled(c)),
        *(fields.values() if isinstance(fields, dict) else ()),
    ]


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


def _traced(value) -> bool:
    return any(_compat.is_tracer(leaf) for leaf in jax.tree.leaves(value))


def refuse_shapes(fun, args, kwargs) -> None:
    """A TypeError naming the `jax.ShapeDtypeStruct` among the arguments of a call,
    which computes values (`mpjax.audit` traces shapes alone; `jax.eval_shape`)."""
    for path, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(x, jax.ShapeDtypeStruct):
            where = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
            raise TypeError(
                f"autocast({getattr(fun, '__name__', 'fun')}): {where} is a "
                f"jax.ShapeDtypeStruct ({x.dtype}{list(x.shape)}), not an array: a call "
                "computes values. For shapes alone use jax.eval_shape(autocast(f), ...), "
                "or mpjax.audit(autocast(f), ...) to see what runs in which precision."
            )
