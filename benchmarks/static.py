"""The deterministic half of the CPU benchmarks, alone: activation memory and
precision coverage at the full mode's size. They only trace and lower, so they take
a minute or two and need no quiet machine.

    PYTHONPATH=. python -m benchmarks.static --json cpu_static.json
"""

from __future__ import annotations

import argparse
import json

import jax

from benchmarks import memory, stablehlo
from benchmarks.cli import FAMILIES, MODES, SIZES
from benchmarks.variants import VARIANTS, loss_fn, step_specs, train_step


def static_benchmarks(mode: str = "full") -> dict:
    out: dict = {"memory": {}, "coverage": {}}
    for family in FAMILIES:
        spec = SIZES[MODES[mode]["static"]][family]
        params, batch = spec.param_spec(), spec.batch_spec()
        out["memory"][family] = {
            n: memory.memory_report(loss_fn(spec, v), params, batch) for n, v in VARIANTS.items()
        }
        out["coverage"][family] = {}
        for n, v in VARIANTS.items():
            step, tx = train_step(spec, v)
            text = jax.jit(step).lower(*step_specs(spec, tx)).as_text()
            out["coverage"][family][n] = stablehlo.coverage(text).as_dict()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="full", choices=sorted(MODES))
    parser.add_argument("--json", required=True, help="write the results here")
    args = parser.parse_args()
    with open(args.json, "w") as f:
        json.dump(static_benchmarks(args.mode), f, indent=1, default=str)
