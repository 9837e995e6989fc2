"""What XLA allocates for a jitted gradient, beside what the traced program keeps.

    PYTHONPATH=. python -m benchmarks.compiled_memory [--families resnet gpt] [--json F]

`benchmarks.memory` counts the residuals of ``jax.vjp``: what the traced program
asks to keep between the forward and backward passes, and what an eager
``jax.vjp`` (or a forward and backward compiled apart) does keep. Compiled as one
program, XLA may keep less: it recomputes a broadcast rather than storing it, and
fuses elementwise work across the two passes. This reports both, for
``jax.jit(jax.grad(loss))``: the activation bytes, and the temporary bytes of XLA's
buffer assignment on this backend (``compiled.memory_analysis()``; arguments and
outputs are left out, as the parameters and gradients are the same in every
variant). Each compile of a full-size model takes a minute or more on a CPU.
"""

from __future__ import annotations

import argparse
import json

import jax

from benchmarks import memory
from benchmarks.cli import FAMILIES
from benchmarks.models import SIZES
from benchmarks.report import MiB, _table
from benchmarks.variants import VARIANTS, value_fn

DEFAULT_VARIANTS = ("float32", "autocast-bf16", "handcast-bf16", "autocast-bf16-lean")


def compiled_memory(spec, names) -> dict:
    """Per variant: activation bytes (vjp residuals) and XLA's temporary bytes."""
    (params, state), batch = spec.param_spec(), spec.batch_spec()
    out = {}
    for name in names:
        loss = value_fn(spec, VARIANTS[name])
        compiled = jax.jit(jax.grad(loss)).lower(params, state, batch).compile()
        analysis = compiled.memory_analysis()
        out[name] = {
            "activation_bytes": memory.memory_report(loss, params, state, batch)[
                "activation_bytes"
            ],
            "compiled_temp_bytes": None if analysis is None else analysis.temp_size_in_bytes,
        }
    return out


def table(results: dict) -> str:
    rows = []
    for family, by_variant in results.items():
        for name, r in by_variant.items():
            base = by_variant.get(VARIANTS[name].baseline or "", {})
            cells = [family, name]
            for key in ("activation_bytes", "compiled_temp_bytes"):
                value, ref = r[key], base.get(key)
                cells.append("n/a" if value is None else f"{value / MiB:,.0f}")
                cells.append(f"{value / ref:.3f}" if value is not None and ref else "")
            rows.append(cells)
    header = ["model", "variant", "activation MiB", "x hand-cast", "compiled temp MiB"]
    return _table(header + ["x hand-cast"], rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument(
        "--variants", nargs="*", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS)
    )
    parser.add_argument("--size", default="full", choices=sorted(SIZES))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {args.size} sizes")
    results = {}
    for family in args.families:
        results[family] = compiled_memory(SIZES[args.size][family], args.variants)
        print(f"{family} done", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
