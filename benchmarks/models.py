"""The benchmark models, written once in Flax Linen: a GPT, a ViT, and a ResNet with
GroupNorm or BatchNorm.

Each module takes a `dtype` attribute, the convention of Flax's own layers:

* ``dtype=None`` is the float32 model. The autocast variants run this very module
  under ``mpjax.autocast(model.apply, dtype=...)``.
* ``dtype=jnp.bfloat16`` (or float16), always with ``param_dtype=float32``, is the
  model cast by hand, the way an expert writes mixed precision in Flax: every layer
  computes in 16 bits, layer norms reduce in float32 internally, and the softmax of
  the attention is upcast to float32 and handed back in 16 bits.

Sizes live in `GPTConfig` / `ViTConfig` / `ResNetConfig` and the `SIZES` table.
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


class SelfAttention(nn.Module):
    heads: int
    dtype: Dtype = None
    causal: bool = True

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        head_dim = d // self.heads
        qkv = nn.Dense(3 * d, dtype=self.dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.heads, head_dim), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim).astype(q.dtype)
        if self.causal:
            mask = jnp.tril(jnp.ones((t, t), bool))
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        # The expert's habit: softmax in float32, the result handed on in 16 bits.
        # (A no-op in the float32 model, so autocast sees a plain softmax.)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(scores.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        return nn.Dense(d, dtype=self.dtype, name="proj")(out)


class Block(nn.Module):
    """A pre-norm transformer block: GPT's (causal attention, tanh GELU) or ViT's
    (attention over every token, exact GELU)."""

    heads: int
    dtype: Dtype = None
    causal: bool = True
    tanh_gelu: bool = True

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        x = x + SelfAttention(self.heads, self.dtype, self.causal, name="attn")(
            nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        )
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(nn.Dense(4 * d, dtype=self.dtype, name="up")(h), approximate=self.tanh_gelu)
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
            x = Block(cfg.heads, self.dtype, name=f"block{i}")(x)
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
# ViT-style encoder


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    layers: int
    width: int
    heads: int
    patch: int  # square patches of patch x patch pixels
    image: int  # square input images, 3 channels
    classes: int
    batch: int

    @property
    def items_per_step(self) -> int:
        """Images per training step."""
        return self.batch


class ViT(nn.Module):
    """A ViT-style encoder: patches embedded by a strided convolution, a class token and
    learned positions, pre-norm blocks with an exact GELU MLP, the class token to the head."""

    config: ViTConfig
    dtype: Dtype = None

    @nn.compact
    def __call__(self, images):
        cfg = self.config
        p = cfg.patch
        x = nn.Conv(cfg.width, (p, p), p, padding="VALID", dtype=self.dtype, name="patches")(images)
        b, h, w, d = x.shape
        cls = self.param("cls", nn.initializers.zeros, (1, 1, d))
        pos = self.param("pos", nn.initializers.normal(0.02), (1, h * w + 1, d))
        # Cast to the layers' dtype, as Flax's own layers cast their parameters.
        cls, pos = nn.dtypes.promote_dtype(cls, pos, dtype=self.dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)), x.reshape(b, h * w, d)], 1) + pos
        for i in range(cfg.layers):
            x = Block(cfg.heads, self.dtype, causal=False, tanh_gelu=False, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(cfg.classes, dtype=self.dtype, name="head")(x[:, 0])


# --------------------------------------------------------------------------
# ResNet-style CNN


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    stages: tuple[int, ...]  # residual blocks per stage; (2, 2, 2, 2) is ResNet-18
    width: int  # channels of the first stage, doubled per stage
    image: int  # square input images, 3 channels
    classes: int
    batch: int
    norm: str = "group"  # "group": GroupNorm; "batch": BatchNorm in training mode

    @property
    def items_per_step(self) -> int:
        """Images per training step."""
        return self.batch


def _norm(features: int, norm: str, dtype: Dtype):
    if norm == "batch":
        # Normalizes by the batch's statistics and updates their running averages,
        # the mutable `batch_stats` collection the training step threads through.
        return nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=dtype)
    return nn.GroupNorm(num_groups=min(32, features), dtype=dtype)


class ResidualBlock(nn.Module):
    features: int
    strides: int
    norm: str = "group"
    dtype: Dtype = None

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, self.features, use_bias=False, dtype=self.dtype)
        norm = functools.partial(_norm, self.features, self.norm, self.dtype)
        y = nn.relu(norm()(conv((3, 3), self.strides)(x)))
        y = norm()(conv((3, 3))(y))
        if x.shape != y.shape:  # projection shortcut
            x = norm()(conv((1, 1), self.strides)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A ResNet-18-style CNN (basic blocks, GroupNorm or BatchNorm); a 3x3 stem for small
    images."""

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
        x = nn.relu(_norm(cfg.width, cfg.norm, self.dtype)(x))
        if large:
            x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, blocks in enumerate(cfg.stages):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = ResidualBlock(cfg.width * 2**stage, strides, cfg.norm, self.dtype)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.classes, dtype=self.dtype, name="head")(x)


def image_batch_spec(cfg: ResNetConfig | ViTConfig) -> dict:
    return dict(
        inputs=jax.ShapeDtypeStruct((cfg.batch, cfg.image, cfg.image, 3), jnp.float32),
        targets=jax.ShapeDtypeStruct((cfg.batch,), jnp.int32),
    )


def image_batch(cfg: ResNetConfig | ViTConfig, key) -> dict:
    k1, k2 = jax.random.split(key)
    return dict(
        inputs=jax.random.normal(k1, (cfg.batch, cfg.image, cfg.image, 3), jnp.float32),
        targets=jax.random.randint(k2, (cfg.batch,), 0, cfg.classes, jnp.int32),
    )


# --------------------------------------------------------------------------
# One interface for all


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family at one size.

    The model's variables are split in two: `params`, what the optimizer trains,
    and `state`, the collections the training forward pass updates (`mutable`:
    BatchNorm's ``batch_stats``), an empty dict for a model without any.
    """

    family: str  # a key of the SIZES tables: "gpt", "vit", "resnet", "resnet_bn"
    config: GPTConfig | ViTConfig | ResNetConfig

    @property
    def unit(self) -> str:
        return "tokens" if isinstance(self.config, GPTConfig) else "images"

    def module(self, dtype: Dtype = None) -> nn.Module:
        cls = {GPTConfig: GPT, ViTConfig: ViT, ResNetConfig: ResNet}[type(self.config)]
        return cls(self.config, dtype=dtype)

    def batch_spec(self) -> dict:
        tokens = isinstance(self.config, GPTConfig)
        return (gpt_batch_spec if tokens else image_batch_spec)(self.config)

    def batch(self, key) -> dict:
        tokens = isinstance(self.config, GPTConfig)
        return (gpt_batch if tokens else image_batch)(self.config, key)

    @functools.lru_cache(maxsize=32)
    def _variable_spec(self) -> dict:
        inputs = self.batch_spec()["inputs"]
        return jax.eval_shape(self.module().init, jax.random.key(0), inputs)

    @property
    def mutable(self) -> tuple[str, ...]:
        """The variable collections other than ``params``: updated, not trained."""
        return tuple(name for name in self._variable_spec() if name != "params")

    def split(self, variables: dict) -> tuple[dict, dict]:
        """``(params, state)`` of the variables ``module().init`` returns."""
        params = {k: v for k, v in variables.items() if k not in self.mutable}
        return params, {k: variables[k] for k in self.mutable}

    def param_spec(self) -> tuple[dict, dict]:
        """Shapes (float32) of ``(params, state)``, without allocating them."""
        return self.split(self._variable_spec())

    @functools.lru_cache(maxsize=8)
    def init(self, seed: int = 0) -> tuple[dict, dict]:
        """Float32 ``(params, state)`` (cached per size and seed: compiling init costs
        seconds)."""
        inputs = jnp.zeros(self.batch_spec()["inputs"].shape, self.batch_spec()["inputs"].dtype)
        return self.split(jit(self.module().init)(jax.random.key(seed), inputs))

    def describe(self) -> str:
        c = self.config
        if isinstance(c, GPTConfig):
            return (
                f"GPT {c.layers}x{c.width}, {c.heads} heads, seq {c.seq_len}, "
                f"vocab {c.vocab}, batch {c.batch}"
            )
        images = f"{c.image}x{c.image} images, {c.classes} classes, batch {c.batch}"
        if isinstance(c, ViTConfig):
            return f"ViT {c.layers}x{c.width}, {c.heads} heads, patch {c.patch}, {images}"
        norm = {"group": "GroupNorm", "batch": "BatchNorm"}[c.norm]
        return f"ResNet stages {list(c.stages)}, width {c.width}, {norm}, {images}"


def cross_entropy(logits, targets):
    """Mean cross-entropy; logits are upcast first, as an expert writes the loss."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()


# Sizes per mode. "full" is GPT-2 small (12x768), a 6-layer ViT-S/16 and ResNet-18 at
# 224x224; the CPU measures that need only tracing or compiling use it. "runtime" is
# what the CPU can afford to *run* repeatedly (scaler overhead). "gpu" is sized to fill
# an 80 GB card in float32. "resnet_bn" is "resnet" with BatchNorm, at the same sizes.


def _sizes(gpt: GPTConfig, vit: ViTConfig, resnet: ResNetConfig) -> dict[str, ModelSpec]:
    return dict(
        gpt=ModelSpec("gpt", gpt),
        vit=ModelSpec("vit", vit),
        resnet=ModelSpec("resnet", resnet),
        resnet_bn=ModelSpec("resnet_bn", dataclasses.replace(resnet, norm="batch")),
    )


SIZES: dict[str, dict[str, ModelSpec]] = {
    "smoke": _sizes(
        GPTConfig(layers=1, width=32, heads=2, seq_len=16, vocab=64, batch=2),
        ViTConfig(layers=1, width=32, heads=2, patch=4, image=16, classes=10, batch=2),
        ResNetConfig(stages=(1, 1), width=8, image=16, classes=10, batch=2),
    ),
    "quick": _sizes(
        GPTConfig(layers=2, width=128, heads=4, seq_len=64, vocab=512, batch=4),
        ViTConfig(layers=2, width=128, heads=4, patch=4, image=32, classes=10, batch=4),
        ResNetConfig(stages=(1, 1, 1), width=16, image=32, classes=10, batch=4),
    ),
    "full": _sizes(
        GPTConfig(layers=12, width=768, heads=12, seq_len=1024, vocab=50304, batch=8),
        ViTConfig(layers=6, width=384, heads=6, patch=16, image=224, classes=1000, batch=32),
        ResNetConfig(stages=(2, 2, 2, 2), width=64, image=224, classes=1000, batch=32),
    ),
    "runtime": _sizes(
        GPTConfig(layers=4, width=256, heads=4, seq_len=128, vocab=2048, batch=4),
        ViTConfig(layers=4, width=256, heads=4, patch=4, image=32, classes=10, batch=8),
        ResNetConfig(stages=(1, 1, 1), width=32, image=32, classes=10, batch=16),
    ),
    "gpu": _sizes(
        GPTConfig(layers=12, width=768, heads=12, seq_len=1024, vocab=50304, batch=8),
        ViTConfig(layers=6, width=384, heads=6, patch=16, image=224, classes=1000, batch=256),
        ResNetConfig(stages=(2, 2, 2, 2), width=64, image=224, classes=1000, batch=256),
    ),
}
