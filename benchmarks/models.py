"""The two benchmark models, written once in Flax Linen.

Each module takes a `dtype` attribute, the convention of Flax's own layers:

* ``dtype=None`` is the float32 model. The autocast variants run this very module
  under ``mpjax.autocast(model.apply, dtype=...)``.
* ``dtype=jnp.bfloat16`` (or float16), always with ``param_dtype=float32``, is the
  model cast by hand, the way an expert writes mixed precision in Flax: every layer
  computes in 16 bits, layer norms reduce in float32 internally, and the softmax of
  the attention is upcast to float32 and handed back in 16 bits.

Sizes live in `GPTConfig` / `ResNetConfig` and the `SIZES` table.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.compile_options import jit

Dtype = Any


# --------------------------------------------------------------------------
# GPT-style decoder


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    layers: int
    width: int
    heads: int
    seq_len: int
    vocab: int
    batch: int

    @property
    def items_per_step(self) -> int:
        """Tokens per training step."""
        return self.batch * self.seq_len


class CausalSelfAttention(nn.Module):
    heads: int
    dtype: Dtype = None

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        head_dim = d // self.heads
        qkv = nn.Dense(3 * d, dtype=self.dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.heads, head_dim), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim).astype(q.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        # The expert's habit: softmax in float32, the result handed on in 16 bits.
        # (A no-op in the float32 model, so autocast sees a plain softmax.)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(scores.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        return nn.Dense(d, dtype=self.dtype, name="proj")(out)


class DecoderBlock(nn.Module):
    heads: int
    dtype: Dtype = None

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        x = x + CausalSelfAttention(self.heads, self.dtype, name="attn")(
            nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        )
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(nn.Dense(4 * d, dtype=self.dtype, name="up")(h), approximate=True)
        return x + nn.Dense(d, dtype=self.dtype, name="down")(h)


class GPT(nn.Module):
    """A GPT-2-style pre-norm decoder with learned positions and an untied head."""

    config: GPTConfig
    dtype: Dtype = None

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        t = tokens.shape[-1]
        x = nn.Embed(cfg.vocab, cfg.width, dtype=self.dtype, name="wte")(tokens)
        x = x + nn.Embed(cfg.seq_len, cfg.width, dtype=self.dtype, name="wpe")(jnp.arange(t))
        for i in range(cfg.layers):
            x = DecoderBlock(cfg.heads, self.dtype, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(cfg.vocab, dtype=self.dtype, name="head")(x)


def gpt_batch_spec(cfg: GPTConfig) -> dict:
    shape = (cfg.batch, cfg.seq_len)
    return dict(
        inputs=jax.ShapeDtypeStruct(shape, jnp.int32),
        targets=jax.ShapeDtypeStruct(shape, jnp.int32),
    )


def gpt_batch(cfg: GPTConfig, key) -> dict:
    k1, k2 = jax.random.split(key)
    shape = (cfg.batch, cfg.seq_len)
    return dict(
        inputs=jax.random.randint(k1, shape, 0, cfg.vocab, jnp.int32),
        targets=jax.random.randint(k2, shape, 0, cfg.vocab, jnp.int32),
    )


# --------------------------------------------------------------------------
# ResNet-style CNN


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    stages: tuple[int, ...]  # residual blocks per stage; (2, 2, 2, 2) is ResNet-18
    width: int  # channels of the first stage, doubled per stage
    image: int  # square input images, 3 channels
    classes: int
    batch: int

    @property
    def items_per_step(self) -> int:
        """Images per training step."""
        return self.batch


def _norm(features: int, dtype: Dtype, name: str | None = None):
    # GroupNorm rather than BatchNorm keeps the training step a pure function of
    # (params, batch): no mutable batch statistics to thread through every variant.
    return nn.GroupNorm(num_groups=min(32, features), dtype=dtype, name=name)


class ResidualBlock(nn.Module):
    features: int
    strides: int
    dtype: Dtype = None

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, self.features, use_bias=False, dtype=self.dtype)
        y = nn.relu(_norm(self.features, self.dtype)(conv((3, 3), self.strides)(x)))
        y = _norm(self.features, self.dtype)(conv((3, 3))(y))
        if x.shape != y.shape:  # projection shortcut
            x = _norm(self.features, self.dtype)(conv((1, 1), self.strides)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A ResNet-18-style CNN (basic blocks, GroupNorm); a 3x3 stem for small images."""

    config: ResNetConfig
    dtype: Dtype = None

    @nn.compact
    def __call__(self, images):
        cfg = self.config
        large = cfg.image >= 64
        x = nn.Conv(
            cfg.width,
            (7, 7) if large else (3, 3),
            2 if large else 1,
            use_bias=False,
            dtype=self.dtype,
            name="stem",
        )(images)
        x = nn.relu(_norm(cfg.width, self.dtype)(x))
        if large:
            x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, blocks in enumerate(cfg.stages):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = ResidualBlock(cfg.width * 2**stage, strides, self.dtype)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.classes, dtype=self.dtype, name="head")(x)


def resnet_batch_spec(cfg: ResNetConfig) -> dict:
    return dict(
        inputs=jax.ShapeDtypeStruct((cfg.batch, cfg.image, cfg.image, 3), jnp.float32),
        targets=jax.ShapeDtypeStruct((cfg.batch,), jnp.int32),
    )


def resnet_batch(cfg: ResNetConfig, key) -> dict:
    k1, k2 = jax.random.split(key)
    return dict(
        inputs=jax.random.normal(k1, (cfg.batch, cfg.image, cfg.image, 3), jnp.float32),
        targets=jax.random.randint(k2, (cfg.batch,), 0, cfg.classes, jnp.int32),
    )


# --------------------------------------------------------------------------
# One interface for both


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family at one size."""

    family: str  # "gpt" or "resnet"
    config: GPTConfig | ResNetConfig

    @property
    def unit(self) -> str:
        return "tokens" if self.family == "gpt" else "images"

    def module(self, dtype: Dtype = None) -> nn.Module:
        cls = GPT if self.family == "gpt" else ResNet
        return cls(self.config, dtype=dtype)

    def batch_spec(self) -> dict:
        return (gpt_batch_spec if self.family == "gpt" else resnet_batch_spec)(self.config)

    def batch(self, key) -> dict:
        return (gpt_batch if self.family == "gpt" else resnet_batch)(self.config, key)

    def param_spec(self):
        """Parameter shapes (float32), without allocating them."""
        inputs = self.batch_spec()["inputs"]
        return jax.eval_shape(self.module().init, jax.random.key(0), inputs)

    @functools.lru_cache(maxsize=8)
    def init(self, seed: int = 0):
        """Float32 parameters (cached per size and seed: compiling init costs seconds)."""
        inputs = jnp.zeros(self.batch_spec()["inputs"].shape, self.batch_spec()["inputs"].dtype)
        return jit(self.module().init)(jax.random.key(seed), inputs)

    def describe(self) -> str:
        c = self.config
        if self.family == "gpt":
            return (
                f"GPT {c.layers}x{c.width}, {c.heads} heads, seq {c.seq_len}, "
                f"vocab {c.vocab}, batch {c.batch}"
            )
        return (
            f"ResNet stages {list(c.stages)}, width {c.width}, "
            f"{c.image}x{c.image} images, {c.classes} classes, batch {c.batch}"
        )


def cross_entropy(logits, targets):
    """Mean cross-entropy; logits are upcast first, as an expert writes the loss."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()


# Sizes per mode. "full" is GPT-2 small (12x768) and ResNet-18 at 224x224; the CPU
# measures that need only tracing or compiling use it. "runtime" is what the CPU can
# afford to *run* repeatedly (scaler overhead). "gpu" is sized to fill an 80 GB card
# in float32.
SIZES: dict[str, dict[str, ModelSpec]] = {
    "smoke": dict(
        gpt=ModelSpec("gpt", GPTConfig(layers=1, width=32, heads=2, seq_len=16, vocab=64, batch=2)),
        resnet=ModelSpec(
            "resnet", ResNetConfig(stages=(1, 1), width=8, image=16, classes=10, batch=2)
        ),
    ),
    "quick": dict(
        gpt=ModelSpec(
            "gpt", GPTConfig(layers=2, width=128, heads=4, seq_len=64, vocab=512, batch=4)
        ),
        resnet=ModelSpec(
            "resnet", ResNetConfig(stages=(1, 1, 1), width=16, image=32, classes=10, batch=4)
        ),
    ),
    "full": dict(
        gpt=ModelSpec(
            "gpt", GPTConfig(layers=12, width=768, heads=12, seq_len=1024, vocab=50304, batch=8)
        ),
        resnet=ModelSpec(
            "resnet", ResNetConfig(stages=(2, 2, 2, 2), width=64, image=224, classes=1000, batch=32)
        ),
    ),
    "runtime": dict(
        gpt=ModelSpec(
            "gpt", GPTConfig(layers=4, width=256, heads=4, seq_len=128, vocab=2048, batch=4)
        ),
        resnet=ModelSpec(
            "resnet", ResNetConfig(stages=(1, 1, 1), width=32, image=32, classes=10, batch=16)
        ),
    ),
    "gpu": dict(
        gpt=ModelSpec(
            "gpt", GPTConfig(layers=12, width=768, heads=12, seq_len=1024, vocab=50304, batch=8)
        ),
        resnet=ModelSpec(
            "resnet",
            ResNetConfig(stages=(2, 2, 2, 2), width=64, image=224, classes=1000, batch=256),
        ),
    ),
}
