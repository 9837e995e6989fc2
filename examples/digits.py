"""Digits: a Flax NNX CNN trained in float32, float16 and bfloat16 autocast.

The data are scikit-learn's bundled handwritten digits (1797 8x8 images, 10
classes; no download). One small convolutional network, written in Flax NNX with
BatchNorm and Dropout, is trained three times from the same seed, on the same
batches, for the same number of steps:

  float32            the reference
  float16 autocast   mpjax.autocast(loss) + mpjax.grad_scaler (float16 needs loss scaling)
  bfloat16 autocast  mpjax.autocast(loss, dtype=jnp.bfloat16) (float32's range: no scaling)

The mixed-precision runs differ from the float32 one in three lines: the loss is
wrapped in `mpjax.autocast`, the optax optimizer in `mpjax.grad_scaler`, and the
gradients come from `mpjax.scaled_value_and_grad`. The model, its BatchNorm
statistics, the dropout RNG and the `nnx.Optimizer` are used exactly as in
float32. The summary table gives test accuracy, final loss, steps skipped and the
final loss scale per run; a note says what the timings mean on this backend. A PNG
shows the loss curves, their difference from float32's (the curves overlap), and
the float16 run's loss scale over time.

    python examples/digits.py                 # 30 s to 1 minute on 2 CPU cores
    python examples/digits.py --steps 2000 --plot digits.png
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm.auto import tqdm

import mpjax

MODES = ("float32", "float16", "bfloat16")
LOW_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
LABELS = {
    "float32": "float32",
    "float16": "float16 autocast + grad_scaler",
    "bfloat16": "bfloat16 autocast",
}


def load_data(seed: int):
    """Images as NHWC float32 in [0, 1], split 75/25 with every class in both halves."""
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    return x_train, y_train.astype(np.int32), x_test, y_test.astype(np.int32)


class CNN(nnx.Module):
    """conv-BN-relu twice, 2x2 average pool, dropout, a linear classifier."""

    def __init__(self, rngs: nnx.Rngs, width: int = 32, dropout: float = 0.2):
        self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(2 * width, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 2 * width, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))  # 8x8 -> 4x4
        x = self.dropout(x.reshape(x.shape[0], -1))
        return self.head(x)


def loss_fn(model: CNN, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def train(
    mode: str,
    data,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    growth_interval: int,
    progress: bool = True,
) -> dict:
    """Trains one model; returns its accuracy, loss curve and scaler history."""
    x_train, y_train, x_test, y_test = data
    # Same seed in every run: same initial weights, dropout masks and batches.
    model = CNN(nnx.Rngs(params=seed, dropout=seed + 1))

    loss = loss_fn
    if mode != "float32":
        loss = mpjax.autocast(loss_fn, dtype=LOW_DTYPES[mode])  # the one line that matters
    # float16 needs loss scaling; bfloat16 has float32's exponent range and does not.
    # noop_scaler keeps one code path (and a scale of 1.0 to plot) for the others.
    # A short growth interval (torch's default is 2000) lets the plot show the scale
    # growing, overflowing and backing off within a short run.
    if mode == "float16":
        tx = mpjax.grad_scaler(optax.adam(lr), growth_interval=growth_interval)
    else:
        tx = mpjax.noop_scaler(optax.adam(lr))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        value, grads = mpjax.scaled_value_and_grad(loss, optimizer.opt_state)(model, x, y)
        optimizer.update(model, grads)  # skips the step if not finite
        stats = mpjax.scaler_stats(optimizer.opt_state)
        return value, stats["scale"], stats["last_step_skipped"]

    model.train()  # batch statistics, dropout on
    # nnx.jit re-splits the model on every call; cached_partial does that once.
    step = nnx.cached_partial(train_step, model, optimizer)

    rng = np.random.default_rng(seed)
    losses, scales, skipped = [], [], []
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc=f"{mode:>8}", disable=not progress, leave=False):
        idx = rng.integers(0, len(x_train), batch_size)
        value, scale, skip = step(x_train[idx], y_train[idx])
        losses.append(value)
        scales.append(scale)
        skipped.append(skip)
    losses, scales, skipped = (np.asarray(jax.device_get(v)) for v in (losses, scales, skipped))
    seconds = time.perf_counter() - start

    # Evaluated as trained: the mixed-precision models run under autocast here too.
    model.eval()  # BatchNorm running statistics, no dropout
    predict = nnx.jit(_predictor(mode))
    logits = np.asarray(predict(model, x_test))
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    test_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean())
    stats = mpjax.scaler_stats(optimizer.opt_state)
    return {
        "mode": mode,
        "accuracy": accuracy,
        "test_loss": test_loss,
        "final_loss": float(losses[-20:].mean()),
        "skipped_steps": int(stats["skipped_steps"]),
        "final_scale": float(stats["scale"]),
        "seconds": seconds,
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
    }


def _predictor(mode: str):
    forward = lambda model, x: model(x)
    if mode == "float32":
        return forward
    return mpjax.autocast(forward, dtype=LOW_DTYPES[mode])


def _smoothing_window(results: list[dict]) -> int:
    return max(1, len(results[0]["losses"]) // 50)  # smooth the per-batch noise


def _smooth(losses: np.ndarray, window: int) -> np.ndarray:
    return np.convolve(losses, np.ones(window) / window, mode="valid")


def curve_gaps(results: list[dict]) -> dict[str, float]:
    """Largest gap between each 16-bit run's smoothed loss curve and float32's."""
    by_mode = {r["mode"]: r for r in results}
    if "float32" not in by_mode:
        return {}
    window = _smoothing_window(results)
    ref = _smooth(by_mode["float32"]["losses"], window)
    return {
        mode: float(np.max(np.abs(_smooth(r["losses"], window) - ref)))
        for mode, r in by_mode.items()
        if mode != "float32"
    }


def speed_note(results: list[dict], backend: str) -> str:
    """What the `seconds` column means here, and what a GPU gives."""
    gpu = (
        "On a GPU with tensor cores (for float16 NVIDIA V100 and newer, for bfloat16 A100 "
        "and newer), 16-bit matrix products run several times faster than float32, and "
        "activations stored in 16 bits take half the memory."
    )
    if backend == "cpu":
        return (
            "On a CPU, 16 bits are no faster and usually slower: XLA's CPU backend computes "
            "float16 and bfloat16 matrix products and convolutions by converting to float32 and "
            "back, so the casts are pure overhead there (differences in the seconds column are "
            "that overhead, compilation and noise). " + gpu
        )
    by_mode = {r["mode"]: r for r in results}
    if "float32" not in by_mode:
        return gpu
    ratios = ", ".join(
        f"{mode} {by_mode['float32']['seconds'] / r['seconds']:.2f}x"
        for mode, r in by_mode.items()
        if mode != "float32"
    )
    return (
        f"Speed-up over float32 on this {backend.upper()}, compilation included: {ratios}. " + gpu
    )


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff, ax_scale) = plt.subplots(1, 3, figsize=(16, 4))
    window = _smoothing_window(results)
    steps = None
    for r in results:
        curve = _smooth(r["losses"], window)
        steps = np.arange(len(curve)) + window
        ax_loss.plot(steps, curve, label=LABELS[r["mode"]])
    ax_loss.set(
        xlabel="step",
        ylabel=f"training loss ({window}-step mean)",
        yscale="log",
        title="Training loss",
    )
    ax_loss.legend()

    # The three curves lie on top of one another; their differences show by how much.
    by_mode = {r["mode"]: r for r in results}
    if "float32" in by_mode:
        ref = _smooth(by_mode["float32"]["losses"], window)
        ax_diff.axhline(0.0, color="C0", label="float32")
        for i, r in enumerate(results):
            if r["mode"] != "float32":
                diff = _smooth(r["losses"], window) - ref
                ax_diff.plot(steps, diff, color=f"C{i}", label=LABELS[r["mode"]])
        gap = max(curve_gaps(results).values(), default=0.0)
        ax_diff.set_ylim(-1.5 * gap - 1e-6, 1.5 * gap + 1e-6)
        ax_diff.legend()
        ax_diff.set_title(
            f"Difference from float32: at most {gap:.2g}\n"
            f"(the loss itself goes from {ref[0]:.2g} to {ref[-1]:.2g})",
            fontsize="medium",
        )
    ax_diff.set(xlabel="step", ylabel=f"loss - float32 loss ({window}-step means)")
    for r in results:
        if r["mode"] != "float16":
            continue
        ax_scale.plot(r["scales"], color="C1", label="loss scale")
        where = np.flatnonzero(r["skipped"])
        ax_scale.scatter(
            where,
            r["scales"][where],
            color="C3",
            marker="x",
            zorder=3,
            label=f"skipped step, scale halved ({len(where)})",
        )
    ax_scale.set(
        xlabel="step", ylabel="scale", yscale="log", title="float16 loss scale (grad_scaler)"
    )
    ax_scale.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=600, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=50,
        help="grad_scaler: finite steps before the scale doubles",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--plot", default="digits.png", help="where the PNG goes")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    results = [
        train(
            mode,
            data,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            growth_interval=args.growth_interval,
            progress=not args.no_progress,
        )
        for mode in args.modes
    ]

    print(
        f"\n{'run':<31} {'test acc':>8} {'test loss':>9} {'final loss':>10} {'skipped':>7} "
        f"{'final scale':>11} {'seconds':>7}"
    )
    for r in results:
        print(
            f"{LABELS[r['mode']]:<31} {r['accuracy']:>8.2%} {r['test_loss']:>9.4f} "
            f"{r['final_loss']:>10.4f} "
            f"{r['skipped_steps']:>7d} {r['final_scale']:>11g} {r['seconds']:>7.1f}"
        )
    gaps = curve_gaps(results)
    if gaps:
        print(
            "\nLoss curves: largest gap to float32's "
            f"({_smoothing_window(results)}-step means): "
            + ", ".join(f"{mode} {gap:.4f}" for mode, gap in gaps.items())
        )
    print("\n" + textwrap.fill(speed_note(results, jax.default_backend()), width=88))
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return results


if __name__ == "__main__":
    main()
