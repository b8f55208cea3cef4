"""The import graph of the product (kernels/, model/, server/ and fusedserve/, under their installed names) and of
bench/: no import cycle, and neither a kernels module nor torch (or triton) reached from the server, in its import
statements or at runtime: the server asks the model package (fusedserve.model.api, fusedserve.model.host) and loads
torch only with a model.

The graph is read from the source (ast), so it holds every import statement, those inside functions included: a
function-level import that only puts off a cycle until the function runs is still a cycle. Imports under
`if TYPE_CHECKING:` are left out of the cycle check (they never run). `importlib.import_module("literal")` counts as
an import of that module; a computed name cannot be read from the source and is not seen.

Nodes are modules: a folder's `__init__.py` is its package's module (fusedserve.kernels is kernels/__init__.py, as
pyproject.toml's package-dir maps the folders). `import a.b.c` is an edge to a.b.c; `from a.b import name` is an edge
to a.b.name where that is a module, else to a.b (the package's __init__, which defines the name). Importing a
submodule also runs its parents' __init__ first, but that is not an edge: otherwise every package whose __init__
imports one of its submodules would be a cycle with it. So a package's __init__ may import its own submodules, as
long as none of them imports the package back (`from pkg import name` for a name its __init__ defines, or `import
pkg`). A cycle is a strongly connected component of more than one module: each of its modules is imported, directly
or not, by every other, so none of them can be understood, loaded or tested without the rest.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "fusedserve.kernels"
SERVER = "fusedserve.server"


def product_roots(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> folder: pyproject.toml's package-dir (the product), and bench/ (run from the root)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {**{name: root / folder for name, folder in mapping.items()}, "bench": root / "bench"}


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the imported module (a node of the graph)
    path: Path  # where the import statement is
    line: int
    function_level: bool  # inside a function: runs when the function is first called
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs

    def __str__(self) -> str:
        where = "function-level" if self.function_level else "module-level"
        return f"{self.path}:{self.line}: {self.source} -> {self.target} ({where})"


def modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py file under each root folder, named under the root's package."""
    found: dict[str, Path] = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _ImportStatements(ast.NodeVisitor):
    """Every import in a module: (line, module name or None, imported names, level, function-level, type-checking)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str | None, tuple[str, ...], int, bool, bool]] = []
        self._functions = self._type_checking = 0

    def _record(self, node: ast.AST, module: str | None, names: tuple[str, ...], level: int) -> None:
        self.found.append((node.lineno, module, names, level, self._functions > 0, self._type_checking > 0))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._type_checking += 1
        for child in node.body:
            self.visit(child)
        self._type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def _function(self, node: ast.AST) -> None:
        self._functions += 1
        self.generic_visit(node)
        self._functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._record(node, alias.name, (), 0)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._record(node, node.module, tuple(alias.name for alias in node.names), node.level)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._record(node, node.args[0].value, (), 0)
        self.generic_visit(node)


def _known(name: str, known: dict[str, Path]) -> str | None:
    """`name` if it is a module of the graph, else its longest prefix that is, else None (outside the graph)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def edges(roots: dict[str, Path]) -> list[Edge]:
    """Every import between modules of the graph (self-imports left out), from the source of each."""
    known = modules(roots)
    out = []
    for source, path in known.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        visitor = _ImportStatements()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for line, module, names, level, function_level, type_checking in visitor.found:
            if level:
                base = package.split(".")
                base = ".".join(base[: len(base) - (level - 1)] + ([module] if module else []))
            else:
                base = module or ""
            targets = [_known(f"{base}.{n}", known) if f"{base}.{n}" in known else _known(base, known)
                       for n in names] if names else [_known(base, known)]
            for target in dict.fromkeys(t for t in targets if t is not None and t != source):
                out.append(Edge(source, target, path, line, function_level, type_checking))
    return out


def cycles(found: list[Edge]) -> list[list[Edge]]:
    """The import cycles of `found` (TYPE_CHECKING imports left out): per strongly connected component of more than
    one module, the edges inside it."""
    graph = nx.DiGraph()
    graph.add_edges_from((e.source, e.target) for e in found if not e.type_checking)
    out = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            out.append(sorted((e for e in found if not e.type_checking and e.source in component
                               and e.target in component), key=lambda e: (e.source, e.line)))
    return sorted(out, key=lambda c: c[0].source)


def describe(cycle: list[Edge]) -> str:
    files = sorted({str(e.path.relative_to(ROOT) if e.path.is_relative_to(ROOT) else e.path) for e in cycle})
    return f"a cycle of {len(files)} files: {', '.join(files)}\n" + textwrap.indent("\n".join(map(str, cycle)), "    ")


# ---- the product and bench --------------------------------------------------------------------------------------
def test_no_import_cycles():
    found = cycles(edges(product_roots()))
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(map(describe, found))


def test_the_server_imports_no_kernels_module():
    """Every import statement under server/, TYPE_CHECKING ones included: the server knows a model only through
    fusedserve.model's protocol, and not even a type of the kernels."""
    offending = [e for e in edges(product_roots()) if (e.source == SERVER or e.source.startswith(SERVER + "."))
                 and (e.target == KERNELS or e.target.startswith(KERNELS + "."))]
    assert not offending, "the server imports kernels modules:\n" + "\n".join(map(str, offending))


# the server's own modules never import these: torch and triton come with a model, through fusedserve.model
DEVICE_LIBRARIES = ("torch", "triton")


def _server_files() -> dict[str, Path]:
    return {m: p for m, p in modules(product_roots()).items() if m == SERVER or m.startswith(SERVER + ".")}


def test_the_server_imports_no_torch():
    """Every import statement under server/, function-level and TYPE_CHECKING ones included."""
    offending = []
    for module, path in _server_files().items():
        visitor = _ImportStatements()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for line, name, _, level, _, _ in visitor.found:
            if not level and name and name.split(".")[0] in DEVICE_LIBRARIES:
                offending.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {name}")
    assert not offending, "the server imports device libraries:\n" + "\n".join(offending)


def test_importing_the_server_loads_no_kernels_module(tmp_path):
    """In a fresh interpreter: fusedserve.server.app, then every other server module; after each, whether any
    fusedserve.kernels module, torch or triton is in sys.modules (through fusedserve.model or anything else)."""
    server = sorted(m for m in modules(product_roots()) if m == SERVER or m.startswith(SERVER + "."))
    names = [f"{SERVER}.app", *(m for m in server if m != f"{SERVER}.app")]
    script = textwrap.dedent("""
        import importlib, json, sys
        loaded, failed = {}, {}
        for name in json.loads(sys.argv[1]):
            try:
                importlib.import_module(name)
            except BaseException as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
            for module in sys.modules:
                if module.split(".")[0] in ("torch", "triton") or module == "fusedserve.kernels" \
                        or module.startswith("fusedserve.kernels."):
                    loaded.setdefault(module.split(".")[0] if "kernels" not in module else module, name)
        print(json.dumps({"loaded": loaded, "failed": failed}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # run away from the repository's root, where the bare folders kernels/, model/ and server/ sit
    result = subprocess.run([sys.executable, "-c", script, json.dumps(names)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}, f"server modules that do not import: {report['failed']}"
    assert report["loaded"] == {}, "importing the server loads kernels modules or torch (module: first loaded by " \
        "importing):\n" + "\n".join(f"    {m}: {by}" for m, by in sorted(report["loaded"].items()))


ROOT_IMPORTS = """
import json, sys
import sentence_transformers
from transformers import PreTrainedModel
import kernels, fusedserve.kernels
outcome = {"kernels": kernels.__file__, "ours": fusedserve.kernels.__file__, "select": hasattr(kernels, "select")}
for bare in ("model", "server"):
    try:
        __import__(bare)
        outcome[bare] = sys.modules[bare].__file__
    except ModuleNotFoundError as exc:
        outcome[bare] = str(exc)
print(json.dumps(outcome))
"""


def test_the_real_libraries_import_from_the_repository_root():
    """`python -c` in the checkout's root (the root first on sys.path, beside the folders kernels/, model/, server/):
    sentence-transformers and transformers import (transformers' probe imports Hugging Face's `kernels`), the bare
    `kernels` is theirs and fusedserve.kernels ours, and the bare `model` and `server` are no module of ours."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH")}
    result = subprocess.run([sys.executable, "-c", ROOT_IMPORTS], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(found["ours"]) == root / "kernels" / "__init__.py"
    assert Path(found["kernels"]).parent.parent.name == "site-packages" and not found["select"], found
    for bare in ("model", "server"):
        assert found[bare].startswith(f"No module named '{bare}'") and f"fusedserve.{bare}" in found[bare], found
    served = subprocess.run([sys.executable, "-m", "server"], cwd=root, env=env, capture_output=True, text=True,
                            timeout=120)
    assert served.returncode != 0 and "fusedserve serve" in served.stderr, served.stderr


# ---- the helpers, on a package made up here ---------------------------------------------------------------------
def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


TOY = {  # folder toy_src/ installed as the package "top.toy", as pyproject maps kernels/ to fusedserve.kernels
    "__init__.py": "from top.toy import a, f\n",  # a package importing its own submodules: fine
    "a.py": "from top.toy import b\nimport top.toy.c as c\n",
    "b.py": "def later():\n    from top.toy.a import thing  # dodges the cycle until called: still one\n",
    "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from top.toy import a\nelse:\n    import os\n",
    "d.py": "from . import e\n",
    "e.py": "from .d import name\nimport importlib\nimportlib.import_module('top.toy.c')\n",
    "f.py": "from top.toy import VERSION  # a name of the package's __init__: imports the package back\n",
    "sub/__init__.py": "",
    "sub/g.py": "from .. import a\nfrom ..c import x\nimport torch.nn\n",
}


def test_the_helpers_on_a_made_up_package(tmp_path):
    _write(tmp_path / "toy_src", TOY)
    roots = {"top.toy": tmp_path / "toy_src"}
    assert set(modules(roots)) == {"top.toy", *(f"top.toy.{m}" for m in "abcdef"), "top.toy.sub", "top.toy.sub.g"}
    found = edges(roots)
    pairs = {(e.source, e.target) for e in found}
    assert pairs == {("top.toy", "top.toy.a"), ("top.toy", "top.toy.f"), ("top.toy.a", "top.toy.b"),
                     ("top.toy.a", "top.toy.c"), ("top.toy.b", "top.toy.a"), ("top.toy.c", "top.toy.a"),
                     ("top.toy.d", "top.toy.e"), ("top.toy.e", "top.toy.d"), ("top.toy.e", "top.toy.c"),
                     ("top.toy.f", "top.toy"), ("top.toy.sub.g", "top.toy.a"), ("top.toy.sub.g", "top.toy.c")}
    by_pair = {(e.source, e.target): e for e in found}
    assert by_pair["top.toy.b", "top.toy.a"].function_level and not by_pair["top.toy.a", "top.toy.b"].function_level
    assert by_pair["top.toy.c", "top.toy.a"].type_checking and by_pair["top.toy.b", "top.toy.a"].line == 2
    # the package and f, which imports it back; a <-> b through the function-level import; d <-> e through relative
    # imports; not a -> c -> a (c's import of a is under TYPE_CHECKING), nor the package's imports of its submodules
    assert [sorted({e.source for e in cycle}) for cycle in cycles(found)] == [
        ["top.toy", "top.toy.f"], ["top.toy.a", "top.toy.b"], ["top.toy.d", "top.toy.e"]]
    message = describe(cycles(found)[2])
    assert "a cycle of 2 files" in message and "d.py" in message and "e.py:1: top.toy.e -> top.toy.d" in message


def test_the_helpers_find_no_cycle_where_there_is_none(tmp_path):
    acyclic = {**TOY, "b.py": "import top.toy.c\n", "e.py": "import importlib\nimportlib.import_module('top.toy.c')\n",
               "f.py": "VERSION = 1\n"}
    _write(tmp_path / "toy_src", acyclic)
    found = edges({"top.toy": tmp_path / "toy_src"})
    assert ("top.toy.c", "top.toy.a") in {(e.source, e.target) for e in found}  # there, but under TYPE_CHECKING
    assert cycles(found) == []
