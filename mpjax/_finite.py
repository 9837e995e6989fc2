"""Which leaves of a tree hold an inf or a NaN: the loss scaler's finite check.

Its cost that users meet first is compile time, not run time: a model has hundreds
to thousands of parameter leaves, and XLA compiles every kernel of the update once.
So the check makes few kernels whatever the number of leaves. Small leaves of one
size are stacked (one copy of them, small by definition) and checked by one
reduction; a large leaf gets a reduction of its own, where its bytes, not its
kernel, cost the time. The flags come out as one vector, not a scalar per leaf:
every scalar output is a kernel more.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _casting, _compat

LARGE = 2**14
"""Leaves of this many elements or more are checked each by a reduction of its own,
except on a GPU (`LARGE_GPU`; `large_leaf` says which applies)."""

_STACK_ELEMENTS = 2**24
"""At most this many elements are stacked together, should XLA copy the stack."""

LARGE_GPU = _STACK_ELEMENTS
"""`LARGE` on a GPU: every leaf that fits a stack is stacked. There a leaf's
reduction is a kernel launched on every step (two, for a large one), and XLA fuses
a stack into the reduction that reads it, so that stacking copies nothing. On an
H200 the update of 10 leaves of 100,000 elements costs 1.24x bare adam's with them
stacked, 1.36x with a reduction each; the GPT's float16 training step compiled for
an H100 has 40 kernels fewer than with leaves from 2**21 elements checked each
alone, and moves the same bytes (docs/benchmarks.md)."""

_STACK = 256
"""At most this many small leaves are stacked into one reduction."""


def inexact(x) -> bool:
    """Whether `x` is floating or complex: a leaf that can hold an inf or a NaN."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def nonfinite_sum(x, axis=None) -> jax.Array:
    """A float32 sum over `axis` (all by default) that is 0 where every value summed
    is finite, and not 0 (NaN, or a count eagerly) where one is not.

    Under a trace, the sum of ``x - x``: inf - inf is NaN, and a NaN survives
    additions in any order (XLA folds ``x - x`` to 0 for integers only). XLA fuses
    the difference into the reduction: one kernel for each leaf shape, which reads
    the leaf once, and which XLA:CPU compiles in about a third of the time of a pass
    writing flags plus a max of them (``python -m benchmarks.scaler --check``). Not
    ``x * 0``: XLA:CPU may read its zeros from a copy as large as the leaf. Not a
    max over the values: XLA:CPU's max of 4096 or more floats drops a NaN.
    """
    if not _compat.is_tracer(x):
        # Eagerly, jax_debug_nans checks each operation: a NaN of the check's own
        # would be reported as the user's.
        return jnp.sum(~jnp.isfinite(x), axis=axis, dtype=jnp.float32)
    # Over every axis, not a ravel: a leaf sharded along any axis is reduced where
    # it lies, and its sums meet in one scalar all-reduce. Accumulated in float32
    # at least: a 16-bit sum is what jax_allow_f16_reductions=False rejects.
    dtype = _casting.promoted(jnp.result_type(x), jnp.float32)
    total = jnp.sum(x - x, axis=axis, dtype=dtype)
    if jnp.iscomplexobj(total):
        total = total.real + total.imag
    return total.astype(jnp.float32)


def leaf_flags(leaves: Sequence) -> tuple[jax.Array, list[int], jax.Array]:
    """Which leaves are not all finite: a bool vector, whose each is, and any.

    ``flags[j]`` is the flag of ``leaves[order[j]]``: leaves checked together are
    next to each other, and `segment_any` takes the order as it is (a permutation
    would be a kernel more). The third result is whether any flag is set.
    """
    if not leaves:
        return jnp.zeros([0], jnp.bool_), [], jnp.array(False)
    small = collections.defaultdict(list)
    large = []
    # Eagerly, each leaf alone: a stack of values would be an operation holding the
    # inf or NaN, which jax_debug_nans reports as the scaler's own.
    threshold = 0 if not any(map(_compat.is_tracer, leaves)) else large_leaf()
    for i, x in enumerate(leaves):
        (large if jnp.size(x) >= threshold else small[_stack_key(x)]).append(i)
    parts, order = [], []
    for idx in small.values():
        step = max(1, min(_STACK, _STACK_ELEMENTS // max(1, jnp.size(leaves[idx[0]]))))
        for start in range(0, len(idx), step):
            chunk = idx[start : start + step]
            # The values are stacked, not their sums: XLA then checks them in one
            # kernel, where it makes a kernel for each small leaf.
            rows = _stack([leaves[i] for i in chunk])
            parts.append(nonfinite_sum(rows, axis=tuple(range(1, rows.ndim))))
            order += chunk
    parts += [nonfinite_sum(leaves[i])[None] for i in large]
    order += large
    if len(parts) == 1:
        flags = parts[0] != 0
        # One reduction to a bool: it reaches every select of the step as it is.
        return flags, order, jnp.any(flags)
    flags = jnp.concatenate(parts) != 0
    # XLA turns a reduction of values joined from several parts (booleans, or the
    # sums themselves) into a chain of scalar operations, and copies the chain into
    # every kernel that reads the result (every select of the step): a program
    # quadratic in the number of leaves. A float32 max of the flags it leaves a
    # reduction.
    return flags, order, jnp.max(flags.astype(jnp.float32)) > 0


def _stack(xs: Sequence) -> jax.Array:
    """``jnp.stack(xs)``, for leaves of one shape; on a CPU that is the only
    device, the concatenation of their ravels, reshaped.

    XLA:CPU's layout assignment takes a time quadratic in the number of operands
    of a concatenation into two or more dimensions, which a stack of reshaped
    leaves is; a concatenation of vectors it assigns in linear time. With several
    devices, or leaves sharded on a mesh with explicit axes (even of one device), a
    stack along an axis of its own: a concatenation along a leaf's own axis would
    gather the shards of a sharded leaf, where a stack moves nothing.
    """
    explicit = _casting.explicit_sharding(jax.typeof(xs[0])) is not None
    if backend() != "cpu" or jax.device_count() > 1 or explicit:
        return jnp.stack(xs)
    flat = jax.lax.concatenate([jnp.ravel(x) for x in xs], 0)
    return flat.reshape((len(xs), *jnp.shape(xs[0])))


def large_leaf() -> int:
    """Leaves of this many elements or more are not stacked: `LARGE_GPU` where the
    program being traced runs on a GPU (`backend`), else `LARGE`."""
    return LARGE_GPU if backend() == "gpu" else LARGE


def backend() -> str:
    """The platform the program being traced runs on: the default backend's."""
    return jax.default_backend()


def _stack_key(x) -> tuple:
    """Leaves stacked together: of one shape, dtype and sharding, so that a stack
    of tensor-parallel leaves moves nothing between devices (a ravel would)."""
    return jnp.shape(x), jnp.result_type(x), getattr(jax.typeof(x), "sharding", None)


def segment_any(flags: jax.Array, segments: Sequence[int], num_segments: int) -> jax.Array:
    """A bool vector: for each segment, whether any of `flags` in it is set.

    `segments[j]` is the segment of ``flags[j]``; a segment no flag is in is False.
    """
    if list(segments) == list(range(num_segments)):
        return flags  # one flag per segment, in order: no scatter
    index = np.asarray(segments, np.int32)
    return jnp.zeros([num_segments], jnp.uint8).at[index].max(flags.astype(jnp.uint8)) > 0
