import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import mpjax

# One mesh axis over every device; batches are split along it, parameters and
# optimizer state (the loss scale included) are replicated. Auto axes: the
# compiler propagates the shardings through the step.
mesh = jax.make_mesh((jax.device_count(),), ("data",),
                     axis_types=(jax.sharding.AxisType.Auto,))
replicated = NamedSharding(mesh, P())
batch_sharded = NamedSharding(mesh, P("data"))


def loss_fn(params, x, y):
    h = jax.nn.gelu(x @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


params = {"w1": jax.random.normal(jax.random.key(0), (32, 64)) * 0.18,
          "w2": jax.random.normal(jax.random.key(1), (64, 10)) * 0.125}
optimizer = mpjax.grad_scaler(optax.adamw(1e-3))
params = jax.device_put(params, replicated)
opt_state = jax.device_put(optimizer.init(params), replicated)
loss = mpjax.autocast(loss_fn)


@jax.jit
def step(params, opt_state, x, y):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    # Under jit the finite check sees the whole (global) gradients, so every
    # device makes the same skip decision.
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


batch = 8 * jax.device_count()
for i in range(10):
    x = jax.random.normal(jax.random.key(i), (batch, 32))
    y = jax.random.randint(jax.random.key(i + 100), (batch,), 0, 10)
    x, y = jax.device_put((x, y), batch_sharded)
    params, opt_state, value = step(params, opt_state, x, y)
print(f"{jax.device_count()} devices, loss {value:.4f}, scale {mpjax.get_scale(opt_state)}")
assert params["w1"].sharding.is_fully_replicated
