"""GPU step time, throughput and peak memory, each variant in a fresh process.

Peak memory (``memory_stats()['peak_bytes_in_use']``) cannot be reset inside a
process, so every (model, variant) runs in its own subprocess:

    python -m benchmarks.gpu --worker gpt autocast-bf16 --size gpu

prints one JSON line. `run_all` starts the workers one after another, keeps to a
deadline (a lease on a GPU machine is short) and returns what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER_FIELDS = ("family", "variant", "step_s", "items_per_s", "peak_bytes", "compile_s")


def compiled_step(spec, variant_name: str, copy: bool = False):
    """``(compiled, (params, state, opt_state, batch), compile_s)``: the variant's
    training step compiled with its parameters and states donated (updated in
    place), and its first arguments. `spec.init` is cached: with `copy`, the step
    gets copies, so that another step of the same process can start from them too
    (the cached arrays then stay alive beside the step's)."""
    import jax

    from benchmarks.variants import VARIANTS, train_step

    step, tx = train_step(spec, VARIANTS[variant_name])
    step = jax.jit(step, donate_argnums=(0, 1, 2))
    params, state = spec.init(0)
    if copy:
        params, state = jax.tree.map(jax.numpy.copy, (params, state))
    args = (params, state, tx.init(params), spec.batch(jax.random.key(1)))
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled, args, time.perf_counter() - t0


def worker(
    family: str,
    variant_name: str,
    size: str,
    windows: int,
    steps: int,
    matmul_precision: str | None,
) -> dict:
    """Compiles and times one training step on the default device."""
    import jax

    if matmul_precision:
        jax.config.update("jax_default_matmul_precision", matmul_precision)
    from benchmarks.models import SIZES

    spec = SIZES[size][family]
    compiled, (params, state, opt_state, batch), compile_s = compiled_step(spec, variant_name)
    for _ in range(2):  # warm-up
        params, state, opt_state, loss = compiled(params, state, opt_state, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps):
            params, state, opt_state, loss = compiled(params, state, opt_state, batch)
        jax.block_until_ready((params, loss))
        times.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(
        family=family,
        variant=variant_name,
        size=size,
        config=spec.describe(),
        matmul_precision=matmul_precision or "default",
        step_s=step_s,
        step_s_all=times,
        items_per_s=spec.config.items_per_step / step_s,
        unit=spec.unit,
        peak_bytes=stats.get("peak_bytes_in_use"),
        compile_s=compile_s,
        final_loss=float(loss),
        device=str(jax.devices()[0]),
    )


def run_all(
    jobs: list[tuple[str, str, str | None]],
    size: str,
    windows: int,
    steps: int,
    deadline_s: float,
    log=print,
) -> list[dict]:
    """Runs each ``(family, variant, matmul_precision)`` in its own process, until the deadline."""
    start, results = time.perf_counter(), []
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    for family, variant, precision in jobs:
        left = deadline_s - (time.perf_counter() - start)
        if left < 30:
            log(f"skipped {family} {variant}: deadline")
            results.append(dict(family=family, variant=variant, error="skipped: deadline"))
            continue
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--worker",
            family,
            variant,
            "--size",
            size,
            "--windows",
            str(windows),
            "--steps",
            str(steps),
        ]
        if precision:
            cmd += ["--matmul-precision", precision]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=left, env=env, check=False
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                tail = (proc.stderr or proc.stdout)[-1500:]
                results.append(dict(family=family, variant=variant, error=tail))
            else:
                results.append(json.loads(lines[-1]))
        except subprocess.TimeoutExpired:
            results.append(dict(family=family, variant=variant, error="timeout"))
        log(f"{family} {variant} {precision or ''}: {_summary(results[-1])}")
    return results


def _summary(r: dict) -> str:
    if "error" in r:
        return f"ERROR {r['error'][-300:]}"
    peak = f"{r['peak_bytes'] / 2**30:.2f} GiB" if r["peak_bytes"] else "n/a"
    return (
        f"{r['step_s'] * 1e3:.1f} ms/step, {r['items_per_s']:.0f} {r['unit']}/s, "
        f"peak {peak}, compile {r['compile_s']:.1f} s"
    )


def main(argv=None):
    from benchmarks.models import SIZES
    from benchmarks.variants import VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("FAMILY", "VARIANT"), required=True)
    parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--matmul-precision", default=None)
    args = parser.parse_args(argv)
    family, variant = args.worker
    if family not in SIZES[args.size] or variant not in VARIANTS:
        parser.error(
            f"--worker {family} {variant}: choose a family from {sorted(SIZES[args.size])} "
            f"and a variant from {sorted(VARIANTS)}"
        )
    result = worker(*args.worker, args.size, args.windows, args.steps, args.matmul_precision)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
