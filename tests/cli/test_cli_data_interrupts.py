"""A signal while ``ppctl prepare-data`` tokenises: one line, 128 + the signal, and the cache as it was.

With ``data.num_proc=2`` the ``datasets`` map runs in a pool of forked processes. SIGINT goes to
ppctl's whole process group, as a terminal's Ctrl-C does; SIGTERM to ppctl alone, as ``kill`` does.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cli.conftest import REPO, run_ppctl
from tests.cli.test_cli_data_refusals import prepare_args

NUM_ROWS = 600_000  # short rows: tokenising them takes seconds, loading them less


def start_ppctl(*args: str) -> subprocess.Popen:
    """Start ``python -m ppctl.cli.app ARGS`` as ``run_ppctl`` runs it, in a session of its own (as a terminal's
    foreground job: its own process group)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ppctl.cli.app", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_until_tokenising(cache_dir, process: subprocess.Popen, timeout_s: float = 90) -> None:
    """Return once the map writes its first tokens: a ``tmp*`` file in the scratch folder (the loader's own files
    are elsewhere in it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if any(cache_dir.glob(".hf-scratch-*/tmp*")):
            return
        time.sleep(0.02)
    raise AssertionError("tokenising did not begin")


@pytest.mark.timeout(240)
# the SIGINT case also tokenises again to the end: what the cache is left as does not depend on the signal, and a
# second full tokenising of the corpus is a tenth of a minute of the suite
@pytest.mark.parametrize("signum, to_group, then_complete", [(signal.SIGINT, True, True),
                                                             (signal.SIGTERM, False, False)])
def test_a_signal_while_tokenising_ends_in_one_line_and_leaves_the_cache_as_it_was(tmp_path, signum, to_group,
                                                                                 then_complete):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"row {number}"}) + "\n" for number in range(NUM_ROWS)))
    args = prepare_args(corpus, tmp_path, "data.num_proc=2")
    cache_dir = tmp_path / "cache"
    process = start_ppctl(*args)
    try:
        wait_until_tokenising(cache_dir, process)
        os.killpg(process.pid, signum) if to_group else process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    assert (process.returncode, stdout, stderr.splitlines()) == (128 + signum, "", [
        f"error: interrupted by {name} while tokenising data.path={corpus}; the cache was left as it was"]), stderr
    # nothing half-written, no scratch or temporary file: at most the memo of input digests
    assert set(os.listdir(cache_dir)) <= {"file-digests.json"}
    if not then_complete:
        return
    completed = run_ppctl(*args)
    assert completed.returncode == 0 and f"tokens from {NUM_ROWS:,} document(s)" in completed.stdout, completed.stderr
    assert sorted(path.suffix for path in cache_dir.glob("text-corpus-byte-*")) == [".bin", ".json"]


# ppctl, its Dataset.__del__ sending SIGINT to ppctl once: the signal comes while Python runs a finalizer, whose
# exceptions it swallows ("Exception ignored in"): as one Ctrl-C in ten did while a real pool tokenised
SIGNAL_IN_DATASET_DEL = """
import os, signal, sys
import datasets
from ppctl.cli.app import main
original = datasets.Dataset.__del__
def signalling_del(self):
    if not sent and os.getpid() == ppctl_pid:  # not in a tokenising process
        sent.append(True)
        os.kill(ppctl_pid, signal.SIGINT)
    original(self)
sent, ppctl_pid = [], os.getpid()
datasets.Dataset.__del__ = signalling_del
sys.argv = ["ppctl", *sys.argv[1:]]
main()
"""


@pytest.mark.timeout(120)
def test_a_signal_while_a_dataset_is_deleted_ends_in_one_line_not_a_finished_run(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"row {number}"}) + "\n" for number in range(100)))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-c", SIGNAL_IN_DATASET_DEL, *prepare_args(corpus, tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=100)
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (130, "", [
        f"error: interrupted by SIGINT while tokenising data.path={corpus}; the cache was left as it was"]), done.stderr
    assert set(os.listdir(tmp_path / "cache")) <= {"file-digests.json"}
