"""`DiagnoseReport.plot`: each module's range against the 16-bit formats' limits.

matplotlib is an optional dependency (the ``examples`` extra): this module is
imported only when a plot is asked for, and uses no pyplot state, so it neither
needs a display nor changes the caller's backend.
"""

from __future__ import annotations

import math

_COLORS = {"float16": "tab:red", "bfloat16": "tab:purple"}


def draw(report, path, ranges):
    """The figure of `report`, saved to `path` unless None; `ranges`: each format's
    (largest, smallest normal, smallest subnormal)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "DiagnoseReport.plot needs matplotlib: pip install matplotlib (or the "
            "`examples` extra of mpjax). The figures are in str(report) and report.as_dict()."
        ) from e
    layers = list(report.layers)
    height = 2.0 + 0.28 * max(len(layers), 1)
    fig = Figure(figsize=(12, height), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True)
    ys = list(range(len(layers)))[::-1]
    dtypes = [run.dtype for run in report.runs]
    _forward(left, layers, ys, dtypes, ranges)
    _backward(right, layers, ys, report.runs[0] if report.runs else None, ranges)
    left.set_yticks(ys, [layer.module for layer in layers], fontsize=8)
    fig.suptitle("mpjax.diagnose: value ranges by module (float32 run)")
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _positive(values, floor=1e-45):
    return [v if v > 0 and math.isfinite(v) else floor for v in values]


def _forward(ax, layers, ys, dtypes, ranges):
    lows = _positive([layer.min_abs for layer in layers])
    highs = _positive([layer.max_abs for layer in layers])
    ax.hlines(
        ys, lows, highs, color="tab:blue", linewidth=4, label="smallest non-zero to largest |x|"
    )
    for dtype in dtypes:
        largest, normal, _ = ranges[dtype]
        ax.axvline(largest, color=_COLORS[dtype], linestyle="-", label=f"{dtype} max")
        ax.axvline(normal, color=_COLORS[dtype], linestyle="--", label=f"{dtype} smallest normal")
        bad = [
            (y, h)
            for y, h, layer in zip(ys, highs, layers)
            if math.isinf(layer.low_max_abs.get(dtype, 0.0))
        ]
        if bad:
            ax.plot(
                [h for _, h in bad],
                [y for y, _ in bad],
                "x",
                color=_COLORS[dtype],
                markersize=9,
                label=f"inf/NaN in the {dtype} run",
            )
    ax.set_xscale("log")
    ax.set_title("|x|, forward pass", fontsize=9)
    # Below the tick labels, a fixed distance whatever the figure's height.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0), borderaxespad=3, ncol=2)


def _backward(ax, layers, ys, run, ranges):
    scale = run.scale if run else 1.0
    grads = [layer.grad_max_abs * scale for layer in layers]
    shown = [y for y, g in zip(ys, grads) if g > 0]
    ax.plot(
        _positive([g for g in grads if g > 0]),
        shown,
        "o",
        color="tab:green",
        label=f"largest |grad| x scale {scale:g}",
    )
    if run is not None and run.dtype in ranges:
        largest, _, tiniest = ranges[run.dtype]
        ax.axvline(largest, color=_COLORS[run.dtype], label=f"{run.dtype} max")
        ax.axvline(
            tiniest,
            color=_COLORS[run.dtype],
            linestyle=":",
            label=f"{run.dtype} smallest subnormal",
        )
        shown_values = [g for g in grads if g > 0 and math.isfinite(g)]
        ax.set_xlim(
            min([tiniest, *shown_values]) / 10, max([largest, *shown_values]) * 10
        )  # the format's whole range: what flushes to 0 and what overflows
    ax.set_xscale("log")
    ax.set_title("|gradient| x loss scale, backward pass", fontsize=9)
    # Below the tick labels, a fixed distance whatever the figure's height.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0), borderaxespad=3, ncol=2)
