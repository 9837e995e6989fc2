"""How far each variant's gradients are from float32's, over several batches.

    PYTHONPATH=. python -m benchmarks.fidelity [--batches 8] [--families gpt vit resnet resnet_bn]
        [--size runtime] [--json PATH] [--before PATH]

For each benchmark model at the size the CPU runs (``SIZES["runtime"]``), the
parameters of seed 0 and ``--batches`` batches (keys 1, 2, ...): the relative L2
error of each variant's gradient (all leaves as one vector) against the float32
gradient of the same batch, as `benchmarks.timing.fidelity` computes it for one
batch. Prints the median and the worst batch per variant, and the median of the
autocast variant over its hand-cast baseline's, batch by batch. With ``--before``
(the JSON of an earlier run, another version of mpjax on the same batches), also
each variant's median then and now, and on how many batches the error now is at
most the error then.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from benchmarks.models import SIZES
from benchmarks.peers.compare import _at_most
from benchmarks.timing import _rel, at_least_one
from benchmarks.variants import VARIANTS, value_fn


def gradient_errors(spec, names: list[str], batches: int) -> dict[str, list[float]]:
    """Per variant, the relative gradient error against float32 on each batch."""
    params, state = spec.init(0)
    grad = {n: jax.jit(jax.grad(value_fn(spec, VARIANTS[n]))) for n in ["float32", *names]}
    errors: dict[str, list[float]] = {n: [] for n in names}
    for i in range(batches):
        batch = spec.batch(jax.random.key(1 + i))
        ref = grad["float32"](params, state, batch)
        for n in names:
            errors[n].append(_rel(grad[n](params, state, batch), ref))
    return errors


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=at_least_one, default=8)
    parser.add_argument(
        "--families", nargs="+", default=list(SIZES["runtime"]), choices=list(SIZES["runtime"])
    )
    parser.add_argument("--size", default="runtime", choices=list(SIZES))
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--before", metavar="PATH", help="an earlier run's --json, to compare")
    args = parser.parse_args(argv)
    names = [n for n in VARIANTS if n != "float32"]
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; {args.batches} batches\n")
    print("| model | variant | grad rel. err, median | worst batch | x baseline, median |")
    print("|---|---|---:|---:|---:|")
    out = {}
    for family in args.families:
        spec = SIZES[args.size][family]
        errors = gradient_errors(spec, names, args.batches)
        out[family] = {"model": spec.describe(), "errors": errors}
        for n in names:
            base = VARIANTS[n].baseline
            ratio = (
                f"{np.median(np.divide(errors[n], errors[base])):.2f} ({base})"
                if base in errors
                else ""
            )
            print(
                f"| {family} | {n} | {np.median(errors[n]):.1e} | {max(errors[n]):.1e} | {ratio} |",
                flush=True,
            )
    if args.before:
        with open(args.before) as fh:
            print("\n" + compare(json.load(fh), out))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"jax": jax.__version__, "batches": args.batches, **out}, fh, indent=1)
    return out


def compare(before: dict, after: dict) -> str:
    """Median error before and after per variant, and the batches where after <= before."""
    lines = [
        "| model | variant | median before | median after | after <= before |",
        "|---|---|---:|---:|---:|",
    ]
    for family, res in after.items():
        if not isinstance(res, dict):  # "jax", "batches" in a loaded JSON
            continue
        for n, errs in res["errors"].items():
            then = before.get(family, {}).get("errors", {}).get(n)
            if then is None or len(then) != len(errs):
                continue
            lines.append(
                f"| {family} | {n} | {np.median(then):.3e} | {np.median(errs):.3e} "
                f"| {_at_most(errs, then)} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
