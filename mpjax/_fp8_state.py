"""Flax's fp8 products under a loss scale: their gradient statistics in the loss's units.

Flax's fp8 layers (``nn.Fp8DirectDotGeneralOp``, ``nn.Fp8Einsum``,
``nn.Fp8DotGeneralOp``) quantize the output gradient to e5m2 with a scale derived
from a history of its past maxima (delayed scaling). Scale and history live in the
``_overwrite_with_gradient`` collection; the backward pass returns their new values
as that collection's "gradients", and the training step writes them back.

A loss scale multiplies the output gradient the history measures. Kept as Flax
keeps it, the history is stale whenever the loss scale changes: on the first step
(scale 1, empty history) the default loss scale saturated e5m2, a gradient error of
0.86 against float32 where the same step without a scaler has 0.05, applied as a
finite step (``python -m benchmarks.cases``). So the statistics are kept in the
loss's own units: multiplied by the loss scale on the way in, divided on the way
out, and the e5m2 quantization is the one an unscaled step makes, whatever the
loss scale. A step whose gradients are not
finite returns the collection as it was given, as the scaler leaves the parameters
and the optimizer state: its inf or NaN would otherwise stay in the history, holding
the layer's gradient scale still for as many steps as the history is long.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mpjax import _finite

COLLECTION = "_overwrite_with_gradient"
"""``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``."""

_GRADIENT_STATISTICS = ("output_grad_scale", "output_grad_amax_history")
"""The variables of Flax's fp8 layers that measure the output gradient; the others
(the input's and the kernel's) measure the forward pass, which knows no loss scale."""


def kind(path) -> str | None:
    """``"gradient"`` or ``"forward"`` for a leaf of the fp8 collection at `path`,
    None for any other leaf."""
    keys = [getattr(k, "key", None) for k in path]
    if COLLECTION not in keys:
        return None
    return "gradient" if keys[-1] in _GRADIENT_STATISTICS else "forward"


def holds_state(tree) -> bool:
    """Whether `tree` holds a leaf of the fp8 collection."""
    return _holds(jax.tree_util.tree_flatten_with_path(tree)[0])


def _holds(paths) -> bool:
    return any(kind(path) for path, _ in paths)


def scaled(args, scale: jax.Array):
    """`args` with the fp8 gradient statistics in the scaled loss's units (`args`
    itself where it holds none: rebuilt, an NNX module would be a copy)."""
    if not holds_state(args):
        return args

    def one(path, x):
        if kind(path) != "gradient" or not _finite.inexact(x):
            return x
        return (jnp.asarray(x, jnp.float32) * scale).astype(jnp.result_type(x))

    return jax.tree_util.tree_map_with_path(one, args)


def kept_where_not_finite(grads, given):
    """`grads`, whose fp8 collection is `given`'s where any other gradient is not
    finite. `given` is the differentiated arguments, `grads`' structure."""
    paths, structure = jax.tree_util.tree_flatten_with_path(grads)
    if not _holds(paths) or structure != jax.tree.structure(given):
        return grads  # none, or a transform that filters its arguments
    others = [g for path, g in paths if kind(path) is None and _finite.inexact(g)]
    bad = _finite.leaf_flags(others)[2]

    def one(path, g, old):
        return jnp.where(bad, old, g) if kind(path) else g

    return jax.tree_util.tree_map_with_path(one, grads, given)
