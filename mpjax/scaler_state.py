"""The loss scaler's state, and the helpers that read or change it in an opt_state.

`GradScalerState` is what `grad_scaler`, `static_scaler` and `noop_scaler` keep in
the optimizer state. The helpers find it wherever it sits (at the top, inside
``optax.inject_hyperparams`` or a ``flax.nnx.Optimizer``; around
``optax.chain``, ``optax.multi_transform`` or ``optax.MultiSteps``, never beside
or inside them: that is an error) and give torch's ``get_scale()`` and
``update(new_scale)``, and the numbers to log.
`mpjax.scaler` re-exports them all.
"""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax._compat import is_tracer
from mpjax._float32 import MAX_F32, MIN_NORMAL_F32
from mpjax._scaler_placement import check_placement

__all__ = ["GradScalerState", "SubtreeFlags", "get_scale", "set_scale", "scaler_stats"]


DISABLED, STATIC = -1, -2
"""The growth tracker of a disabled scaler and of a static one, which count no steps."""


class GradScalerState(NamedTuple):
    """State of `grad_scaler`, `static_scaler` and `noop_scaler`.

    Attributes:
      scale: float32 scalar, the factor the loss is multiplied by.
      growth_tracker: int32 scalar, consecutive finite (effective) steps since the
        last growth or skip (torch's ``_growth_tracker``); -1 in the state of a
        disabled scaler (`noop_scaler`), whose scale is 1.0, -2 in a `static_scaler`'s.
        An enabled scaler that finds -1 (a checkpoint restored with scaling switched
        on) takes its own ``init_scale`` at its first update, a static one that finds
        another state its own scale; a disabled one sets the scale to 1.0.
      skipped_steps: int32 scalar, total number of (effective) steps skipped
        because their gradients (or inner's updates) were not finite.
      last_step_skipped: bool scalar, whether the latest effective step was
        skipped.
      micro_step: int32 scalar, micro-batches accumulated since the last effective
        step; always 0 when ``accumulation_steps == 1``.
      grad_accumulator: the mean (or sum) so far of the micro-batch gradients of
        the current effective batch (float32, or wider if the parameters are),
        shaped like the parameters; ``optax.EmptyState()`` when
        ``accumulation_steps == 1``.
      inner_state: the state of the wrapped optimizer.
      nonfinite_subtrees: a `SubtreeFlags`, a mapping from each top-level subtree of the
        parameters (by its path, e.g. ``"['Dense_0']"``; one level further down when the
        top has a single entry, as Linen's ``{"params": ...}``) to a bool scalar: whether
        its gradients in the latest effective step were not all finite. It says where a
        skipped step's infs came from.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler
      >>> state = grad_scaler(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
      >>> state.scale, state.skipped_steps, state.last_step_skipped
      (Array(65536., dtype=float32), Array(0, dtype=int32), Array(False, dtype=bool))
    """

    scale: jax.Array
    growth_tracker: jax.Array
    skipped_steps: jax.Array
    last_step_skipped: jax.Array
    micro_step: jax.Array
    grad_accumulator: Any
    inner_state: optax.OptState
    nonfinite_subtrees: SubtreeFlags | dict = {}


@jax.tree_util.register_pytree_with_keys_class
class SubtreeFlags(Mapping):
    """A read-only mapping from parameter subtree paths to bool scalars.

    Held as one bool vector, `flags`, in the order of `names`: a pytree of one
    leaf, so that the update that computes it has one output for it, not one per
    subtree (each a kernel XLA compiles).

    Examples:
      >>> import jax.numpy as jnp
      >>> from mpjax import SubtreeFlags
      >>> flags = SubtreeFlags(("['a']", "['b']"), jnp.array([False, True]))
      >>> {name: bool(flag) for name, flag in flags.items()}
      {"['a']": False, "['b']": True}
    """

    def __init__(self, names: tuple[str, ...], flags):
        self.names = tuple(names)
        self.flags = flags
        if "flax" in sys.modules:  # a state made or unpickled anywhere can be saved
            register_serialization()

    def __reduce__(self):  # unpickled through __init__
        return SubtreeFlags, (self.names, self.flags)

    def __getitem__(self, name: str) -> jax.Array:
        try:
            i = self.names.index(name)
        except ValueError:
            raise KeyError(name) from None
        return self.flags[..., i]  # an ensemble's flags carry its member axes first

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"SubtreeFlags(names={self.names!r}, flags={self.flags!r})"

    def tree_flatten_with_keys(self):
        if not self.names:  # no leaf: checkpointers refuse an array of no elements
            return (), ()
        return ((jax.tree_util.GetAttrKey("flags"), self.flags),), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, *children) if names else cls((), jnp.zeros([0], jnp.bool_))


@functools.cache
def register_serialization() -> None:
    """Lets `flax.serialization` save and restore a `SubtreeFlags`, by name: the flags are
    the last step's verdict, so a subtree the saved state lacks restores as False."""
    from flax import serialization

    def to_state_dict(x: SubtreeFlags) -> dict:
        return {name: x.flags[..., i] for i, name in enumerate(x.names)}

    def from_state_dict(target: SubtreeFlags, state: dict) -> SubtreeFlags:
        unseen = np.zeros(np.shape(target.flags)[:-1], np.bool_)  # a subtree added since
        flags = [np.asarray(state.get(name, unseen), np.bool_) for name in target.names]
        if not flags:
            return target
        return SubtreeFlags(target.names, jnp.asarray(np.stack(flags, axis=-1)))

    serialization.register_serialization_state(
        SubtreeFlags, to_state_dict, from_state_dict, override=True
    )


# --------------------------------------------------------------------------
# Helpers on an optimizer state.


def get_scale(opt_state: Any) -> jax.Array:
    """The current loss scale held in `opt_state` (torch's ``get_scale()``).

    Args:
      opt_state: an optimizer state holding exactly one `GradScalerState`, at
        its top or inside ``optax.inject_hyperparams``, a ``flax.nnx.Optimizer``
        or its ``opt_state``; not beside other transforms in an ``optax.chain``,
        nor inside ``optax.MultiSteps``, ``optax.multi_transform``,
        ``optax.apply_if_finite`` or another optax wrapper.

    Returns:
      The float32 scalar scale (a device array; no host sync).

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState`, or several, or
        one beside or inside transforms that would train wrongly with it
        (other elements of an ``optax.chain``, ``optax.MultiSteps``...).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, get_scale
      >>> sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      >>> tx = grad_scaler(optax.chain(optax.clip_by_global_norm(1.0), sgd))
      >>> get_scale(tx.init(jnp.zeros(2)))
      Array(65536., dtype=float32)
    """
    return _value(_find_state(opt_state, "get_scale").scale, jnp.float32)


def set_scale(opt_state: Any, new_scale: float | jax.Array) -> Any:
    """`opt_state` with the scale replaced (torch's ``update(new_scale)``).

    The growth tracker is left as it is, except a disabled scaler's -1, which
    becomes 0 (an enabled scaler would start from its ``init_scale`` instead).
    The input is not modified; use the returned state (for a ``flax.nnx.Optimizer``:
    ``optimizer.opt_state = set_scale(optimizer.opt_state, s)``). The scale's
    floor applies at the next backoff, not here.

    Args:
      opt_state: an optimizer state holding exactly one `GradScalerState`.
      new_scale: the new scale: a finite number >= 2**-126, as a Python number
        or a scalar array (a traced one is not checked). For a state with a
        scale per ensemble member (made with ``jax.vmap``), a scalar sets every
        member's, an array of that shape each its own.

    Returns:
      A new optimizer state of the same structure.

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState` or several, or one in a wrapper
        it cannot work in, or a concrete `new_scale` is no normal float32 or not shaped as it.
      TypeError: if `new_scale` is neither a number nor an array, or
        `opt_state` is a ``flax.nnx.Optimizer`` rather than its ``opt_state``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, get_scale, set_scale
      >>> state = grad_scaler(optax.sgd(0.1)).init(jnp.zeros(2))
      >>> get_scale(set_scale(state, 1024.0))
      Array(1024., dtype=float32)
    """
    target = _find_state(opt_state, "set_scale")
    if any(_is_nnx_optimizer_class(c) for c in type(opt_state).__mro__):
        # Its copy would be returned and the optimizer itself left as it was.
        raise TypeError(
            "set_scale: got a flax.nnx.Optimizer; set_scale returns a new state and "
            "changes nothing in place. Write optimizer.opt_state = "
            "mpjax.set_scale(optimizer.opt_state, new_scale)."
        )
    if isinstance(new_scale, (bool, np.bool_)) or not isinstance(
        new_scale, (numbers.Real, jax.Array, np.ndarray, np.floating)
    ):
        raise TypeError(
            f"set_scale: new_scale must be a number or a float32 scalar array, got "
            f"{type(new_scale).__name__} {new_scale!r}."
        )
    if isinstance(new_scale, numbers.Real) and not (
        MIN_NORMAL_F32 <= float(new_scale) <= MAX_F32
    ):
        raise ValueError(
            f"set_scale: new_scale={new_scale!r} must be a finite "
            "float32 number >= 2**-126 (a normal float32)."
        )
    value = jnp.asarray(new_scale, jnp.float32)
    # A vmapped (ensemble) state holds one scale per member: a scalar sets them all.
    shape = jnp.shape(jax.tree_util.tree_leaves(target.scale)[0])
    if value.shape not in ((), shape):
        each = f" or of the state's scale shape {shape}" if shape else ""
        raise ValueError(f"set_scale: new_scale must be a scalar{each}, got shape {value.shape}.")
    if not is_tracer(value) and not np.all(
        (np.asarray(value) >= MIN_NORMAL_F32) & np.isfinite(np.asarray(value))
    ):
        raise ValueError(
            f"set_scale: new_scale={new_scale!r} must hold finite "
            "float32 numbers >= 2**-126 (a normal float32)."
        )
    value = jnp.broadcast_to(value, shape)

    def replace(node):
        if node is not target:
            return node
        # tree.map keeps any wrapper around the leaf (an nnx Variable, say).
        counted = lambda t: jnp.where(t == DISABLED, 0, t)  # noqa: E731
        return node._replace(
            scale=jax.tree.map(lambda _: value, node.scale),
            growth_tracker=jax.tree.map(counted, node.growth_tracker),
        )

    return jax.tree.map(replace, opt_state, is_leaf=_is_scaler_state)


def scaler_stats(opt_state: Any) -> dict[str, jax.Array]:
    """The scaler's numbers for logging, as device arrays (no host sync).

    Args:
      opt_state: an optimizer state holding exactly one `GradScalerState`.

    Returns:
      A dict with ``scale`` (float32), ``growth_tracker`` (int32),
      ``skipped_steps`` (int32: effective steps skipped so far),
      ``last_step_skipped`` (bool: the latest effective step's verdict),
      ``step_applied`` (bool: whether the latest ``update`` applied the
      wrapped optimizer's step: it ended an effective batch, not skipped;
      with ``accumulation_steps=k``, or a wrapped ``optax.MultiSteps``, it is
      False on k - 1 micro-batches in k: count steps with it) and
      ``nonfinite_subtrees`` (a dict from each top-level parameter subtree's path
      to a bool: whether its gradients were not finite in the latest effective
      step).

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState`, or several, or
        one beside or inside transforms that would train wrongly with it
        (other elements of an ``optax.chain``, ``optax.MultiSteps``...).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax.scaler import grad_scaler, scaler_stats
      >>> stats = scaler_stats(grad_scaler(optax.sgd(0.1)).init(jnp.zeros(2)))
      >>> int(stats["skipped_steps"]), bool(stats["last_step_skipped"])
      (0, False)
    """
    state = _find_state(opt_state, "scaler_stats")
    skipped = _value(state.last_step_skipped)
    return {
        "scale": _value(state.scale, jnp.float32),
        "growth_tracker": _value(state.growth_tracker),
        "skipped_steps": _value(state.skipped_steps),
        "last_step_skipped": skipped,
        "step_applied": _step_applied(state, skipped),
        "nonfinite_subtrees": _subtree_values(state.nonfinite_subtrees),
    }


def _step_applied(state: GradScalerState, skipped: jax.Array) -> jax.Array:
    """Not skipped, and the last micro-batch of an effective batch, which resets
    micro_step to 0: the scaler's own and an ``optax.MultiSteps`` it wraps."""
    is_multi_steps = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    applied = (_value(state.micro_step) == 0) & ~skipped
    for s in filter(is_multi_steps, jax.tree.leaves(state.inner_state, is_leaf=is_multi_steps)):
        applied = applied & (_value(s.mini_step) == 0)
    return applied


def _subtree_values(subtrees) -> dict[str, jax.Array]:
    if isinstance(subtrees, SubtreeFlags):
        flags = _value(subtrees.flags)
        return {name: flags[..., i] for i, name in enumerate(subtrees.names)}
    return {name: _value(flag) for name, flag in dict(subtrees).items()}


def _is_nnx_optimizer_class(cls) -> bool:
    return cls.__name__ == "Optimizer" and cls.__module__.startswith("flax.nnx")


def _is_scaler_state(x) -> bool:
    return isinstance(x, GradScalerState)


_INNER_STATE = jax.tree_util.GetAttrKey("inner_state")


def _find_state(opt_state: Any, caller: str) -> GradScalerState:
    """The single `GradScalerState` inside `opt_state`, or a ValueError."""
    found = []

    def search(tree, prefix):
        flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_scaler_state)
        for path, node in flat:
            if _is_scaler_state(node):
                found.append((prefix + path, node))
                # A scaler nested in a scaler would unscale twice: report it too.
                search(node.inner_state, prefix + path + (_INNER_STATE,))

    search(opt_state, ())
    if len(found) == 1:
        check_placement(opt_state, found[0][1], caller)
        return found[0][1]
    if not found:
        # The fields as a mapping; an empty accumulator or flags may have been dropped.
        fields = set(GradScalerState._fields) - {"grad_accumulator", "nonfinite_subtrees"}
        if any(
            isinstance(x, Mapping) and fields <= set(x)
            for x in jax.tree_util.tree_leaves(
                opt_state, is_leaf=lambda x: isinstance(x, Mapping) and fields <= set(x)
            )
        ):
            if type(opt_state).__module__.startswith("flax.nnx"):
                raise ValueError(
                    f"{caller}: `opt_state` is a flax.nnx.State (from nnx.state or "
                    "nnx.split), which holds the scaler's fields without their structure. "
                    "Pass the optimizer's own state, optimizer.opt_state (after nnx.merge "
                    "in the functional API)."
                )
            raise ValueError(f"{caller}: `opt_state` {RESTORED_WITHOUT_TARGET}")
        raise ValueError(
            f"{caller}: no GradScalerState found in `opt_state` (a "
            f"{type(opt_state).__name__}). Build the optimizer with "
            "mpjax.grad_scaler(inner) (or static_scaler/noop_scaler) around the whole "
            "optimizer (inside inject_hyperparams or an nnx.Optimizer if you like). "
            "Pass the state its init returned."
        )
    paths = ", ".join(jax.tree_util.keystr(path) or "<root>" for path, _ in found)
    raise ValueError(
        f"{caller}: found {len(found)} GradScalerStates in `opt_state` (at "
        f"{paths}); the helpers need exactly one. Wrap the whole optimizer in a "
        "single grad_scaler (e.g. grad_scaler(optax.multi_transform(...))) rather "
        "than each part, or pass the sub-state of the scaler you mean."
    )


RESTORED_WITHOUT_TARGET = (
    "holds the GradScalerState's fields as a dict: a checkpoint restored without a "
    "target structure. Restore into the structure tx.init(params) returns "
    "(flax.serialization.from_bytes(tx.init(params), data), or orbax's restore with "
    "it as target)."
)
"""What a scaler's state restored without its structure is told, by each function."""


def _value(field, dtype=None):
    """The array in a state field, unwrapping containers such as nnx Variables."""
    (leaf,) = jax.tree_util.tree_leaves(field)
    return jnp.asarray(leaf, dtype)
