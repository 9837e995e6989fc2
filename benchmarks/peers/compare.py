"""``python -m benchmarks.peers.compare BEFORE.json AFTER.json``

Compares two ``--batches`` runs of `benchmarks.peers` (two versions of mpjax, the
same peers and batches) row by row: activation bytes over float32, and the median
of each gradient error over the batches, before and after, with the number of
batches on which the after run's error is at most the before run's (the two runs
see the same batches, so this pairs them).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.peers.harness import _err, _median, _ratio


def _rows(path: str, parser) -> dict:
    with open(path) as fh:
        results = json.load(fh).get("results")
    if not isinstance(results, list):
        parser.error(f"{path} is not a peers run (python -m benchmarks.peers --json PATH)")
    return {
        (res["model"], row["variant"]): row
        for res in results
        for row in res["rows"]
        if row["status"] == "ok" and row.get("grad_err_tree_batches")
    }


def _at_most(after: list, before: list) -> str:
    return f"{sum(a <= b for a, b in zip(after, before))}/{len(after)}"


def compare(before: dict, after: dict) -> str:
    """The markdown table of the rows both runs hold, in the after run's order."""
    lines = [
        "| model | variant | activations x f32 before | after | batches "
        "| worst leaf, median before | after | after <= before "
        "| tree, median before | after | after <= before |",
        "|" + "---|" * 2 + "---:|" * 9,
    ]
    for key, a in after.items():
        b = before.get(key)
        if b is None or len(b["grad_err_tree_batches"]) != len(a["grad_err_tree_batches"]):
            continue
        cells = [_ratio(b["activation_ratio"]), _ratio(a["activation_ratio"])]
        cells.append(str(len(a["grad_err_tree_batches"])))
        for field in ("grad_err_leaf_batches", "grad_err_tree_batches"):
            cells += [_err(_median(b[field])), _err(_median(a[field]))]
            cells.append(_at_most(a[field], b[field]))
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers.compare", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("before", help="the JSON of the earlier run (--batches K --json)")
    parser.add_argument("after", help="the JSON of the later run, same K")
    args = parser.parse_args(argv)
    before, after = _rows(args.before, parser), _rows(args.after, parser)
    if not after or not before:
        parser.error("no rows with gradient errors over batches: run with --batches K --json")
    common = [k for k in after if k in before]
    counts = {len(r["grad_err_tree_batches"]) for run in (before, after) for r in run.values()}
    if common and not any(
        len(before[k]["grad_err_tree_batches"]) == len(after[k]["grad_err_tree_batches"])
        for k in common
    ):
        parser.error(
            f"the two runs measured different numbers of batches {sorted(counts)}: "
            "compare runs of the same --batches K"
        )
    print(compare(before, after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
