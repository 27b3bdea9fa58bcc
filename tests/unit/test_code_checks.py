"""The checks engineers expect, run by the test command: ruff's lint and format, mypy on hvdplus/, and a valid
pre-commit configuration that runs the same tools (pyproject.toml holds their settings); and the layout
rules of hvdplus/: no module over 600 lines, no private name imported across modules, no import circle."""

import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)


def _require(module: str) -> None:
    """Skip without the lint extra, except in CI, where scripts/setup.sh installs it and a skip would hide it."""
    if shutil.which(module, path=str(Path(sys.executable).parent)) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not installed beside {sys.executable}: scripts/setup.sh installs the dev extra")
        pytest.skip(f"{module} is not installed (pip install -e '.[lint]')")


def test_ruff_check_passes():
    _require("ruff")
    result = _run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    _require("ruff")
    result = _run(sys.executable, "-m", "ruff", "format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_passes_on_the_package():
    _require("mypy")
    result = _run(sys.executable, "-m", "mypy")  # files and strictness from [tool.mypy] in pyproject.toml
    assert result.returncode == 0 and "Success" in result.stdout, result.stdout + result.stderr


def test_pre_commit_runs_the_same_checks():
    _require("pre-commit")
    result = _run(sys.executable, "-m", "pre_commit", "validate-config", ".pre-commit-config.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    for hook in ("ruff check", "ruff format", "python -m mypy"):
        assert f"entry: {hook}" in config, hook
    hook_versions = set(re.findall(r'"ruff==([^"]+)"', config))
    extra_versions = set(re.findall(r'"ruff==([^"]+)"', (ROOT / "pyproject.toml").read_text()))
    assert len(hook_versions) == 1 and hook_versions == extra_versions, "the hooks' ruff must be the lint extra's"


def test_torch_modules_convert_tensors_through_one_layer():
    """One tensor-to-buffer layer (hvdplus/torch/buffers.py) for every torch feature: no module reaches into the
    collectives' private helpers (mpi_ops' `_numpy` and the like), where a host-only copy could hide."""
    offenders = []
    for path in sorted((ROOT / "hvdplus" / "torch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hvdplus.torch.mpi_ops":
                offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not offenders, offenders


PACKAGE = ROOT / "hvdplus"
MAX_MODULE_LINES = 600
OVERSIZED_MODULES: set[str] = set()  # none: a module that grows past the limit is split


def _modules() -> dict[str, Path]:
    """Every module of hvdplus/, by dotted name (a package by its own name, for its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports of a module's top level, in a top-level if (`if TYPE_CHECKING:` included: a circle of type-only
    imports still ties the modules together), try or with; never those inside a function or class body."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level_imports(block)
        elif isinstance(node, ast.With):
            yield from _module_level_imports(node.body)


def _import_graph() -> dict[str, set[str]]:
    """Which hvdplus modules each hvdplus module imports at its top level. `from pkg import name` counts as an
    import of pkg.name where that is a module, else of pkg; a parent package that Python imports on the way is not
    counted (every submodule would otherwise sit in a circle with the package __init__ that imports it)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.level == 0 and node.module is not None:
                targets = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                    for alias in node.names
                ]
            else:
                targets = []
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_module_is_over_600_lines():
    """A module does one job; past 600 lines it does several, and one is split out (docs/how-it-works.md, 'Where
    the code lives', says which package holds what)."""
    oversized = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert set(oversized) <= OVERSIZED_MODULES, oversized
    assert OVERSIZED_MODULES <= set(oversized), f"now short enough, drop from OVERSIZED_MODULES: {oversized}"


# Private names that another module may import, each with the reason it is not made public.
PRIVATE_IMPORTS = {
    # Horovod's class names: horovod.torch.optimizer defines both, and hvdplus.torch.optimizer holds both.
    ("hvdplus.torch._optimizer", "_DistributedOptimizer"),
    ("hvdplus.torch._adasum_optimizer", "_DistributedAdasumOptimizer"),
    # horovod.tensorflow re-exports horovod.tensorflow.util's underscored helpers (Horovod's tests call
    # hvd._executing_eagerly()); hvdplus.tensorflow does the same.
    ("hvdplus.tensorflow.util", "_executing_eagerly"),
    ("hvdplus.tensorflow.util", "_make_subgraph"),
    ("hvdplus.tensorflow.util", "_cache"),
}


def test_no_private_name_is_imported_from_another_module():
    """A leading underscore means 'this module's own': a name another hvdplus module needs is made public instead,
    so a reader of the owner sees every name the rest of the package relies on. A private module is its package's
    own, so the package's __init__ may import it (hvdplus.torch registers its `_half_kernels` at import). Private
    names of torch itself, where hvdplus has no public way, are torch's to keep and not checked here."""
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("hvdplus"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                own_module = path.name == "__init__.py" and node.module == name and f"{name}.{alias.name}" in modules
                if private and not own_module and (node.module, alias.name) not in PRIVATE_IMPORTS:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
    assert not offenders, "\n".join(offenders)
    used = {
        (node.module, alias.name)
        for path in modules.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert PRIVATE_IMPORTS <= used, f"no longer imported, drop from PRIVATE_IMPORTS: {PRIVATE_IMPORTS - used}"


def test_no_import_circle_among_the_modules():
    """Every module imports only modules below it, so each can be read (and imported) on its own. Type-only imports
    count too (a type both modules need moves below them); an import inside a function does not."""
    circles = _circles(_import_graph())
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)


def test_the_import_graph_reads_what_python_runs():
    """The circle check sees module-level imports, type-only ones included, and only those."""
    graph = _import_graph()
    assert "hvdplus.common.settings" in graph["hvdplus.common.basics"]
    assert "hvdplus.torch.mpi_ops" in graph["hvdplus.torch"]
    source = "import a\nif TYPE_CHECKING:\n    import b\ntry:\n    import c\nexcept ImportError:\n    import d\n"
    source += "def f():\n    import e\n"
    names = [alias.name for node in _module_level_imports(ast.parse(source).body) for alias in node.names]
    assert names == ["a", "b", "c", "d"]
    assert _circles({"x": {"y"}, "y": {"x", "z"}, "z": set()}) == [["x", "y"]]
