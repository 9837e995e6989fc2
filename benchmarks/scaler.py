"""The loss scaler's own cost against the bare optimizer, in one process.

    PYTHONPATH=. python -m benchmarks.scaler [--leaves 10 100 1000 10000] [--params 1e6 1e8]
        [--donate]
        [--scalers grad_scaler ...] [--parts] [--compile-models gpt vit resnet]
        [--compile-steps gpt resnet] [--models gpt resnet] [--model-size gpu]
        [--check 1e4 1e5 1e6 1e7]
        [--repeats 15] [--compile-repeats 3]

Two ratios over bare `optax.adam(1e-3)`, each for `grad_scaler(optax.adam(1e-3))` with
the default check (the gradients, as torch), with ``check_updates=True`` (the updates
too), and for optax's own skip-on-non-finite wrapper, `optax.apply_if_finite`:

* compile: trace, lower and compile ``jax.jit(tx.update)`` on a dict of n small
  leaves (the median of interleaved repeats), and the kernels of each compiled
  update (`benchmarks.kernel_traffic`), adam's first: compile time follows them,
  and unlike a time they do not move from run to run;
* step: run time of the compiled update on a tree of 10 leaves holding the given
  number of parameters in all (the median of interleaved repeats); with
  ``--donate``, each update donates its state and the next call takes the state it
  returned, as a training step jitted with ``donate_argnums`` does.

``--scalers`` names the wrappers to measure (all three by default): at 10000 leaves
each compile takes minutes.

With ``--parts``, the compile time of the default scaler's two halves on the same
leaves, each over bare adam: adam with the finite check alone (the scaler's own
per-leaf flags and their combination, no selection), and adam with the selection
alone (the state selected where adam computes it, and the updates, on a flag that
is a jit argument).

With ``--compile-models``, the compile ratio on the parameter tree of each named
benchmark model at its full size (`benchmarks.models.SIZES`): leaves of many shapes,
each shape a kernel of its own, where the n small leaves above share one.

With ``--compile-steps``, the same for the whole jitted training step of each named
benchmark model at full size (autocast float16 loss, forward, backward and AdamW),
with `grad_scaler(adamw)` against plain adamw: the compile a user waits for.

With ``--check``, the finite check of one float32 leaf of each size alone, by
a reduction over booleans, by a max over bytes, and by `mpjax._finite.nonfinite_sum`'s
sum of ``x - x`` (the check of a leaf of `mpjax._finite.large_leaf()` elements or more;
smaller leaves are stacked by size and checked the same way), against an
elementwise pass over the same leaf (``x + 1``): run time on one leaf, and compile
time on leaves of 8 sizes, each a kernel of its own.

With ``--models``, also the whole jitted training step of each benchmark model
(autocast float16 loss, `grad_scaler(adamw)` against plain adamw) at the size the
full benchmark times, or at ``--model-size``: `benchmarks.timing.scaler_overhead`,
15 repeats of 10 steps.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import mpjax
from benchmarks import kernel_traffic, timing
from benchmarks.models import SIZES
from mpjax import _finite, _scaler_update, _skip


def _leaves(n: int, size: int) -> dict:
    return {f"p{i:05d}": jnp.full((size,), 0.5, jnp.float32) for i in range(n)}


def _compile_seconds(update, *args) -> dict[str, float]:
    """Trace, lower and compile seconds of a fresh jit of `update`, and the number of
    kernels in the compiled program."""
    fresh = lambda *a: update(*a)  # a new function: no cached trace or executable
    t0 = time.perf_counter()
    compiled = jax.jit(fresh).lower(*args).compile()
    total = time.perf_counter() - t0
    return {"total": total, "kernels": kernel_traffic.kernel_bytes(compiled.as_text())["kernels"]}


_SCALERS = {
    "grad_scaler": mpjax.grad_scaler,
    "check_updates=True": lambda tx: mpjax.grad_scaler(tx, check_updates=True),
    "optax.apply_if_finite": lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=5),
}
"""The wrappers of adam measured against bare adam, by name."""


def _contenders(names=tuple(_SCALERS)) -> dict[str, optax.GradientTransformation]:
    return {"adam": optax.adam(1e-3), **{k: _SCALERS[k](optax.adam(1e-3)) for k in names}}


def _ratios(med: dict, field: str, names) -> dict:
    a = med["adam"][field]
    out = {"adam_s": a}
    for name in names:
        out[f"{name}_s"], out[f"{name}_ratio"] = med[name][field], med[name][field] / a
    if "kernels" in med["adam"]:
        out["kernels"] = [int(med[name]["kernels"]) for name in ("adam", *names)]
    return out


def compile_ratio(n: int, repeats: int = 3, names=tuple(_SCALERS)) -> dict:
    """Compile seconds of each named wrapper's update and of bare adam's, on n leaves."""
    params = _leaves(n, 12)
    contenders = {
        k: lambda tx=tx, s=tx.init(params): _compile_seconds(tx.update, params, s, params)
        for k, tx in _contenders(names).items()
    }
    med = timing.interleaved(contenders, repeats=repeats, warmup=False)
    return {"leaves": n, **_ratios(med, "total", names)}


def model_compile_ratio(family: str, repeats: int = 3, names=tuple(_SCALERS)) -> dict:
    """`compile_ratio` on the parameter tree of a benchmark model at its full size.

    Shapes only: the update is lowered on abstract values, so nothing is allocated.
    """
    params, _ = SIZES["full"][family].param_spec()
    contenders = {
        k: lambda tx=tx, s=jax.eval_shape(tx.init, params): _compile_seconds(
            tx.update, params, s, params
        )
        for k, tx in _contenders(names).items()
    }
    med = timing.interleaved(contenders, repeats=repeats, warmup=False)
    return {"leaves": len(jax.tree.leaves(params)), **_ratios(med, "total", names)}


_STEP_PARTS = ("grad_scaler, jax.value_and_grad", "grad_scaler")
"""The scaled steps `step_compile_ratio` compiles: the scaler's update alone (the
gradients of ``jax.value_and_grad``), and the update with the gradients of
`mpjax.scaled_value_and_grad` (the loss scaled, each gradient unscaled)."""


def step_compile_ratio(family: str, repeats: int = 3) -> dict:
    """Trace, lower and compile of a whole training step of a benchmark model at full
    size (autocast float16 loss, AdamW), with loss scaling over without: what the
    scaler adds to the compile a user waits for, and how much of it is the update's."""
    spec = SIZES["full"][family]

    def step(scaler: bool, scaled_loss: bool):
        return lambda: timing.compile_times(spec, "autocast-f16", scaler, scaled_loss, kernels=True)

    med = timing.interleaved(
        dict(
            zip(("adam", *_STEP_PARTS), (step(False, False), step(True, False), step(True, True)))
        ),
        repeats=repeats,
        warmup=False,
    )
    return {"family": family, **_ratios(med, "total", _STEP_PARTS)}


def _check_only(adam):
    """adam's update and the scaler's finite check of the gradients, nothing selected."""

    def update(grads, state, params):
        flags, _, nonfinite = _finite.leaf_flags(jax.tree.leaves(grads))
        # The flags are an output, as the scaler's `nonfinite_subtrees` of a flat dict.
        return adam.update(grads, state, params), flags, nonfinite

    return update


def _selection_only(adam):
    """adam's update with the scaler's selection on `drop`, a flag XLA cannot fold."""

    def update(grads, state, params, drop):
        updates, new_state = _skip.update_selected(adam, drop, grads, state, params, {})
        return _scaler_update._no_updates_where(drop, updates), new_state

    return update


_PARTS = ("check only", "selection only")
"""The default scaler's two halves, as `parts_ratio` names them."""


def parts_ratio(n: int, repeats: int = 3) -> dict:
    """Compile seconds of the default scaler's two halves and of bare adam, on n leaves."""
    params = _leaves(n, 12)
    adam = optax.adam(1e-3)
    args = (params, adam.init(params), params)
    contenders = {
        "adam": lambda: _compile_seconds(adam.update, *args),
        "check only": lambda: _compile_seconds(_check_only(adam), *args),
        "selection only": lambda: _compile_seconds(_selection_only(adam), *args, jnp.array(False)),
    }
    med = timing.interleaved(contenders, repeats=repeats, warmup=False)
    return {"leaves": n, **_ratios(med, "total", _PARTS)}


def _step_seconds(fn, *args, calls: int) -> dict[str, float]:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return {"step": (time.perf_counter() - t0) / calls}


def _donated_step_seconds(update, grads, state: list, params, calls: int) -> dict[str, float]:
    """`_step_seconds` of an update that donates its state: each call takes the
    state the last one returned (``state[0]``), as a training loop does."""
    t0 = time.perf_counter()
    for _ in range(calls):
        _, state[0] = update(grads, state[0], params)
    jax.block_until_ready(state[0])
    return {"step": (time.perf_counter() - t0) / calls}


def step_ratio(
    total_params: int,
    leaves: int = 10,
    repeats: int = 15,
    names=tuple(_SCALERS),
    donate: bool = False,
) -> dict:
    """Run time of the compiled update, each named wrapper over bare adam.

    With `donate`, each update donates its optimizer state (``donate_argnums``), so
    that XLA may write the new state over the old, as in a training step jitted
    with its state donated.
    """
    params = _leaves(leaves, total_params // leaves)
    grads = jax.tree.map(lambda p: p * 0.25, params)
    calls = min(100, max(1, int(2e7 // total_params)))
    contenders = {}
    for name, tx in _contenders(names).items():
        if donate:
            update, state = jax.jit(tx.update, donate_argnums=1), [tx.init(params)]
            contenders[name] = lambda u=update, s=state: _donated_step_seconds(
                u, grads, s, params, calls=calls
            )
        else:
            update, state = jax.jit(tx.update), tx.init(params)
            contenders[name] = lambda u=update, s=state: _step_seconds(
                u, grads, s, params, calls=calls
            )
    med = timing.interleaved(contenders, repeats=repeats)
    return {"params": total_params, **_ratios(med, "step", names)}


_CHECKS = {
    "elementwise pass": lambda x: x + 1,
    "any over booleans": lambda x: jnp.any(~jnp.isfinite(x)),
    "max over bytes": lambda x: jnp.max((~jnp.isfinite(x)).astype(jnp.uint8)) > 0,
    "sum of x - x": lambda x: _finite.nonfinite_sum(x) != 0,
}
"""Ways to check one leaf for an inf or a NaN, against an elementwise pass over it."""

_CHECK_SIZES = 8
"""`check_ratios` compiles each check on this many leaves, each of a size of its own."""


def check_ratios(size: int, repeats: int = 15) -> dict:
    """Run time of each finite check on one leaf of `size` elements, over a pass; and
    compile time of each on `_CHECK_SIZES` leaves of sizes from `size` up (each size a
    kernel of its own, as the leaves of a model's shapes are), over a pass's."""
    x = jnp.full((size,), 0.5, jnp.float32)
    calls = max(1, int(2e7 // size))
    shapes = [jax.ShapeDtypeStruct((size + i,), jnp.float32) for i in range(_CHECK_SIZES)]
    run, build = {}, {}
    for name, fn in _CHECKS.items():
        compiled = jax.jit(fn).lower(x).compile()
        run[name] = lambda c=compiled: _step_seconds(c, x, calls=calls)
        build[name] = lambda fn=fn: _compile_seconds(lambda xs: [fn(v) for v in xs], shapes)
    med = timing.interleaved(run, repeats=repeats)
    built = timing.interleaved(build, repeats=max(1, repeats // 5), warmup=False)
    base, base_compile = med["elementwise pass"]["step"], built["elementwise pass"]["total"]
    return {
        "size": size,
        "pass_s": base,
        "pass_compile_s": base_compile,
        **{name: med[name]["step"] / base for name in list(_CHECKS)[1:]},
        **{f"{name} compile": built[name]["total"] / base_compile for name in list(_CHECKS)[1:]},
        "used": "sum of x - x" if size >= _finite.large_leaf() else "stacked by size, sum of x - x",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--params", type=float, nargs="*", default=[1e6])
    parser.add_argument(
        "--donate", action="store_true", help="the step-time updates donate their state"
    )
    parser.add_argument("--parts", action="store_true", help="the scaler's halves' compile")
    parser.add_argument(
        "--scalers",
        nargs="+",
        default=list(_SCALERS),
        choices=list(_SCALERS),
        help="the wrappers measured against bare adam (all by default)",
    )
    parser.add_argument("--models", nargs="*", default=[], choices=sorted(SIZES["runtime"]))
    parser.add_argument(
        "--model-size",
        default="runtime",
        choices=sorted(SIZES),
        help="the size of the --models (runtime: the full benchmark's; gpu: the --gpu one's)",
    )
    parser.add_argument(
        "--compile-models",
        nargs="*",
        default=[],
        choices=sorted(SIZES["full"]),
        help="compile on the full-size model's parameter tree",
    )
    parser.add_argument(
        "--compile-steps",
        nargs="*",
        default=[],
        choices=sorted(SIZES["full"]),
        help="compile the full-size model's whole training step, with and without",
    )
    parser.add_argument("--check", type=timing.positive, nargs="*", default=[])
    parser.add_argument(
        "--repeats", type=timing.at_least_one, default=15, help="of each run-time measurement"
    )
    parser.add_argument(
        "--compile-repeats",
        type=timing.at_least_one,
        default=None,
        help="of each compile (3; 1 from 1000 leaves)",
    )
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    if args.leaves:
        print(_header("leaves", "adam compile (s)", args.scalers, "s", kernels=True))
    for n in args.leaves:
        r = compile_ratio(n, repeats=_compile_repeats(args, n), names=tuple(args.scalers))
        print(f"| {n} | {_row(r, args.scalers, '.2f', 1)}", flush=True)
    if args.leaves and args.parts:
        print()
        print(_header("leaves", "adam compile (s)", _PARTS, "s", kernels=True))
    for n in args.leaves if args.parts else ():
        r = parts_ratio(n, repeats=_compile_repeats(args, n))
        print(f"| {n} | {_row(r, _PARTS, '.2f', 1)}", flush=True)
    if args.compile_models:
        print()
        print(_header("model (leaves)", "adam compile (s)", args.scalers, "s", kernels=True))
    for family in args.compile_models:
        r = model_compile_ratio(family, repeats=args.compile_repeats or 3, names=args.scalers)
        print(f"| {family} ({r['leaves']}) | {_row(r, args.scalers, '.2f', 1)}", flush=True)
    if args.compile_steps:
        print()
        print(_header("training step", "adamw compile (s)", _STEP_PARTS, "s", kernels=True))
    for family in args.compile_steps:
        r = step_compile_ratio(family, repeats=args.compile_repeats or 3)
        print(f"| {family} | {_row(r, _STEP_PARTS, '.2f', 1)}", flush=True)
    if args.params:
        print()
        state = "state donated" if args.donate else "state not donated"
        print(_header(f"parameters (10 leaves, {state})", "adam step (ms)", args.scalers, "ms"))
    for p in args.params:
        r = step_ratio(int(p), repeats=args.repeats, names=tuple(args.scalers), donate=args.donate)
        print(f"| {int(p):.0e} | {_row(r, args.scalers, '.2f', 1e3)}", flush=True)
    if args.check:
        print()
        checks = list(_CHECKS)[1:]
        print(
            "| leaf size | pass (us) | "
            + " | ".join(checks)
            + f" | compile of {_CHECK_SIZES} sizes: pass (s) | "
            + " | ".join(checks)
            + " | mpjax uses |"
        )
        print("|---:" * (3 + 2 * len(checks)) + "|---|")
    for size in args.check:
        r = check_ratios(int(size), repeats=args.repeats)
        run = " | ".join(f"{r[name]:.3f}" for name in checks)
        build = " | ".join(f"{r[name + ' compile']:.3f}" for name in checks)
        print(
            f"| {int(size)} | {1e6 * r['pass_s']:.1f} | {run} "
            f"| {r['pass_compile_s']:.3f} | {build} | {r['used']} |",
            flush=True,
        )
    if args.models:
        print()
        print("| model | step ms adamw | step ms grad_scaler(adamw) | ratio |")
        print("|---|---|---|---|")
    for family in args.models:
        spec = SIZES[args.model_size][family]
        r = timing.scaler_overhead(spec, "autocast-f16", repeats=args.repeats, steps=10)
        print(
            f"| {family} {spec.describe()} | {1e3 * r['plain_s']:.2f} "
            f"| {1e3 * r['scaler_s']:.2f} | {r['ratio']:.3f} |",
            flush=True,
        )


def _compile_repeats(args, n: int) -> int:
    if args.compile_repeats is not None:
        return args.compile_repeats
    return 3 if n < 1000 else 1


def _header(first: str, base: str, names, unit: str, kernels: bool = False) -> str:
    cells = [first, base] + [c for name in names for c in (f"{name} ({unit})", "ratio")]
    cells += ["kernels"] if kernels else []
    return "| " + " | ".join(cells) + " |\n|" + "---:|" * len(cells)


def _row(r: dict, names, fmt: str, unit: float) -> str:
    cells = [format(unit * r["adam_s"], fmt)]
    for name in names:
        cells += [format(unit * r[f"{name}_s"], fmt), f"{r[f'{name}_ratio']:.3f}"]
    if "kernels" in r:  # adam's, then each wrapper's
        cells.append(" / ".join(map(str, r["kernels"])))
    return " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
