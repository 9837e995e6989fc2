import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import mpjax

mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def global_loss(params, x, y):
    # The mean over every device's shard: its gradient is the all-reduced one.
    return jax.lax.pmean(loss_fn(params, x, y), "data")


optimizer = mpjax.grad_scaler(optax.adam(1e-3), axis_name="data")  # one skip decision


def local_step(params, opt_state, x, y):
    _, grads = mpjax.scaled_value_and_grad(mpjax.autocast(global_loss), opt_state)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


step = jax.jit(jax.shard_map(local_step, mesh=mesh,
                             in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())))

params = {"w1": jax.random.normal(jax.random.key(0), (16, 32)) * 0.25,
          "w2": jax.random.normal(jax.random.key(1), (32, 4)) * 0.18}
opt_state = optimizer.init(params)
batch = 8 * jax.device_count()
for i in range(5):
    x = jax.random.normal(jax.random.key(i), (batch, 16))
    y = jax.random.randint(jax.random.key(i + 100), (batch,), 0, 4)
    params, opt_state = step(params, opt_state, x, y)
print(f"{jax.device_count()} devices, scale {mpjax.get_scale(opt_state)}")
