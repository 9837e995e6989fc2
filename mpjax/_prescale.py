"""A product scaled by a constant: the power of two of the scale moved onto its operands.

Attention's logits are written ``(q @ k.T) * scale`` (``jax.nn.dot_product_attention``,
``scale = 1 / sqrt(head_dim)``) or ``... / sqrt(head_dim)``. In 16 bits the
product is rounded before it is scaled, so a raw ``q . k`` past 65504 is inf in
float16 where the scaled logit is not, and the softmax is NaN: every step skipped,
the loss scale driven to its floor. JAX's own attention avoids it by keeping
float32 logits for 16-bit inputs, torch's by scaling ``q`` and ``k`` by
``sqrt(scale)`` before the product. Here ``scale = m * 2**e`` is split: ``2**e``
multiplies the operands (half each, at most 2**-3 each, `_SHARE`), and what is
left (``m``, in [1, 2), or a divisor in (0.5, 1], times what the operands could
not take) stays where it was, dropped where it is 1. The scale is a number the
program knows before it runs: a literal, a constant it closes over, or one it
computes from those (``jnp.sqrt(head_dim)``); of a computed one, its own value,
times the power of two, stays. A power of two is exact in
every float format, so the result is the one the product gives as written, bit
for bit, wherever that is finite and above float16's subnormals (under jit, XLA
may then skip a rounding the scale kept: docs/policy.md); the 16-bit result it
rounds is no larger than the scaled one, so it overflows only where that does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import _compat, _constants, _products, fusions, policy
from mpjax._casting import F32, convert, dtype_of, fewer, is_concrete
from mpjax.fusions import _is_var
from mpjax.policy import Rule

_SCALES = ("mul", "div")

_LOWEST = -6
"""The smallest power of two moved (an attention scale down to 1/64); a smaller
scale is left where it is."""

_SHARE = -3
"""The most one operand is scaled by, 2**-3: more would take its small values into
float16's subnormals, and would cost the backward product of the cotangent and the
other operand more headroom (it carries what the forward one lost)."""


# Scalar arithmetic a scale is computed with (``jnp.sqrt(head_dim)``), evaluated
# at trace time: only the power of two is taken from the value, the program
# computes its own.
_NUMBERS = frozenset({
    "convert_element_type", "sqrt", "rsqrt", "integer_pow", "pow", "mul", "div", "neg",
})  # fmt: skip


def constants(jaxpr, consts=()) -> dict:
    """``{var: value}`` of the floating scalars of `jaxpr` known before it runs:
    its constants, and what `_NUMBERS` computes from them and from literals."""
    known = {
        v: np.asarray(c)
        for v, c in zip(jaxpr.constvars, consts)
        if v.aval.shape == ()
        and jnp.issubdtype(v.aval.dtype, jnp.floating)  # not a PRNG key, say
        and not _compat.is_tracer(c)
    }
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _NUMBERS or len(eqn.outvars) != 1:
            continue
        out = eqn.outvars[0].aval
        values = [_value(v, known) for v in eqn.invars]
        if (
            out.shape == ()
            and np.dtype(out.dtype).kind == "f"
            and all(x is not None for x in values)
        ):
            exact = _constants.evaluate(eqn, values, [out])
            if exact is not None:
                known[eqn.outvars[0]] = exact[0]
    return known


def _value(v, known):
    return np.asarray(v.val) if not _is_var(v) else known.get(v)


def find(jaxpr, fused, known=None) -> dict[int, tuple[int, int]]:
    """``{index of a dot_general: (index of the equation scaling it, e)}``: the
    products read only by a multiplication, or a division, by a constant scalar
    below 1 (literal or `known`), whose power of two ``2**e`` can move onto their
    operands. Scales evaluated with a pointwise chain (`mpjax.fusions`) are left
    alone."""
    eqns = jaxpr.eqns
    known = constants(jaxpr) if known is None else known
    chained = set(fused.deferred) | set(fused.chains)
    scales = [
        (j, position)
        for j, eqn in enumerate(eqns)
        if eqn.primitive.name in _SCALES
        and j not in chained
        and (position := _constant_position(eqn, known)) is not None
    ]
    if not scales:  # most jaxprs: no reader counts to make
        return {}
    reads = readers(jaxpr, fused.observing)
    made_by = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    out = {}
    for j, position in scales:
        eqn = eqns[j]
        i = _product_of(eqn.invars[1 - position], eqns, made_by, reads)
        if i is None:
            continue
        constant = float(_value(eqn.invars[position], known))
        e = _exponent(constant if eqn.primitive.name == "mul" else 1 / constant)
        if e:
            out[i] = (j, e)
    return out


def _product_of(v, eqns, made_by, reads) -> int | None:
    """The index of the dot_general whose result `v` is, read once, through names
    (``checkpoint_name``) and converts that keep its dtype (a weak type made
    strong), each read once too; else None."""
    while _is_var(v) and reads[v] == 1 and (i := made_by.get(v)) is not None:
        eqn = eqns[i]
        if eqn.primitive.name == "dot_general":
            return i
        kept = eqn.primitive.name == "name" or (
            eqn.primitive.name == "convert_element_type"
            and eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype
        )
        if not kept:
            return None
        v = eqn.invars[0]
    return None


def readers(jaxpr, observing=frozenset()) -> Counter:
    """How many equations (and outputs) of `jaxpr` read each variable, those that
    only observe (`observing`, `mpjax._readers.observing`) not counted."""
    reads = Counter(
        v for i, e in enumerate(jaxpr.eqns) if i not in observing for v in e.invars if _is_var(v)
    )
    reads.update(v for v in jaxpr.outvars if _is_var(v))
    return reads


def _constant_position(eqn, known) -> int | None:
    """Where the scalar constant of a scale is (a divisor only), or None."""
    positions = (0, 1) if eqn.primitive.name == "mul" else (1,)
    for k in positions:
        value, other = _value(eqn.invars[k], known), eqn.invars[1 - k]
        if value is None or not _is_var(other) or other in known:
            continue
        if value.ndim == 0 and value.dtype.kind == "f" and np.isfinite(value) and value:
            return k
    return None


def _exponent(scale: float) -> int:
    """The largest ``e`` with ``2**e <= scale``, for a scale in [2**_LOWEST, 1); else 0."""
    if not (2.0**_LOWEST <= scale < 1.0):  # also NaN
        return 0
    _, e = math.frexp(scale)  # scale = mantissa * 2**e, mantissa in [0.5, 1)
    return e - 1


class Folds:
    """The rules of the products of one jaxpr evaluation whose scale moves, and of
    their scales. A product moves it only where it runs in 16 bits as the policy's
    own (`_moves`); its scale learns that from `moved`."""

    def __init__(self, jaxpr, fused, consts=()):
        self.eqns = jaxpr.eqns
        self.known = constants(jaxpr, consts) if jaxpr.eqns else {}
        self.products = find(jaxpr, fused, self.known)
        self.scales = {j: i for i, (j, _) in self.products.items()}
        reads = readers(jaxpr, fused.observing) if self.products else {}
        self.shared = {v for v, n in reads.items() if n > 1}
        """Read by more than one equation: scaled, a copy kept beside the value."""
        self.moved: dict[int, tuple] = {}
        """By product: (its region, the power of two its operands took)."""

    def rule(self, j: int, rule: Callable) -> Callable:
        """The rule of the `j`-th equation: `rule`, or one moving a scale."""
        if j in self.products:
            return lambda ctx, eqn, vals, weak: self._product(j, rule, ctx, eqn, vals, weak)
        if j in self.scales:
            return lambda ctx, eqn, vals, weak: self._scale(j, rule, ctx, eqn, vals, weak)
        return rule

    def observed(self, v, value):
        """What an observer (`mpjax._readers.observing`) reads of `v`, whose value the
        program holds: a product whose operands took a power of two, widened to
        float32 and without it (finite where the scaled result is); else `value`."""
        for j, (_, e) in self.moved.items():
            if self.eqns[j].outvars[0] is v:
                return lax.mul(convert(value, F32, False), np.float32(2.0**-e))
        return value

    def _product(self, j, rule, ctx, eqn, vals, weak):
        if not _moves(ctx, eqn, vals):
            return rule(ctx, eqn, vals, weak)
        shared = [_is_var(v) and v in self.shared for v in eqn.invars[:2]]
        shares = _shares(self.products[j][1], ctx, eqn, vals, shared)
        if not any(shares):
            return rule(ctx, eqn, vals, weak)
        self.moved[j] = (ctx.region, sum(shares))
        scaled = [_times(ctx, x, 2.0**k) if k else x for x, k in zip(vals[:2], shares)]
        return rule(ctx, eqn, [*scaled, *vals[2:]], weak)

    def _scale(self, j, rule, ctx, eqn, vals, weak):
        i = self.scales[j]
        if i not in self.moved:
            return rule(ctx, eqn, vals, weak)
        region, e = self.moved[i]
        k = _constant_position(eqn, self.known)
        power = 2.0 ** (-e if eqn.primitive.name == "mul" else e)
        vals = list(vals)
        if _is_var(eqn.invars[k]):  # computed: its own value, exactly times the power
            vals[k] = _times(ctx, vals[k], power)
            return rule(ctx, eqn, vals, weak)
        constant = np.asarray(vals[k])
        rest = constant * power
        if rest == 1 and ctx.region == region and not region.lean:
            return [vals[1 - k]]  # its rule would multiply the 16-bit result by 1
        vals[k] = np.asarray(rest, constant.dtype)
        return rule(ctx, eqn, vals, weak)


def _times(ctx, x, power):
    """`x` times `power`, a power of two; a constant's values known as `x`'s are
    (whether the low dtype holds them decides how its product runs)."""
    factor = np.asarray(power, dtype_of(x))
    product = x * factor if is_concrete(x) else lax.mul(x, factor)
    _constants.record_times(ctx.scope, x, power, product)
    return product


def _moves(ctx, eqn, vals) -> bool:
    """Whether `eqn`, a product, runs in the low dtype by the policy's own rule,
    rounding its result to 16 bits: not where the user fixed its precision, nor
    where a reader takes its float32 accumulator (`mpjax.fusions`)."""
    low = ctx.region.dtype
    return (
        low is not None
        and policy.equation_rule(eqn, lean=ctx.region.lean) is Rule.LOW
        and all(dtype_of(x) in (F32, low) for x in vals[:2])
        and not _products.runs_as_written(eqn, vals)
        and not _products.explicit_result_type(eqn)
        and not _products.unreduced(eqn)
        and id(eqn) not in ctx.accumulated
    )


def _shares(e: int, ctx, eqn, vals, shared) -> tuple[int, int]:
    """The powers of two multiplying each operand, ``2**e`` in all where each can
    take its half, at most 2**-3 each (`_SHARE`): half each, or all of it on an
    operand that is neither `shared` (read elsewhere too, as a layer's input is
    by its query, key and value projections: the scaled copy would be kept beside
    it for the backward pass) nor a parameter. A parameter scaled would be a
    float32 copy the backward pass keeps, where it makes the parameter's 16-bit
    cast again from the parameter itself (`mpjax._products`); where both are
    (attention on the arguments of the function autocast wraps), the smaller.
    (0, 0) where neither can take it: the scale stays where it is."""
    params = [p is not None for p in fusions.parameters(ctx, eqn, vals[:2])]
    free = [not (p or s) for p, s in zip(params, shared)]
    if all(free):
        return max(e - e // 2, _SHARE), max(e // 2, _SHARE)
    if not any(free):
        if any(shared):
            return 0, 0
        larger = fewer(np.size(vals[1]), np.size(vals[0]))  # symbolic sizes too
        free = [not larger, larger]
    return (max(e, _SHARE), 0) if free[0] else (0, max(e, _SHARE))
