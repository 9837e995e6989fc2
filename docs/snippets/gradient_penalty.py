import jax
import jax.numpy as jnp
import optax

import mpjax


def critic(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def loss_fn(params, x, scale):
    # The gradient of the critic's output with respect to its input. As in
    # torch's recipe, differentiate the *scaled* output, so that the float16
    # backward pass does not underflow, then divide the scale out.
    scaled_input_grads = jax.grad(lambda x: jnp.sum(critic(params, x)) * scale)(x)
    input_grads = scaled_input_grads / scale
    penalty = jnp.mean((jnp.linalg.norm(input_grads, axis=-1) - 1.0) ** 2)
    return -jnp.mean(critic(params, x)) + 10.0 * penalty


keys = jax.random.split(jax.random.key(0), 3)
params = {"w1": jax.random.normal(keys[0], (8, 32)) * 0.35,
          "w2": jax.random.normal(keys[1], (32, 1)) * 0.18}
x = jax.random.normal(keys[2], (64, 8))

loss = mpjax.autocast(loss_fn)   # the penalty's own backward pass is autocast too
optimizer = mpjax.grad_scaler(optax.adam(1e-3))
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state, x):
    scale = mpjax.get_scale(opt_state)
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, scale)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for i in range(20):
    params, opt_state, value = step(params, opt_state, x)
print(f"loss {value:.4f}")
assert jnp.isfinite(value)
