"""The peer models: other people's models, each behind one small spec.

A `Peer` names a model, where it comes from, the optional packages it needs, and a
`build(batch_size)` that returns ``(loss_fn, params, batch)``:

* ``loss_fn(params, batch) -> scalar`` is the model's own training loss (taken from
  its example's training script where it has one), deterministic: dropout off, so
  that float32 and autocast compute the same function;
* ``params`` is a pytree of float32 arrays (what is differentiated);
* ``batch`` is a dict of arrays (random data of the model's input shapes; PRNG keys
  as raw ``uint32`` key data).

Everything is small: a couple of layers, narrow widths, short sequences. Weights are
random (from each library's own initializers); nothing is downloaded.

`GRAD_BATCH` is the batch the gradients are computed at (it runs on CPU);
`MEM_BATCH` is the batch the activation memory is measured at (only traced), large
enough that activations, not the 16-bit copies of weights, dominate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# transformers must never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

FLAX_COMMIT = "18f8f311c275d57f46d95e41b15aa97b454754c0"
EQUINOX_COMMIT = "9336d820b2ef66b360fc6cb3611b3da5cefbb14d"


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    source: str
    """Where the model code comes from: repository, path (and commit or version)."""
    requires: tuple[str, ...]
    """Importable modules needed beyond mpjax's own dependencies (jax, flax, optax)."""
    build: Callable[..., tuple[Callable, object, dict]]
    """``build(batch_size, seed=0)``: the loss, the parameters (the same for every
    seed) and a batch (`seed` picks which)."""
    grad_batch: int
    mem_batch: int
    note: str = ""

    def missing(self) -> list[str]:
        """The required modules that cannot be imported here."""
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def _data(stream: int, seed: int) -> int:
    """The seed of one of a batch's random streams: `seed` 0 is the batch every
    figure is measured on, others are further batches (``--batches``)."""
    return stream + 100 * seed


def _key(seed: int):
    """Legacy uint32[2] key data: an ordinary array for vjp and memory accounting."""
    return jax.random.key_data(jax.random.key(seed))


def _tokens(seed: int, batch: int, length: int, vocab: int):
    rng = np.random.default_rng(seed)
    # Token 0 is padding in the lm1b/gemma examples: draw from 1..vocab-1.
    return jnp.asarray(rng.integers(1, vocab, size=(batch, length)), jnp.int32)


def _images(seed: int, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# --------------------------------------------------------------------------
# google/flax examples (need only flax)


def build_lm1b(batch_size: int, seed: int = 0):
    """examples/lm1b: the decoder-only Linen transformer, its weighted cross-entropy."""
    from benchmarks.peers.flax_examples import lm1b_models as models
    from benchmarks.peers.flax_examples.train_losses import lm1b_compute_weighted_cross_entropy

    config = models.TransformerConfig(
        vocab_size=512,
        output_vocab_size=512,
        logits_via_embedding=True,  # the lm1b default config's choice
        emb_dim=64,
        num_heads=4,
        num_layers=2,
        qkv_dim=64,
        mlp_dim=256,
        max_len=64,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        deterministic=True,
    )
    model = models.TransformerLM(config)
    inputs = _tokens(_data(0, seed), batch_size, 32, config.vocab_size)
    params = model.init(jax.random.key(0), inputs[:1])["params"]

    def loss_fn(params, batch):
        # examples/lm1b/train.py's loss_fn
        inputs = batch["inputs"]
        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        logits = model.apply({"params": params}, inputs)
        loss, weight_sum = lm1b_compute_weighted_cross_entropy(logits, inputs, weights)
        return loss / weight_sum

    return loss_fn, params, {"inputs": inputs}


def build_imagenet_resnet(batch_size: int, seed: int = 0):
    """examples/imagenet: ResNet18 (narrow) with BatchNorm in training mode.

    The example's BatchNorm has ``axis_name='batch'`` (statistics averaged over the
    devices of a pmap). It runs here unmodified under ``jax.vmap(axis_name='batch')``
    over 2 simulated replicas, each with half the batch; the loss is the replicas'
    mean, as the example's pmean of gradients would make it.
    """
    from benchmarks.peers.flax_examples import imagenet_models as models
    from benchmarks.peers.flax_examples.train_losses import (
        imagenet_cross_entropy_loss,
        imagenet_weight_penalty,
    )

    replicas = 2
    assert batch_size % replicas == 0
    num_classes = 10
    model = models.ResNet18(num_classes=num_classes, num_filters=16)
    image = _images(_data(1, seed), (replicas, batch_size // replicas, 32, 32, 3))
    label = jnp.asarray(
        np.random.default_rng(_data(2, seed)).integers(
            0, num_classes, (replicas, batch_size // replicas)
        ),
        jnp.int32,
    )
    variables = jax.vmap(
        lambda x: model.init(jax.random.key(0), x, train=False), axis_name="batch"
    )(image[:, :1])
    variables = jax.tree.map(lambda v: v[0], variables)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def replica_loss(params, image, label, batch_stats):
        # examples/imagenet/train.py's loss_fn (new batch statistics dropped)
        logits, _ = model.apply(
            {"params": params, "batch_stats": batch_stats},
            image,
            mutable=["batch_stats"],
        )
        loss = imagenet_cross_entropy_loss(logits, label, num_classes)
        return loss + imagenet_weight_penalty(params)

    def loss_fn(params, batch):
        losses = jax.vmap(replica_loss, in_axes=(None, 0, 0, None), axis_name="batch")(
            params, batch["image"], batch["label"], batch["batch_stats"]
        )
        return jnp.mean(losses)

    return loss_fn, params, {"image": image, "label": label, "batch_stats": batch_stats}


def build_vae(batch_size: int, seed: int = 0):
    """examples/vae: the MLP VAE on 784-pixel binary images, BCE + KL."""
    from benchmarks.peers.flax_examples import vae_models as models
    from benchmarks.peers.flax_examples.train_losses import (
        binary_cross_entropy_with_logits,
        kl_divergence,
    )

    latents = 20
    model = models.model(latents)
    images = jnp.asarray(
        np.random.default_rng(_data(3, seed)).random((batch_size, 784)) > 0.5, jnp.float32
    )
    params = model.init(jax.random.key(0), images[:1], jax.random.key(1))["params"]

    def loss_fn(params, batch):
        # examples/vae/train.py's train_step.loss_fn
        z_rng = jax.random.wrap_key_data(batch["z_rng"])
        recon_x, mean, logvar = model.apply({"params": params}, batch["images"], z_rng)
        bce_loss = binary_cross_entropy_with_logits(recon_x, batch["images"]).mean()
        kld_loss = kl_divergence(mean, logvar).mean()
        return bce_loss + kld_loss

    return loss_fn, params, {"images": images, "z_rng": _key(_data(4, seed))}


def build_sst2(batch_size: int, seed: int = 0):
    """examples/sst2: embedding, bidirectional LSTM (nn.scan over OptimizedLSTMCell),
    keys-only MLP attention, sigmoid cross-entropy. Dropout and word dropout off."""
    from benchmarks.peers.flax_examples import sst2_models as models
    from benchmarks.peers.flax_examples.train_losses import sigmoid_cross_entropy_with_logits

    vocab, length = 1000, 24
    model = models.TextClassifier(
        embedding_size=64,
        hidden_size=64,
        vocab_size=vocab,
        output_size=1,
        dropout_rate=0.5,
        word_dropout_rate=0.1,
        unk_idx=1,
    )
    rng = np.random.default_rng(_data(5, seed))
    lengths = jnp.asarray(rng.integers(length // 2, length + 1, batch_size), jnp.int32)
    token_ids = _tokens(_data(6, seed), batch_size, length, vocab)
    token_ids = jnp.where(jnp.arange(length)[None] < lengths[:, None], token_ids, 0)
    label = jnp.asarray(rng.integers(0, 2, batch_size), jnp.float32)
    params = model.init(jax.random.key(0), token_ids[:1], lengths[:1], deterministic=True)["params"]

    def loss_fn(params, batch):
        # examples/sst2/train.py's train_step.loss_fn, deterministic
        logits = model.apply(
            {"params": params}, batch["token_ids"], batch["length"], deterministic=True
        )
        labels = batch["label"]
        if labels.ndim == 1:
            labels = jnp.expand_dims(labels, 1)
        return jnp.mean(sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))

    return loss_fn, params, {"token_ids": token_ids, "length": lengths, "label": label}


def build_gemma(batch_size: int, seed: int = 0):
    """examples/gemma: the NNX Gemma 3 transformer (local sliding + global attention,
    RoPE, QK-norm, RMSNorm, gated MLP, tied embeddings), 2 layers, tiny widths."""
    from flax import nnx

    from benchmarks.peers.flax_examples.gemma import transformer as transformer_lib
    from benchmarks.peers.flax_examples.gemma import transformer_cfg
    from benchmarks.peers.flax_examples.train_losses import gemma_compute_weighted_cross_entropy

    config = transformer_cfg.TransformerConfig.gemma3_1b(
        num_layers=2,
        num_embed=512,
        embed_dim=64,
        hidden_dim=256,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        sliding_window_size=16,
        attention_types=(
            transformer_cfg.AttentionType.LOCAL_SLIDING,
            transformer_cfg.AttentionType.GLOBAL,
        ),
    )
    model = transformer_lib.Transformer(config, rngs=nnx.Rngs(params=0))
    graphdef, params, nondiff = nnx.split(model, nnx.Param, ...)
    tokens = _tokens(_data(7, seed), batch_size, 33, config.num_embed)

    def loss_fn(params, batch):
        # examples/gemma/train.py's jax_train_step.loss_fn (no capture, no packing)
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        input_mask = inputs > 0
        weights = input_mask.astype(jnp.float32)
        attention_mask = transformer_lib.make_causal_attn_mask(input_mask)
        positions = transformer_lib.build_positions_from_mask(input_mask)
        module = nnx.merge(graphdef, params, nondiff)
        logits, _ = module(inputs, positions=positions, attention_mask=attention_mask, cache=None)
        return gemma_compute_weighted_cross_entropy(logits, targets, weights).mean()

    return loss_fn, params, {"tokens": tokens}


# --------------------------------------------------------------------------
# transformers (Flax models, random weights from a config)


def _lm_loss(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def build_hf_gpt2(batch_size: int, seed: int = 0):
    """transformers FlaxGPT2LMHeadModel, 2 layers, next-token cross-entropy."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(
        vocab_size=512,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = FlaxGPT2LMHeadModel(config, seed=0, _do_init=True)
    tokens = _tokens(_data(8, seed), batch_size, 33, config.vocab_size)

    def loss_fn(params, batch):
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        logits = model(inputs, params=params, train=False).logits
        return _lm_loss(logits, targets)

    return loss_fn, model.params, {"tokens": tokens}


def build_hf_vit(batch_size: int, seed: int = 0):
    """transformers FlaxViTForImageClassification, 2 layers, 32x32 images, patch 4."""
    import optax
    from transformers import FlaxViTForImageClassification, ViTConfig

    config = ViTConfig(
        image_size=32,
        patch_size=4,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    model = FlaxViTForImageClassification(config, seed=0, _do_init=True)
    pixels = _images(_data(9, seed), (batch_size, 3, 32, 32))
    labels = jnp.asarray(
        np.random.default_rng(_data(10, seed)).integers(0, 10, batch_size), jnp.int32
    )

    def loss_fn(params, batch):
        logits = model(batch["pixel_values"], params=params, train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return loss_fn, model.params, {"pixel_values": pixels, "labels": labels}


class _ClipShim(types.ModuleType):
    """``jax.numpy`` with a ``clip`` that still takes ``a_min``/``a_max``.

    transformers' Flax T5 calls ``jnp.clip(x, a_max=...)``, which jax 0.10 refuses.
    The shim is given to that one module (``modeling_flax_t5.jnp``), nothing else.
    """

    def __init__(self, inner):
        super().__init__("jax.numpy")
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def clip(self, x, a_min=None, a_max=None, *, min=None, max=None):
        return self._inner.clip(
            x, min if min is not None else a_min, max if max is not None else a_max
        )


def build_hf_t5(batch_size: int, seed: int = 0):
    """transformers FlaxT5ForConditionalGeneration, 2+2 layers, seq2seq cross-entropy.

    Needs the `jnp.clip` shim on jax >= 0.10 (applied to T5's module only)."""
    from transformers import FlaxT5ForConditionalGeneration, T5Config
    from transformers.models.t5 import modeling_flax_t5

    if not isinstance(modeling_flax_t5.jnp, _ClipShim):
        modeling_flax_t5.jnp = _ClipShim(jnp)
    config = T5Config(
        vocab_size=512,
        d_model=64,
        d_kv=16,
        d_ff=256,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = FlaxT5ForConditionalGeneration(config, seed=0, _do_init=True)
    src = _tokens(_data(11, seed), batch_size, 32, config.vocab_size)
    tgt = _tokens(_data(12, seed), batch_size, 16, config.vocab_size)

    def loss_fn(params, batch):
        labels = batch["labels"]
        decoder_input_ids = jnp.concatenate([jnp.zeros_like(labels[:, :1]), labels[:, :-1]], axis=1)
        logits = model(
            batch["input_ids"], decoder_input_ids=decoder_input_ids, params=params, train=False
        ).logits
        return _lm_loss(logits, labels)

    return loss_fn, model.params, {"input_ids": src, "labels": tgt}


# --------------------------------------------------------------------------
# equinox


def build_eqx_vit(batch_size: int, seed: int = 0):
    """equinox's vision_transformer example: eqx.nn.MultiheadAttention, LayerNorm,
    Linear under per-example vmap; 2 layers, 32x32 images, patch 4. Dropout off."""
    import equinox as eqx

    from benchmarks.peers.equinox_examples import vision_transformer as vit

    model = vit.VisionTransformer(
        embedding_dim=64,
        hidden_dim=256,
        num_heads=4,
        num_layers=2,
        dropout_rate=0.1,
        patch_size=4,
        num_patches=64,
        num_classes=10,
        key=jax.random.key(0),
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    images = _images(_data(13, seed), (batch_size, 3, 32, 32))
    labels = jnp.asarray(
        np.random.default_rng(_data(14, seed)).integers(0, 10, batch_size), jnp.int32
    )
    keys = jax.random.key_data(jax.random.split(jax.random.key(_data(15, seed)), batch_size))

    def loss_fn(params, batch):
        model = eqx.combine(params, static)
        key = jax.random.wrap_key_data(batch["keys"])
        return vit.loss_fn(model, batch["images"], batch["labels"], key, enable_dropout=False)

    return loss_fn, params, {"images": images, "labels": labels, "keys": keys}


# --------------------------------------------------------------------------

_FLAX = f"google/flax@{FLAX_COMMIT[:12]}"

PEERS: tuple[Peer, ...] = (
    Peer("flax-vae", f"{_FLAX} examples/vae/models.py", (), build_vae, 16, 512),
    Peer("flax-sst2-bilstm", f"{_FLAX} examples/sst2/models.py", (), build_sst2, 8, 128),
    Peer("flax-lm1b", f"{_FLAX} examples/lm1b/models.py", (), build_lm1b, 4, 64),
    Peer(
        "flax-imagenet-resnet18",
        f"{_FLAX} examples/imagenet/models.py",
        (),
        build_imagenet_resnet,
        8,
        64,
        note="BatchNorm(axis_name='batch') under jax.vmap(axis_name='batch'), 2 replicas",
    ),
    Peer("flax-gemma3-nnx", f"{_FLAX} examples/gemma/*.py", (), build_gemma, 4, 64),
    Peer(
        "hf-gpt2",
        "transformers 4.57.6 FlaxGPT2LMHeadModel",
        ("transformers",),
        build_hf_gpt2,
        4,
        64,
    ),
    Peer(
        "hf-vit",
        "transformers 4.57.6 FlaxViTForImageClassification",
        ("transformers",),
        build_hf_vit,
        8,
        128,
    ),
    Peer(
        "hf-t5",
        "transformers 4.57.6 FlaxT5ForConditionalGeneration",
        ("transformers",),
        build_hf_t5,
        4,
        64,
        note="jnp.clip(a_max=) shim in modeling_flax_t5 only",
    ),
    Peer(
        "eqx-vit",
        f"patrick-kidger/equinox@{EQUINOX_COMMIT[:12]} docs/examples/vision_transformer.ipynb",
        ("equinox", "jaxtyping"),
        build_eqx_vit,
        8,
        128,
    ),
)

BY_NAME = {p.name: p for p in PEERS}
