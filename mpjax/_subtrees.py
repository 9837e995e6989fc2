"""The parameter subtrees that `GradScalerState.nonfinite_subtrees` names.

Names are made at init from the parameters and matched at each update against the
gradients' paths, so both are read the same way: a `flax.nnx.Variable`'s array by
the Variable's path (an ``nnx.Optimizer`` inits on Variables and updates with
their arrays), and for optax.lookahead's `LookaheadParams` from the fast
parameters, whose gradients its update takes.
"""

from __future__ import annotations

import json
import sys

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
    levels = depth(params)
    return sorted({name(path, levels) for path, x in named_leaves(params) if _finite.inexact(x)})


def named_leaves(tree) -> list:
    """``tree_flatten_with_path(tree)[0]``, with a `flax.nnx.Variable`'s leaves named
    by the Variable's path: an ``nnx.Optimizer`` inits on Variables and updates
    with their arrays. (A field of the user's own named ``value`` keeps its name.)"""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]
    return [
        (path, leaf)
        for path, x in flat
        for leaf in (jax.tree.leaves(x) if _is_variable(x) else [x])
    ]


def depth(tree) -> int:
    """1, or 2 when the top has a single entry (Linen's ``{"params": ...}``)."""
    top = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if len(top) != 1 or not top[0][0] or _is_variable(top[0][1]):
        return 1
    below = named_leaves(top[0][1])
    return 2 if below and all(path for path, _ in below) else 1


def name(path, levels: int) -> str:
    """The name of the subtree holding the leaf at `path`, `levels` deep."""
    return jax.tree_util.keystr(tuple(path)[:levels]) or "<root>"


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


def check_accumulable(grads, accumulator, k: int, name: str = "grad_scaler") -> None:
    """An error naming the fix unless `grads` is shaped as `accumulator`, made at
    init (a TypeError for a state made without accumulation)."""
    where = f"{name} update with accumulation_steps={k}"
    if isinstance(accumulator, optax.EmptyState):
        raise TypeError(
            f"{where}: the state was made by a scaler without accumulation (its "
            "grad_accumulator is empty). Make the state with this transformation's "
            "init, or restore the checkpoint with the accumulation_steps it was saved with."
        )
    got, want = jax.tree.structure(grads), jax.tree.structure(accumulator)
    if got != want:
        raise ValueError(
            f"{where}: the gradients are not structured as the parameters given to "
            f"init, for which the accumulator was made.\n  gradients: {got}\n  "
            f"accumulator: {want}\nPass init the parameters the gradients are taken of."
        )
    for (path, g), a in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(accumulator)
    ):
        if jnp.shape(g) != jnp.shape(a):
            raise ValueError(
                f"{where}: the gradient at {jax.tree_util.keystr(path) or '<root>'} has "
                f"shape {jnp.shape(g)}, its accumulator (the parameter's) {jnp.shape(a)}: "
                "gradients are summed over micro-batches only when shaped as their "
                "parameters (per-example gradients would be added example by example "
                "across micro-batches). Reduce them to the parameters' shapes first."
            )


def _is_variable(x) -> bool:
    nnx = sys.modules.get("flax.nnx")  # no Variable exists unless Flax NNX is imported
    return nnx is not None and isinstance(x, nnx.Variable)


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
