"""The layout of the product, read from the source with `ast` (nothing is imported): modules and
classes small enough to read whole, the service's top level kept to a few modules (the rest grouped
by role in its sub-packages), and no unpickling anywhere in the product."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.test_imports import ROOT, library_imports, parse

PRODUCT = ("enhancer", "server", "training")
TOOLS = ("tools",)
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250
MAX_SERVER_MODULES = 15
FORBIDDEN = ("pickle", "multiprocessing.connection", "dill", "cloudpickle")


def sources(root: Path, packages) -> list[Path]:
    return [p for pkg in packages for p in sorted((root / pkg).rglob("*.py")) if "__pycache__" not in p.parts]


def oversized(root: Path, packages) -> list[tuple[str, str, int]]:
    """(file, what, lines) of every module over MAX_MODULE_LINES and class over MAX_CLASS_LINES."""
    found = []
    for path in sources(root, packages):
        rel = str(path.relative_to(root))
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            found.append((rel, "module", lines))
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                found.append((rel, f"class {node.name}", node.end_lineno - node.lineno + 1))
    return found


def forbidden_imports(root: Path, packages) -> list[tuple[str, int, str]]:
    return sorted((str(p.relative_to(root)), line, lib) for p in sources(root, packages)
            for line, lib, _ in library_imports(p)
            if any(lib == f or lib.startswith(f + ".") for f in FORBIDDEN)
            or (lib == "multiprocessing" and "connection" in p.read_text().splitlines()[line - 1]))


def test_modules_and_classes_are_small_enough_to_read_whole():
    assert oversized(ROOT, PRODUCT + TOOLS) == []


def test_the_service_keeps_few_modules_at_its_top_level():
    top = sorted(p.name for p in (ROOT / "server").glob("*.py"))
    assert "app.py" not in top and "__init__.py" in top
    assert len(top) <= MAX_SERVER_MODULES, top
    for group in ("api", "scheduling", "stepserver"):
        assert (ROOT / "server" / group / "__init__.py").is_file(), group


def test_nothing_in_the_product_unpickles():
    """The step server's transport is a framed binary protocol of raw arrays: no module of the
    product imports pickle or multiprocessing's pickling connections."""
    assert forbidden_imports(ROOT, PRODUCT) == []


def test_the_checks_see_what_they_forbid(tmp_path):
    pkg = tmp_path / "server"
    pkg.mkdir()
    (pkg / "big.py").write_text("class Big:\n" + "    x = 1\n" * 260 + "\n" * 200)
    (pkg / "wire.py").write_text("def f():\n    from multiprocessing.connection import Listener\n"
                                 "import pickle\n")
    assert oversized(tmp_path, ("server",)) == [("server/big.py", "module", 461), ("server/big.py", "class Big", 261)]
    assert forbidden_imports(tmp_path, ("server",)) == [("server/wire.py", 2, "multiprocessing.connection"),
                                                       ("server/wire.py", 3, "pickle")]
