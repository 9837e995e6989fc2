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
from mpjax._casting import promoted
from mpjax._diagnose_report import RANGES, DiagnoseReport, LayerRange, LeafGradient, Origin, Run
from mpjax._products import RECAST_SCOPE

_OWN_SCOPE = "mpjax_diagnose_scale"


def diagnose(
    loss_fn: Callable,
    params: Any,
    *batch,
    dtype=None,
    scale: Any = None,
    has_aux: bool = False,
    policy: str | None = None,
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
      (the largest power of two that keeps the largest 16-bit backward value,
      times ``HEADROOM = 8``, below 65504), and where a region should stay in
      float32.

    A host-side tool: it runs eagerly, outside ``jax.jit`` (call it on concrete
    arrays, not inside a jitted function), copies every value to the host, and
    leaves the program you train with unchanged. Sharded arrays are accepted;
    the step then runs on them operation by operation. Equations are told apart
    by JAX's name stack: those of the backward pass carry a ``transpose(...)``
    transform (a ``jax.checkpoint`` region recomputed there counts as forward:
    the loss scale does not reach it).
    Inside ``scan`` and ``while`` loops values are checked per loop, not per
    operation; a ``scan`` that makes inf or NaN from finite values is run again
    one step at a time to find the operation.

    Args:
      loss_fn: ``loss_fn(params, *batch)`` returns a scalar loss (``(loss, aux)``
        with `has_aux`). Pass the function you wrap with `autocast`, or the `autocast`
        function (in a ``functools.partial`` too), unwrapped, its dtype and policy the
        defaults (one called inside another function keeps its own dtype).
      params: what to differentiate: a pytree of arrays (Flax Linen variables
        with ``lambda v, x: model.apply(v, x)``), or a Flax NNX module, whose
        ``nnx.Param`` state is differentiated (its other state, BatchNorm
        statistics or RNG counts, is used and left unchanged).
      *batch: the other arguments of `loss_fn`; non-array leaves are static.
      dtype: ``jnp.float16``, ``jnp.bfloat16``, or ``"both"``. Default: an autocast
        `loss_fn`'s (another is a ValueError), else float16.
      scale: the loss scale: a number, or an optimizer state holding
        `grad_scaler`'s state (its current scale is used). Default: ``2**16``
        for float16, 1 for bfloat16.
      has_aux: whether `loss_fn` returns ``(loss, aux)``.
      policy: ``"torch"`` or ``"lean"``; default: an autocast `loss_fn`'s, else ``"torch"``.

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
      'dot_general'
      >>> report.reference_forward is None   # float32 is finite: a precision problem
      True
      >>> print(report)  # doctest: +SKIP
    """
    loss_fn, dtype, policy = da.unwrap(loss_fn, dtype, policy)
    dtypes = da.check_options(loss_fn, dtype, has_aux, policy)
    scales = {name: da.check_scale(scale, name) for name in dtypes}
    return _report(da.problem(loss_fn, params, batch, has_aux), scales, policy)


def _report(problem: da.Problem, scales: dict[str, float], policy: str) -> DiagnoseReport:
    program = _Program(problem, None, policy)
    reference = program.evaluate(1.0)
    runs, lows = [], {}
    for name, scale in scales.items():
        run, lows[name] = _diagnose_dtype(problem, name, scale, policy, reference)
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
                    wide = promoted(loss.dtype, jnp.float32)
                    return loss.astype(wide) * scale.astype(wide), loss

            (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(leaves)
            return loss, grads

        args = (jnp.float32(1.0), problem.leaves, *problem.batch)
        closed, _, self.args = trace_arrays(step, args, {})
        self.jaxpr, self.consts = _compat.jaxpr_and_consts(closed)
        self.dtype = dtype

    def evaluate(self, scale: float, collect=True, reference=None):
        """A run at `scale`, against the float32 run `reference` (None for that run)."""
        collector = _Collector(scale, collect, reference)
        args = [jnp.float32(scale), *self.args[1:]]
        seeded = [True] + [False] * (len(args) - 1)  # the scale seeds the gradient
        walk = dw.Walk(collector, collector.wants_zoom)
        feeds = [dw.LOSS] + [dw.GRADIENTS] * (len(self.jaxpr.outvars) - 1)
        outs = walk.run(self.jaxpr, self.consts, args, seeded=seeded, feeds=feeds)
        collector.loss = float(np.asarray(outs[0], np.float64))
        collector.grads = outs[1:]
        return collector


@dataclasses.dataclass
class _Row:
    """What one module computes in one run."""

    max_abs: float = 0.0  # forward
    min_abs: float = math.inf  # forward, non-zero
    grad_max_abs: float = 0.0  # backward, divided by the scale
    low_max_abs: float | None = None  # forward 16-bit values; inf once one overflows
    cast_nonzero: int = 0  # forward casts to 16 bits: their non-zero inputs ...
    cast_flushed: int = 0  # ... that came out 0


class _Collector:
    """Observes a walk: the first origin per phase, ranges per module."""

    def __init__(self, scale: float, collect: bool, reference: _Collector | None):
        self.scale, self.collect = scale, collect
        self.origins: dict[str, Origin] = {}
        # Where this run makes inf or NaN from finite inputs; an origin in `known`
        # (the float32 run makes it too: a log(mask)'s -inf) is not precision's doing.
        # And where any of its outputs is inf or NaN: in the float32 run, by design
        # (segment_max's -inf for an empty segment), where 16 bits hold it too.
        self.nonfinite_at, self.nonfinite_out = set(), set()
        self.known = frozenset() if reference is None else reference.nonfinite_at
        self.known_out = frozenset() if reference is None else reference.nonfinite_out
        self.known_lines = frozenset((p, *rest) for p, _, *rest in self.known_out)
        self.zoom_all = reference is None  # the float32 run: its sets must be whole
        self.modules: dict[str, _Row] = {}
        self.backward_max = 0.0  # of all backward values, divided by the scale
        self.backward_low_max = 0.0  # of the 16-bit ones
        self.loss, self.grads = math.nan, []

    def wants_zoom(self, backward: bool) -> bool:
        """Whether a scan that makes inf or NaN is run step by step: until the
        phase has its origin (the first such scan's may be one float32 makes too)."""
        return self.zoom_all or ("backward" if backward else "forward") not in self.origins

    def __call__(self, event: dw.Event) -> None:
        if RECAST_SCOPE in event.stack:  # the forward pass's cast made again
            return
        phase = "backward" if event.backward else "forward"
        overflow = False  # made inf or NaN where the float32 run has none
        if not all(s.finite for s in event.out_stats):
            where = dw.where(event.eqn, event.callers)
            module = dw.module_path(event.stack)  # a line runs once per layer
            at = (phase, event.eqn.primitive.name, module, where.file, where.line)
            self.nonfinite_out.add(at)
            if event.inputs_finite or event.eqn.primitive.name != "convert_element_type":
                overflow = at not in self.known_out
            else:  # autocast's cast of inf: an overflow's unless float32 has inf there too
                overflow = (phase, module, where.file, where.line) not in self.known_lines
            if event.inputs_finite:
                self.nonfinite_at.add(at)
                if phase not in self.origins and at not in self.known:
                    self.origins[phase] = _origin(event, phase)
        if not event.out_stats or _OWN_SCOPE in event.stack:
            return
        key = dw.module_path(event.stack) or _line_key(event)
        if key is None:  # the gradient's seed, outside the loss
            return
        if event.backward:
            for s in event.out_stats:
                self.backward_max = max(self.backward_max, s.max_abs / self.scale)
                if s.low:
                    self.backward_low_max = max(self.backward_low_max, s.max_abs / self.scale)
        if self.collect and (event.backward or event.feeds_loss):
            _add(self.modules.setdefault(key, _Row()), event, self.scale, overflow)


def _add(row: _Row, event: dw.Event, scale: float, overflow: bool) -> None:
    if event.backward:
        row.grad_max_abs = max([row.grad_max_abs, *(s.max_abs / scale for s in event.out_stats)])
        return
    for s in event.out_stats:
        row.max_abs, row.min_abs = max(row.max_abs, s.max_abs), min(row.min_abs, s.min_abs)
        if overflow and not s.finite:  # in any dtype: the inf travels on from 16 bits
            row.low_max_abs = math.inf
        elif s.low:
            row.low_max_abs = max(row.low_max_abs or 0.0, s.max_abs)
    if event.eqn.primitive.name == "convert_element_type" and event.out_stats[0].low:
        before = np.asarray(event.ins[0]).astype(np.float64)
        after = np.asarray(event.outs[0]).astype(np.float64)
        nonzero = (before != 0) & np.isfinite(before)
        row.cast_nonzero += int(np.count_nonzero(nonzero))
        row.cast_flushed += int(np.count_nonzero(nonzero & (after == 0)))


def _line_key(event: dw.Event) -> str | None:
    """A row for an equation outside any named module: its source line (None for
    those of the step around the loss: the seed of the gradient, the scaling)."""
    where = dw.where(event.eqn, event.callers)
    if not where.file:
        return None
    return f"{where.function} ({dw.short_path(where.file)}:{where.line})"


def _origin(event: dw.Event, phase: str) -> Origin:
    eqn = event.eqn
    produced = set()
    for o in event.outs:
        if da.is_float(o):
            a = np.asarray(o).astype(np.float64)
            produced |= {"inf"} if np.isinf(a).any() else set()
            produced |= {"nan"} if np.isnan(a).any() else set()
    where = dw.where(eqn, event.callers)
    return Origin(
        phase=phase,
        primitive=eqn.primitive.name,
        module=dw.module_path(event.stack),
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
                max_abs=(float(np.abs(g).max()) if g.size else 0.0) if finite.all() else math.inf,
                reference_max_abs=float(np.abs(ref).max()) if ref.size else 0.0,
                underflow=float(np.mean((g == 0) & (ref != 0))) if g.size else 0.0,
                overflow=float(1.0 - finite.mean()) if g.size else 0.0,
            )
        )
    return tuple(out)


def _diagnose_dtype(problem, dtype, scale, policy, reference):
    program = _Program(problem, dtype, policy)
    low = program.evaluate(scale, reference=reference)
    forward, backward = low.origins.get("forward"), low.origins.get("backward")
    leaves = _leaf_gradients(problem, low, reference, scale)
    largest, recommended, again = low.backward_low_max, None, ()
    if dtype == "float16" and forward is None:
        largest, recommended, again = _scale_figures(program, low, problem, reference)
    elif forward is not None:  # an overflow the scale cannot reach: none is safe
        largest = math.inf
    run = Run(dtype, scale, low.loss, forward, backward, leaves, largest, recommended, again)
    return run, low


def _scale_figures(program, low, problem, reference):
    """(largest 16-bit backward value, recommended scale, gradients measured there).

    The largest value is read from the run at the user's scale unless it overflowed
    there, or its largest value is subnormal (flushed, so imprecise): then from a
    run at the scale the float32 backward pass's largest value allows, which keeps
    every 16-bit value (a rounding of a float32 one) in range.
    """
    runs = {low.scale: low}
    largest = low.backward_low_max
    if "backward" in low.origins or largest * low.scale < RANGES["float16"][1]:
        probe = advice.recommended_scale(reference.backward_max)
        if probe is not None:  # (None: float32's backward pass is zero too)
            runs[probe] = program.evaluate(probe, False, reference)
            largest = runs[probe].backward_low_max
            if not _finite(runs[probe]) and probe <= low.scale:
                return math.inf, None, ()  # it overflows at every scale down to `probe`
    recommended, low_finite = advice.recommended_scale(largest), _finite(low)
    if recommended is not None and (recommended > low.scale or not low_finite):
        safe = low.scale if low_finite else 2.0**advice.MIN_LOG2
        recommended = _checked(program, runs, recommended, min(safe, recommended), reference)
    if recommended is None or recommended == low.scale:
        return largest, recommended, ()
    leaves = _leaf_gradients(problem, low, reference, low.scale)
    if recommended > low.scale and not advice.underflowing(leaves, low.scale):
        return largest, recommended, ()
    # Measured again where raising the scale brings gradients back, and where
    # lowering it (out of an overflow) may lose small ones.
    if recommended not in runs:
        runs[recommended] = program.evaluate(recommended, False, reference)
    return largest, recommended, _leaf_gradients(problem, runs[recommended], reference, recommended)


def _finite(run: _Collector) -> bool:
    return "backward" not in run.origins and all(np.isfinite(g).all() for g in run.grads)


def _checked(program, runs, scale, safe, reference) -> float:
    """The largest power of two from `safe` (a run there is finite) to `scale` at which
    a run is finite. Values inside a loop (a scan's backward carry) are not measured,
    so a scale derived from the others may still overflow there: the runs decide."""

    def finite(k: int) -> bool:
        if 2.0**k not in runs:
            runs[2.0**k] = program.evaluate(2.0**k, False, reference)
        return _finite(runs[2.0**k])

    lo, hi = math.frexp(safe)[1] - 1, math.frexp(scale)[1] - 1
    if finite(hi):  # the common case: one run, kept for the underflow figures
        return scale
    hi -= 1
    while lo < hi:  # lo: finite (or below a finite scale); above hi: not finite
        k = (lo + hi + 1) // 2
        lo, hi = (k, hi) if finite(k) else (lo, k - 1)
    return 2.0**lo


def _layers(reference: _Collector, lows: dict[str, _Collector]) -> tuple[LayerRange, ...]:
    out = []
    for module, row in reference.modules.items():
        low_max, flushed = {}, {}
        for dtype, low in lows.items():
            low_row = low.modules.get(module)
            if low_row is not None and low_row.low_max_abs is not None:
                low_max[dtype] = low_row.low_max_abs
            if low_row is not None and low_row.cast_nonzero:
                flushed[dtype] = low_row.cast_flushed / low_row.cast_nonzero
        out.append(LayerRange(module, row.max_abs, row.min_abs, row.grad_max_abs, low_max, flushed))
    return tuple(out)
