import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

import mpjax


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


x = jax.random.normal(jax.random.key(0), (64, 16))
y = jnp.sin(x[:, :1])
params = {"w1": jax.random.normal(jax.random.key(1), (16, 32)) * 0.25,
          "w2": jax.random.normal(jax.random.key(2), (32, 1)) * 0.18}
optimizer = mpjax.grad_scaler(optax.adam(1e-2), growth_interval=5)
opt_state = optimizer.init(params)
loss = mpjax.autocast(loss_fn)


@jax.jit
def step(params, opt_state, x, y):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for i in range(12):
    params, opt_state, value = step(params, opt_state, x, y)

# The scaler's state (scale, growth tracker, skip count) is part of opt_state:
# save opt_state and you have saved the scaler. There is no separate state_dict.
directory = Path(tempfile.mkdtemp()) / "checkpoints"
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(directory / "step_12", {"params": params, "opt_state": opt_state})
checkpointer.wait_until_finished()

# Restore into the same structure: build it abstractly, without allocating.
abstract = jax.eval_shape(lambda: {"params": params, "opt_state": optimizer.init(params)})
restored = checkpointer.restore(directory / "step_12", abstract)

print("scale before:", mpjax.get_scale(opt_state), "restored:", mpjax.get_scale(restored["opt_state"]))
assert mpjax.get_scale(restored["opt_state"]) == mpjax.get_scale(opt_state) == 2.0**16 * 4
assert jax.tree.all(jax.tree.map(jnp.array_equal, restored, {"params": params,
                                                             "opt_state": opt_state}))
shutil.rmtree(directory.parent)
