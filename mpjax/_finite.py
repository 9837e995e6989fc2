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

LARGE = 2**14
"""Leaves of this many elements or more are checked each by a reduction of its own."""

_STACK = 256
"""At most this many small leaves are stacked into one reduction."""


def inexact(x) -> bool:
    """Whether `x` is floating or complex: a leaf that can hold an inf or a NaN."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def nonfinite(x) -> jax.Array:
    """Whether `x` holds an inf or a NaN, as a bool scalar.

    A max over bytes: on XLA:CPU it runs in 0.4x to 0.8x the time of ``any``
    over booleans on a large leaf (``python -m benchmarks.scaler --check``).
    Not a max over the values themselves: XLA:CPU's max of 4096 or more
    floats drops a NaN (jax 0.10 to 0.12), so a NaN leaf would pass.
    """
    # Over every axis, not a ravel: a leaf sharded along any axis is reduced where
    # it lies, and its flags meet in one scalar all-reduce.
    return jnp.max((~jnp.isfinite(x)).astype(jnp.uint8), initial=0) > 0


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
    for i, x in enumerate(leaves):
        (large if jnp.size(x) >= LARGE else small[_stack_key(x)]).append(i)
    parts, order = [], []
    for idx in small.values():
        for start in range(0, len(idx), _STACK):
            chunk = idx[start : start + _STACK]
            # The values are stacked, not their flags: XLA then checks them in
            # one kernel; stacked flags made a kernel per leaf.
            rows = jnp.stack([leaves[i] for i in chunk])
            parts.append(_rows_nonfinite(rows))
            order += chunk
    parts += [nonfinite(leaves[i])[None] for i in large]
    order += large
    if len(parts) == 1:
        # One reduction to a bool: it reaches every select of the step as it
        # is, with no comparison for XLA to copy into each.
        return parts[0], order, jnp.any(parts[0])
    flags = jnp.concatenate(parts)
    # XLA turns a reduction over booleans or integers joined from several parts
    # into a chain of scalar ``or``s, and copies the chain into every kernel that
    # reads the result (every select of the step): a program quadratic in the
    # number of leaves. A float32 max it leaves a reduction.
    return flags, order, jnp.max(flags.astype(jnp.float32)) > 0


def _rows_nonfinite(rows: jax.Array) -> jax.Array:
    """For each row of `rows` (its first axis), whether it holds an inf or a NaN.

    A float32 count of the values that are not finite (exact: it only grows),
    not an ``any`` over booleans: XLA fuses the count into one kernel, where it
    splits a boolean reduction into a tree of reduce-window kernels, each compiled
    apart.
    """
    bad = jnp.where(jnp.isfinite(rows), jnp.float32(0), jnp.float32(1))
    return jnp.sum(bad, axis=tuple(range(1, rows.ndim))) > 0


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
