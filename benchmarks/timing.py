"""Overheads on a shared, noisy CPU: ratios of medians of interleaved repeats.

Every comparison runs its two (or more) contenders in one process, alternating
them inside each repeat (in a rotating order, so neither always goes first),
after an untimed warm-up round. A ratio of medians is then robust to the machine
getting busier or quieter during the measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

import mpjax
from benchmarks import compile_options, kernel_traffic
from benchmarks.models import ModelSpec
from benchmarks.compile_options import jit
from benchmarks.variants import VARIANTS, forward, step_specs, train_step, value_fn


def at_least_one(text: str) -> int:
    """An argparse type: a count of repeats, batches or steps, 1 or more."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def positive(text: str) -> float:
    """An argparse type: a size, above 0."""
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return x


def interleaved(
    contenders: dict[str, Callable[[], dict[str, float]]], repeats: int, warmup: bool = True
) -> dict:
    """Runs each contender `repeats` times, interleaved; median of each reported field.

    A contender returns a dict of seconds (e.g. ``{"trace": .., "compile": ..}``).
    """
    names = list(contenders)
    for name in names if warmup else ():  # JAX's own caches, first allocations
        contenders[name]()
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            samples[name].append(contenders[name]())
    return {
        n: {k: statistics.median(s[k] for s in samples[n]) for k in samples[n][0]} for n in names
    }


# --------------------------------------------------------------------------
# Trace, lower and compile


def compile_times(
    spec: ModelSpec,
    variant_name: str,
    scaler: bool | None = None,
    scaled_loss: bool | None = None,
    kernels: bool = False,
) -> dict[str, float]:
    """Seconds to trace, lower and compile one training step, from a fresh function.

    `scaler` overrides the variant's own choice of a grad scaler around its optimizer,
    `scaled_loss` whether the gradients are `mpjax.scaled_value_and_grad`'s
    (`variants.train_step`). With `kernels`, also the compiled step's kernels.
    """
    step, tx = train_step(spec, VARIANTS[variant_name], scaler=scaler, scaled_loss=scaled_loss)
    args = step_specs(spec, tx)
    t0 = time.perf_counter()
    traced = jax.jit(step).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile(compiler_options=dict(compile_options.COMPILER_OPTIONS) or None)
    t3 = time.perf_counter()
    out = dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, total=t3 - t0)
    if kernels:
        out["kernels"] = kernel_traffic.kernel_bytes(compiled.as_text())["kernels"]
    return out


def compile_overhead(spec: ModelSpec, names: list[str], repeats: int, warmup: bool = True) -> dict:
    """Trace/lower/compile seconds of each variant's training step, and ratios to float32."""
    med = interleaved({n: (lambda n=n: compile_times(spec, n)) for n in names}, repeats, warmup)
    base = med["float32"]
    return {
        n: {
            **m,
            "ratio_total": m["total"] / base["total"],
            "ratio_trace": m["trace"] / base["trace"],
        }
        for n, m in med.items()
    }


# --------------------------------------------------------------------------
# Run time of the jitted step, with and without the grad scaler


def _step_runner(spec: ModelSpec, variant_name: str, scaler: bool, steps: int) -> Callable:
    """A closure timing `steps` jitted training steps (compiled on first use)."""
    step, tx = train_step(spec, VARIANTS[variant_name], scaler=scaler)
    step = jit(step)
    params, model_state = spec.init(0)
    state = [params, model_state, tx.init(params)]
    batch = spec.batch(jax.random.key(1))
    jax.block_until_ready(step(*state, batch))

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        for _ in range(steps):
            state[0], state[1], state[2], loss = step(*state, batch)
        jax.block_until_ready((state, loss))
        return dict(step=(time.perf_counter() - t0) / steps)

    return run


def scaler_overhead(
    spec: ModelSpec, variant_name: str, repeats: int, steps: int, warmup: bool = True
) -> dict:
    """Step time with `grad_scaler(adamw)` against plain `adamw`, same autocast loss."""
    med = interleaved(
        {
            "plain": _step_runner(spec, variant_name, False, steps),
            "grad_scaler": _step_runner(spec, variant_name, True, steps),
        },
        repeats,
        warmup,
    )
    return dict(
        variant=variant_name,
        plain_s=med["plain"]["step"],
        scaler_s=med["grad_scaler"]["step"],
        ratio=med["grad_scaler"]["step"] / med["plain"]["step"],
    )


# --------------------------------------------------------------------------
# Eager (un-jitted) calls


def eager_overhead(spec: ModelSpec, low_dtype, repeats: int, warmup: bool = True) -> dict:
    """An un-jitted forward call under autocast against the plain one.

    Without jit, autocast traces the function to a jaxpr and evaluates it op by op
    on every call, so this is the price of using it outside `jax.jit`.
    """
    plain = forward(spec, VARIANTS["float32"])
    cast = mpjax.autocast(plain, dtype=low_dtype)
    params, state = spec.init(0)
    inputs = spec.batch(jax.random.key(1))["inputs"]

    def timed(fn):
        def run():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, state, inputs))
            return dict(call=time.perf_counter() - t0)

        return run

    med = interleaved({"plain": timed(plain), "autocast": timed(cast)}, repeats, warmup)
    return dict(
        plain_s=med["plain"]["call"],
        autocast_s=med["autocast"]["call"],
        ratio=med["autocast"]["call"] / med["plain"]["call"],
    )


# --------------------------------------------------------------------------
# Numerical fidelity: how far each variant's loss and gradients are from float32


def _rel(a, b) -> float:
    a, b = (
        np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
        for t in (a, b)
    )
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fidelity(spec: ModelSpec, names: list[str]) -> dict:
    """Relative error of each variant's loss and gradients against float32's."""
    params, state = spec.init(0)
    batch = spec.batch(jax.random.key(1))
    out = {
        n: jit(jax.value_and_grad(value_fn(spec, VARIANTS[n])))(params, state, batch) for n in names
    }
    ref_loss, ref_grads = out["float32"]
    return {
        n: dict(
            loss=float(loss),
            loss_rel_err=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            grad_rel_err=_rel(grads, ref_grads),
        )
        for n, (loss, grads) in out.items()
    }
