"""Benchmarks of mpjax: memory, precision coverage, overhead, GPU speed.

    python -m benchmarks [--smoke | --quick] [--gpu] [--json PATH]

Modules: `models` (the Flax GPT, ViT and ResNets), `variants` (float32, autocast,
hand-cast), `memory` (vjp residuals), `stablehlo` (coverage of the lowered step),
`timing` (CPU overheads), `gpu` (step time per variant, one process each),
`report` (tables and targets), `compile_options` (XLA options and `jit` with
them), `cli` (the entry point).
"""

from benchmarks.cli import main

__all__ = ["main"]
