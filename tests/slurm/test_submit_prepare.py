"""``ppctl submit prepare-data`` against a real slurmctld and slurmd on this machine (tests/slurm/cluster.py).

A corpus of six ``.jsonl`` files, cut into more shards than the array has tasks (a tiny ``data.shard_mib``), is
prepared by a 3-task job array while one plain ``ppctl prepare-data`` prepares the same files into another cache
beside it. Every task completes, and the two cache entries are one: the same shards, token for token (their
``.bin``), boundary for boundary (their ``.idx``), with the same records and the same index (but for the
mtimes the records keep of their files).
"""

import json
import re
import time

import pytest

from tests.cli.conftest import run_ppctl
from tests.slurm.cluster import FINAL_STATES

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(180)]

TASKS = 3
ARRAY_TIMEOUT_S = 120.0
FILES, ROWS = 6, 30  # about 3 KB of text a file


def _write_corpus(folder):
    """Six ``.jsonl`` files of rows with distinct texts; the folder."""
    folder.mkdir()
    for file in range(FILES):
        rows = [json.dumps({"text": f"file {file} row {row}: " + "lorem ipsum dolor " * (1 + row % 7)})
                for row in range(ROWS)]
        (folder / f"part-{file}.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def test_a_job_array_prepares_the_corpus_one_prepare_data_prepares(slurm_cluster, tmp_path):
    corpus = _write_corpus(tmp_path / "corpus")
    common = ["data=text", f"data.path={corpus}", "data.shard_mib=0.001", "trainer.seq_length=16"]
    job_dir, array_cache, plain_cache = tmp_path / "job", tmp_path / "array cache", tmp_path / "plain cache"
    submitted = run_ppctl("submit", "prepare-data", "launcher=slurm", *common, f"data.cache_dir='{array_cache}'",
                          "--tasks", str(TASKS), "--out", str(job_dir), env=slurm_cluster.env)
    assert submitted.returncode == 0, submitted.stderr
    found = re.fullmatch(rf"submitted job array (\d+) \({TASKS} tasks\): job folder {re.escape(str(job_dir))}\n",
                         submitted.stdout)
    assert found, submitted.stdout
    job_id = found[1]
    plain = run_ppctl("prepare-data", *common, f"data.cache_dir='{plain_cache}'")  # beside the array's tasks
    assert plain.returncode == 0, plain.stderr
    states = _wait_for_array(slurm_cluster, job_id)
    logs = "\n".join(path.read_text(errors="replace") for path in sorted(job_dir.glob("prepare-*.out")))
    assert states == {task: "COMPLETED" for task in range(TASKS)}, logs
    array_entry, plain_entry = _entry(array_cache), _entry(plain_cache)
    assert array_entry.name == plain_entry.name, "the same config, the same entry"
    names = sorted(path.name for path in plain_entry.glob("shard-*"))
    assert len([name for name in names if name.endswith(".bin")]) > TASKS, names
    assert sorted(path.name for path in array_entry.glob("shard-*")) == names
    for name in names:
        if name.endswith(".json"):
            assert _record(array_entry / name, array_cache) == _record(plain_entry / name, plain_cache), name
        else:  # the tokens (.bin) and the documents' boundaries (.idx), byte for byte
            assert (array_entry / name).read_bytes() == (plain_entry / name).read_bytes(), name
    assert _record(array_entry / "index.json", array_cache) == _record(plain_entry / "index.json", plain_cache)


def _wait_for_array(cluster, job_id) -> dict[int, str]:
    """``task -> state`` once every task of the array is in a final state (``scontrol`` shows one record a task
    once the tasks are split from the array's pending record)."""
    deadline = time.monotonic() + ARRAY_TIMEOUT_S
    while True:
        shown = cluster.run(["scontrol", "--oneliner", "show", "job", job_id], check=False).stdout
        states = {int(task): state for task, state in re.findall(r"ArrayTaskId=(\d+) .*?JobState=(\S+)", shown)}
        if len(states) == TASKS and set(states.values()) <= FINAL_STATES:
            return states
        assert time.monotonic() < deadline, f"job array {job_id} not done after {ARRAY_TIMEOUT_S:.0f} s:\n{shown}"
        time.sleep(0.2)


def _entry(cache):
    """The one cache entry folder in ``cache``."""
    entries = [path for path in cache.iterdir() if path.is_dir()]
    assert len(entries) == 1, entries
    return entries[0]


def _record(path, cache):
    """A JSON record of the entry as two preparations must agree on it: the cache folder (where named) written as
    ``<cache>``, a file's ``[size, mtime]`` (a ``*_stat`` field) as its size alone."""
    return _comparable(json.loads(path.read_text().replace(json.dumps(str(cache))[1:-1], "<cache>")))


def _comparable(value):
    """``value`` with every ``*_stat`` field's ``[size, mtime_ns]`` cut to the size, at any depth."""
    if isinstance(value, dict):
        return {key: item[:1] if key.endswith("_stat") else _comparable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_comparable(item) for item in value]
    return value
