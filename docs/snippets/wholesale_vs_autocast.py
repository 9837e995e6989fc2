import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax


def cast(tree, dtype):  # what jmp's policy.cast_to_compute and cast_to_output do
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def wholesale(f):  # jmp's policy: params and inputs to float16, the output to float32
    return lambda *args: cast(f(*cast(args, jnp.float16)), jnp.float32)


def errors(f, *args):
    """The error of f's result against float32 (norm-wise, relative): run wholesale
    in float16, and under autocast."""
    ref = np.asarray(f(*args), np.float64)
    return [float(np.linalg.norm(np.asarray(jax.jit(g)(*args), np.float64) - ref)
                  / np.linalg.norm(ref)) for g in (wholesale(f), mpjax.autocast(f))]


def loss(w, x, y):  # a 1000-class classifier's loss
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()


def float16_values(a):  # both runs start from the same numbers
    return cast(cast(a, jnp.float16), jnp.float32)


k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
w = float16_values(0.1 * jax.random.normal(k1, (512, 1000)))
x = float16_values(jax.random.normal(k2, (256, 512)))
y = jnp.arange(256) % 1000
h = float16_values(8 + jax.random.normal(k3, (8, 4096)))  # activations, mean 8, std 1
u = jax.random.uniform(k4, (2**18,))

results = {
    "softmax of 4096 logits": errors(jax.nn.softmax, 4 * h),
    "layer norm (jax.nn.standardize)": errors(jax.nn.standardize, h),
    "cross-entropy of x @ w": errors(loss, w, x, y),
    "its gradient": errors(jax.grad(loss), w, x, y),
    "sum of 2**18 values in [0, 1)": errors(jnp.sum, u),
}
print(f"{'':32s} {'wholesale':>10s} {'autocast':>10s}")
for name, (whole, auto) in results.items():
    print(f"{name:32s} {whole:10.1e} {auto:10.1e}")

sm, ln, ce, grad, total = results.values()
assert sm[0] > 1e3 * sm[1] and ce[0] > 30 * ce[1]  # float32 softmax and loss
assert ln[0] > 1e-2 and total[0] == np.inf          # cancellation; the sum passes 65504
assert 0.5 < grad[0] / grad[1] < 2                  # float16 backward products in both
