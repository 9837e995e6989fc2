"""The programs an autocast function traced eagerly, by argument signature.

An eager call of ``autocast(f)`` traces `f` to a jaxpr before evaluating it under
the policy. Called again with arguments of the same signature, it reuses that
jaxpr, as `jax.jit` reuses its traces: the signature is the argument pytree's
structure, each array leaf's shape, dtype, weak type and sharding, and the value
of every other (static) leaf.

Unlike `jax.jit`, a trace is reused only where nothing it holds can have changed
since: a function that reads arrays from outside its arguments (a model object
called as the function, a global array) is traced at every call, since a trained
parameter would otherwise come back with its old value; so is a call with a static
leaf that could be mutated in place (an object, rather than a number or string),
and a function that returns such an object, which each call returns afresh.
Scalars read from outside (a global Python number, a NumPy scalar or 0-d array)
are literals of the jaxpr, not constants: fixed at the first trace, as under jit.
Calls inside another trace are never cached, since values closed over from that
trace would be baked into the jaxpr's constants.
"""

from __future__ import annotations

import collections
import enum
import types

import jax
import numpy as np

from mpjax import _compat


class TraceCache:
    """A least-recently-used map from argument signature to (jaxpr, output shapes)."""

    def __init__(self, maxsize: int = 64):
        self.maxsize = maxsize
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def __reduce__(self):  # a pickled autocast function traces afresh where it lands
        return TraceCache, (self.maxsize,)

    def key(self, leaves, treedef, dynamic):
        """The signature of a call, or None where the call cannot be cached: an
        argument is a tracer, or a static leaf is unhashable."""
        dynamic_set = set(dynamic)
        signature = []  # leaf by leaf: which are arrays is part of the signature
        for i, x in enumerate(leaves):
            if i in dynamic_set:
                if _compat.is_tracer(x):
                    return None
                sharding = getattr(x, "sharding", None)
                signature.append((x.shape, x.dtype, getattr(x, "weak_type", False), sharding))
            else:
                signature.append(_static(x))
        signature.append(_static(_aux_data(treedef)))  # a pytree node's own static fields
        if any(s is _MUTABLE for s in signature):
            return None  # an attribute `fun` reads may change before the next call
        key = (treedef, _compat.trace_context(), tuple(signature))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def get(self, key):
        if key is None:
            return None
        try:
            entry = self._entries.get(key)
        except (TypeError, ValueError):  # a static leaf whose == raises: trace again
            return None
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key, closed, out_shape, returned=()) -> None:
        """Stores a trace, unless it has constants, its calls' included: arrays `fun`
        read from outside its arguments (parameters that training replaces, tracers
        of an outer trace); or unless a non-array leaf `fun` `returned` could be
        mutated (a NumPy array, a set): each call returns objects of its own."""
        if key is None or _has_constants(closed):
            return
        if any(_static(x) is _MUTABLE for x in returned):
            return
        self._entries[key] = (closed, out_shape)
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)


# Static leaves whose value is all a trace can have read from them.
_IMMUTABLE = (bool, int, float, complex, str, bytes, types.NoneType, enum.Enum, np.dtype)
_IMMUTABLE += (np.datetime64, np.timedelta64)  # NumPy's scalars that are not traced
# Modules whose classes (dtypes such as jnp.bfloat16) no program changes.
_LIBRARIES = ("builtins", "numpy", "jax", "ml_dtypes")
_MUTABLE = object()


def _static(x):
    """A static value as a key: typed, since 1, 1.0 and True trace differently, and
    so do 0.0 and -0.0 (equal, but ``x / s`` is inf for one, -inf for the other);
    `_MUTABLE` for one `fun` could read changed attributes of (a user's object or
    class)."""
    if isinstance(x, (tuple, list, frozenset)):
        items = tuple(_static(v) for v in x)
        return _MUTABLE if any(v is _MUTABLE for v in items) else (type(x), items)
    if isinstance(x, type):
        return (type, x) if x.__module__.split(".")[0] in _LIBRARIES else _MUTABLE
    if not isinstance(x, _IMMUTABLE):
        return _MUTABLE
    if isinstance(x, float):
        return (float, x.hex())
    if isinstance(x, complex):
        return (complex, x.real.hex(), x.imag.hex())
    return (type(x), x)


def _aux_data(treedef) -> tuple:
    """The static data of every node of `treedef` (a dict's keys, a dataclass's
    static fields), which its equality compares loosely (1 == 1.0)."""
    node = treedef.node_data()  # None for a leaf
    if node is None:
        return ()
    return (node[1], *(_aux_data(child) for child in treedef.children()))


def _has_constants(closed) -> bool:
    """Whether `closed`, or a jaxpr it calls (a nested jit's, a branch's), holds
    constants: its consts, or literals holding arrays (which they are with
    ``jax_use_simplified_jaxpr_constants``)."""
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    if consts or any(_array_literal(v) for e in jaxpr.eqns for v in e.invars):
        return True
    return any(map(_array_literal, jaxpr.outvars)) or any(map(_has_constants, _called(jaxpr)))


def _array_literal(v) -> bool:
    """A literal that holds an array read from outside (not a scalar of the
    program, which a NumPy 0-d array in a literal may be)."""
    if not isinstance(v, _compat.Literal):
        return False
    return isinstance(v.val, jax.Array) or (isinstance(v.val, np.ndarray) and v.val.ndim > 0)


def _called(jaxpr):
    """The jaxprs in the params of `jaxpr`'s equations, as held (with constants)."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield sub
