import jax
import jax.numpy as jnp

import mpjax


def layer(params, x):
    h = x @ params["w"] + params["b"]      # a float32 bias added to a matmul result
    return jnp.mean(jax.nn.gelu(h) ** 2)


params = {"w": jnp.ones((64, 256)) / 64, "b": jnp.zeros(256)}
x = jnp.ones((32, 64))

for policy in ("torch", "lean"):
    report = mpjax.audit(mpjax.autocast(layer, policy=policy), params, x)
    bias_add, tanh = report.find("add")[0], report.find("tanh")[0]
    print(f"{policy:>5}: bias add -> {bias_add.out_dtypes[0]}, gelu's tanh -> {tanh.out_dtypes[0]}")
    expected = "float32" if policy == "torch" else "float16"
    assert bias_add.out_dtypes == tanh.out_dtypes == (expected,)
