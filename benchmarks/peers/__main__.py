"""``python -m benchmarks.peers [--quick] [--json PATH] [--models A,B] [--batches K]``

Runs every peer model (`benchmarks.peers.models.PEERS`) in float32 and under
``mpjax.autocast`` and prints one markdown table (see `benchmarks.peers.harness`).
``--quick`` runs float32, autocast float16 and autocast bfloat16 with the default
policy; without it the ``policy="lean"`` variants run too. Peers whose optional
packages are missing are listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax

from benchmarks.peers import harness
from benchmarks.peers.models import BY_NAME, PEERS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "--quick", action="store_true", help="default policy only (no lean variants)"
    )
    parser.add_argument("--json", metavar="PATH", help="write every measurement to PATH")
    parser.add_argument(
        "--models", help="comma-separated peer names (default: all): " + ", ".join(BY_NAME)
    )
    parser.add_argument(
        "--batches",
        type=int,
        default=1,
        metavar="K",
        help="also measure the gradient error on K batches (median and worst)",
    )
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args(argv)

    peers = PEERS
    if args.models:
        unknown = [m for m in args.models.split(",") if m not in BY_NAME]
        if unknown:
            parser.error(f"unknown peer(s) {unknown}; known: {', '.join(BY_NAME)}")
        peers = tuple(BY_NAME[m] for m in args.models.split(","))
    variants = harness.QUICK_VARIANTS if args.quick else harness.FULL_VARIANTS

    def log(msg):
        if args.verbose or not msg.startswith("Traceback"):
            print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    results = []
    for peer in peers:
        print(f"{peer.name} ...", file=sys.stderr, flush=True)
        results.append(harness.run_peer(peer, variants, log=log, batches=args.batches))
        print(
            f"{peer.name}: {results[-1]['status']} ({results[-1]['seconds']:.0f}s)",
            file=sys.stderr,
            flush=True,
        )

    table = harness.render(results)
    header = (
        f"jax {jax.__version__}, {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs; "
        f"variants: {', '.join(variants)}; total {time.perf_counter() - start:.0f}s"
    )
    print(header + "\n")
    print(table)
    if args.batches > 1:
        print(f"\nGradient error over {args.batches} batches:\n")
        print(harness.render_batches(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "command": " ".join(
                        [
                            "python -m benchmarks.peers",
                            *(argv if argv is not None else sys.argv[1:]),
                        ]
                    ),
                    "jax": jax.__version__,
                    "mpjax_commit": _mpjax_commit(),
                    "backend": jax.default_backend(),
                    "variants": list(variants),
                    "results": results,
                },
                fh,
                indent=1,
                default=str,
            )
    return 0


def _mpjax_commit() -> str | None:
    """The git commit of the mpjax that ran, where it is a checkout (None if not)."""
    import subprocess

    import mpjax

    where = os.path.dirname(os.path.realpath(mpjax.__file__))
    try:
        out = subprocess.run(
            ["git", "-C", where, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
