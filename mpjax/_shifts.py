"""The shift by the maximum of a softmax, ``x - max(x)``, found in a jaxpr.

``jax.nn.softmax``, ``log_softmax`` and ``logsumexp``, optax's losses and a
softmax by hand all subtract the maximum before the ``exp``; the interpreter runs
that difference and its maximum in float32 (`mpjax.first_order`), as torch's
``softmax`` and ``log_softmax`` compute in float32 on 16-bit logits.
"""

from __future__ import annotations

import numpy as np

from mpjax import _compat, policy

# Primitives that carry a reduction's result to the operand's shape unchanged.
_CARRIERS = frozenset({
    "broadcast_in_dim", "reshape", "expand_dims", "squeeze", "convert_element_type",
    "stop_gradient", "transpose",
})  # fmt: skip


def max_shifts(jaxpr) -> frozenset:
    """ids of the equations ``x - max(x)``, and of their ``reduce_max``: the shift
    by the maximum of softmax, log_softmax and logsumexp written out (``jax.nn``,
    ``optax``, by hand). They run in float32, as torch's ``softmax`` and
    ``log_softmax`` do: in 16 bits the difference keeps 8 bits (bfloat16) of what
    the exp or log after it reads. The maximum is taken of the same float32 values
    the difference reads: of a 16-bit product's result, XLA may read the rounded
    value in one place and its float32 accumulator in another, and a difference
    above 0 overflows the exp (jax 0.10 on CPU: NaN at logits of 1e5)."""
    made_by = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "sub":
            continue
        found = _max_of(made_by, eqn.invars[1])
        if found is not None and _same(made_by, found.invars[0], eqn.invars[0]):
            out.update((id(eqn), id(found)))
    return frozenset(out)


def _max_of(made_by, v):
    """The ``reduce_max`` equation `v` is the result of, through broadcasts, the
    guard ``max(-inf, m)`` of an empty row and logsumexp's ``where(isfinite(m), m,
    0)`` of an infinite one; None if it is not one."""
    src = None if isinstance(v, _compat.Literal) else made_by.get(v)
    while src is not None:
        name, ins = src.primitive.name, src.invars
        if name == "reduce_max":
            return src
        if name == "max" and sum(isinstance(x, _compat.Literal) for x in ins) == 1:
            src = made_by.get(next(x for x in ins if not isinstance(x, _compat.Literal)))
        elif name in _CARRIERS and not isinstance(ins[0], _compat.Literal):
            src = made_by.get(ins[0])
        elif name == "select_n" and _finite_guard(made_by, src):
            src = made_by.get(ins[2])
        else:
            return None
    return None


def _finite_guard(made_by, select) -> bool:
    """Whether `select` is ``where(isfinite(m), m, c)``, c a constant."""
    pred, other, m = (*select.invars, None)[:3]
    test = None if isinstance(pred, _compat.Literal) else made_by.get(pred)
    if m is None or test is None or test.primitive.name != "is_finite" or test.invars[0] is not m:
        return False
    fill = None if isinstance(other, _compat.Literal) else made_by.get(other)
    return fill is None or (
        fill.primitive.name == "broadcast_in_dim" and isinstance(fill.invars[0], _compat.Literal)
    )


def _same(made_by, a, b) -> bool:
    """Whether `a` and `b` hold the same values: one variable, or the results of two
    calls of one jitted function on the same arguments (``jnp.where(mask, x, -inf)``,
    written twice by ``log_softmax(where=)`` and ``softmax(where=)``); or `b` a
    transpose of `a` (``jax.nn.dot_product_attention`` shifts its logits' transpose,
    the maximum transposed alike)."""
    if a is b:
        return True
    ea, eb = made_by.get(a), made_by.get(b)
    if eb is not None and eb.primitive.name == "transpose" and eb.invars[0] is a:
        return True
    if (
        ea is None
        or eb is None
        or ea.primitive.name not in policy.JITS
        or eb.primitive.name not in policy.JITS
    ):
        return False
    return (
        ea.params.get("name") == eb.params.get("name")
        and len(ea.invars) == len(eb.invars)
        and all(_same_atom(x, y) for x, y in zip(ea.invars, eb.invars))
        and ea.outvars.index(a) == eb.outvars.index(b)
        and a.aval == b.aval
    )


def _same_atom(x, y) -> bool:
    if isinstance(x, _compat.Literal) and isinstance(y, _compat.Literal):
        same_type = (x.aval.shape, x.aval.dtype) == (y.aval.shape, y.aval.dtype)  # weak or not
        return same_type and bool(np.all(np.asarray(x.val) == np.asarray(y.val)))
    return x is y
