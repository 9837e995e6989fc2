"""Byte-level language model: a Flax Linen transformer in float32 and under autocast.

The text is Python's own standard library: the source files of a few dozen modules,
read from the running interpreter's `stdlib` directory (no download). A small
decoder-only transformer (Flax Linen: token and position embeddings, pre-norm
blocks with causal self-attention and a GELU MLP) learns to predict the next byte.
It is trained from the same seed on the same batches three ways:

  float32            the reference
  bfloat16 autocast  mpjax.autocast(model.apply, dtype=jnp.bfloat16)
  float16 autocast   mpjax.autocast(model.apply) + mpjax.grad_scaler

Linen models need no change: `mpjax.autocast(model.apply)` is a drop-in
replacement for `model.apply` that returns float32 logits. The summary table gives
each run's validation loss (nats per byte, on held-out text, evaluated the way the
run was trained) and its distance from float32's.

    python examples/char_lm.py                        # ~8 minutes on 2 idle CPU cores
    python examples/char_lm.py --steps 300 --layers 1 # a quick look
"""

from __future__ import annotations

import argparse
import functools
import os
import sysconfig
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import mpjax

MODES = ("float32", "bfloat16", "float16")
LABELS = {
    "float32": "float32",
    "bfloat16": "bfloat16 autocast",
    "float16": "float16 autocast + grad_scaler",
}

# Modules whose source makes up the corpus (those missing from a Python build are skipped).
STDLIB_FILES = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "decimal.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "pickle.py",
    "pprint.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "typing.py",
    "urllib/parse.py",
    "uuid.py",
    "zipfile.py",
)


def load_corpus(max_bytes: int, val_fraction: float):
    """The stdlib sources as uint8 bytes; the last `val_fraction` is held out."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in STDLIB_FILES:
        path = os.path.join(stdlib, name)
        if os.path.exists(path):  # zipfile.py is a package on newer Pythons
            with open(path, "rb") as f:
                chunks.append(f.read())
        elif os.path.exists(path[:-3] + "/__init__.py"):
            with open(path[:-3] + "/__init__.py", "rb") as f:
                chunks.append(f.read())
    data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)[:max_bytes]
    # A contiguous split: validation text (whole files, mostly) is never seen in training.
    split = int(len(data) * (1 - val_fraction))
    return data[:split], data[split:]


class Block(nn.Module):
    heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.mlp_ratio * x.shape[-1])(h)
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class ByteLM(nn.Module):
    """A decoder-only transformer over bytes (vocabulary 256)."""

    width: int = 128
    layers: int = 2
    heads: int = 4
    context: int = 64

    @nn.compact
    def __call__(self, tokens):
        t = tokens.shape[-1]
        x = nn.Embed(256, self.width)(tokens) + nn.Embed(self.context, self.width)(jnp.arange(t))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.heads)(x, mask)
        return nn.Dense(256)(nn.LayerNorm()(x))


def batch(data, rng, batch_size, context):
    """Random windows: inputs and the same windows shifted by one byte."""
    start = rng.integers(0, len(data) - context - 1, batch_size)
    idx = start[:, None] + np.arange(context + 1)
    window = data[idx].astype(np.int32)
    return window[:, :-1], window[:, 1:]


def train(mode: str, corpus, args) -> dict:
    train_data, val_data = corpus
    model = ByteLM(width=args.width, layers=args.layers, heads=args.heads, context=args.context)
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.context), jnp.int32))

    # The one change for mixed precision: model.apply under autocast. Its logits
    # come back float32, so the loss below is computed as in the float32 run.
    apply = model.apply
    if mode != "float32":
        low = jnp.float16 if mode == "float16" else jnp.bfloat16
        apply = mpjax.autocast(model.apply, dtype=low)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 20, args.steps)
    adamw = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    # float16 needs loss scaling; grad_scaler wraps the whole chain, so a skipped step
    # leaves clipping and adamw alike untouched. bfloat16 and float32 get the same
    # state layout from noop_scaler.
    tx = mpjax.grad_scaler(adamw) if mode == "float16" else mpjax.noop_scaler(adamw)
    opt_state = tx.init(params)

    # The parameters and the optimizer state are donated: XLA writes the new ones
    # over the old, so the step holds one copy of each.
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        value, grads = mpjax.scaled_value_and_grad(loss_fn, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(args.seed)  # the same batches in every run
    losses = []
    start = time.perf_counter()
    for _ in tqdm(range(args.steps), desc=f"{mode:>8}", disable=args.no_progress, leave=False):
        params, opt_state, value = step(
            params, opt_state, *batch(train_data, rng, args.batch_size, args.context)
        )
        losses.append(value)
    losses = np.asarray(jax.device_get(losses))
    seconds = time.perf_counter() - start

    # Validation on the same fixed windows for every run.
    eval_loss = jax.jit(loss_fn)
    val_rng = np.random.default_rng(12345)
    val = [
        float(eval_loss(params, *batch(val_data, val_rng, args.batch_size, args.context)))
        for _ in range(args.val_batches)
    ]
    stats = mpjax.scaler_stats(opt_state)
    return {
        "mode": mode,
        "val_loss": float(np.mean(val)),
        "final_loss": float(losses[-20:].mean()),
        "skipped_steps": int(stats["skipped_steps"]),
        "final_scale": float(stats["scale"]),
        "seconds": seconds,
        "losses": losses,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="bytes per training window")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size cap")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--val-batches", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    corpus = load_corpus(args.max_bytes, args.val_fraction)
    print(
        f"corpus: {len(corpus[0]):,} training bytes, {len(corpus[1]):,} validation bytes "
        f"from {sysconfig.get_paths()['stdlib']}"
    )
    results = [train(mode, corpus, args) for mode in args.modes]

    reference = next((r["val_loss"] for r in results if r["mode"] == "float32"), None)
    print(
        f"\n{'run':<31} {'val loss':>8} {'vs float32':>10} {'final loss':>10} "
        f"{'skipped':>7} {'final scale':>11} {'seconds':>7}"
    )
    for r in results:
        r["vs_float32"] = None if reference is None else r["val_loss"] / reference - 1
        diff = "" if r["vs_float32"] is None else f"{r['vs_float32']:+.2%}"
        print(
            f"{LABELS[r['mode']]:<31} {r['val_loss']:>8.4f} {diff:>10} {r['final_loss']:>10.4f} "
            f"{r['skipped_steps']:>7d} {r['final_scale']:>11g} {r['seconds']:>7.1f}"
        )
    return results


if __name__ == "__main__":
    main()
