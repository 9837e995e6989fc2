import time

import jax
import jax.numpy as jnp

import mpjax


def loss_fn(w, x):
    for _ in range(4):
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


w, x = jnp.full((32, 32), 0.05), jnp.ones((8, 32))
eager = jax.grad(mpjax.autocast(loss_fn))           # traced and re-evaluated every call
compiled = jax.jit(jax.grad(mpjax.autocast(loss_fn)))  # traced once, then compiled code
compiled(w, x).block_until_ready()                  # the first call compiles

for name, fn in [("eager", eager), ("jit", compiled)]:
    start = time.perf_counter()
    for _ in range(10):
        fn(w, x).block_until_ready()
    print(f"{name:>5}: {(time.perf_counter() - start) / 10 * 1e3:.2f} ms per call")
