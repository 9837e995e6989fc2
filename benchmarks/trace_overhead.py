"""What autocast adds to the time JAX takes to trace and lower a program.

Two measurements, each against plain JAX in the same process (interleaved
repeats, medians; see `benchmarks.timing.interleaved`), in CPU time of this
process, which a shared machine disturbs less than wall time:

* a jitted gradient step of a deep MLP (`--layers`, 200 by default): seconds to
  ``jax.jit(jax.grad(f)).trace(...)`` and to ``.lower()`` it, and their ratios;
* scans nested 1 to `--depth` deep: trace time by nesting depth, which must grow
  with the program's size, not double with each level.

Run from the repository root: ``python -m benchmarks.trace_overhead``. Add
``--profile trace`` (or ``lower``) to print a cProfile of one autocast step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import jax
import jax.numpy as jnp
from jax import lax

import mpjax
from benchmarks.timing import at_least_one, interleaved


def mlp_loss(params, x, y):
    for w, b in params:
        x = jax.nn.gelu(x @ w + b)
    return jnp.mean((x - y) ** 2)


def mlp_args(layers: int, width: int, batch: int = 32):
    keys = jax.random.split(jax.random.key(0), layers)
    params = [(jax.random.normal(k, (width, width)) / width**0.5, jnp.zeros(width)) for k in keys]
    x = jax.random.normal(jax.random.key(1), (batch, width))
    return params, x, jnp.zeros((batch, width))


def grad_step_times(wrap, args) -> dict[str, float]:
    """Seconds to trace and lower ``jit(grad(wrap(loss)))``, from a fresh function."""
    # A new function each time: no trace cache hit.
    step = jax.jit(jax.grad(wrap(lambda *a: mlp_loss(*a))))
    t0 = time.process_time()
    traced = step.trace(*args)
    t1 = time.process_time()
    traced.lower()
    t2 = time.process_time()
    return {"trace": t1 - t0, "lower": t2 - t1, "total": t2 - t0}


def nested_scans(depth: int):
    def level(c, x, d):
        if d == 0:
            return jnp.tanh(c @ x)
        return lax.scan(lambda c2, x2: (level(c2, x2, d - 1), None), c, jnp.stack([x, x]))[0]

    return lambda c, xs: lax.scan(lambda c, x: (level(c, x, depth - 1), None), c, xs)[0].sum()


def nested_trace_ms(wrap, depth: int) -> dict[str, float]:
    c, xs = jnp.ones((4, 4)), jnp.ones((2, 4, 4))
    t0 = time.process_time()
    jax.make_jaxpr(wrap(nested_scans(depth)))(c, xs)
    return {"trace": 1e3 * (time.process_time() - t0)}


CONTENDERS = {"plain": lambda f: f, "autocast": mpjax.autocast}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=at_least_one, default=3)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--profile", choices=["trace", "lower"])
    opts = parser.parse_args(argv)
    args = mlp_args(opts.layers, opts.width)
    if opts.profile:
        return _profile(args, opts.profile)

    out = {"nested": {}}
    for depth in range(1, opts.depth + 1):
        med = interleaved(
            {n: (lambda w=w, d=depth: nested_trace_ms(w, d)) for n, w in CONTENDERS.items()},
            opts.repeats,
        )
        out["nested"][depth] = {n: m["trace"] for n, m in med.items()}
        print(
            f"scans nested {depth} deep: trace {med['plain']['trace']:6.1f} ms plain, "
            f"{med['autocast']['trace']:6.1f} ms autocast",
            flush=True,
        )
    med = interleaved(
        {n: (lambda w=w: grad_step_times(w, args)) for n, w in CONTENDERS.items()},
        opts.repeats,
    )
    out["mlp"] = med
    plain, auto = med["plain"], med["autocast"]
    print(f"jit(grad) of a {opts.layers}-layer MLP, seconds (plain / autocast, ratio):")
    for k in ("trace", "lower", "total"):
        print(f"  {k:6s} {plain[k]:7.2f} / {auto[k]:7.2f}   {auto[k] / plain[k]:.2f}x")
    return out


def _profile(args, stage: str) -> dict:
    step = jax.jit(jax.grad(mpjax.autocast(lambda *a: mlp_loss(*a))))
    profile = cProfile.Profile()
    if stage == "trace":
        profile.runcall(step.trace, *args)
    else:
        traced = step.trace(*args)
        profile.runcall(traced.lower)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    return {}


if __name__ == "__main__":
    main()
