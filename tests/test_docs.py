"""The documentation site: every snippet runs, every docstring example passes,
every public name is documented with an example, and ``mkdocs build --strict``
succeeds.

The code shown in ``docs/`` lives in ``docs/snippets/*.py`` and is included into
the pages with ``--8<-- "docs/snippets/name.py"``, so the files run here are the
code readers see. Python blocks written inline in a page (pages other authors
own) are extracted and run too, each page's blocks in order in one namespace.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import mpjax

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Snippets shown as the "before" of a port, written for a library mpjax does not
# depend on: compiled, not run. Each page shows its mpjax version, which runs.
SHOWN_NOT_RUN = {"jmp_before.py": "jmp"}
ALL_SNIPPETS = sorted((DOCS / "snippets").glob("*.py"))
SNIPPETS = [p for p in ALL_SNIPPETS if p.name not in SHOWN_NOT_RUN]
PAGES = sorted(DOCS.rglob("*.md"))
INCLUDE = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$')
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n]*)$")

# Run again in a fresh process with 8 simulated CPU devices: the recipe promises
# it works on one device and on a mesh of several.
MULTI_DEVICE = {"data_parallel.py", "shard_map_data_parallel.py"}

# Models run in float16 without autocast (the "before" of a port, the wholesale cast
# autocast is measured against): they sum in 16 bits, which the suite's guard
# (conftest.py) refuses, and users' JAX allows.
SIXTEEN_BIT_SUMS = {"flax_dynamic_scale_before.py", "wholesale_vs_autocast.py"}


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _blocks(page: Path):
    """(info string, code) of every fenced block of a Markdown page."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        yield info, "\n".join(body)


def _language(info: str) -> str:
    return info.split()[0].lower() if info.split() else ""


def _is_include(code: str) -> bool:
    lines = [line for line in code.splitlines() if line.strip()]
    return bool(lines) and all(INCLUDE.match(line) for line in lines)


def _inline_python(page: Path) -> list[str]:
    return [
        code
        for info, code in _blocks(page)
        if _language(info) in ("python", "py") and not _is_include(code)
    ]


@pytest.fixture
def restore_jax_config():
    """Snippets may switch debug flags (jax.debug_infs); undo them whatever happens."""
    names = ["jax_debug_nans", "jax_debug_infs"]
    saved = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in saved.items():
        jax.config.update(n, v)


# --------------------------------------------------------------------------
# Snippets


@pytest.mark.parametrize("path", SNIPPETS, ids=[p.name for p in SNIPPETS])
def test_snippet_runs(path, restore_jax_config, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    with jax.allow_f16_reductions(path.name in SIXTEEN_BIT_SUMS):
        runpy.run_path(str(path), run_name="__main__")
    if path.name in MULTI_DEVICE:
        # The suite runs on eight simulated CPU devices (conftest.py): these
        # snippets split their batch over all of them.
        assert jax.device_count() == 8
        assert "8 devices" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(SHOWN_NOT_RUN))
def test_snippet_shown_not_run_compiles(name):
    path = DOCS / "snippets" / name
    source = path.read_text()
    compile(source, str(path), "exec")
    assert f"import {SHOWN_NOT_RUN[name]}" in source, "the reason it is not run is gone"


def test_every_snippet_is_shown_and_every_include_exists():
    included = set()
    for page in PAGES:
        for line in page.read_text().splitlines():
            m = INCLUDE.match(line)
            if m:
                target = ROOT / m[1]
                assert target.is_file(), f"{page.relative_to(ROOT)} includes missing {m[1]}"
                included.add(target.resolve())
    unused = [p.name for p in ALL_SNIPPETS if p.resolve() not in included]
    assert not unused, f"snippets no page includes: {unused}"
    for name in MULTI_DEVICE | SIXTEEN_BIT_SUMS:
        assert (DOCS / "snippets" / name).is_file()


PAGES_WITH_INLINE_PYTHON = [p for p in PAGES if _inline_python(p)]


@pytest.mark.parametrize(
    "page",
    PAGES_WITH_INLINE_PYTHON,
    ids=[str(p.relative_to(DOCS)) for p in PAGES_WITH_INLINE_PYTHON],
)
def test_inline_python_blocks_run(page, restore_jax_config, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for n, code in enumerate(_inline_python(page)):
        source = textwrap.dedent(code)
        try:
            exec(compile(source, f"{page.relative_to(ROOT)}[block {n}]", "exec"), namespace)
        except Exception as e:
            e.add_note(f"in the Python block {n} of {page.relative_to(ROOT)}:\n{source}")
            raise


def test_quickstart_highlights_the_mpjax_lines():
    """The highlighted lines of the quickstart are the ones that use mpjax."""
    text = (DOCS / "index.md").read_text()
    m = re.search(r'hl_lines="([\d ]+)"\s*\n\s*--8<--\s+"([^"]+)"', text)
    assert m, "docs/index.md: no highlighted snippet include"
    lines = (ROOT / m[2]).read_text().splitlines()
    highlighted = {int(n) for n in m[1].split()}
    using_mpjax = {
        n for n, line in enumerate(lines, 1) if "mpjax" in line and n <= max(highlighted)
    }
    assert highlighted == using_mpjax, [lines[n - 1] for n in sorted(highlighted ^ using_mpjax)]


# --------------------------------------------------------------------------
# README


def _readme_python(heading: str) -> list[str]:
    """The Python blocks of the README section under `heading`."""
    text = (ROOT / "README.md").read_text()
    assert f"\n{heading}\n" in text, f"README.md has no section {heading!r}"
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    lines = section.splitlines()
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if m and _language(m["info"]) in ("python", "py"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == m["fence"])
            blocks.append("\n".join(lines[i + 1 : end]))
    return blocks


def test_readme_three_lines_run_as_pasted(restore_jax_config, monkeypatch, tmp_path, capsys):
    """The README's first example is complete: pasted into a fresh interpreter, it trains."""
    (code,) = _readme_python("## Three lines")
    for line in ["mpjax.autocast(loss_fn)", "mpjax.grad_scaler(optax.adamw(1e-3))"]:
        assert line in code
    assert "mpjax.scaled_value_and_grad(loss, opt_state)(params, batch)" in code
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md[Three lines]", "exec"), namespace)
    losses = [
        float(line.split("loss")[1].split()[0]) for line in capsys.readouterr().out.splitlines()
    ]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses


# --------------------------------------------------------------------------
# Docstrings


def _mpjax_modules():
    modules = [mpjax]
    for info in pkgutil.walk_packages(mpjax.__path__, "mpjax."):
        modules.append(importlib.import_module(info.name))
    return modules


def _doctests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = {}
    for module in _mpjax_modules():
        for test in finder.find(module):
            if test.examples:
                tests.setdefault(test.name, test)
    return [tests[name] for name in sorted(tests)]


DOCTESTS = _doctests()
_EXAMPLE_SECTION = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)


@pytest.mark.parametrize("name", mpjax.__all__)
def test_public_name_has_docstring_with_example(name):
    obj = getattr(mpjax, name)
    doc = obj.__doc__ or ""
    assert doc.strip(), f"mpjax.{name} has no docstring"
    assert _EXAMPLE_SECTION.search(doc), f"mpjax.{name}'s docstring has no Example section"
    assert ">>>" in doc, f"mpjax.{name}'s Example section has no doctest"
    # ... and that doctest is among those test_docstring_example runs.
    assert f"{obj.__module__}.{obj.__qualname__}" in {t.name for t in DOCTESTS}


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_example(test, restore_jax_config):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = []
    result = runner.run(test, out=out.append, clear_globs=True)
    assert result.failed == 0, "".join(out)


# --------------------------------------------------------------------------
# The site


def test_api_page_lists_every_public_name():
    """Each public name once, rendered as what it is. mkdocstrings reads the source, where
    ``mpjax.audit`` is the module mpjax/audit.py: a public name that is also a submodule's
    name must be written with its defining module (``::: mpjax.audit.audit``)."""
    paths = re.findall(r"^:::\s+(mpjax(?:\.\w+)+)\s*$", (DOCS / "api.md").read_text(), re.MULTILINE)
    listed = []
    for path in paths:
        module, _, name = path.rpartition(".")
        submodule = (ROOT / "mpjax" / f"{name}.py").exists() or (ROOT / "mpjax" / name).is_dir()
        assert not (module == "mpjax" and submodule), (
            f"docs/api.md: '::: {path}' renders the module mpjax/{name}.py; "
            f"write '::: {getattr(mpjax, name).__module__}.{name}'"
        )
        assert getattr(importlib.import_module(module), name) is getattr(mpjax, name, None), path
        listed.append(name)
    assert sorted(listed) == sorted(mpjax.__all__)


def test_policy_page_is_generated_from_the_tables():
    sys.path.insert(0, str(DOCS))
    try:
        hooks = importlib.import_module("hooks")
    finally:
        sys.path.remove(str(DOCS))
    from mpjax import interpreter, policy

    text = hooks.policy_markdown()
    for name in [*policy.POLICY, *interpreter.HIGHER_ORDER, *getattr(policy, "LEAN_OVERRIDES", {})]:
        assert f"`{name}`" in text, name
    assert hooks.MARKER in (DOCS / "policy.md").read_text()


def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(NO_MKDOCS_2_WARNING="1"),
    )
    assert result.returncode == 0, (
        "mkdocs build --strict failed (the docs tools come with the test extra: "
        "pip install -e '.[test]'):\n" + result.stdout + result.stderr
    )
    for page in ["index.html", "pytorch/index.html", "policy/index.html", "api/index.html"]:
        assert (tmp_path / "site" / page).is_file(), page
