"""The import graph of `ortspec.runtime`, `ortspec.export` and `ortspec.runtime.bench`, read with `ast`
(nothing is imported): no cycles, and the runtime stays the bottom tier.

Every `import` and `from ... import` counts, at module level or inside a function, with relative
imports resolved; `from PKG import NAME` is an edge to the module `PKG.NAME` when there is one,
else to `PKG`. Imports under `if TYPE_CHECKING:` never run and are left out, as is the implicit
import of a module's parent packages. `importlib.import_module("x")` and `__import__("x")` with
a literal name count as imports of `x`.

The rules:

- no cycle among the three packages' modules (module-level or function-level imports);
- the runtime never imports `ortspec.export` or `ortspec.runtime.bench` at module level (its CLI may
  hand a subcommand over to them inside a function);
- the runtime imports nothing outside the standard library but its own dependencies (numpy,
  onnxruntime, tokenizers): never torch, transformers, onnx or the other export-only packages,
  not even inside a function. The server, `ortspec.runtime.serve` (the `serve` extra), may also
  import its web stack (fastapi, uvicorn, prometheus_client, ...); the rest of the runtime
  reaches the server only inside a function (the CLI's `serve` subcommand). The benchmark may
  import matplotlib and tqdm inside functions; its anchors, the peers they run (torch,
  transformers, onnxruntime_genai), and its serving benchmark, the openai client and
  prometheus_client's parser, each inside functions too.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"ortspec.runtime": ROOT / "runtime", "ortspec.export": ROOT / "export"}
RUNTIME = "ortspec.runtime"
BENCH = "ortspec.runtime.bench"
UPPER_TIERS = ("ortspec.export", BENCH)
RUNTIME_DEPENDENCIES = {"numpy", "onnxruntime", "tokenizers"}  # pyproject's `dependencies`
SERVE = "ortspec.runtime.serve"
SERVE_DEPENDENCIES = {"fastapi", "starlette", "uvicorn", "prometheus_client", "ray",
                      "jinja2", "pydantic", "anyio"}  # pyproject's `serve` extra and theirs
BENCH_DEPENDENCIES = {"matplotlib", "tqdm"}  # pyproject's `bench` extra, inside functions
ANCHORS = BENCH + ".anchors"
# the anchors run the peers in their own venv (scripts/setup_anchors.sh), in a subprocess
ANCHOR_DEPENDENCIES = {"onnxruntime_genai", "torch", "transformers"}
SERVING_BENCH = BENCH + ".serving"
# the serving benchmark drives a server through the official client (the `test` extra) and reads
# its /metrics with the server's own parser (the `serve` extra), inside functions
SERVING_BENCH_DEPENDENCIES = {"openai", "prometheus_client"}
EXPORT_ONLY = {"torch", "transformers", "gguf", "accelerate", "onnx", "onnxscript", "tqdm",
               "safetensors", "huggingface_hub", "matplotlib", "scipy"}


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module's (or package's) dotted name
    line: int
    module_level: bool
    type_only: bool = False  # under `if TYPE_CHECKING:`

    def where(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}" + \
            ("" if self.module_level else " (in a function)") + (" (type-only)" if self.type_only else "")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the three packages."""
    found = {}
    for package, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            rel = path.relative_to(directory).with_suffix("")
            if "__pycache__" in rel.parts:
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _package_of(module: str) -> str:
    """The package relative imports in `module` start from."""
    is_package = MODULES[module].name == "__init__.py"
    return module if is_package else module.rpartition(".")[0]


def _resolve_from(module: str, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = _package_of(module).split(".")
        if node.level - 1 > len(base) - 1:
            raise AssertionError(f"{module}:{node.lineno}: relative import beyond the top package")
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def _dynamic_import(node: ast.Call) -> str | None:
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    if name in ("import_module", "__import__") and node.args and \
            isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"), filename=str(MODULES[module]))
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, module_level, True)
            for child in node.orelse:
                visit(child, module_level, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(module, a.name, node.lineno, module_level, type_only)
                         for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.extend(Import(module, t, node.lineno, module_level, type_only)
                         for t in _resolve_from(module, node))
        elif isinstance(node, ast.Call) and (name := _dynamic_import(node)) is not None:
            found.append(Import(module, name, node.lineno, module_level, type_only))
        inner = module_level and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(tree, True, False)
    return found


ALL_IMPORTS = [imp for m in MODULES for imp in imports_of(m)]


def _internal(target: str) -> str | None:
    """`target`, or the nearest enclosing module of ours, if it is one of the three packages."""
    name = target
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a cycle (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strongconnect(w)
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
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return out


def test_every_module_is_found_and_parses():
    for package, directory in PACKAGES.items():
        assert package in MODULES and (directory / "__init__.py").is_file(), package
    assert {"ortspec.runtime.cli.main", "ortspec.runtime.ort.manifest", "ortspec.export.validate",
            "ortspec.runtime.bench.cli"} <= set(MODULES)
    assert ALL_IMPORTS


def test_relative_imports_resolve_to_real_modules():
    for imp in ALL_IMPORTS:
        if imp.target.startswith("ortspec."):
            assert _internal(imp.target) is not None, imp.where()


def test_there_is_no_import_cycle():
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    how: dict[tuple[str, str], Import] = {}
    for imp in ALL_IMPORTS:
        target = _internal(imp.target)
        if target is not None:
            edges[imp.source].add(target)
            how.setdefault((imp.source, target), imp)
    cycles = _cycles(edges)
    report = []
    for component in cycles:
        members = set(component)
        links = [how[(a, b)].where() for a in component for b in sorted(edges[a] & members)]
        report.append(" <-> ".join(component) + "\n    " + "\n    ".join(links))
    assert not cycles, "import cycles:\n  " + "\n  ".join(report)


def test_the_runtime_never_imports_the_export_or_bench_tiers_at_module_level():
    bad = [imp.where() for imp in ALL_IMPORTS
           if _in(imp.source, RUNTIME) and imp.module_level
           and not any(_in(imp.source, t) for t in UPPER_TIERS)
           and any(_in(imp.target, t) for t in UPPER_TIERS)]
    assert not bad, bad


def test_the_benchmark_never_imports_the_export():
    bad = [imp.where() for imp in ALL_IMPORTS
           if _in(imp.source, BENCH) and _in(imp.target, "ortspec.export")]
    assert not bad, bad


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is 3.10+")
def test_the_runtime_imports_only_the_standard_library_and_its_dependencies():
    bad = []
    for imp in ALL_IMPORTS:
        if not imp.source.startswith(RUNTIME):
            continue
        top = imp.target.partition(".")[0]
        allowed = RUNTIME_DEPENDENCIES | (SERVE_DEPENDENCIES if _in(imp.source, SERVE) else set())
        if _in(imp.source, BENCH):
            allowed = allowed | BENCH_DEPENDENCIES
            if _in(imp.source, ANCHORS) and not imp.module_level:
                allowed = allowed | ANCHOR_DEPENDENCIES
            if _in(imp.source, SERVING_BENCH) and not imp.module_level:
                allowed = allowed | SERVING_BENCH_DEPENDENCIES
        if (top in EXPORT_ONLY and top not in allowed) or not (top in sys.stdlib_module_names or top == "ortspec"
                                      or top in allowed):
            bad.append(imp.where())
    assert not bad, bad


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_runtime_reaches_the_server_only_inside_a_function():
    bad = [imp.where() for imp in ALL_IMPORTS
           if imp.source.startswith(RUNTIME) and not _in(imp.source, SERVE) and imp.module_level
           and _in(imp.target, SERVE)]
    assert not bad, bad


def test_the_checker_sees_cycles_and_type_checking_blocks():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]] and _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n")
    assert _is_type_checking(tree.body[1].test)


def test_type_only_and_function_level_imports_are_counted(tmp_path, monkeypatch):
    """A cycle closed only by a `TYPE_CHECKING` import or by one inside a function is still found."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from .b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "__init__.py").write_text("")
    monkeypatch.setitem(MODULES, "pkg", tmp_path / "__init__.py")
    monkeypatch.setitem(MODULES, "pkg.a", tmp_path / "a.py")
    monkeypatch.setitem(MODULES, "pkg.b", tmp_path / "b.py")
    found = imports_of("pkg.a") + imports_of("pkg.b")
    assert [(i.source, i.target, i.type_only, i.module_level) for i in found if i.target != "typing"] \
        == [("pkg.a", "pkg.b", True, True), ("pkg.b", "pkg.a", False, False)]
    assert _cycles({"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}) == [["pkg.a", "pkg.b"]]
