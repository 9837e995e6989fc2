"""Smoke test of the benchmarks: the entry point runs at its smallest size
and its results have the expected structure. No timing is asserted: CI machines are
shared and noisy."""

import importlib
import json
import math
import os
import pathlib
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import compiled_kernels

import mpjax

# `benchmarks/` sits beside `mpjax/` in the repository and is not installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
benchmarks = importlib.import_module("benchmarks")
stablehlo = importlib.import_module("benchmarks.stablehlo")
compile_options = importlib.import_module("benchmarks.compile_options")
variants = importlib.import_module("benchmarks.variants")
VARIANTS = variants.VARIANTS
FAMILIES = importlib.import_module("benchmarks.cli").FAMILIES
SMOKE_VARIANTS = importlib.import_module("benchmarks.cli").MODES["smoke"]["static_variants"]
SIZES = importlib.import_module("benchmarks.models").SIZES


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "b.json"
    # The hand-cast baselines (Flax modules with dtype=float16) sum their bias
    # gradients in 16 bits: they are not autocast programs, so JAX's guard against
    # 16-bit sums (on for the suite, tests/conftest.py) is lifted for them. The
    # autocast variants are checked with it on in tests/test_float32_sums.py.
    with jax.allow_f16_reductions(True):
        out = benchmarks.main(["--smoke", "--json", str(path)])
    return out, json.loads(path.read_text())


def test_json_matches_returned_results(results):
    out, written = results
    assert written["meta"]["mode"] == "smoke"
    assert written["meta"]["command"].startswith("python -m benchmarks --smoke")
    assert written["memory"] == json.loads(json.dumps(out["memory"]))
    assert set(written) >= {
        "meta",
        "memory",
        "coverage",
        "compile",
        "scaler",
        "eager",
        "fidelity",
        "targets",
    }


def test_memory(results):
    _, out = results
    assert set(out["memory"]) == set(FAMILIES) == {"gpt", "vit", "resnet", "resnet_bn"}
    for family in FAMILIES:
        mem = out["memory"][family]
        assert set(mem) == set(SMOKE_VARIANTS)
        for m in mem.values():
            assert m["activation_bytes"] > 0
            assert sum(m["by_dtype"].values()) == m["activation_bytes"]
            assert m["all_bytes"] == m["activation_bytes"] + m["argument_bytes"]
        assert mem["float32"]["forward_float_casts"] == 0
        # 16-bit variants keep 16-bit residuals; float32 keeps none.
        assert "bfloat16" in mem["handcast-bf16"]["by_dtype"]
        assert "bfloat16" in mem["autocast-bf16"]["by_dtype"]
        assert "bfloat16" not in mem["float32"]["by_dtype"]
        # No variant computes a matrix product again in its backward pass; only
        # autocast's rematerialized regions recompute anything (tests/test_recompute.py).
        assert all(m["recomputed_products"] == 0 for m in mem.values())
        for name in ("float32", "handcast-bf16"):
            assert mem[name]["recomputed_bytes"] == 0
    assert out["memory"]["gpt"]["autocast-bf16"]["recomputed_bytes"] > 0  # its GELUs


def test_coverage(results):
    _, out = results
    for family in FAMILIES:
        cov = out["coverage"][family]
        flops = {c["matmul_flops"] for c in cov.values()}
        assert len(flops) == 1 and flops.pop() > 0  # every variant does the same matrix work
        assert cov["float32"]["low_precision_fraction"] == 0.0
        assert cov["float32"]["float_converts"] == 0
        for name, c in cov.items():
            if name != "float32":
                assert c["low_precision_fraction"] == 1.0, name
                assert c["float_converts"] > 0
            by_shape = c["float_converts_by_shape"].values()
            assert sum(n for n, _ in by_shape) == c["float_converts"]
            assert sum(e for _, e in by_shape) == c["float_convert_elements"]


def test_timings_are_positive(results):
    _, out = results
    comp = out["compile"]["gpt"]
    assert set(comp) >= {"float32", "autocast-bf16"}
    for m in comp.values():
        assert all(m[k] > 0 for k in ("trace", "lower", "compile", "total"))
    assert comp["float32"]["ratio_total"] == 1.0
    for section in ("scaler", "eager"):
        assert out[section]["gpt"]["ratio"] > 0
    fid = out["fidelity"]["gpt"]
    assert fid["float32"]["grad_rel_err"] == 0.0
    assert all(math.isfinite(v["loss"]) and v["grad_rel_err"] < 0.2 for v in fid.values())


def test_batch_norm_statistics_are_threaded_through_the_step():
    """The BatchNorm ResNet's running statistics are its `state`, apart from the
    parameters the optimizer trains: every variant's loss returns them in float32, and
    the training step (autocast, grad scaler, ``has_aux``) updates them near float32's."""
    spec = SIZES["smoke"]["resnet_bn"]
    assert spec.mutable == ("batch_stats",)
    params, state = spec.param_spec()
    assert set(params) == {"params"} and set(state) == {"batch_stats"}
    # Random values from numpy: nothing to compile (jitted init costs seconds).
    rng = np.random.default_rng(0)

    def fill(s):
        return jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype)

    params, state = jax.tree.map(fill, params), jax.tree.map(jnp.zeros_like, state)
    batch = spec.batch_spec()
    batch = dict(inputs=fill(batch["inputs"]), targets=jnp.arange(spec.config.batch) % 10)
    # The hand-cast float16 model sums in 16 bits (see `results`): the guard is lifted.
    with jax.allow_f16_reductions(True):
        for name, variant in VARIANTS.items():
            _, stats = jax.eval_shape(variants.loss_fn(spec, variant), params, state, batch)
            assert jax.tree.structure(stats) == jax.tree.structure(state), name
            assert {leaf.dtype for leaf in jax.tree.leaves(stats)} == {jnp.dtype("float32")}, name
    _, want = jax.jit(variants.loss_fn(spec, VARIANTS["float32"]))(params, state, batch)
    step, tx = variants.train_step(spec, VARIANTS["autocast-f16"])
    fast = jax.jit(step, compiler_options=compile_options.FAST_COMPILE)
    _, got, _, loss = fast(params, state, tx.init(params), batch)
    assert math.isfinite(float(loss))
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, state)
    assert max(jax.tree.leaves(moved)) > 0.01  # the running averages were updated
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=0.05, atol=0.02)


def test_targets_table(results):
    _, out = results
    whats = [t["what"] for t in out["targets"]]
    assert any("activation bytes / float32" in w for w in whats)
    assert any("in 16 bit" in w for w in whats)
    assert any("products recomputed" in w for w in whats)
    assert all(isinstance(t["met"], bool) for t in out["targets"])


def test_stablehlo_parser_counts_calls_once_per_call_site():
    text = """
  func.func public @main(%arg0: tensor<2x3xbf16>, %arg1: tensor<3x4xbf16>) -> tensor<2x4xf32> {
    %0 = call @inner(%arg0, %arg1) : (tensor<2x3xbf16>, tensor<3x4xbf16>) -> tensor<2x4xbf16>
    %1 = call @inner(%arg0, %arg1) : (tensor<2x3xbf16>, tensor<3x4xbf16>) -> tensor<2x4xbf16>
    %2 = stablehlo.convert %0 : (tensor<2x4xbf16>) -> tensor<2x4xf32>
    %3 = stablehlo.dot_general %2, %2, contracting_dims = [1] x [1] : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x2xf32>
    return %2 : tensor<2x4xf32>
  }
  func.func private @inner(%arg0: tensor<2x3xbf16>, %arg1: tensor<3x4xbf16>) -> tensor<2x4xbf16> {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<2x3xbf16>, tensor<3x4xbf16>) -> tensor<2x4xbf16>
    return %0 : tensor<2x4xbf16>
  }
"""
    cov = stablehlo.coverage(text)
    low = 2 * (2 * 2 * 4 * 3)  # two calls of a 2x3 @ 3x4 product
    # %3 multiplies float32 values upcast from bfloat16: 16-bit values.
    assert cov.low_precision_flops == low + 2 * (2 * 2) * 4
    assert cov.matmul_flops == low + 2 * (2 * 2) * 4
    assert cov.n_matmuls == cov.n_low_matmuls == 3
    assert cov.float_converts == 1 and cov.float_convert_elements == 8
    assert cov.float_converts_by_shape == {"2x4 bf16->f32": [1, 8]}


def test_stablehlo_parser_tells_exact_round_trips_from_roundings():
    text = """
  func.func public @main(%arg0: tensor<2x4xf16>, %arg1: tensor<2x4xf32>, %arg2: tensor<2x4xbf16>) -> tensor<2x4xf16> {
    %0 = stablehlo.convert %arg0 : (tensor<2x4xf16>) -> tensor<2x4xf32>
    %1 = stablehlo.convert %0 : (tensor<2x4xf32>) -> tensor<2x4xf16>
    %2 = stablehlo.convert %arg1 : (tensor<2x4xf32>) -> tensor<2x4xf16>
    %3 = stablehlo.convert %arg2 : (tensor<2x4xbf16>) -> tensor<2x4xf32>
    %4 = stablehlo.convert %3 : (tensor<2x4xf32>) -> tensor<2x4xf16>
    %5 = stablehlo.add %0, %0 : tensor<2x4xf32>
    %6 = stablehlo.convert %5 : (tensor<2x4xf32>) -> tensor<2x4xf16>
    return %1 : tensor<2x4xf16>
  }
"""
    cov = stablehlo.coverage(text)
    assert cov.float_converts == 6 and cov.float_convert_elements == 48
    # only %1 gives back the very float16 values it was made from: %2 and %6 round
    # float32 values, %4 rounds bfloat16 values to float16
    assert cov.round_trips == 1 and cov.round_trip_elements == 8


def test_xla_removes_an_exact_round_trip_the_parser_counts_apart():
    def f(x16):
        up = x16.astype(jnp.float32)
        return jnp.sum(up, axis=0), up.astype(jnp.float16) * x16

    x = jnp.ones((64, 32), jnp.float16)
    lowered = jax.jit(f).lower(x)
    assert stablehlo.coverage(lowered.as_text()).round_trips == 1
    compiled = lowered.compile().as_text()
    # the multiply reads x16 itself: no convert down to float16 is left
    assert not re.search(r"= f16\[[\d,]*\]\S* convert\(", compiled)
    assert re.search(r"= f32\[[\d,]*\]\S* convert\(", compiled)  # the pattern matches


def test_stablehlo_parser_counts_float32_values_as_float32():
    text = """
  func.func public @main(%arg0: tensor<2x3xf32>, %arg1: tensor<3x4xbf16>) -> tensor<2x4xf32> {
    %0 = stablehlo.convert %arg1 : (tensor<3x4xbf16>) -> tensor<3x4xf32>
    %1 = stablehlo.dot_general %arg0, %0, contracting_dims = [1] x [0] : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
    return %1 : tensor<2x4xf32>
  }
"""
    cov = stablehlo.coverage(text)
    assert cov.matmul_flops == 2 * 2 * 4 * 3 and cov.low_precision_flops == 0


def test_gpu_jobs_add_true_float32_only_where_float32_is_asked_for():
    gpu_jobs = importlib.import_module("benchmarks.cli").gpu_jobs
    assert gpu_jobs(["gpt"], ["float32", "autocast-bf16"]) == [
        ("gpt", "float32", None),
        ("gpt", "autocast-bf16", None),
        ("gpt", "float32", "highest"),
    ]
    assert gpu_jobs(["gpt", "resnet"], ["autocast-bf16"]) == [
        ("gpt", "autocast-bf16", None),
        ("resnet", "autocast-bf16", None),
    ]
    assert gpu_jobs(["gpt"], ["float32"], highest=False) == [("gpt", "float32", None)]


def test_scaler_benchmark_runs_and_reports_ratios(capsys):
    from benchmarks import scaler

    scaler.main(["--leaves", "3", "--params", "3000", "--repeats", "2", "--compile-repeats", "1"])
    out = capsys.readouterr().out
    assert "| 3 |" in out and "| 3e+03 |" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 3")]
    # each row: adam, then the scaler, check_updates=True and optax.apply_if_finite,
    # each with its ratio
    ratios = [float(row[i]) for row in rows for i in (4, 6, 8)]
    assert len(ratios) == 6 and all(r > 0 for r in ratios)


def test_scaler_benchmark_measures_only_the_named_wrappers(capsys):
    from benchmarks import scaler

    scaler.main(["--leaves", "3", "--params", "3000", "--scalers", "grad_scaler", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "| leaves | adam compile (s) | grad_scaler (s) | ratio | kernels |\n" in out
    assert "apply_if_finite" not in out and "check_updates" not in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 3")]
    assert [len(row) for row in rows] == [7, 6] and all(float(row[4]) > 0 for row in rows)
    # the compiled updates' kernels, adam's then the scaler's: a few more
    adam, scaled = map(int, rows[0][5].split("/"))
    assert 0 < adam < scaled <= adam + 12, rows[0]


def test_scaler_benchmark_compiles_whole_training_steps_with_and_without(capsys, monkeypatch):
    from benchmarks import scaler

    calls = []
    real = scaler.timing.compile_times

    def compile_times(spec, variant, scaler=None, scaled_loss=None, kernels=False):
        calls.append((spec, variant, scaler, scaled_loss))
        return real(spec, variant, scaler, scaled_loss, kernels)

    monkeypatch.setitem(SIZES["full"], "gpt", SIZES["smoke"]["gpt"])  # small, same code
    monkeypatch.setattr(scaler.timing, "compile_times", compile_times)
    scaler.main(["--leaves", "--params", "--compile-steps", "gpt", "--compile-repeats", "1"])
    out = capsys.readouterr().out
    assert (
        "| training step | adamw compile (s) | grad_scaler, jax.value_and_grad (s) | ratio "
        "| grad_scaler (s) | ratio | kernels |" in out
    )
    (row,) = [line.split("|") for line in out.splitlines() if line.startswith("| gpt |")]
    assert float(row[4]) > 0 and float(row[6]) > 0
    # the compiled steps' kernels: loss scaling adds some, the unscaling some more
    plain, update, scaled = map(int, row[7].split("/"))
    assert plain < update < scaled, row
    smoke = SIZES["smoke"]["gpt"]
    # without loss scaling, the update alone, and both: the same model and variant
    assert sorted(calls, key=str) == [
        (smoke, "autocast-f16", False, False),
        (smoke, "autocast-f16", True, False),
        (smoke, "autocast-f16", True, True),
    ]


def test_scaler_benchmark_donates_the_state_and_feeds_it_forward(capsys):
    """``--donate`` times updates that write over their state, as a training step
    does: each call takes the state the last returned, and the old one is gone."""
    from benchmarks import scaler

    tx = mpjax.grad_scaler(optax.adam(1e-3))
    params = {"w": jnp.ones([8]), "b": jnp.ones([3])}
    first = tx.init(params)
    state = [first]
    update = jax.jit(tx.update, donate_argnums=1)
    scaler._donated_step_seconds(update, params, state, params, calls=3)
    assert int(state[0].inner_state[0].count) == 3
    assert first.inner_state[0].mu["w"].is_deleted()  # donated, not copied

    scaler.main(
        ["--leaves", "--params", "3000", "--donate", "--scalers", "grad_scaler", "--repeats", "2"]
    )
    out = capsys.readouterr().out
    assert "| parameters (10 leaves, state donated) |" in out
    (row,) = [line.split("|") for line in out.splitlines() if line.startswith("| 3e+03")]
    assert float(row[4]) > 0


def test_scaler_benchmark_compiles_on_a_models_parameter_tree(capsys):
    from benchmarks import scaler
    from benchmarks.models import SIZES

    args = ["--leaves", "--params", "--compile-models", "resnet", "--scalers", "grad_scaler"]
    scaler.main([*args, "--compile-repeats", "1"])
    out = capsys.readouterr().out
    leaves = len(jax.tree.leaves(SIZES["full"]["resnet"].param_spec()[0]))
    (row,) = [line.split("|") for line in out.splitlines() if line.startswith("| resnet")]
    assert row[1].strip() == f"resnet ({leaves})" and float(row[4]) > 0


def test_scaler_benchmark_compiles_the_scalers_halves_apart(capsys):
    from benchmarks import scaler

    scaler.main(["--leaves", "3", "--params", "--parts", "--compile-repeats", "1"])
    out = capsys.readouterr().out
    assert "| check only (s) | ratio | selection only (s) | ratio |" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 2  # the wrappers' row, then the halves'
    assert all(float(rows[1][i]) > 0 for i in (2, 3, 4, 5, 6))


def test_the_scalers_halves_add_up_to_the_scalers_kernels_per_leaf():
    """What `--parts` times is the scaler's per-leaf program, split in two.

    Neither half adds a kernel per leaf: the check stacks the leaves of one size
    into one reduction, and XLA folds the selects into adam's passes. The whole
    scaler adds per leaf exactly what the two add.
    """
    import optax

    import mpjax
    from benchmarks import scaler

    adam = optax.adam(1e-3)
    tx = mpjax.grad_scaler(adam)

    def kernels(n):
        params = scaler._leaves(n, 12)
        state = adam.init(params)
        programs = {
            "adam": (adam.update, params, state, params),
            "check": (scaler._check_only(adam), params, state, params),
            "selection": (scaler._selection_only(adam), params, state, params, jnp.array(False)),
            "scaler": (tx.update, params, tx.init(params), params),
        }
        return {name: compiled_kernels(*program) for name, program in programs.items()}

    small, large = kernels(4), kernels(8)
    per_leaf = {k: (large[k] - small[k] - (large["adam"] - small["adam"])) / 4 for k in small}
    assert per_leaf["check"] == 0 and per_leaf["selection"] == 0
    assert per_leaf["scaler"] == per_leaf["check"] + per_leaf["selection"]


def test_scaler_benchmark_times_the_finite_check_by_leaf_size(capsys, monkeypatch):
    from benchmarks import scaler
    from mpjax import _finite

    monkeypatch.setattr(scaler, "_CHECK_SIZES", 2)  # each compiles 2 sizes, not 8
    large = _finite.LARGE
    scaler.main(["--leaves", "--params", "--check", str(large - 1), str(large), "--repeats", "2"])
    out = capsys.readouterr().out
    assert "adam" not in out  # no compile or update rows were asked for
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 1638")]
    used = ["stacked by size, sum of x - x", "sum of x - x"]
    assert [row[-2].strip() for row in rows] == used
    assert all(float(row[i]) > 0 for row in rows for i in range(2, 10))


def test_scaler_benchmark_times_a_models_training_step(capsys):
    from benchmarks import models, scaler

    args = ["--leaves", "--params", "--models", "resnet", "--model-size", "smoke"]
    scaler.main([*args, "--repeats", "2"])
    out = capsys.readouterr().out
    assert models.SIZES["smoke"]["resnet"].describe() in out
    (row,) = [line for line in out.splitlines() if line.startswith("| resnet")]
    plain, scaled, ratio = (float(c) for c in row.split("|")[2:5])
    assert plain > 0 and scaled > 0 and ratio == pytest.approx(scaled / plain, rel=0.05)


def test_trace_overhead_script_runs():
    trace_overhead = importlib.import_module("benchmarks.trace_overhead")
    out = trace_overhead.main(["--layers", "2", "--width", "8", "--repeats", "1", "--depth", "2"])
    assert set(out["nested"]) == {1, 2}
    assert set(out["mlp"]) == {"plain", "autocast"}
    assert all(t >= 0 for m in out["mlp"].values() for t in m.values())


def test_compiled_memory_reports_both_measures(tmp_path, capsys):
    compiled_memory = importlib.import_module("benchmarks.compiled_memory")
    path = tmp_path / "m.json"
    with jax.allow_f16_reductions(True):  # the hand-cast model's 16-bit bias sums
        compiled_memory.main(["--size", "smoke", "--families", "resnet", "--json", str(path)])
    out = json.loads(path.read_text())["resnet"]
    assert set(out) == set(compiled_memory.DEFAULT_VARIANTS)
    for r in out.values():
        assert r["activation_bytes"] > 0
        assert r["compiled_temp_bytes"] is None or r["compiled_temp_bytes"] > 0
    assert "| resnet | autocast-bf16 |" in capsys.readouterr().out


def test_fidelity_over_batches(capsys):
    fidelity = importlib.import_module("benchmarks.fidelity")
    with jax.allow_f16_reductions(True):  # the hand-cast model's 16-bit bias sums
        out = fidelity.main(["--size", "smoke", "--families", "gpt", "--batches", "2"])
    errors = out["gpt"]["errors"]
    assert set(errors) == set(VARIANTS) - {"float32"}
    for name, errs in errors.items():
        assert len(errs) == 2 and all(0 < e < 0.1 for e in errs), (name, errs)
        assert errs[0] != errs[1], name  # two different batches
    row = [line for line in capsys.readouterr().out.splitlines() if "| autocast-f16 |" in line]
    assert row and "(handcast-f16)" in row[0]
    before = {"gpt": {"errors": {"autocast-f16": [errors["autocast-f16"][0], 0.0]}}}
    (row,) = fidelity.compare(before, out).splitlines()[2:]
    assert row.endswith("| 1/2 |")  # equal on the first batch, above 0 on the second


def test_gpu_memory_compiles_the_timed_step_with_its_state_updated_in_place(tmp_path):
    gpu_memory = importlib.import_module("benchmarks.gpu_memory")
    kernel_traffic = importlib.import_module("benchmarks.kernel_traffic")
    spec = SIZES["smoke"]["gpt"]
    r = gpu_memory.step_memory(spec, "autocast-bf16", jax.devices()[0], hlo_dir=tmp_path)
    assert r["temp_bytes"] > 0
    # Every kernel reads or writes something; together at least the step's arguments.
    assert r["kernels"] > 0 and r["kernel_bytes"] >= r["argument_bytes"], r
    written = (tmp_path / "gpt-autocast-bf16.hlo").read_text()  # for kernel_traffic's diff
    assert kernel_traffic.kernel_bytes(written)["bytes"] == r["kernel_bytes"]
    # Parameters and optimizer state are donated: the new ones take their place,
    # so the peak holds one copy of them (and the loss), not two.
    outputs_apart = r["peak_bytes"] - r["argument_bytes"] - r["temp_bytes"]
    assert 0 <= outputs_apart < 0.01 * r["argument_bytes"], r


def test_gpu_memory_compiles_a_float16_step_without_the_scaler_when_told():
    gpu_memory = importlib.import_module("benchmarks.gpu_memory")
    spec, dev = SIZES["smoke"]["gpt"], jax.devices()[0]
    scaled = gpu_memory.step_memory(spec, "autocast-f16", dev)
    unscaled = gpu_memory.step_memory(spec, "autocast-f16", dev, scaler=False)
    # The scaler's state (scale, counters, a flag per parameter subtree) is an
    # argument of the scaled step only.
    assert 0 < scaled["argument_bytes"] - unscaled["argument_bytes"] < 1024, (scaled, unscaled)


def test_gpu_memory_traces_the_finite_check_as_on_a_gpu():
    # Compiled for a GPU from a CPU, the step's finite check must stack leaves as it
    # does on the GPU, or the kernels counted are those of another program.
    gpu_memory = importlib.import_module("benchmarks.gpu_memory")
    _finite = importlib.import_module("mpjax._finite")
    here = _finite.large_leaf()  # the default backend's: LARGE on a CPU
    with gpu_memory._traced_for(types.SimpleNamespace(platform="gpu")):
        assert _finite.large_leaf() == _finite.LARGE_GPU
    with gpu_memory._traced_for(types.SimpleNamespace(platform="cpu")):
        assert _finite.large_leaf() == here
    assert _finite.large_leaf() == here


def test_gpu_memory_says_how_to_get_the_cuda_plugin(monkeypatch):
    gpu_memory = importlib.import_module("benchmarks.gpu_memory")
    topologies = importlib.import_module("jax.experimental.topologies")

    def no_plugin(**kwargs):
        raise RuntimeError("Unknown backend: 'cuda' requested")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    target = (gpu_memory.TARGETS / "h100.pbtxt").read_text()
    with pytest.raises(SystemExit, match=re.escape(f'"jax[cuda12]=={jax.__version__}"')):
        gpu_memory.device(target)


def test_gpu_memory_drops_target_fields_an_older_xla_does_not_read(monkeypatch, capsys):
    gpu_memory = importlib.import_module("benchmarks.gpu_memory")
    topologies = importlib.import_module("jax.experimental.topologies")
    seen = []

    def older_xla(platform, target_config, topology):
        seen.append(target_config)
        if "mem_clock_ghz" in target_config:  # as XLA reports it: on its own stderr
            os.write(2, b'Message type "GpuDeviceInfoProto" has no field named "mem_clock_ghz".')
            raise RuntimeError("Failed to parse GpuTargetConfigProto")
        return types.SimpleNamespace(devices=["the device"])

    monkeypatch.setattr(topologies, "get_topology_desc", older_xla)
    target = "gpu_device_info {\n  threads_per_warp: 32\n  mem_clock_ghz: 2.619\n}\n"
    assert gpu_memory.device(target) == "the device"
    assert seen[-1] == "gpu_device_info {\n  threads_per_warp: 32\n  \n}\n"
    assert "dropped: mem_clock_ghz" in capsys.readouterr().out


def test_gpu_memory_goes_on_past_a_step_xla_cannot_compile(monkeypatch, capsys):
    # XLA without the device can fail on one model (jax 0.10's on the ViT): the
    # others are still compiled and tabled, and the failure says what to try.
    gpu_memory = importlib.import_module("benchmarks.gpu_memory")
    dev = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", platform="gpu")
    monkeypatch.setattr(gpu_memory, "device", lambda target: dev)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # stay on this backend

    def step_memory(spec, name, dev, scaler, hlo_dir):
        if spec.family == "vit":
            raise jax.errors.JaxRuntimeError("INTERNAL: Couldn't find output tile sizes\n...")
        return dict.fromkeys(("peak_bytes", "kernel_bytes", "kernels"), 2**30)

    monkeypatch.setattr(gpu_memory, "step_memory", step_memory)
    gpu_memory.main(["--families", "vit", "gpt", "--variants", "autocast-bf16"])
    out = capsys.readouterr().out
    assert "vit autocast-bf16: XLA (jax " in out and "Couldn't find output tile sizes" in out
    assert "--xla_gpu_enable_triton_gemm=false" in out
    assert "| gpt | autocast-bf16 | 1.00 |" in out and "| vit |" not in out


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_kernel_traffic_counts_each_kernels_operands_and_result():
    kernel_traffic = importlib.import_module("benchmarks.kernel_traffic")
    assert kernel_traffic.nbytes("f32[2,3]{1,0}") == 24
    assert kernel_traffic.nbytes("(f32[2]{0}, bf16[4]{0}, s32[])") == 20
    x = jnp.ones(4096, jnp.float32)
    one = kernel_traffic.kernel_bytes(_compiled_text(lambda a: a * 2 + 1, x))
    assert one == {"bytes": 2 * 4 * 4096, "kernels": 1}  # read x, write the result
    # A fusion that reads a quarter of its operand counts that quarter.
    part = kernel_traffic.kernel_bytes(_compiled_text(lambda a: a[1024:2048] * 2, x))
    assert part["bytes"] == 2 * 4 * 1024, part
    # A result that two kernels read is written once and read twice.
    two = kernel_traffic.kernel_bytes(_compiled_text(lambda a: jnp.sort(a * 2) + 1, x))
    assert two["kernels"] >= 2 and two["bytes"] >= 4 * 4 * 4096, two


def test_kernel_traffic_compares_two_programs_by_the_arrays_they_move(tmp_path, capsys):
    kernel_traffic = importlib.import_module("benchmarks.kernel_traffic")
    n = 2**28  # 1 GiB of float32, compiled but never allocated
    x = jax.ShapeDtypeStruct((n,), jnp.float32)
    wide = _compiled_text(lambda a: a * 2 + 1, x)
    narrow = _compiled_text(lambda a: (a * 2 + 1).astype(jnp.float16), x)
    assert kernel_traffic.by_array(narrow) == {f"read f32[{n}]": 4 * n, f"write f16[{n}]": 2 * n}
    (tmp_path / "a.hlo").write_text(wide)
    (tmp_path / "b.hlo").write_text(narrow)
    kernel_traffic.main([str(tmp_path / "a.hlo"), str(tmp_path / "b.hlo"), "--top", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "total GB: 2.15 -> 1.61"
    assert lines[3:] == [
        f"| -1.07 | 1.07 | 0.00 | write f32[{n}] |",
        f"| +0.54 | 0.00 | 0.54 | write f16[{n}] |",
    ]


def test_gpu_memory_table_compares_with_float32_and_the_hand_cast_model():
    gpu_memory = importlib.import_module("benchmarks.gpu_memory")
    gib = gpu_memory.GiB
    results = {
        "gpt": {
            "float32": {"peak_bytes": 20 * gib, "kernel_bytes": 90e9, "kernels": 700},
            "handcast-bf16": {"peak_bytes": 12 * gib, "kernel_bytes": 60e9, "kernels": 800},
            "autocast-bf16": {"peak_bytes": 9 * gib, "kernel_bytes": 66e9, "kernels": 850},
        }
    }
    rows = gpu_memory.table(results).splitlines()[2:]
    assert rows[2] == "| gpt | autocast-bf16 | 9.00 | 0.450 | 0.750 | 66.00 | 1.100 | 850 |"
    assert rows[0] == "| gpt | float32 | 20.00 | 1.000 |  | 90.00 |  | 700 |"


def test_kernel_kinds_are_told_from_kernel_names():
    kind = importlib.import_module("benchmarks.kernels")._kind
    names = {
        "nvjet_sm90_tss_128x128_64x6_1x2_h_bz_bias_NNT command_buffer_1": "products",
        "gemm_fusion_dot_52 command_buffer_1": "products",  # a Triton product
        "sm90_xmma_fprop_implicit_gemm_bf16bf16 cudnn-conv.29": "products",
        "wrapped_convert_49 wrapped_convert.49": "loop fusion",  # not a convolution
        "loop_convert_fusion_11 command_buffer_1": "loop fusion",
        "input_convert_reduce_fusion_9 command_buffer_1": "reduce fusion",
        "memcpy128 command_buffer_233": "copy",
    }
    assert {n: kind(n) for n in names} == names


@pytest.mark.parametrize(
    "module, argv",
    [
        ("benchmarks.scaler", ["--repeats", "0"]),
        ("benchmarks.scaler", ["--check", "0"]),
        ("benchmarks.trace_overhead", ["--repeats", "0"]),
        ("benchmarks.fidelity", ["--batches", "0"]),
        ("benchmarks.compiled_memory", ["--variants", "bogus"]),
        ("benchmarks.kernels", ["--families", "bogus"]),
        ("benchmarks.gpu", ["--worker", "gpt", "bogus"]),
        ("benchmarks.peers.compare", ["benchmarks/results/cpu_static.json"] * 2),
        (
            "benchmarks.peers.compare",
            [
                "benchmarks/peers/results_cpu_batches.json",
                "benchmarks/peers/results_cpu_batches64.json",
            ],
        ),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it(module, argv, capsys, monkeypatch):
    monkeypatch.chdir(pathlib.Path(__file__).parent.parent)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def test_diagnose_time_compares_mpjaxs_compile_options_with_xlas_defaults(monkeypatch, capsys):
    diagnose_time = importlib.import_module("benchmarks.diagnose_time")
    from mpjax import _compat

    # What each timed call compiles its equations with, instead of a real first call
    # (seconds of compiling, with the suite's caches cleared).
    seen = []
    monkeypatch.setattr(diagnose_time, "clear_caches", lambda: seen.append("cleared"))
    monkeypatch.setattr(
        diagnose_time.mpjax, "diagnose", lambda *args: seen.append(_compat.fast_compile_options())
    )
    out = diagnose_time.main(["--size", "smoke", "--family", "gpt", "--repeats", "2"])
    fast = _compat.fast_compile_options()
    assert fast and seen == ["cleared", fast, "cleared", {}, "cleared", {}, "cleared", fast]
    assert out["fast_s"] > 0 and out["ratio"] == pytest.approx(out["fast_s"] / out["default_s"])
    assert "| `fast_compile_options` (mpjax) |" in capsys.readouterr().out


def test_cases_print_float32_autocast_and_hand_cast_figures(capsys):
    cases = importlib.import_module("benchmarks.cases")
    figures = cases.lean_bias()
    assert set(figures) == {"float32", "float16", "bfloat16"}
    assert set(figures["float16"]) == {"lean", "hand-cast"}
    # A bias of 1e5 overflows float16, as when cast by hand: loud, not saturated.
    assert math.isinf(figures["float16"]["lean"]) and math.isinf(figures["float16"]["hand-cast"])
    gp = cases.gaussian_process()
    assert gp["bfloat16"]["autocast"] == pytest.approx(gp["float32"], rel=1e-5)
    # Flax's fp8 products quantize the gradient as without a loss scale.
    for figure in cases.fp8_first_step().values():
        assert figure["grad_scaler"] == pytest.approx(figure["no scaler"], rel=1e-6)
