"""`scaled_value_and_grad`: true gradients, computed with the loss scaled inside.

Float16 gradients underflow unless the loss is multiplied by a large factor before
differentiation. Here the multiplication and the division that undoes it happen in
one function: the loss is scaled by the scale held in the optimizer state, the
scaled loss is differentiated, and the gradients are divided by the scale again, in
float32, before they are returned. So the gradients a user sees, logs, clips or
all-reduces are the gradients of the loss, and the scaler's ``update`` takes the
gradients of the loss: gradients from plain ``jax.grad`` or ``nnx.grad`` train
correctly too (without the underflow protection the scaling gives).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat, _fp8_state
from mpjax._casting import promoted
from mpjax._float32 import reciprocal
from mpjax._regions import SCALED
from mpjax.scaler_state import _find_state, _value

__all__ = ["scaled_value_and_grad"]

_NAME = "scaled_value_and_grad"


def scaled_value_and_grad(
    fun: Callable[..., Any],
    opt_state: Any,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    value_and_grad: Callable[..., Callable[..., Any]] | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad(fun)``, with the loss scaled inside.

    The returned function takes `fun`'s arguments and returns ``(value, grads)``
    (``((value, aux), grads)`` with `has_aux`): `value` is `fun`'s own loss, and
    `grads` the gradients of that loss, ready for the scaler's ``update``. They are
    computed as the gradients of ``loss * scale`` (``scale`` read from `opt_state`,
    float32), then multiplied by float32 ``1 / scale``, so that small 16-bit
    gradients do not underflow in the backward pass (torch's ``scaler.scale(loss)
    .backward()`` followed by ``scaler.unscale_``). A gradient that overflowed stays
    inf or NaN, and the scaler's ``update`` skips the step. Call it inside the
    training step, each step: the scale changes as training goes.

    Flax NNX modules among the differentiated arguments are differentiated with
    ``nnx.value_and_grad`` (with respect to their ``nnx.Param`` state).

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
        `has_aux`.
      opt_state: an optimizer state holding exactly one `GradScalerState`.
      argnums: as for ``jax.value_and_grad``; or an ``nnx.DiffState`` (for
        ``nnx.value_and_grad``: the LoRA parameters alone, say).
      has_aux: as for ``jax.value_and_grad``.
      value_and_grad: the transform, called as ``value_and_grad(f, has_aux=True)``
        (``argnums=`` too, unless 0: ``eqx.filter_value_and_grad`` fits). Default:
        ``jax.value_and_grad``, or ``flax.nnx.value_and_grad`` for NNX modules.

    Returns:
      A function with `fun`'s signature returning ``(value, grads)``.

    Raises:
      ValueError: if `opt_state` holds no `GradScalerState` (or several, or one
        inside a wrapper it trains wrongly in, e.g. ``optax.MultiSteps``); when
        called, if `fun` does not return a scalar floating loss (or a
        ``(loss, aux)`` pair with `has_aux`), with the fix in the message, or if
        built outside a jit (or scan) from a dynamic scaler's state, inside it.
      TypeError: if `fun` is not callable.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax import grad_scaler, scaled_value_and_grad
      >>> state = grad_scaler(optax.sgd(0.1), init_scale=4.0).init(jnp.zeros(2))
      >>> scaled_value_and_grad(lambda w: jnp.sum(w**2), state)(jnp.ones(2))
      (Array(2., dtype=float32), Array([2., 2.], dtype=float32))
    """
    if not callable(fun):
        raise TypeError(
            f"{_NAME}(fun, opt_state): fun must be the loss function, got {type(fun).__name__}."
        )
    argnums = _checked_argnums(argnums)
    state = _find_state(opt_state, _NAME)
    scale, check_current = _value(state.scale, jnp.float32), _current_scale_check(state)

    def wrapped(*args, **kwargs):
        check_current()
        transform = _value_and_grad_for(args, argnums, value_and_grad)

        def step(s):
            given = _fp8_state.scaled(args, s)  # Flax fp8's, in the scaled loss's units
            with jax.named_scope(SCALED):  # refused under autocast (`_regions.region_of`)
                out = _transformed(transform, _scaled(fun, s, has_aux, argnums), argnums)(
                    *given, **kwargs
                )
            (_, (loss, aux)), grads = _checked_output(transform, out)
            grads = unscale(grads, s)
            return loss, aux, _fp8_state.kept_where_not_finite(grads, _given(args, argnums))

        loss, aux, grads = _probing(step, scale, (args, kwargs))
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _scaled(fun, scale, has_aux, argnums):
    """`fun` returning ``(loss * scale, (loss, aux))``, the product in float32 at least."""

    def scaled(*args, **kwargs):
        out = fun(*args, **kwargs)
        loss, aux = _loss_and_aux(out, has_aux, _differentiated(args, argnums))
        dtype = promoted(loss.dtype, jnp.float32)
        return loss.astype(dtype) * scale.astype(dtype), (loss, aux)

    return scaled


def _probing(step, scale, args):
    """`step(scale)`. Eagerly under ``jax_debug_nans`` or ``jax_debug_infs``, which
    check each operation, with JAX's checks off: a scaled backward pass that
    overflows is the scaler's probing for a larger scale (it skips the step and
    backs off), no fault of the model's. Where the loss or a gradient is not finite,
    the step runs again at scale 1 with the checks on, so that an inf or NaN the
    model makes without scaling raises there, at its line, as without the scaler."""
    checks = jax.config.jax_debug_nans or jax.config.jax_debug_infs
    if not checks or any(_compat.is_tracer(x) for x in jax.tree.leaves((scale, args))):
        return step(scale)
    with jax.debug_nans(False), jax.debug_infs(False):
        out = step(scale)
        loss, _, grads = out
        floats = [x for x in jax.tree.leaves((loss, grads)) if jnp.issubdtype(x.dtype, jnp.inexact)]
        finite = all(bool(jnp.isfinite(x).all()) for x in floats)
    if not finite:
        step(jnp.ones_like(scale))  # raises FloatingPointError for the model's own
    return out


def _checked_argnums(argnums):
    """`argnums` with its positions as ints (NumPy's integers too, as
    ``jax.value_and_grad`` takes them), or a TypeError naming it."""
    if hasattr(argnums, "argnum"):  # an nnx.DiffState
        return argnums
    try:
        return operator.index(argnums)
    except TypeError:
        pass
    try:
        return tuple(n if hasattr(n, "argnum") else operator.index(n) for n in argnums)
    except TypeError:
        raise TypeError(
            f"{_NAME}(argnums={argnums!r}): argnums must be an integer or a tuple of "
            "integers, the positions of the arguments to differentiate, e.g. argnums=0 "
            "or argnums=(0, 1)."
        ) from None


def _checked_output(transform, out):
    """`out`, if `transform` is a value-and-gradient transform (its output's shape)."""
    if not (_pair(out) and _pair(out[0]) and _pair(out[0][1])):
        name = getattr(transform, "__qualname__", type(transform).__name__)
        raise TypeError(
            f"{_NAME}(value_and_grad={name}): value_and_grad must be a value-and-"
            "gradient transform, as jax.value_and_grad or flax.nnx.value_and_grad, "
            "whose function returns ((value, aux), grads) with has_aux=True; it "
            f"returned {_describe(out)}. (jax.grad and nnx.grad return the "
            "gradients alone.)"
        )
    return out


def _current_scale_check(state) -> Callable[[], None]:
    """What the returned function checks at each call: built from the concrete state of
    a dynamic scaler (its `growth_tracker` counts, >= 0), it must not be called inside a
    jit or scan, whose program would keep the scale as a constant while ``update`` backs
    the state's off: every step would overflow at the old scale and be skipped."""
    scale, tracker = _value(state.scale), _value(state.growth_tracker)
    if _compat.is_tracer(scale) or _compat.is_tracer(tracker):
        return lambda: None  # read inside the step: the step's own

    def check() -> None:
        if _compat.staging_trace(under_others=True) is None:
            return  # eagerly, or under vmap or grad of an eager call: current
        if not np.any(np.asarray(tracker) >= 0):  # read here: no host sync eagerly
            return  # a static or disabled scaler's, which never changes
        shown = np.asarray(scale)
        shown = f"{float(shown):g}" if shown.ndim == 0 else f"of shape {shown.shape}"
        raise ValueError(
            f"{_NAME}(fun, opt_state): the function it returned is called inside a "
            "jitted (or scanned) function, but it was built outside, from an opt_state "
            f"whose scale ({shown}) the grad_scaler's update changes. The program would "
            "keep that scale as a constant: the scaler would back its own off while every "
            "step still overflowed at the old one and was skipped, the parameters never "
            "moving. Build it inside the training step, from the opt_state the step "
            "receives: loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, "
            "batch); for jax.jit(scaled_value_and_grad(...)), pass opt_state to the "
            "jitted function and build it there."
        )

    return check


def _transformed(transform, fun, argnums):
    """``transform(fun, has_aux=True)``, given `argnums` only where it is not the
    default 0: ``eqx.filter_value_and_grad`` takes none."""
    chosen = {} if isinstance(argnums, int) and argnums == 0 else {"argnums": argnums}
    return transform(fun, has_aux=True, **chosen)


def unscale(grads, scale: jax.Array):
    """`grads` multiplied by float32 ``1 / scale``, each leaf keeping its dtype.

    Up to a scale of 2**64 this is torch's ``unscale_``, bit for bit; above, the
    reciprocal comes in two normal factors, exact up to float32's largest scale
    (see `mpjax._float32.reciprocal`).
    """
    inverse, tail = reciprocal(scale)

    def one(path, g):
        if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
            return g  # float0 gradients of integer inputs
        if _fp8_state.kind(path) == "forward":
            return g  # Flax fp8's new input and kernel statistics, not gradients
        wide = promoted(g.dtype, jnp.float32)
        return (g.astype(wide) * inverse.astype(wide) * tail.astype(wide)).astype(g.dtype)

    return jax.tree_util.tree_map_with_path(one, grads)


def _positions(args, argnums) -> list[int]:
    """The positions of the arguments `argnums` differentiates."""
    # An nnx.DiffState(argnum, filter) names its argument by `argnum`.
    single = isinstance(argnums, int) or hasattr(argnums, "argnum")
    nums = [getattr(n, "argnum", n) for n in ((argnums,) if single else argnums)]
    return [i for i in nums if -len(args) <= i < len(args)]


def _differentiated(args, argnums):
    return [args[i] for i in _positions(args, argnums)]


def _given(args, argnums):
    """The differentiated arguments, structured as ``jax.value_and_grad``'s gradients."""
    given = _differentiated(args, argnums)
    return given[0] if isinstance(argnums, int) else tuple(given)


def _check_differentiable(args, argnums) -> None:
    """A TypeError naming a differentiated leaf `jax.value_and_grad` cannot take (an
    Equinox module's activation function), and the transforms that filter it out."""
    leaves = (
        (f"args[{i}]{jax.tree_util.keystr(path)}", leaf)
        for i in _positions(args, argnums)
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]
    )
    for where, leaf in leaves:
        if hasattr(leaf, "dtype") or isinstance(leaf, (bool, int, float, complex)):
            continue
        raise TypeError(
            f"{_NAME}: {where} is a {type(leaf).__name__}, which jax.value_and_grad cannot "
            "differentiate. For an Equinox model pass value_and_grad=eqx.filter_value_and_grad, "
            "which differentiates its arrays alone; otherwise split the arrays off "
            "(eqx.partition, or a pytree of the arrays) and differentiate those."
        )


def _pair(x) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2


def _loss_and_aux(out, has_aux: bool, differentiated: list):
    """`fun`'s output split into a checked scalar loss and its aux."""
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ValueError(
                f"{_NAME}(has_aux=True): fun must return a (loss, aux) pair, got "
                f"{_describe(out)}. Return (loss, aux), or drop has_aux=True."
            )
        loss, aux = out
    elif isinstance(out, (tuple, list)):
        if len(out) == 2 and _shaped_like(out[1], differentiated):
            raise ValueError(
                f"{_NAME}: fun returned (value, a pytree shaped like the parameters): it "
                "looks like jax.value_and_grad(f). Pass the loss function f itself, "
                "which scaled_value_and_grad differentiates (or, if the pair is "
                "(loss, aux), pass has_aux=True)."
            )
        raise ValueError(
            f"{_NAME}: fun returned a {type(out).__name__} of {len(out)} values; it must "
            "return the scalar loss. If it returns (loss, aux), pass has_aux=True."
        )
    else:
        loss, aux = out, None
    if not hasattr(loss, "shape") and not isinstance(loss, (int, float)):
        if _shaped_like(loss, differentiated):
            raise ValueError(
                f"{_NAME}: fun returned a pytree shaped like the parameters, not a "
                "scalar loss: it looks like a gradient function (jax.grad(f)). Pass the "
                "loss function f itself; scaled_value_and_grad differentiates it."
            )
        raise ValueError(f"{_NAME}: fun must return a scalar loss, got {_describe(loss)}.")
    loss = jnp.asarray(loss)
    if loss.shape != () and has_aux and _is_scalar_loss(aux):
        raise ValueError(
            f"{_NAME}(has_aux=True): fun returned (an array of shape {loss.shape}, a "
            "scalar): the loss comes first. Return (loss, aux), as for jax.value_and_grad."
        )
    if loss.shape != ():
        raise ValueError(
            f"{_NAME}: fun must return a scalar loss, got an array of shape {loss.shape}. "
            "Reduce it to one number first (e.g. loss.mean())."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"{_NAME}: fun must return a floating-point loss, got dtype {loss.dtype}.")
    return loss, aux


def _is_scalar_loss(x) -> bool:
    return hasattr(x, "dtype") and jnp.shape(x) == () and jnp.issubdtype(x.dtype, jnp.floating)


def _shaped_like(tree, differentiated: list) -> bool:
    """Whether `tree` has the structure of a differentiated argument (a gradient)."""
    structure = jax.tree.structure(tree)
    return any(structure == jax.tree.structure(a) for a in differentiated)


def _describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


def _value_and_grad_for(args, argnums, value_and_grad):
    """The differentiation transform: NNX's for NNX modules, JAX's otherwise (on
    arguments it can differentiate)."""
    if value_and_grad not in (None, jax.value_and_grad):
        return value_and_grad
    nnx = sys.modules.get("flax.nnx")  # no NNX module can exist before flax.nnx is imported
    if nnx is not None and any(
        isinstance(a, nnx.Module)
        for a in jax.tree.leaves(
            _differentiated(args, argnums), is_leaf=lambda x: isinstance(x, nnx.Module)
        )
    ):
        return nnx.value_and_grad
    _check_differentiable(args, argnums)
    return jax.value_and_grad
