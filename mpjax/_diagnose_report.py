"""What `mpjax.diagnose` returns: the figures, their text table and their plot."""

from __future__ import annotations

import dataclasses
import math
import os
import textwrap

from mpjax._diagnose_walk import short_path

# (largest finite, smallest normal, smallest subnormal) of each 16-bit format.
RANGES = {
    "float16": (65504.0, 2.0**-14, 2.0**-24),
    "bfloat16": (3.3895313892515355e38, 2.0**-126, 2.0**-133),
}


@dataclasses.dataclass(frozen=True)
class Origin:
    """The first equation whose output is inf or NaN while its inputs were finite."""

    phase: str
    """``"forward"`` or ``"backward"``."""
    primitive: str
    module: str
    """Its name-stack path without mpjax's scopes (Flax Linen modules,
    ``jax.named_scope``); empty at the top level."""
    file: str
    line: int
    function: str
    """The user's line that produced it (the first frame outside installed packages)."""
    library_source: str
    """The library line inside that call (a Flax layer), or empty."""
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    in_max_abs: float
    """The largest magnitude among its (finite) floating inputs."""
    produced: str
    """What came out: ``"inf"``, ``"nan"`` or ``"inf and nan"``."""
    inside: str = ""
    """Where inside a `scan` it was found (``"scan step 3"``), if there."""

    @property
    def source(self) -> str:
        """``file:line (function)``, the file relative to the working directory."""
        if not self.file:
            return self.library_source or "unknown"
        return f"{short_path(self.file)}:{self.line} ({self.function})"

    @property
    def what(self) -> str:
        """What the primitive is, where its name alone would puzzle: autocast's casts."""
        if self.primitive == "convert_element_type" and set(self.out_dtypes) & set(RANGES):
            return f"a rounding to {self.out_dtypes[0]}: a matrix product's input or result"
        return ""

    def describe(self) -> str:
        """One line: primitive, module, source, and where inside a loop."""
        what = f" ({self.what})" if self.what else ""
        where = f" in {self.module}" if self.module else ""
        via = f" via {self.library_source}" if self.library_source else ""
        inside = f", {self.inside}" if self.inside else ""
        return f"`{self.primitive}`{what}{where} at {self.source}{via}{inside}"


@dataclasses.dataclass(frozen=True)
class LeafGradient:
    """One parameter's gradient in a 16-bit run, against the float32 reference."""

    path: str
    """``jax.tree_util.keystr`` of the leaf (``['params']['Dense_0']['kernel']``)."""
    size: int
    max_abs: float
    """Largest magnitude, divided by the scale (float32 units); inf if any is not finite."""
    reference_max_abs: float
    """Largest magnitude in the float32 run."""
    underflow: float
    """Share of elements that are zero in the 16-bit run and not in float32."""
    overflow: float
    """Share of elements that are inf or NaN in the 16-bit run."""


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """The values one module (name-stack prefix, or source line) computes."""

    module: str
    max_abs: float
    """Largest magnitude of its forward floating outputs, in the float32 run: those
    the loss reads (not the values JAX's derivative rules add, such as tie counts)."""
    min_abs: float
    """Smallest non-zero magnitude of those, in the float32 run (inf if none)."""
    grad_max_abs: float
    """Largest magnitude of its backward values, in the float32 run (scale 1)."""
    low_max_abs: dict[str, float]
    """By 16-bit dtype: the largest of its forward values held in that dtype in that
    run; inf if any of its forward values (in any dtype) was inf or NaN there where
    the float32 run's is finite (a -inf the float32 run has too is the model's)."""
    flushed: dict[str, float]
    """By 16-bit dtype: of the non-zero values its forward pass rounds to that dtype
    (autocast's casts), the share that became 0."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One 16-bit run: ``value_and_grad`` of ``loss * scale`` under autocast."""

    dtype: str
    scale: float
    loss: float
    forward: Origin | None
    backward: Origin | None
    leaves: tuple[LeafGradient, ...]
    max_gradient: float
    """The largest finite 16-bit value of the backward pass, divided by the scale
    (measured again at scale 1 when the backward pass overflowed at `scale`)."""
    recommended_scale: float | None
    """float16: ``2**k``, the largest power of two with
    ``2**k * max_gradient * HEADROOM <= 65504`` at which a run of the step is finite
    (checked where it is above `scale`, or `scale` overflowed); None for bfloat16,
    where every 16-bit backward value is zero (nothing to derive a scale from), and
    where the step overflows at every scale (`max_gradient` is then inf)."""
    leaves_at_recommended: tuple[LeafGradient, ...] = ()
    """The gradients measured again at `recommended_scale`: when it is below `scale`
    (a lower scale may lose small gradients), or above it and some gradients
    underflowed at `scale`."""


@dataclasses.dataclass(frozen=True)
class DiagnoseReport:
    """Where a training step overflows or underflows in 16 bits: `mpjax.diagnose`'s result.

    ``print(report)`` shows the tables; ``report.plot("ranges.png")`` draws each
    module's range against the formats' limits; ``report.as_dict()`` gives the
    figures as plain Python values.

    Attributes:
      runs: one `Run` per diagnosed dtype: the scale, the loss, the first
        non-finite equation of the forward and of the backward pass (`Origin`,
        or None), each parameter's gradient (`LeafGradient`), the largest
        gradient and the recommended scale.
      reference_loss: the loss of the float32 run (`loss_fn` without autocast).
      reference_forward: the first non-finite equation of the float32 forward
        pass, if any: then the problem is not precision.
      reference_backward: the same for the float32 backward pass.
      layers: per module (Flax Linen modules and ``jax.named_scope`` names, else
        source lines), in program order, the ranges of its values (`LayerRange`).
      recommendations: what to change, computed from these figures.

    Examples:
      >>> import jax.numpy as jnp, mpjax
      >>> def loss_fn(w, x):
      ...     return 100.0 * jnp.sum(x @ w)  # float16 cotangents of 100
      >>> report = mpjax.diagnose(loss_fn, jnp.ones((4, 2)), jnp.ones((3, 4)))
      >>> run = report.runs[0]
      >>> run.forward is None, run.backward.phase  # fine forward, inf backward at 2**16
      (True, 'backward')
      >>> run.max_gradient, run.recommended_scale  # 2**6 * 100 * 8 <= 65504
      (100.0, 64.0)
      >>> report.as_dict()["runs"][0]["recommended_scale"]
      64.0
      >>> print(report.recommendations[-1])
      Start from init_scale=2**6 (grad_scaler backs off on its own, skipping a step
      each time): the largest 16-bit backward value, 100 at scale 1, times 2**6 stays 8
      times below 65504.
    """

    runs: tuple[Run, ...]
    reference_loss: float
    reference_forward: Origin | None
    reference_backward: Origin | None
    layers: tuple[LayerRange, ...]
    recommendations: tuple[str, ...]

    def as_dict(self) -> dict:
        """The figures as nested dicts, lists, strings and floats."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        parts = [_header(self)]
        for run in self.runs:
            parts += [_origins(run), _gradients(run)]
        parts += [_layers(self), _recommendations(self)]
        return "\n\n".join(parts)

    def plot(self, path: str | os.PathLike | None = None):
        """Draws each module's range against the 16-bit formats' limits.

        Left: the forward values' magnitudes in float32 (smallest non-zero to
        largest), with float16's (and bfloat16's, if diagnosed) largest value and
        smallest normal; a cross marks a module whose 16-bit run was not finite.
        Right: the backward values' largest magnitudes times the first run's
        scale, against the largest finite value. Needs matplotlib (the
        ``examples`` extra).

        Args:
          path: where to save the figure (PNG, or any format matplotlib infers
            from the suffix); None to only return it.

        Returns:
          The ``matplotlib.figure.Figure``.
        """
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"DiagnoseReport.plot(path): path must be a file name (a str or a "
                f"pathlib.Path) or None, got {type(path).__name__} {path!r}."
            )
        from mpjax._diagnose_plot import draw  # matplotlib is imported there, only now

        return draw(self, path, RANGES)


# --------------------------------------------------------------------------
# Text


def _g(x: float) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-"
    if x == 0:
        return "0"
    return f"{x:.2e}"


def _table(header: list[str], rows: list[list[str]], left=(0,)) -> str:
    """Columns padded to their widest cell; the columns in `left` left-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        cells = [
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  " + "  ".join(cells).rstrip()

    return "\n".join([fmt(header), *map(fmt, rows)])


def _header(report: DiagnoseReport) -> str:
    runs = ", ".join(f"{r.dtype} at loss scale {r.scale:g}" for r in report.runs)
    losses = ", ".join(f"{r.dtype} {r.loss:.6g}" for r in report.runs)
    return (
        f"mpjax.diagnose: one training step in {runs}\n"
        f"loss: {losses}; float32 reference {report.reference_loss:.6g}"
    )


def _origin_text(origin: Origin | None, dtype: str) -> str:
    if origin is None:
        return "none (no inf or NaN produced from finite inputs)"
    limit = RANGES.get(dtype, (None,))[0]
    hold = f"; {dtype} holds up to {limit:g}" if limit and origin.produced != "nan" else ""
    lines = [
        f"`{origin.primitive}`" + (f" in {origin.module}" if origin.module else ""),
        f"at {origin.source}" + (f", {origin.inside}" if origin.inside else ""),
        f"{origin.produced} from finite inputs ({', '.join(origin.in_dtypes) or '-'} -> "
        f"{', '.join(origin.out_dtypes)}, largest |input| {_g(origin.in_max_abs)}){hold}",
    ]
    if origin.library_source:
        lines.insert(2, f"via {origin.library_source}")
    if origin.what:
        lines.append(origin.what)
    return "\n            ".join(lines)


def _origins(run: Run) -> str:
    return (
        f"First inf/NaN ({run.dtype}, scale {run.scale:g})\n"
        f"  forward:  {_origin_text(run.forward, run.dtype)}\n"
        f"  backward: {_origin_text(run.backward, run.dtype)}"
    )


_MAX_ROWS = 20


def _gradients(run: Run) -> str:
    header = ["parameter", "max |g|", "float32 max |g|", "zero only in " + run.dtype, "inf/NaN"]
    leaves = list(run.leaves)
    hidden = 0
    if len(leaves) > _MAX_ROWS:  # the parameters that lost something first
        leaves.sort(key=lambda leaf: (-leaf.overflow, -leaf.underflow))
        shown = [leaf for leaf in leaves[:_MAX_ROWS] if leaf.overflow or leaf.underflow]
        hidden, leaves = len(leaves) - len(shown), shown
    rows = [
        [
            leaf.path or "<root>",
            _g(leaf.max_abs),
            _g(leaf.reference_max_abs),
            f"{leaf.underflow:.1%}",
            f"{leaf.overflow:.1%}",
        ]
        for leaf in leaves
    ]
    title = f"Gradients ({run.dtype} at scale {run.scale:g}, divided by the scale"
    if run.forward is None:  # else the backward pass is inf/NaN from the start
        title += f"; largest 16-bit backward value {_g(run.max_gradient)} at scale 1"
    title += ")"
    text = title + ("\n" + _table(header, rows) if rows else "")
    if hidden:
        bad = sum(1 for leaf in run.leaves if leaf.overflow or leaf.underflow) - len(rows)
        what = f"{bad} of them with zeros or inf/NaN" if bad else "no zeros lost, no inf/NaN"
        text += f"\n  ... and {hidden} more parameters ({what}); report.as_dict() has them all"
    return text


def _notes(layer: LayerRange, dtypes) -> str:
    notes = []
    for dtype in dtypes:
        if math.isinf(layer.low_max_abs.get(dtype, 0.0)):
            notes.append(f"inf/NaN in {dtype}")
        if layer.flushed.get(dtype, 0.0) >= 0.001:
            notes.append(f"{layer.flushed[dtype]:.1%} rounded to 0 in {dtype}")
    return ", ".join(notes)


def _layers(report: DiagnoseReport) -> str:
    dtypes = [r.dtype for r in report.runs]
    header = ["module", "max |x|", "min |x|>0", *(f"max |x| in {d}" for d in dtypes)]
    header += ["max |grad|", "note"]
    rows = [
        [
            layer.module,
            _g(layer.max_abs),
            _g(layer.min_abs),
            *(_g(layer.low_max_abs.get(d)) for d in dtypes),
            _g(layer.grad_max_abs),
            _notes(layer, dtypes),
        ]
        for layer in report.layers
    ]
    limits = "; ".join(
        f"{d}: max {RANGES[d][0]:.4g}, smallest normal {RANGES[d][1]:.2g}" for d in dtypes
    )
    title = (
        "Values by module (max |x|, min |x|>0: forward pass in float32; max |x| in 16 bits:\n"
        "the values each run holds in 16 bits; max |grad|: backward pass in float32)\n  " + limits
    )
    return title + "\n" + _table(header, rows, left=(0, len(header) - 1))


def _recommendations(report: DiagnoseReport) -> str:
    lines = ["Recommendations"]
    for i, text in enumerate(report.recommendations, 1):
        lines.append(textwrap.fill(text, 88, initial_indent=f"  {i}. ", subsequent_indent="     "))
    return "\n".join(lines)
