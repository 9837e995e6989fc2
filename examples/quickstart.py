"""Quickstart: one classifier trained in float32 and under mpjax.autocast.

The data are scikit-learn's bundled handwritten digits (8x8 images, 10 classes; no
download). The same model, seed and steps are trained three ways and the test
accuracy of each is printed side by side:

  float32           the reference
  float16 autocast  autocast(loss) + mpjax.grad_scaler (float16 needs loss scaling)
  bfloat16 autocast autocast(loss, dtype=jnp.bfloat16) (float32's range: no scaling)

    python examples/quickstart.py
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import mpjax


def load_data(seed):
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    return jnp.asarray(x_train), jnp.asarray(y_train), jnp.asarray(x_test), jnp.asarray(y_test)


def init_params(key, sizes=(64, 256, 256, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [dict(w=jax.random.normal(k, (a, b)) * (2.0 / a) ** 0.5, b=jnp.zeros(b))
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def train(mode, data, steps, batch_size, seed):
    x_train, y_train, x_test, y_test = data
    params = init_params(jax.random.key(seed))
    optimizer = optax.adam(1e-3)
    if mode == "float32":
        loss = loss_fn
    else:
        dtype = jnp.float16 if mode == "float16" else jnp.bfloat16
        loss = mpjax.autocast(loss_fn, dtype=dtype)        # the one line that matters
        if dtype == jnp.float16:
            optimizer = mpjax.grad_scaler(optimizer)          # and loss scaling for float16
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        if mode == "float16":
            value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
        else:
            value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for _ in range(steps):
        idx = rng.integers(0, x_train.shape[0], batch_size)
        params, opt_state, value = step(params, opt_state, x_train[idx], y_train[idx])
    value = float(value)
    seconds = time.perf_counter() - start
    accuracy = float(jnp.mean(jnp.argmax(predict(params, x_test), -1) == y_test))
    return dict(mode=mode, accuracy=accuracy, loss=value, seconds=seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    results = [train(mode, data, args.steps, args.batch_size, args.seed)
               for mode in ("float32", "float16", "bfloat16")]
    print(f"{'run':<18} {'test accuracy':>13} {'final loss':>10} {'seconds':>8}")
    for r in results:
        name = r["mode"] if r["mode"] == "float32" else f"{r['mode']} autocast"
        print(f"{name:<18} {r['accuracy']:>13.2%} {r['loss']:>10.4f} {r['seconds']:>8.1f}")
    return results


if __name__ == "__main__":
    main()
