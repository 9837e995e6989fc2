"""Smoke tests of the example scripts: each `main([...])` with tiny settings.

The full runs, with their numbers, are in docs/examples.md; here only that each
script runs end to end, returns its results and writes what it should.
"""

import importlib.util
import math
import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Linen modules are dataclasses: they look it up
    spec.loader.exec_module(module)
    return module


def test_digits(tmp_path, capsys):
    digits = load("digits")
    plot = tmp_path / "out" / "digits.png"
    results = digits.main(
        [
            "--steps",
            "8",
            "--batch-size",
            "16",
            "--growth-interval",
            "2",
            "--no-progress",
            "--plot",
            str(plot),
        ]
    )
    assert [r["mode"] for r in results] == ["float32", "float16", "bfloat16"]
    for r in results:
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["final_loss"])
        assert math.isfinite(r["test_loss"]) and r["losses"].shape == (8,)
        assert r["scales"].shape == (8,) and r["skipped"].shape == (8,)
    by_mode = {r["mode"]: r for r in results}
    assert by_mode["float32"]["final_scale"] == by_mode["bfloat16"]["final_scale"] == 1.0
    assert by_mode["float32"]["skipped_steps"] == by_mode["bfloat16"]["skipped_steps"] == 0
    f16 = by_mode["float16"]
    # growth_interval 2: the scale moved (grew, or backed off on a skipped step).
    assert f16["final_scale"] != 2.0**16 or f16["skipped_steps"] > 0
    assert plot.exists() and plot.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "float16 autocast + grad_scaler" in out and "test acc" in out
    words = " ".join(out.split())  # the notes are wrapped
    assert "largest gap to float32's" in words  # the curves overlap: by how much
    assert "tensor cores" in words  # what a GPU gives
    if digits.jax.default_backend() == "cpu":
        assert "by converting to float32 and back" in words  # why 16 bits are slower here


def test_char_lm(capsys):
    char_lm = load("char_lm")
    # Two of the three runs (bfloat16 is smoke-tested in test_digits): each run
    # compiles its own training step, the bulk of this test's time.
    results = char_lm.main(
        [
            "--steps",
            "4",
            "--layers",
            "1",
            "--width",
            "16",
            "--heads",
            "2",
            "--context",
            "16",
            "--batch-size",
            "4",
            "--max-bytes",
            "20000",
            "--val-batches",
            "2",
            "--no-progress",
            "--modes",
            "float32",
            "float16",
        ]
    )
    assert [r["mode"] for r in results] == ["float32", "float16"]
    for r in results:
        # Four steps from a uniform guess over 256 bytes: near log(256).
        assert 3.0 < r["val_loss"] < 7.0 and r["losses"].shape == (4,)
        assert abs(r["vs_float32"]) < 0.05
    assert results[0]["vs_float32"] == 0.0 and results[0]["skipped_steps"] == 0
    # float16 may skip its first step or two while the scale backs off from 2**16.
    assert results[1]["skipped_steps"] <= 2
    assert "val loss" in capsys.readouterr().out


def test_underflow(capsys):
    underflow = load("underflow")
    results = underflow.main(["--steps", "30", "--no-progress"])
    assert [r["mode"] for r in results] == ["float32", "float16-unscaled", "float16-scaled"]
    f32, unscaled, scaled = results
    # The effect is there from the first steps: nearly every gradient of the unscaled
    # run is 0 (float32's zeros are inactive ReLUs).
    assert unscaled["zero_grad_fraction"] > 0.99 and unscaled["skipped_steps"] == 0
    assert scaled["zero_grad_fraction"] < 0.5 and f32["zero_grad_fraction"] < 0.5
    assert scaled["final_loss"] < unscaled["final_loss"]
    assert "float16 autocast, no scaling" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["digits", "char_lm", "underflow"])
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load(name).main(["--help"])
    assert exit_info.value.code == 0
    assert "--steps" in capsys.readouterr().out


def test_data_parallel(capsys):
    import jax

    data_parallel = load("data_parallel")
    result = data_parallel.main(["--steps", "6", "--batch-size", "32"])
    assert result["devices"] == jax.device_count() == 8  # conftest: 8 simulated devices
    single, parallel = result["single"], result["parallel"]
    # The same skip decisions and scale, and parameters replicated on every device.
    assert single["skipped_steps"] == parallel["skipped_steps"]
    assert single["final_scale"] == parallel["final_scale"]
    assert parallel["kernel_sharding"].is_fully_replicated
    # The runs differ by rounding (the all-reduce sums in another order), far less
    # than the distance the parameters travelled.
    assert result["relative_param_diff"] < 0.1
    assert "8 devices, data parallel" in capsys.readouterr().out


def test_diagnose(tmp_path, capsys):
    diagnose = load("diagnose")
    result = diagnose.main(["--plot-dir", str(tmp_path)])
    # Pressures in pascals: the first layer's input cast overflows in the forward pass.
    forward = result["overflow"].runs[0].forward
    assert (forward.primitive, forward.module) == ("convert_element_type", "Regressor/embed")
    assert forward.file.endswith("diagnose.py") and forward.function == "Regressor.__call__"
    # A loss weighted by 2**-20 at scale 1: float16 flushes gradients, bfloat16 does not.
    f16, bf16 = result["underflow"].runs
    assert max(leaf.underflow for leaf in f16.leaves) > 0.5
    assert max(leaf.underflow for leaf in bf16.leaves) < 0.01
    assert f16.recommended_scale > 2.0**20 and f16.leaves_at_recommended
    assert max(leaf.underflow for leaf in f16.leaves_at_recommended) < 0.01
    for path in result["plots"].values():
        assert pathlib.Path(path).stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "Recommendations" in out and "Raise init_scale to 2**" in out
