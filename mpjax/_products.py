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
float32, never rounded (jax#34330's ``bf16 @ bf16 -> f32``). Grouped products
(``ragged_dot_general``, a mixture of experts' layers) are handled alike: a
`Product` holds each primitive's arithmetic and transposes.

The product takes its operands already cast (a cast made once per value and
hoisted out of loops by the interpreter) and, beside them, the float32 parameters
they were cast from: a parameter's tangent is taken from the parameter, the
cast's is ignored (it is the same tangent, rounded).

Two predicates say where the user fixed a product's precision, which the policy
then keeps (`runs_as_written`, `explicit_result_type`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mpjax import _compat
from mpjax import policy
from mpjax._casting import F32, convert, dtype_of, weight_gradient


RECAST_SCOPE = "mpjax_recast"
"""The name scope of the backward pass's casts of a product's operands (a
parameter cast again rather than kept): `mpjax.diagnose` leaves them out of the
backward pass's values."""

LOW_PRODUCT = "mpjax_low_product"
"""The name `low_product`'s custom_jvp carries in jaxprs."""


class Product(NamedTuple):
    """A product primitive's arithmetic with a result dtype of our choosing.

    ``apply(a, b, result, *extra)`` is the product; ``grad_lhs(ct, b, a, result,
    *extra)`` and ``grad_rhs(ct, a, b, result, *extra)`` are the cotangents of its
    left and right operands, as JAX's transpose rules make them: each a product
    of the cotangent `ct` and the other operand, returning `result`. `extra` are
    the primitive's operands after the two multiplied (a ragged product's group
    sizes).
    """

    apply: Callable
    grad_lhs: Callable
    grad_rhs: Callable


def product_of(eqn) -> Product | None:
    """The `Product` of a ``dot_general`` or ``ragged_dot_general`` equation, or None
    for a ragged product whose derivative JAX does not define."""
    return _PRODUCTS[eqn.primitive.name](eqn.params)


def _dot_general(params) -> Product:
    dn, precision = params["dimension_numbers"], params.get("precision")
    sharded = _out_sharding(params)
    return Product(
        lambda a, b, r: lax.dot_general(
            a, b, dn, precision=precision, preferred_element_type=r, **sharded
        ),
        lambda ct, b, a, r: _transpose_lhs(ct, b, a, dn, precision, r),
        lambda ct, a, b, r: _transpose_rhs(ct, a, b, dn, precision, r),
    )


def _ragged_dot_general(params) -> Product | None:
    """A grouped product (mixture of experts): each row along the left operand's
    ragged dimension meets the right operand's group that `group_sizes` assigns it.
    JAX differentiates only the mode with the ragged dimension kept in the result."""
    rdn, precision = params["ragged_dot_dimension_numbers"], params.get("precision")
    (x_contract, _), (x_batch, _) = rdn.dot_dimension_numbers
    if params.get("group_offset") is not None or any(
        d in (*x_contract, *x_batch) for d in rdn.lhs_ragged_dimensions
    ):
        return None
    sharded = _out_sharding(params)

    def apply(a, b, r, group_sizes):
        return lax.ragged_dot_general(
            a, b, group_sizes, rdn, precision=precision, preferred_element_type=r, **sharded
        )

    return Product(
        apply,
        lambda ct, b, a, r, gs: _ragged_transpose(ct, b, a, rdn, gs, precision, r, "lhs"),
        lambda ct, a, b, r, gs: _ragged_transpose(ct, a, b, rdn, gs, precision, r, "rhs"),
    )


def _out_sharding(params) -> dict:
    """A product's own ``out_sharding`` as keyword arguments (explicit sharding)."""
    return {} if params.get("out_sharding") is None else {"out_sharding": params["out_sharding"]}


_PRODUCTS = {"dot_general": _dot_general, "ragged_dot_general": _ragged_dot_general}


def low_product(operands, parameters, product, low, extra=(), recast=True, result=F32):
    """`product` of the 16-bit `operands`, returning its float32 accumulator (or,
    with `result` 16-bit, its rounding).

    `parameters` holds, per operand, the float32 parameter it was cast from, or
    None for an activation. `extra` are the product's further operands (not
    differentiated). With `recast`, the backward pass keeps the float32
    parameter (alive anyway) and casts it again, rather than keeping its 16-bit
    copy; inside a loop body, where the cast is made once outside the loop and
    kept once, pass False.
    """
    is_param = [p is not None for p in parameters]
    n_extra = len(extra)

    def dot(a, b, extra):
        return product.apply(a, b, F32, *extra)

    def mpjax_low_product(a, b, *rest):  # the name marks it in jaxprs (`mpjax.audit`)
        return product.apply(a, b, result, *rest[:n_extra])

    custom = jax.custom_jvp(mpjax_low_product)

    def jvp(primals, tangents):
        a, b, *rest = primals
        extra, params = tuple(rest[:n_extra]), rest[n_extra:]
        tangent_of, param_of = iter(tangents[2 + n_extra :]), iter(params)
        ta, tb = (next(tangent_of) if p else t for p, t in zip(is_param, tangents[:2]))
        # What the backward pass keeps of each operand: a parameter itself, alive
        # anyway (its 16-bit copy is cast again when needed), or the activation.
        a_kept, b_kept = (next(param_of) if p and recast else x for p, x in zip(is_param, (a, b)))
        sides = (  # (tangent, the other operand as kept, apply, transpose, operand)
            (ta, b_kept, lambda t, o, e: dot(_cast(t, low), _cast(o, low), e), product.grad_lhs, a),
            (tb, a_kept, lambda t, o, e: dot(_cast(o, low), _cast(t, low), e), product.grad_rhs, b),
        )
        live = [
            (*side, param)
            for side, param in zip(sides, is_param)
            if not isinstance(side[0], _compat.SymbolicZero)
        ]
        # The primal as the product itself, not a call of `custom`: a
        # jax.checkpoint policy (dots_saveable) sees the dot_general it saves.
        out = mpjax_low_product(a, b, *rest)
        if not live:
            return out, jax.numpy.zeros(out.shape, out.dtype)
        return out, _linear(live, extra, low, result)

    custom.defjvp(jvp, symbolic_zeros=True)
    return custom(*operands, *extra, *[p for p in parameters if p is not None])


def _cast(x, low):
    return convert(x, low, False)


def unreduced(eqn) -> bool:
    """Whether a product leaves its result unreduced over mesh axes (explicit
    sharding's ``out_sharding=P(..., unreduced={axis})``): partial sums, which a
    later reshard adds across devices."""
    sharding = eqn.params.get("out_sharding")
    spec = getattr(sharding, "spec", sharding)
    return eqn.primitive.name == "dot_general" and bool(getattr(spec, "unreduced", None))


def unreduced_product(eqn, vals, low):
    """A product whose result is left `unreduced`: 16-bit operands and float32
    partial sums, so that the sum across devices adds float32 values. Differentiated
    by JAX's own rule, which types an unreduced result's cotangent (`low_product`'s
    cannot), on float32 tangents where the operands are float32: a weight's
    gradient is a float32 sum, never rounded."""

    def bind(a, b):
        return _compat.bind(eqn, a, b, preferred_element_type=F32)[0]

    product = jax.custom_jvp(lambda a, b: bind(_cast(a, low), _cast(b, low)))

    @product.defjvp
    def jvp(primals, tangents):
        a, b = (_cast(x, low) for x in primals)
        ta, tb = tangents
        return bind(a, b), bind(ta, b) + bind(a, tb)

    return [product(*vals[:2])]


def _linear(sides, extra, low, result):
    """The product's tangent, the sum of ``apply(tangent, other)`` over the `sides`
    (operands) with a tangent, as one linear function returning `result`. Its
    transpose rounds the cotangent to 16 bits once and multiplies it by each side's
    `other` into that operand's gradient: float32 for a parameter, `low` for an
    activation."""
    tangents, others, applies = (tuple(side[i] for side in sides) for i in range(3))
    n_others, residuals = len(sides), others + extra
    # Kept in the program past this trace, the transpose holds no tracer of it.
    backs = [(t.dtype, tr, jax.typeof(x), p) for t, _, _, tr, x, p in sides]

    def forward(residuals, tangents):
        others, extra = residuals[:n_others], residuals[n_others:]
        terms = [apply(t, o, extra) for apply, t, o in zip(applies, tangents, others)]
        return (terms[0] if len(terms) == 1 else terms[0] + terms[1]).astype(result)

    def transposed(residuals, ct):
        others, extra = residuals[:n_others], residuals[n_others:]
        ct = _cast(ct, low)
        cts = []
        for (tangent_dtype, transpose, operand, is_param), other in zip(backs, others):
            result = F32 if is_param else low
            with jax.named_scope(RECAST_SCOPE):  # a forward value, not a gradient
                other = _cast(other, low)

            def product(carrier):  # called (and traced) within this iteration
                return transpose(carrier, other, operand, result, *extra)

            t = weight_gradient(product, ct, low) if is_param else product(ct)
            cts.append(t.astype(tangent_dtype))
        return cts

    return _compat.linear_call(forward, transposed, residuals, tangents)


def _transpose_rhs(ct, x, y, dn, precision, result_type):
    (x_contract, y_contract), (x_batch, y_batch) = dn
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(ct, x, y, swapped, precision, result_type, swap_ans=True)


def _transpose_lhs(ct, y, x, dn, precision, result_type, swap_ans=False):
    """The cotangent of a product's left operand `x` (JAX's own transpose rule, its
    operands swapped where that lays the result out as `x`), as a product of the
    16-bit cotangent and right operand returning `result_type`, sharded as `x`, a
    type (explicit sharding asks, when the contraction is over a sharded dimension, as a
    weight's gradient over a sharded batch is)."""
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
    swapped_axes = list(x_batch) + x_contract_sorted_by_y + x_kept
    if (
        unsorted_axes != sorted(unsorted_axes)
        and swapped_axes == sorted(swapped_axes)
        and _symmetric(precision)
    ):
        # The other operand first gives `x`'s axes in order (a weight's gradient, of
        # the activation and the cotangent): no transpose (XLA mostly swaps the
        # operands itself), and the gradient a product's own result, which the
        # finite check's reduction reads in one kernel (behind a transpose,
        # XLA:CPU splits it into three).
        swapped_dims = ((dims[0][1], dims[0][0]), (dims[1][1], dims[1][0]))
        return lax.dot_general(
            y, ct, swapped_dims, precision=precision,
            preferred_element_type=result_type, **_sharded_as(x, swapped_axes),
        )
    out = lax.dot_general(
        ct, y, dims, precision=precision, preferred_element_type=result_type,
        **_sharded_as(x, unsorted_axes),
    )
    return lax.transpose(out, tuple(int(a) for a in np.argsort(unsorted_axes)))


def _symmetric(precision) -> bool:
    """Whether `precision` asks the same of both operands, so that they can swap."""
    if isinstance(precision, lax.DotAlgorithm):
        return precision.lhs_precision_type == precision.rhs_precision_type and (
            precision.lhs_component_count == precision.rhs_component_count
        )
    return not isinstance(precision, tuple) or len(set(precision)) <= 1


def _ragged_transpose(ct, other, operand, rdn, group_sizes, precision, result, side):
    """The cotangent of a ragged product's left (`side` "lhs") or right operand, JAX's
    own transpose rule, returning `result`: the left operand's is a ragged product
    of the cotangent and the groups, the right operand's (each group's weight
    gradient) a product contracting the ragged dimension, group by group."""
    x, y = (operand, other) if side == "lhs" else (other, operand)
    (x_contract, y_contract), (x_batch, y_batch) = rdn.dot_dimension_numbers
    y_group = list(rdn.rhs_group_dimensions)
    (x_ragged,) = rdn.lhs_ragged_dimensions
    x_kept = _remaining(range(np.ndim(x)), x_contract, x_batch)
    y_kept = _remaining(range(np.ndim(y)), y_contract, y_batch, y_group)
    ans_batch, ans_x, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    if side == "lhs":
        dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
        ragged, group = [len(x_batch) + x_kept.index(x_ragged)], y_group
        lhs, rhs = ct, y
        unsorted_axes = list(x_batch) + x_kept + list(np.take(x_contract, np.argsort(y_contract)))
    else:
        dims = ((tuple(x_kept), ans_x), (tuple(x_batch), ans_batch))
        ragged, group = [x_ragged], []  # the ragged dimension is contracted
        lhs, rhs = x, ct
        unsorted_axes = (
            y_group + list(y_batch) + list(np.take(y_contract, np.argsort(x_contract))) + y_kept
        )
    out = lax.ragged_dot_general(
        lhs, rhs, group_sizes,
        lax.RaggedDotDimensionNumbers(dims, ragged, group),
        precision=precision, preferred_element_type=result,
    )
    return lax.transpose(out, tuple(int(a) for a in np.argsort(unsorted_axes)))


def _sharded_as(x, axes) -> dict:
    """``out_sharding`` for a product whose result is `x`'s axes in the order
    `axes`: type `x`'s sharding permuted, or nothing where it has no mesh."""
    sharding = x.sharding
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
    """Whether a product keeps its inputs' precision: one with a float64 or complex
    operand (never cast: rounding the other to 16 bits would only lose precision,
    or drop an imaginary part), or asked for a float64 result; one of a float8 or
    integer value, whose precision the user chose (float8 kinds without a common
    type; a quantized ``x @ int8`` scaled after, which 16 bits would overflow);
    one given ``precision=HIGHEST`` or a dot algorithm, unless that is what
    `jax.default_matmul_precision` writes into every product (``"float32"``),
    which, as torch's autocast overrides ``allow_tf32``, asks nothing."""
    dtypes = [np.dtype(dtype_of(x)) for x in vals]
    kept = any(_kept_float(d) or d.kind == "c" for d in dtypes)
    if eqn.primitive.name in _PRODUCTS or eqn.primitive.name == "conv_general_dilated":
        kept = kept or any(d.kind in "iu" for d in dtypes[:2])  # not a group size
    preferred = eqn.params.get("preferred_element_type")
    kept = kept or (preferred is not None and _kept_float(preferred))
    return kept or _asks_precision(eqn.params.get("precision"))


def _kept_float(dtype) -> bool:
    """float64, float8 and other floats autocast never casts."""
    return jnp.issubdtype(dtype, jnp.floating) and not policy.is_castable(dtype)


def _asks_precision(precision) -> bool:
    if precision == _written(jax.config.jax_default_matmul_precision):
        return False
    given = precision if isinstance(precision, tuple) else (precision,)
    return any(
        p == jax.lax.Precision.HIGHEST
        if p is None or isinstance(p, jax.lax.Precision)
        else getattr(p, "name", None) != "DEFAULT"  # a DotAlgorithmPreset
        for p in given
    )


@functools.cache
def _written(config):
    """The precision `jax.default_matmul_precision` set to `config` writes into a
    product the user gave none: a user's own (HIGHEST under ``"bfloat16"``) differs."""
    one = np.ones((1, 1), np.float32)
    return jax.make_jaxpr(lambda a: a @ a)(one).eqns[0].params["precision"]


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
