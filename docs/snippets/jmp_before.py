import jax
import jax.numpy as jnp
import jmp
import optax

policy = jmp.get_policy("params=float32,compute=float16,output=float32")


def loss_fn(params, x, y):
    params, x = policy.cast_to_compute((params, x))   # everything to float16
    h = jax.nn.relu(x @ params["w1"])
    logits = policy.cast_to_output(h @ params["w2"])  # back to float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


params = {"w1": jax.random.normal(jax.random.key(0), (32, 64)) * 0.18,
          "w2": jax.random.normal(jax.random.key(1), (64, 10)) * 0.125}
x = jax.random.normal(jax.random.key(2), (16, 32))
y = jnp.arange(16) % 10

optimizer = optax.adamw(1e-3)
opt_state = optimizer.init(params)
loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**15))


@jax.jit
def step(params, opt_state, loss_scale, x, y):
    scaled_loss = lambda p: loss_scale.scale(loss_fn(p, x, y))
    value, grads = jax.value_and_grad(scaled_loss)(params)
    value, grads = loss_scale.unscale((value, grads))
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
        grads_finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale, value


for i in range(10):
    params, opt_state, loss_scale, value = step(params, opt_state, loss_scale, x, y)
print(f"loss {value:.4f}, scale {loss_scale.loss_scale}")
