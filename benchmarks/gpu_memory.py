"""Peak GPU memory and kernel traffic of a training step, compiled for a GPU this
machine does not have.

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    PYTHONPATH=. python -m benchmarks.gpu_memory [--families gpt resnet] [--variants ...]
        [--no-scaler] [--target benchmarks/targets/h100.pbtxt] [--json F] [--hlo-dir D]

XLA's GPU compiler needs a description of the device, not the device itself: JAX's
deviceless ahead-of-time compilation (`jax.experimental.topologies`) compiles a
jitted step for the GPU a target configuration describes, here an H100 (the
``gpu_target_config`` XLA wrote when compiling on one). The step is the one
`benchmarks.gpu` times: forward, backward and optimizer, parameters and optimizer
state donated. Its peak is what XLA's buffer assignment allocates: the arguments,
the temporaries, and the outputs not written in place of a donated argument. On the
H100 itself, ``memory_stats()['peak_bytes_in_use']`` after the same step was within
1 MiB of this number for eight of the nine steps compared, and 17 MiB (0.09%) below
it for the ninth (docs/benchmarks.md).

What this cannot show is time: without the device, XLA does not autotune its
kernels, so it may choose Triton where it would choose cuBLAS (and the converts
around it). Memory is set by the buffers the program keeps, which do not depend on
that choice. The bytes the step's kernels read and write
(`benchmarks.kernel_traffic`) are an estimate of its memory traffic: on a
transformer they track the step time, on a convolutional network they do not
(docs/benchmarks.md). To see what is alive at the peak, add
``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`` and read the
``...-live-range.txt`` file ("Stack trace breakdown for peak usage"). With
``--no-scaler`` every step is compiled without the loss scaler, float16 ones too:
what the scaler adds to a peak is the difference.

Needs the CUDA plugin of the installed jax (``jax[cuda12]``); runs on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import tempfile
import time

import jax

from benchmarks import kernel_traffic
from benchmarks.cli import FAMILIES
from benchmarks.models import SIZES
from benchmarks.report import _table
from benchmarks.variants import VARIANTS, step_specs, train_step
from mpjax import _finite

GiB = 2**30
TARGETS = pathlib.Path(__file__).parent / "targets"
DEFAULT_VARIANTS = (
    "float32",
    "handcast-bf16",
    "autocast-bf16",
    "autocast-bf16-lean",
    "handcast-f16",
    "autocast-f16",
)


def device(target_config: str):
    """The one device of a deviceless CUDA topology described by `target_config`.

    Fields that the installed XLA does not know (a target written by a newer one)
    are dropped, with a note: they describe the device in more detail than this XLA
    reads.
    """
    from jax.experimental import topologies

    dropped = []
    while True:
        with tempfile.TemporaryFile("w+") as log:
            try:
                with _stderr_to(log):  # XLA names a field it does not know there
                    topology = topologies.get_topology_desc(
                        platform="cuda", target_config=target_config, topology="1x1x1"
                    )
                break
            except Exception as e:  # the plugin is missing, or is another jax's
                log.seek(0)
                unknown = re.search(r'has no field named "(\w+)"', log.read())
                if unknown is None or unknown.group(1) in dropped:
                    raise SystemExit(
                        f"cannot compile for a GPU without one here ({type(e).__name__}: "
                        f"{e}).\nInstall the CUDA plugin of the installed jax: pip install "
                        f'"jax[cuda12]=={jax.__version__}"'
                    ) from e
        dropped.append(unknown.group(1))
        target_config = re.sub(rf"\b{unknown.group(1)}: *\S+", "", target_config)
    if dropped:
        print(f"(target fields this jax's XLA does not read, dropped: {', '.join(dropped)})")
    return topology.devices[0]


@contextlib.contextmanager
def _stderr_to(file):
    """The process's standard error (file descriptor 2, where XLA logs) into `file`."""
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _traced_for(dev):
    """The step traced as on `dev`'s platform. The loss scaler shapes its program
    for the platform it runs on (`mpjax._finite.backend`): the default backend,
    here the CPU, whatever the program is compiled for."""
    if dev.platform != "gpu":
        yield
        return
    cpu = _finite.backend
    _finite.backend = lambda: "gpu"
    try:
        yield
    finally:
        _finite.backend = cpu


def peak_bytes(analysis) -> int:
    """Arguments, temporaries and outputs not aliased to a donated argument."""
    return (
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )


def step_memory(
    spec, variant_name: str, dev, scaler: bool | None = None, hlo_dir: str | None = None
) -> dict:
    """Compiles `benchmarks.gpu`'s training step for `dev`; its memory in bytes.

    `scaler` overrides the variant's own choice of the loss scaler. With `hlo_dir`,
    the compiled program's text is written there as ``<model>-<variant>.hlo``.
    """
    step, tx = train_step(spec, VARIANTS[variant_name], scaler)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        step_specs(spec, tx),
    )
    t0 = time.perf_counter()
    with _traced_for(dev):
        compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(*args).compile()
    analysis = compiled.memory_analysis()
    text = compiled.as_text()
    if hlo_dir is not None:
        path = pathlib.Path(hlo_dir) / f"{spec.family}-{variant_name}.hlo"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    traffic = kernel_traffic.kernel_bytes(text)
    return {
        "peak_bytes": peak_bytes(analysis),
        "temp_bytes": analysis.temp_size_in_bytes,
        "argument_bytes": analysis.argument_size_in_bytes,
        "kernel_bytes": traffic["bytes"],
        "kernels": traffic["kernels"],
        "compile_s": time.perf_counter() - t0,
    }


def _not_compiled(family: str, variant: str, dev, error: Exception) -> str:
    """What to tell of a step this XLA could not compile for `dev` (it goes on with
    the others). Without the device, XLA picks Triton's matrix kernels untuned, and
    some XLA versions find no tiling for one of them."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return (
        f"{family} {variant}: XLA (jax {jax.__version__}) could not compile this step for "
        f"{dev.device_kind}: {first}\n  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false "
        "compiles its products for cuBLAS instead: another program, whose peak and "
        "kernels can differ (a newer jax may compile this one)."
    )


def table(results: dict) -> str:
    rows = []
    for family, by_variant in results.items():
        for name, r in by_variant.items():
            f32 = by_variant.get("float32", {}).get("peak_bytes")
            baseline = by_variant.get(VARIANTS[name].baseline or "", {})
            hand, hand_traffic = baseline.get("peak_bytes"), baseline.get("kernel_bytes")
            peak, traffic = r["peak_bytes"], r["kernel_bytes"]
            rows.append(
                [
                    family,
                    name,
                    f"{peak / GiB:.2f}",
                    f"{peak / f32:.3f}" if f32 else "",
                    f"{peak / hand:.3f}" if hand else "",
                    f"{traffic / 1e9:.2f}",
                    f"{traffic / hand_traffic:.3f}" if hand_traffic else "",
                    str(r["kernels"]),
                ]
            )
    header = ["model", "variant", "peak GiB", "x float32", "x hand-cast"]
    return _table(header + ["kernel GB", "x hand-cast", "kernels"], rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    parser.add_argument(
        "--no-scaler", action="store_true", help="compile every step without the loss scaler"
    )
    parser.add_argument("--target", default=str(TARGETS / "h100.pbtxt"))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--hlo-dir",
        help="write each compiled step here, for `python -m benchmarks.kernel_traffic A B`",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown --variants {unknown}; choose from {sorted(VARIANTS)}")
    jax.config.update("jax_platforms", "cpu")  # compile for the target, run nothing
    dev = device(pathlib.Path(args.target).read_text())
    scaler = False if args.no_scaler else None
    print(
        f"jax {jax.__version__}, compiled for {dev.device_kind} ({args.target}), gpu sizes"
        + (", no loss scaler" if args.no_scaler else "")
    )
    results = {}
    for family in args.families:
        results[family] = {}
        for name in args.variants:
            try:
                results[family][name] = step_memory(
                    SIZES["gpu"][family], name, dev, scaler, args.hlo_dir
                )
            except jax.errors.JaxRuntimeError as e:  # an XLA without the device can fail
                print(_not_compiled(family, name, dev, e), flush=True)
        print(f"{family} done", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
