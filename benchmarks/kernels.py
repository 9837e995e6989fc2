"""Where a GPU training step spends its time, kernel by kernel.

    python -m benchmarks.kernels --families gpt --variants handcast-bf16 autocast-bf16

compiles each variant's step, profiles a few steps with `jax.profiler`, and prints the
device time per step of every kernel (by name: XLA names a fusion's kernel after it),
the largest first, with each variant's totals by kind (matrix products and
convolutions, fusions, copies). `--json` keeps it all; `--hlo DIR` writes each
optimized program beside it, to read what a fusion holds. Times are device time, from
the profiler's GPU timeline; step times are wall-clock medians, in one process.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

_PRODUCT_KERNELS = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "cudnn", "conv-", "conv.")


def _kind(name: str) -> str:
    """A kernel's kind, from its name (and the HLO op that launched it)."""
    low = name.lower()
    if "command_buffer" in low:  # a CUDA graph: the kernel's own name says what it is
        low = low.split()[0]
    if any(k in low for k in _PRODUCT_KERNELS):
        return "products"
    if "copy" in low or "memcpy" in low or "memset" in low:
        return "copy"
    if "reduce" in low:
        return "reduce fusion"
    if "fusion" in low or "convert" in low:
        return "loop fusion"
    return "other"


def _device_events(path: Path) -> list[tuple[str, str, float]]:
    """(kernel name, HLO op, duration in microseconds) of every GPU kernel."""
    import jax.profiler

    data = jax.profiler.ProfileData.from_file(str(path))
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        # XLA's op and module lines repeat the kernels; keep the streams' lines.
        streams = [x for x in lines if x.name.lower().startswith("stream")]
        for line in streams or [x for x in lines if x.name == "XLA Ops"]:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op") or stats.get("long_name") or event.name
                out.append((event.name, str(op), event.duration_ns / 1e3))
    if not out:
        names = [(p.name, [x.name for x in p.lines]) for p in data.planes]
        print(f"no GPU kernels in the profile; its planes and lines: {names}")
    return out


def profile(family: str, variant_name: str, size: str, steps: int, hlo_dir: Path | None):
    import jax

    from benchmarks.gpu import compiled_step
    from benchmarks.models import SIZES

    # Several variants run in this process: each step donates copies.
    compiled, args, _ = compiled_step(SIZES[size][family], variant_name, copy=True)
    params, state, opt_state, batch = args
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{family}-{variant_name}.txt").write_text(compiled.as_text())
    for _ in range(3):
        params, state, opt_state, loss = compiled(params, state, opt_state, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        params, state, opt_state, loss = compiled(params, state, opt_state, batch)
        jax.block_until_ready((params, loss))
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                params, state, opt_state, loss = compiled(params, state, opt_state, batch)
            jax.block_until_ready((params, loss))
        events = [e for p in Path(tmp).rglob("*.xplane.pb") for e in _device_events(p)]
    # Kernels launched from a command buffer (a CUDA graph) all carry the buffer's
    # name as their HLO op: the kernel's own name is the fusion's.
    by_kernel = collections.defaultdict(lambda: [0.0, 0, set()])
    for name, op, us in events:
        row = by_kernel[name]
        row[0] += us / steps
        row[1] += 1
        row[2].add(op)
    kinds = collections.Counter()
    for name, (us, _, ops) in by_kernel.items():
        kinds[_kind(name + " " + " ".join(ops))] += us
    return {
        "family": family,
        "variant": variant_name,
        "step_ms": statistics.median(times) * 1e3,
        "device_ms": sum(r[0] for r in by_kernel.values()) / 1e3,
        "kinds_ms": {k: v / 1e3 for k, v in kinds.most_common()},
        "kernels": sorted(
            ([name, us, n // steps, sorted(ops)[:3]] for name, (us, n, ops) in by_kernel.items()),
            key=lambda r: -r[1],
        ),
    }


def main(argv=None):
    from benchmarks.models import SIZES
    from benchmarks.variants import VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["gpt"], choices=sorted(SIZES["gpu"]))
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["handcast-bf16", "autocast-bf16"],
        choices=sorted(VARIANTS),
    )
    parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--hlo", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    for family in args.families:
        for variant in args.variants:
            r = profile(family, variant, args.size, args.steps, args.hlo)
            results.append(r)
            print(
                f"\n{family} {variant}: step {r['step_ms']:.2f} ms, device {r['device_ms']:.2f} ms",
                flush=True,
            )
            for kind, ms in r["kinds_ms"].items():
                print(f"  {kind:22s} {ms:8.3f} ms")
            for name, us, n, ops in r["kernels"][: args.top]:
                print(f"  {us:9.1f} us x{n:<3d} {name[:70]:70s} {ops[0][:30]}")
            if args.json:
                args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
