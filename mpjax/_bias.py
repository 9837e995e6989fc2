"""A bias add rounded to 16 bits, differentiated so that the bias's gradient sums
the same rounded cotangent the product's backward pass reads.

JAX transposes ``convert(product + bias, low)`` into one widening of the 16-bit
cotangent, read by both the product's backward pass and the bias's sum. Where that
cotangent was itself rounded from float32 values (the backward pass of a GELU
between two products, `mpjax._pointwise`), XLA:GPU's excess precision reads the
widening through the rounding: the sum then reads the float32 values, which the
kernel computing them writes to memory in float32. Here the bias's gradient is
``-sum(widen(-ct))`` in a program lowered for a GPU: the same value (a rounding
to nearest is symmetric), with no widening directly after a rounding for XLA to
remove, so XLA sums the 16-bit cotangent in the kernel that computes it, as a
hand-cast model's program does. The product's cotangent is the 16-bit cotangent
itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mpjax import _compat
from mpjax._casting import F32, convert


def rounded_bias_add(add, operands, bias: int, low):
    """``convert(add(*operands), low)`` at float32: a product (its float32
    accumulator, or its 16-bit result) plus ``operands[bias]``, a float32 bias it
    broadcasts, the sum rounded to `low`. A 16-bit product's cotangent is the
    16-bit cotangent itself (widening, adding and rounding transpose to nothing)."""

    def mpjax_bias_add(*xs):  # the name marks it in jaxprs
        return convert(add(*[convert(x, F32, False) for x in xs]), low, False)

    custom = jax.custom_jvp(mpjax_bias_add)

    def jvp(primals, tangents):
        out = mpjax_bias_add(*primals)
        live = [i for i, t in enumerate(tangents) if not isinstance(t, _compat.SymbolicZero)]
        if not live:
            return out, jnp.zeros_like(out)

        def forward(_, ts):
            full = [jnp.zeros_like(x) for x in primals]  # with their shardings
            for i, t in zip(live, ts):
                full[i] = t
            return mpjax_bias_add(*full)

        def transposed(_, ct):
            wide = convert(ct, F32, False)
            return tuple(
                _bias_gradient(ct, wide, primals[i].shape)
                if i == bias
                else convert(ct, primals[i].dtype, False)  # the product's
                for i in live
            )

        return out, _compat.linear_call(forward, transposed, (), tuple(tangents[i] for i in live))

    custom.defjvp(jvp, symbolic_zeros=True)
    return custom(*operands)


def _bias_gradient(ct, wide, shape):
    """The 16-bit cotangent `ct` (`wide`: widened) summed in float32 to a bias of
    `shape` (the transpose of its broadcast)."""
    apart = functools.partial(_apart, shape=shape)
    plain = functools.partial(_plain, shape=shape)
    return lax.platform_dependent(ct, wide, cuda=apart, rocm=apart, default=plain)


def _plain(ct, wide, shape):
    return _summed(wide, shape)


def _apart(ct, wide, shape):
    """`_plain`'s sum as ``-sum(widen(-ct))``: the same value, out of reach of
    XLA:GPU's excess precision."""
    return -_summed(convert(-ct, F32, False), shape)


def _summed(x, shape):
    """`x` summed over the axes a broadcast from `shape` added or stretched."""
    lead = x.ndim - len(shape)
    stretched = [lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1]
    return x.sum(tuple(range(lead)) + tuple(stretched)).reshape(shape)
