"""The backward pass's recomputation (benchmarks/recompute.py): what the gradient of
a `jax.checkpoint` region computes again, and what autocast's default policy
recomputes in a GPT (its GELUs, no matrix product)."""

import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

# `benchmarks/` sits beside `mpjax/` in the repository and is not installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
recompute = importlib.import_module("benchmarks.recompute")
SIZES = importlib.import_module("benchmarks.models").SIZES
variants = importlib.import_module("benchmarks.variants")

F32 = jnp.float32


def spec(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_nothing_is_recomputed_without_checkpoint():
    def loss(x, w):
        return jnp.tanh(x @ w).sum()

    r = recompute.recompute_report(loss, spec((4, 8)), spec((8, 8)))
    assert (r["recomputed_products"], r["recomputed_equations"], r["recomputed_bytes"]) == (0, 0, 0)


@pytest.mark.parametrize("jit", [False, True])
def test_an_elementwise_recomputation_is_counted_in_bytes(jit):
    # d/dx sin(x) * 2 = 2 cos(x): the backward pass computes cos(x) from the kept x,
    # reading n float32 values and writing n. sin itself is not needed again. A jit
    # inside the checkpointed function changes nothing.
    n = 1000

    def loss(x):
        f = jax.jit(jnp.sin) if jit else jnp.sin
        return jax.checkpoint(lambda x: f(x) * 2.0)(x).sum()

    r = recompute.recompute_report(loss, spec((n,)))
    assert r["recomputed_products"] == 0
    assert r["recomputed_by_primitive"] == {"cos": 8 * n}
    assert r["recomputed_bytes"] == 8 * n
    assert r["recomputed_boundary_bytes"] == 8 * n  # x in, cos(x) out: one equation


def test_a_recomputed_product_is_counted():
    def loss(x, w, policy=None):
        return jax.checkpoint(lambda x, w: jnp.tanh(x @ w), policy=policy)(x, w).sum()

    args = spec((4, 8)), spec((8, 16))
    r = recompute.recompute_report(loss, *args)
    assert r["recomputed_products"] == 1  # tanh's derivative needs x @ w again
    assert r["recomputed_by_primitive"]["dot_general"] == 4 * (4 * 8 + 8 * 16 + 4 * 16)
    saved = jax.checkpoint_policies.dots_saveable
    assert (
        recompute.recompute_report(lambda x, w: loss(x, w, saved), *args)["recomputed_products"]
        == 0
    )


def test_a_recomputation_in_a_scan_counts_once_per_iteration():
    n, steps = 100, 5

    def loss(x):
        body = jax.checkpoint(lambda c, _: (jnp.sin(c), None))
        return jax.lax.scan(body, x, None, length=steps)[0].sum()

    r = recompute.recompute_report(loss, spec((n,)))
    assert r["recomputed_by_primitive"] == {"cos": steps * 8 * n}


@pytest.mark.parametrize("name", ["autocast-bf16", "autocast-f16"])
def test_autocast_gpt_recomputes_its_gelus_and_no_product(name):
    gpt = SIZES["smoke"]["gpt"]
    c = gpt.config
    args = (*gpt.param_spec(), gpt.batch_spec())
    r = recompute.recompute_report(variants.value_fn(gpt, variants.VARIANTS[name]), *args)
    assert r["recomputed_products"] == 0
    # The default policy evaluates each MLP's tanh GELU in float32 from its 16-bit
    # input, under jax.checkpoint. Per element of that input the backward pass
    # computes again: its cast to float32 (reads 2 bytes, writes 4); the add
    # x + 0.044715 x**3 (reads 8, writes 4); and nine one-operand float32 equations
    # (8 each): x**3, x**2, 3 x**2, 0.044715 x**3, sqrt(2/pi) (...), tanh, the
    # 1 - tanh factor of its derivative, 1 + tanh, 0.5 (1 + tanh).
    per_element = 6 + 12 + 9 * 8
    gelu_inputs = c.layers * c.batch * c.seq_len * 4 * c.width
    # The causal mask's select runs in a checkpoint that keeps no broadcast: the
    # backward pass broadcasts the (T, T) mask again (reads a byte per mask
    # element, writes one per score) and makes zeros per score twice (its JVP's,
    # for the constant fill, and its transpose's), float32 ones: the fill,
    # float32's most negative number, is one no 16-bit dtype holds, so the select
    # computes in float32.
    scores = c.layers * c.batch * c.heads * c.seq_len**2
    mask = c.layers * c.seq_len**2 + scores + 2 * 4 * scores
    assert r["recomputed_bytes"] == gelu_inputs * per_element + mask > 0
    # As one kernel it reads the 16-bit input and writes the float32 values the
    # derivative needs (which of them depends on JAX's derivative rules).
    assert gelu_inputs * (2 + 4) <= r["recomputed_boundary_bytes"] < r["recomputed_bytes"]

    # The model cast by hand (Flax dtype=) recomputes nothing. Its float16 bias
    # gradients are 16-bit sums, which the suite's guard forbids: lifted for it.
    hand = variants.VARIANTS[variants.VARIANTS[name].baseline]
    with jax.allow_f16_reductions(True):
        base = recompute.recompute_report(variants.value_fn(gpt, hand), *args)
    assert (base["recomputed_products"], base["recomputed_bytes"]) == (0, 0)
