"""The package's import graph keeps its shape: no import circles (imports inside functions counted), no private
names imported across modules, and paths tested for their kind only where that is decided.

The layering itself (format below storage below engines below the public API; adapters
independent of storage) is checked by ``lint-imports`` (pyproject.toml); these checks
cover what its contracts cannot express.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchrl_dcp"
# the dispatch of checkpoint locations and the URL parser: the only modules that look at what a path is
PATH_KIND_MODULES = {"torchrl_dcp.storage.backends", "torchrl_dcp.storage.urls"}
PATH_KIND = re.compile(
    r"\bis_store\(|\bis_url\(|isinstance\([^()]*,\s*\(?[^()]*\b(?:Path|StorePath|PosixPath)\b[^()]*\)"
)


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imports(name: str, path: Path, is_package: bool, modules: dict) -> list[tuple[str, str | None]]:
    """``(imported module, imported name)`` of every runtime import in ``path`` (``if TYPE_CHECKING:`` skipped)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith("torchrl_dcp")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("torchrl_dcp"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    found.append((full, None) if full in modules else (base, a.name))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, (path, is_package) in modules.items():
        for target, imported in _imports(name, path, is_package, modules):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
                if imported and imported.startswith("_") and not imported.startswith("__"):
                    private.append(f"{name} imports {imported} from {target}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circles_counting_imports_inside_functions() -> None:
    edges, _ = _graph()
    assert sum(map(len, edges.values())) > 100  # the walk found the package's imports
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_from_another_module() -> None:
    _, private = _graph()
    assert private == []


def test_paths_are_tested_for_their_kind_only_in_the_dispatch() -> None:
    found = []
    for name, (path, _) in _modules().items():
        if name in PATH_KIND_MODULES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PATH_KIND.search(line) and not line.lstrip().startswith(("#", ">>>")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert found == []
    assert PATH_KIND.search("if isinstance(p, StorePath):") and PATH_KIND.search("is_store(path)")


def test_subpackages_are_attributes_of_the_package_in_a_fresh_interpreter() -> None:
    """The docs call ``tdcp.adapters.register_exact_transform(cls)`` after ``import torchrl_dcp as tdcp``: a
    subpackage is imported on first use (importing the package alone still imports no torch)."""
    import subprocess
    import sys

    code = (
        "import sys; import torchrl_dcp as tdcp; assert 'torch' not in sys.modules; "
        "print(callable(tdcp.adapters.register_exact_transform)); "
        "print(hasattr(tdcp, 'no_such_module'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "False"], proc.stderr[-2000:]
