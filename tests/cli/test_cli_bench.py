"""``ppctl bench`` end to end, in a smoke mode (2 steps a block): the JSON keys, the table, equal losses on both
sides, refusals before any worker starts. Timing targets live in benchmarks/RESULTS.md, not here."""

import json

import pytest

SMOKE = ["data=synthetic", "--steps", "2", "--repeats", "1"]
KEYS = {"schedule", "ppctl_step_s", "other_step_s", "ratio", "ratios_per_block", "bubble_measured",
        "bubble_simulated", "makespan_measured_s", "makespan_simulated_s", "peak_memory_bytes", "loss_max_rel_diff",
        "fitted_costs_ms", "losses", "pp", "vpp", "microbatches", "against", "update_s", "update_parameters",
        "all_reduce_s", "collective_wait_s", "world_size", "cores", "on_core_share"}


@pytest.mark.timeout(240)
def test_bench_against_torch_pipelining_json(ppctl, tmp_path):
    """Two schedules (one chunk per rank, and a V of two) in one launch: same losses as torch's, every key."""
    result = ppctl("bench", "parallel.pp=2", f"trainer.out_dir={tmp_path}", "--schedules", "1f1b,zbv", "--json",
                   *SMOKE)
    assert result.returncode == 0, result.stderr[-3000:]
    entries = json.loads(result.stdout.strip().splitlines()[-1])
    assert [entry["schedule"] for entry in entries] == ["1f1b", "zbv"]
    for entry in entries:
        assert KEYS <= set(entry), KEYS - set(entry)
        assert entry["against"] == "torch" and entry["vpp"] == (2 if entry["schedule"] == "zbv" else 1)
        assert len(entry["losses"]["ppctl"]) == len(entry["losses"]["torch"]) == 4  # warm-up and timed blocks
        assert entry["loss_max_rel_diff"] <= 1e-4
        assert entry["ppctl_step_s"] > 0 and entry["other_step_s"] > 0
        assert entry["ratio"] == pytest.approx(entry["ppctl_step_s"] / entry["other_step_s"])
        assert all(len(per_rank) == 2 and min(per_rank) > 0 for per_rank in entry["peak_memory_bytes"].values())
        assert 0 <= entry["bubble_simulated"] and 0 <= entry["bubble_measured"]
        assert set(entry["fitted_costs_ms"]) >= {"F", "B", "W", "comm"}
        assert entry["update_s"] > 0 and entry["update_parameters"] > 0 and entry["world_size"] == 2
        assert set(entry["all_reduce_s"]) == {"1024", "1048576"} and min(entry["all_reduce_s"].values()) > 0
        assert entry["collective_wait_s"] >= 0 and entry["cores"] >= 1
        assert all(len(shares) == 2 and all(0 < share <= 1 for share in shares)
                   for shares in entry["on_core_share"].values()), entry["on_core_share"]
    assert (tmp_path / "bench.json").is_file()


@pytest.mark.timeout(240)
def test_bench_against_a_plain_loop_table(ppctl, tmp_path):
    """pp=1 against a plain PyTorch loop (auto), printed as a table."""
    result = ppctl("bench", "parallel=single", f"trainer.out_dir={tmp_path}", *SMOKE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ppctl against a plain PyTorch loop" in result.stdout
    row = next(line for line in result.stdout.splitlines() if "1f1b" in line)
    assert "1 x 1" in row
    entry = json.loads((tmp_path / "bench.json").read_text())[0]
    assert entry["against"] == "plain" and entry["loss_max_rel_diff"] <= 1e-4
    shares = entry["on_core_share"]  # the table's "on core" cell: the least share, in actions / between them
    assert "on core" in result.stdout and f"{min(shares['actions']):.2f} / {min(shares['between']):.2f}" in row


@pytest.mark.parametrize("arguments, words", [
    (["parallel.pp=2", "schedule=hanayo", "--against", "torch"], "no schedule class for schedule=hanayo"),
    (["parallel.pp=2", "--against", "plain"], "compares a pp=1 run"),
    (["parallel.pp=2", "--schedules", "1f1b,nonesuch"], "nonesuch"),
])
def test_bench_refuses_before_starting(ppctl, tmp_path, arguments, words):
    result = ppctl("bench", f"trainer.out_dir={tmp_path}", *arguments)
    assert result.returncode == 2
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "bench.json").exists()
