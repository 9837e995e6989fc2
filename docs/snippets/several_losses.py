import jax
import jax.numpy as jnp
import optax

import mpjax


def forward(params, x):
    h = jax.nn.gelu(x @ params["trunk"])
    return h @ params["class_head"], h @ params["box_head"]


def loss_fn(params, x, labels, boxes):
    logits, box_pred = forward(params, x)
    classification = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    regression = optax.huber_loss(box_pred, boxes).mean()
    # One scalar to differentiate; the parts come back as aux, for logging.
    return classification + 0.5 * regression, {"classification": classification,
                                               "regression": regression}


keys = jax.random.split(jax.random.key(0), 5)
params = {"trunk": jax.random.normal(keys[0], (16, 64)) * 0.25,
          "class_head": jax.random.normal(keys[1], (64, 5)) * 0.125,
          "box_head": jax.random.normal(keys[2], (64, 4)) * 0.125}
x = jax.random.normal(keys[3], (32, 16))
labels = jnp.arange(32) % 5
boxes = jax.random.uniform(keys[4], (32, 4))

loss = mpjax.autocast(loss_fn)
optimizer = mpjax.grad_scaler(optax.adam(1e-2))
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state, x, labels, boxes):
    (value, parts), grads = mpjax.scaled_value_and_grad(loss, opt_state, has_aux=True)(
        params, x, labels, boxes)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, parts


for i in range(30):
    params, opt_state, value, parts = step(params, opt_state, x, labels, boxes)
print(f"loss {value:.4f}: classification {parts['classification']:.4f}, "
      f"regression {parts['regression']:.4f}")
