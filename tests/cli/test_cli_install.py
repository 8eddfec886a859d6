"""``pip install .`` without extras gives working commands: every third-party module ppctl imports is a runtime
dependency of ``pyproject.toml``.

Two checks. Each top-level module ppctl's source imports (read with ``ast``) that is not the standard library's
belongs to a distribution among the closure of the runtime dependencies (``[project] dependencies``, each one's own
requirements in this venv, extras' requirements left out as pip leaves them out). And the commands run where only
that closure is installed: a fresh venv (``python -m venv --without-pip``) whose ``site-packages`` links each
distribution of the closure (its files and its ``dist-info``) from this venv, and ppctl on a ``.pth``: what
``pip install .`` gives, without installing torch again (a fresh ``pip install`` of the closure costs minutes and the
network; linking it, a second). There one Python process runs the Typer app: ``ppctl train --dry-run`` from a tiny
GPT-2 Hugging Face folder (``model.init_from`` validated: its headers and shapes), ``ppctl export`` of a run
directory (its checkpoint written in this process, ``tests/harness/tiny_run.py``) and ``ppctl generate`` from the
folder (which reads its weights as ``model.init_from``'s workers do, with ``safetensors``). Before ``safetensors``
became a runtime dependency export and generate failed there (``ModuleNotFoundError: No module named
'safetensors'``). Measured: about 8 s.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.char_tokenizer import save_char_tokenizer
from tests.harness.hf_models import VOCAB, overrides, save_tiny
from tests.harness.tiny_run import save_step, tiny_run

tomllib = pytest.importorskip("tomllib")  # Python 3.11's: reads pyproject.toml

pytestmark = [pytest.mark.cli, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
# The three commands, run by the fresh venv's interpreter in one process; prints each one's exit code and output.
DRIVER = """
import json, sys, time
from typer.testing import CliRunner
from ppctl.cli.app import app

results = []
for args in json.loads(sys.argv[1]):
    started = time.monotonic()
    result = CliRunner().invoke(app, args)
    results.append({"args": args[:1], "exit_code": result.exit_code, "output": result.output[-2000:],
                    "exception": repr(result.exception) if result.exit_code else None,
                    "seconds": round(time.monotonic() - started, 1)})
print(json.dumps(results))
"""


def runtime_requirements() -> list[str]:
    """``[project] dependencies`` of ``pyproject.toml``."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def runtime_closure(requirements: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """Every distribution of this venv that ``requirements`` bring, theirs included, by name; a requirement whose
    marker is false here (another platform, an extra nobody asked for) brings nothing, as pip installs nothing."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    closure, pending = {}, [(requirement, ("",)) for requirement in requirements]
    while pending:
        text, extras = pending.pop()
        requirement = Requirement(text)
        if requirement.marker and not any(requirement.marker.evaluate({"extra": extra}) for extra in extras):
            continue
        name = canonicalize_name(requirement.name)
        key = (name, tuple(sorted(requirement.extras)))
        if key in closure:
            continue
        closure[key] = distribution = importlib.metadata.distribution(requirement.name)
        asked = tuple(requirement.extras) or ("",)
        pending += [(child, asked) for child in distribution.requires or []]
    return {name: distribution for (name, _extras), distribution in closure.items()}


def imported_modules(package: Path) -> set[str]:
    """The top-level modules every ``import`` of a package's source names (relative imports left out)."""
    modules = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module.split(".")[0])
    return modules


def test_every_third_party_module_ppctl_imports_is_a_runtime_dependency():
    closure = runtime_closure(runtime_requirements())
    provided = importlib.metadata.packages_distributions()
    from packaging.utils import canonicalize_name

    third_party = sorted(imported_modules(REPO / "ppctl") - set(sys.stdlib_module_names) - {"ppctl", "__future__"})
    missing = {module: provided.get(module) for module in third_party
               if not {canonicalize_name(name) for name in provided.get(module, [])} & set(closure)}
    assert not missing, f"imported by ppctl, brought by no runtime dependency: {missing}"


def fresh_venv(root: Path, distributions) -> Path:
    """A venv at ``root`` holding ``distributions`` (linked from this venv) and ppctl (a ``.pth`` to the checkout);
    its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for distribution in distributions:
        tops = {Path(file).parts[0] for file in distribution.files or []}
        for top in tops - {"..", "__pycache__"}:
            if not (site / top).exists():
                (site / top).symlink_to(Path(distribution.locate_file(top)).resolve())
    (site / "ppctl_checkout.pth").write_text(f"{REPO}\n")
    return root / "bin" / "python"


def test_export_init_from_and_generate_run_with_the_runtime_dependencies_alone(tmp_path):
    python = fresh_venv(tmp_path / "venv", runtime_closure(runtime_requirements()).values())
    folder = save_tiny(tmp_path / "gpt2", tie=True)
    save_char_tokenizer(folder, VOCAB)
    run = tmp_path / "run"
    save_step(run, tiny_run(run), step=1)
    commands = [
        ["train", *overrides(folder, tie=True), f"trainer.out_dir={tmp_path / 'from_folder'}", "--dry-run"],
        ["export", str(run), str(tmp_path / "exported")],
        ["generate", str(folder), "--prompt", "Hello", "--max-new-tokens", "3", "--temperature", "0"],
    ]
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    completed = subprocess.run([str(python), "-c", DRIVER, json.dumps(commands)], cwd=tmp_path, capture_output=True,
                               text=True, timeout=240, env={**env, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.splitlines()[-1])
    failed = [result for result in results if result["exit_code"] != 0]
    assert not failed, (failed, completed.stderr[-3000:])
    print("seconds per command:", {result["args"][0]: result["seconds"] for result in results})
    assert (tmp_path / "exported" / "model.safetensors").is_file()
