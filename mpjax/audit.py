"""`audit`: what ran in which precision."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from mpjax import _compat, _nnx
from mpjax import policy
from mpjax._autocast import trace_arrays
from mpjax._marks import original_of

_MATMULS = frozenset(policy.LOW_PRECISION)


class Equation(NamedTuple):
    """One primitive of the audited program, after the policy.

    Examples:
      >>> import jax.numpy as jnp, mpjax
      >>> f = mpjax.autocast(lambda w, x: x @ w)
      >>> eqn = mpjax.audit(f, jnp.ones((4, 3)), jnp.ones((2, 4))).find("dot_general")[0]
      >>> eqn.primitive, eqn.in_dtypes, eqn.out_dtypes, eqn.path
      ('dot_general', ('float16', 'float16'), ('float16',), '')
    """

    primitive: str
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    path: str
    """Where it sits: the higher-order primitives around it, e.g. ``"scan/cond"``
    (a ``jit`` only outside autocast: autocast inlines the jits nested in it)."""
    source: str
    """The user's line that produced it."""


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What a traced function computes in which precision.

    Attributes:
      equations: every primitive whose result is used, in program order,
        sub-programs included (one nothing reads is dropped, as jit drops it).
      float_casts: number of casts between floating dtypes.
      casts_inserted: casts that autocast added, when the audited function is
        an `autocast` function (its float casts minus those of the function it
        wraps, through any autocast nested directly in it); None otherwise.
      matmul_flops: floating-point operations of the dot products and
        convolutions one call runs: a scan body once per iteration, a while
        loop's body once (its trip count is not known), and of a cond's branches
        (``lax.platform_dependent`` included) the one with the most. Inside
        ``shard_map``, on the per-device shapes.
      low_precision_flops: the part of `matmul_flops` with 16-bit inputs.

    Examples:
      >>> import jax.numpy as jnp, mpjax
      >>> def f(w, x):
      ...     return jnp.sum(jnp.exp(x @ w))
      >>> report = mpjax.audit(mpjax.autocast(f), jnp.ones((4, 3)), jnp.ones((2, 4)))
      >>> report.matmul_flops, report.low_precision_fraction, report.casts_inserted
      (48, 1.0, 3)
    """

    equations: tuple[Equation, ...]
    float_casts: int
    casts_inserted: int | None
    matmul_flops: int
    low_precision_flops: int

    @property
    def low_precision_fraction(self) -> float:
        """Share of dot/conv FLOPs that run in float16 or bfloat16 (1.0 if none)."""
        return self.low_precision_flops / self.matmul_flops if self.matmul_flops else 1.0

    def find(self, primitive: str) -> list[Equation]:
        """The equations of one primitive, e.g. ``report.find("dot_general")``.

        Names are JAX's primitives' (or the primitive, ``jax.lax.dot_general_p``): a
        name on torch's autocast op lists that is no JAX primitive's (``"matmul"``)
        raises ValueError naming what to find instead."""
        name = getattr(primitive, "name", primitive)  # a Primitive: jax.lax.exp_p
        if not isinstance(name, str):
            raise TypeError(
                f"AuditReport.find(primitive): expected a primitive's name such as "
                f"'dot_general', got {type(primitive).__name__}."
            )
        found = [e for e in self.equations if e.primitive == name]
        if not found:
            policy.check_not_torch_name(name, "AuditReport.find")
        return found

    def summary(self) -> dict[tuple[str, tuple[str, ...], tuple[str, ...]], int]:
        """Counts of (primitive, input dtypes, output dtypes)."""
        return dict(
            collections.Counter((e.primitive, e.in_dtypes, e.out_dtypes) for e in self.equations)
        )

    def __str__(self) -> str:
        rows = sorted(self.summary().items(), key=lambda kv: (kv[0][0], -kv[1]))
        width = max([len(k[0]) for k, _ in rows] + [9])
        lines = [f"{'primitive':<{width}}  {'count':>5}  inputs -> outputs"]
        for (prim, ins, outs), n in rows:
            lines.append(f"{prim:<{width}}  {n:>5}  {', '.join(ins) or '-'} -> {', '.join(outs)}")
        inserted = (
            "" if self.casts_inserted is None else f" ({self.casts_inserted} inserted by autocast)"
        )
        lines.append(f"float casts: {self.float_casts}{inserted}")
        lines.append(
            f"dot/conv FLOPs in 16-bit precision: {self.low_precision_fraction:.1%} "
            f"of {self.matmul_flops:,}"
            if self.matmul_flops
            else "dot/conv FLOPs in 16-bit precision: none, no dense product or convolution"
        )
        sparse = sorted({prim for prim, _, _ in self.summary() if _is_other_product(prim)})
        if sparse:
            # jax.experimental.sparse's products: autocast has no rule for them.
            lines.append(f"not counted: {', '.join(sparse)}, run as traced, in their own dtypes")
        float8 = any(i.startswith("float8") for _, ins, _ in self.summary() for i in ins)
        if self.matmul_flops and not self.low_precision_flops and not float8:
            # The usual cause: the function audited is not the autocast one (a
            # float8 program's products are narrower still, as its author chose).
            lines.append(
                "no product runs in 16 bits: audit the function autocast returns "
                "(audit(autocast(f), ...)), or one that calls it"
                if self.casts_inserted is None
                else "no product runs in 16 bits: autocast ran each as written, as it runs "
                "a product given a precision (jnp.linalg's and jax.scipy's ask for "
                "HIGHEST), a float32 or float64 result, an integer operand, one only a "
                "factorization reads, and a jax.custom_vjp function (Equinox's checkpointed "
                "while_loop, diffrax's solvers): docs/policy.md"
            )
        return "\n".join(lines)


def audit(fun: Callable, /, *args, **kwargs) -> AuditReport:
    """Traces ``fun(*args, **kwargs)`` and reports the precision of every operation.

    `fun` is audited as given: pass ``autocast(f)``, ``jax.grad(autocast(f))`` or a
    whole training step. Nothing is executed.

    Examples:
      >>> import jax.numpy as jnp, mpjax
      >>> def f(w, x):
      ...     return jnp.sum(jnp.exp(x @ w))
      >>> report = mpjax.audit(mpjax.autocast(f), jnp.ones((4, 3)), jnp.ones((2, 4)))
      >>> [e.in_dtypes for e in report.find("dot_general")]
      [('float16', 'float16')]
      >>> report.low_precision_fraction
      1.0
      >>> print(report)  # doctest: +SKIP
    """
    if not callable(fun):
        raise TypeError(
            f"audit(fun, ...): fun must be callable, got {type(fun).__name__}. "
            "Pass the function and its arguments: audit(autocast(f), *args)."
        )
    if hasattr(fun, "__mpjax_module__"):
        # ``autocast(nnx_model)``: traced with the module passed in, as it runs.
        fun, module = fun.__mpjax_module__
        args = (module, *args)
    elif (bound := _nnx.bound_module(fun)) is not None:
        # An NNX module (or its method) itself, the same way: closed over, its
        # state updates (dropout's RNG counts) would be writes from inside a trace.
        module, fun = bound
        args = (module, *args)
    equations, casts, flops, low_flops = _walk(_trace(fun, args, kwargs))
    inserted = None
    original = original_of(fun)
    while (inner := original_of(original)) is not None:  # autocast(autocast(f)): f's
        original = inner
    if original is not None:
        inserted = casts - _walk(_trace(original, args, kwargs))[1]
    return AuditReport(tuple(equations), casts, inserted, flops, low_flops)


def _trace(fun, args, kwargs):
    # As autocast does: arrays are traced, Python scalars stay Python values.
    closed, _, _ = trace_arrays(fun, args, kwargs)
    return _compat.without_dead_code(_compat.jaxpr_and_consts(closed)[0])


def _dtype_names(atoms) -> tuple[str, ...]:
    return tuple(str(a.aval.dtype) for a in atoms if hasattr(a.aval, "dtype"))


def _walk(jaxpr, path: str = "", repeat: int = 1):
    equations, casts, flops, low_flops = [], 0, 0, 0
    upcast_from = {}  # var -> the 16-bit dtype of the value it is an upcast of
    for eqn in _live(jaxpr):
        name = eqn.primitive.name
        own = _compat.called_name(eqn).startswith("mpjax_")  # mpjax's own wrapper:
        if not own:  # what it calls is listed, as if inlined
            equations.append(
                Equation(
                    name,
                    _dtype_names(eqn.invars),
                    _dtype_names(eqn.outvars),
                    path,
                    _compat.user_frame(eqn),
                )
            )
        if name == "convert_element_type":
            src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
            if np.dtype(src) in policy.LOW_DTYPES and np.dtype(dst) == np.float32:
                upcast_from[eqn.outvars[0]] = np.dtype(src)
            # jnp.issubdtype: numpy does not count bfloat16 as floating.
            casts += (
                src != dst
                and jnp.issubdtype(src, jnp.floating)
                and jnp.issubdtype(dst, jnp.floating)
            )
        elif name in _MATMULS and any(
            jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars[:2]
        ):
            n = _matmul_flops(eqn) * repeat  # integer products are not floating-point work
            flops += n
            if _multiplies_low(eqn.invars[:2], upcast_from):
                low_flops += n
        inner_repeat = repeat * (eqn.params["length"] if name == "scan" else 1)
        branches = []  # (flops, low_flops) of each branch of a cond
        for sub in _compat.sub_jaxprs(eqn.params):
            inner, _ = _compat.jaxpr_and_consts(sub)
            inner_path = path if own else f"{path}/{name}" if path else name
            e, c, f, lf = _walk(inner, inner_path, inner_repeat)
            equations += e
            casts += c
            branches.append((f, lf))
        # One branch of a cond runs: count the costliest (all other sub-programs run).
        runs = [max(branches)] if name == "cond" and branches else branches
        flops += sum(f for f, _ in runs)
        low_flops += sum(lf for _, lf in runs)
    return equations, casts, flops, low_flops


def _live(jaxpr) -> list:
    """The equations of `jaxpr` whose results are used: what runs once compiled.

    Tracing can keep a result nobody reads; jit drops it.
    """
    used = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in used for v in eqn.outvars):
            live.append(eqn)
            used.update(v for v in eqn.invars if not isinstance(v, _compat.Literal))
    return live[::-1]


def _multiplies_low(operands, upcast_from) -> bool:
    """Whether a product multiplies 16-bit values.

    A product kept at a float32 result is transposed into products of a float32
    cotangent, upcast from 16 bits, and a 16-bit operand: 16-bit values still,
    run on 16-bit units where the backend can (see ``autocast(reduce_dtype=)``).
    """
    dtypes = [np.dtype(v.aval.dtype) for v in operands]
    if not any(d in policy.LOW_DTYPES for d in dtypes):
        return False
    return all(d in policy.LOW_DTYPES or v in upcast_from for v, d in zip(operands, dtypes))


def _is_other_product(primitive: str) -> bool:
    """A product (``bcoo_dot_general``, ``bcsr_dot_general``) that is not one of
    the dense products and convolutions the FLOP share counts."""
    return primitive.endswith("dot_general") and primitive not in _MATMULS


def _matmul_flops(eqn) -> int:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    if eqn.primitive.name == "conv_general_dilated":
        return _conv_flops(eqn, lhs, rhs)
    if eqn.primitive.name == "dot_general":
        (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
        rhs_free = [d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch)]
        return 2 * math.prod(lhs) * math.prod(rhs_free)
    # ragged_dot: each row of lhs meets one group of rhs, so every lhs element is
    # multiplied by each free element of one group (its gradients too).
    numbers = eqn.params.get("ragged_dot_dimension_numbers")
    if numbers is None:
        return 2 * math.prod(lhs) * rhs[-1]  # lhs [m, k] against rhs [groups, k, n]
    (_, contract), (_, batch) = numbers.dot_dimension_numbers
    taken = {*contract, *batch, *numbers.rhs_group_dimensions}
    return 2 * math.prod(lhs) * math.prod(d for i, d in enumerate(rhs) if i not in taken)


def _conv_flops(eqn, lhs, rhs) -> int:
    """A convolution's multiply-adds, twice: per output element, its kernel's taps
    that meet an input element, as XLA counts them. A tap on the padding, or on a
    zero an input dilation inserts (a transposed convolution, the input gradient
    of a strided one), multiplies nothing."""
    params = eqn.params
    dims = params["dimension_numbers"]
    out = eqn.outvars[0].aval.shape
    spatial = len(dims.lhs_spec) - 2
    lhs_dilation = params.get("lhs_dilation") or (1,) * spatial
    rhs_dilation = params.get("rhs_dilation") or (1,) * spatial
    pairs = 1  # (output position, tap) pairs that meet an input element
    for d in range(spatial):
        size, taps = lhs[dims.lhs_spec[2 + d]], rhs[dims.rhs_spec[2 + d]]
        at = (
            np.arange(out[dims.out_spec[2 + d]])[:, None] * params["window_strides"][d]
            + np.arange(taps)[None, :] * rhs_dilation[d]
            - params["padding"][d][0]
        )
        step = lhs_dilation[d]
        pairs *= int(np.count_nonzero((at >= 0) & (at <= (size - 1) * step) & (at % step == 0)))
    spatial_out = math.prod(out[i] for i in dims.out_spec[2:])
    spatial_taps = math.prod(rhs[i] for i in dims.rhs_spec[2:])
    per_pair = math.prod(out) // max(spatial_out, 1) * math.prod(rhs) // max(spatial_taps, 1)
    return 2 * pairs * per_pair // max(rhs[dims.rhs_spec[0]], 1)

