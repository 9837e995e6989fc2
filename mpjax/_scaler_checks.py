"""The argument checks of `grad_scaler`, `static_scaler` and `noop_scaler`.

Each raises a ValueError that names the function, the argument, what is valid and
what was given.
"""

from __future__ import annotations

import itertools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat
from mpjax._float32 import MAX_F32, MIN_NORMAL_F32
from mpjax._scaler_update import ScalerConfig


def check_inner(fn: str, inner) -> None:
    """`inner` is an optax transformation, not the function that makes one."""
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        name = getattr(inner, "__name__", type(inner).__name__)
        hint = (
            f"it makes one: pass {fn}({name}(...)), not {fn}({name})"
            if callable(inner)
            else "pass an optimizer such as optax.adam(1e-3)"
        )
        raise TypeError(
            f"{fn}(inner): inner must be an optax GradientTransformation, got {name!r}; {hint}."
        )


# The default floor of the scale: the smallest normal float16. See `grad_scaler`.
DEFAULT_MIN_SCALE = 2.0**-14
_INT32_MAX = int(np.iinfo(np.int32).max)


def grad_scaler_config(
    init_scale,
    growth_factor,
    backoff_factor,
    growth_interval,
    min_scale,
    enabled,
    accumulation_steps,
    accumulation,
    axis_name,
    check_updates,
) -> ScalerConfig:
    """`grad_scaler`'s arguments, checked."""
    name = "grad_scaler"
    steps, accumulation = check_accumulation(name, accumulation_steps, accumulation)
    enabled = check_bool(name, "enabled", enabled)
    init_scale = check_number(
        name, "init_scale", init_scale, "a finite number > 0", lambda v: 0 < v < math.inf
    )
    check_fits_float32(name, "init_scale", init_scale)
    growth_factor = check_number(
        name, "growth_factor", growth_factor, "a finite number > 1", lambda v: 1 < v < math.inf
    )
    backoff_factor = check_number(
        name, "backoff_factor", backoff_factor, "a number in (0, 1)", lambda v: 0 < v < 1
    )
    growth_interval = check_int(name, "growth_interval", growth_interval)
    min_scale = check_number(
        name,
        "min_scale",
        min_scale,
        "a finite number >= 2**-126 (a normal float32)",
        lambda v: MIN_NORMAL_F32 <= v < math.inf,
    )
    if init_scale < min_scale:
        raise ValueError(
            f"{name}: init_scale={init_scale!r} is below "
            f"min_scale={min_scale!r}; raise init_scale or lower min_scale."
        )
    return ScalerConfig(
        init_scale=init_scale if enabled else 1.0,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=min_scale,
        dynamic=True,
        enabled=enabled,
        accumulation_steps=steps,
        accumulation=accumulation,
        axis_name=check_axis_name(name, axis_name),
        check_updates=check_bool(name, "check_updates", check_updates),
    )


def check_axis_name(fn: str, axis_name):
    """None, or the name of a mapped axis (hashable, not an integer: `lax.psum` reads
    an integer as an array axis), or a tuple of them."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is None or all(_is_axis_name(n) for n in names):
        return axis_name
    raise ValueError(
        f"{fn}: axis_name must be the name of the mapped axis the gradients are split "
        "along (a string, as in jax.make_mesh(..., ('data',)) or pmap(..., axis_name="
        "'data')), or a tuple of names, not an integer or an unhashable value; got "
        f"{axis_name!r}. For example {fn}(inner, axis_name='data'), or "
        "axis_name=('data', 'model')."
    )


def _is_axis_name(name) -> bool:
    if isinstance(name, (numbers.Integral, np.integer)) or _compat.is_tracer(name):
        return False
    try:
        hash(name)
    except TypeError:
        return False
    return name is not None


def check_bool(fn: str, name: str, value) -> bool:
    """A flag: True or False (numpy's bools too), never a truthy string or number."""
    value = _scalar(fn, name, value)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{fn}: {name} must be True or False, got {value!r}.")


def check_accumulation(fn: str, accumulation_steps, accumulation) -> tuple[int, str]:
    """(steps, how micro-batch gradients combine): `accumulation` is required as
    soon as there are several micro-batches, and an error without
    `accumulation_steps` (None: not given)."""
    if accumulation_steps is None:
        if accumulation is not None:
            # A loop that divides its loss by k but steps on every micro-batch
            # takes k steps of 1/k gradients.
            raise ValueError(
                f"{fn}(accumulation={accumulation!r}) without accumulation_steps: the "
                "scaler would step on every micro-batch. Pass accumulation_steps=k (the "
                "number of micro-batches per optimizer step) with it, or leave "
                "accumulation out."
            )
        return 1, "mean"
    steps = check_int(fn, "accumulation_steps", accumulation_steps)
    if accumulation in ("mean", "sum") or (accumulation is None and steps == 1):
        return steps, accumulation or "mean"  # one micro-batch: mean and sum agree
    raise ValueError(
        f"{fn}(accumulation_steps={steps}): pass accumulation='mean' if each "
        "micro-batch's loss is a mean over its own examples (as with optax.MultiSteps), "
        "or accumulation='sum' if the loss is already divided by accumulation_steps "
        f"(the PyTorch recipe); got accumulation={accumulation!r}."
    )


def check_no_float16(params, inner, inner_state, name: str = "grad_scaler") -> None:
    """Refuses float16 parameters that `inner` updates, as torch refuses to unscale
    float16 gradients (a frozen float16 parameter, with no gradient, is fine there).

    An optimizer's small constants underflow in float16 (adam's eps=1e-8 is 0), so
    its updates are not finite and every step would be skipped. A parameter is
    frozen when its update depends on no input of ``inner.update``, or is zeros
    whatever they hold: those of ``optax.set_to_zero`` in an
    ``optax.multi_transform``, also where a schedule or a clip follows.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    half = [i for i, (_, leaf) in enumerate(flat) if jnp.result_type(leaf) == jnp.float16]
    if not half:
        return
    moved = _moved_leaves(params, inner, inner_state, treedef)
    paths = [jax.tree_util.keystr(flat[i][0]) or "<root>" for i in half if moved[i]]
    if paths:
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        raise ValueError(
            f"{name} init: the parameters at {shown} are float16. Keep the "
            "parameters (and the optimizer state) in float32 and let mpjax.autocast "
            "cast them to float16 for the matrix products: an optimizer's small "
            "constants (adam's eps) underflow in float16, its updates are not finite, "
            "and every step would be skipped. (torch refuses the same: 'Attempting "
            "to unscale FP16 gradients'.) Frozen float16 parameters are accepted: "
            "give them optax.set_to_zero() in an optax.multi_transform."
        )


def explain_failed_update(name: str, inner, updates, state, params, error) -> None:
    """Where the scaler's ``update`` failed, raises a ValueError naming the cause if
    it is one a user makes: gradients shaped unlike the parameters, or a state made
    for another optimizer (a checkpoint of an earlier run). Returns otherwise. Run
    only after a failure: a successful step pays nothing for it."""
    if str(error).startswith(f"{name} "):
        return  # the scaler's own, which names its cause already
    if params is not None and (found := _first_difference(params, updates)):
        want, got = found
        raise ValueError(
            f"{name} update: the gradients are not shaped as the parameters: they hold "
            f"{_described('updates', got)} where the parameters hold "
            f"{_described('params', want)}. Pass the gradients of these parameters, as "
            "scaled_value_and_grad returns them."
        ) from error
    try:
        expected = jax.eval_shape(inner.init, updates if params is None else params)
    except Exception:  # noqa: BLE001 (inner's init cannot say: the failure stands as it is)
        return
    if found := _first_difference(expected, state.inner_state):
        want, got = found
        raise ValueError(
            f"{name} update: the state is not one the wrapped optimizer makes for these "
            f"parameters: it holds {_described('state.inner_state', got)} where "
            f"inner.init(params) makes {_described('state.inner_state', want)}. A state "
            "made for another optimizer or other parameters (a checkpoint of an earlier "
            "run) cannot be resumed: build the state with tx.init(params) of this "
            "transformation and restore into that structure."
        ) from error


def _first_difference(want, got):
    """The first leaves, as (path, leaf) or None, at which `got` differs from `want`
    in path or shape; None where it differs in neither."""
    pairs = itertools.zip_longest(
        jax.tree_util.tree_flatten_with_path(want)[0], jax.tree_util.tree_flatten_with_path(got)[0]
    )
    for w, g in pairs:
        if w is None or g is None or w[0] != g[0] or jnp.shape(w[1]) != jnp.shape(g[1]):
            return w, g
    return None


def _described(name: str, leaf) -> str:
    if leaf is None:
        return "nothing more"
    return f"{name}{jax.tree_util.keystr(leaf[0])} of shape {jnp.shape(leaf[1])}"


def _moved_leaves(params, inner, inner_state, treedef) -> list[bool]:
    """For each parameter leaf, whether its update depends on the inputs of
    ``inner.update`` (gradients, state, parameters) and is not always zero; all True
    if unknown."""
    unknown = [True] * treedef.num_leaves
    # An optimizer may need the loss too (optax.contrib.reduce_on_plateau).
    closed = _updates_jaxpr(inner, params, inner_state, {})
    if closed is None:
        closed = _updates_jaxpr(inner, params, inner_state, {"value": jnp.zeros([])})
    if closed is None:
        return unknown
    jaxpr, consts = _compat.jaxpr_and_consts(closed)
    if len(jaxpr.outvars) != len(unknown):  # updates not shaped as the parameters
        return unknown
    live = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, _compat.Literal) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    zero = _zero_outputs(jaxpr, consts, [False] * len(jaxpr.invars))
    return [
        not isinstance(v, _compat.Literal) and v in live and not z
        for v, z in zip(jaxpr.outvars, zero)
    ]


def _updates_jaxpr(inner, params, inner_state, extra):
    """The jaxpr of inner's updates, or None if inner needs other arguments."""
    try:
        return jax.make_jaxpr(lambda g, s, p: inner.update(g, s, p, **extra)[0])(
            params, inner_state, params
        )
    except Exception:  # an optimizer that needs more than (grads, state, params)
        return None


# The zeros of ``optax.set_to_zero`` stay zeros through what follows it in a chain:
# a schedule's learning rate multiplies them, a clip divides them, a sum adds them.
# (Times an inf or a NaN they would not be, but such a learning rate ruins the
# parameters that train too.) A primitive's results are zeros where any operand
# is, where every operand is, or, for ``div``, where the numerator is.
_ZERO_IF_ANY = frozenset({"mul", "dot_general"})
_ZERO_IF_ALL = frozenset({
    "add", "add_any", "sub", "neg", "abs", "max", "min", "convert_element_type", "copy",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "reduce_sum",
    "concatenate", "pad", "slice", "sharding_constraint",
})  # fmt: skip


def _zero_outputs(jaxpr, consts, zero_inputs: list[bool]) -> list[bool]:
    """For each output of `jaxpr`, whether it is zeros whatever the inputs not
    marked in `zero_inputs` hold."""
    zero = {v for v, z in zip(jaxpr.invars, zero_inputs) if z}
    zero.update(v for v, c in zip(jaxpr.constvars, consts) if _all_zeros(c))

    def is_zero(v) -> bool:
        return _all_zeros(v.val) if isinstance(v, _compat.Literal) else v in zero

    for eqn in jaxpr.eqns:
        operands, name = [is_zero(v) for v in eqn.invars], eqn.primitive.name
        callee = eqn.params.get("jaxpr") if name in ("jit", "pjit", "closed_call") else None
        if callee is not None:
            outs = _zero_outputs(*_compat.jaxpr_and_consts(callee), operands)
        elif name == "cond":  # zeros where every branch makes zeros
            branches = [_compat.jaxpr_and_consts(b) for b in eqn.params["branches"]]
            outs = [all(z) for z in zip(*(_zero_outputs(*b, operands[1:]) for b in branches))]
        elif name in _ZERO_IF_ANY:
            outs = [any(operands)] * len(eqn.outvars)
        elif name in _ZERO_IF_ALL or name == "select_n":
            # select_n's first operand is the predicate: the cases decide.
            cases = operands[1:] if name == "select_n" else operands
            outs = [bool(cases) and all(cases)] * len(eqn.outvars)
        else:
            outs = [name == "div" and operands[0]] * len(eqn.outvars)
        zero.update(v for v, z in zip(eqn.outvars, outs) if z)
    return [is_zero(v) for v in jaxpr.outvars]


def _all_zeros(value) -> bool:
    if _compat.is_tracer(value):
        return False
    try:
        return bool(np.all(np.asarray(value) == 0))
    except TypeError:  # not numbers (a typed PRNG key)
        return False


def check_static_scale(scale) -> float:
    """`static_scaler`'s scale, checked."""
    name = "static_scaler"
    scale = check_number(
        name,
        "scale",
        scale,
        "a finite float32 number >= 2**-126 (a normal float32)",
        lambda v: MIN_NORMAL_F32 <= v < math.inf,
    )
    check_fits_float32(name, "scale", scale)
    return scale


def check_fits_float32(fn: str, name: str, value: float) -> None:
    """Refuses a finite `value` that overflows to inf as a float32."""
    with np.errstate(over="ignore"):
        overflows = not np.isfinite(np.float32(value))
    if overflows:
        raise ValueError(
            f"{fn}: {name}={value!r} overflows float32; it must be at most "
            f"{MAX_F32!r}."
        )


def _scalar(fn: str, name: str, value):
    """A 0-d NumPy or JAX array as the NumPy scalar it holds; anything else as is."""
    if _compat.is_tracer(value):
        raise ValueError(
            f"{fn}: {name} must be a concrete number, got a traced value: the scaler's "
            "settings are fixed when it is built. Build it outside the jitted function "
            "(under optax.inject_hyperparams, name the setting in static_args, e.g. "
            f"static_args=('{name}',)), or use set_scale on the state to change the "
            "scale as training goes."
        )
    if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0:
        return np.asarray(value)[()]
    return value


def check_number(fn: str, name: str, value, valid: str, ok) -> float:
    """`value` as a float if it is a real number (not bool) with `ok(value)`."""
    value = _scalar(fn, name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{fn}: {name} must be {valid}, got {value!r} (a {type(value).__name__}).")
    value = float(value)
    if math.isnan(value) or not ok(value):
        raise ValueError(f"{fn}: {name} must be {valid}, got {value!r}.")
    return value


def check_int(fn: str, name: str, value) -> int:
    """`value` as an int if it is an integer in [1, 2**31 - 1]."""
    value = _scalar(fn, name, value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{fn}: {name} must be an integer >= 1, got {value!r} (a {type(value).__name__})."
        )
    value = int(value)
    if not 1 <= value <= _INT32_MAX:
        raise ValueError(f"{fn}: {name} must be an integer in [1, {_INT32_MAX}], got {value!r}.")
    return value
