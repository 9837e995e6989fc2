"""The rule of every first-order primitive: the policy tables applied to its inputs.

A primitive with no rule of its own in `mpjax.interpreter.HIGHER_ORDER` is bound
again on its inputs cast as `mpjax.policy` says (`policy_rule`). Two cases compute
in one precision and hand on another: under the lean policy, a float32-list
primitive on 16-bit inputs (`_float32_inside`); and a 16-bit product with a
float32 input, whose result stays float32 for its gradient
(`_low_product_float32_accumulator`).

`ctx` below is the interpreter's `Context`, read without importing its type.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from mpjax import _compat, _constants, _products, fusions, policy
from mpjax._casting import F32, convert, dtype_of, explicit_sharding, fewer, is_concrete, size
from mpjax import _pointwise
from mpjax._pointwise import bind_quotient, float32_tangent
from mpjax.policy import Rule

# Primitives bound with a derivative of their own, not JAX's (`bind_quotient`).
_BIND = {"div": bind_quotient}


def _targets(rule: Rule, eqn, vals, weak, low, lean=False, scope=None) -> list:
    """The dtype each input is cast to (None: left as it is)."""
    dtypes = [dtype_of(x) for x in vals]
    castable = [policy.is_castable(d) for d in dtypes]
    if rule is Rule.LOW:
        return [low if c else None for c in castable]
    if rule is Rule.FLOAT32:
        return [F32 if c else None for c in castable]
    if rule is Rule.WIDEST:
        strong = [
            (d, size(x))
            for x, d, c, w in zip(vals, dtypes, castable, weak)
            if c and (not w or _constants.starts_a_sum(scope, eqn, x))
        ]
        if lean and strong:
            # The largest operand (the activation) sets the precision: a float32
            # bias, scale or per-row statistic does not widen a [B, T, D] tensor.
            largest = _largest([n for _, n in strong])
            strong = [(d, n) for d, n in strong if not fewer(n, largest)]
        strong = [d for d, _ in strong]
        target = policy.widest(strong) or policy.widest(d for d, c in zip(dtypes, castable) if c)
        if target in policy.LOW_DTYPES and any(
            w and not _constants.fits(scope, x, target) for x, w in zip(vals, weak)
        ):
            # A constant the low dtype cannot hold (``h / 1e5`` in float16): the
            # operation runs in float32 rather than divide by inf, 65504 or 0.
            target = F32
        return [target if c else None for c in castable]
    if rule is Rule.ORIGINAL:
        return [
            v.aval.dtype if c and policy.is_castable(v.aval.dtype) else None
            for v, c in zip(eqn.invars, castable)
        ]
    return [None] * len(vals)


def policy_rule(ctx, eqn, vals, weak):
    """The rule of every primitive without one in `HIGHER_ORDER`: cast, then bind."""
    low = ctx.region.dtype
    if eqn.primitive.name == "convert_element_type":
        return _convert_rule(ctx, eqn, vals, weak)
    lean = ctx.region.lean
    rule = Rule.ORIGINAL if low is None else policy.equation_rule(eqn, lean=lean)
    if rule is not Rule.ORIGINAL and not lean and id(eqn) in ctx.max_shifts:
        rule = Rule.FLOAT32  # the shift of a softmax, part of its exp (`_shifts.max_shifts`)
    if rule is Rule.LOW and lean and eqn.primitive.name == "gather":
        # An embedding's table is a parameter; other gathers (a quantile's, of
        # sorted values) read data, which rounding would move (past 65504, to inf).
        table = fusions.parameters(ctx, eqn, vals, among=ctx.tables)[0]  # `Context.tables`
        rule = rule if table is not None else Rule.AS_RECEIVED
    if rule is Rule.LOW and _products.runs_as_written(eqn, vals):
        rule = Rule.ORIGINAL
    if rule is Rule.LOW and not _constants.scales_fit(ctx.scope, vals, weak, low):
        rule = Rule.ORIGINAL  # a constant operand 16 bits would saturate or flush
    if rule is not Rule.ORIGINAL and not _constants.fill_fits(eqn, low):
        rule = Rule.ORIGINAL
    if lean and rule is Rule.FLOAT32 and any(dtype_of(x) in policy.LOW_DTYPES for x in vals):
        return _float32_inside(ctx, eqn, vals, low)
    vals = fusions.residual_operands(ctx, eqn, vals, weak)
    targets = _targets(rule, eqn, vals, weak, low, lean, ctx.scope)
    if fusions.joins_product(ctx, eqn, vals, weak):
        outs = fusions.bias_add(ctx, eqn, vals)
        if outs is not None:
            return outs
        targets = [low if t is not None else None for t in targets]
    if low is not None and _sums_in_float32(ctx.region, eqn.primitive.name):
        outs = _float32_sums(eqn, vals, targets, ctx, weak)
        if outs is not None:
            return outs
    clamp = lean and rule is Rule.WIDEST  # a float32 operand outvoted: its mask fills saturated
    if low is not None and eqn.primitive.name in policy.IMPLICIT_BROADCAST:
        outs = _broadcast_in_float32(ctx, eqn, vals, targets, weak, clamp)
        if outs is not None:
            return outs
    if low is not None and rule is Rule.WIDEST:  # `mpjax._pointwise`
        # A 16-bit operand widened, kept as it is; a constant 16 bits would round
        # (lean rounds it, as Flax's dtype= does) or saturate, computed in float32.
        lone = ctx.lone.get(id(eqn), ())
        outs = None if lean else _pointwise.widened(eqn, vals, targets, weak, lone, ctx.rematted)
        outs = outs or _pointwise.by_constant(ctx.scope, eqn, vals, targets, weak, lean)
        if outs is not None:
            return outs
    args = _cast_all(ctx, vals, targets, weak, clamp)
    updates = {}
    if rule is Rule.LOW:
        if _products.unreduced(eqn):  # summed across devices next: in float32
            return _products.unreduced_product(eqn, vals, low)
        if _products.explicit_result_type(eqn):
            return _compat.bind(eqn, *args)
        if _float32_accumulator(ctx, eqn, vals):
            return _low_product_float32_accumulator(ctx, eqn, vals, args, low)
        preferred = eqn.params.get("preferred_element_type")
        if preferred is not None and policy.is_castable(preferred):
            updates["preferred_element_type"] = low
    if "update_jaxpr" in eqn.params and args and dtype_of(args[0]) != eqn.invars[0].aval.dtype:
        updates.update(_compat.retype_scalar_jaxpr(eqn.params, dtype_of(args[0])))
    outs = _BIND.get(eqn.primitive.name, _compat.bind)(eqn, *args, **updates)
    return fusions.constant_broadcast(ctx, eqn, args, outs)


def _float32_accumulator(ctx, eqn, vals) -> bool:
    """Whether a low-precision product keeps a float32 result: one of its inputs
    is a float32 argument (a weight), so its transpose is a float32 gradient.
    A float32 activation (attention probabilities) gets no float32 result: its
    cotangent is 16-bit, as the product's other operand's is."""
    return (
        not ctx.region.reduce_low
        and eqn.primitive.name in policy.FLOAT32_ACCUMULATOR
        and any(p is not None for p in fusions.parameters(ctx, eqn, vals))
        and _products.product_of(eqn) is not None
    )


def _low_product_float32_accumulator(ctx, eqn, vals, args, low):
    """The product of a float32 parameter in `low`: its float32 accumulator
    rounded to `low`, or a product returning `low` where no reader takes the
    accumulator (`mpjax.fusions.Fusions.accumulated`).

    The forward value is what a low-precision product gives (16-bit operands,
    float32 accumulation, one rounding). The backward products multiply 16-bit
    cotangents and operands, and the parameter's gradient is a float32 sum over
    the batch, never rounded, which data-parallel jit all-reduces in float32
    (`mpjax._products`).
    """
    # Where no reader takes the accumulator, the product returns its 16-bit
    # rounding itself: a GPU product then writes 16 bits, not float32 and a
    # rounding kernel after it (a cuBLAS call cannot round its float32 result).
    accumulated = id(eqn) in ctx.accumulated
    out = _products.low_product(
        args[:2],
        fusions.parameters(ctx, eqn, vals)[:2],
        _products.product_of(eqn),
        low,
        extra=tuple(args[2:]),  # a ragged product's group sizes
        recast=ctx.scope.parent is None,  # in a loop body the cast is hoisted: keep it
        result=F32 if accumulated else low,
    )
    if not accumulated:  # a bias add widens the rounding (`mpjax.fusions.bias_add`),
        # through the scope's casts: one widening for every float32 reader
        ctx.scope.keep_accumulator(out, lambda: ctx.scope.cast(out, F32))
        return [out]
    rounded = convert(out, low, False)
    ctx.scope.keep_accumulator(rounded, out)  # for a bias added next
    return [rounded]


def _sums_in_float32(region, name) -> bool:
    """Whether `name` runs at float32 when the policy would run it in 16 bits: it is
    in `policy.FLOAT32_SUMS`, and not a collective left in 16 bits by
    ``reduce_dtype=dtype``."""
    return name in policy.FLOAT32_SUMS and not (
        region.reduce_low and name in policy.COLLECTIVE_SUMS
    )


# How the primitives of `policy.SUMMED_BY_AUTODIFF` get float32 derivatives.
# Those linear in their floating inputs run on 16-bit values as they are, with a
# custom JVP at float32 (`_pointwise.float32_tangent`): no convert in the forward pass.
_LINEAR = frozenset({
    "broadcast_in_dim", "tile", "gather", "pad", "all_gather", "all_gather_invariant", "pvary",
})  # fmt: skip
# reduce_max and reduce_min too, with JAX's JVP rule taken at float32.
_CHOOSERS = frozenset({"reduce_max", "reduce_min"})
# The others run at float32 and round back; these keep a function of their operand
# for the backward pass (a max-pool's), so they run inside a `jax.checkpoint`,
# which keeps the 16-bit operand rather than a float32 copy.
_KEEP_OPERAND = frozenset({"reduce_window_max", "reduce_window_min", "select_and_gather_add"})


def _float32_sums(eqn, vals, targets, ctx, weak):
    """A primitive of `policy.FLOAT32_SUMS` that the policy would run on 16-bit
    values: its sums, forward or in its derivatives, made in float32.

    Each floating input runs in its target dtype (its own if none). If any of
    those is 16-bit, the primitive runs at float32 on the same values (the
    16-bit inputs upcast, exactly) and the results that would have been 16-bit
    are rounded to that dtype, but for a sum over devices (`policy.DEVICE_SUMS`).
    A float32 value that the policy would round to 16 bits (an embedding table,
    lean policy) is used as it is where the primitive does no arithmetic, since
    rounding commutes with moving values: the table's gradient then stays float32
    all the way. Linear primitives and reduce_max/min on 16-bit values run as they
    are, with a float32 JVP. Returns None when nothing runs in 16 bits, or no sum
    would be made."""
    runs_in = [t if t is not None else dtype_of(x) for x, t in zip(vals, targets)]
    is_low = [_is_low(d) for d in runs_in]
    lows = {np.dtype(d) for d, b in zip(runs_in, is_low) if b}
    positional = eqn.primitive.multiple_results and len(eqn.outvars) == len(vals)
    if not lows or (len(lows) > 1 and not positional):
        return None  # nothing in 16 bits, or 16-bit inputs of two kinds
    if _derivatives_sum_nothing(eqn, vals, weak):
        return None
    exact = eqn.primitive.name in policy.SUMMED_BY_AUTODIFF
    args = [
        x if t is None or (b and exact and dtype_of(x) == F32) else ctx.scope.cast(x, t, w)
        for x, t, w, b in zip(vals, targets, weak, is_low)
    ]
    device_sum = eqn.primitive.name in policy.DEVICE_SUMS and not ctx.region.lean
    if device_sum or id(eqn) in ctx.float32_sums:  # or a mean's sum (`fusions.find`)
        rounds_to = [None] * len(eqn.outvars)
    elif positional:  # each result has its input's dtype (psum, pvary of several values)
        rounds_to = [d if b else None for d, b in zip(runs_in, is_low)]
    else:
        rounds_to = [next(iter(lows))] * len(eqn.outvars)
    updates = {}
    if "update_jaxpr" in eqn.params and eqn.invars[0].aval.dtype != F32:
        updates = _compat.retype_scalar_jaxpr(eqn.params, F32)  # a scatter's combiner

    def compute(*xs):
        xs = [convert(x, F32, False) if dtype_of(x) in policy.LOW_DTYPES else x for x in xs]
        outs = _compat.bind(eqn, *xs, **updates)
        return [
            o if d is None or dtype_of(o) != F32 else convert(o, d, False)
            for o, d in zip(outs, rounds_to)
        ]

    if eqn.primitive.name in _LINEAR | _CHOOSERS and all(
        _is_low(dtype_of(a)) for a, b in zip(args, is_low) if b
    ):  # the forward pass as it is; only the derivative at float32
        primal = lambda *xs: _compat.bind(eqn, *xs)  # noqa: E731
        if eqn.primitive.name in _CHOOSERS:
            chooser = _pointwise.chooser_float32_tangent(lambda x: primal(x)[0], eqn.params["axes"])
            return [chooser(*args)]
        return list(float32_tangent(primal, compute)(*args))
    if eqn.primitive.name in _KEEP_OPERAND:
        return list(_pointwise.recomputed(compute, ctx.rematted)(*args))
    return compute(*args)


def _derivatives_sum_nothing(eqn, vals, weak) -> bool:
    """Constants (literals, values computed from literals alone), a broadcast
    that only adds axes of size 1, a pad with a constant padding value: their
    derivatives sum nothing."""
    if eqn.primitive.name in policy.SUMMED_BY_AUTODIFF and all(
        w or is_concrete(x) for x, w in zip(vals, weak) if policy.is_castable(dtype_of(x))
    ):
        return True
    if eqn.primitive.name == "broadcast_in_dim":
        return size(vals[0]) == size(eqn.outvars[0].aval)
    if eqn.primitive.name == "pad":  # only the padding value's cotangent is a sum
        return weak[1] or is_concrete(vals[1])
    return False


def _is_low(dtype) -> bool:
    return policy.is_castable(dtype) and np.dtype(dtype) in policy.LOW_DTYPES


def _broadcast_in_float32(ctx, eqn, vals, targets, weak, clamp=False):
    """An elementwise primitive whose 16-bit operand it would broadcast implicitly:
    that operand is broadcast explicitly (sharded as the result), with its tangent
    broadcast at float32 (`_pointwise.float32_tangent`), and the primitive bound. None if none.

    The transpose of an implicit broadcast sums the cotangent in the operand's dtype;
    that of a broadcast of a float32 tangent sums in float32. A float32 value that the
    policy rounds (a bias, lean policy) is rounded while small, and its gradient stays
    float32. Constants have no cotangent and are left alone. Unless the primitive
    is linear (add, sub), it is rematerialized with the broadcast.
    """
    shape, sharded = eqn.outvars[0].aval.shape, explicit_sharding(eqn.outvars[0].aval)
    broadcast = functools.partial(jax.lax.broadcast_in_dim, shape=shape, out_sharding=sharded)
    widen = {}  # operand index -> the 16-bit dtype it is broadcast to
    for i, (x, t, w) in enumerate(zip(vals, targets, weak)):
        runs_in = t if t is not None else dtype_of(x)
        literal = is_concrete(x)
        if not (w or literal or np.shape(x) == shape) and _is_low(runs_in):
            widen[i] = np.dtype(runs_in)
    if not widen:
        return None
    args = [
        x if i in widen or t is None else ctx.scope.cast(x, t, w, clamp)
        for i, (x, t, w) in enumerate(zip(vals, targets, weak))
    ]

    def compute(*xs):
        xs = list(xs)
        for i, low in widen.items():
            dims = tuple(range(np.ndim(xs[i])))

            def primal(v, low=low, dims=dims):  # rounded (`Scope.cast`), then broadcast
                sat = clamp and dtype_of(v) == F32
                return [broadcast(convert(v, low, False, sat), broadcast_dimensions=dims)]

            def tangent(t, low=low, dims=dims):  # broadcast at float32, then rounded
                t = broadcast(convert(t, F32, False), broadcast_dimensions=dims)
                return [convert(t, low, False)]

            (xs[i],) = float32_tangent(primal, tangent)(xs[i])
        return _BIND.get(eqn.primitive.name, _compat.bind)(eqn, *xs)

    if eqn.primitive.name not in ("add", "sub"):
        compute = _pointwise.recomputed(compute, ctx.rematted)
    return list(compute(*args))


def _float32_inside(ctx, eqn, vals, low):
    """Lean policy: a float32-list primitive on low-precision inputs.

    It computes in float32 and hands `low` on, unless every reader is a float32-list
    primitive too (``log1p(exp(x))`` stays float32 throughout). An elementwise
    primitive is rematerialized, so its backward pass keeps only the low-precision
    input, not float32 copies: the residuals of the hand-cast model. Every reader
    widens the same float32 copy (`Scope.cast`), so that their cotangents add in
    float32 and round once: a norm's ``mean(x * x) - mean(x) ** 2`` on values around
    50 cancels two terms 50 times its result. A reduction's output is smaller than
    its input, so it stays float32; so does a running sum's (`cumsum`), whose later
    elements 16 bits would round as a sum of 16-bit terms.
    """
    in_size = _largest([size(x) for x in vals])
    reduces = all(fewer(size(v.aval), in_size) for v in eqn.outvars)
    running = eqn.primitive.name in policy.RUNNING_SUMS
    keep_f32 = reduces or running or all(v in ctx.float32_only for v in eqn.outvars)

    # A 16-bit result of the program (user's float16 in a bfloat16 region) stays so.
    hand_on = [v.aval.dtype if v.aval.dtype in policy.LOW_DTYPES else low for v in eqn.outvars]
    widened = [ctx.scope.cast(x, F32) if dtype_of(x) in policy.LOW_DTYPES else x for x in vals]

    def compute(*xs):
        outs = _compat.bind(eqn, *xs)
        return outs if keep_f32 else [convert(o, d, False) for o, d in zip(outs, hand_on)]

    if reduces:  # linear: nothing float32 is kept for the backward pass anyway
        return compute(*widened)
    return _pointwise.derived_from(compute, widened, vals, ctx.rematted)


def _convert_rule(ctx, eqn, vals, weak):
    """User casts are respected; dtype-preserving converts are weak-type strips."""
    (x,) = vals
    original_in = eqn.invars[0].aval.dtype
    new_dtype = np.dtype(eqn.params["new_dtype"])
    if ctx.region.dtype is None:
        return _compat.bind(
            eqn, *_cast_all(ctx, vals, _targets(Rule.ORIGINAL, eqn, vals, weak, None), weak)
        )
    if new_dtype == original_in or dtype_of(x) == new_dtype:
        # A reshard (``jnp.astype(x, t, device=...)``) keeps its sharding, at x's dtype.
        resharded = eqn.params.get("sharding") is not None
        return _compat.bind(eqn, x, new_dtype=dtype_of(x)) if resharded else [x]
    return _compat.bind(eqn, x)


def _largest(sizes):
    """The largest of `sizes`; of symbolic sizes that cannot be ordered, the first."""
    return functools.reduce(lambda out, n: n if fewer(out, n) else out, sizes)


def _cast_all(ctx, vals, targets, weak, clamp=False) -> list:
    """Each value cast to its target dtype (None: left as it is), through the scope."""
    cast = ctx.scope.cast
    return [x if t is None else cast(x, t, w, clamp) for x, t, w in zip(vals, targets, weak)]
