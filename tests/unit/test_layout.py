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


TRAINER = TESTS.parent / "trainer-image" / "src" / "kubetrain" / "trainer"
TRAINER_LAYERS = {
    "config": 0, "lora": 1, "model": 1, "schedule": 1, "observe": 2, "data": 3, "checkpoint": 4, "parallel": 5,
    "preflight": 6, "export": 6, "loop": 7, "main": 8, "__main__": 9,
}
"""The trainer's packages and top-level modules, lowest first: a module imports only its own layer or lower."""
TRAINER_TOP_MODULES = 10
"""At most this many modules beside the packages: the entry point, config, the loop, the model, preflight, schedule,
export, lora."""


def _trainer_module(path: Path) -> str:
    rel = path.relative_to(TRAINER.parent.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _trainer_layer(module: str) -> int:
    """The layer of a kubetrain.trainer module; the package itself (its __init__) is the lowest."""
    parts = module.split(".")
    return TRAINER_LAYERS[parts[2]] if len(parts) > 2 else -1


def _trainer_imports(path: Path) -> list[str]:
    """Every kubetrain.trainer module a file imports (anywhere in it: TYPE_CHECKING blocks and function-level
    imports too), by the module's name: `from kubetrain.trainer.observe import progress` is observe.progress."""
    modules = {_trainer_module(p) for p in TRAINER.rglob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kubetrain.trainer"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            found += subs or [node.module]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("kubetrain.trainer")]
    return found


def _trainer_graph() -> dict[str, set[str]]:
    return {_trainer_module(p): set(_trainer_imports(p)) for p in sorted(TRAINER.rglob("*.py"))}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_trainers_layers_import_only_downwards():
    """config <- model, schedule <- observe <- data <- checkpoint <- parallel <- preflight, export <- loop <- main."""
    upward = [
        f"{module} imports {m}"
        for module, imports in _trainer_graph().items()
        for m in imports
        if _trainer_layer(m) > _trainer_layer(module)
    ]
    assert upward == []


def test_no_two_trainer_modules_import_each_other_even_through_others():
    assert _cycles(_trainer_graph()) == []


def test_the_trainers_top_level_holds_only_its_entry_point_and_core_modules():
    top = sorted(p.stem for p in TRAINER.glob("*.py") if p.stem != "__init__")
    packages = sorted(p.name for p in TRAINER.iterdir() if (p / "__init__.py").is_file())
    assert len(top) <= TRAINER_TOP_MODULES
    assert sorted([*top, *packages]) == sorted(TRAINER_LAYERS)


def test_the_trainer_checks_see_an_upward_import_and_a_cycle(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from kubetrain.trainer.parallel.engines import Engine\nfrom kubetrain.trainer import loop\n")
    assert [_trainer_layer(m) for m in _trainer_imports(bad)] == [TRAINER_LAYERS["parallel"], TRAINER_LAYERS["loop"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
