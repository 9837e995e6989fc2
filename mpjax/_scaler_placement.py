"""Where a scaler's state may sit in an optimizer state, and the errors where it may not.

A scaler must wrap everything that transforms the gradients: a skipped step then
changes nothing. Each placement refused here trains wrongly without an error of
its own, so the helpers (`get_scale`, `scaled_value_and_grad`...) refuse it.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import optax

_FIX = "Put the whole optimizer inside one scaler: grad_scaler(optax.chain(...))."

# Wrappers a scaler cannot work inside, and why.
MISPLACED = {
    optax.ApplyIfFiniteState: (
        "the grad_scaler is wrapped in optax.apply_if_finite, which skips non-finite "
        "steps before the scaler sees them: the scale never backs off and "
        "skipped_steps stays 0. grad_scaler skips those steps itself: drop "
        "apply_if_finite."
    ),
    optax.MultiStepsState: (
        "the grad_scaler is wrapped in optax.MultiSteps, which resets its accumulator "
        "by multiplying it by 0: one overflowing micro-batch leaves a NaN there (0 * "
        "inf), and every later step is skipped. Accumulate in the scaler instead: "
        "grad_scaler(inner, accumulation_steps=k)."
    ),
    optax.MaskedState: (
        "the grad_scaler sits inside optax.multi_transform (or optax.masked), so it "
        "sees only part of the parameters: the others' gradients are not checked, and "
        "an overflow there (their loss is scaled too) is applied. Wrap the whole "
        "optimizer: grad_scaler(optax.multi_transform(...))."
    ),
}

# The states of optax's chains: a plain tuple of the transforms' states, and (named)
# an OrderedDict of them.
_CHAINS = {tuple: "optax.chain", collections.OrderedDict: "optax.named_chain"}

# optax states that may hold a scaler: inject_hyperparams only feeds it settings.
_TRANSPARENT = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def check_placement(opt_state: Any, target: Any, caller: str) -> None:
    """A ValueError if `target`, a scaler state in `opt_state`, sits where it trains wrongly."""
    ancestors = _ancestors(opt_state, target) or []
    for node in ancestors:  # the wrappers with a message of their own first
        if type(node) in MISPLACED:
            raise ValueError(f"{caller}: {MISPLACED[type(node)]}")
    for node, child in zip(ancestors, [*ancestors[1:], target]):
        if type(node) in _CHAINS and len(node) > 1 and _chained(node, child):
            raise ValueError(
                f"{caller}: the grad_scaler is one of {len(node)} transforms of an "
                f"{_CHAINS[type(node)]}. The others do not take part in its skip: before "
                "it, they run on every step (optax.clip hides an inf from it); after it, "
                "they run on a skipped step's zero updates (momentum and weight decay "
                f"still move the parameters). {_FIX} (A tuple of your own holding several "
                "optimizers' states looks like a chain's: pass this helper the scaler's "
                "own state, or hold them in a list or a dict.)"
            )
        if _is_optax_state(node) and not isinstance(node, _TRANSPARENT):
            raise ValueError(
                f"{caller}: the grad_scaler sits inside an optax wrapper whose state is "
                f"{type(node).__name__}; the wrapper keeps running on a skipped step. "
                f"{_FIX}"
            )


def _chained(node, child) -> bool:
    """Whether `node`, a tuple holding `child`, is a chain's state rather than the
    user's own tuple such as ``(params, opt_state)``: beside a transform's state, a
    chain holds only other transforms' states."""
    others = node.values() if isinstance(node, collections.OrderedDict) else node
    return all(_transform_state(x) for x in others if x is not child)


def _transform_state(x) -> bool:
    """Whether `x` may be a transform's state: a NamedTuple (optax's ``EmptyState()``
    and every state of its own), a chain's tuple of them, or None (a hand-written
    transform's). A list, a dict, an array, a number or a string is the user's."""
    if x is None or hasattr(x, "_fields"):
        return True
    if type(x) in _CHAINS:
        return all(map(_transform_state, x.values() if isinstance(x, dict) else x))
    return False


def _is_optax_state(node) -> bool:
    return isinstance(node, tuple) and type(node).__module__.split(".")[0] == "optax"


def _ancestors(tree: Any, target: Any) -> list | None:
    """The nodes on the path from `tree` down to `target` (excluded), or None."""
    if tree is target:
        return []
    children = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)[0]
    if len(children) == 1 and children[0] is tree:
        return None  # a leaf
    for child in children:
        below = _ancestors(child, target)
        if below is not None:
            return [tree, *below]
    return None
