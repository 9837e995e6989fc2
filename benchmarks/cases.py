"""Small programs where 16 bits go wrong, each under autocast against float32 and
against the same program cast to 16 bits by hand, in one process.

    PYTHONPATH=. python -m benchmarks.cases [--json PATH]

Each case prints its figure for float32, autocast (default policy; ``lean`` where the
case is the lean policy's) and the hand-cast program, for float16 and bfloat16:

* ``integer-label cross-entropy``: the median relative error, over 64 confident
  examples, of the input gradient (each row) of
  ``optax.softmax_cross_entropy_with_integer_labels(x @ w, y)``;
* ``tied-embedding LM``: the relative L2 error of the embedding's gradient in a
  language model whose next token is one of a few (4032 of 4096 positions);
* ``Gaussian process``: the loss ``cholesky(x @ x.T + 0.01 I)`` gives;
* ``lean: bias of 1e5``: the loss of a regression whose bias is the target's mean;
* ``lean: summed log-decays``: the loss of a ``cumsum`` of log-decays (segment sums);
* ``lean: BatchNorm, inputs around 50``: the relative error of the first layer's
  kernel gradient;
* ``Flax fp8 layers, first step``: the relative L2 error of the parameter gradients
  of an MLP of Flax's fp8 products under autocast, without a loss scale and with
  ``scaled_value_and_grad`` at the default scale (no hand-cast program: the fp8
  products set their own precision).
"""

from __future__ import annotations

import argparse
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax

LOWS = (jnp.float16, jnp.bfloat16)


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def cross_entropy() -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    w, x = jax.random.normal(k1, (16, 10)), jax.random.normal(k2, (64, 16))
    y = jnp.argmax(x @ w, -1)
    x = 3.0 * x  # confident and right: a trained classifier's predictions

    def loss(x, w, cast=None):
        logits = x @ w if cast is None else (x.astype(cast) @ w.astype(cast)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    want = jax.grad(loss)(x, w)

    def err(g):
        rows = jnp.linalg.norm(g - want, axis=1) / jnp.linalg.norm(want, axis=1)
        return float(jnp.median(rows))

    return {
        jnp.dtype(d).name: {
            "autocast": err(jax.jit(jax.grad(mpjax.autocast(loss, dtype=d)))(x, w)),
            "hand-cast": err(jax.jit(jax.grad(lambda x, w: loss(x, w, d)))(x, w)),
        }
        for d in LOWS
    }


def tied_embedding() -> dict:
    k = jax.random.split(jax.random.key(0), 3)
    vocab, width, length = 50, 32, 4096
    ids = jnp.concatenate(
        [jnp.zeros(length - 64, jnp.int32), jax.random.randint(k[1], (64,), 0, vocab)]
    )
    targets = jnp.roll(ids, -1)
    params = {
        "emb": jax.random.normal(k[0], (vocab, width)) * 0.5,
        "w": jax.random.normal(k[2], (width, width)) * 0.2,
    }

    def loss(p, cast=None):
        emb = p["emb"] if cast is None else p["emb"].astype(cast)
        w = p["w"] if cast is None else p["w"].astype(cast)
        h = emb[ids]
        h = h + jnp.tanh(h @ w)
        logits = (h @ emb.T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum() / 64.0

    want = jax.grad(loss)(params)["emb"]
    return {
        jnp.dtype(d).name: {
            "autocast": _rel(jax.jit(jax.grad(mpjax.autocast(loss, dtype=d)))(params)["emb"], want),
            "hand-cast": _rel(jax.jit(jax.grad(lambda p: loss(p, d)))(params)["emb"], want),
        }
        for d in LOWS
    }


def gaussian_process() -> dict:
    k1, k2 = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(k1, (64, 4)), jax.random.normal(k2, (64,))

    def nll(x, cast=None):
        gram = x @ x.T if cast is None else (x.astype(cast) @ x.astype(cast).T).astype(x.dtype)
        chol = jnp.linalg.cholesky(gram + 1e-2 * jnp.eye(len(x)))
        fit = 0.5 * y @ jax.scipy.linalg.cho_solve((chol, True), y)
        return fit + jnp.sum(jnp.log(jnp.diag(chol)))

    out = {"float32": float(nll(x))}
    for d in LOWS:
        out[jnp.dtype(d).name] = {
            "autocast": float(jax.jit(mpjax.autocast(nll, dtype=d))(x)),
            "hand-cast": float(jax.jit(lambda x: nll(x, d))(x)),
        }
    return out


def lean_bias() -> dict:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x, y = jax.random.normal(k1, (256, 64)), 1e5 + 1e3 * jax.random.normal(k2, (256, 1))
    w, b = 0.05 * jax.random.normal(k3, (64, 1)), jnp.array([1e5])

    def mse(w, b, cast=None):
        pred = x @ w + b if cast is None else x.astype(cast) @ w.astype(cast) + b.astype(cast)
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    out = {"float32": float(mse(w, b))}
    for d in LOWS:
        out[jnp.dtype(d).name] = {
            "lean": float(mpjax.autocast(mse, dtype=d, policy="lean")(w, b)),
            "hand-cast": float(mse(w, b, d)),
        }
    return out


def lean_running_sum() -> dict:
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    x, w = jax.random.normal(k1, (4096, 32)), 0.1 * jax.random.normal(k2, (32, 1))
    r = jax.random.normal(k3, (4095,))

    def loss(w, cast=None):
        h = x @ w if cast is None else (x.astype(cast) @ w.astype(cast)).astype(jnp.float32)
        cs = jnp.cumsum(-jnp.abs(h[:, 0]))
        return jnp.sum(jnp.exp(cs[1:] - cs[:-1]) * r)

    out = {"float32": float(loss(w))}
    for d in LOWS:
        out[jnp.dtype(d).name] = {
            "lean": float(mpjax.autocast(loss, dtype=d, policy="lean")(w)),
            "hand-cast": float(loss(w, d)),
        }
    return out


class _DenseNorm(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, dtype=self.dtype)(x)
        h = nn.BatchNorm(use_running_average=False, dtype=self.dtype)(h)
        return nn.Dense(4, dtype=self.dtype)(h)


def lean_norm() -> dict:
    x = jax.random.normal(jax.random.key(0), (32, 16)) * 3 + 50.0
    model = _DenseNorm()
    variables = model.init(jax.random.key(1), x)

    def kernel_grad(apply):
        def loss(p):
            out = apply({**variables, "params": p}, x, mutable=["batch_stats"])[0]
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss))(variables["params"])["Dense_0"]["kernel"]

    want = kernel_grad(model.apply)
    out = {}
    for d in LOWS:
        out[jnp.dtype(d).name] = {
            "autocast": _rel(kernel_grad(mpjax.autocast(model.apply, dtype=d)), want),
            "lean": _rel(kernel_grad(mpjax.autocast(model.apply, dtype=d, policy="lean")), want),
            "hand-cast": _rel(kernel_grad(_DenseNorm(d).apply), want),
        }
    return out


class Fp8Mlp(nn.Module):
    """Two Dense layers whose products are Flax's fp8 `product` (None: plain ones)."""

    product: type | None = nn.Fp8DirectDotGeneralOp

    @nn.compact
    def __call__(self, x):
        product = {"dot_general_cls": self.product} if self.product else {}
        return nn.Dense(8, **product)(jax.nn.gelu(nn.Dense(64, **product)(x)))


def fp8_first_step() -> dict:
    x = 3.0 * jax.random.normal(jax.random.key(0), (64, 32))
    y = jax.random.normal(jax.random.key(2), (64, 8))
    variables = Fp8Mlp().init(jax.random.key(1), x)

    def loss(model):
        return lambda v: jnp.sum((model.apply(v, x) - y) ** 2)

    want = jax.grad(loss(Fp8Mlp(None)))({"params": variables["params"]})["params"]
    flat = lambda g: jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(g)])  # noqa: E731
    state = mpjax.grad_scaler(optax.sgd(0.1)).init(variables["params"])
    out = {}
    for d in LOWS:
        fp8 = mpjax.autocast(loss(Fp8Mlp()), dtype=d)
        scaled = mpjax.scaled_value_and_grad(fp8, state)(variables)[1]
        out[jnp.dtype(d).name] = {
            "no scaler": _rel(flat(jax.grad(fp8)(variables)["params"]), flat(want)),
            "grad_scaler": _rel(flat(scaled["params"]), flat(want)),
        }
    return out


CASES = {
    "integer-label cross-entropy": cross_entropy,
    "tied-embedding LM": tied_embedding,
    "Gaussian process": gaussian_process,
    "lean: bias of 1e5": lean_bias,
    "lean: summed log-decays": lean_running_sum,
    "lean: BatchNorm, inputs around 50": lean_norm,
    "Flax fp8 layers, first step": fp8_first_step,
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cases", description=__doc__)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    results = {name: case() for name, case in CASES.items()}
    for name, figures in results.items():
        print(name)
        for key, value in figures.items():
            row = value if isinstance(value, dict) else {"": value}
            print(f"  {key:<9}" + "".join(f"  {k} {v:.4g}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
