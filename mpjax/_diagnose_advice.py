"""`mpjax.diagnose`'s recommendations, computed from the report's figures."""

from __future__ import annotations

import math
import re

from mpjax._diagnose_report import RANGES

HEADROOM = 8.0
"""The recommended scale keeps the largest 16-bit backward value this many times
below float16's largest value: gradients grow and vary between batches."""
UNDERFLOW_SHARE = 0.01
"""A parameter is named when more than this share of its gradient is lost to zero."""
NEGLIGIBLE = 2.0**-20
"""bfloat16: a gradient this many times below the largest is taken for one that is
zero in exact arithmetic (its float32 value is rounding noise)."""
MIN_LOG2, MAX_LOG2 = -14, 64  # grad_scaler's default min_scale; far beyond any use
_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)")


def underflowing(leaves, scale: float) -> list:
    """The leaves that lose more than `UNDERFLOW_SHARE` of their gradient to zero in
    float16 at `scale`, but for one whose float32 gradient float16 holds at that
    scale and is `NEGLIGIBLE` times below the largest: zero in exact arithmetic
    most likely (the bias of a layer a normalization follows, whose float32
    gradient is rounding noise), not a loss of range."""
    largest = max((leaf.reference_max_abs for leaf in leaves), default=0.0)

    def noise(leaf) -> bool:
        held = leaf.reference_max_abs * scale >= RANGES["float16"][1]
        return held and leaf.reference_max_abs <= NEGLIGIBLE * largest

    return [leaf for leaf in leaves if leaf.underflow > UNDERFLOW_SHARE and not noise(leaf)]


def recommended_scale(largest: float) -> float | None:
    """``2**k``: the largest power of two with ``2**k * largest * HEADROOM <= 65504``.

    None where `largest` is zero: no 16-bit backward value to keep in range, so
    nothing to derive a scale from (not "any scale": every gradient is lost).
    """
    if largest == 0:
        return None
    if not largest > 0 or not math.isfinite(largest):
        return 2.0**MIN_LOG2
    # frexp: floor(log2(x)) exactly, x = m * 2**e with 0.5 <= m < 1.
    k = math.frexp(RANGES["float16"][0] / (HEADROOM * largest))[1] - 1
    return 2.0 ** min(max(k, MIN_LOG2), MAX_LOG2)


def _pow2(x: float) -> str:
    k = math.frexp(x)[1] - 1
    return f"2**{k}" if x == 2.0**k else f"{x:g}"


def advise(report) -> tuple[str, ...]:
    """The recommendations of a `DiagnoseReport` (whose own field is ignored)."""
    reference_finite = math.isfinite(report.reference_loss) and all(
        math.isfinite(leaf.reference_max_abs) for run in report.runs for leaf in run.leaves
    )
    if not reference_finite:  # an inf or NaN on the way that cancels out is no problem
        origin = report.reference_forward or report.reference_backward
        where = (
            f"its {origin.phase} pass produces {origin.produced} first at {origin.describe()}"
            if origin is not None
            else "no operation makes inf or NaN from finite values, so an input (the "
            "batch, a parameter) holds one"
        )
        return (
            f"The float32 run is not finite either: {where}. Precision is not the "
            "cause: look at the data (a NaN or inf in the batch), the model, or an "
            "operation that is infinite in exact arithmetic (log(0), the gradient "
            "of sqrt at 0).",
        )
    layers = {layer.module: layer for layer in report.layers}
    out = []
    for run in report.runs:
        out += _forward(run, layers) if run.forward else _backward_and_scale(run, layers)
    return tuple(out)


def _forward(run, layers) -> list[str]:
    o = run.forward
    largest = RANGES[run.dtype][0]
    layer = layers.get(o.module) if o.module else None
    text = f"{run.dtype} forward pass: {o.produced} first at {o.describe()}"
    if layer is not None:
        beyond = f", beyond {run.dtype}'s {largest:.4g}" if layer.max_abs > largest else ""
        text += f"; in float32 its values reach {layer.max_abs:.3g}{beyond}"
    where = f"`{o.module}`" if o.module else f"the code at {o.source}"
    if o.in_dtypes and set(o.in_dtypes + o.out_dtypes) <= {"float32", "float64"}:
        # It ran in float32 already: what differs from the float32 run is its input.
        return [
            text + f". It ran in float32: its inputs differ from the float32 run's, "
            f"computed in {run.dtype} before it (a matrix product's result, rounded), and "
            "it needs them exact (a Gram matrix X @ X.T that rounding leaves indefinite "
            "has no Cholesky factor, for one). Keep the code computing its inputs, and "
            f"{where}, in float32 with a nested `mpjax.autocast(fn, enabled=False)`."
        ]
    text += (
        ". Loss scaling cannot fix the forward pass. Keep "
        f"{where} in float32 with a nested `mpjax.autocast(fn, enabled=False)`"
    )
    if run.dtype == "float16" and (layer is None or layer.max_abs < RANGES["bfloat16"][0]):
        text += f", or use bfloat16 (largest value {RANGES['bfloat16'][0]:.2g})"
    return [text + ", or rescale the values before this operation."]


def _backward_and_scale(run, layers) -> list[str]:
    out = []
    if run.backward is not None:
        o = run.backward
        text = (
            f"{run.dtype} backward pass at scale {run.scale:g}: {o.produced} first at "
            f"{o.describe()}."
        )
        if run.dtype != "float16":
            text += (
                f" {run.dtype} overflows only beyond {RANGES[run.dtype][0]:.2g}: look at "
                "this operation."
            )
        out.append(text)
    if run.recommended_scale is None:
        if run.dtype == "float16" and math.isinf(run.max_gradient):
            return out + _overflow_at_every_scale(run)
        if run.dtype == "float16":
            return out + _no_gradient(run)
        return out + _underflow_bfloat16(run, layers)
    return out + _scale(run, layers)


def _overflow_at_every_scale(run) -> list[str]:
    where = (run.backward.module or run.backward.source) if run.backward else "the loss"
    return [
        f"float16: the backward pass overflows at scale {run.scale:g} and still at the "
        "smallest scale float32's gradients allow, so no loss scale avoids it: keep "
        f"`{where}` in float32 with a nested `mpjax.autocast(fn, enabled=False)`, or use "
        "bfloat16."
    ]


def _no_gradient(run) -> list[str]:
    if not any(leaf.reference_max_abs > 0 for leaf in run.leaves):
        return [
            "The float32 gradients are zero too: this step has no gradient to scale "
            "(a loss that does not depend on the parameters, or a batch that makes "
            "it constant)."
        ]
    return [
        f"float16 at scale {run.scale:g}: every 16-bit value of the backward pass is "
        "zero, here and at the largest scale float32's gradients allow, so no loss "
        "scale brings the gradients back: they are lost before the backward pass, "
        "in the forward pass (a normalization over a constant batch, for one: zero "
        "in 16 bits, rounding noise in float32). Compare each module's values in 16 "
        "bits with float32's above, and keep the one that loses them in float32 with "
        "a nested `mpjax.autocast(fn, enabled=False)`, or use bfloat16."
    ]


def _worst(leaves) -> str:
    worst = max(leaves, key=lambda leaf: leaf.underflow)
    return f"worst `{worst.path}`, {worst.underflow:.1%}"


def _scale(run, layers) -> list[str]:
    s, rec, g = run.scale, run.recommended_scale, run.max_gradient
    fits = (
        f"the largest 16-bit backward value, {g:.3g} at scale 1, times {_pow2(rec)} "
        f"stays {HEADROOM:g} times below 65504"
    )
    if run.backward is not None:
        if rec < s:
            return [
                f"Start from init_scale={_pow2(rec)} (grad_scaler backs off on its own, "
                f"skipping a step each time): {fits}.",
                *_still_under(run, layers),
            ]
        where = f"`{run.backward.module}`" if run.backward.module else run.backward.source
        return [
            f"A lower scale does not help: {fits}, so the inf comes from the operation "
            f"itself, or the step overflows at scale 1 too. Keep {where} in float32 with "
            "a nested `mpjax.autocast(fn, enabled=False)`, or use bfloat16."
        ]
    under = underflowing(run.leaves, run.scale)
    if rec > s and under:
        return _raise_scale(run, layers, under, fits)
    if rec < s:
        out = [
            f"At scale {s:g} the largest 16-bit backward value reaches {g * s:.3g}, less "
            f"than {HEADROOM:g} times below 65504: init_scale={_pow2(rec)} leaves room as "
            "gradients grow.",
            *_still_under(run, layers),
        ]
    elif under:
        out = [f"Scale {s:g} is the largest safe power of two: {fits}."]
    else:
        return [
            f"float16 at scale {s:g}: no overflow, and no parameter loses more than "
            f"{UNDERFLOW_SHARE:.0%} of its gradient to zero. Scales up to {_pow2(rec)} "
            f"would fit: {fits}."
        ]
    if under:
        out.append(
            f"At scale {s:g}, at or above the largest safe scale, {_lost(under)}: use "
            f"bfloat16, or keep {_users(under, layers)} in float32 with a nested "
            "`mpjax.autocast(fn, enabled=False)`."
        )
    return out


def _lost(under) -> str:
    return (
        f"{len(under)} parameter(s) lose more than {UNDERFLOW_SHARE:.0%} of their gradient "
        f"elements to zero ({_worst(under)})"
    )


def _raise_scale(run, layers, under, fits) -> list[str]:
    rec = _pow2(run.recommended_scale)
    out = [f"Raise init_scale to {rec}: at scale {run.scale:g}, {_lost(under)}; {fits}."]
    still = _still_under(run, layers, "even ")
    if still:
        out += still
    elif run.leaves_at_recommended:
        out.append(
            f"At {rec} no parameter loses more than {UNDERFLOW_SHARE:.0%} of its gradient to zero."
        )
    return out


def _still_under(run, layers, even="") -> list[str]:
    """The parameters that lose gradients at the recommended scale, if measured there."""
    still = underflowing(run.leaves_at_recommended, run.recommended_scale)
    if not still:
        return []
    return [
        f"{len(still)} parameter(s) underflow {even}at {_pow2(run.recommended_scale)}, the "
        f"largest safe scale ({_worst(still)}): use bfloat16, or keep "
        f"{_users(still, layers)} in float32 with a nested `mpjax.autocast(fn, enabled=False)`."
    ]


def _underflow_bfloat16(run, layers) -> list[str]:
    under = [leaf for leaf in run.leaves if leaf.underflow > UNDERFLOW_SHARE]
    # bfloat16 has float32's range: its zeros are values rounded away against larger
    # ones. A gradient far below every other one is zero in exact arithmetic, most
    # likely (an attention key bias, which softmax cancels): nothing to fix there.
    largest = max((leaf.reference_max_abs for leaf in run.leaves), default=0.0)
    real = [leaf for leaf in under if leaf.reference_max_abs > NEGLIGIBLE * largest]
    if not real:
        if run.backward is not None:
            return []
        noise = (
            f" ({len(under)} parameter(s) whose float32 gradient is {1 / NEGLIGIBLE:.0e} "
            "times below the largest, zero in exact arithmetic most likely, come back zero)"
            if under
            else ""
        )
        return [
            f"{run.dtype}: no overflow, and no parameter loses more than "
            f"{UNDERFLOW_SHARE:.0%} of its gradient to zero{noise}."
        ]
    return [
        f"In {run.dtype}, {len(real)} parameter(s) lose more than {UNDERFLOW_SHARE:.0%} "
        f"of their gradient elements to zero ({_worst(real)}); with float32's range, "
        "that is precision (8 bits), not range: keep "
        f"{_users(real, layers)} in float32 with a nested `mpjax.autocast(fn, enabled=False)`."
    ]


def _users(leaves, layers) -> str:
    """The modules that use these parameters, where the names say so, else the parameters."""
    names = []
    for leaf in leaves:
        keys = [next(g for g in m.groups() if g is not None) for m in _KEY.finditer(leaf.path)]
        keys = [k for k in keys[:-1] if k != "params"]
        suffix = "/".join(keys)
        found = [m for m in layers if suffix and (m == suffix or m.endswith("/" + suffix))]
        name = f"`{found[0]}`" if found else f"the computation using `{leaf.path}`"
        if name not in names:
            names.append(name)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
