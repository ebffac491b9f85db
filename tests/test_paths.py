"""No absolute path of one machine in the code: data places are flags whose defaults come from
the project's layout (`training.defaults`: beside the checkout), or from the caller."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("enhancer", "server", "training", "tools", "tests")
ONE_MACHINE = re.compile(r"^/(work|root|home|mnt|scratch|data|Users)(/|$)")


def machine_paths(root: Path = ROOT) -> list[str]:
    """Every string literal of the packages' modules that starts with one machine's folder."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and ONE_MACHINE.match(node.value):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_names_a_path_of_one_machine():
    assert machine_paths() == []


def test_the_check_sees_one(tmp_path):
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "m.py").write_text('DATA = "/work/enhancer-data"\nOK = "../shared"\n')
    assert machine_paths(tmp_path) == ["training/m.py:1: '/work/enhancer-data'"]
