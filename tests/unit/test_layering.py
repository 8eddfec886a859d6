"""The package's shape: pure math at the bottom, distributed glue above it, the CLI on top.

Imports are read from the source (module level and inside functions alike), so a lazy
import that goes the wrong way is caught as well as a top-level one.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ppctl"

# Pure: no torch at all (layout math, placement, schedules, their programs, checker, simulator, config validation).
PURE = ("ppctl.parallel.layout", "ppctl.parallel.placement", "ppctl.pipeline.schedules", "ppctl.pipeline.program",
        "ppctl.pipeline.replay", "ppctl.pipeline.simulate", "ppctl.pipeline.check", "ppctl.pipeline.interleave",
        "ppctl.optim.lr", "ppctl.optim.loss_scale", "ppctl.config", "ppctl.resolve", "ppctl.checkpoint.files",
        "ppctl.run.interrupt", "ppctl.fileio", "ppctl.bench.rules", "ppctl.model.flops", "ppctl.model.recompute",
        "ppctl.model.family", "ppctl.model.memory_shape", "ppctl.model.hf_format", "ppctl.model.gpt.hf",
        "ppctl.model.llama.hf", "ppctl.model.moe.shape",
        "ppctl.plan", "ppctl.verify.tolerance", "ppctl.verify.runs", "ppctl.verify.shrink")
# The folders are the layers. Each module's level is that of its longest listed prefix (a package covers
# its modules, a module listed alone overrides its package); a module imports only from its level or below.
LEVELS = {
    # 0, foundations that import nothing of ppctl's: file writes, the autograd primitives of the B/W
    # split (below both model/ and parallel/), the placement of stages on ranks (below layout and schedules),
    # the config schema (its dataclasses; config/'s arithmetic builds on the core at level 2).
    "ppctl.fileio": 0, "ppctl.autograd": 0, "ppctl.parallel.placement": 0, "ppctl.config.schema": 0,
    # 1, the pure core and torch building blocks: layout, schedules and their programs, data, TP/CP layers.
    "ppctl.parallel": 1, "ppctl.pipeline": 1, "ppctl.data": 1, "ppctl.optim.lr": 1, "ppctl.optim.loss_scale": 1,
    "ppctl.checkpoint.files": 1, "ppctl.run.interrupt": 1, "ppctl.bench.rules": 1, "ppctl.model.flops": 1,
    "ppctl.model.recompute": 1, "ppctl.model.moe.shape": 1,
    # 2, what the core is configured and run with: the config's arithmetic, the model (a family's settings
    # subclass the schema's), groups, the runtime, the optimizer.
    "ppctl.config": 2, "ppctl.model": 2, "ppctl.data.iterator": 2, "ppctl.parallel.groups": 2,
    "ppctl.pipeline.p2p": 2, "ppctl.pipeline.trace": 2, "ppctl.pipeline.runtime": 2, "ppctl.pipeline.overlap": 2,
    "ppctl.optim": 2,
    "ppctl.checkpoint": 2,
    # 3 and 4, a config built into a model, its pipeline stages, the single-process reference, checkpoints; the
    # config composed, validated and resolved once (resolve/: above the model families it asks, the optimizer's
    # rules, and the planner's balancer and memory model its split under parallel.balance=auto asks), and above
    # it the planner's search, which resolves each candidate.
    "ppctl.plan": 3, "ppctl.resolve": 4, "ppctl.plan.search": 5,
    "ppctl.model.from_config": 3, "ppctl.model.stages": 4, "ppctl.run.reference": 4, "ppctl.checkpoint.state": 4,
    "ppctl.checkpoint.hf_export": 4,  # ppctl export: a checkpoint and its run's config as a Hugging Face folder
    # 5, the launch path (run/): the training loop and what it logs, the launcher's parts (supervise, proctree,
    # rundir, rendezvous, failures, the resume point), the launcher and a run's start (the launch's work behind the
    # command line). The worker each torchrun process starts runs train, check-cluster or bench: an entry point
    # beside the commands (cli/worker.py), above run/ and bench/.
    "ppctl.run": 5,
    # 5, ``ppctl bench``'s workers: the trainer against torch.distributed.pipelining or a plain loop.
    "ppctl.bench": 5,
    # 5, ``ppctl generate``: a run's checkpoint or a Hugging Face folder as one chunk, decoded with a KV cache.
    "ppctl.generate": 5,
    # 5, ``ppctl verify``: two train runs, read back and judged by the tolerance rule (itself pure, at level 1).
    "ppctl.verify": 5, "ppctl.verify.tolerance": 1,
    # 6 and 7, the faces (cli/): the reports, then the commands on top.
    "ppctl.cli": 6, "ppctl.cli.app": 7,
}
# The lazy imports allowed to go up, each with why. None: the split parallel.balance=auto chooses is made where the
# config is resolved (ppctl.resolve.resolved, above the planner's balancer and memory model), not in config/derived.
UPWARD_LAZY_IMPORTS: set[tuple[str, str]] = set()
# Resolve once: what a config describes (its layout, schedule, split and layer map) is built by
# ppctl.resolve.resolved and read from the ResolvedConfig; outside config/ no module builds them again.
RESOLVED_ONCE = ("layout_of", "configured_schedule", "pipeline_layout_of", "schedule_placement")
# The only modules at the top of the package: everything else lives in a folder that says what it is.
TOP_LEVEL_MODULES = {"ppctl", "ppctl.fileio"}
# Foundations: they import nothing of ppctl's, so anything may build on them.
FOUNDATIONS = ("ppctl.fileio", "ppctl.autograd", "ppctl.parallel.placement", "ppctl.config.schema")


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
    """Module -> the package's modules it imports (the ``UPWARD_LAZY_IMPORTS`` left out)."""
    files = module_files()
    return {name: {dep for dep in imported_names(name, path)
                   if dep in files and dep != name and (name, dep) not in UPWARD_LAZY_IMPORTS}
            for name, path in files.items()}


def test_the_allowed_upward_imports_are_lazy_and_still_there():
    files = module_files()
    for name, dep in UPWARD_LAZY_IMPORTS:
        tree = ast.parse(files[name].read_text())
        top_level = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                top_level.add(node.module)
            elif isinstance(node, ast.Import):
                top_level.update(alias.name for alias in node.names)
        assert dep in imported_names(name, files[name]), f"{name} no longer imports {dep}: drop it from the list"
        assert dep not in top_level, f"{name} imports {dep} at module level; only a lazy import may go up"


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


def test_the_top_level_holds_only_the_shared_modules():
    loose = {name for name in module_files() if name.count(".") == 1} - TOP_LEVEL_MODULES
    loose = {name for name in loose if not (PACKAGE / name.split(".")[1]).is_dir()}
    assert not loose, f"loose modules at the package's top: {sorted(loose)}; put each in the folder of its kind"


def is_foundation(name: str) -> bool:
    """Whether ``name`` is (in) one of the FOUNDATIONS."""
    return any(name == base or name.startswith(base + ".") for base in FOUNDATIONS)


def test_foundations_import_nothing_of_ppctl():
    for name, deps in internal_graph().items():
        if is_foundation(name):
            outside = {dep for dep in deps if dep != "ppctl" and not is_foundation(dep)}
            assert not outside, f"{name} is a foundation but imports {sorted(outside)}"


def test_only_the_config_package_builds_what_a_resolved_config_holds():
    imports = {name: imported_names(name, path) for name, path in module_files().items()
               if not name.startswith(("ppctl.config", "ppctl.resolve"))}
    built_again = sorted((name, helper) for name, names in imports.items() for helper in RESOLVED_ONCE
                         if any(imported.endswith("." + helper) for imported in names))
    assert not built_again, f"read these from the ResolvedConfig (ppctl.resolve.resolved) instead: {built_again}"
