"""`autocast` of a callable pytree (an Equinox module, a bound method of one).

Returned as a plain function, it would hide the module's arrays: a model holding
``autocast(self.mlp)`` as a field would show `eqx.filter_grad` no parameters, and
train nothing. It is a pytree instead, whose child is the module, as Equinox's own
``filter_jit`` and ``filter_checkpoint`` return; called, it passes the module to
the autocast function as an argument, so its arrays are traced as parameters are.
"""

from __future__ import annotations

import jax

from mpjax import _leaves


def holds_arrays(fun) -> bool:
    """Whether `fun` is a pytree with array leaves (not a plain function, a leaf)."""
    return any(_leaves.is_value(x) for x in jax.tree.leaves(fun) if x is not fun)


def call(fun, *args, **kwargs):
    """What the autocast function of a `PytreeFunction` runs: `fun`, passed in."""
    return fun(*args, **kwargs)


@jax.tree_util.register_pytree_node_class
class PytreeFunction:
    """``autocast(module)``: the module as its child, the autocast function of `call`
    (made once, its traces kept across the copies JAX's tree functions make) as its
    static part."""

    def __init__(self, fun, inner):
        self.fun, self._inner = fun, inner

    @property
    def __mpjax_module__(self):  # `mpjax.audit` traces `inner` with the module passed
        return self._inner, self.fun

    def __call__(self, *args, **kwargs):
        return self._inner(self.fun, *args, **kwargs)

    def __repr__(self) -> str:
        return f"mpjax.autocast({self.fun!r})"

    def tree_flatten(self):
        return (self.fun,), self._inner

    @classmethod
    def tree_unflatten(cls, inner, children):
        return cls(children[0], inner)
