"""Loss scaling for mixed-precision training, as optax transformations.

Float16 gradients underflow unless the loss is multiplied by a large factor
before differentiation and the gradients are divided by it afterwards. The
scaler here is an optax `GradientTransformationExtraArgs` that *wraps* the
optimizer (``grad_scaler(optax.adamw(...))``): its state, including the scale,
lives in ``opt_state`` and is saved with it, and a step whose gradients are not
finite is skipped exactly, leaving every leaf of the inner optimizer's state
(moments, step counts, schedules) bit for bit as it was.

It follows ``torch.amp.GradScaler``'s rule to the bit, with two deliberate
differences, both documented on `grad_scaler`: the scale never falls below
``min_scale`` (torch's reaches 0 and its parameters become NaN), and the finite
check looks at the unscaled gradients (a superset of torch's check: it also
catches gradients that overflow when a scale below 1 is divided out).

A typical step::

  loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

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
_MIN_NORMAL_F32 = float(np.finfo(np.float32).tiny)  # 2**-126
_INT32_MAX = int(np.iinfo(np.int32).max)


class GradScalerState(NamedTuple):
    """State of `grad_scaler`, `static_scaler` and `noop_scaler`.

    Attributes:
      scale: float32 scalar, the factor the loss is multiplied by.
      growth_tracker: int32 scalar, consecutive finite (effective) steps since
        the last growth or skip (torch's ``_growth_tracker``).
      skipped_steps: int32 scalar, total number of (effective) steps skipped
        because their gradients (or inner's updates) were not finite.
      last_step_skipped: bool scalar, whether the latest effective step was
        skipped.
      micro_step: int32 scalar, micro-batches accumulated since the last effective
        step; always 0 when ``accumulation_steps == 1``.
      grad_accumulator: the sum of the scaled micro-batch gradients of the current
        effective batch (float32, or wider if the parameters are), shaped like the
        parameters; ``optax.EmptyState()`` when ``accumulation_steps == 1``.
      inner_state: the state of the wrapped optimizer.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler
      >>> state = grad_scaler(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
      >>> state.scale, state.skipped_steps, state.last_step_skipped
      (Array(65536., dtype=float32), Array(0, dtype=int32), Array(False, dtype=bool))
    """

    scale: jax.Array
    growth_tracker: jax.Array
    skipped_steps: jax.Array
    last_step_skipped: jax.Array
    micro_step: jax.Array
    grad_accumulator: Any
    inner_state: optax.OptState


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
    `scaled_value_and_grad`). It multiplies them by float32 ``1 / scale``
    (each leaf keeps its dtype), checks that all are finite (NaN counts as not
    finite), and then:

    * finite: returns ``inner``'s updates on the unscaled gradients and
      ``inner``'s new state;
    * not finite: returns zero updates and ``inner``'s state unchanged, bit for
      bit. ``inner`` is then run on zeros instead of the bad gradients, so no
      inf or NaN is ever computed inside it.

    The scale then changes as torch's ``_amp_update_scale_``: on a skipped step it
    is multiplied by ``backoff_factor`` and the growth tracker resets; after
    ``growth_interval`` finite steps in a row it is multiplied by
    ``growth_factor`` (unless that overflows float32: growth refused) and the
    tracker resets. Products are computed as torch computes them, in double
    precision rounded to float32, bit for bit, without float64 (see
    ``_mul_f32_by_f64``). Everything is ``jnp.where``: no host sync, jit-safe.

    It is a wrapper, not a chain element: a transform earlier in an
    ``optax.chain`` cannot stop later ones from advancing their state, so only a
    wrapper can skip a step exactly. Wrap the whole chain; clipping inside it then
    sees unscaled gradients, as torch's ``unscale_``-then-clip recipe asks.

    Differences from torch, both deliberate:

    * The scale never falls below ``min_scale``. torch's scale reaches 0 after
      enough overflows, its gradients are then 0, the step is not skipped, and
      ``0 * inf`` turns the parameters into NaN. The default floor, 2**-14 (the
      smallest normal float16), is far below any useful scale: a run that still
      overflows there is diverging, and keeps skipping (see ``skipped_steps``)
      with finite, unchanged parameters. Being a power of two, it is reached
      exactly by backoffs from a power-of-two ``init_scale``.
    * The finite check looks at the unscaled gradients. torch looks at the
      scaled ones; the two agree except when a scale below 1 makes a finite
      scaled gradient overflow once divided out, which torch would apply.

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
        the scale is updated, once per effective batch. The other calls return zero updates and change neither
        the scale nor ``inner``'s state. Unlike ``optax.MultiSteps``, the
        accumulator is reset by selection, so an inf in one effective batch cannot
        poison the next.
      axis_name: for ``update`` called inside ``shard_map`` or ``pmap`` on
        per-device gradients: the mapped axis name (or names) over which the
        finite check is combined, so every device makes the same skip decision.
        Not needed under plain ``jit`` with sharded arrays, where the check is
        already global.

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
        lambda v: _MIN_NORMAL_F32 <= v < math.inf,
    )
    if init_scale < min_scale:
        raise ValueError(
            f"{name}: init_scale={init_scale!r} is below "
            f"min_scale={min_scale!r}; raise init_scale or lower min_scale."
        )
    return _loss_scaler(
        inner,
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
    name = "static_scaler"
    scale = _check_number(
        name,
        "scale",
        scale,
        "a finite float32 number >= 2**-126 (a normal float32)",
        lambda v: _MIN_NORMAL_F32 <= v < math.inf,
    )
    with np.errstate(over="ignore"):
        overflows = not np.isfinite(np.float32(scale))
    if overflows:
        raise ValueError(
            f"{name}: scale={scale!r} overflows float32; it must be at "
            f"most {float(np.finfo(np.float32).max)!r}."
        )
    return _loss_scaler(
        inner,
        init_scale=scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1,
        min_scale=_MIN_NORMAL_F32,
        dynamic=False,
        enabled=True,
        accumulation_steps=_check_int(name, "accumulation_steps", accumulation_steps),
        axis_name=axis_name,
    )


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


def _loss_scaler(
    inner,
    *,
    init_scale,
    growth_factor,
    backoff_factor,
    growth_interval,
    min_scale,
    dynamic,
    enabled,
    accumulation_steps,
    axis_name,
) -> optax.GradientTransformationExtraArgs:
    """The transformation behind `grad_scaler`, `static_scaler`, `noop_scaler`."""
    inner = optax.with_extra_args_support(inner)
    k = accumulation_steps

    def init_fn(params):
        if k > 1:
            accumulator = jax.tree.map(
                lambda p: jnp.zeros(jnp.shape(p), _accumulator_dtype(p)), params
            )
        else:
            accumulator = optax.EmptyState()
        return GradScalerState(
            scale=jnp.asarray(init_scale, jnp.float32),
            growth_tracker=jnp.zeros([], jnp.int32),
            skipped_steps=jnp.zeros([], jnp.int32),
            last_step_skipped=jnp.zeros([], jnp.bool_),
            micro_step=jnp.zeros([], jnp.int32),
            grad_accumulator=accumulator,
            inner_state=inner.init(params),
        )

    def step(grads, state, params, extra):
        """One effective step on unscaled `grads`: check, skip or apply, rescale."""
        if not enabled:
            updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
            return updates, state._replace(inner_state=inner_state)
        finite = _all_finite_everywhere(grads)
        # inner runs on zeros when skipping: its result is discarded anyway, and
        # this way no inf or NaN is computed inside it (jax_debug_nans stays quiet).
        grads = _zeros_unless(finite, grads)
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        # inner may itself produce a non-finite update from finite gradients (adam
        # with eps=0 on zero gradients): that step is skipped too, so parameters
        # never become non-finite. The scale is not at fault and is not backed off.
        applied = finite & _all_finite_everywhere(updates)
        # Selection is exact, so a skipped step leaves inner's state bit for bit.
        updates = _zeros_unless(applied, updates)
        inner_state = _select(applied, inner_state, state.inner_state)
        if dynamic:
            scale, tracker = _next_scale(
                state.scale,
                state.growth_tracker,
                finite,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                min_scale=min_scale,
            )
        else:
            scale, tracker = state.scale, state.growth_tracker
        skipped = jnp.logical_not(applied)
        return updates, state._replace(
            scale=scale,
            growth_tracker=tracker,
            skipped_steps=state.skipped_steps + skipped.astype(jnp.int32),
            last_step_skipped=skipped,
            inner_state=inner_state,
        )

    def unscale(grads, like, state):
        """`grads` unscaled, in `like`'s dtypes."""
        if enabled:
            inv_scale, inv_tail = _reciprocal(state.scale)

        def one(g, ref):
            if not _is_inexact(ref):
                return ref
            g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
            if enabled:
                g = g * inv_scale * inv_tail
            return g.astype(ref.dtype)

        return jax.tree.map(one, grads, like)

    def _all_finite_everywhere(tree):
        finite = _all_finite(tree)
        if axis_name is not None:
            # Every device must take the same branch, or replicas drift apart.
            finite = lax.psum(jnp.logical_not(finite).astype(jnp.int32), axis_name) == 0
        return finite

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
        if k == 1:
            return step(unscale(updates, updates, state), state, params, extra)

        # Each micro-batch is divided by k before it is added, as torch's recipe
        # divides the loss: the sum then overflows only where torch's would.
        # Written as the product XLA turns a division by a constant into anyway,
        # so the result is the same on every backend.
        total = jax.tree.map(
            lambda acc, g: acc + g.astype(acc.dtype) * jnp.asarray(1.0 / k, acc.dtype)
            if _is_inexact(g)
            else acc,
            state.grad_accumulator,
            updates,
        )
        micro_step = state.micro_step + 1
        last_micro_step = micro_step == k
        step_updates, step_state = step(
            unscale(total, updates, state), state, params, extra
        )
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

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------
# The scale update rule.


def _next_scale(
    scale, tracker, finite, *, growth_factor, backoff_factor, growth_interval, min_scale
):
    """torch's ``_amp_update_scale_``, with the scale floored at `min_scale`."""
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


def _reciprocal(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``1 / scale`` as two normal float32 factors, ``(inverse, tail)``.

    Up to a scale of 2**64 this is torch's ``f32(1 / double(scale))`` and a tail of
    1, so unscaling is torch's single multiply, bit for bit (a float32 quotient
    is the same number: a reciprocal never rounds to a float32 midpoint). Above,
    the exact power of two 2**-64 is split off into the tail: above 2**126 the
    single reciprocal would be a float32 subnormal, which backends flush to
    zero, and every gradient would silently become 0.
    """
    big = scale > jnp.float32(2.0**64)
    tail = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
    return 1.0 / jnp.where(big, scale * jnp.float32(2.0**-64), scale), tail


def _mul_f32_by_f64(x: jax.Array, factor: float) -> jax.Array:
    """``float32(float64(x) * factor)`` for a float32 scalar `x`, without float64.

    torch multiplies the scale in double precision and rounds to float32. Two
    roundings can differ from one float32 multiply (with ``factor=1.1`` often:
    its binary expansion repeats), and float64 is off by default in JAX and
    slow or missing on accelerators. So the 24-bit by 53-bit significand product
    is formed exactly in 16-bit limbs held in uint32, then rounded to nearest
    even twice, to 53 and then to 24 bits, as the double multiply and the
    conversion do. Integer arithmetic is exact on every backend.

    A power-of-two `factor` takes a plain float32 multiply, which is then exact.
    Results below the smallest normal float32 come out as 0; the scale's floor
    (`min_scale` >= 2**-126) makes that invisible.

    Args:
      x: float32 scalar (or array).
      factor: a positive finite Python float.

    Returns:
      The float32 product, ``inf`` where it overflows float32.
    """
    x = jnp.asarray(x, jnp.float32)
    mantissa, exponent = math.frexp(factor)
    if mantissa == 0.5:
        return x * jnp.float32(factor)
    mf = int(mantissa * 2**53)  # factor == mf * 2**(exponent - 53), exactly
    b = [jnp.uint32((mf >> (16 * j)) & 0xFFFF) for j in range(4)]

    u32 = lambda v: jnp.asarray(v, jnp.uint32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    biased = (bits >> 23) & 0xFF
    fraction = bits & 0x7FFFFF
    # x == ms * 2**ex with ms normalised into [2**23, 2**24).
    ms = jnp.where(biased == 0, fraction, fraction | 0x800000)
    ex = jnp.where(biased == 0, -126, biased.astype(jnp.int32) - 127) - 23
    shift = lax.clz(ms).astype(jnp.int32) - 8
    ms = lax.shift_left(ms, u32(jnp.maximum(shift, 0)))
    ex = ex - shift

    # The exact product ms * mf in [2**75, 2**77), as six 16-bit limbs.
    a = [ms & 0xFFFF, ms >> 16]
    columns = [u32(0)] * 6
    for i in range(2):
        for j in range(4):
            p = a[i] * b[j]  # < 2**32
            columns[i + j] = columns[i + j] + (p & 0xFFFF)
            columns[i + j + 1] = columns[i + j + 1] + (p >> 16)
    r, carry = [], u32(0)
    for c in columns:
        c = c + carry
        r.append(c & 0xFFFF)
        carry = c >> 16
    # Normalise to exactly 77 bits (top bit 76 == bit 12 of r[4]).
    top = (r[4] >> 12) & 1
    doubled = [((r[i] << 1) & 0xFFFF) | (r[i - 1] >> 15 if i else u32(0)) for i in range(5)]
    r = [jnp.where(top == 1, r[i], doubled[i]) for i in range(5)]
    ex = ex + exponent - 53 - (1 - top.astype(jnp.int32))

    # First rounding, to 53 bits (the double product): drop bits 0..23.
    sticky = (r[0] != 0) | ((r[1] & 0x7F) != 0)
    round_bit = (r[1] >> 7) & 1
    lo = (r[1] >> 8) | (r[2] << 8) | ((r[3] & 0xFF) << 24)  # bits 24..55
    hi = (r[3] >> 8) | (r[4] << 8)  # bits 56..76, 21 bits
    inc = ((round_bit == 1) & (sticky | ((lo & 1) == 1))).astype(jnp.uint32)
    new_lo = lo + inc
    hi = hi + ((new_lo == 0) & (inc == 1)).astype(jnp.uint32)
    lo = new_lo
    overflow = hi >> 21  # rounded up to 2**53
    hi = jnp.where(overflow == 1, u32(1 << 20), hi)
    ex = ex + 24 + overflow.astype(jnp.int32)

    # Second rounding, to 24 bits (the conversion to float32): drop 29 bits.
    sticky = (lo & 0x0FFFFFFF) != 0
    round_bit = (lo >> 28) & 1
    kept = (hi << 3) | (lo >> 29)
    kept = kept + ((round_bit == 1) & (sticky | ((kept & 1) == 1))).astype(jnp.uint32)
    overflow = kept >> 24
    kept = jnp.where(overflow == 1, kept >> 1, kept)
    ex = ex + 29 + overflow.astype(jnp.int32)

    biased = ex + 23 + 127
    result_bits = jnp.where(
        biased >= 255,
        u32(0x7F800000),
        jnp.where(
            biased <= 0,
            u32(0),
            lax.shift_left(u32(jnp.clip(biased, 0, 255)), u32(23)) | (kept & 0x7FFFFF),
        ),
    )
    result = lax.bitcast_convert_type(result_bits, jnp.float32)
    # 0, inf and NaN multiply exactly in float32.
    return jnp.where(jnp.isfinite(x) & (x > 0), result, x * jnp.float32(factor))


# --------------------------------------------------------------------------
# Helpers on an optimizer state.


def get_scale(opt_state: Any) -> jax.Array:
    """The current loss scale held in `opt_state` (torch's ``get_scale()``).

    Args:
      opt_state: an optimizer state holding exactly one `GradScalerState`
        anywhere inside (``optax.chain``, ``optax.MultiSteps``,
        ``optax.inject_hyperparams``, ``optax.multi_transform``, a
        ``flax.nnx.Optimizer`` or its ``opt_state``).

    Returns:
      The float32 scalar scale (a device array; no host sync).

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState`, or several.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, get_scale
      >>> tx = optax.chain(optax.identity(), grad_scaler(optax.sgd(0.1)))
      >>> get_scale(tx.init(jnp.zeros(2)))
      Array(65536., dtype=float32)
    """
    return _value(_find_state(opt_state, "get_scale").scale, jnp.float32)


def set_scale(opt_state: Any, new_scale: float | jax.Array) -> Any:
    """`opt_state` with the scale replaced (torch's ``update(new_scale)``).

    The growth tracker is left as it is. The input is not modified; use the
    returned state (for a ``flax.nnx.Optimizer``:
    ``optimizer.opt_state = set_scale(optimizer.opt_state, s)``). The scale's
    floor applies at the next backoff, not here.

    Args:
      opt_state: an optimizer state holding exactly one `GradScalerState`.
      new_scale: the new scale: a finite number >= 2**-126, or a float32
        scalar array (then not checked, so it may be traced).

    Returns:
      A new optimizer state of the same structure.

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState` or several, or a
        concrete `new_scale` is not a finite number >= 2**-126.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, get_scale, set_scale
      >>> state = grad_scaler(optax.sgd(0.1)).init(jnp.zeros(2))
      >>> get_scale(set_scale(state, 1024.0))
      Array(1024., dtype=float32)
    """
    target = _find_state(opt_state, "set_scale")
    if isinstance(new_scale, numbers.Real) and not (
        _MIN_NORMAL_F32 <= float(new_scale) <= float(np.finfo(np.float32).max)
    ):
        raise ValueError(
            f"set_scale: new_scale={new_scale!r} must be a finite "
            "float32 number >= 2**-126 (a normal float32)."
        )
    value = jnp.asarray(new_scale, jnp.float32)
    if value.shape != ():
        raise ValueError(f"set_scale: new_scale must be a scalar, got shape {value.shape}.")

    def replace(node):
        if node is not target:
            return node
        # tree.map keeps any wrapper around the leaf (an nnx Variable, say).
        return node._replace(scale=jax.tree.map(lambda _: value, node.scale))

    return jax.tree.map(replace, opt_state, is_leaf=_is_scaler_state)


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss * scale`` (torch's ``scaler.scale(loss)``), in float32 or wider.

    The product is never formed in float16, whose maximum (65504) is below the
    default scale. Differentiate the result and pass the gradients to the
    scaler's ``update``.

    Args:
      loss: the loss, a scalar (or any array).
      opt_state: an optimizer state holding exactly one `GradScalerState`.

    Returns:
      The scaled loss, with dtype ``promote_types(loss.dtype, float32)``.

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState`, or several.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, scale_loss
      >>> state = grad_scaler(optax.sgd(0.1), init_scale=8.0).init(jnp.zeros(2))
      >>> scale_loss(jnp.float16(1.5), state)
      Array(12., dtype=float32)
    """
    scale = _value(_find_state(opt_state, "scale_loss").scale, jnp.float32)
    loss = jnp.asarray(loss)
    dtype = jnp.promote_types(loss.dtype, jnp.float32)
    return loss.astype(dtype) * scale.astype(dtype)


def scaled_value_and_grad(
    fun: Callable[..., Any],
    opt_state: Any,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    value_and_grad: Callable[..., Callable[..., Any]] = jax.value_and_grad,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad(fun)``, with the loss scaled for the gradients.

    The returned function takes `fun`'s arguments and returns ``(value, grads)``
    (``((value, aux), grads)`` with `has_aux`): `value` is `fun`'s own,
    *unscaled* loss, for logging; `grads` are the gradients of the *scaled* loss,
    ready for the scaler's ``update``. The scale is read from `opt_state` when
    this is called, so call it inside the training step, each step.

    Args:
      fun: the loss function; returns a scalar loss (and aux if `has_aux`).
      opt_state: an optimizer state holding exactly one `GradScalerState`.
      argnums: as for ``jax.value_and_grad``.
      has_aux: as for ``jax.value_and_grad``.
      value_and_grad: the differentiation transform; pass
        ``flax.nnx.value_and_grad`` to differentiate with respect to nnx modules.

    Returns:
      A function with `fun`'s signature returning ``(value, grads)``.

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState`, or several.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, scaled_value_and_grad
      >>> state = grad_scaler(optax.sgd(0.1), init_scale=4.0).init(jnp.zeros(2))
      >>> scaled_value_and_grad(lambda w: jnp.sum(w**2), state)(jnp.ones(2))
      (Array(2., dtype=float32), Array([8., 8.], dtype=float32))
    """
    scale = _value(_find_state(opt_state, "scaled_value_and_grad").scale, jnp.float32)

    def scaled_fun(*args, **kwargs):
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss)
        dtype = jnp.promote_types(loss.dtype, jnp.float32)
        return loss.astype(dtype) * scale.astype(dtype), (loss, aux)

    grad_fn = value_and_grad(scaled_fun, argnums=argnums, has_aux=True)

    def wrapped(*args, **kwargs):
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def scaler_stats(opt_state: Any) -> dict[str, jax.Array]:
    """The scaler's numbers for logging, as device arrays (no host sync).

    Args:
      opt_state: an optimizer state holding exactly one `GradScalerState`.

    Returns:
      A dict with ``scale`` (float32), ``growth_tracker`` (int32),
      ``skipped_steps`` (int32: effective steps skipped so far) and
      ``last_step_skipped`` (bool).

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState`, or several.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, scaler_stats
      >>> stats = scaler_stats(grad_scaler(optax.sgd(0.1)).init(jnp.zeros(2)))
      >>> int(stats["skipped_steps"]), bool(stats["last_step_skipped"])
      (0, False)
    """
    state = _find_state(opt_state, "scaler_stats")
    return {
        "scale": _value(state.scale, jnp.float32),
        "growth_tracker": _value(state.growth_tracker),
        "skipped_steps": _value(state.skipped_steps),
        "last_step_skipped": _value(state.last_step_skipped),
    }


def _is_scaler_state(x) -> bool:
    return isinstance(x, GradScalerState)


def _find_state(opt_state: Any, caller: str) -> GradScalerState:
    """The single `GradScalerState` inside `opt_state`, or a ValueError."""
    found = []

    def search(tree, prefix):
        flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_scaler_state)
        for path, node in flat:
            if _is_scaler_state(node):
                found.append((prefix + path, node))
                # A scaler nested in a scaler would unscale twice: report it too.
                search(node.inner_state, prefix + path)

    search(opt_state, ())
    if len(found) == 1:
        return found[0][1]
    if not found:
        raise ValueError(
            f"{caller}: no GradScalerState found in `opt_state` (a "
            f"{type(opt_state).__name__}). Build the optimizer with "
            "mpjax.grad_scaler(inner) (or static_scaler/noop_scaler); it may sit "
            "anywhere inside optax.chain, MultiSteps, inject_hyperparams, "
            "multi_transform or an nnx.Optimizer. Pass the state its init returned."
        )
    paths = ", ".join(jax.tree_util.keystr(path) or "<root>" for path, _ in found)
    raise ValueError(
        f"{caller}: found {len(found)} GradScalerStates in `opt_state` (at "
        f"{paths}); the helpers need exactly one. Wrap the whole optimizer in a "
        "single grad_scaler (e.g. grad_scaler(optax.multi_transform(...))) rather "
        "than each part, or pass the sub-state of the scaler you mean."
    )


def _value(field, dtype=None):
    """The array in a state field, unwrapping containers such as nnx Variables."""
    (leaf,) = jax.tree_util.tree_leaves(field)
    return jnp.asarray(leaf, dtype)


# --------------------------------------------------------------------------
# Small utilities.


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _accumulator_dtype(p):
    return jnp.promote_types(jnp.result_type(p), jnp.float32)


def _all_finite(tree) -> jax.Array:
    """Whether every inexact leaf of `tree` is finite, as a bool scalar.

    One reduction per leaf, combined by one more reduction (a float32 min of
    their stack). Combined with ``&`` instead, the flag is a chain of cheap
    scalar ops that XLA copies into every fusion reading it (every select of
    the step), so compile time grew with the square of the number of leaves;
    a reduction is never copied.
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree) if _is_inexact(x)]
    if len(flags) <= 1:
        return flags[0] if flags else jnp.array(True)
    return jnp.min(jnp.stack(flags).astype(jnp.float32)) > 0


def _select(pred: jax.Array, on_true, on_false):
    """``jnp.where(pred, on_true, on_false)`` leaf by leaf, for a bool scalar `pred`.

    One ``select_n`` per leaf: ``jnp.where`` wraps each call in a nested jit,
    which costs trace and compile time on trees of thousands of leaves.
    """

    def one(t, f):
        t, f = jnp.asarray(t), jnp.asarray(f)
        if t.dtype != f.dtype or t.shape != f.shape:  # rare: an inner that retypes its state
            return jnp.where(pred, t, f)
        return lax.select_n(lax.broadcast(pred, t.shape), f, t)

    return jax.tree.map(one, on_true, on_false)


def _zeros_unless(pred: jax.Array, tree):
    """`tree` where `pred`, zeros of the same shapes and dtypes elsewhere."""
    return _select(pred, tree, jax.tree.map(jnp.zeros_like, tree))


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
