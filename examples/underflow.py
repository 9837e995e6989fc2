"""Underflow: why float16 training needs loss scaling.

float16's smallest positive number is 2**-24 (about 6e-8). Under `mpjax.autocast`
the backward pass's matrix products run in float16 too, so any gradient below that
becomes exactly 0 and its parameter stops learning. Nothing fails, nothing is
skipped, and the run simply learns little.

Here an MLP on scikit-learn's digits data is trained with SGD (momentum 0.9) on
its cross-entropy multiplied by a small weight (2**-20 by default), as when a term
of a multi-task loss is weighted down or a summed loss is normalised by a large
count. The learning rate is divided by the same weight, so in float32 the weighted
run is the unweighted run (an SGD step is linear in the gradient): only float16's
range sees the weight. Three runs, same seed and batches:

  float32                       the reference
  float16 autocast, no scaling  mpjax.static_scaler(sgd, 1.0): gradients as they come
  float16 autocast + scaler     mpjax.grad_scaler(sgd): the loss is multiplied by 2**16 first

The table gives test accuracy, the final (unweighted) training loss, the steps
skipped, and the share of gradient entries that came back exactly zero (float32
has some too: ReLUs that are off for the whole batch).

    python examples/underflow.py                        # ~30 seconds on 2 CPU cores
    python examples/underflow.py --loss-weight 6.1e-5   # 2**-14: milder, partial underflow
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm.auto import tqdm

import mpjax

MODES = ("float32", "float16-unscaled", "float16-scaled")
LABELS = {
    "float32": "float32",
    "float16-unscaled": "float16 autocast, no scaling",
    "float16-scaled": "float16 autocast + grad_scaler",
}


def load_data(seed: int):
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    return x_train, y_train.astype(np.int32), x_test, y_test.astype(np.int32)


def init_params(key, sizes=(64, 256, 256, 256, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) * (2.0 / a) ** 0.5, "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def cross_entropy(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def train(
    mode: str,
    data,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    loss_weight: float,
    seed: int,
    progress: bool = True,
) -> dict:
    x_train, y_train, x_test, y_test = data
    params = init_params(jax.random.key(seed))

    def weighted_loss(params, x, y):
        return loss_weight * cross_entropy(params, x, y)

    loss = weighted_loss if mode == "float32" else mpjax.autocast(weighted_loss)
    # The learning rate is divided by the weight: in float32 the weighted run is then
    # the unweighted run (SGD's update is linear in the gradient).
    sgd = optax.sgd(lr / loss_weight, momentum=0.9)
    if mode == "float16-scaled":
        tx = mpjax.grad_scaler(sgd)
    else:
        # A fixed scale of 1 is no scaling, but non-finite steps would still be
        # skipped and counted: the unscaled run skips none, it just loses gradients.
        tx = mpjax.static_scaler(sgd, 1.0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        leaves = jax.tree.leaves(grads)
        zeros = sum(jnp.sum(g == 0) for g in leaves) / sum(g.size for g in leaves)
        return optax.apply_updates(params, updates), opt_state, value / loss_weight, zeros

    rng = np.random.default_rng(seed)
    losses, zero_fractions = [], []
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc=f"{mode:>16}", disable=not progress, leave=False):
        idx = rng.integers(0, len(x_train), batch_size)
        params, opt_state, value, zeros = step(params, opt_state, x_train[idx], y_train[idx])
        losses.append(value)
        zero_fractions.append(zeros)
    losses = np.asarray(jax.device_get(losses))
    zero_fractions = np.asarray(jax.device_get(zero_fractions))
    seconds = time.perf_counter() - start

    logits = jax.jit(predict)(params, x_test)
    stats = mpjax.scaler_stats(opt_state)
    return {
        "mode": mode,
        "accuracy": float(np.mean(np.argmax(logits, -1) == y_test)),
        "final_loss": float(losses[-20:].mean()),
        "skipped_steps": int(stats["skipped_steps"]),
        "zero_grad_fraction": float(zero_fractions.mean()),
        "final_scale": float(stats["scale"]),
        "seconds": seconds,
        "losses": losses,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=500, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--lr",
        type=float,
        default=0.05,
        help="SGD learning rate of the unweighted loss (divided by the weight)",
    )
    parser.add_argument(
        "--loss-weight",
        type=float,
        default=2.0**-20,
        help="factor the cross-entropy is multiplied by",
    )
    parser.add_argument("--seed", type=int, default=0)
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
            loss_weight=args.loss_weight,
            seed=args.seed,
            progress=not args.no_progress,
        )
        for mode in MODES
    ]

    print(f"\nloss weight {args.loss_weight:g}, {args.steps} steps")
    print(
        f"{'run':<31} {'test acc':>8} {'final loss':>10} {'skipped':>7} "
        f"{'zero grads':>10} {'final scale':>11}"
    )
    for r in results:
        print(
            f"{LABELS[r['mode']]:<31} {r['accuracy']:>8.2%} {r['final_loss']:>10.4f} "
            f"{r['skipped_steps']:>7d} {r['zero_grad_fraction']:>10.1%} {r['final_scale']:>11g}"
        )
    return results


if __name__ == "__main__":
    main()
