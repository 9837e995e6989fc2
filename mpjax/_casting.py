"""How autocast reads a value's dtype and casts it: the helpers every rule shares.

They sit below the interpreter and the rules, which all import them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import _compat

F32 = np.dtype(jnp.float32)


def dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def size(x) -> int:
    """Elements of a value or an aval: a symbolic expression under `jax.export`'s
    shape polymorphism, which compares equal as a number does."""
    return math.prod(x.shape if hasattr(x, "shape") else np.shape(x))


def fewer(a, b) -> bool:
    """Whether size `a` < size `b`. Of symbolic sizes (`jax.export`'s), where `a`
    is at most `b` and may be less (n against b * n, for any batch b), as a program
    traced at a batch of 2 or more decides; False where nothing can tell."""
    try:
        return bool(a < b)
    except jax.errors.InconclusiveDimensionOperation:
        try:
            return bool(a <= b)
        except jax.errors.InconclusiveDimensionOperation:
            return False


def promoted(a, b) -> np.dtype:
    """JAX's standard promotion of dtypes `a` and `b`, whatever the user's promotion
    mode: under "strict", a mix of 16-bit and float32 that autocast made is no mix
    the user wrote, nor one they could cast away."""
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(jnp.promote_types(a, b))


def dtype_named(spec, argument: str | None = None) -> np.dtype | None:
    """The dtype `spec` names (a dtype, its scalar type, or its name), or None.

    A tuple or list is none: NumPy reads ``(float16, bfloat16)`` as a float16
    sub-array type, which would run one dtype where two were asked for. Nor is a
    value, an array or a scalar (``np.float16(3)``): NumPy reads it as its dtype,
    taking data passed by mistake for a setting. Given the `argument` it came as
    (``"autocast(dtype"``), a value raises TypeError naming it."""
    if not isinstance(spec, (str, type, np.dtype)):
        if argument is not None and hasattr(spec, "dtype"):
            name = argument.partition("(")[2]
            raise TypeError(
                f"{argument}=...): {name} must be a dtype, such as jnp.bfloat16 or 'float32', "
                f"not a value: got a {spec.dtype} array of shape {np.shape(spec)}. For a "
                f"value's dtype, pass x.dtype."
            )
        return None
    try:
        return np.dtype(spec)
    except TypeError:
        return None


def is_concrete(x) -> bool:
    """Whether `x` is a value known at trace time (a literal), not a tracer."""
    return isinstance(x, (np.ndarray, np.generic))


SENTINEL = 2.0**12
"""How many times the 16-bit maximum a value must be to be taken for a mask's fill
(``-1e9``, ``jnp.finfo(jnp.float32).min``) rather than data (`convert`'s `sentinels`)."""


def convert(x, dtype: np.dtype, saturate: bool, sentinels: bool = False):
    """Casts `x`; a saturating cast maps finite values out of range to +-max. With
    `sentinels`, only those at least `SENTINEL` times the maximum: a mask's fill
    becomes -65504 in float16, where 1e5, a value, overflows to inf as it would cast
    by hand, loud rather than wrong.

    Infinities and NaN pass through a saturating cast unchanged: a ``-inf`` the
    user wrote (a mask) means -inf, not -65504.
    """
    numpy_value = is_concrete(x)
    if (saturate or sentinels) and jnp.finfo(dtype).max < jnp.finfo(dtype_of(x)).max:
        # The bound in x's dtype, rounded down: 65504 in bfloat16 rounds up to 65536.
        hi = _largest_below(jnp.finfo(dtype).max, dtype_of(x))
        far = min(float(jnp.finfo(dtype).max) * SENTINEL, float(jnp.finfo(dtype_of(x)).max))
        xp = np if numpy_value else jnp
        kept = xp.isfinite(x) if saturate else xp.isfinite(x) & (xp.abs(x) >= far)
        if numpy_value:  # a literal
            return np.where(kept, np.clip(x, -hi, hi), x).astype(dtype)
        # Computed from literals (or a mask), so XLA folds it. The select is made in
        # `dtype`: a value autocast holds in 16 bits stays 16 bits wide in the program.
        clamped = lax.convert_element_type(lax.clamp(-hi, x, hi), dtype)
        return lax.select(kept, clamped, lax.convert_element_type(x, dtype))
    if numpy_value:
        return np.asarray(x).astype(dtype)
    return _compat.convert_element_type(x, dtype)


def explicit_sharding(aval):
    """`aval`'s sharding where its mesh has explicit axes (a broadcast made by a rule
    must then say it, or it is replicated), else None."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
    return sharding if explicit else None


def constrained(values, shardings):
    """`values`, each constrained to its sharding where one is given (a nested
    jit's ``out_shardings=``), not where it is left to the compiler, nor on a mesh
    with explicit axes, where the values' types carry their shardings (and a
    constraint only asserts)."""

    def one(x, s):
        types = getattr(getattr(s, "mesh", None), "axis_types", ())
        if not isinstance(s, jax.sharding.Sharding) or jax.sharding.AxisType.Explicit in types:
            return x
        return jax.lax.with_sharding_constraint(x, s)

    if not shardings:
        return values
    return [one(x, s) for x, s in zip(values, shardings, strict=True)]


def _largest_below(bound, dtype):
    """The largest value of `dtype` at most `bound`."""
    hi = np.asarray(bound).astype(dtype)
    return hi if hi <= bound else np.nextafter(hi, np.asarray(0, dtype))


def weight_gradient(product, ct, low):
    """``product(ct)`` for a weight-gradient product of the 16-bit cotangent `ct`, in
    `low`; but the CPU's dot kernel rejects bf16 x bf16 -> f32 in the layouts XLA gives
    weight gradients ("Unsupported element type for DotThunk"): there bfloat16 values
    go as float32, exactly, summed alike. Chosen for the platform the program is
    lowered for: a program exported for a GPU on a CPU host keeps its 16-bit products."""
    if low != jnp.bfloat16:
        return product(ct)
    return jax.lax.platform_dependent(
        ct, cpu=lambda c: product(c.astype(jnp.float32)), default=product
    )
