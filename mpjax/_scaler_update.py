"""What one ``update`` of the loss scaler does, and the scale update rule.

`update` takes the gradients of the loss (`mpjax.scaled_value_and_grad` computes
them with the loss scaled and divides the scale out again; with
``accumulation_steps > 1``, their mean or sum over the micro-batches), checks them,
runs the wrapped optimizer and keeps or discards its step by selection, then moves
the scale with `_next_scale`, torch's ``_amp_update_scale_``. The transformations
that use it are in `mpjax.scaler`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mpjax._float32 import _mul_f32_by_f64


class ScalerConfig(NamedTuple):
    """The settings of one scaler, checked by its constructor in `mpjax.scaler`."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    dynamic: bool
    """False for `static_scaler`: the scale never changes."""
    enabled: bool
    """False for `noop_scaler`: no unscaling, no checks, no skipping."""
    accumulation_steps: int
    accumulation: str
    """How micro-batch gradients combine: "mean" or "sum"."""
    axis_name: Hashable | Sequence[Hashable] | None
    check_updates: bool
    """Also skip a step whose gradients are finite but whose updates are not."""


def update(inner, config: ScalerConfig, grads, state, params, extra):
    """The scaler's ``update`` on the gradients of one (micro-)batch."""
    if config.accumulation_steps == 1:
        return _step(inner, config, grads, state, params, extra)
    return _accumulate(inner, config, grads, state, params, extra)


def _accumulate(inner, config: ScalerConfig, grads, state, params, extra):
    """Adds a micro-batch's gradients; the last of an effective batch takes the step."""
    k = config.accumulation_steps
    # For the mean, each micro-batch is divided by k before it is added, as
    # torch's recipe divides the loss: the sum then overflows only where torch's
    # would. Written as the product XLA turns a division by a constant into, so
    # the result is the same on every backend.
    weight = 1.0 / k if config.accumulation == "mean" else 1.0
    total = jax.tree.map(
        lambda acc, g: (
            acc + g.astype(acc.dtype) * jnp.asarray(weight, acc.dtype) if _is_inexact(g) else acc
        ),
        state.grad_accumulator,
        grads,
    )
    micro_step = state.micro_step + 1
    last_micro_step = micro_step == k
    step_updates, step_state = _step(inner, config, _like(total, grads), state, params, extra)
    # Selection, as in optax.MultiSteps: inner's update is computed on every
    # micro-batch and kept on the last. (lax.cond would skip that work, but
    # inside shard_map its branches must agree on device variance, which the
    # zeros of the other branch cannot know.)
    new_updates = _zeros_unless(last_micro_step, step_updates)
    new_state = _select(last_micro_step, step_state, state)
    # Reset by selection: a multiplication (optax.MultiSteps) would turn an inf
    # into a NaN that poisons every later effective batch.
    accumulator = _select(last_micro_step, jax.tree.map(jnp.zeros_like, total), total)
    return new_updates, new_state._replace(
        micro_step=jnp.where(last_micro_step, 0, micro_step).astype(jnp.int32),
        grad_accumulator=accumulator,
    )


def _step(inner, config: ScalerConfig, grads, state, params, extra):
    """One effective step on the gradients of the loss: check, skip or apply, rescale."""
    if not config.enabled:
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        return updates, state._replace(inner_state=inner_state)
    finite, nonfinite_subtrees = _finite_flags(config, grads, state.nonfinite_subtrees)
    # inner runs on zeros when skipping: its result is discarded anyway, and
    # this way no inf or NaN is computed inside it (jax_debug_nans stays quiet).
    grads = _zeros_unless(finite, grads)
    updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
    # inner may itself produce a non-finite update from finite gradients (adam
    # with eps=0 on zero gradients): that step is skipped too, so parameters
    # never become non-finite. The scale is not at fault and is not backed off.
    # Without the check, `applied` is known before inner runs, and XLA folds the
    # selects below into inner's own elementwise passes.
    applied = finite & _all_finite_everywhere(config, updates) if config.check_updates else finite
    # Selection is exact, so a skipped step leaves inner's state bit for bit.
    updates = _zeros_unless(applied, updates)
    inner_state = _select(applied, inner_state, state.inner_state)
    if config.dynamic:
        scale, tracker = _next_scale(
            state.scale,
            state.growth_tracker,
            finite,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            min_scale=config.min_scale,
        )
        # A step skipped for inner's non-finite updates is no success to grow on
        # (adam's eps underflowing in float16 parameters would skip every step
        # while the scale kept growing): scale and tracker hold.
        held = finite & ~applied
        scale = jnp.where(held, state.scale, scale)
        tracker = jnp.where(held, state.growth_tracker, tracker)
    else:
        scale, tracker = state.scale, state.growth_tracker
    skipped = jnp.logical_not(applied)
    return updates, state._replace(
        scale=scale,
        growth_tracker=tracker,
        skipped_steps=state.skipped_steps + skipped.astype(jnp.int32),
        last_step_skipped=skipped,
        inner_state=inner_state,
        nonfinite_subtrees=nonfinite_subtrees,
    )


def _like(total, grads):
    """The accumulated gradients in the dtypes of the micro-batch gradients."""
    return jax.tree.map(lambda t, g: t.astype(g.dtype) if _is_inexact(g) else g, total, grads)


def _all_finite_everywhere(config: ScalerConfig, tree):
    return _finite_flags(config, tree, {})[0]


def _finite_flags(config: ScalerConfig, tree, subtrees: dict):
    """Whether all of `tree` is finite, and for each of `subtrees` whether it is not.

    One reduction per leaf (`_nonfinite`); the leaves' flags are combined by one
    more. A subtree of a single small leaf (a flat dict of parameters) reports
    that leaf's flag itself, with no op of its own.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    flags = [(path, _nonfinite(x)) for path, x in flat if _is_inexact(x)]
    finite = jnp.logical_not(_any([f for _, f in flags]))
    by_name: dict = {}
    if subtrees:
        depth = _depth(tree)
        for path, f in flags:
            by_name.setdefault(_subtree_name(path, depth), []).append(f)
    nonfinite = {name: _any(by_name.get(name, [])) for name in dict(subtrees)}
    if config.axis_name is not None:
        # Every device must take the same branch, or replicas drift apart.
        total = lax.psum(
            [jnp.logical_not(finite).astype(jnp.int32)]
            + [v.astype(jnp.int32) for v in nonfinite.values()],
            config.axis_name,
        )
        finite = total[0] == 0
        nonfinite = {name: t > 0 for name, t in zip(nonfinite, total[1:])}
    return finite, nonfinite


_BYTE_CHECK_FROM = 2**14
"""Leaves of this many elements or more are checked by a max over bytes."""


def _nonfinite(x) -> jax.Array:
    """Whether `x` holds an inf or a NaN: a bool, or a uint8 0/1 for a large `x`.

    XLA:CPU runs a max over bytes in 0.4x to 0.8x the time of ``any`` over
    booleans (``python -m benchmarks.scaler --check``), but its result needs one
    more scalar kernel to become the bool a subtree's flag is: worth it only
    where the leaf's bytes, not the kernels, cost the time.
    """
    return _nonfinite_bools(x) if jnp.size(x) < _BYTE_CHECK_FROM else _nonfinite_bytes(x)


def _nonfinite_bools(x) -> jax.Array:
    return jnp.any(~jnp.isfinite(x))


def _nonfinite_bytes(x) -> jax.Array:
    return jnp.max((~jnp.isfinite(x)).astype(jnp.uint8))


def subtree_names(params) -> list[str]:
    """The paths of the parameter subtrees `GradScalerState.nonfinite_subtrees` keys."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    depth = _depth(params)
    return sorted({_subtree_name(path, depth) for path, x in flat if _is_inexact(x)})


def _depth(tree) -> int:
    """1, or 2 when the top has a single entry (Linen's ``{"params": ...}``)."""
    top = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if len(top) != 1 or not top[0][0]:
        return 1
    below = jax.tree_util.tree_flatten_with_path(top[0][1])[0]
    return 2 if below and all(path for path, _ in below) else 1


def _subtree_name(path, depth: int) -> str:
    return jax.tree_util.keystr(tuple(path[:depth])) or "<root>"


# --------------------------------------------------------------------------
# The scale update rule.


def _next_scale(
    scale, tracker, finite, *, growth_factor, backoff_factor, growth_interval, min_scale
):
    """torch's ``_amp_update_scale_``, with the scale floored at `min_scale`.

    On a skipped step the scale is multiplied by ``backoff_factor`` and the growth
    tracker resets; after ``growth_interval`` finite steps in a row it is
    multiplied by ``growth_factor`` (unless that overflows float32: growth
    refused) and the tracker resets. Products are computed as torch computes
    them, in double precision rounded to float32, bit for bit, without float64
    (see ``_mul_f32_by_f64``). Everything is ``jnp.where``: no host sync, jit-safe.
    """
    # A NaN or inf scale (only a corrupted checkpoint makes one) restarts from
    # the floor instead of skipping, or zeroing, every later step.
    scale = jnp.where(jnp.isfinite(scale), scale, jnp.float32(min_scale))
    successful = tracker + 1
    grow = successful == growth_interval  # equality, as torch: not >=
    grown = _mul_f32_by_f64(scale, growth_factor)
    grown = jnp.where(jnp.isfinite(grown), grown, scale)  # growth refused at the top
    backed_off = jnp.maximum(_mul_f32_by_f64(scale, backoff_factor), jnp.float32(min_scale))
    new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed_off)
    # The tracker resets on growth even when growth was refused, as torch's does.
    new_tracker = jnp.where(finite & ~grow, successful, 0).astype(jnp.int32)
    return new_scale.astype(jnp.float32), new_tracker


# --------------------------------------------------------------------------
# Small utilities.


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def accumulator_dtype(p):
    return jnp.promote_types(jnp.result_type(p), jnp.float32)


def _any(flags) -> jax.Array:
    """Whether any of `flags` (scalars from `_nonfinite`) is set, as a bool.

    Combined by one reduction, a float32 max of their stack. Combined with
    ``|`` instead, the flag is a chain of cheap scalar ops that XLA copies into
    every fusion reading it (every select of the step), so compile time grew with
    the square of the number of leaves; a reduction is never copied. (XLA turns
    a max over a stack of integers into such a chain too: hence float32.)
    """
    if len(flags) <= 1:
        return flags[0].astype(bool) if flags else jnp.array(False)
    return jnp.max(jnp.stack(flags).astype(jnp.float32)) > 0


def _select(pred: jax.Array, on_true, on_false):
    """``jnp.where(pred, on_true, on_false)`` leaf by leaf, for a bool scalar `pred`.

    One ``select_n`` per leaf: ``jnp.where`` wraps each call in a nested jit,
    which costs trace and compile time on trees of thousands of leaves.
    """

    def one(t, f):
        if jnp.result_type(t) != jnp.result_type(f) or jnp.shape(t) != jnp.shape(f):
            return jnp.where(pred, t, f)  # rare: an inner that retypes its state
        return lax.select_n(pred, f, t)  # a scalar predicate needs no broadcast

    return jax.tree.map(one, on_true, on_false)


def _zeros_unless(pred: jax.Array, tree):
    """`tree` where `pred`, zeros of the same shapes and dtypes elsewhere."""
    return _select(pred, tree, jax.tree.map(lambda t: lax.full_like(t, 0), tree))
