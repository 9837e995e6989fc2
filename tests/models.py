"""Small pure-JAX models the autocast tests run (float32 parameters)."""

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _normal(key, shape, scale=None):
    scale = (1.0 / shape[0]) ** 0.5 if scale is None else scale
    return scale * jax.random.normal(key, shape, jnp.float32)


def mlp_init(key, sizes=(12, 32, 32, 5)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        dict(w=_normal(k, (a, b)), b=jnp.zeros(b)) for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp_loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), -1))


def cnn_init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return dict(
        c1=_normal(k1, (3, 3, 1, 8), 0.3),
        c2=_normal(k2, (3, 3, 8, 8), 0.1),
        scale=jnp.ones(8),
        w=_normal(k3, (8, 4)),
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


def block_init(key, d=16, vocab=11):
    ks = jax.random.split(key, 6)
    return dict(
        embed=_normal(ks[0], (vocab, d), 1.0),
        qkv=_normal(ks[1], (d, 3 * d)),
        proj=_normal(ks[2], (d, d)),
        up=_normal(ks[3], (d, 4 * d)),
        down=_normal(ks[4], (4 * d, d)),
        ln1=jnp.ones(d),
        ln2=jnp.ones(d),
        unembed=_normal(ks[5], (d, vocab)),
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


def rnn_init(key, n_in=6, n_hidden=16):
    k1, k2, k3 = jax.random.split(key, 3)
    return dict(
        wx=_normal(k1, (n_in, n_hidden)),
        wh=_normal(k2, (n_hidden, n_hidden)),
        out=_normal(k3, (n_hidden, 1)),
    )


def rnn_loss(params, xs, y):
    def step(h, x):
        h = jnp.tanh(x @ params["wx"] + h @ params["wh"])
        return h, None

    h, _ = lax.scan(step, jnp.zeros((xs.shape[1], params["wh"].shape[0])), xs)
    return jnp.mean((h @ params["out"] - y) ** 2)


def moe_init(key, d=16, hidden=32, experts=4):
    k1, k2, k3 = jax.random.split(key, 3)
    return dict(
        router=_normal(k1, (d, experts), 0.1),
        w_in=_normal(k2, (experts, d, hidden), d**-0.5),
        w_out=_normal(k3, (experts, hidden, d), hidden**-0.5),
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
def model_case(name):
    """(loss, params, inputs) of the model `name`, with small data. Drawn when a
    test first asks, not while pytest collects the tests (in every worker): each
    draw compiles."""
    k = jax.random.split(jax.random.key(0), 8)
    normal, randint = jax.random.normal, jax.random.randint
    params, inputs = {
        "mlp": lambda: (mlp_init(k[0]), (normal(k[1], (8, 12)), randint(k[2], (8,), 0, 5))),
        "cnn": lambda: (cnn_init(k[3]), (normal(k[4], (2, 8, 8, 1)), jnp.array([1, 3]))),
        "transformer": lambda: (block_init(k[5]), (randint(k[6], (2, 9), 0, 11),)),
        "rnn": lambda: (rnn_init(k[7]), (normal(k[1], (7, 4, 6)), normal(k[2], (4, 1)))),
        "moe": lambda: (moe_init(k[4]), (normal(k[5], (24, 16)), normal(k[6], (24, 16)))),
    }[name]()
    return MODELS[name], params, inputs
