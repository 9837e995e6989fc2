"""A 16-bit matrix product whose backward products are 16-bit too, with float32
gradients for float32 parameters.

JAX transposes ``dot_general(x16, w16, preferred_element_type=float32)`` at its
float32 result type: the backward products multiply a float32 cotangent (mixed
operands: float32 GEMMs on CPU, TPU and older GPUs), and the weight's gradient is
rounded to its operand's 16 bits before the cast back to float32 widens it again.
Here the product is a `jax.custom_jvp` whose tangent is a linear function with a
transpose of its own (`jax.custom_derivatives.linear_call`): the cotangent,
16-bit values by construction (it comes back through the rounding of the
product's result), is cast to 16 bits once for both backward products,
multiplied as 16 bits with each one's other 16-bit operand and
accumulated in float32, and a float32 parameter's gradient is returned in
float32, never rounded (jax#34330's ``bf16 @ bf16 -> f32``).

The product takes its operands already cast (a cast made once per value and
hoisted out of loops by the interpreter) and, beside them, the float32 parameters
they were cast from: a parameter's tangent is taken from the parameter, the
cast's is ignored (it is the same tangent, rounded).

Two predicates say where the user fixed a product's precision, which the policy
then keeps (`runs_as_written`, `explicit_result_type`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mpjax import _compat
from mpjax import policy
from mpjax._casting import F32, convert, dtype_of


RECAST_SCOPE = "mpjax_recast"
"""The name scope of the backward pass's casts of a product's operands (a
parameter cast again rather than kept): `mpjax.diagnose` leaves them out of the
backward pass's values."""


LOW_PRODUCT = "mpjax_low_product"
"""The name `low_product`'s custom_jvp carries in jaxprs."""


def low_product(
    operands, parameters, dimension_numbers, precision, low, recast=True, out_sharding=None
):
    """``dot_general`` of the 16-bit `operands`, returning its float32 accumulator.

    `parameters` holds, per operand, the float32 parameter it was cast from, or
    None for an activation. With `recast`, the backward pass keeps the float32
    parameter (alive anyway) and casts it again, rather than keeping its 16-bit
    copy; inside a loop body, where the cast is made once outside the loop and
    kept once, pass False. `out_sharding` is the product's own (explicit sharding).
    """
    dn = dimension_numbers
    is_param = [p is not None for p in parameters]
    sharded = {} if out_sharding is None else {"out_sharding": out_sharding}

    def dot(a, b):
        return lax.dot_general(
            a, b, dn, precision=precision, preferred_element_type=F32, **sharded
        )

    def mpjax_low_product(a, b, *params):  # the name marks it in jaxprs (`mpjax.audit`)
        return dot(a, b)

    product = jax.custom_jvp(mpjax_low_product)

    def jvp(primals, tangents):
        a, b, *params = primals
        tangent_of, param_of = iter(tangents[2:]), iter(params)
        ta, tb = (next(tangent_of) if p else t for p, t in zip(is_param, tangents[:2]))
        # What the backward pass keeps of each operand: a parameter itself, alive
        # anyway (its 16-bit copy is cast again when needed), or the activation.
        a_kept, b_kept = (next(param_of) if p and recast else x for p, x in zip(is_param, (a, b)))
        sides = (  # (tangent, the other operand as kept, apply, transpose, operand)
            (ta, b_kept, lambda t, o: dot(_cast(t, low), _cast(o, low)), _transpose_lhs, a),
            (tb, a_kept, lambda t, o: dot(_cast(o, low), _cast(t, low)), _transpose_rhs, b),
        )
        live = [
            (*side, param)
            for side, param in zip(sides, is_param)
            if not isinstance(side[0], _compat.SymbolicZero)
        ]
        out = product(a, b, *params)
        if not live:
            return out, jax.numpy.zeros(out.shape, F32)
        return out, _linear(live, dn, precision, low)

    product.defjvp(jvp, symbolic_zeros=True)
    return product(*operands, *[p for p in parameters if p is not None])


def _cast(x, low):
    return convert(x, low, False)


def _linear(sides, dn, precision, low):
    """The product's tangent, the sum of ``apply(tangent, other)`` over the `sides`
    (operands) with a tangent, as one linear function. Its transpose rounds the
    cotangent to 16 bits once and multiplies it by each side's `other` into that
    operand's gradient: float32 for a parameter, `low` for an activation."""
    tangents = tuple(side[0] for side in sides)
    others = tuple(side[1] for side in sides)

    def forward(others, tangents):
        terms = [side[2](t, o) for side, t, o in zip(sides, tangents, others)]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    def transposed(others, ct):
        ct = _cast(ct, low)
        cts = []
        for (tangent, _, _, transpose, operand, is_param), other in zip(sides, others):
            result = F32 if is_param else low
            with jax.named_scope(RECAST_SCOPE):  # a forward value, not a gradient
                other = _cast(other, low)

            def product(carrier):  # called (and traced) within this iteration
                return transpose(carrier, other, operand, dn, precision, result)

            t = _compat.weight_gradient(product, ct, low) if is_param else product(ct)
            cts.append(t.astype(tangent.dtype))
        return tuple(cts)

    return _compat.linear_call(forward, transposed, others, tangents)


def _transpose_rhs(ct, x, y, dn, precision, result_type):
    (x_contract, y_contract), (x_batch, y_batch) = dn
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(ct, x, y, swapped, precision, result_type, swap_ans=True)


def _transpose_lhs(ct, y, x, dn, precision, result_type, swap_ans=False):
    """The cotangent of a product's left operand `x` (JAX's own transpose rule), as
    a product of the 16-bit cotangent and right operand returning `result_type`,
    sharded as `x` (explicit sharding asks, when the contraction is over a sharded
    dimension, as a weight's gradient over a sharded batch is)."""
    (x_contract, y_contract), (x_batch, y_batch) = dn
    x_kept = _remaining(range(np.ndim(x)), x_contract, x_batch)
    y_kept = _remaining(range(np.ndim(y)), y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    unsorted_axes = list(x_batch) + x_kept + x_contract_sorted_by_y
    out = lax.dot_general(
        ct, y, dims, precision=precision, preferred_element_type=result_type,
        **_sharded_as(x, unsorted_axes),
    )
    return lax.transpose(out, tuple(int(a) for a in np.argsort(unsorted_axes)))


def _sharded_as(x, axes) -> dict:
    """``out_sharding`` for a product whose result is `x`'s axes in the order
    `axes`: `x`'s sharding permuted, or nothing where `x` has no mesh."""
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty:
        return {}
    spec = tuple(sharding.spec) + (None,) * (np.ndim(x) - len(sharding.spec))
    return {"out_sharding": sharding.update(spec=P(*(spec[a] for a in axes)))}


def _remaining(original, *removed) -> list:
    gone = {int(i) for r in removed for i in r}
    return [i for i in original if i not in gone]


def _ranges_like(*groups):
    start = 0
    for group in groups:
        yield tuple(range(start, start + len(group)))
        start += len(group)


def runs_as_written(eqn, vals) -> bool:
    """Whether a product keeps its inputs' precision. float64 and complex values are
    never cast, so a product with such an operand runs in float64 or complex
    whatever autocast does: rounding its float32 operand to 16 bits would only
    lose precision (and a complex x 16-bit product with a float32 result would
    drop the imaginary part). And a
    product given ``precision=HIGHEST`` or a dot algorithm was told how precise
    to be by the user, unless `jax.default_matmul_precision` (which writes its
    precision into every product) told all of them, as torch's autocast
    overrides ``allow_tf32``."""
    precision = eqn.params.get("precision")
    given = precision if isinstance(precision, tuple) else (precision,)
    wide = any(dtype_of(x) == np.float64 or np.dtype(dtype_of(x)).kind == "c" for x in vals)
    return wide or any(map(_asks_precision, given))


def _asks_precision(p) -> bool:
    if jax.config.jax_default_matmul_precision is not None:
        return False
    if p is None or isinstance(p, jax.lax.Precision):
        return p == jax.lax.Precision.HIGHEST
    return getattr(p, "name", None) != "DEFAULT"  # a DotAlgorithmPreset


def explicit_result_type(eqn) -> bool:
    """Whether a product's `preferred_element_type` was asked for by the user.

    jnp sets it to the inputs' promoted dtype, which autocast replaces by the low
    dtype. Any other value (float16 operands accumulated into a float32 result)
    was written explicitly, and is kept: the operands still go to the low dtype.
    """
    preferred = eqn.params.get("preferred_element_type")
    if preferred is None or not policy.is_castable(preferred):
        return False
    default = policy.widest(v.aval.dtype for v in eqn.invars[:2])
    return np.dtype(preferred) != default
