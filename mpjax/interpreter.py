"""The evaluation core of `autocast`: a jaxpr evaluated equation by equation.

Each equation's primitive is bound again on inputs cast as `mpjax.policy` says
(`mpjax.first_order`), or, for a higher-order primitive, rebuilt around bodies
evaluated the same way (its rule in `HIGHER_ORDER`, filled by
`mpjax.control_flow`). Because the evaluation binds ordinary primitives on
whatever values it receives (tracers included), the result composes with `jit`,
`grad`, `vmap` and the rest.

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

import contextlib
import functools
from typing import Callable, NamedTuple

import numpy as np

from mpjax import _compat
from mpjax import _constants
from mpjax import _pointwise
from mpjax import _prescale
from mpjax import _products
from mpjax import _reorder
from mpjax import _shifts
from mpjax import first_order
from mpjax import fusions
from mpjax import policy
from mpjax._casting import F32, convert, dtype_of
from mpjax._regions import Region, region_of
from mpjax._scope import Scope

class Context(NamedTuple):
    region: Region
    scope: Scope
    float32_only: frozenset = frozenset()
    """Lean policy: the variables read only by float32-list primitives."""
    float32_outputs: frozenset = frozenset()
    """Lean policy: the output positions of the jaxpr evaluated next (a call's) that
    its caller reads only by float32-list primitives."""
    bias_adds: dict = {}
    """By id of each equation adding a bias to a product: the product's position
    (`mpjax.fusions`)."""
    float32_sums: frozenset = frozenset()
    """ids of those whose sum stays float32 (read by `mpjax.fusions.SQUASHING`), and
    of the collective sums a mean divides next."""
    residual_sums: frozenset = frozenset()
    """ids of the adds that read a product's float32 accumulator (`mpjax.fusions`)."""
    accumulated: frozenset = frozenset()
    """ids of the products whose float32 accumulator a reader takes (`mpjax.fusions`)."""
    arguments: frozenset = frozenset()
    """The variables holding the jaxpr's arguments (parameters), `mpjax.fusions`."""
    passed: frozenset | None = None
    """The input positions of the jaxpr evaluated next (a body's) that hold its
    caller's arguments (`passing`); None where all do (the function autocast wraps)."""
    tables: frozenset = frozenset()
    """The variables holding the function's parameters themselves: `arguments`
    less a loop's carries and computed inputs, and the values layout primitives
    join from several. The lean policy rounds the rows a gather reads from these
    only (an embedding's table); other rows are data. A bias is one of these."""
    passed_tables: frozenset | None = None
    """Likewise for `tables`: the positions of the next body's inputs holding them."""
    lone: dict = {}
    """By equation id, the operands of a mul or div nothing else reads (`mpjax.fusions`)."""
    max_shifts: frozenset = frozenset()
    """ids of the ``x - max(x)`` of a softmax, run in float32 (`_shifts.max_shifts`)."""
    memo: dict | None = None
    """What rules solved by probing a body (a loop's carry dtypes and hoisted
    casts, a cond's output dtypes), for the whole autocast call: see `solved`."""
    probing: bool = False
    """Inside a probe: a body evaluated abstractly, for its output dtypes only."""
    rematted: bool = False
    """Inside a ``jax.checkpoint``'s body, whose policy decides what the backward pass
    keeps of it (`_pointwise.recomputed`)."""

    def for_call(self, eqn) -> Context:
        """This context, for the body of the call `eqn` (`passing` its inputs): (lean)
        with the positions of its results that its readers take only as float32."""
        only = frozenset(i for i, v in enumerate(eqn.outvars) if v in self.float32_only)
        return self.passing(eqn.invars)._replace(float32_outputs=only)

    def passing(self, invars, loop: bool = False) -> Context:
        """This context, for a body whose inputs are the caller's `invars` (None for
        none of them, True for a constant): an input is a parameter there only where
        it holds one here, so that an activation passed to a nested jit stays one.
        A `loop`'s body goes without: each of its inputs counts as a parameter, as a
        float32 operand costs nothing where the loop keeps the 16-bit casts anyway,
        and its gradient stays float32 (an RNN's inputs', its carry's). Its `tables`
        are narrowed all the same (its carries passed as None)."""

        def holding(found):
            return frozenset(
                i
                for i, v in enumerate(invars)
                if v is True
                or (v is not None and not isinstance(v, _compat.Literal) and v in found)
            )

        passed = None if loop else holding(self.arguments)
        return self._replace(passed=passed, passed_tables=holding(self.tables))

    @contextlib.contextmanager
    def nested(self, invariant=(), probing: bool = False):
        """A child context for one trace of a body, with a scope of its own that lets
        go of the trace's values as the body returns: a rule's closure may outlive
        the trace (a custom_jvp's rule, kept in its equation), and a tracer it held
        would be a leak (``jax_check_tracer_leaks``) and keep the trace's arrays alive."""
        child = self._replace(scope=Scope(self.scope, invariant), probing=self.probing or probing)
        try:
            yield child
        finally:
            child.scope.release()

    def solved(self, eqn, vals, weak, solve: Callable):
        """``solve()``, once per equation, region and input dtypes and weak flags.

        A loop rule probes its body before tracing it, so without this an inner
        loop would be probed again inside every evaluation of the outer body:
        2**depth evaluations of the innermost body. With it, and with solved
        rules answering probes without their bodies (`control_flow._abstract`),
        each body is probed once and traced once. `solve` must return nothing
        tied to one trace (positions, not values).
        """
        if self.memo is None:
            return solve()
        signature = tuple(_signature(self.scope, x, w) for x, w in zip(vals, weak))
        # A jitted function's jaxpr, and so its equations, are shared by its calls,
        # whose inputs may be parameters in one and activations in another.
        roles = tuple(
            not isinstance(v, _compat.Literal) and (v in self.arguments, v in self.tables)
            for v in eqn.invars
        )
        key = (id(eqn), self.region, signature, roles)
        entry = self.memo.get(key)
        if entry is None:
            # The equation is kept with its result, so its id is not reused.
            entry = self.memo[key] = (eqn, solve())
        return entry[1]


def _signature(scope: Scope, x, weak: bool):
    """What a rule's result may depend on in an input: its dtype and weak flag,
    and a constant's known values too, weak or closed over (whether the low dtype
    holds them, `mpjax._constants.fits`); a large one's identity, alive all call."""
    known = _constants.values(scope, x)
    if known is not None:
        held = known.tobytes() if _constants.small(known) else id(x)
        is_set = isinstance(known, _constants.ValueSet)
        return dtype_of(x), np.shape(x), known.dtype, held, is_set, weak
    return dtype_of(x), weak


# --------------------------------------------------------------------------
# Evaluation


HIGHER_ORDER: dict[str, Callable] = {}
"""Rules of the higher-order primitives the interpreter recurses into, by name.

Each rule maps ``(ctx, eqn, vals, weak)`` to the equation's outputs. The rules and
their registration (one line per primitive) are in `mpjax.control_flow`; every
other primitive takes `mpjax.first_order.policy_rule`.
"""


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
        elsewhere = lambda eqn: region_of(eqn, ctx.region) != ctx.region  # noqa: E731
        only = policy.float32_only_consumers(jaxpr, ctx.float32_outputs, elsewhere)
        ctx = ctx._replace(float32_only=only, float32_outputs=frozenset())
    fused = fusions.find(jaxpr, ctx.passed, ctx.passed_tables) if jaxpr.eqns else fusions.NONE
    ctx = ctx._replace(
        passed=None,
        passed_tables=None,
        tables=fusions.arguments(jaxpr, ctx.passed_tables, joined=True),
        bias_adds=fused.bias_adds,
        float32_sums=fused.float32_sums,
        residual_sums=fused.residual_sums,
        accumulated=fused.accumulated,
        arguments=fused.arguments,
        max_shifts=_shifts.max_shifts(jaxpr) if jaxpr.eqns else frozenset(),
        lone=fused.lone,
    )
    folds = _prescale.Folds(jaxpr, fused, consts)  # attention's scale: `mpjax._prescale`
    lean = ctx.region.lean
    pools = _reorder.relu_pools(jaxpr, fused.observing) if jaxpr.eqns and not lean else {}
    relus = frozenset(pools.values())
    observe = _Observer(ctx, jaxpr.eqns, env, read, folds)
    for i, eqn in enumerate(jaxpr.eqns):
        if i in fused.observing:  # a print, a check: sees what the program holds
            _evaluate(ctx, eqn, observe, env)
            continue
        if i in fused.deferred or i in relus:
            continue  # evaluated with the pointwise function or max-pool it belongs to
        if i in pools:  # relu(max_pool(x)) for max_pool(relu(x)): `mpjax._reorder`
            relu = jaxpr.eqns[pools[i]]
            _evaluate(ctx, eqn.replace(invars=relu.invars), read, env)
            relu_ctx = ctx._replace(region=region_of(relu, ctx.region))
            _reorder.relu_of(functools.partial(eval_closed, relu_ctx), env, eqn.outvars[0], relu)
            continue
        chain = fused.chains.get(i)
        if chain is not None and _fuses(ctx, chain, jaxpr.eqns, env):
            source, source_weak = env[chain.source]
            with _compat.equation_context(eqn):
                env[chain.out] = (_pointwise.pointwise(chain, jaxpr.eqns, source), source_weak)
            continue
        for j in chain.eqns if chain is not None else (i,):
            rule = _rule(jaxpr.eqns[j])
            if j in fused.selects:
                rule = functools.partial(fusions.select, rule, fused.selects[j], read)
            else:
                rule = folds.rule(j, rule)
            if id(jaxpr.eqns[j]) in fused.factorized:
                rule = functools.partial(_as_written, rule)
            _evaluate(ctx, jaxpr.eqns[j], read, env, rule)
    return [list(t) for t in zip(*map(read, jaxpr.outvars))] if jaxpr.outvars else ([], [])


class _Observer:
    """The reader of the equations that only observe (`mpjax._readers.observing`):
    what the program holds of a value, without the power of two a product's
    operands took (`_prescale.Folds.observed`), and made per primitive where a
    rewrite made none (a fused chain's inside, a ReLU moved after its max-pool).
    Not a closure calling itself, whose cycle would keep `env` alive."""

    def __init__(self, ctx: Context, eqns, env, read, folds):
        self.ctx, self.eqns, self.env, self.read, self.folds = ctx, eqns, env, read, folds
        self.made, self.made_by = {}, {}

    def __call__(self, v):
        if isinstance(v, _compat.Literal):
            return self.read(v)
        if v in self.made:
            return self.made[v]
        if v in self.env:
            value, weak = self.env[v]
            return self.folds.observed(v, value), weak
        if not self.made_by:
            self.made_by.update((o, e) for e in self.eqns for o in e.outvars)
        _evaluate(self.ctx, self.made_by[v], self, self.made)
        return self.made[v]


def _fuses(ctx: Context, chain, eqns, env) -> bool:
    """Whether a pointwise function runs as one (`mpjax.fusions`): the default
    policy is on for all of it and the products reading it (an inner region
    may turn autocast off for them), none of which runs as written (a float32
    product given ``precision=HIGHEST`` would read its rounding), and its
    activation arrives in 16 bits."""
    regions = {region_of(eqns[j], ctx.region) for j in chain.eqns + chain.products}
    if len(regions) != 1:
        return False
    (region,) = regions
    source, weak = env[chain.source]
    return (
        region.dtype is not None
        and not region.lean
        and not weak
        and dtype_of(source) in (region.dtype, F32)
        and not any(
            _products.runs_as_written(eqns[j], [v.aval for v in eqns[j].invars])
            for j in chain.products
        )
    )


def _as_written(rule, ctx: Context, eqn, vals, weak):
    """A product only linear algebra reads (`_readers.factorized`), as the program wrote it."""
    return rule(ctx._replace(region=ctx.region._replace(dtype=None)), eqn, vals, weak)


def _rule(eqn) -> Callable:
    return HIGHER_ORDER.get(eqn.primitive.name, first_order.policy_rule)


def _evaluate(ctx: Context, eqn, read, env, rule: Callable | None = None) -> None:
    """One equation by its rule (`_rule`, unless given); its outputs go into `env`."""
    vals, weaks = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
    eqn_ctx = ctx._replace(region=region_of(eqn, ctx.region))
    rule = rule or _rule(eqn)
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
    eqn_ctx.scope.record_move(eqn, vals, outs)
    out_weak = all(weaks) and _constants.computed_from_literals(eqn)
    if out_weak:
        _constants.propagate(eqn_ctx.scope, eqn, vals, outs, eqn.primitive.name not in HIGHER_ORDER)
    for v, o in zip(eqn.outvars, outs, strict=True):
        env[v] = (o, out_weak)


def eval_closed(ctx: Context, closed, args, weak):
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    return eval_jaxpr(ctx, jaxpr, consts, args, weak)
