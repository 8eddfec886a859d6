"""The package's shape: pure math at the bottom, distributed glue above it, the CLI on top.

Imports are read from the source (module level and inside functions alike), so a lazy
import that goes the wrong way is caught as well as a top-level one.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ppctl"

# Pure: no torch at all (layout math, schedules, plan, checker, simulator, config validation).
PURE = ("ppctl.parallel.layout", "ppctl.pipeline.schedules", "ppctl.pipeline.messages", "ppctl.pipeline.replay",
        "ppctl.pipeline.comm", "ppctl.pipeline.simulate", "ppctl.pipeline.check", "ppctl.optim.lr",
        "ppctl.optim.loss_scale", "ppctl.config", "ppctl.checkpoint.files",
        "ppctl.interrupt", "ppctl.fileio")
# Each module's level: a module imports only from its own level or below.
LEVELS = {
    "ppctl.parallel.layout": 0, "ppctl.pipeline.schedules": 0, "ppctl.pipeline.messages": 0,
    "ppctl.pipeline.replay": 0, "ppctl.pipeline.comm": 0, "ppctl.pipeline.simulate": 0,
    "ppctl.pipeline.check": 0, "ppctl.pipeline.render": 0, "ppctl.data.tokenizer": 0, "ppctl.data.prepare": 0,
    "ppctl.data.dataset": 0, "ppctl.parallel.tensor_parallel": 0, "ppctl.parallel.context_parallel": 0,
    "ppctl.pipeline.stage": 0, "ppctl.testing": 0, "ppctl.optim.lr": 0, "ppctl.optim.loss_scale": 0,
    "ppctl.model.weight_grad": 0, "ppctl.checkpoint.files": 0, "ppctl.interrupt": 0,
    "ppctl.fileio": 0,
    "ppctl.checkpoint": 1, "ppctl.checkpoint.state": 3,
    "ppctl.config": 1, "ppctl.model": 1, "ppctl.data.iterator": 1, "ppctl.parallel.groups": 1,
    "ppctl.pipeline.p2p": 1, "ppctl.pipeline.trace": 1, "ppctl.pipeline.runtime": 1, "ppctl.optim": 1,
    "ppctl.factory": 2, "ppctl.stages": 3, "ppctl.reference": 3,
    "ppctl.train": 4, "ppctl.logging": 4, "ppctl.cluster": 4,
    "ppctl.worker": 5, "ppctl.launch": 5, "ppctl.layout_report": 5, "ppctl.schedule_report": 5,
    "ppctl.cli": 6,
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name ``path`` imports, anywhere in the file, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def internal_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = module_files()
    return {name: {dep for dep in imported_names(name, path) if dep in files and dep != name}
            for name, path in files.items()}


def level_of(name: str) -> int:
    """The level of ``name``: that of the longest listed prefix (a package covers its modules)."""
    prefixes = [prefix for prefix in LEVELS if name == prefix or name.startswith(prefix + ".")]
    assert prefixes, f"{name} has no level in LEVELS: place it"
    return LEVELS[max(prefixes, key=len)]


def test_no_module_imports_one_above_it():
    graph = internal_graph()
    wrong = [(name, dep) for name, deps in graph.items() if name != "ppctl" for dep in deps
             if dep not in ("ppctl",) and level_of(dep) > level_of(name)]
    assert not wrong, f"imports going up: {wrong}"


def test_import_graph_has_no_cycle():
    graph, state = internal_graph(), {}

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_pure_core_imports_no_torch():
    files = module_files()
    for name, path in files.items():
        if any(name == pure or name.startswith(pure + ".") for pure in PURE):
            torch_imports = {dep for dep in imported_names(name, path) if dep.split(".")[0] == "torch"}
            assert not torch_imports, f"{name} is pure but imports {sorted(torch_imports)}"
