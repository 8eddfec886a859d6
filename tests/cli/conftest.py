"""End-to-end CLI tests: run ``ppctl`` in a subprocess as a user would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.runs import single_run  # noqa: F401  (a fixture shared by the CLI tests)

REPO = Path(__file__).resolve().parents[2]


def run_ppctl(*args: str, cwd: Path | None = None, timeout: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m ppctl.cli.app ARGS`` (with ``env`` added to this process's environment); return the
    completed process (text output)."""
    env = {**os.environ, **(env or {}), "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "ppctl.cli.app", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ppctl():
    return run_ppctl
