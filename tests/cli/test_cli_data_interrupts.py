"""A signal while ``ppctl prepare-data`` tokenises: one line, 128 + the signal, the complete shards kept, and a
new preparation that resumes from them to the same bytes as one that was never interrupted.

With ``data.num_proc=2`` the shards are tokenised in two forked processes. SIGINT goes to ppctl's whole process
group, as a terminal's Ctrl-C does; SIGTERM to ppctl alone, as ``kill`` does.
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

NUM_ROWS = 600_000  # short rows (13.3 MB): seconds of tokenising in 27 shards
NUM_SHARDS = 27
SHARDS = ["data.shard_mib=0.5"]
INTERRUPTED = "; the shards already complete are kept, and a new preparation resumes from them"


def start_ppctl(*args: str) -> subprocess.Popen:
    """Start ``python -m ppctl.cli.app ARGS`` as ``run_ppctl`` runs it, in a session of its own (as a terminal's
    foreground job: its own process group)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ppctl.cli.app", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for_a_shard(cache_dir, process: subprocess.Popen, timeout_s: float = 90) -> None:
    """Return once the first shard is complete (its record is written)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if any(cache_dir.glob("*/shard-*.json")):
            return
        time.sleep(0.01)
    raise AssertionError("no shard was completed")


def entry_files(cache_dir) -> dict:
    """Each file of the cache's one entry folder: name -> bytes (a shard's record without the size and mtime of
    its ``.bin`` as written, which differ from run to run)."""
    (folder,) = [entry for entry in cache_dir.iterdir() if entry.is_dir()]
    return {file.name: _without_stat(file) for file in sorted(folder.iterdir())}


def _without_stat(file) -> bytes:
    """A file's bytes; for a shard's record, its fields but ``bin_stat``."""
    if not (file.name.startswith("shard-") and file.suffix == ".json"):
        return file.read_bytes()
    return json.dumps({key: value for key, value in json.loads(file.read_text()).items() if key != "bin_stat"}).encode()


@pytest.mark.timeout(240)
# the SIGINT case also resumes to the end and prepares the corpus again uninterrupted: what a resumed preparation
# writes does not depend on the signal
@pytest.mark.parametrize("signum, to_group, then_resume", [(signal.SIGINT, True, True),
                                                           (signal.SIGTERM, False, False)])
def test_a_signal_while_tokenising_ends_in_one_line_and_a_new_preparation_resumes_to_the_same_bytes(
        tmp_path, signum, to_group, then_resume):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"row {number}"}) + "\n" for number in range(NUM_ROWS)))
    args = prepare_args(corpus, tmp_path, "data.num_proc=2", *SHARDS)
    cache_dir = tmp_path / "cache"
    process = start_ppctl(*args)
    try:
        wait_for_a_shard(cache_dir, process)
        os.killpg(process.pid, signum) if to_group else process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    assert (process.returncode, stdout, stderr.splitlines()[-1:]) == (128 + signum, "", [
        f"error: interrupted by {name} while tokenising data.path={corpus}{INTERRUPTED}"]), stderr
    assert all(line.startswith("shard-") for line in stderr.splitlines()[:-1]), stderr  # the shards' own lines
    kept = entry_files(cache_dir)
    assert "index.json" not in kept and not [name for name in kept if name.endswith(".tmp")], sorted(kept)
    records = [name for name in kept if name.endswith(".json")]
    assert 1 <= len(records) < NUM_SHARDS and all(f"{name[:-5]}.bin" in kept and f"{name[:-5]}.idx" in kept
                                          for name in records)
    if not then_resume:
        return
    resumed = run_ppctl(*args)
    assert resumed.returncode == 0 and f"tokens from {NUM_ROWS:,} document(s)" in resumed.stdout, resumed.stderr
    assert len([line for line in resumed.stderr.splitlines() if line.startswith("shard-")]) == NUM_SHARDS - len(records)
    fresh = run_ppctl(*prepare_args(corpus, tmp_path / "fresh", *SHARDS))
    assert fresh.returncode == 0, fresh.stderr
    assert entry_files(cache_dir) == entry_files(tmp_path / "fresh" / "cache")  # byte for byte, index included


# ppctl, its shard writer's finalizer sending SIGINT to ppctl once: the signal comes while Python runs a finalizer,
# whose exceptions it swallows ("Exception ignored in"), as a signal during a garbage collection does
SIGNAL_IN_A_FINALIZER = """
import os, signal, sys
from ppctl.data import indexed
from ppctl.cli.app import main
def signalling_del(self):
    if not sent and os.getpid() == ppctl_pid:
        sent.append(True)
        os.kill(ppctl_pid, signal.SIGINT)
sent, ppctl_pid = [], os.getpid()
indexed.IndexedWriter.__del__ = signalling_del
sys.argv = ["ppctl", *sys.argv[1:]]
main()
"""


@pytest.mark.timeout(120)
def test_a_signal_in_a_finalizer_ends_in_one_line_not_a_finished_preparation(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"row {number}"}) + "\n" for number in range(100)))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-c", SIGNAL_IN_A_FINALIZER, *prepare_args(corpus, tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=100)
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (130, "", [
        f"error: interrupted by SIGINT while tokenising data.path={corpus}{INTERRUPTED}"]), done.stderr
    assert not list((tmp_path / "cache").glob("*/index.json"))  # the entry was not completed
