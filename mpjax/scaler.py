"""Loss scaling for mixed-precision training, as optax transformations.

Float16 gradients underflow unless the loss is multiplied by a large factor
before differentiation and the gradients are divided by it afterwards. The
scaler here is an optax `GradientTransformationExtraArgs` that *wraps* the
optimizer (``grad_scaler(optax.adamw(...))``): its state, including the scale,
lives in ``opt_state`` and is saved with it, and a step whose gradients are not
finite is skipped exactly, leaving every leaf of the inner optimizer's state
(moments, step counts, schedules) bit for bit as it was.

It is a wrapper, not a chain element: a transform earlier in an ``optax.chain``
cannot stop later ones from advancing their state, so only a wrapper can skip a
step exactly. Wrap the whole chain; clipping inside it then sees unscaled
gradients, as torch's ``unscale_``-then-clip recipe asks.

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

A typical step::

  loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)

This module holds the transformations and their argument checks. What one
``update`` does, and the scale update rule, are in `mpjax._scaler_update`; the
state and the helpers that read it, in `mpjax.scaler_state` (re-exported here).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax import _scaler_update
from mpjax._float32 import MIN_NORMAL_F32
from mpjax._scaler_update import ScalerConfig
from mpjax.scaler_state import (
    GradScalerState,
    get_scale,
    scale_loss,
    scaled_value_and_grad,
    scaler_stats,
    set_scale,
)

__all__ = [
    "GradScalerState",
    "grad_scaler",
    "static_scaler",
    "noop_scaler",
    "get_scale",
    "set_scale",
    "scale_loss",
    "scaled_value_and_grad",
    "scaler_stats",
]

# The default floor of the scale: the smallest normal float16. See `grad_scaler`.
_DEFAULT_MIN_SCALE = 2.0**-14
_INT32_MAX = int(np.iinfo(np.int32).max)


# --------------------------------------------------------------------------
# Transformations.


def grad_scaler(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = _DEFAULT_MIN_SCALE,
    enabled: bool = True,
    accumulation_steps: int = 1,
    axis_name: Hashable | Sequence[Hashable] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scaling around an optimizer, with torch's GradScaler rule.

    ``update`` takes the gradients of the *scaled* loss (see `scale_loss` and
    `scaled_value_and_grad`), multiplies them by float32 ``1 / scale`` (each leaf
    keeps its dtype) and checks that all are finite (NaN is not). If so, it returns
    ``inner``'s updates on the unscaled gradients and ``inner``'s new state; if
    not, zero updates and ``inner``'s state unchanged, bit for bit (``inner`` runs
    on zeros then, so no inf or NaN is computed inside it). The scale then changes
    as torch's ``_amp_update_scale_``, bit for bit, with no host sync: jit-safe.

    Wrap the whole ``optax.chain``: only a wrapper can skip a step exactly, and
    clipping inside it sees unscaled gradients. Two differences from torch, both
    deliberate (see `mpjax.scaler` or the Loss scaling guide): the scale never falls
    below ``min_scale``, and the finite check looks at the unscaled gradients.

    Args:
      inner: the optimizer to wrap (any optax transformation or chain).
      init_scale: the initial scale, a finite positive number.
      growth_factor: factor the scale grows by, > 1.
      backoff_factor: factor the scale shrinks by on a skipped step, in (0, 1).
      growth_interval: number of consecutive finite steps before growth, an
        integer >= 1.
      min_scale: floor of the scale, a normal float32 number (>= 2**-126) no
        larger than ``init_scale``.
      enabled: if False, a no-op scaler: the scale is 1.0, gradients pass through
        unchanged and ``inner``'s updates are always applied (the state keeps the
        same structure, so checkpoints are interchangeable).
      accumulation_steps: number k of micro-batches per effective batch. Each
        ``update`` call then takes one micro-batch's scaled gradients; their sum
        is kept in float32 (or wider) and on the k-th call their mean (the sum
        times float32 ``1/k``) is unscaled, checked and given to ``inner``, and
        the scale is updated, once per effective batch. The other calls return
        zero updates and change neither the scale nor ``inner``'s state. Unlike
        ``optax.MultiSteps``, the accumulator is reset by selection, so an inf in
        one effective batch cannot poison the next.
      axis_name: for ``update`` called inside ``shard_map`` or ``pmap`` on per-device
        gradients: the mapped axis name (or names) over which the finite check is
        combined, so every device makes the same skip decision. Not needed under plain
        ``jit`` with sharded arrays, where the check is already global.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `GradScalerState`; extra keyword arguments of ``update`` go to ``inner``.

    Raises:
      ValueError: if an argument is out of its valid range.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, scaled_value_and_grad, get_scale
      >>> tx = grad_scaler(optax.sgd(0.1), init_scale=2.0**10)
      >>> params = {"w": jnp.ones(3)}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p, x: jnp.sum(p["w"] * x)
      >>> loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, jnp.ones(3))
      >>> grads["w"]  # gradients of the scaled loss
      Array([1024., 1024., 1024.], dtype=float32)
      >>> updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
      >>> updates["w"]  # computed from the unscaled gradients
      Array([-0.1, -0.1, -0.1], dtype=float32)
      >>> bad = {"w": jnp.array([1.0, jnp.inf, 1.0])}
      >>> updates, opt_state = jax.jit(tx.update)(bad, opt_state, params)
      >>> updates["w"], get_scale(opt_state)  # skipped; the scale backs off
      (Array([0., 0., 0.], dtype=float32), Array(512., dtype=float32))
    """
    settings = (init_scale, growth_factor, backoff_factor, growth_interval, min_scale, enabled)
    config = _grad_scaler_config(*settings, accumulation_steps, axis_name)
    return _loss_scaler(inner, config)


def static_scaler(
    inner: optax.GradientTransformation,
    scale: float,
    *,
    accumulation_steps: int = 1,
    axis_name: Hashable | Sequence[Hashable] | None = None,
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
      axis_name: as for `grad_scaler`.

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
      >>> updates, state = tx.update(jnp.array([128.0, -256.0]), state)
      >>> updates
      Array([-1.,  2.], dtype=float32)
    """
    scale = _check_static_scale(scale)
    config = ScalerConfig(
        init_scale=scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1,
        min_scale=MIN_NORMAL_F32,
        dynamic=False,
        enabled=True,
        accumulation_steps=_check_int("static_scaler", "accumulation_steps", accumulation_steps),
        axis_name=axis_name,
    )
    return _loss_scaler(inner, config)


def noop_scaler(
    inner: optax.GradientTransformation,
    *,
    accumulation_steps: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """``grad_scaler(inner, enabled=False)``: scale 1.0, no checks, no skipping.

    Useful to switch loss scaling off (bfloat16, float32) without touching the
    training step: `scale_loss`, `scaled_value_and_grad` and the state layout
    stay the same.

    Args:
      inner: the optimizer to wrap.
      accumulation_steps: as for `grad_scaler`.

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
    return grad_scaler(inner, enabled=False, accumulation_steps=accumulation_steps)


def _loss_scaler(inner, config: ScalerConfig) -> optax.GradientTransformationExtraArgs:
    """The transformation behind `grad_scaler`, `static_scaler`, `noop_scaler`."""
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        if config.accumulation_steps > 1:
            accumulator = jax.tree.map(
                lambda p: jnp.zeros(jnp.shape(p), _scaler_update.accumulator_dtype(p)), params
            )
        else:
            accumulator = optax.EmptyState()
        return GradScalerState(
            scale=jnp.asarray(config.init_scale, jnp.float32),
            growth_tracker=jnp.zeros([], jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            last_step_skipped=jnp.zeros([], jnp.bool_),
            micro_step=jnp.zeros([], jnp.int32),
            grad_accumulator=accumulator,
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra):
        if not isinstance(state, GradScalerState):
            raise TypeError(
                f"grad_scaler update: `state` must be the GradScalerState that this "
                f"transformation's init returned, got {type(state).__name__}. A "
                "checkpoint saved without the scaler cannot be resumed with it: build "
                "the state with tx.init(params) and restore into that structure."
            )
        if jnp.shape(state.scale) != ():
            raise ValueError(
                f"grad_scaler update: the state's `scale` must be a float32 scalar, got "
                f"shape {jnp.shape(state.scale)}. Restore checkpoints into the structure "
                "tx.init(params) returns (e.g. orbax's restore with that as target)."
            )
        return _scaler_update.update(inner, config, updates, state, params, extra)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------
# Argument checks.


def _grad_scaler_config(
    init_scale,
    growth_factor,
    backoff_factor,
    growth_interval,
    min_scale,
    enabled,
    accumulation_steps,
    axis_name,
) -> ScalerConfig:
    """`grad_scaler`'s arguments, checked."""
    name = "grad_scaler"
    init_scale = _check_number(
        name, "init_scale", init_scale, "a finite number > 0", lambda v: 0 < v < math.inf
    )
    with np.errstate(over="ignore"):
        overflows = not np.isfinite(np.float32(init_scale))
    if overflows:
        raise ValueError(
            f"{name}: init_scale={init_scale!r} overflows float32; "
            f"it must be at most {float(np.finfo(np.float32).max)!r}."
        )
    growth_factor = _check_number(
        name, "growth_factor", growth_factor, "a finite number > 1", lambda v: 1 < v < math.inf
    )
    backoff_factor = _check_number(
        name, "backoff_factor", backoff_factor, "a number in (0, 1)", lambda v: 0 < v < 1
    )
    growth_interval = _check_int(name, "growth_interval", growth_interval)
    min_scale = _check_number(
        name,
        "min_scale",
        min_scale,
        "a finite number >= 2**-126 (a normal float32)",
        lambda v: MIN_NORMAL_F32 <= v < math.inf,
    )
    if init_scale < min_scale:
        raise ValueError(
            f"{name}: init_scale={init_scale!r} is below "
            f"min_scale={min_scale!r}; raise init_scale or lower min_scale."
        )
    return ScalerConfig(
        init_scale=init_scale if enabled else 1.0,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=min_scale,
        dynamic=True,
        enabled=bool(enabled),
        accumulation_steps=_check_int(name, "accumulation_steps", accumulation_steps),
        axis_name=axis_name,
    )


def _check_static_scale(scale) -> float:
    """`static_scaler`'s scale, checked."""
    name = "static_scaler"
    scale = _check_number(
        name,
        "scale",
        scale,
        "a finite float32 number >= 2**-126 (a normal float32)",
        lambda v: MIN_NORMAL_F32 <= v < math.inf,
    )
    with np.errstate(over="ignore"):
        overflows = not np.isfinite(np.float32(scale))
    if overflows:
        raise ValueError(
            f"{name}: scale={scale!r} overflows float32; it must be at "
            f"most {float(np.finfo(np.float32).max)!r}."
        )
    return scale


def _check_number(fn: str, name: str, value, valid: str, ok) -> float:
    """`value` as a float if it is a real number (not bool) with `ok(value)`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{fn}: {name} must be {valid}, got {value!r} (a {type(value).__name__}).")
    value = float(value)
    if math.isnan(value) or not ok(value):
        raise ValueError(f"{fn}: {name} must be {valid}, got {value!r}.")
    return value


def _check_int(fn: str, name: str, value) -> int:
    """`value` as an int if it is an integer in [1, 2**31 - 1]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{fn}: {name} must be an integer >= 1, got {value!r} (a {type(value).__name__})."
        )
    value = int(value)
    if not 1 <= value <= _INT32_MAX:
        raise ValueError(f"{fn}: {name} must be an integer in [1, {_INT32_MAX}], got {value!r}.")
    return value
