"""The benchmark entry point: ``python -m benchmarks [--smoke | --quick] [--gpu] [--json PATH]``.

Without ``--gpu`` it runs the CPU measurements (activation memory, precision
coverage, trace/compile overhead, grad-scaler overhead, eager overhead, numerical
fidelity) and prints markdown tables; with ``--gpu`` it runs the GPU step-time
benchmark instead, one process per variant. Both write everything to JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import flax
import jax
import jax.numpy as jnp

from benchmarks import compile_options, gpu, memory, recompute, report, stablehlo, timing
from benchmarks.models import SIZES
from benchmarks.variants import VARIANTS, step_specs, train_step, value_fn

FAMILIES = ("gpt", "vit", "resnet", "resnet_bn")

# Per mode: the size of each measurement, and how many repeats the timings take.
# Memory and coverage only trace, so they use the largest size of the mode; run
# times need a size the CPU can run many times.
MODES = {
    "smoke": dict(
        static="smoke",
        compile="smoke",
        run="smoke",
        timed_families=("gpt",),
        compile_repeats=1,
        run_repeats=1,
        run_steps=1,
        eager_repeats=1,
        warmup=False,
        variants=("float32", "autocast-bf16"),
        # memory and coverage: float32 and bfloat16 autocast and hand-cast (the
        # float16 and lean variants trace the same code at another dtype or policy)
        static_variants=("float32", "autocast-bf16", "handcast-bf16"),
    ),
    "quick": dict(
        static="quick",
        compile="quick",
        run="quick",
        timed_families=("gpt",),
        compile_repeats=2,
        run_repeats=5,
        run_steps=3,
        eager_repeats=3,
        warmup=False,
        variants=("float32", "autocast-bf16", "handcast-bf16"),
    ),
    "full": dict(
        static="full",
        compile="full",
        run="runtime",
        timed_families=FAMILIES,
        compile_repeats=3,
        run_repeats=15,
        run_steps=10,
        eager_repeats=9,
        warmup=True,
        variants=None,
    ),
}
"""Per mode: the size of each measurement and the repeats of the timings. Memory and
coverage only trace, so they take the mode's largest size; run times need a size the
CPU can run many times. --smoke and --quick time one model and a few variants
(`variants`; None: all), without warm-up rounds, to stay within their budgets (a
test's; 2 minutes); the full run times every model and every variant. --smoke also
traces fewer variants for memory and coverage (`static_variants`; all by default)."""

COMPILE_VARIANTS = ["float32", "autocast-bf16", "handcast-bf16"]
"""Same optimizer (adamw) in all three: autocast against none, and against casting by hand."""


def metadata(argv: list[str], mode: str) -> dict:
    return dict(
        date=datetime.date.today().isoformat(),
        command="python -m benchmarks " + " ".join(argv),
        mode=mode,
        jax=jax.__version__,
        flax=flax.__version__,
        python=platform.python_version(),
        backend=jax.default_backend(),
        device=str(jax.devices()[0]),
        cpu_count=os.cpu_count(),
        machine=platform.machine(),
    )


def traced_measurements(spec, names) -> tuple[dict, dict]:
    """Activation memory (with the backward pass's recomputation) and precision
    coverage of each variant: traced, not timed."""
    (params, state), batch = spec.param_spec(), spec.batch_spec()
    mem = {}
    for n in names:
        loss = value_fn(spec, VARIANTS[n])
        mem[n] = memory.memory_report(loss, params, state, batch)
        mem[n].update(recompute.recompute_report(loss, params, state, batch))
    cov = {}
    for n in names:
        step, tx = train_step(spec, VARIANTS[n])
        text = jax.jit(step).lower(*step_specs(spec, tx)).as_text()
        cov[n] = stablehlo.coverage(text).as_dict()
    return mem, cov


def cpu_benchmarks(mode: str, log=print) -> dict:
    """Every CPU measurement, per model family."""
    cfg = MODES[mode]
    names = [n for n in VARIANTS if n in cfg.get("static_variants", VARIANTS)]
    results: dict = {
        "sizes": {},
        "memory": {},
        "coverage": {},
        "compile": {},
        "scaler": {},
        "eager": {},
        "fidelity": {},
    }
    for family in FAMILIES:
        spec = SIZES[cfg["static"]][family]
        results["sizes"][family] = {
            k: SIZES[cfg[k]][family].describe() for k in ("static", "compile", "run")
        }
        log(f"[{family}] memory and coverage: {spec.describe()}")
        results["memory"][family], results["coverage"][family] = traced_measurements(spec, names)

        if family not in cfg["timed_families"]:
            continue
        log(f"[{family}] trace/lower/compile, {cfg['compile_repeats']} repeats")
        timed = [n for n in names if cfg["variants"] is None or n in cfg["variants"]]
        results["compile"][family] = timing.compile_overhead(
            SIZES[cfg["compile"]][family],
            [n for n in COMPILE_VARIANTS if n in timed],
            cfg["compile_repeats"],
            cfg["warmup"],
        )
        run_spec = SIZES[cfg["run"]][family]
        log(f"[{family}] grad-scaler step time, eager calls, fidelity: {run_spec.describe()}")
        results["scaler"][family] = timing.scaler_overhead(
            run_spec, "autocast-f16", cfg["run_repeats"], cfg["run_steps"], cfg["warmup"]
        )
        results["eager"][family] = timing.eager_overhead(
            run_spec, jnp.bfloat16, cfg["eager_repeats"], cfg["warmup"]
        )
        results["fidelity"][family] = timing.fidelity(run_spec, timed)
    return results


def gpu_jobs(families, names, highest: bool = True) -> list[tuple[str, str, str | None]]:
    """(family, variant, matmul precision) per GPU worker. Where float32 is among
    `names`, it also runs at 'highest' precision, last, unless `highest` is False: by
    default XLA runs float32 matmuls on TF32 tensor cores, so 'float32' is TF32 unless
    said otherwise."""
    jobs = []
    for family in families:
        jobs += [(family, n, None) for n in names]
        if highest and "float32" in names:
            jobs.append((family, "float32", "highest"))
    return jobs


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    size.add_argument(
        "--quick", action="store_true", help="small sizes, under 2 minutes on 2 cores"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="GPU step time and peak memory, one process per variant"
    )
    parser.add_argument(
        "--families", nargs="+", default=list(FAMILIES), choices=FAMILIES, help="models for --gpu"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="variants for --gpu, in this order",
    )
    parser.add_argument(
        "--no-highest",
        action="store_true",
        help="--gpu float32 at XLA's default precision only (TF32 on NVIDIA GPUs)",
    )
    parser.add_argument("--deadline", type=float, default=540, help="seconds for all --gpu workers")
    parser.add_argument("--json", metavar="PATH", help="write all results here")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"

    start = time.perf_counter()
    out = {"meta": metadata(argv, mode)}

    def log(msg: str) -> None:  # progress goes to stderr, the tables to stdout
        print(f"# {time.perf_counter() - start:6.1f}s {msg}", file=sys.stderr, flush=True)

    if args.gpu:
        gpu_size = {"full": "gpu"}.get(mode, mode)
        out["gpu"] = gpu.run_all(
            gpu_jobs(args.families, args.variants, highest=not args.no_highest),
            gpu_size,
            windows=3,
            steps=10 if mode == "full" else 2,
            deadline_s=args.deadline,
            log=log,
        )
        text = report.gpu_tables(out["gpu"])
    else:
        saved = dict(compile_options.COMPILER_OPTIONS)
        if mode == "smoke":
            compile_options.COMPILER_OPTIONS.update(compile_options.FAST_COMPILE)
        try:
            out.update(cpu_benchmarks(mode, log))
        finally:  # main() may run inside a test session: leave no setting behind
            compile_options.COMPILER_OPTIONS.clear()
            compile_options.COMPILER_OPTIONS.update(saved)
        out["targets"] = report.targets(out)
        text = report.cpu_tables(out)
    out["meta"]["seconds"] = time.perf_counter() - start
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out
