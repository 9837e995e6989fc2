"""Flax Linen modules and `autocast`: the one use that cannot work, refused loudly.

``autocast(model.apply)`` is the way: `apply` is a pure function of the variables.
An autocast function run inside a Linen method (``@autocast`` on an
``@nn.compact`` method, or ``autocast(lambda x: nn.Dense(3)(x))`` within one) is
traced apart from the module, so at ``init`` the parameters it creates are that
trace's values: they leak out of it, and ``init`` returns tracers without an
error. Inside a Linen method autocast therefore looks for values of its trace left
in the module's variables, and does not reuse traces (what the function reads from
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


def check_function(fun) -> None:
    """A TypeError if `fun` is a Linen module class, a module not bound to variables
    (either would end in Flax's error from inside autocast's trace), or one bound with
    mutable collections (they would be left holding values of autocast's trace)."""
    linen = sys.modules.get("flax.linen")
    if linen is None:
        return
    module = getattr(fun, "__self__", fun)  # a bound method's module
    if isinstance(fun, type) and issubclass(fun, linen.Module):
        got = f"the Flax Linen module class {fun.__name__}"
    elif isinstance(fun, linen.Module) and fun.scope is None:
        got = f"the unbound Flax Linen module {type(fun).__name__}()"
    elif _bound_mutable(module) and not in_module():  # inside one: `no_leaks` checks
        # Its collections would be written from autocast's trace, and keep its values.
        got = f"the Flax Linen module {type(module).__name__} bound with mutable collections"
    else:
        return
    raise TypeError(
        f"autocast(fun): got {got}. Autocast its apply: "
        "mpjax.autocast(model.apply)(variables, x), with mutable=[...] for the "
        "collections it updates."
    )


def _bound_mutable(module) -> bool:
    linen = sys.modules["flax.linen"]
    return isinstance(module, linen.Module) and bool(module.scope and module.scope.mutable)


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
    before = {id(x) for x in jax.tree.leaves(module.variables) if is_tracer(x)}
    yield
    # A traced value that was not in the module before the call is one of the call's
    # own trace, which has ended: it escaped it.
    flat = jax.tree_util.tree_flatten_with_path(module.variables)[0]
    new = [path for path, x in flat if is_tracer(x) and id(x) not in before]
    if not new:
        return
    where = ", ".join(jax.tree_util.keystr(p) for p in new[:3]) + (" ..." if len(new) > 3 else "")
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
        f"in, at {where}: {what}, which would leak out as tracers. {fix}"
    )
