"""The import graph of the product, built from the source with `ast` (no module is imported):
the core (`enhancer`) never imports the service (`server`) or the training code (`training`), and
no module of the three packages imports itself again through others (no import cycle).

Every import statement counts, also one inside a function (a lazy import closes a cycle just the
same when the function runs)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("enhancer", "server", "training")
HARNESS = "tools"  # test, load, fuzz, soak and GPU-box tooling: run from a checkout, never installed
BUILD = "enhancer.build"  # everything of the core that needs torch or onnx
BUILD_LIBRARIES = ("torch", "onnx", "onnxscript", "onnx_ir", "onnxruntime.quantization")
CORE, ABOVE_CORE = "enhancer", ("server", "training")


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of `packages` under `root`."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def parse(path: Path, attempts: int = 3) -> ast.Module:
    """`ast.parse` of a file, retried on CPython 3.11's spurious "AST constructor recursion depth
    mismatch" SystemError (python/cpython#106905; seen once in this suite on 3.11.7): the counter
    it checks is module state shared by all threads, so another thread can upset it. A syntax
    error still fails at once."""
    source = path.read_text()
    for _ in range(attempts - 1):
        try:
            return ast.parse(source, str(path))
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
    return ast.parse(source, str(path))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a name inside a module: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module of the core, what it imports of the packages above it)."""
    return sorted((m, t) for m, targets in graph.items() if m.split(".")[0] == CORE
                  for t in targets if t.split(".")[0] in ABOVE_CORE)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_core_imports_neither_the_service_nor_training():
    graph = import_graph()
    assert len(graph) > 60 and "enhancer.runtime" in graph and "server.scheduling.scheduler" in graph
    assert upward_imports(graph) == []


def test_no_import_cycle_among_the_product_modules():
    assert cycles(import_graph()) == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The checks on a small tree that breaks both rules (so a violation in the product would fail)."""
    def write(rel: str, text: str = "") -> None:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    write("enhancer/__init__.py", "from .config import X\n")
    write("enhancer/config.py", "X = 1\n")
    write("enhancer/cli.py", "def serve():\n    import server.api.app\n")  # lazy, still an upward import
    write("enhancer/model/__init__.py", "from ..config import X\nfrom . import step\n")
    write("enhancer/model/step.py", "from .. import config\n")
    write("server/__init__.py")
    write("server/api/app.py", "from enhancer.config import X\n")
    write("training/__init__.py")
    write("training/cli.py", "from .evaluate import cmd_eval\n")
    write("training/evaluate.py", "def cmd_eval():\n    from .cli import main\n")
    write("training/plots.py", "from training import evaluate\n")
    graph = import_graph(tmp_path)
    assert graph["enhancer.model.step"] == {"enhancer.config"}  # `from .. import config`: the module
    assert graph["enhancer.model"] == {"enhancer.config", "enhancer.model.step"}
    assert graph["training.plots"] == {"training.evaluate"}
    assert upward_imports(graph) == [("enhancer.cli", "server.api.app")]
    assert cycles(graph) == [["training.cli", "training.evaluate"]]


def test_the_harness_is_outside_the_product_and_unused_by_it():
    """The tools import the product; no product module imports a tool (they are not installed)."""
    graph = import_graph(packages=PACKAGES + (HARNESS,))
    assert {"tools.loadtest", "tools.gpu_check", "tools.gpustage", "tools.fuzz", "tools.soak"} <= set(graph)
    users = sorted(m for m, targets in graph.items() if m.split(".")[0] != HARNESS
                   and any(t.split(".")[0] == HARNESS for t in targets))
    assert users == []


def test_the_benchmark_against_peers_is_used_only_by_its_command():
    graph = import_graph()
    assert "training.peers" in graph
    users = sorted(m for m, targets in graph.items() if not m.startswith("training.peers")
                   and any(t == "training.peers" or t.startswith("training.peers.") for t in targets))
    assert users == ["training.cli"]


def library_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, at the top level) of every absolute import in a file, lazy ones included."""
    tree = parse(path)
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module, id(node) in top))
    return found


def runtime_modules(root: Path = ROOT) -> dict[str, Path]:
    """The modules directly in `enhancer/` (the runtime): not those of its sub-packages."""
    return {name: path for name, path in modules(root, ("enhancer",)).items() if name.count(".") <= 1
            and path.parent == root / "enhancer"}


def test_the_runtime_imports_neither_torch_nor_onnx():
    """No module directly in enhancer/ imports torch or onnx, not even inside a function: that is
    what `enhancer.build` holds."""
    mods = runtime_modules()
    assert {"enhancer", "enhancer.engine", "enhancer.runtime", "enhancer.cli", "enhancer.client"} <= set(mods)
    found = [(name, line, lib) for name, path in mods.items() for line, lib, _ in library_imports(path)
             if any(lib == b or lib.startswith(b + ".") for b in BUILD_LIBRARIES)]
    assert found == []


def test_the_runtime_imports_only_what_the_package_declares():
    """The runtime's libraries are the core dependencies of pyproject.toml and onnxruntime (the
    [cpu] or [gpu] extra), nothing the training extra brings (soxr, scipy): a client install and
    the service image have all the runtime imports."""
    import re
    import sys

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].replace("-", "_").lower() for d in project["dependencies"]}
    allowed = declared | {"onnxruntime", "enhancer"} | set(sys.stdlib_module_names)
    used = {(name, lib.split(".")[0]) for name, path in runtime_modules().items() for _, lib, _ in library_imports(path)}
    assert {"numpy", "onnxruntime", "soundfile"} <= {lib for _, lib in used}
    assert sorted((name, lib) for name, lib in used if lib not in allowed) == []
    assert "soxr" not in declared


def test_the_runtime_reaches_the_build_only_lazily():
    """Only the command line and the package's own convenience functions reach `enhancer.build`,
    inside the functions that need it; the rest of the runtime never does."""
    graph, mods = import_graph(), runtime_modules()
    users = sorted(m for m in mods if any(t == BUILD or t.startswith(BUILD + ".") for t in graph[m]))
    assert users == ["enhancer", "enhancer.cli"]
    eager = [(name, line, lib) for name, path in mods.items() for line, lib, top in library_imports(path)
             if top and lib.startswith(BUILD)]
    relative_eager = [(name, node.lineno) for name, path in mods.items() for node in parse(path).body
                      if isinstance(node, ast.ImportFrom) and node.level and (node.module or "").startswith("build")]
    assert eager == [] and relative_eager == []


def test_the_checks_see_torch_in_the_runtime(tmp_path):
    (tmp_path / "enhancer" / "build").mkdir(parents=True)
    (tmp_path / "enhancer" / "__init__.py").write_text("")
    (tmp_path / "enhancer" / "engine.py").write_text("def f():\n    import onnx.helper\n")
    (tmp_path / "enhancer" / "build" / "export.py").write_text("import torch\n")
    mods = runtime_modules(tmp_path)
    assert set(mods) == {"enhancer", "enhancer.engine"}
    assert library_imports(mods["enhancer.engine"]) == [(2, "onnx.helper", False)]
