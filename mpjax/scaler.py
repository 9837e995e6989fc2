"""Loss scaling for mixed-precision training, as optax transformations.

Float16 gradients underflow unless the loss is multiplied by a large factor
before differentiation and the gradients are divided by it afterwards.
`mpjax.scaled_value_and_grad` does both, with the scale held in the optimizer
state; the scaler here checks the gradients and adapts that scale. It is an
optax `GradientTransformationExtraArgs` that *wraps* the
optimizer (``grad_scaler(optax.adamw(...))``): its state, including the scale,
lives in ``opt_state`` and is saved with it, and a step whose gradients are not
finite is skipped exactly, leaving every leaf of the inner optimizer's state
(moments, step counts, schedules) bit for bit as it was.

It is a wrapper, not a chain element: a transform earlier in an ``optax.chain``
cannot stop later ones from advancing their state, so only a wrapper can skip a
step exactly. Wrap the whole chain.

It follows ``torch.amp.GradScaler``'s rule to the bit, with two deliberate
differences:

* The scale never falls below ``min_scale``. torch's scale reaches 0 after
  enough overflows, its gradients are then 0, the step is not skipped, and
  ``0 * inf`` turns the parameters into NaN. The default floor, 2**-14 (the
  smallest normal float16), is far below any useful scale: a run that still
  overflows there is diverging, and keeps skipping (see ``skipped_steps``)
  with finite, unchanged parameters. Being a power of two, it is reached
  exactly by backoffs from a power-of-two ``init_scale``.
* The finite check looks at the unscaled gradients (a superset of torch's
  check). torch looks at the scaled ones; the two agree except when a scale
  below 1 makes a finite scaled gradient overflow once divided out, which torch
  would apply.

``update`` takes the gradients of the loss itself, unscaled, as every optax
transformation does: those `scaled_value_and_grad` returns, or those of plain
``jax.grad``, which then train correctly too, only without the protection against
underflow that the scaling gives.

A typical step::

  loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)

This module holds the transformations and their argument checks. What one
``update`` does, and the scale update rule, are in `mpjax._scaler_update`; the
state and the helpers that read it, in `mpjax.scaler_state`, and
`scaled_value_and_grad` in `mpjax.gradients` (both re-exported here).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import optax

from mpjax import _scaler_update, _subtrees
from mpjax._float32 import MIN_NORMAL_F32
from mpjax._scaler_checks import (
    DEFAULT_MIN_SCALE,
    check_accumulation,
    check_axis_name,
    check_bool,
    check_inner,
    check_no_float16,
    check_static_scale,
    explain_failed_update,
    grad_scaler_config,
)
from mpjax._scaler_update import ScalerConfig
from mpjax.gradients import scaled_value_and_grad
from mpjax.scaler_state import (
    DISABLED,
    RESTORED_WITHOUT_TARGET,
    STATIC,
    GradScalerState,
    SubtreeFlags,
    get_scale,
    scaler_stats,
    set_scale,
)

__all__ = [
    "GradScalerState",
    "SubtreeFlags",
    "grad_scaler",
    "static_scaler",
    "noop_scaler",
    "get_scale",
    "set_scale",
    "scaled_value_and_grad",
    "scaler_stats",
]


# --------------------------------------------------------------------------
# Transformations.


def grad_scaler(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = DEFAULT_MIN_SCALE,
    enabled: bool = True,
    accumulation_steps: int | None = None,
    accumulation: str | None = None,
    axis_name: Hashable | Sequence[Hashable] | None = None,
    check_updates: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scaling around an optimizer, with torch's GradScaler rule.

    `scaled_value_and_grad` computes the gradients with the loss scaled by the
    scale in the state, and divides it out again. ``update`` takes those gradients
    (the loss's own, as every optax transformation does; plain ``jax.grad``'s train
    too, without the underflow protection) and checks that all are finite. If so,
    it returns ``inner``'s updates and state; if not, updates of -0.0 (which keep
    every bit of a parameter) and ``inner``'s state bit for bit. The scale changes as
    torch's ``_amp_update_scale_`` (differences: `mpjax.scaler`), with no host sync.
    Wrap the whole ``optax.chain``: only a wrapper skips a step exactly.

    Args:
      inner: the optimizer to wrap (any optax transformation or chain).
      init_scale: the initial scale, a finite positive number.
      growth_factor: factor the scale grows by, > 1.
      backoff_factor: factor the scale shrinks by on a skipped step, in (0, 1).
      growth_interval: consecutive finite steps before growth, an integer >= 1.
      min_scale: floor of the scale, a normal float32 (>= 2**-126), <= ``init_scale``.
      enabled: if False, a no-op scaler: scale 1.0, gradients unchanged, ``inner``'s
        updates always applied (same state structure: checkpoints interchange).
      accumulation_steps: micro-batches per effective batch, k (None: one). Each
        ``update`` adds one micro-batch's gradients in float32 (and returns zero
        updates); the k-th checks them, steps ``inner`` and updates the scale. The
        reset is a selection (not ``* 0``): an inf cannot poison the next batch.
      accumulation: required with ``accumulation_steps > 1``: ``"mean"`` if each
        micro-batch's loss is a mean over its own examples (as ``optax.MultiSteps``),
        ``"sum"`` if the loss is already divided by k (PyTorch's recipe); an error
        without ``accumulation_steps``. Both give the mean gradient.
      axis_name: for ``update`` called inside ``shard_map`` or ``pmap`` on per-device
        gradients: the mapped axis name (or names) over which the finite check is
        combined, so every device makes the same skip decision. Not needed under plain
        ``jit`` with sharded arrays, where the check is already global.
      check_updates: also skip a step whose updates, or state, ``inner`` made
        non-finite from finite gradients (the scale holds), at the cost of a pass
        over the updates and the state (docs/loss_scaling.md). False: as torch.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `GradScalerState`; extra keyword arguments of ``update`` go to ``inner``.

    Raises:
      ValueError: if an argument is out of its valid range; ``init``: on trained float16 params.
      TypeError: if `inner` is not an optax transformation.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, scaled_value_and_grad, get_scale
      >>> tx = grad_scaler(optax.sgd(0.1), init_scale=2.0**10)
      >>> params = {"w": jnp.ones(3)}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p, x: jnp.sum(p["w"] * x)
      >>> loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, jnp.ones(3))
      >>> grads["w"]  # the loss's gradients, computed with the loss scaled by 1024
      Array([1., 1., 1.], dtype=float32)
      >>> updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
      >>> updates["w"]
      Array([-0.1, -0.1, -0.1], dtype=float32)
      >>> bad = {"w": jnp.array([1.0, jnp.inf, 1.0])}
      >>> updates, opt_state = jax.jit(tx.update)(bad, opt_state, params)
      >>> updates["w"], get_scale(opt_state)  # skipped; the scale backs off
      (Array([-0., -0., -0.], dtype=float32), Array(512., dtype=float32))
    """
    check_inner("grad_scaler", inner)
    settings = (init_scale, growth_factor, backoff_factor, growth_interval, min_scale, enabled)
    extra = (accumulation_steps, accumulation, axis_name, check_updates)
    return _loss_scaler(inner, grad_scaler_config(*settings, *extra))


def static_scaler(
    inner: optax.GradientTransformation,
    scale: float,
    *,
    accumulation_steps: int | None = None,
    accumulation: str | None = None,
    axis_name: Hashable | Sequence[Hashable] | None = None,
    check_updates: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """A fixed loss scale around an optimizer; non-finite steps are still skipped.

    The same transformation as `grad_scaler`, with the same state type, except
    that the scale never changes (no growth, no backoff; `set_scale` still sets
    it). A skipped step leaves ``inner``'s state bit for bit as it was and is
    counted in ``skipped_steps``.

    Args:
      inner: the optimizer to wrap.
      scale: the loss scale, a finite float32 number >= 2**-126 (a power of two
        keeps unscaling exact).
      accumulation_steps: as for `grad_scaler`.
      accumulation: as for `grad_scaler`.
      axis_name: as for `grad_scaler`.
      check_updates: as for `grad_scaler`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `GradScalerState`.

    Raises:
      ValueError: if ``scale`` is not a finite normal float32 number, or
        ``accumulation_steps`` is not an integer >= 1.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import static_scaler
      >>> tx = static_scaler(optax.sgd(1.0), 128.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> updates, state = tx.update(jnp.array([1.0, jnp.inf]), state)
      >>> updates, bool(state.last_step_skipped)
      (Array([-0., -0.], dtype=float32), True)
    """
    check_inner("static_scaler", inner)
    scale = check_static_scale(scale)
    steps, accumulation = check_accumulation("static_scaler", accumulation_steps, accumulation)
    config = ScalerConfig(
        init_scale=scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1,
        min_scale=MIN_NORMAL_F32,
        dynamic=False,
        enabled=True,
        accumulation_steps=steps,
        accumulation=accumulation,
        axis_name=check_axis_name("static_scaler", axis_name),
        check_updates=check_bool("static_scaler", "check_updates", check_updates),
    )
    return _loss_scaler(inner, config)


def noop_scaler(
    inner: optax.GradientTransformation,
    *,
    accumulation_steps: int | None = None,
    accumulation: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``grad_scaler(inner, enabled=False)``: scale 1.0, no checks, no skipping.

    Useful to switch loss scaling off (bfloat16, float32) without touching the
    training step: `scaled_value_and_grad` and the state layout stay the same.

    Args:
      inner: the optimizer to wrap.
      accumulation_steps: as for `grad_scaler`.
      accumulation: as for `grad_scaler`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `GradScalerState` with scale 1.0.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import noop_scaler, get_scale
      >>> tx = noop_scaler(optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> get_scale(state)
      Array(1., dtype=float32)
    """
    check_inner("noop_scaler", inner)
    check_accumulation("noop_scaler", accumulation_steps, accumulation)  # errors by this name
    return grad_scaler(
        inner, enabled=False, accumulation_steps=accumulation_steps, accumulation=accumulation
    )


def _loss_scaler(inner, config: ScalerConfig) -> optax.GradientTransformationExtraArgs:
    """The transformation behind `grad_scaler`, `static_scaler`, `noop_scaler`."""
    inner = _pair_returning(optax.with_extra_args_support(inner), config.name)

    def init_fn(params):
        inner_state = inner.init(params)
        if config.enabled:
            check_no_float16(params, inner, inner_state, config.name)
        if config.accumulation_steps > 1:
            # Laid out as each parameter is: a tensor-parallel model's accumulator
            # is sharded as its parameters are, not copied whole onto each device.
            accumulator = jax.tree.map(
                lambda p: jnp.zeros_like(p, _scaler_update.accumulator_dtype(p)),
                _subtrees.gradient_shaped(params),
            )
        else:
            accumulator = optax.EmptyState()
        return GradScalerState(
            scale=jnp.asarray(config.init_scale, jnp.float32),
            growth_tracker=jnp.asarray(_first_tracker(config), jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            last_step_skipped=jnp.zeros([], jnp.bool_),
            micro_step=jnp.zeros([], jnp.int32),
            grad_accumulator=accumulator,
            inner_state=inner_state,
            nonfinite_subtrees=_subtrees.no_subtree_flags(params),
        )

    def update_fn(updates, state, params=None, **extra):
        if isinstance(state, dict) and set(GradScalerState._fields) <= set(state):
            raise TypeError(f"{config.name} update: `state` {RESTORED_WITHOUT_TARGET}")
        if not isinstance(state, GradScalerState):
            raise TypeError(
                f"{config.name} update: `state` must be the GradScalerState that this "
                f"transformation's init returned, got {type(state).__name__}. A "
                "checkpoint saved without the scaler cannot be resumed with it: build "
                "the state with tx.init(params) and restore into that structure."
            )
        if jnp.shape(state.scale) != ():
            raise ValueError(
                f"{config.name} update: the state's `scale` must be a float32 scalar, got "
                f"shape {jnp.shape(state.scale)}. Restore checkpoints into the structure "
                "tx.init(params) returns (e.g. orbax's restore with that as target)."
            )
        try:
            return _scaler_update.update(inner, config, updates, state, params, extra)
        # optax's own errors for a state of another optimizer: a chain of another
        # length (ValueError), a missing field (AttributeError: EmptyState has no mu).
        except (ValueError, TypeError, AttributeError) as error:
            explain_failed_update(config.name, inner, updates, state, params, error)
            raise

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _first_tracker(config: ScalerConfig) -> int:
    """A fresh state's growth tracker, which also tells what kind of scaler made it."""
    return (0 if config.dynamic else STATIC) if config.enabled else DISABLED


def _pair_returning(inner, name: str) -> optax.GradientTransformationExtraArgs:
    """`inner`, whose update is refused where it returns no ``(updates, new_state)``
    pair (the updates alone, say), which would fail deep inside the scaler."""

    def update(updates, state, params=None, **extra):
        out = inner.update(updates, state, params, **extra)
        if isinstance(out, (tuple, list)) and len(out) == 2:
            return tuple(out)
        what = f" of {len(out)} values" if isinstance(out, (tuple, list)) else ""
        raise ValueError(
            f"{name}: the wrapped optimizer's update must return (updates, new_state), as "
            f"optax's do; it returned a {type(out).__name__}{what}. End it with "
            "`return updates, state`."
        )

    return inner._replace(update=update)
