"""The peer-model benchmark harness on its cheapest peer (a Flax example: needs only flax)."""

import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("flax")

# `benchmarks/` sits beside `mpjax/` in the repository and is not installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.peers import harness
from benchmarks.peers.models import BY_NAME

CHEAP = ("flax-vae",)


@pytest.fixture(scope="module")
def results():
    return [harness.run_peer(BY_NAME[name], harness.QUICK_VARIANTS, batches=3) for name in CHEAP]


def test_numbers_are_finite_and_close(results):
    for res in results:
        assert res["status"] == "ok", res["status"]
        rows = {r["variant"]: r for r in res["rows"]}
        assert set(rows) == set(harness.QUICK_VARIANTS)
        for variant, r in rows.items():
            assert r["status"] == "ok", (variant, r["status"])
            assert r["grads_finite"], variant
            for key in ("residual_bytes", "loss", "grad_err_leaf", "grad_err_tree"):
                assert math.isfinite(r[key]), (variant, key, r[key])
            assert r["residual_bytes"] > 0
            assert r["reductions_16bit"] >= 0
            assert r["f16_reductions_off_ok"] in (True, False, None)
        assert rows["float32"]["grad_err_tree"] == 0.0
        assert rows["float32"]["reductions_16bit"] == 0
        for variant in ("autocast-f16", "autocast-bf16"):
            assert rows[variant]["grad_err_tree"] < 0.1, rows[variant]
            assert rows[variant]["grad_err_leaf"] < 0.5, rows[variant]
            assert 0 < rows[variant]["residual_ratio"] < 1.5


def test_table_renders(results):
    skipped = {
        "model": "needs-nothing-here",
        "source": "",
        "status": "skipped: needs nosuchpkg",
        "seconds": 0.0,
        "rows": [],
    }
    table = harness.render(results + [skipped])
    assert table.startswith("| model | variant |")
    for name in CHEAP:
        assert f"| {name} | float32 |" in table
    assert "autocast-bf16" in table
    assert "needs-nothing-here: skipped: needs nosuchpkg" in table


def test_further_batches_change_the_data_not_the_parameters():
    peer = BY_NAME["flax-vae"]
    _, params0, batch0 = peer.build(4)
    _, params1, batch1 = peer.build(4, seed=1)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params0, params1))
    assert not (batch0["images"] == batch1["images"]).all()
    assert not (batch0["z_rng"] == batch1["z_rng"]).all()


def test_errors_over_several_batches(results):
    rows = {r["variant"]: r for r in results[0]["rows"]}
    assert rows["float32"]["grad_err_tree_batches"] == []  # nothing to compare
    for variant in ("autocast-f16", "autocast-bf16"):
        leaf, tree = rows[variant]["grad_err_leaf_batches"], rows[variant]["grad_err_tree_batches"]
        assert len(leaf) == len(tree) == 3
        # The first batch is the one the main row measures; the others are new data.
        assert (leaf[0], tree[0]) == (
            rows[variant]["grad_err_leaf"],
            rows[variant]["grad_err_tree"],
        )
        assert len(set(tree)) == 3
        assert all(0 < e < 0.1 for e in tree), tree
    table = harness.render_batches(results)
    median = sorted(rows["autocast-f16"]["grad_err_tree_batches"])[1]
    assert "| flax-vae | autocast-f16 | 3 |" in table
    assert f"{median:.1e}" in table.splitlines()[2]
    assert "float32" not in table


def test_missing_package_is_skipped_not_crashed():
    import dataclasses

    peer = dataclasses.replace(BY_NAME["flax-vae"], name="ghost", requires=("no_such_module_xyz",))
    res = harness.run_peer(peer)
    assert res["status"] == "skipped: needs no_such_module_xyz"
    assert res["rows"] == []


def test_reduction_counter_sees_16bit_sums():
    import jax
    import jax.numpy as jnp

    def f(x):
        y = jax.lax.cumsum(x.astype(jnp.bfloat16), axis=0)
        total = jax.lax.reduce(y, 0.0, jax.lax.add, (0, 1))  # reduce_sum in bf16
        return total.astype(jnp.float32) + jnp.sum(x)  # jnp.sum of float32: not counted

    x = jnp.ones((4, 3))
    # The suite refuses 16-bit reductions (tests/conftest.py); this program, not an
    # autocast one, builds them on purpose to check that the counter sees them.
    allowed = jax.config.jax_allow_f16_reductions
    jax.config.update("jax_allow_f16_reductions", True)
    try:
        forward = harness.count_16bit_reductions(jax.make_jaxpr(jax.jit(f))(x))  # sub-jaxpr
        backward = harness.count_16bit_reductions(jax.make_jaxpr(jax.grad(f))(x))
    finally:
        jax.config.update("jax_allow_f16_reductions", allowed)
    assert forward == {"cumsum": 1, "reduce_sum": 1}, forward
    assert backward.get("cumsum") == 2, backward  # forward and transposed cumsum


def test_compare_pairs_the_batches_of_two_runs():
    from benchmarks.peers.compare import compare

    def row(tree, leaf):
        return {
            "activation_ratio": 0.5,
            "grad_err_tree_batches": tree,
            "grad_err_leaf_batches": leaf,
        }

    before = {("m", "autocast-f16"): row([1e-3, 2e-3, 3e-3], [1e-2, 1e-2, 1e-2])}
    after = {("m", "autocast-f16"): row([2e-3, 1e-3, 3e-3], [2e-2, 2e-2, 5e-3])}
    table = compare(before, after).splitlines()
    assert len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    # leaf medians 1.0e-02 -> 2.0e-02, at most on 1 of 3; tree medians equal, at most on 2 of 3
    assert cells == ["m", "autocast-f16", "0.50", "0.50", "3"] + [
        "1.0e-02",
        "2.0e-02",
        "1/3",
        "2.0e-03",
        "2.0e-03",
        "2/3",
    ]


def test_a_sum_over_axes_of_size_one_is_no_16_bit_sum():
    # It adds nothing, and JAX's jax_allow_f16_reductions=False guard lets it pass.
    x = jnp.ones((4, 1, 3), jnp.float16)
    with jax.allow_f16_reductions(True):
        nothing = jax.make_jaxpr(lambda x: jax.lax.reduce(x, 0.0, jax.lax.add, (1,)))(x)
        four = jax.make_jaxpr(lambda x: jax.lax.reduce(x, 0.0, jax.lax.add, (0, 1)))(x)
    assert harness.find_16bit_reductions(nothing) == []
    assert [s.split(" @ ")[0] for s in harness.find_16bit_reductions(four)] == [
        "reduce_sum float16[4,1,3]"
    ]
