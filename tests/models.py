"""Small pure-JAX models the autocast tests run (float32 parameters)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _normal(rng, shape, scale=None):
    scale = (1.0 / shape[0]) ** 0.5 if scale is None else scale
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def mlp_init(rng, sizes=(12, 32, 32, 5)):
    return [dict(w=_normal(rng, (a, b)), b=jnp.zeros(b)) for a, b in zip(sizes[:-1], sizes[1:])]


def mlp_loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), -1))


def cnn_init(rng):
    return dict(
        c1=_normal(rng, (3, 3, 1, 8), 0.3),
        c2=_normal(rng, (3, 3, 8, 8), 0.1),
        scale=jnp.ones(8),
        w=_normal(rng, (8, 4)),
    )


def cnn_loss(params, x, y):
    dn = ("NHWC", "HWIO", "NHWC")
    h = lax.conv_general_dilated(x, params["c1"], (1, 1), "SAME", dimension_numbers=dn)
    h = jax.nn.gelu(h)
    h = lax.conv_general_dilated(h, params["c2"], (2, 2), "SAME", dimension_numbers=dn)
    h = jax.nn.standardize(h, axis=(1, 2)) * params["scale"]  # an instance norm
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    logits = jnp.mean(h, axis=(1, 2)) @ params["w"]
    return jnp.mean(
        jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]
    )


def block_init(rng, d=16, vocab=11):
    return dict(
        embed=_normal(rng, (vocab, d), 1.0),
        qkv=_normal(rng, (d, 3 * d)),
        proj=_normal(rng, (d, d)),
        up=_normal(rng, (d, 4 * d)),
        down=_normal(rng, (4 * d, d)),
        ln1=jnp.ones(d),
        ln2=jnp.ones(d),
        unembed=_normal(rng, (d, vocab)),
    )


def _layer_norm(x, scale, eps=1e-5):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * scale


def block_apply(params, tokens, heads=2):
    """One pre-norm transformer block with causal masked attention; returns logits."""
    x = params["embed"][tokens]  # [B, T, D]
    b, t, d = x.shape
    q, k, v = jnp.split(_layer_norm(x, params["ln1"]) @ params["qkv"], 3, -1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, -1e9)  # a float32 literal mask
    attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v).reshape(b, t, d)
    x = x + attn @ params["proj"]
    x = x + jax.nn.gelu(_layer_norm(x, params["ln2"]) @ params["up"]) @ params["down"]
    return x @ params["unembed"]


def block_loss(params, tokens):
    logits = block_apply(params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def rnn_init(rng, n_in=6, n_hidden=16):
    return dict(
        wx=_normal(rng, (n_in, n_hidden)),
        wh=_normal(rng, (n_hidden, n_hidden)),
        out=_normal(rng, (n_hidden, 1)),
    )


def rnn_loss(params, xs, y):
    def step(h, x):
        h = jnp.tanh(x @ params["wx"] + h @ params["wh"])
        return h, None

    h, _ = lax.scan(step, jnp.zeros((xs.shape[1], params["wh"].shape[0])), xs)
    return jnp.mean((h @ params["out"] - y) ** 2)


def moe_init(rng, d=16, hidden=32, experts=4):
    return dict(
        router=_normal(rng, (d, experts), 0.1),
        w_in=_normal(rng, (experts, d, hidden), d**-0.5),
        w_out=_normal(rng, (experts, hidden, d), hidden**-0.5),
    )


def moe_loss(params, x, y, k=2):
    """A mixture-of-experts layer: top-k routing, tokens sorted by expert and
    multiplied by their experts' weights with grouped products (``ragged_dot``),
    weighted results scattered back, and a load-balancing loss."""
    experts = params["router"].shape[1]
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    gate, choice = lax.top_k(probs, k)
    gate = gate / jnp.sum(gate, -1, keepdims=True)
    order = jnp.argsort(choice.reshape(-1))
    token = order // k
    sizes = jnp.bincount(choice.reshape(-1), length=experts).astype(jnp.int32)
    h = jax.nn.gelu(lax.ragged_dot(x[token], params["w_in"], sizes))
    out = lax.ragged_dot(h, params["w_out"], sizes) * gate.reshape(-1)[order][:, None]
    combined = jnp.zeros_like(x).at[token].add(out)
    first_choice = jnp.mean(jax.nn.one_hot(choice[:, 0], experts), 0)
    balance = experts * jnp.sum(jnp.mean(probs, 0) * first_choice)
    return jnp.mean((x + combined - y) ** 2) + 0.01 * balance


MODELS = {
    "mlp": mlp_loss,
    "cnn": cnn_loss,
    "transformer": block_loss,
    "rnn": rnn_loss,
    "moe": moe_loss,
}
"""Every model's loss, by name: `model_case` draws its parameters and data."""


@functools.cache
def model_case(name, seed=0):
    """(loss, params, inputs) of the model `name`, with small data, drawn by numpy
    (a `jax.random` draw outside jit is a compile of its own) when a test first
    asks. The CNN's max-pool and the MoE's top-k routing choose between values:
    on a draw that puts two of them within 16-bit rounding of each other, the
    choice can flip and the gradient flows elsewhere (seed 3's MoE in bfloat16),
    a property of the choice, not of the precision policy; seed 0 has none."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return _normal(rng, shape, 1.0)

    def integers(high, *shape):
        return jnp.asarray(rng.integers(0, high, shape), jnp.int32)

    params, inputs = {
        "mlp": lambda: (mlp_init(rng), (normal(8, 12), integers(5, 8))),
        "cnn": lambda: (cnn_init(rng), (normal(2, 8, 8, 1), jnp.array([1, 3]))),
        "transformer": lambda: (block_init(rng), (integers(11, 2, 9),)),
        "rnn": lambda: (rnn_init(rng), (normal(7, 4, 6), normal(4, 1))),
        "moe": lambda: (moe_init(rng), (normal(24, 16), normal(24, 16))),
    }[name]()
    return MODELS[name], params, inputs
