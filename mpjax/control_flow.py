"""The rules of the higher-order primitives: nested jit, remat, shard_map, cond,
scan and while.

Each rule rebuilds its primitive around bodies that the interpreter evaluates
under the same policy (`mpjax.interpreter.eval_jaxpr`), so the casts inside a
body obey the tables too. Loop rules fix each carry at a dtype the body maps to
itself, and hoist casts of loop-invariant values out of the loop. The table at
the end registers each rule under its primitive's name: adding a primitive is
one line there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import _compat, _constants
from mpjax import policy
from mpjax._casting import constrained, dtype_of
from mpjax.interpreter import HIGHER_ORDER, Context, Scope, eval_closed, eval_jaxpr


def _inline_call(ctx: Context, eqn, vals, weak):
    """A nested jit is inlined, so its casts share the caller's scope. Its
    equations are named ``jit(name)`` in the name stack, as JAX names a call's,
    so that a profile or `mpjax.diagnose` tells them from a module named alike.
    The shardings it names for its arguments and results are kept, as constraints."""
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    vals = constrained(vals, eqn.params.get("in_shardings"))
    ctx = ctx.for_call(eqn)
    with jax.named_scope(f"jit({eqn.params.get('name', eqn.primitive.name)})"):
        outs, _ = eval_closed(ctx, closed, vals, weak)
    return constrained(outs, eqn.params.get("out_shardings"))


def _remat(ctx: Context, eqn, vals, weak):
    """jax.checkpoint: rebuilt around the autocast body, its policy kept."""

    inner = ctx.for_call(eqn)._replace(rematted=True)
    known = _constants.known(ctx.scope, vals)

    def body(*args):
        with inner.nested() as child:
            _constants.record(child.scope, known, args)
            outs, _ = eval_closed(child, eqn.params["jaxpr"], list(args), weak)
        return outs

    checkpointed = jax.checkpoint(
        body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
    )
    if not eqn.params.get("differentiated"):
        return list(checkpointed(*vals))
    # A checkpoint of a backward pass (``autocast(jax.grad(f))``) is marked so: only
    # then does XLA keep it from merging the recomputation into the forward pass
    # (which keeps every activation the checkpoint was there to drop).
    closed = jax.make_jaxpr(checkpointed)(*vals)
    env = dict(zip(closed.jaxpr.constvars, closed.consts)) | dict(zip(closed.jaxpr.invars, vals))
    read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]  # noqa: E731
    for made in closed.jaxpr.eqns:  # the checkpoint, and a convert of a literal at most
        marked = {"differentiated": True} if made.primitive is eqn.primitive else {}
        env.update(zip(made.outvars, _compat.bind(made, *map(read, made.invars), **marked)))
    return [read(v) for v in closed.jaxpr.outvars]


def _shard_map(ctx: Context, eqn, vals, weak):
    """shard_map: rebuilt around the autocast body, mesh and specs kept."""

    known = _constants.known(ctx.scope, vals, parts=True)  # of shards

    def body(*args):
        with ctx.passing(eqn.invars).nested() as child:
            _constants.record(child.scope, known, args)
            outs, _ = eval_closed(child, eqn.params["jaxpr"], list(args), weak)
        return tuple(outs)

    mapped = jax.shard_map(body, **_compat.shard_map_kwargs(eqn.params))
    if _compat.staging_trace() is None:  # outside jit: eagerly, a nested shard_map fails
        mapped = jax.jit(mapped)
    return list(mapped(*vals))


def _cond(ctx: Context, eqn, vals, weak):
    """Each branch is autocast; outputs are cast to the widest across branches."""
    index, ops = vals[0], vals[1:]
    ops_weak = weak[1:]
    branches = eqn.params["branches"]
    inner = ctx.passing(eqn.invars[1:])
    ops_known = _constants.known(ctx.scope, ops)

    def branch_fn(closed, out_dtypes=None, known=None):
        """A branch, its outputs cast to `out_dtypes`; probing (None), what it
        returns, with its constant outputs' values (zeros) put in `known`."""

        def fn(*args):
            with inner.nested(probing=out_dtypes is None) as child:
                _constants.record(child.scope, ops_known, args)
                outs, out_weak = eval_closed(child, closed, list(args), ops_weak)
                if out_dtypes is None:
                    known.append(
                        [w and _constants.values(child.scope, o) for o, w in zip(outs, out_weak)]
                    )
                    return outs
                return [child.scope.cast(o, d) for o, d in zip(outs, out_dtypes)]

        return fn

    def solve():
        known = []
        per_branch = [jax.eval_shape(branch_fn(b, known=known), *ops) for b in branches]
        avals = zip(*per_branch)
        return [_constants.joined([a.dtype for a in v], k) for v, k in zip(avals, zip(*known))]

    out_dtypes = ctx.solved(eqn, vals, weak, solve)
    abstract = _abstract(ctx, eqn, out_dtypes)
    if abstract is not None:
        return abstract
    return list(lax.switch(index, [branch_fn(b, out_dtypes) for b in branches], *ops))


def _fix_carry(ctx: Context, init, init_weak, probe) -> tuple[list, object]:
    """Carry dtypes that the loop body maps to themselves.

    `probe(dtypes)` evaluates the body abstractly and returns the carry-out
    dtypes and what else it found, returned with the fixed dtypes. A carry
    starts at its initial dtype; a weak initial value (``jnp.zeros``) adopts the
    body's output dtype once, where that holds its values (not ``jnp.full(n,
    1e5)`` in float16), so an RNN state started from zeros stays in low
    precision; after that a carry only widens, so the search ends.
    """
    dtypes = [dtype_of(x) for x in init]
    for step in range(len(dtypes) + 3):
        out_dtypes, found = probe(dtypes)
        new = []
        for x, d, o, w in zip(init, dtypes, out_dtypes, init_weak):
            if d == o or not (policy.is_castable(d) and policy.is_castable(o)):
                new.append(d)
            elif w and step == 0 and _constants.fits(ctx.scope, x, o):
                new.append(o)
            else:
                new.append(policy.widest([d, o]))
        if new == dtypes:
            return dtypes, found
        dtypes = new
    raise AssertionError("autocast: loop carry dtypes did not converge")  # unreachable


def _abstract(ctx: Context, eqn, dtypes) -> list | None:
    """Inside a probe, the outputs of a solved loop or cond: zeros of the
    equation's shapes at the solved dtypes. A probe reads only dtypes, so its
    body need not be traced again. None outside probes (and for PRNG keys)."""
    if not ctx.probing or any(jax.dtypes.issubdtype(d, jax.dtypes.extended) for d in dtypes):
        return None
    return [_compat.zeros(v.aval, d) for v, d in zip(eqn.outvars, dtypes, strict=True)]


def _positions(scope: Scope, *groups) -> list[tuple[int, int, np.dtype, bool]]:
    """The casts a probed loop body asked of loop-invariant values, as
    ``(group, index, dtype, weak)``: the value is ``groups[group][index]``
    (the loop's consts, or its xs slices). Positions, unlike the values, hold
    for every trace of the loop."""
    where = {id(v): (g, i) for g, vs in enumerate(groups) for i, v in reversed(list(enumerate(vs)))}
    return [(*where[id(value)], dtype, weak) for value, dtype, weak in scope.requests]


def _scan(ctx: Context, eqn, vals, weak):
    """scan: rebuilt with carries at fixed dtypes, loop-invariant casts hoisted.

    Casts of the scanned-over inputs (a stacked layer's weights) are made once,
    on the whole stack, and scanned over beside the originals.
    """
    params = eqn.params
    n_consts, n_carry = _compat.scan_counts(params)

    def split(seq):  # consts, carries, xs
        return seq[:n_consts], seq[n_consts : n_consts + n_carry], seq[n_consts + n_carry :]

    consts, init, xs = split(vals)
    consts_weak, init_weak, xs_weak = split(weak)
    jaxpr, jaxpr_consts = _compat.jaxpr_and_consts(params["jaxpr"])
    body_weak = [*consts_weak, *[False] * n_carry, *xs_weak]
    const_vars, _, xs_vars = split(eqn.invars)
    ctx = ctx.passing([*const_vars, *[None] * n_carry, *xs_vars], loop=True)

    def run_body(scope_ctx, carry, x_slices):
        outs, _ = eval_jaxpr(
            scope_ctx, jaxpr, jaxpr_consts, [*consts, *carry, *x_slices], body_weak
        )
        return outs[:n_carry], outs[n_carry:]

    xs_avals = [_compat.abstract(x, dtype_of(x), slice_leading=True) for x in xs]
    xs_known = _constants.known(ctx.scope, xs, parts=True)

    def probe(carry_dtypes):
        found = []  # the casts of invariants the body asked (`_positions`), its ys dtypes

        def fn(carry, x_slices):
            with ctx.nested(invariant=[*consts, *x_slices], probing=True) as child:
                _constants.record(child.scope, xs_known, x_slices)
                carry_out, ys = run_body(child, carry, x_slices)
                found[:] = _positions(child.scope, consts, x_slices), [dtype_of(y) for y in ys]
            return carry_out

        carry_avals = [_compat.abstract(c, d) for c, d in zip(init, carry_dtypes)]
        carry_out = jax.eval_shape(fn, carry_avals, xs_avals)
        return [a.dtype for a in carry_out], found

    def solve():
        carry_dtypes, (positions, ys_dtypes) = _fix_carry(ctx, init, init_weak, probe)
        return carry_dtypes, positions, [*carry_dtypes, *ys_dtypes]

    carry_dtypes, requests, out_dtypes = ctx.solved(eqn, vals, weak, solve)
    # Casts of loop invariants are made once, outside the loop; those of whole xs
    # are scanned over beside the originals.
    hoisted_xs = []
    for group, i, dtype, w in requests:
        if group == 1:
            hoisted_xs.append((i, dtype, ctx.scope.cast(xs[i], dtype, w)))
        else:
            ctx.scope.cast(consts[i], dtype, w)

    def body(carry, x_all):
        x_slices, extra = x_all[: len(xs)], x_all[len(xs) :]
        with ctx.nested() as child:
            _constants.record(child.scope, xs_known, x_slices)
            for (i, dtype, _), cast_slice in zip(hoisted_xs, extra):
                child.scope.seed(x_slices[i], dtype, cast_slice)
            new_carry, ys = run_body(child, carry, x_slices)
            return [child.scope.cast(c, d) for c, d in zip(new_carry, carry_dtypes)], ys

    init = [ctx.scope.cast(c, d, w) for c, d, w in zip(init, carry_dtypes, init_weak)]
    abstract = _abstract(ctx, eqn, out_dtypes)
    if abstract is not None:
        return abstract
    carry, ys = lax.scan(
        body,
        init,
        [*xs, *(h[2] for h in hoisted_xs)],
        # From xs where there are any: a symbolic length (jax.export) is no int.
        length=None if xs else params["length"],
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
    cond_ctx = ctx.passing([*eqn.invars[:nc], *[None] * n_carry], loop=True)
    ctx = ctx.passing([*eqn.invars[nc : nc + nb], *[None] * n_carry], loop=True)

    def run_body(scope_ctx, carry):
        outs, _ = eval_closed(
            scope_ctx,
            params["body_jaxpr"],
            [*body_consts, *carry],
            [*body_weak, *[False] * n_carry],
        )
        return outs

    def probe(carry_dtypes):
        positions = []

        def fn(carry):
            with ctx.nested(invariant=body_consts, probing=True) as child:
                outs = run_body(child, carry)
                positions[:] = _positions(child.scope, body_consts)
            return outs

        carry_avals = [_compat.abstract(c, d) for c, d in zip(init, carry_dtypes)]
        out = jax.eval_shape(fn, carry_avals)
        return [a.dtype for a in out], positions

    def solve():
        return _fix_carry(ctx, init, init_weak, probe)

    carry_dtypes, requests = ctx.solved(eqn, vals, weak, solve)
    for _, i, dtype, w in requests:  # loop-invariant casts, made once outside the loop
        ctx.scope.cast(body_consts[i], dtype, w)

    def pred(carry):
        with cond_ctx.nested() as child:
            outs, _ = eval_closed(
                child,
                params["cond_jaxpr"],
                [*cond_consts, *carry],
                [*cond_weak, *[False] * n_carry],
            )
        return outs[0]

    def body_fn(carry):
        with ctx.nested() as child:
            outs = run_body(child, carry)
            return [child.scope.cast(c, d) for c, d in zip(outs, carry_dtypes)]

    init = [ctx.scope.cast(c, d, w) for c, d, w in zip(init, carry_dtypes, init_weak)]
    abstract = _abstract(ctx, eqn, carry_dtypes)
    if abstract is not None:
        return abstract
    if params["cond_jaxpr"].out_avals[0].shape:
        return _while_per_element(pred, body_fn, init)
    return list(lax.while_loop(pred, body_fn, init))


def _while_per_element(pred, body_fn, init):
    """A while whose predicate is an array (`jax.vmap` of a loop with a trip count
    per example): it runs while any element's holds, and each carry's leading
    elements step only while theirs does, as the `while` primitive's lowering does."""

    def body(carry):
        keep = pred(carry)
        new = body_fn(carry)
        dims = tuple(range(keep.ndim))
        return [
            lax.select(lax.broadcast_in_dim(keep, jnp.shape(n), dims), n, c)
            for n, c in zip(new, carry)
        ]

    return list(lax.while_loop(lambda c: jnp.any(pred(c)), body, init))


# The table: primitive name -> rule (custom_jvp, custom_vjp and custom_vmap's are
# in `mpjax.custom_rules`).
HIGHER_ORDER["jit"] = _inline_call
HIGHER_ORDER["pjit"] = _inline_call
HIGHER_ORDER["closed_call"] = _inline_call
HIGHER_ORDER["core_call"] = _inline_call
HIGHER_ORDER["remat2"] = _remat
HIGHER_ORDER["checkpoint"] = _remat
HIGHER_ORDER["shard_map"] = _shard_map
HIGHER_ORDER["cond"] = _cond
HIGHER_ORDER["scan"] = _scan
HIGHER_ORDER["while"] = _while
