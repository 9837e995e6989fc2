"""How long a first `mpjax.diagnose` call takes, and what its compile options save.

`diagnose` evaluates the training step one equation at a time, and each distinct
equation is compiled once: on a first call most of the time is XLA compiling
small programs. mpjax compiles them with `_compat.fast_compile_options` (LLVM's
cheapest code generation; on jaxlib 0.10 the older kernel emitters). The
baseline compiles them with XLA's defaults, as JAX's eager evaluation does.
Each call starts from cleared caches (JAX's and mpjax's), the two interleaved in
one process; medians of wall time.

Run from the repository root: ``python -m benchmarks.diagnose_time``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import jax

import mpjax
from benchmarks.models import SIZES
from benchmarks.timing import at_least_one, interleaved
from benchmarks.variants import VARIANTS, value_fn
from mpjax import _compat


def clear_caches() -> None:
    """JAX's caches and mpjax's jitted equations: the next call compiles anew."""
    jax.clear_caches()
    _compat._jit_of_bind.cache_clear()


def first_call(spec, options: dict | None) -> dict[str, float]:
    """Seconds of one `diagnose` call of `spec`'s float32 loss from cold caches,
    its equations compiled with `options` (None: mpjax's own)."""
    params, state = spec.init(0)
    batch = spec.batch(jax.random.key(1))
    loss = value_fn(spec, VARIANTS["float32"])
    clear_caches()
    fixed = mock.patch.object(_compat, "fast_compile_options", lambda: options)
    with fixed if options is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        mpjax.diagnose(loss, params, state, batch)
        return {"call": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="quick", choices=sorted(SIZES))
    parser.add_argument("--family", default="gpt", choices=sorted(SIZES["quick"]))
    parser.add_argument("--repeats", type=at_least_one, default=3)
    args = parser.parse_args(argv)
    spec = SIZES[args.size][args.family]
    med = interleaved(
        {"fast": lambda: first_call(spec, None), "default": lambda: first_call(spec, {})},
        args.repeats,
        warmup=False,
    )
    fast, default = med["fast"]["call"], med["default"]["call"]
    print(f"### first `mpjax.diagnose` call, {spec.describe()}, jax {jax.__version__}")
    print("| equations compiled with | seconds | ratio |\n|---|---:|---:|")
    print(f"| XLA's defaults (eager evaluation's) | {default:.2f} | 1.00 |")
    print(f"| `fast_compile_options` (mpjax) | {fast:.2f} | {fast / default:.2f} |")
    return {"fast_s": fast, "default_s": default, "ratio": fast / default}


if __name__ == "__main__":
    main()
