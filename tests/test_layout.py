"""The repository's layout: no import cycles, and files and functions of mpjax/ that
stay short enough to read.

Imports are read with `ast`, so nothing is executed: every ``import`` and
``from ... import`` statement counts, at module level or inside a function (a
deferred import that closes a cycle is still a cycle). Importing a submodule runs
its package's ``__init__`` first; that implicit step is not an edge, or every
package whose ``__init__`` imports its own submodules would be a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ["mpjax", "benchmarks", "examples", "tests", "docs"]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files(root: Path, dirs) -> list[Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)


def _resolve(name: str, path: Path, root: Path, modules: dict) -> str | None:
    """The repository module `name` means when imported from `path`, if any.

    Absolute names first (the repository root is on the path); then the
    importing file's own directory, which is on the path of scripts and of
    tests (``from conftest import ...``).
    """
    if name in modules:
        return name
    sibling = _module_name(path.parent, root)
    local = f"{sibling}.{name}" if sibling else name
    return local if local in modules else None


def _imports(path: Path, root: Path, modules: dict) -> set[str]:
    """The repository modules `path` imports, anywhere in the file."""
    package = _module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_resolve(alias.name, path, root, modules))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's package, `level - 1` up
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = _resolve(node.module, path, root, modules)
            if source is None:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                # `from pkg import sub` imports the submodule; `from pkg import name`, pkg.
                found.add(submodule if submodule in modules else source)
    found.discard(None)
    found.discard(_module_name(path, root))  # a module reading its own names is no cycle
    return {m for m in found if m in modules}


def import_graph(root: Path, dirs) -> dict[str, set[str]]:
    """Repository module -> the repository modules it imports."""
    files = _python_files(root, dirs)
    modules = {_module_name(p, root): p for p in files}
    return {name: _imports(path, root, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete cycle through the component's first module (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")  # unreachable


def too_long(root: Path, dirs) -> list[str]:
    """Files over MAX_FILE_LINES lines and functions over MAX_FUNCTION_LINES lines.

    A function's lines run from its first decorator to its last line, docstring
    included.
    """
    problems = []
    for path in _python_files(root, dirs):
        text = path.read_text()
        name = path.relative_to(root).as_posix()
        n = len(text.splitlines())
        if n > MAX_FILE_LINES:
            problems.append(f"{name}: {n} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(
                        f"{name}:{node.lineno} {node.name}: {length} lines "
                        f"(at most {MAX_FUNCTION_LINES})"
                    )
    return problems


# --------------------------------------------------------------------------
# The repository


def test_no_import_cycles():
    graph = import_graph(ROOT, SOURCE_DIRS)
    assert "mpjax.interpreter" in graph and graph["mpjax.interpreter"], "import graph not read"
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_mpjax_files_and_functions_are_short():
    problems = too_long(ROOT, ["mpjax"])
    assert not problems, "too long:\n" + "\n".join(problems)


# --------------------------------------------------------------------------
# The checks themselves fail when they should


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_is_found_through_function_level_and_sibling_imports(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\n",
            "pkg/a.py": "from pkg import b\n\ndef f():\n    return b\n",
            "pkg/b.py": "def g():\n    from pkg.c import h\n    return h\n",
            "pkg/c.py": "import pkg.a\nh = 1\n",
            "scripts/run.py": "from helper import x\n",
            "scripts/helper.py": "def x():\n    import run\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg", "scripts"])
    assert graph["pkg"] == {"pkg.a"}  # the package's own submodules: no edge back
    assert sorted(map(tuple, import_cycles(graph))) == [
        ("pkg.a", "pkg.b", "pkg.c", "pkg.a"),
        ("scripts.helper", "scripts.run", "scripts.helper"),
    ]


def test_imports_without_a_cycle_pass(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\n",
            "pkg/a.py": "import numpy\nfrom pkg import b\nfrom . import c\n",
            "pkg/b.py": "from pkg.c import h\n",
            "pkg/c.py": "h = 1\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"}
    assert import_cycles(graph) == []


def test_long_files_and_functions_are_named(tmp_path):
    def lines(indent: str, n: int) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    _write(
        tmp_path,
        {
            # def + 79 lines: at the limit. decorator + def + 79 lines: one over.
            "pkg/ok.py": "def short():\n" + lines("    ", MAX_FUNCTION_LINES - 1),
            "pkg/long.py": "class A:\n    @staticmethod\n    def method():\n"
            + lines("        ", MAX_FUNCTION_LINES - 1),
            "pkg/big.py": "\n" * (MAX_FILE_LINES + 1),
        },
    )
    problems = too_long(tmp_path, ["pkg"])
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"pkg/big.py: {MAX_FILE_LINES + 1} lines")
    assert problems[1].startswith(f"pkg/long.py:3 method: {MAX_FUNCTION_LINES + 1} lines")
