"""Debugging overflow and underflow: where a float16 step goes wrong, with `mpjax.diagnose`.

Two small Flax Linen models, each with a float16 problem that a training loop
would only report as "non-finite gradients, step skipped" or not at all:

  overflow   a regressor fed raw air-pressure readings, in pascals (about 1e5):
             beyond float16's 65504 before the first layer multiplies them, so
             every step is skipped whatever the loss scale.
  underflow  a classifier whose loss is weighted down (an auxiliary term, 2**-20),
             trained without loss scaling: most of its gradient is below float16's
             smallest subnormal and silently becomes 0.

`mpjax.diagnose` runs one training step of each, equation by equation, in float16
and in float32, prints its report (the first inf, the gradients lost to zero, the
range of each module, what to change) and saves each report's range chart.

    python examples/diagnose.py                   # the plots go to a temporary folder
    python examples/diagnose.py --plot-dir plots  # ~20 seconds on 2 CPU cores
"""

from __future__ import annotations

import argparse
import os
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import mpjax


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(2 * x.shape[-1], name="up")(nn.LayerNorm(name="norm")(x))
        return x + nn.Dense(x.shape[-1], name="down")(nn.gelu(h))


class Regressor(nn.Module):
    """Readings in, a value out; the readings are not normalised."""

    @nn.compact
    def __call__(self, readings):
        x = nn.Dense(64, name="embed")(readings)  # products in float16 under autocast
        for i in range(2):
            x = Block(name=f"block_{i}")(x)
        return nn.Dense(1, name="head")(nn.LayerNorm(name="norm")(x))[..., 0]


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="embed")(x))
        for i in range(2):
            x = Block(name=f"block_{i}")(x)
        return nn.Dense(10, name="head")(x)


def overflow_case(key):
    """Air pressure at 32 stations, in pascals: 101325 +- 3000."""
    k_x, k_y, k_init = jax.random.split(key, 3)
    readings = 101325.0 + 1000.0 * jax.random.normal(k_x, (64, 32))
    targets = jax.random.normal(k_y, (64,))
    model = Regressor()
    params = jax.jit(model.init)(k_init, readings)  # one compile, not one per operation

    def loss_fn(params, readings, targets):
        return jnp.mean((model.apply(params, readings) - targets) ** 2)

    return loss_fn, params, readings, targets


def underflow_case(key, weight: float):
    """A classification loss multiplied by a small weight."""
    k_x, k_y, k_init = jax.random.split(key, 3)
    x = jax.random.normal(k_x, (64, 20))
    labels = jax.random.randint(k_y, (64,), 0, 10)
    model = Classifier()
    params = jax.jit(model.init)(k_init, x)

    def loss_fn(params, x, labels):
        logits = model.apply(params, x)
        return weight * optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss_fn, params, x, labels


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--plot-dir", help="where the charts go (default: a temporary folder)")
    parser.add_argument(
        "--loss-weight", type=float, default=2.0**-20, help="the underflow case's loss weight"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    plot_dir = args.plot_dir or tempfile.mkdtemp(prefix="mpjax-diagnose-")
    os.makedirs(plot_dir, exist_ok=True)
    k1, k2 = jax.random.split(jax.random.key(args.seed))

    print("== overflow: raw pressure readings, float16, the default scale 2**16 ==\n")
    overflow = mpjax.diagnose(*overflow_case(k1))
    print(overflow)

    print("\n== underflow: a loss weighted by 2**-20, float16 and bfloat16, no loss scaling ==\n")
    # scale=1.0: the step as it runs without loss scaling (or with mpjax.noop_scaler).
    underflow = mpjax.diagnose(*underflow_case(k2, args.loss_weight), dtype="both", scale=1.0)
    print(underflow)

    plots = {}
    for name, report in [("overflow", overflow), ("underflow", underflow)]:
        plots[name] = os.path.join(plot_dir, f"diagnose_{name}.png")
        report.plot(plots[name])
    print(f"\nRange charts: {plots['overflow']}, {plots['underflow']}")
    return {"overflow": overflow, "underflow": underflow, "plots": plots}


if __name__ == "__main__":
    main()
