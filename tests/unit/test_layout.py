"""The test tree: pytest imports test files by their base name (no packages), so two tiers must not share one."""

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_unique_across_tiers():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []


OPERATOR = TESTS.parent / "operator" / "src" / "kubetrain" / "operator"
LAYERS = {"runtime": 0, "kueue": 1, "jobs": 2, "sweeps": 3}
"""The operator's subpackages, lowest first; its top-level modules (kopf wiring, the controller) sit above them."""
TOP = len(LAYERS)


def _layer(module: str) -> int:
    """The layer of a kubetrain.operator module by its dotted name."""
    parts = module.split(".")
    return LAYERS.get(parts[2], TOP) if len(parts) > 2 else TOP


def _imports(path: Path) -> list[str]:
    """Every kubetrain.operator module a file imports, TYPE_CHECKING blocks included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kubetrain.operator"):
            found += [node.module] if node.module.count(".") > 1 else [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("kubetrain.operator")]
    return found


def test_the_operators_subpackages_import_only_downwards():
    """runtime <- kueue <- jobs <- sweeps <- the kopf wiring: a module never imports a layer above its own,
    so no two subpackages import each other."""
    upward = []
    for path in sorted(OPERATOR.rglob("*.py")):
        rel = path.relative_to(OPERATOR.parent.parent).with_suffix("")
        here = _layer(".".join(rel.parts))
        upward += [f"{rel} imports {m}" for m in _imports(path) if _layer(m) > here]
    assert upward == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from kubetrain.operator.sweeps import plan\nfrom kubetrain.operator import handlers\n")
    assert [_layer(m) for m in _imports(bad)] == [LAYERS["sweeps"], TOP]
