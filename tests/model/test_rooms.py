"""model/ as one room per family: the family modules (those whose FAMILIES model/families.py joins into its table)
import no other family module, and no class in one skips a parent's constructor (`nn.Module.__init__(self)`,
`super(nn.Module, self).__init__()` inside a subclass). What two families share lives in model/layers.py, where a
change to it is visibly a change to both.

Read from the source (ast), as tests/test_imports.py reads the import graph: function-level and TYPE_CHECKING imports
count too."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

from tests.test_imports import ROOT, edges, modules, product_roots

MODEL = "fusedserve.model"


def family_modules(table: str) -> set[str]:
    """The modules whose FAMILIES the `FAMILIES = ...` assignment of `table` (families.py's source) joins, by the
    names its `from fusedserve.model import ...` / `import fusedserve.model.x as y` statements give them."""
    tree = ast.parse(table)
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == MODEL and not node.level:
            imported.update({alias.asname or alias.name: f"{MODEL}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Import):
            imported.update({alias.asname: alias.name for alias in node.names
                             if alias.asname and alias.name.startswith(MODEL + ".")})
    assignment = next(node for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                      and "FAMILIES" in [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                                         if isinstance(t, ast.Name)])
    listed = {n.value.id for n in ast.walk(assignment.value)
              if isinstance(n, ast.Attribute) and n.attr == "FAMILIES" and isinstance(n.value, ast.Name)}
    return {imported[name] for name in listed}


def skipped_constructors(source: str) -> list[str]:
    """`Class (line N): call` for each explicit parent constructor call inside a class of `source`: `X.__init__(...)`
    for any X but `super()`, and `super(X, ...)` naming another class than the one it sits in (both run some
    ancestor's constructor instead of the parent's)."""
    found = []

    def visit(node: ast.AST, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            if cls is not None and isinstance(child, ast.Call):
                func = child.func
                explicit = isinstance(func, ast.Attribute) and func.attr == "__init__" and not (
                    isinstance(func.value, ast.Call) and getattr(func.value.func, "id", None) == "super")
                named_super = getattr(func, "id", None) == "super" and child.args and not (
                    isinstance(child.args[0], ast.Name) and child.args[0].id == cls)
                if explicit or named_super:
                    found.append(f"{cls} (line {child.lineno}): {ast.unparse(child)}")
            visit(child, inner)

    visit(ast.parse(source), None)
    return found


def _families() -> dict[str, Path]:
    paths = modules(product_roots())
    return {name: paths[name] for name in family_modules((ROOT / "model" / "families.py").read_text())}


def test_the_table_is_read_as_the_package_builds_it():
    """The modules read from families.py's source are those its FAMILIES come from at runtime (the module each
    family's config reader is defined in)."""
    families = importlib.import_module(f"{MODEL}.families")
    assert set(_families()) == {inspect.getmodule(f.read_config).__name__ for f in families.FAMILIES}


def test_no_family_module_imports_another():
    rooms = _families()
    crossing = [str(e) for e in edges(product_roots()) if e.source in rooms and e.target in rooms]
    assert not crossing, "family modules import each other (what they share belongs in model/layers.py):\n" + \
        "\n".join(crossing)


def test_no_family_class_skips_a_parent_constructor():
    skipped = [f"{path.relative_to(ROOT)}: {call}" for path in _families().values()
               for call in skipped_constructors(path.read_text())]
    assert not skipped, "family classes that skip a parent's constructor (derive from a model/layers.py base whose " \
        "constructor does the common part):\n" + "\n".join(skipped)


def test_the_readers_on_made_up_sources():
    table = textwrap.dedent("""
        from fusedserve.model import alpha, beta as b, gamma
        import fusedserve.model.delta as d
        FAMILIES: tuple = alpha.FAMILIES + b.FAMILIES + d.FAMILIES
        OTHER = gamma.FAMILIES
    """)
    assert family_modules(table) == {f"{MODEL}.alpha", f"{MODEL}.beta", f"{MODEL}.delta"}
    source = textwrap.dedent("""
        class Skips(Base):
            def __init__(self):
                nn.Module.__init__(self)
        class SkipsBySuper(Base):
            def __init__(self):
                super(nn.Module, self).__init__()
        class Fine(Base):
            def __init__(self):
                super().__init__()
                super(Fine, self).__init__()
        def outside():
            nn.Module.__init__(object())
    """)
    assert [s.split(":")[0] for s in skipped_constructors(source)] == ["Skips (line 4)", "SkipsBySuper (line 7)"]
