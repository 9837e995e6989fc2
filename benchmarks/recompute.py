"""Recomputation in the backward pass: what a gradient pays for the memory it saves.

A `jax.checkpoint` (remat) region keeps its inputs rather than its intermediates
and computes the intermediates again in the backward pass. That trades memory for
compute: a matrix product computed twice would cost far more than the bytes it
saves, an elementwise chain computed twice costs memory traffic. `recompute_report`
finds that work in the program of a whole gradient, forward and backward, from one
abstract trace (nothing runs).

How: the program traced is ``vjp(fun, *args)[1](ct)`` with the output cotangent
``ct`` made from an argument. An equation whose inputs do not depend on ``ct`` is
forward work; one that does is backward work. JAX's partial evaluation hoists the
forward copy of a remat region into the forward pass and leaves, in the backward
pass, a remat equation (``checkpoint``, ``remat2`` as JAX names it) that takes
cotangents. Inside its body, the equations that do not depend on a cotangent are the
forward computation done again (with the coefficients of its derivative, which
without remat the forward pass would have computed and kept): they are the
recomputation.

Limits: it counts equations, not kernels. The bytes are those each recomputed
equation reads and writes (its operands and results, literals aside), the traffic
of running them one by one; XLA fuses an elementwise chain into one kernel that
reads the kept input and writes the values the backward needs, so the traffic on a
device is smaller: ``recomputed_boundary_bytes`` counts only what the recomputation
reads from outside itself and hands to the rest of the backward pass. A recomputed
equation inside a loop counts once per iteration of a `scan` and once for a `while`
loop (whose trip count a trace does not know).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from benchmarks.memory import var_nbytes
from mpjax import _compat

REMAT = frozenset({"checkpoint", "remat", "remat2"})
"""The names JAX (0.10 to 0.12) gives the primitive of `jax.checkpoint`."""

PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})
NOT_WORK = frozenset({"platform_index"})
"""Equations that compute nothing at run time (``lax.platform_dependent``'s choice,
made where the program is lowered)."""


def _is_var(v) -> bool:
    return not isinstance(v, _compat.Literal)


class _Tally:
    def __init__(self):
        self.products = 0
        self.equations = 0
        self.bytes = 0
        self.by_primitive = collections.Counter()
        self.boundary = 0
        self.recomputed = set()  # the values recomputed equations write
        self.crossed = set()  # values counted in `boundary`

    def add(self, eqn, times: int) -> None:
        name = eqn.primitive.name
        moved = sum(var_nbytes(v) for v in (*eqn.invars, *eqn.outvars) if _is_var(v))
        self.equations += times
        self.products += times * (name in PRODUCTS)
        self.bytes += times * moved
        self.by_primitive[name] += times * moved
        self._cross([v for v in eqn.invars if _is_var(v) and v not in self.recomputed], times)
        self.recomputed.update(eqn.outvars)

    def read(self, values, times: int) -> None:
        """Values read by the rest of the backward pass: recomputed ones cross out."""
        self._cross([v for v in values if _is_var(v) and v in self.recomputed], times)

    def _cross(self, values, times: int) -> None:
        for v in values:
            if v not in self.crossed:
                self.crossed.add(v)
                self.boundary += times * var_nbytes(v)

    def alias(self, inner, outer) -> None:
        """Values of a sub-program (`inner`) that are values of its caller
        (`outer`), either way: one value, recomputed and crossing once."""
        for a, b in zip(outer, inner):
            if _is_var(a) and _is_var(b):
                for seen in (self.recomputed, self.crossed):
                    if a in seen:
                        seen.add(b)


def _walk(jaxpr, tainted_in, in_backward_remat: bool, times: int, tally: _Tally) -> list[bool]:
    """Walks `jaxpr` whose invars depend on the cotangent where `tainted_in` says;
    tallies the cotangent-free equations inside remat regions that take a
    cotangent. Returns, per outvar, whether it depends on the cotangent."""
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}

    def dep(v) -> bool:
        return _is_var(v) and v in tainted

    for eqn in jaxpr.eqns:
        ins = [dep(v) for v in eqn.invars]
        outs = _call(eqn, ins, in_backward_remat, times, tally)
        if outs is None:  # a primitive
            if in_backward_remat and not any(ins) and eqn.primitive.name not in NOT_WORK:
                tally.add(eqn, times)
            else:
                tally.read(eqn.invars, times)
            outs = [any(ins)] * len(eqn.outvars)
        tainted.update(v for v, t in zip(eqn.outvars, outs) if t)
    return [dep(v) for v in jaxpr.outvars]


def _enter(sub, outer_ins, tally, in_remat, times, ins) -> list[bool]:
    """Walks `sub`, a sub-program of an equation that passes it `outer_ins`;
    returns which of its results depend on the cotangent."""
    inner, _ = _compat.jaxpr_and_consts(sub)
    tally.alias(inner.invars, outer_ins)
    outs = _walk(inner, ins, in_remat, times, tally)
    tally.alias(outer_ins, inner.invars)  # what crossed inside has crossed
    return outs


def _leave(sub, outer_outs, tally) -> None:
    tally.alias(outer_outs, _compat.jaxpr_and_consts(sub)[0].outvars)


def _call(eqn, ins, in_backward_remat, times, tally):
    """Per output of an equation with sub-programs, whether it depends on the
    cotangent (its sub-programs walked); None for a primitive without any."""
    subs = _compat.sub_jaxprs(eqn.params)
    if not subs:
        return None
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    if name == "scan":
        body = eqn.params["jaxpr"]
        n_consts, n_carry = _compat.scan_counts(eqn.params)
        ins = list(ins)
        while True:  # a carry that takes the cotangent in one iteration takes it in all
            outs = _walk(body, ins, in_backward_remat, 0, _Tally())
            carry = [a or b for a, b in zip(ins[n_consts : n_consts + n_carry], outs[:n_carry])]
            if carry == ins[n_consts : n_consts + n_carry]:
                break
            ins[n_consts : n_consts + n_carry] = carry
        length = times * eqn.params["length"]
        outs = _enter(body, eqn.invars, tally, in_backward_remat, length, ins)
        _leave(body, eqn.outvars, tally)
        return outs
    if name == "cond":
        outs = [any(ins)] * n_out
        for branch in eqn.params["branches"]:
            got = _enter(branch, eqn.invars[1:], tally, in_backward_remat, times, ins[1:])
            _leave(branch, eqn.outvars, tally)
            outs = [a or b or ins[0] for a, b in zip(outs, got)]
        return outs
    inner = [j for j in subs if len(_compat.jaxpr_and_consts(j)[0].invars) == len(ins)]
    if len(subs) == 1 and inner:  # a call: jit, remat, custom_jvp/vjp, shard_map, ...
        remat = in_backward_remat or (name in REMAT and any(ins))
        outs = _enter(inner[0], eqn.invars, tally, remat, times, ins)
        if len(outs) != n_out:
            return [any(ins)] * n_out
        _leave(inner[0], eqn.outvars, tally)
        return outs
    # Anything else (a while loop, ...): its bodies are walked with every input
    # taken as the cotangent's if any is, so only cotangent-free loops count.
    tally.read(eqn.invars, times)
    for sub in subs:
        n_in = len(_compat.jaxpr_and_consts(sub)[0].invars)
        _walk(sub, [any(ins)] * n_in, in_backward_remat, times, tally)
    return [any(ins)] * n_out


def recompute_report(fun, *args) -> dict:
    """The work the backward pass of ``vjp(fun, *args)`` does again (module doc).

    ``recomputed_products``: matrix products and convolutions computed again;
    ``recomputed_equations``: all equations computed again; ``recomputed_bytes``:
    the bytes those equations read and write, also ``by_primitive``;
    ``recomputed_boundary_bytes``: the values the recomputation starts from and
    those it hands to the rest of the backward pass, each once: what it reads and
    writes if it runs as one fused kernel.
    """

    def gradient(args, seed):
        out, vjp = jax.vjp(fun, *args)
        # The cotangent is made from an argument inside the trace (a scalar loss's
        # is the argument itself): one trace, where an output shape asked of
        # `jax.eval_shape` first would be two.
        return vjp(jax.tree.map(lambda o: jnp.broadcast_to(seed.astype(o.dtype), o.shape), out))

    closed = jax.make_jaxpr(gradient)(args, jax.ShapeDtypeStruct((), jnp.float32))
    jaxpr, _ = _compat.jaxpr_and_consts(closed)
    tainted = [False] * (len(jaxpr.invars) - 1) + [True]  # the seed
    tally = _Tally()
    _walk(jaxpr, tainted, False, 1, tally)
    tally.read(jaxpr.outvars, 1)
    return dict(
        recomputed_products=tally.products,
        recomputed_equations=tally.equations,
        recomputed_bytes=tally.bytes,
        recomputed_boundary_bytes=tally.boundary,
        recomputed_by_primitive=dict(tally.by_primitive.most_common()),
    )
