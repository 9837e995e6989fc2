"""Flax Linen modules and `autocast`: the one use that cannot work, refused loudly.

``autocast(model.apply)`` is the way: `apply` is a pure function of the variables.
An autocast function run inside a Linen method (``@autocast`` on an
``@nn.compact`` method, or ``autocast(lambda x: nn.Dense(3)(x))`` within one) is
traced apart from the module, so the values it stores in the module (parameters
created at ``init``, a BatchNorm's statistics) would be that trace's: they would
leak out of it without an error. So inside a Linen method autocast refuses the
module as an argument (the decorated method), runs as written at ``init`` (which
creates the parameters, float32 either way), looks for values of its trace left in
the module's variables, and does not reuse traces (what the function reads from
the module is not among its arguments).

Flax is never imported here: while ``flax.linen`` is absent from `sys.modules`
no Linen module can be running.
"""

from __future__ import annotations

import contextlib
import sys

import jax

from mpjax._compat import is_tracer

_FIX = (
    "Autocast the whole model from outside instead: "
    "mpjax.autocast(model.apply)(variables, x), for init as for apply "
    "(mpjax.autocast(model.init) if init must run in mixed precision too)."
)


def in_module() -> bool:
    """Whether a Flax Linen module's method is running (its scope is current)."""
    linen = sys.modules.get("flax.linen.module")
    stack = getattr(getattr(linen, "_context", None), "module_stack", None)
    return bool(stack) and stack[-1] is not None


def initializing() -> bool:
    """Whether the running Linen module is being initialized (``model.init``)."""
    module = sys.modules["flax.linen.module"]._context.module_stack[-1]
    return bool(module.is_initializing())


_APPLY = (
    "Autocast its apply: mpjax.autocast(model.apply)(variables, x), with "
    "mutable=[...] for the collections it updates."
)


def check_function(fun) -> None:
    """A TypeError if `fun` is a Linen module class: calling it builds a module, not
    a result."""
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(fun, type) and issubclass(fun, linen.Module):
        raise TypeError(f"autocast(fun): got the Flax Linen module class {fun.__name__}. {_APPLY}")


_BINDING = frozenset({"apply", "init", "init_with_output"})


@contextlib.contextmanager
def checked_call(fun):
    """Errors naming the fix where `fun` is a Linen module (or its method) that
    cannot run under autocast: unbound, where Flax raises from inside the trace (one
    that needs no variables runs), or bound with mutable collections that the call
    wrote (they now hold values of autocast's ended trace; a call that writes
    nothing runs)."""
    linen = sys.modules.get("flax.linen")
    module = getattr(fun, "__self__", fun)  # a bound method's module
    # `model.apply` (`init`) binds the variables it is given: Flax's errors are the user's
    binds = getattr(fun, "__name__", None) in _BINDING
    if linen is None or not isinstance(module, linen.Module) or binds or in_module():
        yield  # inside a module, `no_leaks` checks
        return
    name = type(module).__name__
    if module.scope is None:
        try:
            yield
        except sys.modules["flax.errors"].FlaxError as e:
            raise TypeError(
                f"autocast(fun): got the unbound Flax Linen module {name}(), "
                f"which Flax cannot run ({type(e).__name__}). {_APPLY}"
            ) from e
        return
    with _left_in(module) as new:
        yield
    if new:
        raise TypeError(
            f"autocast(fun): got the Flax Linen module {name} bound with mutable "
            f"collections, and the call wrote them ({_where(new)}): they now hold values "
            f"of autocast's trace, not arrays; bind the variables again. {_APPLY}"
        )


def check_arguments(args, kwargs) -> None:
    """A TypeError if a Linen module is among the arguments (``@autocast`` on a method)."""
    linen = sys.modules.get("flax.linen")
    leaves = jax.tree.leaves((args, kwargs))
    module = next((x for x in leaves if isinstance(x, linen.Module)), None)
    if module is not None:
        raise TypeError(
            f"autocast: an argument is the Flax Linen module {type(module).__name__} "
            "(autocast used as a decorator on its method?). Autocast traces it apart "
            "from its variables: at init the parameters leak out as tracers. " + _FIX
        )


@contextlib.contextmanager
def no_leaks():
    """A ValueError if the call left a value of its trace in the running Linen module."""
    module = sys.modules["flax.linen.module"]._context.module_stack[-1]
    with _left_in(module) as new:
        yield
    if not new:
        return
    if any(str(getattr(p[0], "key", "")) == "params" for p in new):
        what = "parameters created at init"
        fix = _FIX
    else:  # batch_stats in training, a decode cache, a sow
        what = "the update of a mutable collection (BatchNorm's statistics, a decode cache, a sow)"
        fix = (
            "A region traced apart from the module cannot write to it: call that layer "
            "outside the nested autocast region (its own dtype= argument sets its "
            "precision); the model autocast from outside, mpjax.autocast(model.apply)"
            "(variables, x, mutable=[...]), carries such updates out."
        )
    raise ValueError(
        f"autocast: the function stored traced values in the Flax Linen module it runs "
        f"in, at {_where(new)}: {what}, which would leak out as tracers. {fix}"
    )


@contextlib.contextmanager
def _left_in(module):
    """The paths of `module`'s variables that hold, after the block, a traced value
    they did not hold before: one of the block's own trace, which has ended."""
    before = {id(x) for x in jax.tree.leaves(module.variables) if is_tracer(x)}
    new: list = []
    yield new
    flat = jax.tree_util.tree_flatten_with_path(module.variables)[0]
    new += [path for path, x in flat if is_tracer(x) and id(x) not in before]


def _where(paths) -> str:
    return ", ".join(jax.tree_util.keystr(p) for p in paths[:3]) + (" ..." * (len(paths) > 3))
