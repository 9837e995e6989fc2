"""The deterministic half of the CPU benchmarks, alone: activation memory and
precision coverage at the full mode's size. They only trace and lower, so they take
a few minutes and need no quiet machine.

    PYTHONPATH=. python -m benchmarks.static --json cpu_static.json
"""

from __future__ import annotations

import argparse
import json

from benchmarks.cli import FAMILIES, MODES, SIZES, traced_measurements
from benchmarks.variants import VARIANTS


def static_benchmarks(mode: str = "full") -> dict:
    out: dict = {"memory": {}, "coverage": {}}
    for family in FAMILIES:
        spec = SIZES[MODES[mode]["static"]][family]
        out["memory"][family], out["coverage"][family] = traced_measurements(spec, list(VARIANTS))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="full", choices=sorted(MODES))
    parser.add_argument("--json", required=True, help="write the results here")
    args = parser.parse_args()
    with open(args.json, "w") as f:
        json.dump(static_benchmarks(args.mode), f, indent=1, default=str)
