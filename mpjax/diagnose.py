"""`diagnose`: where a 16-bit training step overflows or underflows, in the user's terms."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat
from mpjax import _diagnose_advice as advice
from mpjax import _diagnose_args as da
from mpjax import _diagnose_walk as dw
from mpjax._autocast import autocast, trace_arrays
from mpjax._diagnose_report import DiagnoseReport, LayerRange, LeafGradient, Origin, Run

_OWN_SCOPE = "mpjax_diagnose_scale"


def diagnose(
    loss_fn: Callable,
    params: Any,
    *batch,
    dtype=jnp.float16,
    scale: Any = None,
    has_aux: bool = False,
    policy: str = "torch",
) -> DiagnoseReport:
    """Runs one training step in 16 bits and reports where it overflows or underflows.

    Computes the loss and the gradient of ``loss * scale`` under
    ``mpjax.autocast(loss_fn, dtype=dtype)``, as ``mpjax.scaled_value_and_grad``
    does, evaluating the step's program one equation at a time on concrete
    values and checking every floating output; and the same step in float32
    (`loss_fn` as written) for reference. The report gives:

    * the first equation of the forward pass, and of the backward pass, that
      produced an inf or NaN from finite inputs: its primitive, its module (the
      name stack: Flax Linen modules, ``jax.named_scope``), your source line;
    * per parameter: the largest gradient (divided by the scale), and the shares
      of elements that are zero only in 16 bits (underflow) or not finite
      (overflow);
    * per module: the range of the values it computes against float16's and
      bfloat16's;
    * recommendations computed from these figures: the loss scale to start from
      (the largest power of two that keeps the largest 16-bit gradient value,
      times ``HEADROOM = 8``, below 65504), and where a region should stay in
      float32.

    A host-side tool: it runs eagerly, outside ``jax.jit`` (call it on concrete
    arrays, not inside a jitted function), copies every value to the host, and
    leaves the program you train with unchanged. Sharded arrays are accepted;
    the step then runs on them operation by operation. Equations are told apart
    by JAX's name stack: those of the backward pass carry a ``transpose(...)``
    transform (a ``jax.checkpoint`` region recomputed there counts as backward).
    Inside ``scan`` and ``while`` loops values are checked per loop, not per
    operation; a ``scan`` that produces the first inf is run again one step at
    a time to find the operation.

    Args:
      loss_fn: ``loss_fn(params, *batch)`` returns a scalar loss (``(loss, aux)``
        with `has_aux`). Pass the function you wrap with `autocast`, not the
        wrapped one (an `autocast` function is unwrapped).
      params: what to differentiate: a pytree of arrays (Flax Linen variables
        with ``lambda v, x: model.apply(v, x)``), or a Flax NNX module, whose
        ``nnx.Param`` state is differentiated (its other state, BatchNorm
        statistics or RNG counts, is used and left unchanged).
      *batch: the other arguments of `loss_fn`; non-array leaves are static.
      dtype: ``jnp.float16`` (default), ``jnp.bfloat16``, or ``"both"``.
      scale: the loss scale: a number, or an optimizer state holding
        `grad_scaler`'s state (its current scale is used). Default: ``2**16``
        for float16, 1 for bfloat16.
      has_aux: whether `loss_fn` returns ``(loss, aux)``.
      policy: autocast's policy, ``"torch"`` or ``"lean"``.

    Returns:
      A `DiagnoseReport`: ``print(report)`` for the tables,
      ``report.plot(path)`` for a chart, ``report.as_dict()`` for the figures.

    Examples:
      >>> import jax.numpy as jnp, mpjax
      >>> def loss_fn(params, x):
      ...     h = x @ params["w"]        # about 1e5: beyond float16's 65504
      ...     return jnp.mean((h * 1e-5 - 1.0) ** 2)
      >>> params = {"w": jnp.full((64, 8), 40.0)}
      >>> report = mpjax.diagnose(loss_fn, params, jnp.full((4, 64), 50.0))
      >>> report.runs[0].forward.primitive
      'convert_element_type'
      >>> report.reference_forward is None   # float32 is finite: a precision problem
      True
      >>> print(report)  # doctest: +SKIP
    """
    dtypes = da.check_options(loss_fn, dtype, has_aux, policy)
    scales = {name: da.check_scale(scale, name) for name in dtypes}
    return _report(da.problem(da.unwrap(loss_fn), params, batch, has_aux), scales, policy)


def _report(problem: da.Problem, scales: dict[str, float], policy: str) -> DiagnoseReport:
    program = _Program(problem, None, policy)
    calls = dw.call_names(program.jaxpr)  # autocast inlines them: names to leave out
    reference = program.evaluate(1.0, calls)
    runs, lows = [], {}
    for name, scale in scales.items():
        run, lows[name] = _diagnose_dtype(problem, name, scale, policy, reference, calls)
        runs.append(run)
    report = DiagnoseReport(
        tuple(runs),
        reference.loss,
        reference.origins.get("forward"),
        reference.origins.get("backward"),
        _layers(reference, lows),
        (),
    )
    return dataclasses.replace(report, recommendations=advice.advise(report))


# --------------------------------------------------------------------------
# Runs


class _Program:
    """The step ``(scale, leaves, *batch) -> (loss, grads)`` as one jaxpr."""

    def __init__(self, problem: da.Problem, dtype: str | None, policy: str):
        fn = problem.pure
        if dtype is not None:
            fn = autocast(fn, dtype=da.DTYPES[dtype], policy=policy)

        def step(scale, leaves, *batch):
            def scaled(leaves):
                loss = fn(leaves, *batch)
                with jax.named_scope(_OWN_SCOPE):  # not the user's: left out of the tables
                    wide = jnp.promote_types(loss.dtype, jnp.float32)
                    return loss.astype(wide) * scale.astype(wide), loss

            (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(leaves)
            return loss, grads

        args = (jnp.float32(1.0), problem.leaves, *problem.batch)
        closed, _, self.args = trace_arrays(step, args, {})
        self.jaxpr, self.consts = _compat.jaxpr_and_consts(closed)
        self.dtype = dtype

    def evaluate(self, scale: float, calls=frozenset(), collect: bool = True) -> _Collector:
        collector = _Collector(scale, calls, collect)
        args = [jnp.float32(scale), *self.args[1:]]
        outs = dw.Walk(collector).run(self.jaxpr, self.consts, args)
        collector.loss = float(np.asarray(outs[0], np.float64))
        collector.grads = outs[1:]
        return collector


class _Collector:
    """Observes a walk: the first origin per phase, ranges per module."""

    def __init__(self, scale: float, calls: frozenset, collect: bool):
        self.scale, self.calls, self.collect = scale, calls, collect
        self.origins: dict[str, Origin] = {}
        # module -> [forward max, forward min non-zero, forward finite, backward max,
        #            forward non-zero count, of those flushed to 0 by float16]
        self.modules: dict[str, list] = {}
        self.backward_low_max = 0.0
        self.loss, self.grads = math.nan, []

    def __call__(self, event: dw.Event) -> None:
        phase = "backward" if event.backward else "forward"
        if not all(s.finite for s in event.out_stats):
            if event.inputs_finite and phase not in self.origins:
                self.origins[phase] = _origin(event, phase, self.calls)
        if not self.collect or not event.out_stats or _OWN_SCOPE in event.stack:
            return
        key = dw.module_path(event.stack, self.calls) or _line_key(event.eqn)
        if key is None:
            return
        row = self.modules.setdefault(key, [0.0, math.inf, True, 0.0, 0, 0])
        for s in event.out_stats:
            if event.backward:
                row[3] = max(row[3], s.max_abs / self.scale)
                if s.low:
                    self.backward_low_max = max(self.backward_low_max, s.max_abs / self.scale)
            else:
                row[0], row[1] = max(row[0], s.max_abs), min(row[1], s.min_abs)
                row[2] = row[2] and s.finite
                row[4], row[5] = row[4] + s.nonzero, row[5] + s.flushed


def _line_key(eqn) -> str | None:
    """A row for an equation outside any named module: its source line (None for
    those of the step around the loss: the seed of the gradient, the scaling)."""
    where = dw.where(eqn)
    if not where.file:
        return None
    return f"{where.function} ({dw.short_path(where.file)}:{where.line})"


def _origin(event: dw.Event, phase: str, calls: frozenset) -> Origin:
    eqn = event.eqn
    produced = set()
    for o in event.outs:
        if da.is_float(o):
            a = np.asarray(o).astype(np.float64)
            produced |= {"inf"} if np.isinf(a).any() else set()
            produced |= {"nan"} if np.isnan(a).any() else set()
    where = dw.where(eqn)
    return Origin(
        phase=phase,
        primitive=eqn.primitive.name,
        module=dw.module_path(event.stack, calls),
        file=where.file,
        line=where.line,
        function=where.function,
        library_source=where.library,
        in_dtypes=tuple(str(v.aval.dtype) for v in eqn.invars if da.is_float(v.aval)),
        out_dtypes=tuple(str(v.aval.dtype) for v in eqn.outvars if da.is_float(v.aval)),
        in_max_abs=max((s.max_abs for s in event.in_stats), default=0.0),
        produced=" and ".join(sorted(produced)) or "inf",
        inside=event.inside,
    )


def _leaf_gradients(problem, low, reference, scale) -> tuple[LeafGradient, ...]:
    out = []
    for path, g, ref in zip(problem.paths, low.grads, reference.grads):
        g = np.asarray(g).astype(np.float64) / scale
        ref = np.asarray(ref).astype(np.float64)
        finite = np.isfinite(g)
        out.append(
            LeafGradient(
                path=path,
                size=int(g.size),
                max_abs=float(np.abs(g).max()) if finite.all() else math.inf,
                reference_max_abs=float(np.abs(ref).max()) if ref.size else 0.0,
                underflow=float(np.mean((g == 0) & (ref != 0))) if g.size else 0.0,
                overflow=float(1.0 - finite.mean()) if g.size else 0.0,
            )
        )
    return tuple(out)


def _diagnose_dtype(problem, dtype, scale, policy, reference, calls):
    program = _Program(problem, dtype, policy)
    low = program.evaluate(scale, calls)
    forward, backward = low.origins.get("forward"), low.origins.get("backward")
    leaves = _leaf_gradients(problem, low, reference, scale)
    largest = low.backward_low_max
    if backward is not None and forward is None:
        largest = program.evaluate(1.0, calls).backward_low_max  # unknown where it overflowed
    recommended = advice.recommended_scale(largest) if dtype == "float16" else None
    again = ()
    if (
        recommended is not None
        and forward is None
        and recommended > scale
        and any(leaf.underflow > advice.UNDERFLOW_SHARE for leaf in leaves)
    ):
        at = program.evaluate(recommended, calls, collect=False)
        again = _leaf_gradients(problem, at, reference, recommended)
    run = Run(dtype, scale, low.loss, forward, backward, leaves, largest, recommended, again)
    return run, low


def _layers(reference: _Collector, lows: dict[str, _Collector]) -> tuple[LayerRange, ...]:
    out = []
    for module, (fmax, fmin, _, bmax, nonzero, flushed) in reference.modules.items():
        low_max = {}
        for dtype, low in lows.items():
            row = low.modules.get(module)
            if row is not None:
                low_max[dtype] = row[0] if row[2] else math.inf
        flush = flushed / nonzero if nonzero else 0.0
        out.append(LayerRange(module, fmax, fmin, bmax, low_max, flush))
    return tuple(out)
