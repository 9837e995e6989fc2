"""Groups of equations the default policy treats as one operation, as torch does.

torch's ``linear``, ``addmm`` and biased convolutions are single operations on
its float16 list: the bias is added to the product's float32 accumulator and the
sum rounded once, so the activation leaves the layer in 16 bits. Its activation
functions (``gelu``, ``silu``, ...) are single kernels too: on a float16 tensor
they compute in float32 and return float16. JAX writes both as several
primitives, which a rule per primitive would promote to float32 (a float32 bias
widens the product it is added to; ``x ** 3`` in a tanh-GELU is a float32-list
power), keeping the activations after them in float32. `find` recognizes the two
groups in a jaxpr, before it is evaluated:

* a *bias add*: ``add`` of a product (``dot_general``, a convolution) and a value
  it broadcasts (fewer elements, or a broadcast of fewer). `bias_add` adds the
  bias, in float32, to the 16-bit result of a product of a float32 parameter
  (`mpjax.first_order`) and rounds the sum; otherwise the bias joins the
  product's dtype. The product returns 16 bits, which a GPU writes directly: a
  float32 accumulator rounded after the add is written in float32 and rounded by
  a kernel of its own wherever XLA runs the product on cuBLAS (a language
  model's logits). A sum that stays float32 adds the accumulator: one that only
  a tanh or sigmoid reads (`SQUASHING`, through layout and further sums) is
  handed on in float32, unrounded: a recurrent cell's gates (the products of its
  input and its state, and a bias) or a tanh layer, which torch's fused LSTM and
  GRU cells add and squash in float32.
  Rounding it would not shrink what the backward pass keeps: neither the sums
  nor the squashing functions keep their operand.
* a *residual sum*: ``add`` of a float32 value and a product (or product plus
  bias) that nothing else reads, as a residual connection adds a layer's output
  to its float32 stream. `residual_operands` hands the sum the product's float32
  accumulator instead of its rounding: the sum is float32 either way and keeps
  nothing for the backward pass, so no 16-bit copy is made and the layer's
  output is not rounded twice. Any other float32 reader (a loss's log-softmax
  of the logits) reads the 16-bit rounding widened, as torch's do: on a GPU the
  product writes its result to memory, where a float32 one is twice the bytes.
* a *select*: ``select_n`` keeps its predicate for the backward pass, and its
  JVP makes zeros for a constant case (``jnp.where(mask, x, 0)``, dropout, a
  causal mask's fill); linearization keeps both, full size. `select` evaluates
  it in a checkpoint that saves all but broadcasts, re-broadcasting there the
  operands that `find` saw broadcast from fewer elements: the backward pass
  keeps a causal mask's (T, T) source, not its (B, H, T, T) broadcast, and no
  zeros.
* a *pointwise function*: elementwise primitives (or jits of them) computing one
  value from one activation and literals alone, with a float32-list primitive or a
  sigmoid among them (GELU, SiLU), whose result only matrix products read. On a
  16-bit activation, `mpjax._pointwise` evaluates it, and its derivative, in float32
  and rounds the result once; it is rematerialized, so the backward pass keeps the
  16-bit activation rather than float32 intermediates.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import jax
import numpy as np

from mpjax import _bias, _compat, _constants, _pointwise, _readers, policy
from mpjax._casting import F32, convert, dtype_of, is_concrete, size

_PRODUCTS = _bias.PRODUCTS
SQUASHING = frozenset({"tanh", "logistic"})
"""The gate functions a bias add's sum is handed to in float32 (`find`): their
backward pass keeps their result, not their operand."""
_SUMS = frozenset({"add", "sub"})
_OUTPUT = _readers.OUTPUT  # a reader index standing for "an output of the jaxpr"


class Chain(NamedTuple):
    """A pointwise function of `source`: equations `eqns` (indices, in order) compute `out`."""

    source: object
    eqns: tuple[int, ...]
    out: object
    products: tuple[int, ...] = ()  # reading `out`: it fuses only in their region


class Fusions(NamedTuple):
    bias_adds: dict = {}
    """By id of each ``add`` of a product and its bias: the product's position."""
    float32_sums: frozenset = frozenset()
    """ids of the bias adds whose sum is handed on in float32 (read by `SQUASHING`),
    and of the collective sums a constant divides (`lax.pmean`'s)."""
    residual_sums: frozenset = frozenset()
    """ids of the adds that are a product's (or bias add's) only readers, each adding
    another value to its float32 accumulator."""
    chains: dict = {}
    """Chain by the index of its last equation."""
    deferred: frozenset = frozenset()
    """Indices of the other equations of the chains: evaluated with their chain."""
    arguments: frozenset = frozenset()
    """The parameters a product may read (a weight, its transpose): `arguments`."""
    accumulated: frozenset = frozenset()
    """ids of the products whose float32 accumulator a reader takes (a residual sum,
    a bias add whose sum stays float32); the others return 16 bits (`first_order`)."""
    selects: dict = {}
    """By the index of each floating ``select_n``: its operands broadcast from
    fewer elements, as (operand position, broadcast equation) pairs."""
    lone: dict = {}
    """By id of each mul and div, its operands nothing else reads (`_readers`)."""
    observing: frozenset = frozenset()
    """Indices of the equations that only observe (`_readers.observing`): no readers."""
    factorized: frozenset = frozenset()
    """ids of the products only linear algebra reads (`_readers.factorized`)."""


NONE = Fusions()


def _is_var(v) -> bool:
    return not isinstance(v, _compat.Literal)


def _size(v) -> int:
    return size(v.aval)


def find(jaxpr, passed=None, passed_tables=None) -> Fusions:
    """The bias adds and pointwise functions of `jaxpr`; `passed`, `passed_tables`:
    `Context`'s (in a loop body, a product takes a bias only where the caller's
    parameters reach it: a chunk of keys scanned over is no layer's weight)."""
    eqns = jaxpr.eqns
    observing = _readers.observing(eqns, jaxpr.outvars)
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    readers = _readers.reader_indices(eqns, jaxpr.outvars, observing)
    args = arguments(jaxpr, passed)
    weights = args if passed_tables is None else arguments(jaxpr, passed_tables, joined=True)
    found = ((e, _bias.bias_product(e, eqns, producer, weights)) for e in eqns)
    bias_adds = {id(e): k for e, k in found if k is not None}
    adds = [e for e in eqns if id(e) in bias_adds]
    float32_sums = frozenset(
        id(e) for e in adds if _readers.read_by(e.outvars[0], eqns, readers, SQUASHING, _SUMS)
    )
    chains: dict = {}
    deferred: set = set()
    for source, members in _pointwise_groups(eqns, observing).items():
        chain = _chain(source, members, eqns, readers)
        if chain is not None:
            chains[chain.eqns[-1]] = chain
            deferred.update(chain.eqns[:-1])
    selects = {
        i: _broadcast_operands(e, eqns, producer)
        for i, e in enumerate(eqns)
        if e.primitive.name == "select_n" and _has_derivative(e.outvars[0])
    }
    residual_sums = _residual_sums(eqns, producer, readers, bias_adds, _constant_values(eqns))
    # A 16-bit bias sum adds the product's rounding (`bias_add`); a float32 one (a
    # gate's, or one a residual sum reads) its accumulator, as a residual sum does.
    summed = _read_by_any(adds, residual_sums, eqns, readers)
    takers = float32_sums | residual_sums | summed
    accumulated = _read_by_any([e for e in eqns if e.outvars], takers, eqns, readers)
    float32_sums |= frozenset(id(e) for e in eqns if _readers.is_mean(e, eqns, readers))
    fused = (bias_adds, float32_sums, residual_sums, chains, frozenset(deferred))
    lone = _readers.lone_operands(eqns, readers)
    factorized = _readers.factorized(eqns, jaxpr.outvars)
    return Fusions(*fused, args, accumulated, selects, lone, observing, factorized)


def _read_by_any(candidates, ids, eqns, readers) -> frozenset:
    """ids of the `candidates` (equations) whose result an equation of `ids` reads."""
    return frozenset(
        id(e)
        for e in candidates
        if any(r != _OUTPUT and id(eqns[r]) in ids for r in readers[e.outvars[0]])
    )


def _residual_sums(eqns, producer, readers, bias_adds, constants) -> frozenset:
    """The adds (not bias adds) of a same-size value, not a constant, to a product
    or bias add whose every reader is such an add."""

    def is_sum(i, v):
        e = eqns[i] if i != _OUTPUT else None
        return (
            e is not None
            and e.primitive.name == "add"
            and id(e) not in bias_adds
            and all(_is_var(u) and _size(u) == _size(v) and u not in constants for u in e.invars)
        )

    found = set()
    for v, i in producer.items():
        e = eqns[i]
        if not (e.primitive.name in _PRODUCTS or id(e) in bias_adds) or not readers[v]:
            continue
        if all(is_sum(r, v) for r in readers[v]):
            found.update(id(eqns[r]) for r in readers[v])
    return frozenset(found)


def _constant_values(eqns) -> set:
    """The values computed from literals alone, which the interpreter marks weak."""
    found: set = set()
    for e in eqns:
        inputs = [v for v in e.invars if _is_var(v)]
        if all(v in found for v in inputs) and _constants.computed_from_literals(e):
            found.update(e.outvars)
    return found


def _has_derivative(v) -> bool:
    """Whether `v` is floating: an integer or boolean select keeps nothing."""
    return jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)


def _broadcast_operands(eqn, eqns, producer) -> tuple:
    found = ((k, _bias.broadcast_from_fewer(v, eqns, producer)) for k, v in enumerate(eqn.invars))
    return tuple((k, b) for k, b in found if b is not None)


def arguments(jaxpr, passed, joined: bool = False) -> frozenset:
    """The jaxpr's arguments (at the positions `passed`, or all) and what layout
    makes of one; with `joined`, of several (an LSTM's four gate biases, joined)."""
    invars = jaxpr.invars if passed is None else [jaxpr.invars[i] for i in sorted(passed)]
    found = set(invars) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        ins = list(filter(_is_var, eqn.invars))
        layout = eqn.primitive.name in policy.CARRY_PARAMETERS and (len(ins) == 1 or joined)
        if layout and ins and all(v in found for v in ins):
            found.update(eqn.outvars)
    return frozenset(found)


def parameters(ctx, eqn, vals, among=None) -> list:
    """Per operand of `eqn`, the float32 argument (a parameter) it is, or None;
    `among`: variables in place of `ctx.arguments`."""
    among = ctx.arguments if among is None else among
    return [
        x if dtype_of(x) == F32 and _is_var(v) and v in among else None
        for x, v in zip(vals, eqn.invars)
    ]


def _pointwise_groups(eqns, observing=frozenset()) -> dict:
    """Equations by the one variable their elementwise computation started from."""
    source: dict = {}
    groups: dict = defaultdict(list)
    for i, eqn in enumerate(eqns):
        if not _pointwise.is_pointwise(eqn) or i in observing:
            continue
        roots = {source.get(v, v) for v in filter(_is_var, eqn.invars)}
        if len(roots) != 1:
            continue
        (root,) = roots
        if any(v.aval.shape != root.aval.shape for v in eqn.outvars):
            continue
        source.update((v, root) for v in eqn.outvars)
        groups[root].append(i)
    return groups


def _chain(source, members, eqns, readers) -> Chain | None:
    """The members as one pointwise function, if they qualify (see the module doc)."""
    inside = set(members)
    escaping = [
        v for i in members for v in eqns[i].outvars if any(r not in inside for r in readers[v])
    ]
    out = eqns[members[-1]].outvars[0]
    if _pointwise.primitives(eqns, members) < 2 or len(escaping) != 1 or escaping[0] is not out:
        return None
    written_in_float32 = (
        all(v.aval.dtype in (F32, np.dtype(bool)) for i in members for v in eqns[i].outvars)
        and source.aval.dtype == F32
    )
    computes_float32 = any(_pointwise.computes_float32(eqns[i]) for i in members)
    products: set = set()  # filled by read_by
    if not (written_in_float32 and computes_float32) or not _readers.read_by(
        out, eqns, readers, _PRODUCTS, found=products
    ):
        return None
    return Chain(source, tuple(members), out, tuple(products))


def joins_product(ctx, eqn, vals, weak) -> bool:
    """Whether `eqn` is a bias add (`find`) under the default policy, whose
    product arrived in the low dtype and whose bias is a float32 parameter
    (`Context.tables`), as torch's ``linear``'s is: not a constant, which does not
    widen, nor a computed value (an attention mask's ``-1e9``, ``-inf`` in float16,
    which torch adds in float32). A sum handed on in float32 joins a product only
    where it kept its float32 accumulator: elsewhere the add widens, as any other."""
    low = ctx.region.dtype
    if low is None or ctx.region.lean or id(eqn) not in ctx.bias_adds:
        return False
    position = ctx.bias_adds[id(eqn)]
    product = vals[position]
    if eqn.invars[1 - position] not in ctx.tables:
        return False
    if id(eqn) in ctx.float32_sums and ctx.scope.accumulator(product) is None:
        return False
    return (
        dtype_of(product) == low and not any(weak) and all(dtype_of(x) in (F32, low) for x in vals)
    )


def bias_add(ctx, eqn, vals):
    """A product plus its bias (`joins_product`), for a product of a float32
    parameter: the bias added in float32 to the product's 16-bit result widened,
    and the sum rounded; added to its float32 accumulator where the product kept
    one (`Fusions.accumulated`: a sum that `find` hands on in float32 or a
    residual sum reads). None for other products: the caller then runs the add in
    the product's dtype."""
    product = vals[ctx.bias_adds[id(eqn)]]
    bias = next(i for i, x in enumerate(vals) if x is not product)
    rounding = id(eqn) not in ctx.float32_sums
    if rounding and ctx.scope.kept_no_accumulator(product):
        operand = product  # widened by the bias add, whose cotangent it takes in 16 bits
    elif (operand := ctx.scope.accumulator(product)) is None:
        return None
    args = [operand if x is product else x for x in vals]
    if dtype_of(vals[bias]) != F32 or dtype_of(operand) not in (F32, ctx.region.dtype):
        return None
    if not rounding:
        return _compat.bind(eqn, *args)
    rounded = _bias.rounded_bias_add(args, bias, ctx.region.dtype)
    # for a residual sum (`residual_operands`): the float32 sum, made if one asks
    wide = lambda: [convert(x, F32, False) for x in args]  # noqa: E731
    ctx.scope.keep_accumulator(rounded, lambda: _compat.bind(eqn, *wide())[0])
    return [rounded]


def residual_operands(ctx, eqn, vals, weak) -> list:
    """`vals`, with a product's rounding replaced by its float32 accumulator where
    `eqn` is a residual sum (`find`) whose result is float32 anyway: another of
    its operands is a float32 value (not a constant, which widens nothing)."""
    if ctx.region.dtype is None or ctx.region.lean or id(eqn) not in ctx.residual_sums:
        return vals
    accumulators = [ctx.scope.accumulator(x) for x in vals]
    if not any(
        a is None and dtype_of(x) == F32 and not w for x, a, w in zip(vals, accumulators, weak)
    ):
        return vals
    return [x if a is None else a for x, a in zip(vals, accumulators)]


def keeps_no_broadcast(prim, *avals, **params) -> bool:
    """A checkpoint policy: everything is saved but broadcasts, which the
    backward pass makes again from fewer elements (or from a constant)."""
    return prim.name != "broadcast_in_dim"


def select(rule, broadcasts, read, ctx, eqn, vals, weak) -> list:
    """A ``select_n`` by `rule`, in a checkpoint that recomputes broadcasts, its
    broadcast operands (`Fusions.selects`) made again inside from their sources."""
    # (position, broadcast, source, weak); a broadcast the interpreter retyped (a
    # cast constant) is left as it came.
    redo = [(k, b, *read(b.invars[0])) for k, b in broadcasts]
    redo = [r for r in redo if dtype_of(r[2]) == dtype_of(vals[r[0]])]
    everything = [source for _, _, source, _ in redo] + list(vals)
    # Traced values go in as arguments; numpy constants stay closed over, so the
    # rule still sees them as literals.
    traced = [i for i, x in enumerate(everything) if not is_concrete(x)]
    concrete = [None if i in traced else x for i, x in enumerate(everything)]
    known = _constants.known(ctx.scope, everything)

    def compute(*args):
        xs = list(concrete)
        for i, x in zip(traced, args):
            xs[i] = x
        inner = xs[len(redo) :]
        with ctx.nested() as child:
            _constants.record(child.scope, known, xs)
            for (k, b, _, w), source in zip(redo, xs):
                # by the select's rule, which is every broadcast's (the policy's)
                (inner[k],) = rule(child, b, [source], [w])
                _constants.record(child.scope, [known[len(redo) + k]], [inner[k]])
            return rule(child, eqn, inner, weak)

    kept = _pointwise.recomputed(compute, ctx.rematted, policy=keeps_no_broadcast)
    return list(kept(*[everything[i] for i in traced]))


def constant_broadcast(ctx, eqn, args, outs) -> list:
    """`outs`; where they broadcast a constant (jnp.zeros_like, a mask's fill),
    their casts are made at the source, then broadcast: of broadcasts alone,
    which a backward pass makes again (`select`) rather than keeping."""
    if eqn.primitive.name == "broadcast_in_dim" and is_concrete(args[0]):
        source = args[0]
        ctx.scope.remake_with(
            outs[0], lambda dtype: _compat.bind(eqn, convert(source, dtype, True))[0]
        )
    return outs
