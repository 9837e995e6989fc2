import jax
import jax.numpy as jnp
import optax

import mpjax

keys = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(keys[0], (32, 8))

# 1. Two models trained from one loss: one scaler around both optimizers, so
#    both skip together and share one scale.
params = {"encoder": jax.random.normal(keys[1], (8, 4)) * 0.35,
          "decoder": jax.random.normal(keys[2], (4, 8)) * 0.5}


def autoencoder_loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["encoder"]) @ params["decoder"] - x) ** 2)


optimizer = mpjax.grad_scaler(optax.multi_transform(
    {"encoder": optax.adam(1e-2), "decoder": optax.sgd(1e-1)},
    {"encoder": "encoder", "decoder": "decoder"},
))
opt_state = optimizer.init(params)
loss = mpjax.autocast(autoencoder_loss)


@jax.jit
def step(params, opt_state, x):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for i in range(20):
    params, opt_state, value = step(params, opt_state, x)
print(f"autoencoder loss {value:.4f}")


# 2. Two models with their own losses (a GAN): one scaler per optimizer. Each
#    keeps its own scale in its own opt_state, and skips on its own overflows.
g_params = {"w": jax.random.normal(keys[3], (4, 8)) * 0.5}
d_params = {"w": jax.random.normal(keys[1], (8, 1)) * 0.35}


def generate(g_params, z):
    return jnp.tanh(z @ g_params["w"])


def d_loss_fn(d_params, g_params, real, z):
    fake = jax.lax.stop_gradient(generate(g_params, z))
    logits_real, logits_fake = real @ d_params["w"], fake @ d_params["w"]
    return (optax.sigmoid_binary_cross_entropy(logits_real, jnp.ones_like(logits_real)).mean()
            + optax.sigmoid_binary_cross_entropy(logits_fake, jnp.zeros_like(logits_fake)).mean())


def g_loss_fn(g_params, d_params, z):
    logits = generate(g_params, z) @ d_params["w"]
    return optax.sigmoid_binary_cross_entropy(logits, jnp.ones_like(logits)).mean()


g_opt, d_opt = mpjax.grad_scaler(optax.adam(1e-3)), mpjax.grad_scaler(optax.adam(1e-3))
g_state, d_state = g_opt.init(g_params), d_opt.init(d_params)
d_loss, g_loss = mpjax.autocast(d_loss_fn), mpjax.autocast(g_loss_fn)


@jax.jit
def gan_step(g_params, d_params, g_state, d_state, real, z):
    d_value, d_grads = mpjax.scaled_value_and_grad(d_loss, d_state)(d_params, g_params, real, z)
    d_updates, d_state = d_opt.update(d_grads, d_state, d_params)
    d_params = optax.apply_updates(d_params, d_updates)

    g_value, g_grads = mpjax.scaled_value_and_grad(g_loss, g_state)(g_params, d_params, z)
    g_updates, g_state = g_opt.update(g_grads, g_state, g_params)
    g_params = optax.apply_updates(g_params, g_updates)
    return g_params, d_params, g_state, d_state, d_value, g_value


for i in range(20):
    z = jax.random.normal(jax.random.key(i), (32, 4))
    g_params, d_params, g_state, d_state, d_value, g_value = gan_step(
        g_params, d_params, g_state, d_state, x, z)
print(f"discriminator loss {d_value:.4f} (scale {mpjax.get_scale(d_state)}), "
      f"generator loss {g_value:.4f} (scale {mpjax.get_scale(g_state)})")
