"""stdout that cannot be written (a full disk, ``/dev/full``, a reader that went away) ends ``ppctl`` with one
line on stderr and a non-zero exit, not a traceback; a closed pipe (``| head``) ends it quietly."""

import os
import subprocess
import sys

import pytest

from tests.cli.conftest import REPO

pytestmark = pytest.mark.timeout(120)


def _ppctl_into(stdout, *args: str) -> subprocess.CompletedProcess:
    """``ppctl ARGS`` with its stdout on ``stdout``; stderr captured."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ppctl.cli.app", *args], cwd=REPO, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=100)


@pytest.mark.parametrize("args", [["inspect-layout"], ["inspect-schedule", "--json"],
                                  ["inspect-layout", "parallel.pp=4", "--json"]])
def test_a_full_stdout_is_one_line(args):
    with open("/dev/full", "w") as full:
        result = _ppctl_into(full, *args)
    assert result.returncode == 1 and result.stderr == ("error: cannot write the output to stdout: No space left on "
                                                        "device\n"), result.stderr


def test_a_reader_that_goes_away_ends_it_quietly():
    reader, writer = os.pipe()
    os.close(reader)  # nobody will read: the first write fails with EPIPE
    with os.fdopen(writer, "w") as closed:
        result = _ppctl_into(closed, "inspect-schedule", "parallel.pp=4", "trainer.global_batch_size=64")
    assert result.returncode == 1 and result.stderr == "", result.stderr
