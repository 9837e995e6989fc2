"""What one ``update`` of the loss scaler does, and the scale update rule.

`update` takes the gradients of the loss (`mpjax.scaled_value_and_grad` computes
them with the loss scaled and divides the scale out again; with
``accumulation_steps > 1``, their mean or sum over the micro-batches), checks them,
runs the wrapped optimizer and keeps or discards its step by selection, then moves
the scale with `_next_scale`, torch's ``_amp_update_scale_``. The transformations
that use it are in `mpjax.scaler`.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from mpjax import _casting, _compat, _finite, _one_kernel, _skip, _subtrees
from mpjax._skip import select as _select
from mpjax._float32 import _mul_f32_by_f64
from mpjax.scaler_state import DISABLED, STATIC, SubtreeFlags


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

    @property
    def name(self) -> str:
        """The constructor its errors name (`noop_scaler` is `grad_scaler`, disabled)."""
        return "grad_scaler" if self.dynamic else "static_scaler"


def update(inner, config: ScalerConfig, grads, state, params, extra):
    """The scaler's ``update`` on the gradients of one (micro-)batch."""
    # A state saved mid-way through an effective batch and resumed without
    # accumulation still holds its micro-batches: they join the next step's.
    if config.accumulation_steps == 1 and isinstance(state.grad_accumulator, optax.EmptyState):
        updates, state = _step(inner, config, grads, state, params, extra)
    else:
        updates, state = _accumulate(inner, config, grads, state, params, extra)
    # Every scalar of the new state (the scaler's and inner's) written by one kernel.
    leaves, tree = jax.tree.flatten(state)
    return updates, jax.tree.unflatten(tree, _one_kernel.together(leaves))


def _accumulate(inner, config: ScalerConfig, grads, state, params, extra):
    """Adds a micro-batch's gradients; the last of an effective batch takes the step."""
    k = config.accumulation_steps
    # For the mean, each micro-batch is divided by k before it is added, as
    # torch's recipe divides the loss: the sum then overflows only where torch's
    # would. Written as the product XLA turns a division by a constant into, so
    # the result is the same on every backend.
    weight = 1.0 / k if config.accumulation == "mean" else 1.0
    _subtrees.check_accumulable(grads, state.grad_accumulator, k, config.name)
    total = jax.tree.map(
        lambda acc, g: (
            acc + g.astype(acc.dtype) * jnp.asarray(weight, acc.dtype)
            if _finite.inexact(g)
            else acc
        ),
        state.grad_accumulator,
        grads,
    )
    micro_step = state.micro_step + 1
    last_micro_step = micro_step >= k  # a state resumed with fewer steps: its next one
    # Selection, as in optax.MultiSteps: inner's update is computed on every
    # micro-batch and kept on the last. (lax.cond would skip that work, but
    # inside shard_map its branches must agree on device variance, which the
    # zeros of the other branch cannot know.) inner's state is selected inside
    # `_step`, where inner computes it; the scaler's own fields here.
    new_updates, step_state = _step(
        inner, config, _like(total, grads), state, params, extra, take=last_micro_step
    )
    own = _select(
        last_micro_step, step_state._replace(inner_state=None), state._replace(inner_state=None)
    )
    new_state = own._replace(inner_state=step_state.inner_state)
    # Reset by selection: a multiplication (optax.MultiSteps) would turn an inf
    # into a NaN that poisons every later effective batch.
    accumulator = _zeros_where(last_micro_step, total)
    return new_updates, new_state._replace(
        micro_step=_select(last_micro_step, jnp.int32(0), micro_step.astype(jnp.int32)),
        grad_accumulator=accumulator,
    )


def _step(inner, config: ScalerConfig, grads, state, params, extra, take=True):
    """One effective step on the gradients of the loss: check, skip or apply, rescale.

    Where `take` is False, inner's state is kept and its updates are zeros even if
    the step is applied (a micro-batch that is not an effective batch's last).
    Flags say what is wrong (`nonfinite`, `skipped`), so that the one XLA
    outputs is the one every select reads, with no negation between them.
    """
    if not config.enabled:
        return _disabled_step(inner, grads, state, params, extra, take)
    state = _starting_scale(config, state)
    eager = not any(_compat.is_tracer(x) for x in jax.tree.leaves((grads, state, params, extra)))
    # Eagerly, inner runs once, as bare (a Python schedule, a host-side log): it is
    # traced only to tell whether a non-finite gradient is one it reads.
    traced = None if eager else _skip.trace_update(inner, grads, state.inner_state, params, extra)
    flags = functools.partial(
        _nonfinite_flags, config, grads, state.nonfinite_subtrees, state.scale
    )
    nonfinite, nonfinite_subtrees = flags(None if eager else _skip.read_gradients(traced, grads))
    if eager and bool(nonfinite):
        nonfinite, nonfinite_subtrees = flags(
            _skip.read_eagerly(inner, grads, state.inner_state, params, extra)
        )
    if not _compat.is_tracer(nonfinite):
        # Eagerly (jax_debug_nans checks each operation) inner runs on zeros; under
        # jit, where a select in front changed XLA's rounding of inner, as they are.
        grads = _zeros_where(nonfinite, grads)
    if config.check_updates:
        if _compat.is_tracer(nonfinite):
            updates, inner_state = _skip.run_traced(traced, grads, state.inner_state, params)
        else:  # eagerly, each operation as inner's own
            updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        bad_updates = _bad_updates(config, updates, state, inner_state)
        skipped = nonfinite | bad_updates
        # Selection is exact, so a skipped step leaves inner's state bit for bit.
        inner_state = _select(_either(skipped, take), state.inner_state, inner_state)
    else:
        # The skip is known before inner runs: its state is selected where inner
        # computes it, and XLA folds the selects into inner's own passes.
        skipped = nonfinite
        updates, inner_state = _skip.update_selected(
            inner, _either(skipped, take), grads, state.inner_state, params, extra, traced
        )
    updates = _no_updates_where(_either(skipped, take), updates)
    if config.dynamic:
        scale, tracker = _next_scale(
            state.scale,
            state.growth_tracker,
            nonfinite,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            min_scale=config.min_scale,
        )
        if config.check_updates:
            # A step skipped for inner's non-finite updates is no success to grow
            # on (adam's eps underflowing in float16 parameters would skip every
            # step while the scale kept growing): scale and tracker hold.
            held = bad_updates & ~nonfinite
            scale = _select(held, state.scale, scale)
            tracker = _select(held, state.growth_tracker, tracker)
    else:
        scale, tracker = state.scale, state.growth_tracker
    return updates, state._replace(
        scale=scale,
        growth_tracker=tracker,
        skipped_steps=state.skipped_steps + skipped.astype(jnp.int32),
        last_step_skipped=skipped,
        inner_state=inner_state,
        nonfinite_subtrees=nonfinite_subtrees,
    )


def _starting_scale(config: ScalerConfig, state):
    """`state` with its scale set where another kind of scaler made it. A disabled
    scaler's 1.0 (scaling switched on at a restore) becomes init_scale, as in a fresh
    state: float16 gradients would underflow for thousands of steps of growth. A static
    scaler keeps the scale of its own state only (`set_scale` may have set it)."""
    tracker = state.growth_tracker
    if not config.dynamic:
        own = tracker == STATIC
        scale = _select(own, state.scale, jnp.float32(config.init_scale))
        return state._replace(scale=scale, growth_tracker=jnp.full_like(tracker, STATIC))
    fresh = tracker == DISABLED
    scale = _select(fresh, jnp.float32(config.init_scale), state.scale)
    return state._replace(scale=scale, growth_tracker=jnp.maximum(tracker, 0))


def _disabled_step(inner, grads, state, params, extra, take):
    """`_step` of a disabled scaler: inner's update, the loss not scaled."""
    # An enabled scaler's state (a checkpoint restored with scaling off)
    # gives its scale up here: the loss is not scaled from the next step on,
    # and a skip it recorded is cleared by the first effective step (a
    # micro-batch's update leaves the last effective step's report).
    micro = jnp.logical_not(take)
    state = state._replace(
        scale=jnp.ones([], jnp.float32),
        growth_tracker=_disabled(),
        last_step_skipped=state.last_step_skipped & micro,
        nonfinite_subtrees=jax.tree.map(lambda f: f & micro, state.nonfinite_subtrees),
    )
    if take is True:
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        return updates, state._replace(inner_state=inner_state)
    updates, inner_state = _skip.update_selected(
        inner, micro, grads, state.inner_state, params, extra
    )
    return _no_updates_where(micro, updates), state._replace(inner_state=inner_state)


def _bad_updates(config: ScalerConfig, updates, state, inner_state) -> jax.Array:
    """Whether inner made non-finite updates from finite gradients (adam with
    eps=0 on zero gradients), or a non-finite moment: a leaf of its state shaped
    as an update (adam's nu from a gradient of 1e20, whose update mu / sqrt(inf)
    is a finite 0: the parameter would never move again). Such a step is skipped
    too; the scale is not at fault and is not backed off. Any other floating leaf
    (a scalar parameter's moment, a factored one) is at fault where it turns
    non-finite: reduce_on_plateau's best loss, which starts at inf, is not."""
    shapes = {jnp.shape(u) for u in jax.tree.leaves(updates) if jnp.ndim(u)}
    moments = []
    for old, new in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(inner_state)):
        if not _finite.inexact(new):
            continue
        if jnp.ndim(new) and jnp.shape(new) in shapes:
            moments.append(new)
        else:  # read only where it was finite: a best loss may stay at inf
            moments.append(jnp.where(jnp.isfinite(old), new, jnp.zeros_like(new)))
    # One check of the updates and the moments together: a handful of kernels.
    return _nonfinite_flags(config, [jax.tree.leaves(updates), moments], {}, state.scale)[0]


def _disabled() -> jax.Array:
    return jnp.asarray(DISABLED, jnp.int32)


def _either(skip, take):
    """Whether inner's step is dropped: skipped, or not one to take."""
    return skip if take is True else skip | jnp.logical_not(take)


def _like(total, grads):
    """The accumulated gradients in the dtypes of the micro-batch gradients, which
    inner's state was made for; float16 ones in the accumulator's: a sum float16
    cannot hold is not an overflow of the step's (bfloat16 has float32's range)."""

    def one(t, g):
        if not _finite.inexact(g):
            return g
        return t if jnp.result_type(g) == jnp.float16 else t.astype(g.dtype)

    return jax.tree.map(one, total, grads)


def _nonfinite_flags(config: ScalerConfig, tree, subtrees, scale, read=None):
    """Whether any of `tree` is not finite, and for each of `subtrees` whether it is.

    `read`: for each leaf, whether it is checked (the gradients inner reads); all
    by default.

    `subtrees` is the state's `SubtreeFlags` (its names are the subtrees), or an
    empty dict for none. The leaves are checked by a few reductions
    (`_finite.leaf_flags`), their flags combined by one more. `scale` is the
    state's: inside shard_map, a check that varies where it does not needs
    ``axis_name``.
    """
    flat = _subtrees.named_leaves(tree)
    read = [True] * len(flat) if read is None else read
    flat = [(path, x) for (path, x), r in zip(flat, read, strict=True) if r and _finite.inexact(x)]
    flags, order, nonfinite = _finite.leaf_flags([x for _, x in flat])
    if subtrees:
        names = tuple(subtrees)
        depth = _subtrees.depth(tree)
        index = {name: i for i, name in enumerate(names)}
        segments = [index.get(_subtrees.name(flat[j][0], depth), len(names)) for j in order]
        _subtrees.check_named(config.name, names, [flat[j][0] for j in order], segments)
        by_subtree = _finite.segment_any(flags, segments, len(names))
    if config.axis_name is not None:
        # Every device must take the same branch, or replicas drift apart.
        local = [nonfinite[None]] + ([by_subtree] if subtrees else [])
        total = _psum_over(config, jnp.concatenate(local).astype(jnp.int32))
        nonfinite = total[0] > 0
        if subtrees:
            by_subtree = total[1:] > 0
    _check_agreed(config, nonfinite, scale)
    return nonfinite, SubtreeFlags(names, by_subtree) if subtrees else subtrees


def _psum_over(config: ScalerConfig, x):
    """`x` summed over the scaler's `axis_name`, or a ValueError naming it where no
    such axis is bound (JAX's own error names a psum the user never wrote)."""
    try:
        return lax.psum(x, config.axis_name)
    except (NameError, AssertionError) as e:
        raise ValueError(
            f"{config.name}(..., axis_name={config.axis_name!r}): no mapped axis of that "
            "name is bound where update runs. Call update inside shard_map (or pmap, or "
            "vmap with axis_name=...) over a mesh with that axis; under jax.jit with "
            "sharded arrays leave axis_name=None: the check covers every device already."
        ) from e


def _check_agreed(config: ScalerConfig, flag, scale) -> None:
    """A ValueError if, inside shard_map, `flag` still differs between devices
    along mesh axes the scaler's state does not: each would decide alone whether
    to skip the step on a state they share, and replicas would drift apart."""
    lone = _lone_axes(flag, scale)
    if not lone:
        return
    fix = (
        f"Pass axis_name ({config.name}(inner, axis_name=...)) to combine the finite check "
        "over those axes"
        if config.axis_name is None
        else f"axis_name={config.axis_name!r} combines it over the others only: name "
        "every axis the gradients are split along"
    )
    raise ValueError(
        f"{config.name} update: inside shard_map, the gradients differ between devices "
        f"along the mesh axes {lone} and the scaler's state does not, so each device "
        f"would decide alone whether to skip the step. {fix}, or all-reduce the "
        "gradients (lax.pmean) first."
    )


def _lone_axes(flag, shared) -> tuple:
    """The shard_map axes `flag` varies along and the `shared` state does not."""
    along = _compat.varying_axes(jax.typeof(shared))
    return tuple(a for a in _compat.varying_axes(jax.typeof(flag)) if a not in along)


# --------------------------------------------------------------------------
# The scale update rule.


def _next_scale(
    scale, tracker, nonfinite, *, growth_factor, backoff_factor, growth_interval, min_scale
):
    """torch's ``_amp_update_scale_``, with the scale floored at `min_scale`.

    On a skipped step the scale is multiplied by ``backoff_factor`` and the growth
    tracker resets; after ``growth_interval`` finite steps in a row it is
    multiplied by ``growth_factor`` (unless that overflows float32: growth
    refused) and the tracker resets. Products are computed as torch computes
    them, in double precision rounded to float32, bit for bit, without float64
    (see ``_mul_f32_by_f64``). Everything is a selection: no host sync, jit-safe.
    """
    # A NaN or inf scale (only a corrupted checkpoint makes one) restarts from
    # the floor instead of skipping, or zeroing, every later step.
    scale = _select(jnp.isfinite(scale), scale, jnp.float32(min_scale))
    successful = tracker + 1
    # torch's test is equality; at or past it is the same there (its checkpoints
    # carry the interval), and it also grows a tracker resumed past a smaller one.
    grow = successful >= growth_interval
    grown = _mul_f32_by_f64(scale, growth_factor)
    grown = _select(jnp.isfinite(grown), grown, scale)  # growth refused at the top
    backed_off = jnp.maximum(_mul_f32_by_f64(scale, backoff_factor), jnp.float32(min_scale))
    new_scale = _select(nonfinite, backed_off, _select(grow, grown, scale))
    # The tracker resets on growth even when growth was refused, as torch's does.
    new_tracker = _select(nonfinite | grow, jnp.int32(0), successful.astype(jnp.int32))
    return new_scale.astype(jnp.float32), new_tracker


# --------------------------------------------------------------------------
# Small utilities.


def accumulator_dtype(p):
    return _casting.promoted(jnp.result_type(p), jnp.float32)


def _no_updates_where(pred, updates):
    """`updates` where not `pred`, and -0.0 where `pred`: ``p + -0.0`` is `p` bit for
    bit, a -0.0 parameter included (which ``+ 0.0`` would turn into +0.0)."""
    return _zeros_where(pred, updates, zero=-0.0)


def _zeros_where(pred, tree, zero=0.0):
    """Zeros of `tree`'s shapes and dtypes where `pred`, `tree` elsewhere.

    One zeros per type (shape, dtype, sharding), shared by the leaves of that
    type: a model's many leaves come in few types, and every ``full_like`` costs
    trace time (XLA would merge the copies anyway).
    """
    zeros: dict = {}

    def zeros_like(t):
        # A concrete array's type under a mesh of automatic axes omits its sharding.
        key = jax.typeof(t), None if _compat.is_tracer(t) else getattr(t, "sharding", None)
        if key not in zeros:
            kind = jnp.result_type(t).kind
            zeros[key] = lax.full_like(t, complex(zero, zero) if kind == "c" else zero)
        return zeros[key]

    return _select(pred, jax.tree.map(zeros_like, tree), tree)
