"""The parameter subtrees that `GradScalerState.nonfinite_subtrees` names.

Names are made at init from the parameters and matched at each update against the
gradients' paths, so both are read the same way: without the ``.value`` of a
`flax.nnx.Variable` (an ``nnx.Optimizer`` inits on Variables and updates with
their arrays), and for optax.lookahead's `LookaheadParams` from the fast
parameters, whose gradients its update takes.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax

from mpjax import _compat, _finite
from mpjax.scaler_state import GradScalerState, SubtreeFlags, register_serialization


def no_subtree_flags(params) -> SubtreeFlags | jax.Array:
    """The `SubtreeFlags` of `params` with every flag clear, as `init` keeps them."""
    if _compat.is_optax_placeholder(params):
        # optax.tree_map_params inits on a stand-in without leaves, where the
        # names cannot be known: one leaf takes their place, so that its
        # transform_non_params gets the state's SubtreeFlags whole.
        return jnp.zeros([0], jnp.bool_)
    names = tuple(subtree_names(params))
    register_serialization()
    return SubtreeFlags(names, jnp.zeros([len(names)], jnp.bool_))


def gradient_shaped(params):
    """`params` as its gradients come: optax.lookahead's `LookaheadParams` are
    updated with the gradients of their fast parameters only."""
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def subtree_names(params) -> list[str]:
    """The paths of the parameter subtrees `GradScalerState.nonfinite_subtrees` keys."""
    params = gradient_shaped(params)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    levels = depth(params)
    return sorted({name(path, levels) for path, x in flat if _finite.inexact(x)})


def depth(tree) -> int:
    """1, or 2 when the top has a single entry (Linen's ``{"params": ...}``)."""
    top = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if len(top) != 1 or not top[0][0]:
        return 1
    below = jax.tree_util.tree_flatten_with_path(top[0][1])[0]
    return 2 if below and all(_named(path) for path, _ in below) else 1


def name(path, levels: int) -> str:
    """The name of the subtree holding the leaf at `path`, `levels` deep."""
    return jax.tree_util.keystr(_named(path)[:levels]) or "<root>"


def check_named(fn: str, names, paths, segments) -> None:
    """A ValueError where a gradient lies in none of the subtrees `names` of the
    parameters given to init (segment ``len(names)``): the step would still be
    checked, but its flags would say nothing of where an inf came from."""
    for path, segment in zip(paths, segments):
        if segment == len(names):
            raise ValueError(
                f"{fn} update: the gradient at {jax.tree_util.keystr(path) or '<root>'} lies "
                f"in none of the subtrees of the parameters given to init ({', '.join(names)}): "
                "the gradients are not structured as those parameters. Pass init the "
                "parameters the gradients are taken of (with Flax Linen, variables['params'], "
                "not the whole variables)."
            )


def _named(path) -> tuple:
    """A leaf's path without the ``.value`` of the `flax.nnx.Variable` holding it:
    an ``nnx.Optimizer`` inits on Variables and updates with their arrays."""
    return tuple(
        k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")
    )


def _register_export_serialization() -> None:
    """Lets ``jax.export``'s ``Exported.serialize`` save a program whose arguments or
    results hold the scaler's state: its NamedTuple, and the subtree flags, whose
    auxiliary data is the tuple of their names."""
    try:
        jax.export.register_namedtuple_serialization(
            GradScalerState, serialized_name="mpjax.GradScalerState"
        )
        jax.export.register_pytree_node_serialization(
            SubtreeFlags,
            serialized_name="mpjax.SubtreeFlags",
            serialize_auxdata=lambda names: json.dumps(list(names)).encode(),
            deserialize_auxdata=lambda data: tuple(json.loads(data)),
        )
    except ValueError:  # registered already: mpjax imported again (importlib.reload)
        pass


_register_export_serialization()
