"""Which primitives read a value of a jaxpr, followed through layout.

The walk is iterative: a model written as a Python loop is a chain of adds as long
as it has layers (a residual stream, an accumulator), deeper than Python's stack.
"""

from __future__ import annotations

from collections import defaultdict

from mpjax import _compat, policy

OUTPUT = -1
"""The reader index of a jaxpr's output."""


def read_by(v, eqns, readers, names, through=frozenset(), found=None) -> bool:
    """Whether every reader of `v` is one of the primitives `names`, directly or
    through layout (and the primitives `through`); those readers are added to
    `found`, if given. `readers` maps a variable to the indices of the equations
    reading it (`OUTPUT` for the jaxpr's output)."""
    passing = policy.LAYOUT | through

    def answer(u):  # a generator: yields each variable whose answer it needs
        for i in set(readers[u]):
            name = eqns[i].primitive.name if i != OUTPUT else None
            if name in names:
                if found is not None:
                    found.add(i)
            elif name not in passing:
                return False
            else:
                for o in eqns[i].outvars:
                    if not (yield o):
                        return False
        return True

    seen: dict = {}  # each variable's answer, computed once
    stack, sent = [(v, answer(v))], None
    while True:
        u, walk = stack[-1]
        try:
            needed = walk.send(sent)
        except StopIteration as done:
            seen[u] = sent = done.value
            stack.pop()
            if not stack:
                return sent
            continue
        if needed in seen:
            sent = seen[needed]
        else:
            stack.append((needed, answer(needed)))
            sent = None


def is_mean(eqn, eqns, readers) -> bool:
    """A collective sum whose every result a constant divides, as `lax.pmean`
    does: rounded to 16 bits before the division, n devices' sum of values 16
    bits hold could overflow."""
    if eqn.primitive.name not in ("psum", "psum_invariant"):
        return False
    return all(
        r != OUTPUT
        and eqns[r].primitive.name == "div"
        and eqns[r].invars[0] is v
        and isinstance(eqns[r].invars[1], _compat.Literal)
        for v in eqn.outvars
        for r in readers[v]
    )


def lone_operands(eqns, readers) -> dict:
    """By id of each ``mul`` and ``div`` of `eqns`, the positions of its operands
    that nothing else reads (`readers`: no other equation, no output). A 16-bit one
    that only this operation widens is widened again in the backward pass
    (`_pointwise.widened`) at no cost in precision: its cotangent is rounded once
    either way. A value two operations widen keeps one float32 copy, so that their
    cotangents add in float32 and round once."""
    return {
        id(e): frozenset(
            i
            for i, v in enumerate(e.invars)
            if not isinstance(v, _compat.Literal) and len(readers[v]) == 1
        )
        for e in eqns
        if e.primitive.name in ("mul", "div")
    }


def reader_indices(eqns, outvars, skip=frozenset()) -> defaultdict:
    """Each variable's readers: the indices of the equations reading it (but those in
    `skip`), and `OUTPUT` for the jaxpr's outputs; none for an unread one."""
    readers: defaultdict = defaultdict(list)
    for i, eqn in enumerate(eqns):
        if i not in skip:
            for v in eqn.invars:
                if not isinstance(v, _compat.Literal):
                    readers[v].append(i)
    for v in outvars:
        if not isinstance(v, _compat.Literal):
            readers[v].append(OUTPUT)
    return readers


OBSERVERS = frozenset({"debug_print", "debug_callback", "check"})
"""``jax.debug.print``, ``jax.debug.callback`` and ``checkify.check``: primitives
that look at values and compute none the program reads."""


def observing(eqns, outvars) -> frozenset[int]:
    """Indices of the equations of a jaxpr that only observe: `OBSERVERS`, and the
    equations whose every result only they read (a check's predicate). autocast's
    rewrites count them as no readers, so that printing a value does not change
    what the program computes; they read what the program has (`mpjax.interpreter`)."""
    readers = reader_indices(eqns, outvars)
    found: set = set()
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn.primitive.name in OBSERVERS:
            found.add(i)
        elif not eqn.effects and eqn.outvars and all(
            v in readers and all(r in found for r in readers[v]) for v in eqn.outvars
        ):  # an output's reader, OUTPUT, is never found
            found.add(i)
    return frozenset(found)


# Primitives a factorized matrix passes through on its way (`factorized`): a Gram
# matrix plus a multiple of the identity, an RBF kernel's exp(-|x - y|^2), reshaped.
_TO_FACTORIZATION = policy.POINTWISE | policy.LAYOUT | frozenset(
    {"add_any", "convert_element_type", "stop_gradient"}
)
_CALLS = policy.JITS | frozenset({"closed_call", "custom_jvp_call", "custom_vjp_call"})
_TESTS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "is_finite"})
"""Readers that compute booleans only (``jnp.linalg.cond``'s NaN check on jax 0.12):
they read the product as written as the traced program does, and decide nothing
about its precision."""


def factorized(eqns, outvars) -> frozenset[int]:
    """ids of the matrix products of a jaxpr (`eqns`, `outvars`) whose results only
    linear algebra reads (`policy.FACTORIZATIONS`, through elementwise and layout
    primitives and through nested jits, into their bodies and out of them:
    ``jnp.linalg.cholesky(jnp.clip(x @ x.T, -c, c) + noise * eye)``). Rounded to 16
    bits, a Gram matrix loses its positive definiteness (an eigenvalue of 0.01 became
    negative in bfloat16), and its Cholesky factor is NaN: such a product runs as
    written. Equations that only observe, and those whose results nothing reads,
    are no readers."""
    products = [e for e in eqns if e.primitive.name == "dot_general"]
    if not products:  # most nested jits' bodies: no pass over them for the readers
        return frozenset()
    readers = reader_indices(eqns, outvars, _unused(eqns, outvars))
    out = []
    for e in products:
        paths = _paths(e.outvars, eqns, readers, outvars)
        out += [id(e)] * (paths is not None and paths[0] and not paths[1])
    return frozenset(out)


def _unused(eqns, outvars) -> frozenset[int]:
    """Indices of the equations that only observe (`observing`) or compute values
    nothing reads but such equations (dead code, which XLA removes)."""
    readers = reader_indices(eqns, outvars)
    found: set = set()
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn.primitive.name in OBSERVERS or not eqn.effects and all(
            r in found for v in eqn.outvars for r in readers.get(v, ())
        ):  # an output's reader, OUTPUT, is never found
            found.add(i)
    return frozenset(found)


def _paths(start, eqns, readers, outvars):
    """Where the paths from the variables `start` end: None if one ends in a reader
    other than a factorization, else (whether one ends in a factorization, the
    positions of the jaxpr's outputs they reach)."""
    stack, seen, factorizes, outputs = list(start), set(), False, set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        for i in readers.get(u, ()):
            name = eqns[i].primitive.name if i != OUTPUT else None
            if i == OUTPUT:
                outputs.update(j for j, w in enumerate(outvars) if w is u)
            elif name in policy.FACTORIZATIONS:
                factorizes = True
            elif name in _TESTS:
                continue
            elif name in _TO_FACTORIZATION:
                stack.extend(eqns[i].outvars)
            elif name in _CALLS and (body := _body_paths(eqns[i], u)) is not None:
                factorizes |= body[0]
                stack.extend(eqns[i].outvars[j] for j in body[1])
            else:
                return None
    return factorizes, outputs


def _body_paths(eqn, v):
    """`_paths` from the body's parameters that `eqn` passes its operand `v`; None
    where the body cannot be followed (its outputs, `eqn`'s, in the same order)."""
    bodies = _compat.sub_jaxprs(eqn.params)
    if len(bodies) != 1:
        return None
    body = _compat.jaxpr_and_consts(bodies[0])[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    readers = reader_indices(body.eqns, body.outvars, _unused(body.eqns, body.outvars))
    return _paths(
        [w for w, u in zip(body.invars, eqn.invars) if u is v], body.eqns, readers, body.outvars
    )
