"""The rules of the custom-derivative primitives: custom_jvp, custom_vjp, custom_vmap.

A custom_jvp and a custom_vmap are rebuilt around bodies and rules that the
interpreter evaluates under the policy; a custom_vjp runs as written, its backward
rule exact. A rule is read back from the traced program: one that reads a value of
that program (closed over, or in ``nondiff_argnums``) cannot run again, and says so.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat, _constants, _leaves, _products, first_order, policy
from mpjax._casting import dtype_of
from mpjax.interpreter import HIGHER_ORDER, Context, eval_closed, eval_jaxpr


def _custom_jvp(ctx: Context, eqn, vals, weak):
    """Rebuilt as a new custom_jvp whose primal and rule are both autocast.

    Primal outputs of the rule are cast to the primal function's output dtypes
    and tangents to the matching tangent dtypes, as custom_jvp requires.
    """
    if _compat.called_name(eqn) == _products.LOW_PRODUCT and all(
        dtype_of(x) == v.aval.dtype for x, v in zip(vals, eqn.invars)
    ):
        # A product an inner region already made: its operands are as it made them.
        return _compat.bind(eqn, *vals)
    params = eqn.params
    n_consts = params["num_consts"]
    # The rebuilt function's rule is kept in its equation, past this trace: it
    # closes over what is known of `vals`, not over `vals`, tracers of this trace.
    known = _constants.known(ctx.scope, vals)

    def primal(*args):
        with ctx.passing(eqn.invars).nested() as child:
            _constants.record(child.scope, known, args)
            outs, _ = eval_closed(child, params["call_jaxpr"], list(args), weak)
        return outs

    def jvp(primals, tangents):
        # Traced only when differentiated, as JAX does: a rule may not trace at all
        # (erfcx's second-order one on jax 0.12), and the forward pass needs none.
        # Symbolic zeros are passed on, as JAX does, to a rule that asked for them.
        tangents = tangents[n_consts:]
        zeros = [isinstance(t, _compat.SymbolicZero) for t in tangents]
        if not params["symbolic_zeros"]:
            tangents = [_zero_tangent(t.aval) if z else t for t, z in zip(tangents, zeros)]
            zeros = [False] * len(zeros)
        tangents = [t for t, z in zip(tangents, zeros) if not z]
        rule, rule_consts, leading, out_zeros = _compat.custom_jvp_rule(params, zeros)
        widen = _tangents_reach_sums(rule, rule.invars[len(rule.invars) - len(tangents) :])
        if any(_compat.is_stale_tracer(c) for c in (*rule_consts, *leading)):
            raise TypeError(_CLOSED_OVER.format(_compat.user_frame(eqn)))
        out_avals = jax.eval_shape(primal, *primals)
        if widen:  # the rule's sums of tangents, transposed, are float32 sums
            tangents = [_float32(t) for t in tangents]
        # A tangent is a parameter where its primal is: its product's transpose
        # is the parameter's gradient, which keeps a float32 accumulator.
        primals_in = eqn.invars[n_consts:]
        tangents_of = [v for v, z in zip(primals_in, zeros) if not z]
        passed = [*[True] * len(leading), *primals_in, *tangents_of]
        with ctx.passing(passed).nested() as child:
            _constants.record(child.scope, known, primals)
            try:
                outs, _ = eval_jaxpr(
                    child,
                    rule,
                    rule_consts,
                    [*leading, *primals[n_consts:], *tangents],
                    [False] * len(leading) + [*weak[n_consts:], *[False] * len(tangents)],
                )
            except jax.errors.UnexpectedTracerError as e:
                raise TypeError(_CLOSED_OVER.format(_compat.user_frame(eqn))) from e
            n = len(out_avals)
            nonzero = iter(outs[n:])
            tangent_outs = [
                _zero_tangent(a) if z else next(nonzero) for a, z in zip(out_avals, out_zeros)
            ]
            primal_outs = [child.scope.cast(o, a.dtype) for o, a in zip(outs[:n], out_avals)]
            tangent_outs = [
                child.scope.cast(t, a.dtype) if _inexact(a) else _zero_tangent(a)
                for t, a in zip(tangent_outs, out_avals)
            ]
        return primal_outs, tangent_outs

    rebuilt = jax.custom_jvp(primal)
    rebuilt.defjvp(lambda ps, ts: jvp(list(ps), list(ts)), symbolic_zeros=True)
    return list(rebuilt(*vals))


_CLOSED_OVER = (
    "mpjax.autocast: the jax.custom_jvp function called at {} reads, in its jvp rule, "
    "a value computed inside the autocast function (closed over, or passed in "
    "nondiff_argnums). A rule read from a traced program cannot be run again on "
    "such a value (jax.core.eval_jaxpr cannot either). Pass the value to the "
    "custom_jvp function as an ordinary argument."
)
_BWD_CLOSED_OVER = (
    "mpjax.autocast: the jax.custom_vjp function called at {} reads, in its fwd or bwd "
    "rule, "
    "a value of the autocast function itself (an argument, or a value computed from "
    "one). A rule read from a traced program cannot be run again on such a value "
    "(jax.core.eval_jaxpr cannot either). Pass the value to the custom_vjp function "
    "as an ordinary argument (its cotangent may be zero), or build the function with "
    "jax.closure_convert."
)


def _custom_vjp(ctx: Context, eqn, vals, weak):
    """Runs as written at its original input dtypes (`Rule.ORIGINAL`), so the user's
    backward rule stays exact. A rule that can reach a value of the traced program
    is checked when it runs: one that reads it raises, rather than read it from a
    trace that has ended (under `jax.export`, a wrong hidden input)."""
    fwd, bwd = eqn.params["fwd_jaxpr_thunk"], eqn.params["bwd"]
    # A constant the trace inlined reaches the user's rules as a JAX array, as without
    # autocast, not as the NumPy copy the interpreter reads (a rule may use `.at` on
    # it, or index it with a traced index).
    vals = [jnp.asarray(v) if isinstance(v, (np.ndarray, np.generic)) else v for v in vals]
    if not (_reads_stale(fwd) or _reads_stale(bwd)):
        return first_order.policy_rule(ctx, eqn, vals, weak)

    def refuse():
        raise TypeError(_BWD_CLOSED_OVER.format(_compat.user_frame(eqn)))

    def checked_fwd(*zeros):
        jaxpr, consts = fwd.call_wrapped(*zeros)
        if any(_compat.is_stale_tracer(c) for c in consts):
            refuse()
        return jaxpr, consts

    def checked_bwd(*args):
        # Traced apart first, for what it reads; then run as JAX runs it.
        try:
            consts = _compat.jaxpr_and_consts(jax.make_jaxpr(bwd.call_wrapped)(*args))[1]
        except TypeError:  # results that are no arrays (symbolic zeros): unchecked
            consts = ()
        if any(_compat.is_stale_tracer(c) for c in consts):
            refuse()
        return bwd.call_wrapped(*args)

    checked = {"fwd_jaxpr_thunk": (checked_fwd, fwd), "bwd": (checked_bwd, bwd)}
    params = {k: _compat.wrapped_like(f, like) for k, (f, like) in checked.items()}
    return first_order.policy_rule(ctx, eqn.replace(params={**eqn.params, **params}), vals, weak)


def _reads_stale(fun) -> bool:
    """Whether a rule can reach a value of a trace that has ended, through closures,
    `functools.partial` arguments, bound methods, objects' attributes and
    `WrappedFun`s (``jax.custom_gradient``'s user function is seven levels down).
    Breadth first, at most 4096 objects: what it reaches is then checked exactly."""
    seen, level = set(), [fun]
    for _ in range(9):
        parts = []
        for x in level:
            if id(x) in seen or len(seen) > 4096:
                continue
            seen.add(id(x))
            if _compat.is_stale_tracer(x):
                return True
            parts.extend(_leaves.parts(x))
        level = parts
    return False


def _tangents_reach_sums(jaxpr, tangents) -> bool:
    """Whether a rule applies to its tangents a primitive whose transpose sums (a
    broadcast, a gather): given 16-bit tangents, the backward pass would sum in
    16 bits, the rule being differentiated by JAX, not by the policy."""
    reached = set(tangents)
    for eqn in jaxpr.eqns:
        if not any(v in reached for v in eqn.invars if not isinstance(v, _compat.Literal)):
            continue
        if eqn.primitive.name in policy.FLOAT32_SUMS or any(
            _sums_anywhere(_compat.jaxpr_and_consts(sub)[0])
            for sub in _compat.sub_jaxprs(eqn.params)
        ):
            return True
        reached.update(eqn.outvars)
    return False


def _sums_anywhere(jaxpr) -> bool:
    return any(
        eqn.primitive.name in policy.FLOAT32_SUMS
        or any(
            _sums_anywhere(_compat.jaxpr_and_consts(s)[0]) for s in _compat.sub_jaxprs(eqn.params)
        )
        for eqn in jaxpr.eqns
    )


def _float32(x):
    return _compat.convert_element_type(x, jnp.float32) if dtype_of(x) in policy.LOW_DTYPES else x


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zero_tangent(aval):
    """The zero tangent of an output: float0 for an integer or boolean one, as JAX requires."""
    if _inexact(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _custom_vmap(ctx: Context, eqn, vals, weak):
    """Rebuilt as a new custom_vmap whose function and vmap rule are both autocast.

    The rule is traced at the original dtypes (and the batched shapes) and
    evaluated under the policy; its outputs are cast to the function's output
    dtypes, as the primitive requires of its rule.
    """
    call, rule = _compat.custom_vmap_parts(eqn.params)

    def primal(*args):
        with ctx.passing(eqn.invars).nested() as child:
            outs, _ = eval_closed(child, call, list(args), weak)
        return outs

    def vmap_rule(axis_size, in_batched, *args):
        unbatched = [_compat.abstract(a, dtype_of(a), b) for a, b in zip(args, in_batched)]
        out_avals = jax.eval_shape(primal, *unbatched)
        out_batched = []

        def original_rule(*xs):
            outs, batched = rule(axis_size, in_batched, xs)
            out_batched[:] = batched
            return outs

        at_original_dtypes = [_compat.abstract(a, v.aval.dtype) for a, v in zip(args, eqn.invars)]
        closed = jax.make_jaxpr(original_rule)(*at_original_dtypes)
        with ctx.passing(eqn.invars).nested() as child:
            outs, _ = eval_closed(child, closed, list(args), weak)
            outs = [child.scope.cast(o, a.dtype) for o, a in zip(outs, out_avals)]
        return outs, list(out_batched)

    rebuilt = jax.custom_batching.custom_vmap(primal)
    rebuilt.def_vmap(vmap_rule)
    return list(rebuilt(*vals))


HIGHER_ORDER["custom_jvp_call"] = _custom_jvp
HIGHER_ORDER["custom_vjp_call"] = _custom_vjp
HIGHER_ORDER["custom_vmap_call"] = _custom_vmap
