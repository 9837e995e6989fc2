"""The rule of every first-order primitive: the policy tables applied to its inputs.

A primitive with no rule of its own in `mpjax.interpreter.HIGHER_ORDER` is bound
again on its inputs cast as `mpjax.policy` says (`policy_rule`). Two cases compute
in one precision and hand on another: under the lean policy, a float32-list
primitive on 16-bit inputs (`_float32_inside`); and a 16-bit product with a
float32 input, whose result stays float32 for its gradient
(`_low_product_float32_accumulator`).

`ctx` below is the interpreter's `Context`. This module sits below the
interpreter (which imports it), so it reads the context without importing its type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat
from mpjax import policy
from mpjax._casting import F32, convert, dtype_of
from mpjax.policy import Rule


def _targets(rule: Rule, eqn, vals, weak, low, lean=False) -> list:
    """The dtype each input is cast to (None: left as it is)."""
    dtypes = [dtype_of(x) for x in vals]
    castable = [policy.is_castable(d) for d in dtypes]
    if rule is Rule.LOW:
        return [low if c else None for c in castable]
    if rule is Rule.FLOAT32:
        return [F32 if c else None for c in castable]
    if rule is Rule.WIDEST:
        strong = [
            (d, np.size(x)) for x, d, c, w in zip(vals, dtypes, castable, weak) if c and not w
        ]
        if lean and strong:
            # The largest operand (the activation) sets the precision: a float32
            # bias, scale or per-row statistic does not widen a [B, T, D] tensor.
            largest = max(n for _, n in strong)
            strong = [(d, n) for d, n in strong if n == largest]
        strong = [d for d, _ in strong]
        target = policy.widest(strong) or policy.widest(d for d, c in zip(dtypes, castable) if c)
        if target in policy.LOW_DTYPES and any(
            w and not _fits(x, target) for x, w in zip(vals, weak)
        ):
            # A literal the low dtype cannot hold (``h / 1e5`` in float16): the
            # operation runs in float32 rather than divide by inf or 65504.
            target = F32
        return [target if c else None for c in castable]
    if rule is Rule.ORIGINAL:
        return [
            v.aval.dtype if c and policy.is_castable(v.aval.dtype) else None
            for v, c in zip(eqn.invars, castable)
        ]
    return [None] * len(vals)


def _fits(x, dtype) -> bool:
    """Whether a literal's values are normal numbers (or 0, inf) in `dtype`."""
    if not isinstance(x, (np.ndarray, np.generic)) or not policy.is_castable(dtype_of(x)):
        return True  # traced values: unknown, and saturated when cast (see Scope.cast)
    info = jnp.finfo(dtype)
    magnitude = np.abs(np.asarray(x, np.float64))
    finite = magnitude[np.isfinite(magnitude)]
    return bool(
        np.all(
            (finite == 0) | ((finite >= float(info.smallest_normal)) & (finite <= float(info.max)))
        )
    )


def policy_rule(ctx, eqn, vals, weak):
    """The rule of every primitive without one in `HIGHER_ORDER`: cast, then bind."""
    low = ctx.region.dtype
    if eqn.primitive.name == "convert_element_type":
        return _convert_rule(ctx, eqn, vals, weak)
    lean = ctx.region.lean
    rule = Rule.ORIGINAL if low is None else policy.rule_for(eqn.primitive.name, lean=lean)
    if lean and rule is Rule.FLOAT32 and any(dtype_of(x) in policy.LOW_DTYPES for x in vals):
        return _float32_inside(ctx, eqn, vals, low)
    args = _cast_all(ctx, vals, _targets(rule, eqn, vals, weak, low, lean), weak)
    updates = {}
    if rule is Rule.LOW:
        if _explicit_result_type(eqn):
            return _compat.bind(eqn, *args)
        if _float32_accumulator(ctx.region, eqn, vals):
            return _low_product_float32_accumulator(eqn, args, low)
        preferred = eqn.params.get("preferred_element_type")
        if preferred is not None and policy.is_castable(preferred):
            updates["preferred_element_type"] = low
    if "update_jaxpr" in eqn.params and args and dtype_of(args[0]) != eqn.invars[0].aval.dtype:
        updates.update(_compat.retype_scalar_jaxpr(eqn.params, dtype_of(args[0])))
    return _compat.bind(eqn, *args, **updates)


def _explicit_result_type(eqn) -> bool:
    """Whether a product's `preferred_element_type` was asked for by the user.

    jnp sets it to the inputs' promoted dtype, which autocast replaces by the low
    dtype. Any other value (float16 operands accumulated into a float32 result)
    was written explicitly, and is kept: the operands still go to the low dtype.
    """
    preferred = eqn.params.get("preferred_element_type")
    if preferred is None or not policy.is_castable(preferred):
        return False
    default = policy.widest(v.aval.dtype for v in eqn.invars[:2])
    return np.dtype(preferred) != default


def _float32_accumulator(region, eqn, vals) -> bool:
    """Whether a low-precision product keeps a float32 result: one of its inputs
    is float32 (a weight), so its transpose is a float32 gradient."""
    return (
        not region.reduce_low
        and eqn.primitive.name in policy.FLOAT32_ACCUMULATOR
        and any(dtype_of(x) == F32 for x in vals)
    )


def _low_product_float32_accumulator(eqn, args, low):
    """The product of low-precision `args` with a float32 result, rounded to `low`.

    The forward value is what a low-precision product gives (16-bit operands,
    float32 accumulation, one rounding). What changes is the backward pass: JAX
    transposes the product at its float32 result type, so the weight gradient is
    a float32 sum over the batch, and data-parallel jit all-reduces it in float32
    (jax#27496). On GPUs an explicit dot algorithm keeps those backward products
    on 16-bit tensor cores, their float32 cotangent being exact in 16 bits.
    """
    updates = {"preferred_element_type": F32}
    algorithm = _compat.low_precision_dot_algorithm(low)
    if algorithm is not None and _compat.is_default_precision(eqn.params.get("precision")):
        updates["precision"] = algorithm
    return [convert(o, low, False) for o in _compat.bind(eqn, *args, **updates)]


def _float32_inside(ctx, eqn, vals, low):
    """Lean policy: a float32-list primitive on low-precision inputs.

    It computes in float32 and hands `low` on, unless every reader is a
    float32-list primitive too (``log1p(exp(x))`` stays float32 throughout). An
    elementwise primitive is rematerialized, so its backward pass keeps only the
    low-precision input, not float32 copies: the residuals of the hand-cast model.
    A reduction's output is smaller than its input, so it stays float32.
    """
    in_size = max(np.size(x) for x in vals)
    reduces = all(np.prod(v.aval.shape, dtype=int) < in_size for v in eqn.outvars)
    keep_f32 = reduces or all(v in ctx.float32_only for v in eqn.outvars)

    def compute(*xs):
        xs = [convert(x, F32, False) if dtype_of(x) in policy.LOW_DTYPES else x for x in xs]
        outs = _compat.bind(eqn, *xs)
        return outs if keep_f32 else [convert(o, low, False) for o in outs]

    if reduces:  # linear: nothing float32 is kept for the backward pass anyway
        return compute(*vals)
    return list(jax.checkpoint(compute, prevent_cse=False)(*vals))


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
        return [x]
    return _compat.bind(eqn, x)


def _cast_all(ctx, vals, targets, weak) -> list:
    """Each value cast to its target dtype (None: left as it is), through the scope."""
    return [x if t is None else ctx.scope.cast(x, t, w) for x, t, w in zip(vals, targets, weak)]


def float32_only_consumers(jaxpr) -> frozenset:
    """The variables whose every reader is a float32-list primitive."""
    readers: dict = {}
    for eqn in jaxpr.eqns:
        rule = policy.rule_for(eqn.primitive.name)
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                readers.setdefault(v, set()).add(rule)
    for v in jaxpr.outvars:
        if not isinstance(v, _compat.Literal):
            readers.setdefault(v, set()).add(None)
    return frozenset(v for v, rules in readers.items() if rules == {Rule.FLOAT32})
