"""Flax NNX modules through `autocast`: their state updates are kept.

A jaxpr interpreter sees only arrays, so writes to a module inside the traced
function (BatchNorm statistics, RNG counters, any `nnx.Variable`) would happen on
a throw-away copy. Here the arguments are split into (graphdef, state), the
function is made pure (state in, new graph and state out), and the caller's
modules are updated from them, as `nnx.jit` does.

Flax is never imported here at module level: `import mpjax` stays free of it.
NNX objects can exist only once `flax.nnx` has been imported, so while it is
absent from `sys.modules` no argument can hold one and nothing is imported.
"""

from __future__ import annotations

import functools
import math
import sys

import jax


def _is_nnx(x) -> bool:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    return isinstance(x, (nnx.Module, nnx.Variable, nnx.Rngs)) or (
        nnx.graph.is_graph_node(x) and not isinstance(x, (tuple, list, dict, nnx.State))
    )


def _is_nnx_or_state(x) -> bool:
    """Where flattening the arguments stops: at NNX objects, and at `nnx.State`s.

    A State (from ``nnx.split``) is a plain pytree of values: the `nnx.Variable`s
    it holds are not a module's, and `fun` gets them traced, like any array. It
    is flattened whole later, so its Variables are never taken for modules.
    """
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and (isinstance(x, nnx.State) or _is_nnx(x))


def _nnx_leaves(tree):
    """The leaves of `tree`, its NNX objects (not those inside a State) kept whole."""
    return jax.tree.flatten(tree, is_leaf=_is_nnx_or_state)


def bound_module(fun):
    """``(module, function)`` when `fun` is an NNX module or a bound method of one.

    Called as `fun`, the module would be closed over, and a write to it from the
    traced function (BatchNorm's statistics) fails; passed as the function's
    first argument, its updates are carried back like any module argument's.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    if isinstance(fun, nnx.Module):
        return fun, type(fun).__call__
    owner = getattr(fun, "__self__", None)
    if isinstance(owner, nnx.Module) and hasattr(fun, "__func__"):
        return owner, fun.__func__
    if isinstance(fun, functools.partial) and fun.args and isinstance(fun.args[0], nnx.Module):
        # A method under a Flax decorator (``@nnx.jit``): a partial of the module.
        call, rest, keywords = fun.func, fun.args[1:], fun.keywords
        return fun.args[0], lambda m, *a, **k: call(m, *rest, *a, **{**keywords, **k})
    return None


def has_nnx_objects(tree) -> bool:
    """Whether the arguments hold NNX objects whose state autocast must carry."""
    if sys.modules.get("flax.nnx") is None:
        return False
    return any(_is_nnx(x) for x in _nnx_leaves(tree)[0])


def call_with_state(call, fun, args, kwargs):
    """Runs ``call(pure_fun, state)`` and carries what `fun` did to the modules back.

    `call` runs a pure function of one pytree argument (the autocast
    interpreter); the state it returns keeps its original dtypes. NNX's update
    context, as `nnx.jit` uses it, carries every change back: Variables, static
    attributes (a flag, ``model.eval()``), submodules created in the call, and
    modules passed twice or inside one another.
    """
    from flax import nnx  # already imported: the arguments hold NNX objects

    leaves, treedef = _nnx_leaves((args, kwargs))
    where = [i for i, x in enumerate(leaves) if _is_nnx(x)]
    tag = object()  # this call's own: nested calls keep their contexts apart
    with nnx.update_context(tag):
        with nnx.split_context(tag) as ctx:
            graphdef, state = ctx.split([leaves[i] for i in where])
        _check_no_refs(state)

        def pure(state, other_leaves):
            with nnx.merge_context(tag, inner=True) as ctx:
                new_nodes = ctx.merge(graphdef, state)
            full = list(other_leaves)
            for i, node in zip(where, new_nodes):
                full[i] = node
            a, k = jax.tree.unflatten(treedef, full)
            out = fun(*a, **k)
            with nnx.split_context(tag) as ctx:
                new_graphdef, new_state = ctx.split(new_nodes)
            # Unchanged values come back as the very tracers that went in.
            same = _same_graph(new_graphdef, graphdef) and _same_leaves(new_state, state)
            return _marked(out, new_nodes), _Static((new_graphdef, same)), new_state

        others = [None if i in where else x for i, x in enumerate(leaves)]
        out, static, new_state = call(pure, (state, others))
        new_graphdef, same = static.value
        if not same:  # else nothing to write: a module from outside a transform reads fine
            _check_writable([leaves[i] for i in where])
            with nnx.merge_context(tag, inner=False) as ctx:
                ctx.merge(new_graphdef, new_state)
    return _unmarked(out, [leaves[i] for i in where])


def _check_no_refs(state) -> None:
    """A TypeError for Variables backed by `jax.Ref`s: NNX's merge inside the trace
    gives them refs of the trace's own, and what the call writes is lost."""
    if any(isinstance(x, jax.Ref) for x in jax.tree.leaves(state)):
        raise TypeError(
            "autocast: an NNX module among the arguments holds Variables backed by jax "
            "Refs (made under nnx.var_defaults(ref=True)). autocast cannot carry back "
            "what a call writes to them (BatchNorm statistics, a decode cache), which "
            "would be lost silently. Make the module without ref=True (the default)."
        )


def _marked(out, nodes):
    """`out` with each argument module (or its submodule, Variable) it returns
    replaced by its place among `nodes`: the caller gets its own object back, as
    from a plain call or `nnx.jit`, not a copy made inside the trace."""
    from flax import nnx

    places = {}
    for j, node in enumerate(nodes):
        for path, sub in nnx.graph.iter_graph(node):
            # Modules, lists of them and Variables; not their attributes' values (a
            # returned True is not the one a layer's `use_bias` holds).
            if nnx.graph.is_graph_node(sub) or isinstance(sub, nnx.Variable):
                places.setdefault(id(sub), (j, tuple(path)))
    leaves, treedef = _nnx_leaves(out)
    marked = [_Place(places[id(x)]) if id(x) in places else x for x in leaves]
    return jax.tree.unflatten(treedef, marked)


def _unmarked(out, originals):
    def resolve(place):
        j, path = place.value
        node = originals[j]
        for key in path:
            indexed = isinstance(node, (list, tuple, dict)) or not isinstance(key, str)
            node = node[key] if indexed else getattr(node, key)  # an nnx.List's by index
        return node

    is_place = lambda x: isinstance(x, _Place)  # noqa: E731
    return jax.tree.map(lambda x: resolve(x) if is_place(x) else x, out, is_leaf=is_place)


def _same_graph(new, old) -> bool:
    """Whether the call left the modules' structure and attributes as they were.

    GraphDefs compare attributes with ``==``, for which a flag set from True to 1,
    or a 0.0 to -0.0, is no change; a plain call keeps it, and so must this.
    """
    if new.with_no_outer_index() != old.with_no_outer_index():
        return False
    pairs = zip(getattr(new, "attributes", ()), getattr(old, "attributes", ()))
    value = lambda attribute: getattr(attribute, "value", None)  # noqa: E731 (a Static's)
    return all(_identical(value(a), value(b)) for (_, a), (_, b) in pairs)


def _identical(a, b) -> bool:
    """For `a` and `b` known equal: whether their types (throughout) and the signs of
    their floats are too."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (tuple, list)):
        return all(map(_identical, a, b))
    if isinstance(a, dict):
        return all(_identical(a[k], b[k]) for k in a) and all(
            type(k) is type(j) for k, j in zip(a, b)
        )
    return True


def _same_leaves(a, b) -> bool:
    (xs, tx), (ys, ty) = jax.tree.flatten(a), jax.tree.flatten(b)
    return tx == ty and all(x is y for x, y in zip(xs, ys))


def _check_writable(nodes) -> None:
    """A TypeError, before anything is written, where the call changed a module it
    cannot write to: one closed over by a JAX transform (``jax.jit(autocast(model))``),
    whose Variables belong to the trace outside it. A failed merge would leave the
    module half rebuilt, without its attributes."""
    from flax import nnx

    for _, node in nnx.graph.iter_graph(nodes):
        if isinstance(node, nnx.Variable) and not getattr(node, "_can_update", True):
            raise TypeError(
                "autocast: the call changed an NNX module (BatchNorm statistics, RNG "
                "counters, an attribute) that a JAX transform closes over, as in "
                "jax.jit(autocast(model)) or jax.grad of a function reading `model`, "
                "so the change cannot be written back. Pass the module through an NNX "
                "transform (nnx.jit, nnx.grad, nnx.value_and_grad) or as an argument, "
                "or call model.eval() first if the call should change nothing."
            )


class _Static:
    """A value handed out of the traced function as it is, not as a pytree."""

    def __init__(self, value):
        self.value = value


class _Place(_Static):
    """Where a returned module sits among the arguments' (`_marked`)."""
