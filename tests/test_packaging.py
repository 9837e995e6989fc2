"""What users of the package get: a light `import mpjax`, and a wheel with its
licence and type marker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
