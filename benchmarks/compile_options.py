"""The XLA options of every compilation the benchmarks make, and `jit` with them.

A module of its own so that `models` (whose parameters are initialised under
`jit`) and `variants` (which builds on `models`) both use it without importing
each other.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

COMPILER_OPTIONS: dict = {}
"""XLA options for every compilation the benchmarks make. --smoke sets options that
compile about 3x faster (and run slower), since it measures nothing that matters."""

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit(fun: Callable, **kwargs) -> Callable:
    """`jax.jit` with `COMPILER_OPTIONS`."""
    return jax.jit(fun, compiler_options=dict(COMPILER_OPTIONS) or None, **kwargs)
