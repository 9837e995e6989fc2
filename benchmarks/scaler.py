"""The loss scaler's own cost against the bare optimizer, in one process.

    PYTHONPATH=. python -m benchmarks.scaler [--leaves 10 100 1000 10000] [--params 1e6 1e8]

Two ratios, each `grad_scaler(optax.adam(1e-3))` over bare `optax.adam(1e-3)`:

* compile: trace, lower and compile ``jax.jit(tx.update)`` on a dict of n small
  leaves (the median of interleaved repeats);
* step: run time of the compiled update on a tree of 10 leaves holding the given
  number of parameters in all (the median of interleaved repeats).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import mpjax
from benchmarks.timing import interleaved


def _leaves(n: int, size: int) -> dict:
    return {f"p{i:05d}": jnp.full((size,), 0.5, jnp.float32) for i in range(n)}


def _compile_seconds(tx: optax.GradientTransformation, params: dict) -> dict[str, float]:
    state = tx.init(params)
    fresh = lambda *args: tx.update(*args)  # a new function: no cached trace or executable
    t0 = time.perf_counter()
    jax.jit(fresh).lower(params, state, params).compile()
    return {"total": time.perf_counter() - t0}


def compile_ratio(n: int, repeats: int = 3) -> dict:
    """Compile seconds of the scaler's update and of bare adam's, on n leaves."""
    params = _leaves(n, 12)
    bare, scaled = optax.adam(1e-3), mpjax.grad_scaler(optax.adam(1e-3))
    med = interleaved(
        {
            "adam": lambda: _compile_seconds(bare, params),
            "grad_scaler(adam)": lambda: _compile_seconds(scaled, params),
        },
        repeats=repeats,
        warmup=False,
    )
    a, s = med["adam"]["total"], med["grad_scaler(adam)"]["total"]
    return {"leaves": n, "adam_s": a, "scaler_s": s, "ratio": s / a}


def _step_seconds(update, grads, state, params, calls: int) -> dict[str, float]:
    jax.block_until_ready(update(grads, state, params))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = update(grads, state, params)
    jax.block_until_ready(out)
    return {"step": (time.perf_counter() - t0) / calls}


def step_ratio(total_params: int, leaves: int = 10, repeats: int = 7) -> dict:
    """Run time of the compiled update, scaler over bare adam, on `total_params`."""
    params = _leaves(leaves, total_params // leaves)
    grads = jax.tree.map(lambda p: p * 0.25, params)
    calls = min(100, max(1, int(2e7 // total_params)))
    contenders = {}
    for name, tx in (("adam", optax.adam(1e-3)), ("grad_scaler(adam)", mpjax.grad_scaler(optax.adam(1e-3)))):
        update, state = jax.jit(tx.update), tx.init(params)
        contenders[name] = lambda u=update, s=state: _step_seconds(u, grads, s, params, calls)
    med = interleaved(contenders, repeats=repeats)
    a, s = med["adam"]["step"], med["grad_scaler(adam)"]["step"]
    return {"params": total_params, "adam_s": a, "scaler_s": s, "ratio": s / a}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--params", type=float, nargs="*", default=[1e6])
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("| leaves | adam compile (s) | grad_scaler(adam) compile (s) | ratio |")
    print("|---:|---:|---:|---:|")
    for n in args.leaves:
        r = compile_ratio(n, repeats=3 if n < 1000 else 1)
        print(f"| {n} | {r['adam_s']:.2f} | {r['scaler_s']:.2f} | {r['ratio']:.2f} |", flush=True)
    print()
    print("| parameters (10 leaves) | adam step (ms) | grad_scaler(adam) step (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    for p in args.params:
        r = step_ratio(int(p))
        print(
            f"| {int(p):.0e} | {1e3 * r['adam_s']:.2f} | {1e3 * r['scaler_s']:.2f} "
            f"| {r['ratio']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
