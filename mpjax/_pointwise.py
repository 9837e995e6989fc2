"""An activation function between two products, evaluated as torch's fused
activation kernels do (`mpjax.fusions` finds it): at float32 on a 16-bit
activation, its result rounded once, and rematerialized for the backward pass.
And the other elementwise rules that follow torch: the division by a float16
value, whose derivative is taken as torch takes it; a 16-bit operand widened by a
float32 one, kept for the backward pass in 16 bits; a factor 16 bits hold only
rounded, applied in float32; float32 tangents of linear functions and of a
maximum; and a float32 function differentiated at the 16-bit values its inputs
widen, so that the backward pass keeps those (`derived_from`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from mpjax import _compat, _constants, policy
from mpjax._casting import F32, convert, dtype_of
from mpjax.policy import Rule


def is_pointwise(eqn) -> bool:
    """Whether `eqn` is elementwise: a `policy.POINTWISE` primitive, or a nested jit
    of them with one result (``jax.nn.silu``, ``jax.nn.relu6`` are jitted)."""
    if eqn.primitive.name in policy.POINTWISE:
        return True
    body = _body(eqn)
    return body is not None and len(eqn.outvars) == 1 and all(map(is_pointwise, body.eqns))


def computes_float32(eqn) -> bool:
    """Whether `eqn` (or a jit's body) computes something torch's fused activation
    kernels compute in float32 and autocast would round: a float32-list primitive,
    or a sigmoid (SiLU's: its backward product in 16 bits overflows)."""
    body = _body(eqn)
    if body is not None:
        return any(map(computes_float32, body.eqns))
    return policy.equation_rule(eqn) is Rule.FLOAT32 or eqn.primitive.name == "logistic"


def primitives(eqns, members) -> int:
    """How many primitives ``eqns[i]`` for `members` are, a jit's its body's (a
    jit of ``jax.nn.silu``, itself a jit, counts silu's)."""
    return sum(
        primitives(b.eqns, range(len(b.eqns))) if (b := _body(eqns[i])) is not None else 1
        for i in members
    )


def _body(eqn):
    """The jaxpr of a nested jit with equations, or None."""
    if eqn.primitive.name not in policy.JITS:
        return None
    body = _compat.jaxpr_and_consts(eqn.params["jaxpr"])[0]
    return body if body.eqns else None


def recomputed(fun, rematted: bool, **kwargs):
    """`fun` in a ``jax.checkpoint``, so that the backward pass keeps its (16-bit)
    inputs and recomputes its float32 values; the checkpoint also bars common-
    subexpression elimination, by which XLA would merge the recomputation with the
    forward pass and keep those values after all. `fun` as it is where it is
    `rematted`, inside the body of a checkpoint of the user's: that one's policy
    decides for every value in it, and JAX keeps the inputs and outputs of an
    inner checkpoint besides (an activation ``save_only_these_names`` keeps, twice)."""
    return fun if rematted else jax.checkpoint(fun, prevent_cse=False, **kwargs)


def pointwise(chain, eqns, source_value):
    """The chain evaluated at float32 on a 16-bit `source_value`, its result
    rounded to that dtype; rematerialized for the backward pass. The checkpoint
    bars common-subexpression elimination: in a jitted step XLA would otherwise
    merge the recomputation with the forward chain and keep its float32
    intermediates (a GELU's tanh) after all. The same function of each layer is
    one cached jit, so JAX traces and differentiates it once. (Inside a checkpoint
    of the user's too: its input is the product that policies keep anyway.)"""
    program, literals = [], []
    index = {chain.source: 0}
    for i in chain.eqns:
        eqn = eqns[i]
        refs = []
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                refs.append(index[v])
            else:
                refs.append(-1 - len(literals))
                literals.append(np.asarray(v.val, dtype=v.aval.dtype))
        program.append((eqn.primitive, tuple(sorted(eqn.params.items())), tuple(refs)))
        index.update((o, len(index)) for o in eqn.outvars)
    constants = tuple((x.dtype, x.shape, x.tobytes()) for x in literals)
    key = (tuple(program), constants, index[chain.out])
    try:
        hash(key)
    except TypeError:  # an unhashable param: no cache
        return jax.checkpoint(_evaluator(*key, dtype_of(source_value)))(source_value)
    return _remat(key, np.dtype(dtype_of(source_value)))(source_value)


@functools.lru_cache(maxsize=1024)
def _remat(key, low):
    return _compat.inline_jit(jax.checkpoint(_evaluator(*key, low)))


def _evaluator(program, literals, out, low):
    """``function(x)``: `program` run at float32 on `x`, its value `out` rounded to `low`."""
    consts = [np.frombuffer(data, dtype).reshape(shape) for dtype, shape, data in literals]

    def function(x):
        values = [convert(x, F32, False)]
        for primitive, params, refs in program:
            args = [values[r] if r >= 0 else consts[-1 - r] for r in refs]
            outs = primitive.bind(*args, **primitive.get_bind_params(dict(params)))
            values.extend(outs if primitive.multiple_results else [outs])
        return convert(values[out], low, False)

    return function


def derived_from(fun, widened, narrow, rematted: bool = False):
    """``fun(*widened)``, differentiated at ``widened`` recomputed from `narrow`: the
    16-bit values they widen exactly (or themselves, not widened). Its backward pass
    keeps the 16-bit values, not float32 copies, while the cotangent of a widened
    value stays float32, to be summed with its other readers' before it is
    rounded once (a norm's ``mean(x * x) - mean(x) ** 2``, whose cotangents nearly
    cancel on uncentred values)."""
    dtypes = [dtype_of(w) for w in widened]

    @jax.custom_jvp
    def f(widened, narrow):
        return fun(*widened)

    @f.defjvp
    def jvp(primals, tangents):
        again = [convert(x, d, False) for x, d in zip(primals[1], dtypes)]
        return jax.jvp(fun, again, list(tangents[0]))

    return list(recomputed(f, rematted)(list(widened), list(narrow)))


def bind_quotient(eqn, x, y, **updates):
    """``x / y``, bound. JAX's derivative in a 16-bit divisor `y` squares it in its
    dtype (``y**-2``: 0 past 256 and inf below 2**-8 in float16); here it is
    ``(x / y) / y``, as torch's, taken at float32 and rounded once. The derivative in
    `x` is JAX's, so a division by a constant is differentiated as before."""
    # bfloat16 has float32's range: its y**-2 is fine.
    if updates or dtype_of(y) != np.float16 or any(jax.typeof(a).weak_type for a in (x, y)):
        return _compat.bind(eqn, x, y, **updates)
    return [_quotient(x, y)]


@jax.custom_jvp
def _quotient(x, y):
    return jax.lax.div(x, y)


def _quotient_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    q = _quotient(x, y)
    out = None if type(tx) is jax.custom_derivatives.SymbolicZero else tx / y  # JAX's
    if type(ty) is not jax.custom_derivatives.SymbolicZero:
        y32 = convert(y, F32, False)
        term = convert(ty, F32, False) * (convert(x, F32, False) / y32) / y32
        term = convert(-term, dtype_of(q), False)
        out = term if out is None else out + term
    return q, (jax.numpy.zeros_like(q) if out is None else out)


_quotient.defjvp(_quotient_jvp, symbolic_zeros=True)


def float32_tangent(primal, tangent):
    """`primal`, linear in its floating arguments, whose JVP is `tangent` (the
    same function, at float32, its results rounded): its transpose, the sum JAX
    makes of it, is float32. Integer arguments (indices) reach `tangent` as
    they are."""
    fun = jax.custom_jvp(lambda *xs: list(primal(*xs)))

    @fun.defjvp
    def jvp(primals, tangents):
        ts = [t if policy.is_castable(dtype_of(p)) else p for p, t in zip(primals, tangents)]
        return fun(*primals), list(tangent(*ts))

    return fun


def chooser_float32_tangent(primal, axes):
    """reduce_max or reduce_min as it is, with JAX's JVP (the tangents at the
    maxima, averaged over ties) taken at float32: the ties are counted, and the
    tangents summed, in float32. The backward pass keeps which entries are
    maxima, as booleans."""
    fun = jax.custom_jvp(primal)

    @fun.defjvp
    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = fun(x)
        shape = [1 if i in axes else d for i, d in enumerate(np.shape(x))]
        chosen = jax.lax.eq(x, jax.lax.reshape(out, shape))
        counts = jax.lax.reduce_sum(convert(chosen, F32, False), tuple(axes))
        t = convert(t, F32, False)
        # t * 0 elsewhere, not 0: an inf or NaN tangent spreads as JAX's
        # t * chosen makes it (a NaN under a max must reach the gradients).
        picked = jax.lax.select(chosen, t, t * 0)
        total = jax.lax.reduce_sum(picked, tuple(axes))
        return out, convert(total / counts, dtype_of(out), False)

    return fun


# Elementwise primitives whose derivative multiplies by an operand: JAX keeps that
# operand for the backward pass as it was bound.
_KEEPS_OPERANDS = frozenset({"mul", "div"})


def widened(eqn, vals, targets, weak, lone=(), rematted: bool = False):
    """`mul` or `div` of a 16-bit activation and a float32 value, at float32: bound in
    a checkpoint that widens the activation, so that the backward pass keeps its
    16-bit value, not a float32 copy (torch's mul keeps its operands as they come).
    None unless the other operands are float32 already, none is a constant, and
    the activation is read here alone (its positions in `lone`)."""
    if eqn.primitive.name not in _KEEPS_OPERANDS or any(weak):
        return None
    dtypes = [dtype_of(x) for x in vals]
    low = [t == F32 and d in policy.LOW_DTYPES for d, t in zip(dtypes, targets)]
    if not any(low) or not all(w or d == F32 for w, d in zip(low, dtypes)):
        return None
    if not all(i in lone for i, w in enumerate(low) if w):
        return None

    def compute(*xs):
        return _compat.bind(eqn, *[convert(x, F32, False) if w else x for x, w in zip(xs, low)])

    return list(recomputed(compute, rematted)(*vals))


def by_constant(scope, eqn, vals, targets, weak, lean=False):
    """``x * c``, ``c * x`` or ``x / c`` of a 16-bit `x` by a constant that its dtype
    holds only rounded (0.1, 1/3, an EMA's 0.001), computed in float32 and rounded
    once, as torch's opmath computes with a Python scalar: the constant rounded
    first would move every result by the same relative amount (up to 2**-11 in
    float16, 2**-8 in bfloat16), a bias averaging keeps (the `lean` policy rounds
    it, as Flax's ``dtype=`` does). None otherwise. A constant whose values
    autocast cannot know is no such case: its operation runs in float32
    (`mpjax._constants.fits`). A divisor counts as held where its reciprocal is
    too: XLA divides by a constant as a product with its reciprocal, rounded to
    the dtype (x / 3 in float16 is x * 0.33325)."""
    name = eqn.primitive.name
    if name not in _KEEPS_OPERANDS or len(vals) != 2 or weak[0] == weak[1]:
        return None
    i = 0 if weak[1] else 1  # the value, then the constant
    if name == "div" and i != 0:
        return None  # c / x keeps x for its derivative: left as it is
    low = targets[i]
    if low not in policy.LOW_DTYPES or dtype_of(vals[i]) != low:
        return None
    known = _constants.values(scope, vals[1 - i])  # known: else the target is float32
    if lean or _held(np.asarray(known, F32), low, name == "div"):
        return None  # held exactly: a power of two, a small integer
    args = [convert(vals[i], F32, False), convert(vals[1 - i], F32, False)]
    return [convert(o, low, False) for o in _compat.bind(eqn, *(args if i == 0 else args[::-1]))]


def _held(c: np.ndarray, low, divisor: bool) -> bool:
    """Whether `low` holds every value of `c` exactly (and, for a divisor, its
    reciprocal: a power of two)."""
    with np.errstate(divide="ignore"):
        values = (c, np.float32(1) / c) if divisor else (c,)
    return all(np.array_equal(v.astype(low).astype(F32), v, equal_nan=True) for v in values)
