"""Torch-exact float32 arithmetic for the loss scale, without float64.

torch multiplies its float32 scale by a Python float in double precision and
rounds the product to float32. `_mul_f32_by_f64` reproduces that bit for bit in
integer arithmetic, which is exact on every backend (float64 is off by default in
JAX, and slow or missing on accelerators). `reciprocal` gives ``1 / scale`` as two
normal factors, so unscaling stays exact up to float32's largest scale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MIN_NORMAL_F32 = float(np.finfo(np.float32).tiny)  # 2**-126
MAX_F32 = float(np.finfo(np.float32).max)


def _mul_f32_by_f64(x: jax.Array, factor: float) -> jax.Array:
    """``float32(float64(x) * factor)`` for a float32 scalar `x`, without float64.

    torch multiplies the scale in double precision and rounds to float32. Two
    roundings can differ from one float32 multiply (with ``factor=1.1`` often:
    its binary expansion repeats), and float64 is off by default in JAX and
    slow or missing on accelerators. So the 24-bit by 53-bit significand product
    is formed exactly in 16-bit limbs held in uint32, then rounded to nearest
    even twice, to 53 and then to 24 bits, as the double multiply and the
    conversion do. Integer arithmetic is exact on every backend.

    A power-of-two `factor` takes a plain float32 multiply, which is then exact.
    Results below the smallest normal float32 come out as 0; the scale's floor
    (`min_scale` >= 2**-126) makes that invisible.

    Args:
      x: float32 scalar (or array).
      factor: a positive finite Python float.

    Returns:
      The float32 product, ``inf`` where it overflows float32.
    """
    x = jnp.asarray(x, jnp.float32)
    mantissa, exponent = math.frexp(factor)
    if mantissa == 0.5:
        return x * jnp.float32(factor)
    mf = int(mantissa * 2**53)  # factor == mf * 2**(exponent - 53), exactly
    ms, ex = _significand(x)
    r, ex = _exact_product(ms, ex, mf, exponent)
    hi, lo, ex = _round_to_53_bits(r, ex)
    kept, ex = _round_to_24_bits(hi, lo, ex)
    result = lax.bitcast_convert_type(_float32_bits(kept, ex), jnp.float32)
    # 0, inf and NaN multiply exactly in float32.
    return jnp.where(jnp.isfinite(x) & (x > 0), result, x * jnp.float32(factor))


def _u32(v):
    return jnp.asarray(v, jnp.uint32)


def _significand(x):
    """(ms, ex) with ``x == ms * 2**ex`` and ms normalised into [2**23, 2**24)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    biased = (bits >> 23) & 0xFF
    fraction = bits & 0x7FFFFF
    ms = jnp.where(biased == 0, fraction, fraction | 0x800000)
    ex = jnp.where(biased == 0, -126, biased.astype(jnp.int32) - 127) - 23
    shift = lax.clz(ms).astype(jnp.int32) - 8
    ms = lax.shift_left(ms, _u32(jnp.maximum(shift, 0)))
    return ms, ex - shift


def _exact_product(ms, ex, mf: int, exponent: int):
    """The exact product ``ms * mf``, normalised to 77 bits, as five 16-bit limbs.

    Returns the limbs (least significant first) and the product's exponent.
    """
    b = [jnp.uint32((mf >> (16 * j)) & 0xFFFF) for j in range(4)]
    # The exact product ms * mf in [2**75, 2**77), as six 16-bit limbs.
    a = [ms & 0xFFFF, ms >> 16]
    columns = [_u32(0)] * 6
    for i in range(2):
        for j in range(4):
            p = a[i] * b[j]  # < 2**32
            columns[i + j] = columns[i + j] + (p & 0xFFFF)
            columns[i + j + 1] = columns[i + j + 1] + (p >> 16)
    r, carry = [], _u32(0)
    for c in columns:
        c = c + carry
        r.append(c & 0xFFFF)
        carry = c >> 16
    # Normalise to exactly 77 bits (top bit 76 == bit 12 of r[4]).
    top = (r[4] >> 12) & 1
    doubled = [((r[i] << 1) & 0xFFFF) | (r[i - 1] >> 15 if i else _u32(0)) for i in range(5)]
    r = [jnp.where(top == 1, r[i], doubled[i]) for i in range(5)]
    return r, ex + exponent - 53 - (1 - top.astype(jnp.int32))


def _round_to_53_bits(r, ex):
    """First rounding, to 53 bits (the double product): drop bits 0..23.

    Returns the kept bits as (hi: bits 56..76, lo: bits 24..55) and the exponent.
    """
    sticky = (r[0] != 0) | ((r[1] & 0x7F) != 0)
    round_bit = (r[1] >> 7) & 1
    lo = (r[1] >> 8) | (r[2] << 8) | ((r[3] & 0xFF) << 24)  # bits 24..55
    hi = (r[3] >> 8) | (r[4] << 8)  # bits 56..76, 21 bits
    inc = ((round_bit == 1) & (sticky | ((lo & 1) == 1))).astype(jnp.uint32)
    new_lo = lo + inc
    hi = hi + ((new_lo == 0) & (inc == 1)).astype(jnp.uint32)
    lo = new_lo
    overflow = hi >> 21  # rounded up to 2**53
    hi = jnp.where(overflow == 1, _u32(1 << 20), hi)
    return hi, lo, ex + 24 + overflow.astype(jnp.int32)


def _round_to_24_bits(hi, lo, ex):
    """Second rounding, to 24 bits (the conversion to float32): drop 29 bits."""
    sticky = (lo & 0x0FFFFFFF) != 0
    round_bit = (lo >> 28) & 1
    kept = (hi << 3) | (lo >> 29)
    kept = kept + ((round_bit == 1) & (sticky | ((kept & 1) == 1))).astype(jnp.uint32)
    overflow = kept >> 24
    kept = jnp.where(overflow == 1, kept >> 1, kept)
    return kept, ex + 29 + overflow.astype(jnp.int32)


def _float32_bits(kept, ex):
    """The float32 bit pattern of ``kept * 2**ex``: inf above the range, 0 below."""
    biased = ex + 23 + 127
    return jnp.where(
        biased >= 255,
        _u32(0x7F800000),
        jnp.where(
            biased <= 0,
            _u32(0),
            lax.shift_left(_u32(jnp.clip(biased, 0, 255)), _u32(23)) | (kept & 0x7FFFFF),
        ),
    )


def reciprocal(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``1 / scale`` as two normal float32 factors, ``(inverse, tail)``.

    Up to a scale of 2**64 this is torch's ``f32(1 / double(scale))`` and a tail of
    1, so unscaling is torch's single multiply, bit for bit (a float32 quotient
    is the same number: a reciprocal never rounds to a float32 midpoint). Above,
    the exact power of two 2**-64 is split off into the tail: above 2**126 the
    single reciprocal would be a float32 subnormal, which backends flush to
    zero, and every gradient would silently become 0.
    """
    big = scale > jnp.float32(2.0**64)
    tail = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
    return 1.0 / jnp.where(big, scale * jnp.float32(2.0**-64), scale), tail
