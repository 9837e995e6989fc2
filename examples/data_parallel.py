"""Data parallel: the digits CNN trained over all local devices, against one device.

The model, data and float16 recipe are those of `examples/digits.py` (autocast +
grad_scaler, a Flax NNX CNN with BatchNorm and Dropout). The data-parallel run
places the batch on a device mesh, split along its first axis, with the model and
optimizer state replicated, and jits the *same* training step: XLA partitions it
and inserts the gradient all-reduce. Nothing in the step changes, and:

* the skip decision is global (the finite check reads the whole gradient), so
  every device skips the same steps and holds the same scale;
* BatchNorm statistics are over the whole batch, as on one device.

On a CPU the devices are simulated: this script asks XLA for 8 host devices
unless XLA_FLAGS already says otherwise.

    python examples/data_parallel.py               # about a minute on 2 CPU cores
    python examples/data_parallel.py --steps 600
"""

from __future__ import annotations

import argparse
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import mpjax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import CNN, load_data, loss_fn  # noqa: E402


def train(data, *, mesh, steps: int, batch_size: int, lr: float, seed: int) -> dict:
    """float16 autocast + grad_scaler training; data parallel when `mesh` is given."""
    x_train, y_train, x_test, y_test = data
    model = CNN(nnx.Rngs(params=seed, dropout=seed + 1))
    optimizer = nnx.Optimizer(model, mpjax.grad_scaler(optax.adam(lr)), wrt=nnx.Param)
    loss = mpjax.autocast(loss_fn)
    batch_sharding = None
    if mesh is not None:
        replicated = NamedSharding(mesh, P())
        batch_sharding = NamedSharding(mesh, P("data"))
        # Replicate every variable: parameters, BatchNorm statistics, RNG state
        # and the optimizer state (the scale included).
        for node in (model, optimizer):
            nnx.update(node, jax.device_put(nnx.state(node), replicated))

    @nnx.jit
    def train_step(model, optimizer, x, y):
        value, grads = mpjax.scaled_value_and_grad(
            loss, optimizer.opt_state, value_and_grad=nnx.value_and_grad
        )(model, x, y)
        optimizer.update(model, grads)
        return value

    model.train()
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x_train), batch_size)
        x, y = x_train[idx], y_train[idx]
        if batch_sharding is not None:
            x, y = jax.device_put((x, y), batch_sharding)
        value = train_step(model, optimizer, x, y)

    model.eval()
    logits = nnx.jit(mpjax.autocast(lambda m, x: m(x)))(model, x_test)
    stats = mpjax.scaler_stats(optimizer.opt_state)
    return {
        "accuracy": float(np.mean(np.argmax(np.asarray(logits), -1) == y_test)),
        "final_loss": float(value),
        "skipped_steps": int(stats["skipped_steps"]),
        "final_scale": float(stats["scale"]),
        "params": jax.device_get(nnx.state(model, nnx.Param)),
        "kernel_sharding": model.head.kernel[...].sharding,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch; a multiple of the device count"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    devices = jax.devices()
    if args.batch_size % len(devices):
        parser.error(
            f"--batch-size {args.batch_size} must be a multiple of the {len(devices)} devices"
        )
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    data = load_data(args.seed)
    kwargs = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    single = train(data, mesh=None, **kwargs)
    parallel = train(data, mesh=mesh, **kwargs)

    # Adam moves near-zero gradients by about the learning rate whatever their
    # size, so compare in norm: the two runs' distance against the distance trained.
    initial = nnx.state(CNN(nnx.Rngs(params=args.seed, dropout=args.seed + 1)), nnx.Param)
    norm = lambda tree: float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))
    between = norm(jax.tree.map(lambda a, b: a - b, single["params"], parallel["params"]))
    travelled = norm(jax.tree.map(lambda a, b: a - b, single["params"], initial))
    print(f"{'run':<28} {'test accuracy':>13} {'final loss':>10} {'skipped':>7} {'scale':>9}")
    for name, r in (("1 device", single), (f"{len(devices)} devices, data parallel", parallel)):
        print(
            f"{name:<28} {r['accuracy']:>13.2%} {r['final_loss']:>10.4f} "
            f"{r['skipped_steps']:>7d} {r['final_scale']:>9.0f}"
        )
    print(
        f"parameter difference between the runs: {between / travelled:.2%} of the distance trained"
    )
    return {
        "single": single,
        "parallel": parallel,
        "relative_param_diff": between / travelled,
        "devices": len(devices),
    }


if __name__ == "__main__":
    main()
