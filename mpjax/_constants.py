"""What autocast knows at trace time of the values of a constant.

A weak value (computed from literals alone) never widens an operation, but a
16-bit cast of it must not change what it means: ``x * 1e-8`` and
``x * jnp.full(shape, 1e-8)`` are one computation, and a float16 ``1e-8`` is 0.
Literals are concrete; a constant the program computes is a tracer. `propagate`
follows the values through the equations that make constants: exactly where the
result is small (`EXACT_LIMIT` elements, evaluated at trace time), and as the set
of values it can take (a `ValueSet`) where the equation only moves or selects
values (a literal broadcast by ``jnp.full`` or ``jnp.where``) or computes
elementwise from such sets (``jnp.ones(n) * 1e5``). `fits` then decides as for a
literal. A body a higher-order primitive traces again (a checkpoint's, a branch's,
a loop's) learns what is known of its arguments by `known` and `record`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat
from mpjax import policy
from mpjax._casting import dtype_of, is_concrete, size

EXACT_LIMIT = 1 << 16
"""Elements up to which a computed constant is evaluated at trace time (as many as
a closed-over one is read, `CLOSED_OVER_LIMIT`). A larger one is known only as a
set of values (`ValueSet`), or not at all: it then widens the operation it meets
(`fits`), rather than be cast blind."""

SET_LIMIT = 1024
"""Combinations of values up to which an elementwise function of sets is evaluated."""

# Each element of their result is an element of a floating input.
MOVES_VALUES = policy.LAYOUT | frozenset({
    "convert_element_type", "select_n", "pad", "max", "min", "clamp", "tile", "gather",
    "dynamic_slice", "reduce_max", "reduce_min", "cummax", "cummin", "sort",
})  # fmt: skip


class ValueSet(np.ndarray):
    """The values a constant takes, each once, in place of its elements: what `fits`
    judges, never what an equation is evaluated on (the sum of ``jnp.full(2048,
    40.)`` is not 40)."""


def value_set(values) -> ValueSet:
    return np.unique(np.ravel(values)).view(ValueSet)


CLOSED_OVER_LIMIT = 1 << 16
"""Elements up to which a closed-over jax.Array constant is read at trace time."""


def small(known) -> bool:
    """Whether known values are a NumPy array of at most `CLOSED_OVER_LIMIT`
    elements, cheap to copy or compare by value (not a PRNG key's jax.Array)."""
    return isinstance(known, np.ndarray) and known.size <= CLOSED_OVER_LIMIT


def read_closed_over(x):
    """`x`, a constant of the traced program; a floating jax.Array the function
    closed over (on one device, of up to `CLOSED_OVER_LIMIT` elements) as a NumPy
    array, whose values autocast then knows as a NumPy constant's: a frozen weight
    of 1e5 or 1e-8 makes its product run as written, not inf or 0 in float16. A
    larger one stays on its device, its values unknown, as a parameter's are."""
    if (
        isinstance(x, jax.Array)
        and not _compat.is_tracer(x)
        and policy.is_castable(x.dtype)
        and size(x) <= CLOSED_OVER_LIMIT
        and len(x.sharding.device_set) == 1
    ):
        return np.asarray(x)
    return x


def computed_from_literals(eqn) -> bool:
    """Whether the outputs of `eqn`, given constant inputs, are constants too: not
    those of an equation without inputs (a callback's, an ``axis_index``), but
    ``iota``'s, nor those of a callback or an effect, which run when the program
    does, not when autocast traces it."""
    name = eqn.primitive.name
    if eqn.effects or "callback" in name:
        return False
    return bool(eqn.invars) or name == "iota"


def values(scope, x):
    """The values `x` can take, known at trace time (an array whose elements are
    them), or None."""
    if is_concrete(x):
        return np.asarray(x)
    return scope.constant_values(x)


def starts_a_sum(scope, eqn, x) -> bool:
    """Whether `x`, a constant, is a float32 array of zeros, of the result's shape,
    added to a value: the start of a sum (``acc = jnp.zeros(...)``, then ``acc = acc
    + x @ w``; ``jnp.zeros(n).at[i].add(h)``, ``jax.ops.segment_sum``). It widens the
    add or scatter-add, as a float32 tensor does in torch, so the sum runs in
    float32. (A Python ``0.0`` is weakly typed and widens nothing, in JAX either;
    nor does a 0-d float32 zero in torch.)"""
    if eqn.primitive.name not in ("add", "scatter-add") or scope is None:
        return False
    if jax.typeof(x).weak_type:
        return False
    if jnp.shape(x) != eqn.outvars[0].aval.shape:
        return False
    known = values(scope, x)
    return known is not None and dtype_of(x) == np.float32 and not np.any(known)


def propagate(scope, eqn, vals, outs, first_order: bool) -> None:
    """Records, in `scope`, what is known of the outputs `outs` of `eqn`, an
    equation on weak inputs `vals`: all of them exactly, or its floating ones'
    set of values."""
    if all(is_concrete(o) for o in outs):
        return
    known = [values(scope, x) for x in vals]
    all_known = all(k is not None for k in known)
    if first_order and all_known and not any(isinstance(k, ValueSet) for k in known):
        if all(isinstance(n := size(o), int) and n <= EXACT_LIMIT for o in outs):
            exact = evaluate(eqn, known, outs)
            if exact is not None:
                for o, e in zip(outs, exact):
                    scope.record_constant(o, e)
                return
    floating = [o for o in outs if policy.is_castable(dtype_of(o))]
    if floating and eqn.primitive.name in MOVES_VALUES:
        sources = [k for k, x in zip(known, vals) if policy.is_castable(dtype_of(x))]
        if sources and all(k is not None for k in sources):
            union = np.concatenate([np.ravel(k).astype(np.float64) for k in sources])
            for o in floating:
                scope.record_constant(o, value_set(union.astype(dtype_of(o))))
    elif floating and first_order and all_known and eqn.primitive.name in policy.POINTWISE:
        _elementwise_sets(scope, eqn, known, outs)


def _elementwise_sets(scope, eqn, known, outs) -> None:
    """An elementwise function of constants whose values are known as sets (a large
    ``jnp.ones(n) * 1e5``, ``(1 - causal_mask) * -1e9``): its results lie in the
    function of every combination of its inputs' values, a superset that `fits`
    judges as well. Skipped where the combinations are too many."""
    sets = [value_set(k) for k in known]
    n = int(np.prod([len(v) for v in sets]))
    if n > SET_LIMIT:
        return
    grids = [
        np.asarray(g).ravel().astype(k.dtype)
        for g, k in zip(np.meshgrid(*sets, indexing="ij"), known)
    ]
    flat = [jax.ShapeDtypeStruct((n,), dtype_of(o)) for o in outs]
    results = evaluate(eqn, grids, flat)
    for o, r in zip(outs, results or ()):
        if policy.is_castable(dtype_of(o)):
            scope.record_constant(o, value_set(r))


def evaluate(eqn, known, outs):
    """`eqn` on the concrete inputs `known`, if it gives the outputs' types."""
    try:
        # Evaluated, whatever trace is current: eager constant folding alone
        # leaves an eager shard_map's body tracing.
        with jax.ensure_compile_time_eval(), jax.core.eval_context():
            exact = _compat.bind(eqn, *known)
        # A typed PRNG key stays a jax.Array: its random bits are known in turn.
        exact = [e if jax.dtypes.issubdtype(e.dtype, jax.dtypes.extended) else np.asarray(e)
                 for e in exact]
    except Exception:  # a primitive that cannot run eagerly: nothing is known
        return None
    if any(e.shape != o.shape or e.dtype != o.dtype for e, o in zip(exact, outs)):
        return None
    return exact


def known(scope, xs, parts: bool = False) -> list:
    """What `scope` knows of the values `xs`, for a nested trace in which other
    values stand for them (a checkpoint's or a branch's arguments; `record`); with
    `parts`, for parts of them (the slices a loop body takes of its scanned-over
    values, a shard_map body's shards), as sets, where those take few enough
    elements to gather (`CLOSED_OVER_LIMIT`). NumPy arrays and None: a body's
    closure may keep them past the trace, where it may not keep `xs`, tracers."""
    found = [values(scope, x) for x in xs]
    if parts:
        found = [
            k if k is None or isinstance(k, ValueSet) else value_set(k) if small(k) else None
            for k in found
        ]
    return found


def record(target, known_values, inner) -> None:
    """Records in scope `target` `known_values` (`known`) for the values `inner`."""
    for k, y in zip(known_values, inner):
        if k is not None and not is_concrete(y):
            target.record_constant(y, k)


def record_times(scope, x, factor, product) -> None:
    """Records in `scope` the values of `product`, the constant `x` times the number
    `factor` (a scale moved onto it), where those of `x` are known."""
    known = values(scope, x)
    if known is not None and not is_concrete(product):
        scaled = np.asarray(np.asarray(known) * factor, known.dtype)
        scope.record_constant(product, value_set(scaled) if isinstance(known, ValueSet) else scaled)


def fits(scope, x, dtype) -> bool:
    """Whether a weak value's known values are normal numbers (or 0, inf, NaN)
    in `dtype`: what a cast to it keeps. Unknown values (a constant too large to
    evaluate, ``jnp.arange(4096) * 30.``) are not taken to fit: a cast would
    saturate or flush them silently. A selection's fill counts as any other
    constant: a mask's ``-1e9`` saturated to -65504 would no longer equal the
    ``1e9`` the program compares it with later."""
    if not policy.is_castable(dtype_of(x)):
        return True
    known = values(scope, x)
    return known is not None and _holds(known, dtype)


def _holds(values, dtype) -> bool:
    """Whether `values` are normal numbers (or 0, inf, NaN) in `dtype`."""
    info = jnp.finfo(dtype)
    magnitude = np.abs(np.asarray(values, np.float64))
    finite = magnitude[np.isfinite(magnitude)]
    small = (finite == 0) | (finite >= float(info.smallest_normal))
    return bool(np.all(small & (finite <= float(info.max))))


def scales_fit(scope, vals, weak, low) -> bool:
    """Whether each constant operand of a product in `low`, a 16-bit dtype, keeps its
    scale there: its largest magnitude a normal number (or 0). Beyond that range the
    cast saturates the constant, and the product is finite and wrong (``h @
    jnp.full(s, 1e5)`` in float16); below it, the constant becomes zeros and
    subnormals (``x @ jnp.full(s, 1e-8)`` is 0). Smaller elements beside the largest
    lose precision as a weight's do. A weak operand whose values are unknown does
    not fit (`fits`); other unknown values (a large closed-over weight) are taken to
    fit, as a parameter's are."""
    for x, w in zip(vals, weak):
        if not policy.is_castable(dtype_of(x)):
            continue
        known = values(scope, x)
        if known is None and w:
            return False
        if known is not None and not _holds(largest(scope, known), low):
            return False
    return True


def largest(scope, known) -> float:
    """The largest finite magnitude of `known`, once per array and call: a large
    constant (a frozen weight) read by many products, or in bodies traced twice,
    would be read through at each. Arrays are told apart by their memory (a
    body's closed-over jax.Array is a new NumPy view of it each time), which the
    cache keeps alive, so that no other array takes it."""
    while scope.parent is not None:
        scope = scope.parent
    known = np.asarray(known)
    key = known.__array_interface__["data"][0], known.shape, known.strides, known.dtype
    if key not in scope.magnitudes:
        wide = known if known.dtype.itemsize >= 4 else known.astype(np.float32)
        magnitude = np.abs(wide)
        scope.magnitudes[key] = known, float(np.max(magnitude[np.isfinite(magnitude)], initial=0.0))
    return scope.magnitudes[key][1]


def fill_fits(eqn, low) -> bool:
    """Whether a gather's fill value (``mode="fill"``) is one `low` holds: one it
    cannot (``fill_value=1e6`` in float16) runs the gather as written, rather
    than fill with inf."""
    fill = eqn.params.get("fill_value")
    if fill is None or low is None or not policy.is_castable(eqn.invars[0].aval.dtype):
        return True
    return _holds(fill, low)


def joined(dtypes, known) -> np.dtype:
    """The dtype of an output of a cond's branches: the widest of those computed;
    a constant one (`known` holds its values: a reset to zeros) is held in it
    where it fits, as `jnp.where`'s constant is, and widens it where not, or where
    its values are unknown (None in `known`; False: a computed output)."""
    if all(d == dtypes[0] for d in dtypes):
        return dtypes[0]
    computed = [d for d, k in zip(dtypes, known) if k is False]
    target = policy.widest(computed) if computed else None
    if target is None or not policy.is_castable(target):
        return policy.widest(dtypes)
    if any(k is None or (k is not False and not _holds(k, target)) for k in known):
        return policy.widest(dtypes)
    return target
