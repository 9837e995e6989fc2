"""`autocast`: re-evaluates a traced program under the precision policy.

The wrapped function is traced to a jaxpr, and the jaxpr is evaluated equation by
equation, binding each primitive again on inputs cast as `mpjax.policy` says.
Because the evaluation binds ordinary primitives on whatever values it receives
(tracers included), the result composes with `jit`, `grad`, `vmap` and the rest.

Three pieces of state travel through the evaluation:

* a *region* (the low-precision dtype, or None where autocast is off), read from
  the name scopes that nested `autocast` calls leave on their equations;
* a *weak* flag per value: True for values computed from literals alone (``0.5``,
  the ``-1e9`` of an attention mask, ``jnp.arange``). Weak values never widen an
  operation, the way Python scalars do not widen a float16 array in JAX;
* a *scope* of casts already made, so that each value is cast to a dtype once per
  trace, and casts of loop-invariant values are hoisted out of loops.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import _compat
from mpjax import _nnx
from mpjax import policy
from mpjax import policy as policy_module  # `policy` is also autocast's argument
from mpjax.policy import Rule

_F32 = np.dtype(jnp.float32)
_MARKER = "mpjax_autocast_"
_MARKER_RE = re.compile(_MARKER + r"(off|float16|bfloat16)(_lean)?(_reduce_low)?")
POLICIES = ("torch", "lean")


class Region(NamedTuple):
    """The autocast setting in force: the low dtype (None when disabled), whether
    the memory-lean policy is on, and whether products of float32 values round
    their accumulator to the low dtype (``reduce_dtype=dtype``)."""

    dtype: np.dtype | None
    lean: bool = False
    reduce_low: bool = False

    @property
    def scope_name(self) -> str:
        if self.dtype is None:
            return _MARKER + "off"
        suffix = ("_lean" if self.lean else "") + ("_reduce_low" if self.reduce_low else "")
        return _MARKER + self.dtype.name + suffix


def region_of(eqn, outer: Region) -> Region:
    """The region an equation was traced in: the innermost autocast scope."""
    found = _MARKER_RE.findall(_compat.name_stack(eqn))
    if not found:
        return outer
    dtype, lean, reduce_low = found[-1]
    return Region(None if dtype == "off" else np.dtype(dtype), bool(lean), bool(reduce_low))


def dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _convert(x, dtype: np.dtype, saturate: bool):
    """Casts `x`; a saturating cast maps finite values out of range to +-max."""
    numpy_value = isinstance(x, (np.ndarray, np.generic))
    if saturate and jnp.finfo(dtype).max < jnp.finfo(dtype_of(x)).max:
        hi = jnp.finfo(dtype).max.astype(dtype_of(x))
        if numpy_value:  # a literal: keep its infinities
            x = np.where(np.isinf(x), x, np.clip(x, -hi, hi))
        else:  # computed from literals: one clamp, which XLA folds
            x = lax.clamp(-hi, x, hi)
    if numpy_value:
        return np.asarray(x).astype(dtype)
    return lax.convert_element_type(x, dtype)


class Scope:
    """The casts made in one trace, so each value is cast to a dtype once.

    A loop body gets a child scope. Its `invariant` values are the loop's
    constants, which the body sees by closure: a cast of one is recorded in
    `requests`, so the loop rule can make it once outside the loop instead.
    """

    def __init__(self, parent: Scope | None = None, invariant=()):
        self.parent = parent
        self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}
        self._invariant = {id(v) for v in invariant}
        self.requests: list[tuple[Any, np.dtype, bool]] = []

    def seed(self, x, dtype, cast_x) -> None:
        self._casts[(id(x), np.dtype(dtype))] = (x, cast_x)

    def cast(self, x, dtype, weak: bool = False):
        if dtype_of(x) == dtype:
            return x
        dtype = np.dtype(dtype)
        key = (id(x), dtype)
        scope = self
        while scope is not None:
            if key in scope._casts:
                return scope._casts[key][1]
            scope = scope.parent
        if key[0] in self._invariant:
            self.requests.append((x, dtype, weak))
        # Weak values are constants the user wrote for float32 (a -1e9 mask):
        # saturate them rather than overflow to inf in float16.
        y = _convert(x, dtype, saturate=weak)
        self._casts[key] = (x, y)  # the key's object is kept alive with its id
        return y


class Context(NamedTuple):
    region: Region
    scope: Scope
    float32_only: frozenset = frozenset()
    """Lean policy: the variables read only by float32-list primitives."""

    def child(self, invariant=()) -> Context:
        return self._replace(scope=Scope(self.scope, invariant))


# --------------------------------------------------------------------------
# Evaluation


def eval_jaxpr(ctx: Context, jaxpr, consts, args, weak) -> tuple[list, list[bool]]:
    """Evaluates `jaxpr` on `args` under `ctx`; returns outputs and weak flags."""
    env: dict = {}

    def read(v):
        if isinstance(v, _compat.Literal):
            return np.asarray(v.val, dtype=v.aval.dtype), True
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = (c, False)
    for v, a, w in zip(jaxpr.invars, args, weak, strict=True):
        env[v] = (a, w)
    if ctx.region.lean:
        ctx = ctx._replace(float32_only=_float32_only_consumers(jaxpr))
    for eqn in jaxpr.eqns:
        vals, weaks = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
        eqn_ctx = ctx._replace(region=region_of(eqn, ctx.region))
        rule = HIGHER_ORDER.get(eqn.primitive.name, _first_order)
        try:
            with _compat.equation_context(eqn):
                outs = rule(eqn_ctx, eqn, list(vals), list(weaks))
        except Exception as e:
            if not getattr(e, "_mpjax_noted", False):
                e.add_note(
                    f"(mpjax.autocast, while evaluating `{eqn.primitive.name}` "
                    f"from {_compat.user_frame(eqn)})"
                )
                e._mpjax_noted = True
            raise
        out_weak = all(weaks)
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = (o, out_weak)
    return [list(t) for t in zip(*map(read, jaxpr.outvars))] if jaxpr.outvars else ([], [])


def _float32_only_consumers(jaxpr) -> frozenset:
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


def _eval_closed(ctx: Context, closed, args, weak):
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    return eval_jaxpr(ctx, jaxpr, consts, args, weak)


# --------------------------------------------------------------------------
# First-order primitives: the policy tables


def _targets(rule: Rule, eqn, vals, weak, low, lean=False) -> list:
    """The dtype each input is cast to (None: left as it is)."""
    dtypes = [dtype_of(x) for x in vals]
    castable = [policy.is_castable(d) for d in dtypes]
    if rule is Rule.LOW:
        return [low if c else None for c in castable]
    if rule is Rule.FLOAT32:
        return [_F32 if c else None for c in castable]
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
            target = _F32
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


def _first_order(ctx: Context, eqn, vals, weak):
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
        if _float32_accumulator(ctx.region, eqn, vals):
            return _low_product_float32_accumulator(eqn, args, low)
        preferred = eqn.params.get("preferred_element_type")
        if preferred is not None and policy.is_castable(preferred):
            updates["preferred_element_type"] = low
    if "update_jaxpr" in eqn.params and args and dtype_of(args[0]) != eqn.invars[0].aval.dtype:
        updates.update(_compat.retype_scalar_jaxpr(eqn.params, dtype_of(args[0])))
    return _compat.bind(eqn, *args, **updates)


def _float32_accumulator(region: Region, eqn, vals) -> bool:
    """Whether a low-precision product keeps a float32 result: one of its inputs
    is float32 (a weight), so its transpose is a float32 gradient."""
    return (
        not region.reduce_low
        and eqn.primitive.name in policy.FLOAT32_ACCUMULATOR
        and any(dtype_of(x) == _F32 for x in vals)
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
    updates = {"preferred_element_type": _F32}
    algorithm = _compat.low_precision_dot_algorithm(low)
    if algorithm is not None and _compat.is_default_precision(eqn.params.get("precision")):
        updates["precision"] = algorithm
    return [_convert(o, low, False) for o in _compat.bind(eqn, *args, **updates)]


def _float32_inside(ctx: Context, eqn, vals, low):
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
        xs = [_convert(x, _F32, False) if dtype_of(x) in policy.LOW_DTYPES else x for x in xs]
        outs = _compat.bind(eqn, *xs)
        return outs if keep_f32 else [_convert(o, low, False) for o in outs]

    if reduces:  # linear: nothing float32 is kept for the backward pass anyway
        return compute(*vals)
    return list(jax.checkpoint(compute, prevent_cse=False)(*vals))


def _convert_rule(ctx: Context, eqn, vals, weak):
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


def _cast_all(ctx: Context, vals, targets, weak) -> list:
    """Each value cast to its target dtype (None: left as it is), through the scope."""
    return [x if t is None else ctx.scope.cast(x, t, w) for x, t, w in zip(vals, targets, weak)]


# --------------------------------------------------------------------------
# Higher-order primitives


def _inline_call(ctx: Context, eqn, vals, weak):
    """A nested jit is inlined, so its casts share the caller's scope."""
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    with jax.named_scope(eqn.params.get("name", eqn.primitive.name)):
        outs, _ = _eval_closed(ctx, closed, vals, weak)
    return outs


def _remat(ctx: Context, eqn, vals, weak):
    """jax.checkpoint: rebuilt around the autocast body, its policy kept."""

    def body(*args):
        outs, _ = _eval_closed(ctx.child(), eqn.params["jaxpr"], list(args), weak)
        return outs

    checkpointed = jax.checkpoint(
        body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
    )
    return list(checkpointed(*vals))


def _shard_map(ctx: Context, eqn, vals, weak):
    """shard_map: rebuilt around the autocast body, mesh and specs kept."""

    def body(*args):
        outs, _ = _eval_closed(ctx.child(), eqn.params["jaxpr"], list(args), weak)
        return tuple(outs)

    return list(jax.shard_map(body, **_compat.shard_map_kwargs(eqn.params))(*vals))


def _custom_jvp(ctx: Context, eqn, vals, weak):
    """Rebuilt as a new custom_jvp whose primal and rule are both autocast.

    Primal outputs of the rule are cast to the primal function's output dtypes
    and tangents to the matching tangent dtypes, as custom_jvp requires.
    """
    params = eqn.params
    n_consts = params["num_consts"]
    rule, rule_consts, out_zeros = _compat.custom_jvp_rule(params, len(vals) - n_consts)

    def primal(*args):
        outs, _ = _eval_closed(ctx.child(), params["call_jaxpr"], list(args), weak)
        return outs

    def jvp(primals, tangents):
        out_avals = jax.eval_shape(primal, *primals)
        n_args = len(primals) - n_consts
        child = ctx.child()
        outs, _ = eval_jaxpr(
            child,
            rule,
            rule_consts,
            [*primals[n_consts:], *tangents[n_consts:]],
            [*weak[n_consts:], *[False] * n_args],
        )
        n = len(out_avals)
        nonzero = iter(outs[n:])
        tangent_outs = [
            jnp.zeros(a.shape, a.dtype) if z else next(nonzero)
            for a, z in zip(out_avals, out_zeros)
        ]
        primal_outs = [child.scope.cast(o, a.dtype) for o, a in zip(outs[:n], out_avals)]
        tangent_outs = [child.scope.cast(t, a.dtype) for t, a in zip(tangent_outs, out_avals)]
        return primal_outs, tangent_outs

    rebuilt = jax.custom_jvp(primal)
    rebuilt.defjvp(lambda primals, tangents: jvp(list(primals), list(tangents)))
    return list(rebuilt(*vals))


def _cond(ctx: Context, eqn, vals, weak):
    """Each branch is autocast; outputs are cast to the widest across branches."""
    index, ops = vals[0], vals[1:]
    ops_weak = weak[1:]
    branches = eqn.params["branches"]

    def branch_fn(closed, out_dtypes=None):
        def fn(*args):
            child = ctx.child()
            outs, _ = _eval_closed(child, closed, list(args), ops_weak)
            if out_dtypes is None:
                return outs
            return [child.scope.cast(o, d) for o, d in zip(outs, out_dtypes)]

        return fn

    per_branch = [jax.eval_shape(branch_fn(b), *ops) for b in branches]
    out_dtypes = [_join([a.dtype for a in avals]) for avals in zip(*per_branch)]
    return list(lax.switch(index, [branch_fn(b, out_dtypes) for b in branches], *ops))


def _join(dtypes):
    if all(d == dtypes[0] for d in dtypes):
        return dtypes[0]
    return policy.widest(dtypes)


def _fix_carry(ctx: Context, init, init_weak, probe) -> tuple[list, Scope]:
    """Carry dtypes that the loop body maps to themselves.

    `probe(dtypes)` evaluates the body abstractly and returns the carry-out
    dtypes and the probing scope. A carry starts at its initial dtype; a weak
    initial value (``jnp.zeros``) adopts the body's output dtype once, so an RNN
    state started from zeros stays in low precision; after that a carry only
    widens, so the search ends.
    """
    dtypes = [dtype_of(x) for x in init]
    for step in range(len(dtypes) + 3):
        out_dtypes, scope = probe(dtypes)
        new = []
        for d, o, w in zip(dtypes, out_dtypes, init_weak):
            if d == o or not (policy.is_castable(d) and policy.is_castable(o)):
                new.append(d)
            elif w and step == 0:
                new.append(o)
            else:
                new.append(policy.widest([d, o]))
        if new == dtypes:
            return dtypes, scope
        dtypes = new
    raise AssertionError("autocast: loop carry dtypes did not converge")  # unreachable


def _hoist(ctx: Context, scope: Scope) -> None:
    """Makes the casts a loop body asked of loop-invariant values, outside it."""
    for value, dtype, weak in scope.requests:
        ctx.scope.cast(value, dtype, weak)


def _scan(ctx: Context, eqn, vals, weak):
    """scan: rebuilt with carries at fixed dtypes, loop-invariant casts hoisted.

    Casts of the scanned-over inputs (a stacked layer's weights) are made once,
    on the whole stack, and scanned over beside the originals.
    """
    params = eqn.params
    n_consts, n_carry = _compat.scan_counts(params)
    consts, init, xs = (
        vals[:n_consts],
        vals[n_consts : n_consts + n_carry],
        vals[n_consts + n_carry :],
    )
    consts_weak, init_weak, xs_weak = (
        weak[:n_consts],
        weak[n_consts : n_consts + n_carry],
        weak[n_consts + n_carry :],
    )
    jaxpr, jaxpr_consts = _compat.jaxpr_and_consts(params["jaxpr"])
    body_weak = [*consts_weak, *[False] * n_carry, *xs_weak]

    def run_body(scope_ctx, carry, x_slices):
        outs, _ = eval_jaxpr(
            scope_ctx, jaxpr, jaxpr_consts, [*consts, *carry, *x_slices], body_weak
        )
        return outs[:n_carry], outs[n_carry:]

    xs_avals = [jax.ShapeDtypeStruct(np.shape(x)[1:], dtype_of(x)) for x in xs]
    slice_ids: dict[int, int] = {}

    def probe(carry_dtypes):
        child = ctx.child(invariant=consts)

        def fn(carry, x_slices):
            slice_ids.clear()
            slice_ids.update({id(s): i for i, s in enumerate(x_slices)})
            child.scope._invariant |= set(slice_ids)
            return run_body(child, carry, x_slices)[0]

        carry_avals = [jax.ShapeDtypeStruct(np.shape(c), d) for c, d in zip(init, carry_dtypes)]
        out = jax.eval_shape(fn, carry_avals, xs_avals)
        return [a.dtype for a in out], child.scope

    carry_dtypes, probe_scope = _fix_carry(ctx, init, init_weak, probe)

    # Casts of whole xs are made once, outside the loop, and scanned over.
    hoisted_xs = []
    const_requests = []
    for value, dtype, w in probe_scope.requests:
        if id(value) in slice_ids:
            i = slice_ids[id(value)]
            hoisted_xs.append((i, dtype, ctx.scope.cast(xs[i], dtype, w)))
        else:
            const_requests.append((value, dtype, w))
    probe_scope.requests = const_requests
    _hoist(ctx, probe_scope)

    def body(carry, x_all):
        x_slices, extra = x_all[: len(xs)], x_all[len(xs) :]
        child = ctx.child()
        for (i, dtype, _), cast_slice in zip(hoisted_xs, extra):
            child.scope.seed(x_slices[i], dtype, cast_slice)
        new_carry, ys = run_body(child, carry, x_slices)
        return [child.scope.cast(c, d) for c, d in zip(new_carry, carry_dtypes)], ys

    init = [ctx.scope.cast(c, d, w) for c, d, w in zip(init, carry_dtypes, init_weak)]
    carry, ys = lax.scan(
        body,
        init,
        [*xs, *(h[2] for h in hoisted_xs)],
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _while(ctx: Context, eqn, vals, weak):
    """while_loop: rebuilt with carries at fixed dtypes, loop-invariant casts hoisted."""
    params = eqn.params
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = vals[:nc], vals[nc : nc + nb], vals[nc + nb :]
    cond_weak, body_weak, init_weak = weak[:nc], weak[nc : nc + nb], weak[nc + nb :]
    n_carry = len(init)

    def run_body(scope_ctx, carry):
        outs, _ = _eval_closed(
            scope_ctx,
            params["body_jaxpr"],
            [*body_consts, *carry],
            [*body_weak, *[False] * n_carry],
        )
        return outs

    def probe(carry_dtypes):
        child = ctx.child(invariant=body_consts)
        carry_avals = [jax.ShapeDtypeStruct(np.shape(c), d) for c, d in zip(init, carry_dtypes)]
        out = jax.eval_shape(lambda c: run_body(child, c), carry_avals)
        return [a.dtype for a in out], child.scope

    carry_dtypes, probe_scope = _fix_carry(ctx, init, init_weak, probe)
    _hoist(ctx, probe_scope)

    def cond_fn(carry):
        outs, _ = _eval_closed(
            ctx.child(),
            params["cond_jaxpr"],
            [*cond_consts, *carry],
            [*cond_weak, *[False] * n_carry],
        )
        return outs[0]

    def body_fn(carry):
        child = ctx.child()
        return [child.scope.cast(c, d) for c, d in zip(run_body(child, carry), carry_dtypes)]

    init = [ctx.scope.cast(c, d, w) for c, d, w in zip(init, carry_dtypes, init_weak)]
    return list(lax.while_loop(cond_fn, body_fn, init))


HIGHER_ORDER: dict[str, Callable] = {
    "jit": _inline_call,
    "pjit": _inline_call,
    "closed_call": _inline_call,
    "core_call": _inline_call,
    "remat2": _remat,
    "checkpoint": _remat,
    "shard_map": _shard_map,
    "custom_jvp_call": _custom_jvp,
    "cond": _cond,
    "scan": _scan,
    "while": _while,
}
"""Higher-order primitives the interpreter recurses into, by name.

custom_vjp_call is deliberately absent: it runs as written at its original input
dtypes (`Rule.ORIGINAL`), so the user's backward rule stays exact.
"""


# --------------------------------------------------------------------------
# The public transform


def _check_dtype(dtype) -> np.dtype:
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in policy.LOW_DTYPES:
        raise ValueError(
            f"autocast(dtype={dtype!r}): dtype must be jnp.float16 or jnp.bfloat16, "
            "the precision that matrix products run in. To run a region in float32, "
            "use autocast(fun, enabled=False)."
        )
    return resolved


def _check_reduce_dtype(reduce_dtype, low: np.dtype) -> bool:
    """Validates `reduce_dtype`; returns whether gradients are summed in `low`."""
    try:
        resolved = None if reduce_dtype is None else np.dtype(reduce_dtype)
    except TypeError:
        resolved = None
    if resolved not in (_F32, low):
        raise ValueError(
            f"autocast(reduce_dtype={reduce_dtype!r}): reduce_dtype must be jnp.float32 "
            f"(the default: weight gradients summed and all-reduced in float32) or "
            f"jnp.{low.name}, the autocast dtype (all-reduced in 16 bits, half the bandwidth)."
        )
    return resolved == low


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def autocast(
    fun: Callable | None = None,
    *,
    dtype=jnp.float16,
    enabled: bool = True,
    policy: str = "torch",
    reduce_dtype=jnp.float32,
):
    """Runs `fun` in mixed precision, like ``torch.autocast``.

    Matrix products and convolutions run in `dtype`; transcendental functions and
    reductions run in float32; operations with several floating inputs run in the
    widest of them; everything else runs in the dtype it receives. The tables are
    in `mpjax.policy`. Results keep the dtypes `fun` returns without autocast, so
    ``autocast(fun)`` is a drop-in replacement for `fun`.

    Array arguments are traced; every other leaf of the arguments (Python bools,
    ints, floats, strings) is passed to `fun` as it is, so it may steer Python
    control flow. Flax NNX modules may be passed too: what `fun` writes to them
    (BatchNorm statistics, RNG counters) is kept, at the variables' own dtypes.

    Calls nest: inside an autocast function, ``autocast(g, enabled=False)`` runs
    `g` exactly as written and ``autocast(g, dtype=jnp.bfloat16)`` runs it in
    bfloat16.

    Args:
      fun: the function to transform. Omit it to use ``autocast(dtype=...)`` as a
        decorator.
      dtype: ``jnp.float16`` (default) or ``jnp.bfloat16``.
      enabled: if False, `fun` runs as written (and so does any region nested in
        it that does not enable autocast again).
      policy: ``"torch"`` (default) hands on the dtype each operation computes in,
        as ``torch.autocast`` does: a float32-list operation returns float32, and a
        float32 bias promotes the activation it is added to. ``"lean"`` keeps
        activations in `dtype` between operations, as a model written with Flax's
        ``dtype=`` does: float32-list operations compute in float32 and return
        `dtype` (rematerialized, so no float32 copy is kept for the backward
        pass); reductions stay float32; the largest operand of a multi-input
        operation sets its precision; embedding lookups gather from a
        low-precision table. It keeps fewer and smaller activations, at the cost
        of rounding more intermediate results to 16 bits.
      reduce_dtype: the dtype gradients of float32 values (the weights) are summed
        in, as torch FSDP's ``reduce_dtype``. ``jnp.float32`` (default): a matrix
        product with a float32 input keeps its float32 result and rounds it to
        `dtype` afterwards (the same forward value), so in the backward pass its
        weight gradient is summed over the batch in float32, and data-parallel
        ``jit`` all-reduces it in float32, not in 16 bits. Pass `dtype` itself to
        all-reduce in 16 bits, for half the bandwidth. Convolutions always
        produce `dtype` results.

    Returns:
      A function with the signature of `fun`.

    Examples:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> grads = jax.grad(mpjax.autocast(loss))(w, x)
      >>> grads.dtype  # gradients of float32 parameters stay float32
      dtype('float32')
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled={enabled!r}): enabled must be a Python bool.")
    low = _check_dtype(dtype)
    if policy not in POLICIES:
        raise ValueError(f"autocast(policy={policy!r}): policy must be one of {POLICIES}.")
    reduce_low = _check_reduce_dtype(reduce_dtype, low)
    if fun is None:
        return functools.partial(
            autocast, dtype=low, enabled=enabled, policy=policy, reduce_dtype=reduce_dtype
        )
    if isinstance(fun, type) and policy_module.is_castable(fun):
        raise TypeError(
            f"autocast(fun): got the dtype {np.dtype(fun).name} as the function; pass the "
            f"dtype by keyword: autocast(dtype=jnp.{np.dtype(fun).name}) or "
            f"autocast(fun, dtype=jnp.{np.dtype(fun).name})."
        )
    if not callable(fun):
        raise TypeError(
            f"autocast(fun): fun must be callable, got {type(fun).__name__}. Wrap the "
            "function that computes your loss: autocast(loss_fn)(params, batch), or use "
            "@autocast / @autocast(dtype=jnp.bfloat16) as a decorator."
        )
    region = Region(low if enabled else None, enabled and policy == "lean", reduce_low)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        with jax.named_scope(region.scope_name):
            if not enabled:
                return fun(*args, **kwargs)
            if _nnx.has_nnx_objects((args, kwargs)):
                return _nnx.call_with_state(
                    lambda pure, state_args: _autocast_call(pure, region, state_args, {}),
                    fun,
                    args,
                    kwargs,
                )
            return _autocast_call(fun, region, args, kwargs)

    # Lets `audit` count the casts autocast adds. Stored with `wrapped` itself, since
    # functools.wraps in other transforms (jax.grad) copies attributes onward.
    wrapped.__mpjax_autocast__ = (wrapped, fun)
    return wrapped


_STATIC_HINT = (
    "mpjax.autocast traces `fun` with its array arguments abstract, so Python "
    "control flow (if, while, bool(), int()) must not depend on array values. Pass "
    "such flags as Python bools or ints (autocast hands non-array arguments to `fun` "
    "unchanged), close over them, or use lax.cond / jnp.where."
)


def trace_arrays(fun, args, kwargs):
    """Traces ``fun(*args, **kwargs)`` with the array leaves abstract.

    Every other leaf (Python scalars, strings, None) is passed to `fun` as it is.
    Returns the closed jaxpr, the output shapes, and the array leaves.
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

    def flat_fun(*dynamic_leaves):
        full = list(leaves)
        for i, x in zip(dynamic, dynamic_leaves):
            full[i] = x
        a, k = jax.tree.unflatten(treedef, full)
        return fun(*a, **k)

    dynamic_leaves = [leaves[i] for i in dynamic]
    try:
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dynamic_leaves)
    except Exception as e:
        # Python control flow or shapes depending on an array: say how to fix it.
        if isinstance(
            e,
            (
                jax.errors.ConcretizationTypeError,
                jax.errors.TracerBoolConversionError,
                jax.errors.TracerIntegerConversionError,
            ),
        ) or "Traced<" in str(e):
            e.add_note(_STATIC_HINT)
        raise
    return closed, out_shape, dynamic_leaves


def _autocast_call(fun, region: Region, args, kwargs):
    closed, out_shape, dynamic_leaves = trace_arrays(fun, args, kwargs)
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    ctx = Context(region, Scope())
    outs, _ = eval_jaxpr(ctx, jaxpr, consts, dynamic_leaves, [False] * len(dynamic_leaves))
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    # jnp.asarray: an output that is a literal comes back a jax.Array, as from `fun`.
    outs = [jnp.asarray(ctx.scope.cast(o, s.dtype)) for o, s in zip(outs, out_leaves)]
    return jax.tree.unflatten(out_tree, outs)
