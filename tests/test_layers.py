"""The import graph against README.md's layer table ("Code layout"): the table is the one statement
of the layers, read here, so the README and this test cannot disagree.

Rules, over every ``import`` in ``lchat/`` (module level and inside functions alike):

- a module imports only modules of its own layer or of the layers below it (rows further down the
  table);
- nothing but the CLI itself and the wiring imports ``lchat.cli``;
- no module uses another module's private name (``_name``), by ``from m import _name`` or
  ``m._name``; a package's private submodules (``proxy/_oneread_c``) are its own modules' to use;
- every module of the tree has a row, and every name in the table is a module of the tree.

Imports under ``if TYPE_CHECKING:`` are checked like any other: a type named across the layers
is the same coupling as a call.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Known breaches, each being removed by another area of issue 31; the test fails on any other,
# and on an entry here that no longer occurs (so the list only shrinks).
# (importer, imported module, name or "" for an upward import)
KNOWN: frozenset[tuple[str, str, str]] = frozenset()


def layer_table(readme: str = README.read_text(encoding="utf-8")) -> list[tuple[str, list[str]]]:
    """README's layer table, top row first: (layer, the modules it names, dotted). A name in
    parentheses describes its row's module (``backup/`` (``service``, ...)) and is not an entry."""
    section = readme.split("### Code layout", 1)[1]
    rows = re.findall(r"^\| *([^|]+?) *\| *(.+?) *\|$", section, re.M)
    table = []
    for layer, cell in rows[2:]:  # after the header and its rule
        if layer == "---" or not layer.strip():
            break
        table.append((layer, [_dotted(name) for name in re.findall(r"`([^`]+)`", _bare(cell))]))
    return table


def _bare(cell: str) -> str:
    """``cell`` without its parenthesised remarks (which nest)."""
    kept, depth = [], 0
    for char in cell:
        depth += char == "("
        if depth == 0:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return "".join(kept)


def _dotted(name: str) -> str:
    """``mesh/`` -> ``lchat.mesh``; ``objstore/where.py`` -> ``lchat.objstore.where``; a path
    from the repository's root (``twisted/plugins/x.py``) stays rooted there."""
    path = name.removesuffix("/").removesuffix(".py")
    if path == "__init__":
        return "lchat"
    dotted = path.replace("/", ".")
    return dotted if dotted.startswith("twisted.") else "lchat." + dotted


def modules() -> dict[str, Path]:
    """Every module of the tree by its dotted name (a package by its own name)."""
    found = {}
    for path in [*(ROOT / "lchat").rglob("*.py"), *(ROOT / "twisted" / "plugins").glob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, tree: set[str]) -> Iterator[tuple[str, str, int]]:
    """(module imported, name taken from it or "", line) for each ``lchat`` import of a module;
    ``from p import m`` of a submodule ``m`` is an import of ``p.m``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub, "", node.lineno) if sub in tree else (base, alias.name, node.lineno)


def private_uses(name: str, path: Path, tree: set[str]) -> Iterator[tuple[str, str, int]]:
    """(module, private name, line) for each ``m._name`` where ``m`` names another of our modules."""
    syntax = ast.parse(path.read_text(encoding="utf-8"), str(path))
    bound: dict[str, str] = {}  # local name -> the module it names
    for node in ast.walk(syntax):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in tree:
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in tree:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def named(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            outer = named(node.value)
            return f"{outer}.{node.attr}" if f"{outer}.{node.attr}" in tree else None
        return None

    for node in ast.walk(syntax):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            module = named(node.value)
            if module is not None and module != name:
                yield module, node.attr, node.lineno


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def layer_of(module: str, entries: dict[str, int]) -> int | None:
    """The row of the longest table entry that is ``module`` or a package holding it (``lchat``
    itself, the package's ``__init__``, holds nothing: each module has a row of its own)."""
    parts = module.split(".")
    for end in range(len(parts), 1 if len(parts) > 1 else 0, -1):
        if ".".join(parts[:end]) in entries:
            return entries[".".join(parts[:end])]
    return None


def breaches() -> set[tuple[str, str, str]]:
    """Every breach of the rules in the tree: (importer, imported, private name or "")."""
    table = layer_table()
    entries = {entry: row for row, (_, names) in enumerate(table) for entry in names}
    wiring = {entry for entry in table[0][1]}
    tree = modules()
    found: set[tuple[str, str, str]] = set()
    for name, path in tree.items():
        own = layer_of(name, entries)
        for module, taken, _ in imports(name, path, set(tree)):
            if not module.startswith("lchat"):
                continue
            theirs = layer_of(module, entries)
            if own is not None and theirs is not None and theirs < own:
                found.add((name, module, ""))
            if module.startswith("lchat.cli") and not (
                name.startswith("lchat.cli") or layer_of(name, {w: 0 for w in wiring}) == 0
            ):
                found.add((name, module, ""))
            if _private(taken) and not name.startswith(module + "."):
                found.add((name, module, taken))
        for module, taken, _ in private_uses(name, path, set(tree)):
            found.add((name, module, taken))
    return found


class Layers(SynchronousTestCase):
    def test_the_table_covers_the_tree(self) -> None:
        """Every module has a row; every name in the table is a module (or package) of the tree."""
        entries = {entry: row for row, (_, names) in enumerate(layer_table()) for entry in names}
        tree = modules()
        self.assertEqual(sorted(n for n in tree if layer_of(n, entries) is None), [])
        self.assertEqual(sorted(e for e in entries if e not in tree), [])

    def test_imports_follow_the_layers(self) -> None:
        """No upward import, no import of the CLI from outside it and the wiring, no private name
        of another module, beyond KNOWN."""
        self.assertEqual(sorted(breaches() - KNOWN), [])

    def test_known_breaches_still_occur(self) -> None:
        """KNOWN only shrinks: a breach that is gone is deleted from it."""
        self.assertEqual(sorted(KNOWN - breaches()), [])

    def test_the_table_is_read_as_written(self) -> None:
        """The parser on a table of the README's form: parenthesised names describe, not list."""
        text = (
            "### Code layout\n\n| layer | modules |\n|---|---|\n"
            "| top | `tap.py` (`twisted/plugins/x.py`), `twisted/plugins/y.py` |\n"
            "| base | `mesh/` (`api`, `client` (`treq`)), `objstore/where.py`, `__init__.py` |\n"
        )
        self.assertEqual(
            layer_table(text),
            [
                ("top", ["lchat.tap", "twisted.plugins.y"]),
                ("base", ["lchat.mesh", "lchat.objstore.where", "lchat"]),
            ],
        )

    def test_every_way_of_importing_is_seen(self) -> None:
        """Function-level, relative, TYPE_CHECKING and submodule imports, and ``m._name``."""
        path = Path(self.mktemp()) / "lchat" / "mesh" / "probe.py"
        path.parent.mkdir(parents=True)
        path.write_text(
            "from typing import TYPE_CHECKING\n"
            "from lchat import hosts\n"
            "from . import api\n"
            "if TYPE_CHECKING:\n"
            "    from lchat.cli.main import Args\n"
            "def f():\n"
            "    from lchat.tap import _thing\n"
            "    return hosts._norm, api._x\n"
        )
        tree = {"lchat.hosts", "lchat.mesh", "lchat.mesh.api", "lchat.cli.main", "lchat.tap"}
        self.assertEqual(
            [(m, n) for m, n, _ in imports("lchat.mesh.probe", path, tree) if m != "typing"],
            [
                ("lchat.hosts", ""),
                ("lchat.mesh.api", ""),
                ("lchat.cli.main", "Args"),
                ("lchat.tap", "_thing"),
            ],
        )
        self.assertEqual(
            sorted((m, n) for m, n, _ in private_uses("lchat.mesh.probe", path, tree)),
            [("lchat.hosts", "_norm")],  # (a relative import's module is not followed)
        )
        self.assertEqual(layer_of("lchat.mesh.api", {"lchat.mesh": 1, "lchat": 2}), 1)
        self.assertIsNone(layer_of("lchat.hostsx", {"lchat.hosts": 2, "lchat": 2}))
