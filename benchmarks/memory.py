"""Activation memory without a GPU: the residuals a `jax.vjp` keeps.

The residuals are what the backward pass reads: the activations a training step
holds between its forward and backward passes, which is where mixed precision
saves memory. They are found by tracing ``jax.vjp`` abstractly (nothing runs), so
the full-size models cost only a trace.

Residuals that *are* arguments (the float32 parameters, the batch) are left out of
`activation_bytes`: they are in memory whatever the precision, and counting them
would charge the float32 model for weights that every variant holds anyway. A
16-bit *copy* of a weight that the backward pass keeps is not an argument, so it is
counted: it is real extra memory. `all_bytes` (every leaf of the vjp function) is reported too.
One abstract trace of the vjp gives all of it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat


@dataclasses.dataclass(frozen=True)
class Residual:
    shape: tuple[int, ...]
    dtype: str
    producer: str
    """``argument``, ``literal``, or the primitive that computed it (``jit:name``
    for a nested jitted function)."""
    source: str
    """``file:line (function)`` of the code that computed it ('' for arguments)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def is_argument(self) -> bool:
        return self.producer in ("argument", "literal")


def var_nbytes(v) -> int:
    """The bytes of a jaxpr variable's value."""
    return math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize


def _vjp_jaxpr(fun, *args):
    """The jaxpr of ``jax.vjp(fun, *args)`` (the forward pass, linearized) and the
    number of residuals, its trailing outputs."""
    closed, out_shape = jax.make_jaxpr(lambda *a: jax.vjp(fun, *a), return_shape=True)(*args)
    jaxpr, _ = _compat.jaxpr_and_consts(closed)
    return jaxpr, len(jax.tree.leaves(out_shape[1]))


def residuals(jaxpr, n_res: int) -> list[Residual]:
    """The residuals a vjp jaxpr keeps, each once, with its producer.

    What ``jax.ad_checkpoint.print_saved_residuals`` prints, as data, from public API.
    """
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - n_res :]
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    invars = set(jaxpr.invars)
    out, seen = [], set()
    for v in res_vars:
        if isinstance(v, _compat.Literal):
            out.append(Residual(tuple(v.aval.shape), str(v.aval.dtype), "literal", ""))
            continue
        if v in seen:
            continue
        seen.add(v)
        aval = v.aval
        if v in invars:
            producer, source = "argument", ""
        elif v in producers:
            eqn = producers[v]
            producer = eqn.primitive.name
            if producer in ("jit", "pjit"):
                producer = f"jit:{eqn.params.get('name', '?')}"
            source = _short_frame(_compat.user_frame(eqn))
        else:
            producer, source = "constant", ""
        out.append(Residual(tuple(aval.shape), str(aval.dtype), producer, source))
    return out


def _short_frame(frame: str) -> str:
    """``/long/path/flax/linen/linear.py:123 (__call__)`` -> ``linear.py:123 (__call__)``."""
    path, _, rest = frame.partition(":")
    return f"{os.path.basename(path)}:{rest}" if rest else frame


def float_casts(jaxpr) -> int:
    """Casts between floating dtypes in a jaxpr, sub-jaxprs included."""
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
            # jnp.issubdtype: numpy does not count bfloat16 as floating.
            n += (
                src != dst
                and jnp.issubdtype(src, jnp.floating)
                and jnp.issubdtype(dst, jnp.floating)
            )
        n += sum(float_casts(sub) for sub in _compat.sub_jaxprs(eqn.params))
    return n


def memory_report(fun, *args, top: int = 8) -> dict:
    """Activation bytes of ``vjp(fun, *args)``, with a breakdown of where they come from.

    `all_bytes` is what ``jax.eval_shape(lambda *a: jax.vjp(fun, *a)[1], *args)``'s
    leaves add up to (arguments kept as residuals included, and a residual kept
    twice counted twice).
    """
    jaxpr, n_res = _vjp_jaxpr(fun, *args)
    res = residuals(jaxpr, n_res)
    acts = [r for r in res if not r.is_argument]
    by_dtype = collections.Counter()
    by_producer = collections.Counter()
    for r in acts:
        by_dtype[r.dtype] += r.nbytes
        by_producer[f"{r.dtype} {r.producer} @ {r.source}"] += r.nbytes
    all_bytes = sum(var_nbytes(v) for v in jaxpr.outvars[len(jaxpr.outvars) - n_res :])
    return dict(
        activation_bytes=sum(r.nbytes for r in acts),
        argument_bytes=sum(r.nbytes for r in res if r.is_argument),
        all_bytes=all_bytes,
        n_residuals=len(acts),
        by_dtype=dict(by_dtype.most_common()),
        top_producers=dict(by_producer.most_common(top)),
        forward_float_casts=float_casts(jaxpr),
    )
