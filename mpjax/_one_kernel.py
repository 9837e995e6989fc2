"""The scaler's scalar outputs, written by one kernel on a CPU.

XLA:CPU compiles a kernel for each scalar the update outputs (the scale, the
growth tracker, the skipped-step count, adam's count...), 15-20 ms each, and an
output passed through unchanged is a copy, one kernel more: with a few leaves,
these are most of what the scaler adds to the optimizer's compile time. A
variadic reduction writes several outputs from one kernel: each value, reduced
by ``max`` with its type's lowest value along a length-2 axis, is the value bit
for bit. XLA:GPU fuses the scalars into few kernels itself, and copies a
reduction's outputs into the donated state's buffers (a kernel each): there the
values are left as they are.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import _compat, _finite


def together(values: list) -> list:
    """`values`, scalars, as they are; traced for a CPU, written by one kernel for
    each group of them that one reduction can hold: varying over the same manual
    mesh axes, and of one floating type at most (XLA refuses to mix precisions)."""
    if _finite.backend() != "cpu":
        return list(values)
    groups = collections.defaultdict(list)
    for i, x in enumerate(values):
        key = _group(x)
        if key is not None:
            groups[key].append(i)
    out = list(values)
    for idx in groups.values():
        if len(idx) > 1:
            for i, x in zip(idx, _together(tuple(values[i] for i in idx))):
                out[i] = x
    return out


@jax.custom_jvp
def _together(xs: tuple) -> tuple:
    lowest = [np.asarray(_lowest(x.dtype), x.dtype) for x in xs]
    pairs = [lax.concatenate([lax.broadcast(x, (1,)), low[None]], 0) for x, low in zip(xs, lowest)]
    return tuple(lax.reduce(pairs, lowest, _max, (0,)))


def _max(a, b):
    # At module level: lax caches the reduction's computation by this function.
    return [lax.max(p, q) for p, q in zip(a, b)]


@_together.defjvp
def _together_jvp(primals, tangents):
    # The identity: its derivative passes the tangents through (JAX has no
    # derivative of a variadic reduction).
    return _together(*primals), tangents[0]


def _group(x):
    """The reduction `x` joins, or None: a traced boolean, integer or IEEE float
    scalar, for which ``max`` with the type's lowest value is the identity, bit for
    bit (a float8 without an infinity has no such value: -inf is a NaN there). Not
    weakly typed: the reduction's result is not, and a state whose types change is
    compiled again. Float32 goes with the integers and booleans, another float type
    apart, each by the manual mesh axes it varies over."""
    if not _compat.is_tracer(x) or jnp.ndim(x) != 0:
        return None
    aval = jax.typeof(x)
    if aval.weak_type:
        return None
    if aval.dtype in _IEEE:
        other = None if aval.dtype == np.float32 else aval.dtype
    elif aval.dtype == np.bool_ or jnp.issubdtype(aval.dtype, jnp.integer):
        other = None
    else:
        return None
    return _compat.varying_axes(aval), other


_IEEE = frozenset(map(np.dtype, (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)))


def _lowest(dtype):
    """The identity of ``max`` for `dtype`."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return False
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf
    return jnp.iinfo(dtype).min
