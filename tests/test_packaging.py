"""What users of the package get: a light `import mpjax`, and a wheel with its
licence and type marker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_import_mpjax_does_not_import_flax(tmp_path):
    """Flax is needed only for NNX modules passed to autocast; it is imported then."""
    code = (
        "import mpjax, sys; "
        "loaded = sorted(m for m in sys.modules if m == 'flax' or m.startswith('flax.')); "
        "assert not loaded, loaded; "
        "assert mpjax.__file__.startswith(sys.argv[1]), mpjax.__file__"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------
# The distribution: licence, type marker, metadata


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_and_type_marker_are_declared_and_present():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"], text[:200]
    assert "END OF TERMS AND CONDITIONS" in text
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["mpjax"]
    assert (ROOT / "mpjax" / "py.typed").is_file()
    assert "Typing :: Typed" in project["classifiers"]


def test_jax_bounds_agree():
    """jax, jaxlib and the cuda12 extra admit the same versions: those _compat supports."""
    project = _pyproject()["project"]
    pins = [d for d in project["dependencies"] if d.startswith(("jax>", "jaxlib>"))]
    pins += project["optional-dependencies"]["cuda12"]
    bounds = {d.split(">", 1)[1] for d in pins}
    assert len(pins) == 3 and bounds == {"=0.10,<0.13"}, pins
    assert "jax 0.10 to 0.12" in (ROOT / "mpjax" / "_compat.py").read_text()


def _new_enough_setuptools() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major = int(setuptools.__version__.split(".")[0])
    return major >= 77  # PEP 639 license expressions


@pytest.mark.skipif(
    not _new_enough_setuptools(),
    reason="building the wheel offline needs setuptools>=77 in this environment "
    "(it comes with the test extra)",
)
def test_wheel_holds_license_and_type_marker(tmp_path):
    # Built from a copy: a build/ folder left in the checkout could add stale modules.
    src = tmp_path / "src"
    src.mkdir()
    for name in ["pyproject.toml", "README.md", "LICENSE"]:
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "mpjax", src / "mpjax", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--quiet", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("mpjax-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert "mpjax/py.typed" in names
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata
    assert not any(n.startswith(("tests/", "docs/", "benchmarks/", "examples/")) for n in names)
