"""The autocast policy: which precision each JAX primitive runs in.

The tables below are the whole policy. Each maps a primitive's *name* to a
`Rule`; names, not primitive objects, so that a primitive one JAX version lacks
(``log2``, ``polynomial``, ``ragged_dot``) costs nothing. Adding a primitive is one
line in one table. Primitives in none of the tables run exactly as they were
traced (`Rule.ORIGINAL`), which is always type-correct.

Higher-order primitives (``jit``, ``scan``, ``while``, ``cond``, ``remat``,
``custom_jvp_call``, ``shard_map``) are not policy: the interpreter recurses
into them (see ``mpjax/control_flow.py``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

import numpy as np
import jax.numpy as jnp

from mpjax import _casting, _compat


class Rule(enum.Enum):
    """What autocast does to a primitive's floating-point inputs.

    Examples:
      >>> import mpjax
      >>> mpjax.rule_for("exp")
      <Rule.FLOAT32: 'float32'>
      >>> [rule.name for rule in mpjax.Rule]
      ['LOW', 'FLOAT32', 'WIDEST', 'AS_RECEIVED', 'ORIGINAL']
    """

    LOW = "low"
    """Cast to the region's low-precision dtype; the result is low precision too."""
    FLOAT32 = "float32"
    """Cast to float32: numerically fragile (transcendental, accumulating)."""
    WIDEST = "widest"
    """Cast to the widest non-weak floating input, as torch's promote list."""
    AS_RECEIVED = "as_received"
    """Run in whatever dtype the inputs arrive in."""
    ORIGINAL = "original"
    """Cast back to the dtypes the program was traced with, run as written."""


def _table(rule: Rule, names: Iterable[str]) -> dict[str, Rule]:
    return {name: rule for name in names}


# fmt: off
# Matrix products and convolutions: the work tensor cores accelerate.
LOW_PRECISION = _table(Rule.LOW, [
    "dot_general",
    "conv_general_dilated",
    "ragged_dot",
    "ragged_dot_general",
])

# Transcendentals that lose range or accuracy in 16 bits, and every reduction or
# scan that accumulates. softmax, log_softmax, layer/RMS norm, mean/var and the
# optax losses are float32 by composition of these.
FLOAT32 = _table(Rule.FLOAT32, [
    # exponentials and logarithms
    "exp", "exp2", "expm1", "log", "log1p", "log2", "pow", "integer_pow",
    "square", "rsqrt",
    # trigonometric and hyperbolic functions torch keeps in float32
    "tan", "sinh", "cosh", "asin", "acos",
    # special functions
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma", "zeta",
    "igamma", "igammac", "igamma_grad_a", "random_gamma_grad",
    "regularized_incomplete_beta", "bessel_i0e", "bessel_i1e", "polynomial",
    # accumulating reductions and scans
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
    "reduce_window_sum",
])

# Scans that accumulate: their results stay float32 under the lean policy too.
RUNNING_SUMS = frozenset({"cumsum", "cumprod", "cumlogsumexp"})

# Several floating inputs that must agree: promote to the widest.
WIDEST = _table(Rule.WIDEST, [
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "atan2",
    "eq", "ne", "lt", "le", "gt", "ge",
    "select_n", "clamp", "concatenate", "stack", "pad",
    "dynamic_update_slice",
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "select_and_scatter_add", "select_and_gather_add",
])

# Dtype-polymorphic primitives that are safe in any precision: layout and
# indexing, sign and rounding, bounded elementwise functions, comparisons of a
# single operand, and collectives (which move data, not precision).
AS_RECEIVED = _table(Rule.AS_RECEIVED, [
    # layout and indexing
    "reshape", "broadcast_in_dim", "tile", "squeeze", "expand_dims", "transpose", "rev",
    "slice", "dynamic_slice", "gather", "copy", "copy_p", "split", "unstack",
    "sharding_constraint", "device_put", "mesh_cast", "reshard", "pvary",
    "optimization_barrier", "stop_gradient", "reduce_precision", "iota",
    "name",  # jax.ad_checkpoint.checkpoint_name
    # elementwise, bounded or exact in any precision
    "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "sqrt", "cbrt",
    "tanh", "logistic", "sin", "cos", "atan", "asinh", "acosh", "atanh",
    "one_minus_square", "real", "imag",
    "not", "and", "or", "xor", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "population_count", "clz",
    # selections and orderings: exact whatever the dtype
    "reduce_max", "reduce_min", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin", "cummax", "cummin", "sort", "top_k", "approx_top_k",
    "reduce_window_max", "reduce_window_min",
    # collectives
    "psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_gather",
    "all_gather_invariant", "all_to_all",
    "psum_scatter", "reduce_scatter", "axis_index", "pbroadcast",
])

# fmt: on

POLICY: dict[str, Rule] = {**LOW_PRECISION, **FLOAT32, **WIDEST, **AS_RECEIVED}
"""Every primitive with a rule; anything else is `Rule.ORIGINAL`."""

# Products whose transposes, when an input was float32 before autocast cast it (a
# weight), multiply 16-bit operands into that value's float32 gradient: summed
# across a batch in float32, and all-reduced in float32 under data-parallel jit, as
# torch DDP reduces float32 `.grad`s. ``autocast(..., reduce_dtype=dtype)`` turns it
# off for the bandwidth. The forward product returns 16 bits, or its float32
# accumulator where a float32 sum reads it (`mpjax.fusions`). Convolutions are
# left out: GPUs have no convolution from 16-bit operands to a float32 result, so
# its transpose would run in float32.
FLOAT32_ACCUMULATOR = frozenset({"dot_general", "ragged_dot_general"})

# Sums are float32, forward and backward. The FLOAT32 table covers the reductions
# a program writes; these are the 16-bit sums it does not write. JAX builds sums
# into the derivatives of primitives that do no arithmetic themselves: the
# transpose of a broadcast is a reduce_sum, of a gather a scatter-add, of an
# all_gather a psum_scatter; the JVP of reduce_max counts its ties with a
# reduce_sum, that of a max-pool transposes to select_and_scatter_add, that of
# cummax is an associative scan whose transpose adds cotangents in a tree. And a few
# primitives sum in their forward pass yet hand on the dtype they receive. When
# the policy runs one of these on 16-bit values, it runs at float32 instead, on
# the same values, and its result is rounded back (`first_order._float32_sums`).
# The forward value is unchanged, bit for bit, where the primitive does no
# arithmetic, and JAX differentiates it at float32: the cotangent is upcast,
# summed in float32 and rounded once. XLA fuses the converts.
# fmt: off
SUMMED_BY_AUTODIFF = frozenset({
    "broadcast_in_dim", "tile", "pad", "gather", "scatter", "scatter-max", "scatter-min",
    "reduce_max", "reduce_min", "reduce_window_max", "reduce_window_min",
    "cummax", "cummin", "select_and_gather_add", "sort", "top_k", "approx_top_k",
    "all_gather", "all_gather_invariant", "pvary", "pbroadcast",
})
SUMMING = frozenset({
    "scatter-add", "scatter_add", "scatter-sub", "scatter-mul", "select_and_scatter_add",
    "psum", "psum_invariant", "psum_scatter", "reduce_scatter",
})
FLOAT32_SUMS = SUMMED_BY_AUTODIFF | SUMMING
"""Primitives run at float32 when the policy would run them on 16-bit values."""

# Sums over devices hand on float32 (default policy), as `reduce_sum` does. All these
# collectives run as received under ``autocast(..., reduce_dtype=dtype)``, 16 bits asked.
DEVICE_SUMS = frozenset({"psum", "psum_invariant", "psum_scatter", "reduce_scatter"})
COLLECTIVE_SUMS = frozenset({
    "all_gather", "all_gather_invariant", "pvary", "pbroadcast", "psum", "psum_invariant",
    "psum_scatter", "reduce_scatter",
})

# Elementwise primitives broadcast a size-1 or scalar operand implicitly, and
# their transpose sums its cotangent back to its shape, in its dtype. A 16-bit
# operand that a sum would be made for is broadcast explicitly at float32 first
# (`first_order._broadcast_in_float32`), so that sum is float32.
IMPLICIT_BROADCAST = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "atan2", "nextafter",
})
# fmt: on

# Primitives that act on each element alone. A chain of them computing one value
# from one activation (and literals) is an activation function: the default policy
# evaluates it as torch's fused activation kernels do (`mpjax.fusions`).
# fmt: off
POINTWISE = frozenset({
    "neg", "abs", "sign", "floor", "ceil", "round", "sqrt", "rsqrt", "cbrt",
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "tanh", "logistic", "sin", "cos", "tan", "atan", "sinh", "cosh", "asinh", "acosh",
    "atanh", "erf", "erfc", "erf_inv",
    "add", "sub", "mul", "div", "max", "min", "select_n", "is_finite",
    "eq", "ne", "lt", "le", "gt", "ge",
})
# Primitives that move values without computing: a value only they lead to a
# matrix product is rounded by the product anyway.
LAYOUT = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "slice",
    "rev", "copy", "copy_p", "sharding_constraint", "split", "unstack", "concatenate", "name",
    # where the values lie, not what they are
    "reshard", "mesh_cast", "device_put", "pvary",
})
# fmt: on

# Each moves its first input's elements: widened, from its float32 copy (`mpjax._scope`).
MOVES_ELEMENTS = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "slice", "rev",
    "copy", "copy_p", "gather", "dynamic_slice",
})  # fmt: skip

# Linear algebra that needs its matrix exact: a matrix product only these read runs as written.
FACTORIZATIONS = frozenset({"cholesky", "lu", "qr", "eigh", "eig", "svd", "schur", "hessenberg",
                            "triangular_solve", "tridiagonal_solve", "custom_linear_solve"})

# A parameter stays one through these, and through the all_gather of its shards
# (FSDP under shard_map): its products' gradients are float32 sums (`mpjax.fusions`).
CARRY_PARAMETERS = LAYOUT | frozenset({"all_gather", "all_gather_invariant"})

# The memory-lean policy changes these rules. An embedding lookup gathers from a
# low-precision table (of a float32 parameter only: a gather of data, a quantile's,
# keeps its rule, `mpjax.first_order.policy_rule`).
LEAN_OVERRIDES: dict[str, Rule] = {"gather": Rule.LOW}

assert len(POLICY) == (len(LOW_PRECISION) + len(FLOAT32) + len(WIDEST) + len(AS_RECEIVED)), (
    "a primitive is in two tables"
)

# The floating dtypes autocast moves between. float64 and everything else (ints,
# bools, PRNG keys, fp8) is never touched.
CASTABLE = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
LOW_DTYPES = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16))


# torch's names for what JAX traces as other primitives: `rule_for` points to them
# rather than answer ORIGINAL, which would read as "torch's matmul is not cast".
_TRACED = "the primitives JAX traces it to (mpjax.audit lists them)"
# torch's CUDA autocast op lists, each name with the JAX primitive to look up.
_TORCH_NAMES = {
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm", "addmm", "addbmm", "baddbmm",
                     "addmv", "addr", "linear", "einsum", "dot", "mv", "chain_matmul",
                     "multi_dot", "tensordot", "bilinear", "GRUCell", "LSTMCell", "RNNCell"),
                    "dot_general"),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                     "conv_transpose3d", "convolution", "conv_tbc"), "conv_general_dilated"),
    **dict.fromkeys(("softmax", "log_softmax", "softmin", "softplus", "layer_norm",
                     "group_norm", "batch_norm", "norm", "normalize", "renorm", "dist",
                     "cdist", "pdist", "cosine_similarity", "mse_loss", "cross_entropy",
                     "nll_loss", "l1_loss", "smooth_l1_loss", "kl_div", "poisson_nll_loss",
                     "binary_cross_entropy_with_logits", "cosine_embedding_loss",
                     "hinge_embedding_loss", "margin_ranking_loss", "multilabel_margin_loss",
                     "multi_margin_loss", "soft_margin_loss", "triplet_margin_loss", "prelu",
                     "addcdiv", "addcmul", "cross", "grid_sample"), _TRACED),
    **dict.fromkeys(("__pow__", "__rpow__"), "pow"),
    **dict.fromkeys(("reciprocal", "__rdiv__", "__rtruediv__"), "integer_pow"),
    "sum": "reduce_sum", "mean": "reduce_sum", "prod": "reduce_prod", "sigmoid": "logistic",
    "erfinv": "erf_inv", "log10": "log", "index_put": "scatter", "scatter_add": "scatter-add",
    "cat": "concatenate", "equal": "eq",
}  # fmt: skip


def rule_for(primitive_name: str, lean: bool = False) -> Rule:
    """The rule autocast applies to a primitive, by name.

    Args:
      primitive_name: e.g. ``"dot_general"``, as ``eqn.primitive.name`` gives it
        (or the primitive itself, ``jax.lax.dot_general_p``). Names are JAX's
        primitives', not torch's: an unknown name runs as written, and a name on
        torch's autocast op lists that is no JAX primitive's (``"matmul"``,
        ``"conv2d"``, ``"softplus"``) raises ValueError naming what to look up.
      lean: a bool: the rule under ``autocast(..., policy="lean")``.

    Examples:
      >>> from mpjax import Rule, rule_for
      >>> rule_for("dot_general") is Rule.LOW
      True
      >>> rule_for("gather"), rule_for("gather", lean=True)
      (<Rule.AS_RECEIVED: 'as_received'>, <Rule.LOW: 'low'>)
      >>> rule_for("a_primitive_mpjax_does_not_know")
      <Rule.ORIGINAL: 'original'>
    """
    if not isinstance(primitive_name, str):
        name = getattr(primitive_name, "name", None)  # a Primitive: jax.lax.exp_p
        if not isinstance(name, str):
            raise TypeError(
                f"rule_for(primitive_name): expected a primitive's name such as "
                f"'dot_general' (eqn.primitive.name), got {type(primitive_name).__name__}."
            )
        primitive_name = name
    if not isinstance(lean, (bool, np.bool_)):  # a string such as "False" is truthy
        raise TypeError(f"rule_for(lean={lean!r}): lean must be a bool, True for policy='lean'.")
    check_not_torch_name(primitive_name, "rule_for")
    if lean and primitive_name in LEAN_OVERRIDES:
        return LEAN_OVERRIDES[primitive_name]
    return POLICY.get(primitive_name, Rule.ORIGINAL)


def check_not_torch_name(name: str, where: str) -> None:
    """Raises ValueError for a name on torch's op lists that no JAX primitive has."""
    if name not in POLICY and name in _TORCH_NAMES:
        raise ValueError(
            f"{where}({name!r}): {name!r} is torch's name, not a JAX primitive's; "
            f"look up {_TORCH_NAMES[name]} instead."
        )


def equation_rule(eqn, lean: bool = False) -> Rule:
    """The rule of one equation: its primitive's, with exceptions by operands.

    A value times itself (``jnp.linalg.norm``, a hand-written RMSNorm) is a
    square: float32, as ``square`` and torch's ``pow`` and ``norm``, not 16 bits
    past 256. A Python number divided by a value (``1.0 / x``) is a reciprocal:
    float32, as ``jnp.reciprocal`` and torch's ``__rdiv__``, not inf below 1.5e-5.
    A vector dot product (``jnp.vdot``, ``jnp.dot`` of 1-D arrays: one number), or
    a batch of them (``einsum("bn,bn->b")``, a 1-D dot under vmap: no operand has a
    dimension of its own) runs at the dtypes the program gave it, as torch's
    ``dot`` (on its promote list): 16 bits save nothing on a reduction to one
    number per row, and a float16 sum of squares overflows past 65504.
    """
    a, name = eqn.invars, eqn.primitive.name
    if name == "mul" and a[0] is a[1] and not isinstance(a[0], _compat.Literal):
        return rule_for("square", lean=lean)
    if name == "div" and isinstance(a[0], _compat.Literal):
        return rule_for("integer_pow", lean=lean)
    if name == "dot_general" and _vector_dots(eqn):
        return Rule.ORIGINAL
    if name == "gather" and math.prod(eqn.params["slice_sizes"]) == 1:
        # Single elements (jnp.searchsorted, jnp.interp, quantiles, x[i] of a
        # vector), not an embedding's rows: rounded, they fall in other bins.
        return rule_for("gather")
    return rule_for(name, lean=lean)


def _vector_dots(eqn) -> bool:
    """Whether every dimension of both operands is contracted or a batch one."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.ndim for v in eqn.invars[:2])
    return len(lhs_contract) + len(lhs_batch) == lhs and len(rhs_contract) + len(rhs_batch) == rhs


def is_castable(dtype) -> bool:
    """Whether autocast may change a value of this dtype."""
    try:
        return np.dtype(dtype) in CASTABLE
    except TypeError:  # extended dtypes: PRNG keys
        return False


def widest(dtypes: Iterable) -> np.dtype | None:
    """The narrowest dtype that holds all of `dtypes` (float16 + bfloat16 -> float32)."""
    out = None
    for d in dtypes:
        out = np.dtype(d) if out is None else _casting.promoted(out, d)
    return out


def float32_only_consumers(jaxpr, outputs=frozenset(), elsewhere=lambda eqn: False) -> frozenset:
    """The variables whose every reader is a float32-list primitive, or takes them
    as they are: a call (a nested jit, a checkpoint, a cond's branches) whose own
    readers are, a reader `elsewhere` (in a nested region of another precision),
    or, for the output positions in `outputs`, the caller's readers."""
    readers: dict = {}
    for eqn in jaxpr.eqns:
        inner = _callee_readers(eqn)
        rule = Rule.FLOAT32 if elsewhere(eqn) else equation_rule(eqn)
        for i, v in enumerate(eqn.invars):
            if not isinstance(v, _compat.Literal):
                readers.setdefault(v, set()).add(rule if inner is None else inner[i])
    for i, v in enumerate(jaxpr.outvars):
        if not isinstance(v, _compat.Literal):
            readers.setdefault(v, set()).add(Rule.FLOAT32 if i in outputs else None)
    return frozenset(v for v, rules in readers.items() if rules == {Rule.FLOAT32})


JITS = frozenset({"jit", "pjit"})  # a nested jit's primitive, by its name on each jax

_CALLS = JITS | frozenset({"closed_call", "core_call", "checkpoint", "remat2"})


def _callee_readers(eqn) -> list | None:
    """For a call or a cond, per operand: FLOAT32 where every callee reads it only
    by float32-list primitives, else None; None for any other equation."""
    name = eqn.primitive.name
    if name == "cond":
        callees, skip = eqn.params["branches"], 1  # the index is no operand
    elif name in _CALLS:
        callees, skip = [eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))], 0
    else:
        return None
    out = [Rule.FLOAT32] * len(eqn.invars)
    out[:skip] = [None] * skip
    for closed in callees:
        inner = _compat.jaxpr_and_consts(closed)[0]
        if len(inner.invars) != len(eqn.invars) - skip:
            return [None] * len(eqn.invars)
        only = float32_only_consumers(inner)
        for i, v in enumerate(inner.invars):
            if v not in only:
                out[skip + i] = None
    return out
