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

Which adds are a bias's is decided here too (`bias_product`): a layer's bias varies
along the features its weight gives the product, an attention mask does not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax import _compat
from mpjax._casting import F32, convert, fewer, size

PRODUCTS = frozenset({"dot_general", "ragged_dot_general", "conv_general_dilated"})


def rounded_bias_add(operands, bias: int, low):
    """``convert(operands[0] + operands[1], low)`` at float32: a product (its float32
    accumulator, or its 16-bit result) plus ``operands[bias]``, a float32 bias it
    broadcasts, the sum rounded to `low`. A 16-bit product's cotangent is the
    16-bit cotangent itself (widening, adding and rounding transpose to nothing)."""
    return _rounded_bias_add(bias, np.dtype(low))(*operands)


@functools.cache
def _rounded_bias_add(bias: int, low):
    """`rounded_bias_add` as one inlined jit per bias position and dtype: JAX traces
    and differentiates it once per input types, not once per layer."""

    def mpjax_bias_add(*xs):  # the name marks it in jaxprs
        return convert(lax.add(*[convert(x, F32, False) for x in xs]), low, False)

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

        # The transpose is kept in the program past this trace: no tracer of it.
        types = [(x.shape, x.dtype) for x in primals]

        def transposed(_, ct):
            wide = convert(ct, F32, False)
            return [
                _bias_gradient(ct, wide, types[i][0])
                if i == bias
                else convert(ct, types[i][1], False)  # the product's
                for i in live
            ]

        return out, _compat.linear_call(forward, transposed, (), tuple(tangents[i] for i in live))

    custom.defjvp(jvp, symbolic_zeros=True)
    return _compat.inline_jit(custom)


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


def feature_dims(product, weighted) -> frozenset:
    """The output dimensions of `product` (a ``dot_general``, convolution or ragged
    product) that the free dimensions of its `weighted` operands (a layer's
    weight) give: its output features, along which a layer's bias varies. An
    attention mask varies along others too: the batch, the query positions."""
    out = product.outvars[0].aval.ndim
    name = product.primitive.name
    if name == "conv_general_dilated":
        return frozenset({product.params["dimension_numbers"].out_spec[1]})
    if name != "dot_general":
        return frozenset({out - 1})  # a ragged product: the experts' features, last
    (lhs_contract, _), (lhs_batch, _) = product.params["dimension_numbers"]
    lhs_end = product.invars[0].aval.ndim - len(lhs_contract)  # batch, then lhs free
    spans = [range(len(lhs_batch), lhs_end), range(lhs_end, out)]
    return frozenset(d for span, w in zip(spans, weighted) if w for d in span)


def varying_dims(bias, broadcast) -> frozenset:
    """The output dimensions along which `bias` (a variable of the product's shape or
    of fewer elements) varies: through `broadcast`, the ``broadcast_in_dim`` that
    made it, if any."""
    if broadcast is None:
        return frozenset(i for i, n in enumerate(bias.aval.shape) if n != 1)
    operand, dims = broadcast.invars[0].aval, broadcast.params["broadcast_dimensions"]
    return frozenset(d for d, n in zip(dims, operand.shape) if n != 1)


def bias_product(eqn, eqns, producer, args) -> int | None:
    """Where the product is in `eqn`, an add of a parameter's product and its bias:
    a value of fewer elements varying along the output features the parameter
    gives, as a layer's bias does. An attention mask (``[B, 1, 1, T]``, causal)
    varies along the batch or the queries, and adds apart (in float32)."""
    if eqn.primitive.name != "add" or not all(map(_is_var, eqn.invars)):
        return None
    n = size(eqn.outvars[0].aval)
    for k, v in enumerate(eqn.invars):
        made_by = eqns[producer[v]] if v in producer else None
        if made_by is None or made_by.primitive.name not in PRODUCTS or size(v.aval) != n:
            continue
        weighted = [_is_var(w) and w in args for w in made_by.invars[:2]]
        bias = eqn.invars[1 - k]
        broadcast = broadcast_from_fewer(bias, eqns, producer)
        if any(weighted) and (fewer(size(bias.aval), n) or broadcast is not None):
            features = feature_dims(made_by, weighted)
            return k if varying_dims(bias, broadcast) <= features else None
    return None


def broadcast_from_fewer(v, eqns, producer):
    """The ``broadcast_in_dim`` equation that made `v` from fewer elements, or None."""
    made_by = eqns[producer[v]] if _is_var(v) and v in producer else None
    if made_by is None or made_by.primitive.name != "broadcast_in_dim":
        return None
    return made_by if fewer(size(made_by.invars[0].aval), size(v.aval)) else None


def _is_var(v) -> bool:
    return not isinstance(v, _compat.Literal)
