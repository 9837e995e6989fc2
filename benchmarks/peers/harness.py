"""What the peer benchmark measures, for one model and one variant.

For each peer (see `benchmarks.peers.models`) and each variant (float32, or
``mpjax.autocast(loss_fn, dtype=..., policy=...)``):

* **residual bytes**: the leaves of ``jax.eval_shape(lambda *a: jax.vjp(f, *a)[1],
  params, batch)`` added up: everything the backward pass keeps, arguments
  included (``all_bytes`` of `benchmarks.memory.memory_report`), and **activation
  bytes**, the same without the residuals that are arguments (the float32 params
  and the batch, held whatever the precision). Traced only, at the peer's
  ``mem_batch``.
* **gradient error** against the float32 gradient (computed at ``grad_batch``,
  jitted): per parameter leaf ``max|g - g32| / max|g32|`` (the denominator floored
  at 1e-3 of the largest float32 gradient entry of the tree, see `LEAF_FLOOR`), the
  worst leaf reported; and over the whole tree ``||g - g32||_2 / ||g32||_2``.
* with ``batches`` > 1, the **gradient error over several batches**: the same two
  errors on ``batches`` batches (the first is the one above; the others draw their
  data with other seeds, the parameters unchanged), kept per batch, their median
  and worst shown. One batch is a noisy measure where a ReLU's or a max's choice
  flips against float32; the median says which policy is the more accurate.
* **16-bit reductions**: equations of ``jax.make_jaxpr(jax.grad(f))`` (sub-jaxprs
  included) that sum in float16/bfloat16: `REDUCTIONS` with a 16-bit operand and a
  16-bit result. ``dot_general`` and ``add_any`` are not counted.
* **f16 reductions off**: whether the jitted gradient still traces (lowers) with
  ``jax_allow_f16_reductions=False``, jax's switch that makes ``reduce_sum`` on a
  16-bit operand an error.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import mpjax

VARIANTS: dict[str, dict | None] = {
    "float32": None,
    "autocast-f16": {"dtype": jnp.float16},
    "autocast-bf16": {"dtype": jnp.bfloat16},
    "lean-f16": {"dtype": jnp.float16, "policy": "lean"},
    "lean-bf16": {"dtype": jnp.bfloat16, "policy": "lean"},
}
QUICK_VARIANTS = ("float32", "autocast-f16", "autocast-bf16")
FULL_VARIANTS = tuple(VARIANTS)

REDUCTIONS = frozenset(
    {
        "reduce_sum",
        "cumsum",
        "reduce_window_sum",
        "scatter-add",
        "scatter_add",
        "psum",
        "psum2",
        "psum_invariant",
    }
)
LOW = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def variant_fn(loss_fn, variant: str):
    kwargs = VARIANTS[variant]
    return loss_fn if kwargs is None else mpjax.autocast(loss_fn, **kwargs)


# --------------------------------------------------------------------------
# memory


def _leaf_bytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def residual_bytes(f, *args) -> dict:
    """``all_bytes`` (every vjp residual) and ``activation_bytes`` (the residuals
    that are not arguments), from `benchmarks.memory.memory_report`.

    If that module is not importable (it is being reworked), the brief's measure is
    computed here directly and ``activation_bytes`` is left out.
    """
    try:
        from benchmarks.memory import memory_report
    except ImportError:  # pragma: no cover - depends on the state of benchmarks/
        memory_report = None
    if memory_report is not None:
        rep = memory_report(f, *args)
        return {
            "residual_bytes": int(rep["all_bytes"]),
            "activation_bytes": int(rep["activation_bytes"]),
            "residuals_by_dtype": rep.get("by_dtype", {}),
        }
    shapes = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
    return {
        "residual_bytes": sum(_leaf_bytes(x) for x in jax.tree.leaves(shapes)),
        "activation_bytes": None,
        "residuals_by_dtype": {},
    }


# --------------------------------------------------------------------------
# gradient error


LEAF_FLOOR = 1e-3
"""A leaf's error is divided by ``max(max|g32_leaf|, LEAF_FLOOR * max|g32_tree|)``.

Without the floor, a leaf whose float32 gradient is zero up to rounding (the key
bias of an attention layer: softmax is invariant to it) makes the ratio of two
rounding noises, arbitrarily large. ``grad_err_leaf_raw`` keeps the unfloored figure.
"""


def gradient_error(grads, ref) -> dict:
    """Worst leaf (max abs error / max abs reference, per leaf, see `LEAF_FLOOR`)
    and whole tree (relative L2 over all leaves) of ``grads`` against ``ref``."""
    flat_g = jax.tree_util.tree_flatten_with_path(grads)[0]
    flat_r = jax.tree_util.tree_flatten_with_path(ref)[0]
    assert len(flat_g) == len(flat_r), (len(flat_g), len(flat_r))
    tree_max = max(
        (float(np.max(np.abs(np.asarray(r, np.float64)))) for _, r in flat_r if np.size(r)),
        default=0.0,
    )
    floor = LEAF_FLOOR * tree_max
    worst, worst_path, worst_raw, worst_raw_path = 0.0, "", 0.0, ""
    num = den = 0.0
    finite = True
    for (path, g), (_, r) in zip(flat_g, flat_r):
        g = np.asarray(g, np.float64)
        r = np.asarray(r, np.float64)
        finite &= bool(np.all(np.isfinite(g)))
        diff = np.abs(g - r)
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        err = float(np.max(diff)) if diff.size else 0.0
        for denom, kind in ((max(scale, floor), "floored"), (scale, "raw")):
            if denom > 0:
                leaf = err / denom
            else:
                leaf = 0.0 if err == 0 else math.inf
            if kind == "floored" and (worst_path == "" or leaf > worst):
                worst, worst_path = leaf, jax.tree_util.keystr(path)
            if kind == "raw" and (worst_raw_path == "" or leaf > worst_raw):
                worst_raw, worst_raw_path = leaf, jax.tree_util.keystr(path)
        num += float(np.sum(diff**2))
        den += float(np.sum(r**2))
    tree = math.sqrt(num) / math.sqrt(den) if den > 0 else (0.0 if num == 0 else math.inf)
    if not finite:
        worst = tree = math.nan
    return {
        "grad_err_leaf": worst,
        "worst_leaf": worst_path,
        "grad_err_tree": tree,
        "grads_finite": finite,
        "grad_err_leaf_raw": worst_raw,
        "worst_leaf_raw": worst_raw_path,
    }


# --------------------------------------------------------------------------
# 16-bit reductions


def _sub_jaxprs(value):
    """Jaxprs inside an equation parameter (a jaxpr, a closed jaxpr, or a tuple of them)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _is_low(var) -> bool:
    aval = getattr(var, "aval", None)
    dtype = getattr(aval, "dtype", None)
    try:
        return dtype is not None and np.dtype(dtype) in LOW
    except TypeError:
        return False


def _is_16bit_reduction(eqn) -> bool:
    name = eqn.primitive.name
    if name not in REDUCTIONS:
        return False
    if name == "reduce_sum" and all(eqn.invars[0].aval.shape[a] == 1 for a in eqn.params["axes"]):
        return False  # over axes of size 1: adds nothing (JAX's guard lets it pass too)
    if name in ("scatter-add", "scatter_add"):
        operands = [eqn.invars[0], eqn.invars[-1]]  # operand, updates
    else:
        operands = list(eqn.invars)
    return any(_is_low(v) for v in operands) and all(_is_low(v) for v in eqn.outvars)


def _where(eqn) -> str:
    """``primitive dtype[shape] @ file:line (function)`` of an equation."""
    try:
        from mpjax import _compat

        frame = _compat.user_frame(eqn)
    except Exception:  # noqa: BLE001 - only a label
        frame = "?"
    path, _, rest = frame.partition(":")
    frame = f"{path.rsplit('/', 1)[-1]}:{rest}" if rest else frame
    return f"{eqn.primitive.name} {eqn.invars[0].aval.str_short()} @ {frame}"


def find_16bit_reductions(jaxpr) -> list[str]:
    """`REDUCTIONS` equations with 16-bit operands and results, walking every
    sub-jaxpr (each occurrence counted), as `_where` labels."""
    if hasattr(jaxpr, "jaxpr") and not hasattr(jaxpr, "eqns"):
        jaxpr = jaxpr.jaxpr
    found: list[str] = []
    for eqn in jaxpr.eqns:
        if _is_16bit_reduction(eqn):
            found.append(_where(eqn))
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found.extend(find_16bit_reductions(sub))
    return found


def count_16bit_reductions(jaxpr) -> dict[str, int]:
    """The number of `find_16bit_reductions`, by primitive."""
    counts: dict[str, int] = {}
    for label in find_16bit_reductions(jaxpr):
        name = label.split(" ", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


# --------------------------------------------------------------------------
# jax_allow_f16_reductions


def f16_reductions_off(make_f, params, batch) -> tuple[bool | None, str]:
    """Does ``jit(grad(f))`` lower with ``jax_allow_f16_reductions=False``?

    ``None`` where the installed jax has no such option. ``make_f`` builds a fresh
    function so that no cached trace is reused.
    """
    name = "jax_allow_f16_reductions"
    if not hasattr(jax.config, name):
        return None, f"{name} not in this jax"
    previous = getattr(jax.config, name)
    try:
        jax.config.update(name, False)
        jax.jit(jax.grad(make_f())).lower(params, batch)
        return True, ""
    except Exception as e:  # noqa: BLE001 - reported, not raised
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return False, msg[:200]
    finally:
        jax.config.update(name, previous)


# --------------------------------------------------------------------------
# one peer


@dataclasses.dataclass
class Row:
    model: str
    variant: str
    status: str = "ok"
    residual_bytes: int | None = None
    activation_bytes: int | None = None
    residual_ratio: float | None = None
    activation_ratio: float | None = None
    grad_err_leaf: float | None = None
    worst_leaf: str = ""
    grad_err_tree: float | None = None
    grads_finite: bool | None = None
    grad_err_leaf_raw: float | None = None
    worst_leaf_raw: str = ""
    loss: float | None = None
    reductions_16bit: int | None = None
    reductions_by_primitive: dict = dataclasses.field(default_factory=dict)
    reductions_where: list = dataclasses.field(default_factory=list)
    f16_reductions_off_ok: bool | None = None
    f16_reductions_off_error: str = ""
    seconds: float | None = None
    mem_batch: int | None = None
    grad_batch: int | None = None
    grad_err_leaf_batches: list = dataclasses.field(default_factory=list)
    grad_err_tree_batches: list = dataclasses.field(default_factory=list)


def _short_error(e: BaseException) -> str:
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:240]


def run_peer(peer, variants=QUICK_VARIANTS, *, log=None, batches: int = 1) -> dict:
    """All measurements of one peer: ``dict(model, status, seconds, rows)``.

    With ``batches`` > 1, each row also holds the gradient errors on that many
    batches (``grad_err_leaf_batches``, ``grad_err_tree_batches``).

    A peer whose optional packages are missing is ``skipped: needs X``; one whose
    build fails is ``failed: ...``; a variant that fails gets a ``failed`` row and
    the other variants still run.
    """
    start = time.perf_counter()
    missing = peer.missing()
    if missing:
        return {
            "model": peer.name,
            "source": peer.source,
            "status": f"skipped: needs {', '.join(missing)}",
            "seconds": 0.0,
            "rows": [],
        }
    try:
        loss_fn, params, batch = peer.build(peer.grad_batch)
        _, mem_params, mem_batch = peer.build(peer.mem_batch)
        ref_fn = jax.jit(jax.grad(loss_fn))
        ref_grads = ref_fn(params, batch)
        ref_loss = float(jax.jit(loss_fn)(params, batch))
        more = [peer.build(peer.grad_batch, seed)[2] for seed in range(1, batches)]
        refs = [ref_grads] + [ref_fn(params, b) for b in more]
    except Exception as e:  # noqa: BLE001
        if log:
            log(traceback.format_exc())
        return {
            "model": peer.name,
            "source": peer.source,
            "status": f"failed: {_short_error(e)}",
            "seconds": time.perf_counter() - start,
            "rows": [],
        }
    rows = []
    base = None
    for variant in variants:
        t0 = time.perf_counter()
        row = Row(peer.name, variant, mem_batch=peer.mem_batch, grad_batch=peer.grad_batch)
        try:
            f = variant_fn(loss_fn, variant)
            mem = residual_bytes(f, mem_params, mem_batch)
            row.residual_bytes = mem["residual_bytes"]
            row.activation_bytes = mem["activation_bytes"]
            if variant == "float32":
                base = row
            if base is not None and base.residual_bytes:
                row.residual_ratio = row.residual_bytes / base.residual_bytes
            if base is not None and base.activation_bytes and row.activation_bytes is not None:
                row.activation_ratio = row.activation_bytes / base.activation_bytes
            if variant == "float32":
                grads, row.loss = ref_grads, ref_loss
            else:
                grads = jax.jit(jax.grad(f))(params, batch)
                row.loss = float(jax.jit(f)(params, batch))
            err = gradient_error(grads, ref_grads)
            row.grad_err_leaf = err["grad_err_leaf"]
            row.worst_leaf = err["worst_leaf"]
            row.grad_err_tree = err["grad_err_tree"]
            row.grads_finite = err["grads_finite"]
            row.grad_err_leaf_raw = err["grad_err_leaf_raw"]
            row.worst_leaf_raw = err["worst_leaf_raw"]
            if more and variant != "float32":
                grad_fn = jax.jit(jax.grad(f))
                errs = [err] + [
                    gradient_error(grad_fn(params, b), r) for b, r in zip(more, refs[1:])
                ]
                row.grad_err_leaf_batches = [e["grad_err_leaf"] for e in errs]
                row.grad_err_tree_batches = [e["grad_err_tree"] for e in errs]
            found = find_16bit_reductions(jax.make_jaxpr(jax.grad(f))(params, batch))
            row.reductions_16bit = len(found)
            row.reductions_by_primitive = {}
            for label in found:
                name = label.split(" ", 1)[0]
                row.reductions_by_primitive[name] = row.reductions_by_primitive.get(name, 0) + 1
            row.reductions_where = sorted(set(found))
            ok, msg = f16_reductions_off(lambda v=variant: variant_fn(loss_fn, v), params, batch)
            row.f16_reductions_off_ok, row.f16_reductions_off_error = ok, msg
        except Exception as e:  # noqa: BLE001
            if log:
                log(traceback.format_exc())
            row.status = f"failed: {_short_error(e)}"
        row.seconds = time.perf_counter() - t0
        rows.append(row)
        if log:
            log(f"  {peer.name:24s} {variant:14s} {row.status} ({row.seconds:.1f}s)")
    return {
        "model": peer.name,
        "source": peer.source,
        "status": "ok",
        "seconds": time.perf_counter() - start,
        "rows": [dataclasses.asdict(r) for r in rows],
    }


# --------------------------------------------------------------------------
# the table


def _mib(n):
    return "" if n is None else f"{n / 2**20:.2f}"


def _ratio(x):
    return "" if x is None else f"{x:.2f}"


def _err(x):
    if x is None:
        return ""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.1e}"


def _yesno(x):
    return "" if x is None else ("yes" if x else "no")


def render(results: list[dict]) -> str:
    """The markdown table of `run_peer` results, then the skipped and failed peers."""
    head = (
        "| model | variant | residuals MiB (all vjp leaves) | ×f32 | activations MiB (non-argument) | ×f32 "
        "| grad err, worst leaf (max\\|Δ\\|/max\\|g32\\|, floor 1e-3·tree max) | grad err, tree (rel. L2) "
        "| 16-bit sums in grad jaxpr | jit(grad) lowers with f16 reductions off | s |"
    )
    lines = [head, "|" + "---|" * 11]
    notes = []
    for res in results:
        if not res["rows"]:
            notes.append(f"* {res['model']}: {res['status']}")
            continue
        first = True
        for r in res["rows"]:
            name = res["model"] if first else ""
            first = False
            if r["status"] != "ok":
                lines.append(
                    f"| {name} | {r['variant']} | {r['status']} |"
                    + " |" * 8
                    + f" {r['seconds']:.1f} |"
                )
                notes.append(f"* {res['model']} / {r['variant']}: {r['status']}")
                continue
            lines.append(
                f"| {name} | {r['variant']} | {_mib(r['residual_bytes'])} | {_ratio(r['residual_ratio'])} "
                f"| {_mib(r['activation_bytes'])} | {_ratio(r['activation_ratio'])} "
                f"| {_err(r['grad_err_leaf'])} | {_err(r['grad_err_tree'])} "
                f"| {'' if r['reductions_16bit'] is None else r['reductions_16bit']} "
                f"| {_yesno(r['f16_reductions_off_ok'])} | {r['seconds']:.1f} |"
            )
    out = "\n".join(lines)
    times = [f"{res['model']} {res['seconds']:.0f}s" for res in results if res["rows"]]
    if times:
        out += "\n\nWall time per model (all variants, build included): " + ", ".join(times) + "."
    batches = [
        f"{res['model']} {res['rows'][0]['mem_batch']}/{res['rows'][0]['grad_batch']}"
        for res in results
        if res["rows"]
    ]
    if batches:
        out += "\nBatch for memory / for gradients: " + ", ".join(batches) + "."
    if notes:
        out += "\n\nSkipped or failed:\n" + "\n".join(notes)
    return out


def render_batches(results: list[dict]) -> str:
    """The gradient errors over several batches (``--batches``): median and worst."""
    lines = [
        "| model | variant | batches | worst leaf, median | worst leaf, worst batch "
        "| tree, median | tree, worst batch |",
        "|" + "---|" * 2 + "---:|" * 5,
    ]
    for res in results:
        for r in res["rows"]:
            leaf, tree = r.get("grad_err_leaf_batches"), r.get("grad_err_tree_batches")
            if r["status"] != "ok" or not leaf:
                continue
            lines.append(
                f"| {res['model']} | {r['variant']} | {len(leaf)} "
                f"| {_err(_median(leaf))} | {_err(max(leaf))} "
                f"| {_err(_median(tree))} | {_err(max(tree))} |"
            )
    return "\n".join(lines)


def _median(xs: list) -> float:
    return float(np.median(np.asarray(xs, np.float64)))
