"""Run an optimizer's update so that a dropped step leaves its state as it was.

The obvious way, ``jnp.where(drop, old, new)`` on each leaf of the new state,
makes XLA compute each new moment twice: the select is fused into the moment's
pass, so the moment itself is never stored, and the pass that computes the update
from it computes it again (a larger program for XLA to compile, and more work per
step). Here the optimizer's update is traced to a jaxpr and evaluated with each
new state leaf selected against the old one *where it is computed*: everything
after reads the selected value, as the state output does, so XLA stores it once
and reads it back, as it does for the bare optimizer.

What the caller sees is unchanged. When the step is kept, every selected value is
the new one and every result is the optimizer's own. When it is dropped, the state
is the old state, and the updates, computed from a mix of old and new values, are
for the caller to replace by zeros.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from mpjax import _compat, _finite
from mpjax._casting import explicit_sharding

LOOPED = 128
"""On a CPU, leaves of this many elements or more are selected on an iota
comparison (`_broadcast`); smaller ones XLA:CPU compiles without a loop."""


def trace_update(inner, grads, state, params, extra):
    """``inner.update`` traced on these arguments: (closed jaxpr, output shapes)."""

    def run(g, s, p):
        return inner.update(g, s, p, **extra)

    return jax.make_jaxpr(run, return_shape=True)(grads, state, params)


def read_eagerly(inner, grads, state, params, extra) -> list[bool] | None:
    """`read_gradients` of inner traced; None (every gradient read) where inner
    cannot be traced, as a schedule with Python control flow cannot."""
    try:
        return read_gradients(trace_update(inner, grads, state, params, extra), grads)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerIntegerConversionError):  # fmt: skip
        return None


def run_traced(traced, grads, state, params):
    """``inner.update`` as `trace_update` traced it, evaluated on these arguments
    (no second trace of inner)."""
    closed, out_shape = traced
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    flat = jax.core.eval_jaxpr(jaxpr, consts, *jax.tree.leaves((grads, state, params)))
    return jax.tree.unflatten(jax.tree.structure(out_shape), flat)


def read_gradients(traced, grads) -> list[bool]:
    """For each leaf of `grads`, whether inner's update reads its values: one it
    does not read (``optax.set_to_zero`` of a frozen parameter takes only its
    shape) is no gradient of the step's, as torch computes none for it."""
    jaxpr = _compat.jaxpr_and_consts(traced[0])[0]
    needed = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, _compat.Literal))
    return [v in needed for v in jaxpr.invars[: len(jax.tree.leaves(grads))]]


def update_selected(inner, drop, grads, state, params, extra, traced=None):
    """``inner.update(grads, state, params, **extra)``, with the new state already
    ``where(drop, old, new)``. The updates are inner's: zero them where `drop`.
    `traced`: `trace_update`'s result on these arguments, if made already."""
    if not any(_compat.is_tracer(x) for x in jax.tree.leaves((grads, state, params, extra))):
        # Called eagerly: nothing is compiled as a whole, so the plain selects
        # cost nothing more, and each operation runs as inner's own does.
        updates, new = inner.update(grads, state, params, **extra)
        _check_structure(jax.tree.structure(new), state)
        return updates, select(drop, state, new)
    closed, out_shape = traced or trace_update(inner, grads, state, params, extra)
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    old = jax.tree.leaves(state)
    n_updates = len(jax.tree.leaves(out_shape[0]))
    _check_structure(jax.tree.structure(out_shape[1]), state)
    # The state leaves each variable is, where it is of the old leaf's type.
    leaves_of: dict = {}
    for i, var in enumerate(jaxpr.outvars[n_updates:]):
        if not isinstance(var, _compat.Literal) and _same_type(var.aval, old[i]):
            leaves_of.setdefault(var, []).append(i)
    env = dict(zip(jaxpr.constvars, consts))
    kept: dict = {}  # state leaf -> its selected value
    predicates: dict = {}

    def write(var, value):
        env[var] = value
        indices = leaves_of.get(var, ())
        for i in indices:
            which = _predicate(drop, value, predicates)
            kept[i] = lax.select_n(which, value, _sharded_as(old[i], value))
        if indices:
            env[var] = kept[indices[0]]  # what comes after reads the selected value

    for var, value in zip(jaxpr.invars, jax.tree.leaves((grads, state, params))):
        write(var, value)
    # Under jit, each equation is added to the trace as it is (the arguments
    # have the types it was traced with); anything else binds it anew.
    trace = _compat.staging_trace()
    for eqn in jaxpr.eqns:
        outs = _compat.emit(
            trace, eqn, [v if isinstance(v, _compat.Literal) else env[v] for v in eqn.invars]
        )
        # (A dropped output is written too: nothing reads it.)
        for var, value in zip(eqn.outvars, outs):
            write(var, value)
    flat = [_read(env, v) for v in jaxpr.outvars]
    for i, value in enumerate(flat[n_updates:]):
        # Not selected where computed: a constant, or a leaf inner retyped.
        flat[n_updates + i] = (
            kept[i] if i in kept else jnp.where(drop, _sharded_as(old[i], value), value)
        )
    return jax.tree.unflatten(jax.tree.structure(out_shape), flat)


def select(pred: jax.Array, on_true, on_false):
    """``jnp.where(pred, on_true, on_false)`` leaf by leaf, for a bool scalar `pred`.

    One ``select_n`` per leaf: ``jnp.where`` wraps each call in a nested jit,
    which costs trace and compile time on trees of thousands of leaves.
    """
    predicates: dict = {}

    def one(t, f):
        # Either may be the explicitly sharded one (zeros made with no mesh set are not).
        f = _sharded_as(f, t)
        t = _sharded_as(t, f)
        if jnp.result_type(t) != jnp.result_type(f) or jnp.shape(t) != jnp.shape(f):
            return jnp.where(pred, t, f)  # rare: an inner that retypes its state
        return lax.select_n(_predicate(pred, t, predicates), f, t)

    return jax.tree.map(one, on_true, on_false)


def _predicate(pred, like, broadcasts: dict):
    """`pred`, a bool scalar, as the predicate of a selection of `like`: broadcast
    to its shape, once per shape (`broadcasts` holds them). A scalar predicate is
    broadcast anyway, by a select of its own when lowered: a broadcast for every
    leaf, three per leaf of adam, which XLA's passes work through before they
    merge them. Left scalar where `like`'s type says more than its shape: a
    sharding its mesh makes explicit, or ``shard_map`` axes it varies over.
    """
    aval = jax.typeof(like)
    if (
        jnp.ndim(pred)
        or not aval.ndim
        or explicit_sharding(aval)
        or _compat.varying_axes(aval) != _compat.varying_axes(jax.typeof(pred))
    ):
        return pred
    if aval.shape not in broadcasts:
        broadcasts[aval.shape] = _broadcast(pred, aval.shape)
    return broadcasts[aval.shape]


def _broadcast(pred, shape: tuple[int, ...]) -> jax.Array:
    """`pred`, a bool scalar, broadcast to `shape`.

    On a CPU, for `LOOPED` elements or more, as ``iota < (n if pred else 0)``
    along the last axis longer than one, of length n: the same values, which vary
    along the kernel's inner loop. On a predicate the loop does not vary, LLVM
    unswitches the loop: it emits it twice, one copy unrolled, and compiles each
    of the optimizer's kernels about twice over (docs/benchmarks.md).
    """
    if _finite.backend() != "cpu" or math.prod(shape) < LOOPED:
        return lax.broadcast_in_dim(pred, shape, ())
    axis = max(i for i, n in enumerate(shape) if n > 1)
    limit = lax.select(pred, jnp.int32(shape[axis]), jnp.int32(0))
    return lax.broadcasted_iota(jnp.int32, shape, axis) < limit


def _sharded_as(old, new):
    """`old` with `new`'s sharding where the mesh's axes are explicit and the two
    differ, as a selection between them needs: a state made eagerly (optax's
    ``zeros_like`` replicates it) whose update comes out sharded as the gradients,
    as it does without the scaler."""
    was, now = getattr(jax.typeof(old), "sharding", None), explicit_sharding(jax.typeof(new))
    if was is None or now is None or was.spec == now.spec or jnp.shape(old) != jnp.shape(new):
        return old
    return jax.sharding.reshard(old, now)


def _check_structure(new, state) -> None:
    if new != jax.tree.structure(state):
        raise ValueError(
            "grad_scaler: the wrapped optimizer's update returned a state of another "
            f"structure than its init made ({new} against {jax.tree.structure(state)}); "
            "a skipped step must return the old state in its place, so the two must "
            "match, as optax requires."
        )


def _read(env, var):
    return var.val if isinstance(var, _compat.Literal) else env[var]


def _same_type(aval, x) -> bool:
    return aval.shape == jnp.shape(x) and aval.dtype == jnp.result_type(x)
