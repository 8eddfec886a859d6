"""End-to-end runs that start torchrun workers (gloo): check-cluster, train, failures.

The multi-rank training run is judged by its numbers too: every step's logged loss and
gradient norm must equal those of the single-process run a user would launch with the
same overrides and ``parallel=single`` (``tests.cli.runs``); the other layouts' numbers
are proven in process (tests/distributed), where a proof is cheap.
"""

import json
import math
import time
from collections import defaultdict

import pytest

from tests.cli.runs import assert_same_series, scalars
from tests.cli.test_cli_equivalence import MASKED

FAST_TRAIN = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
THREE_STEPS = ["trainer.max_steps=3", "trainer.log_every=1", *FAST_TRAIN]
TB_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/step_time_s", "train/tokens_per_s"}


def pipeline_neighbours(layout) -> list[tuple[int, int]]:
    """(src, dst) global ranks of every pair of consecutive pp ranks, in every pipeline group."""
    return sorted((group[i], group[i + 1]) for group in layout.groups("pp") for i in range(len(group) - 1))


@pytest.mark.timeout(180)
def test_check_cluster_proves_every_group(ppctl, tmp_path):
    """Every group proved; exactly the pipeline-neighbour links measured, each with a verified payload.

    One launch tests the command; every group kind's proof on other layouts (cp among them) runs in
    process (tests/distributed/test_groups.py)."""
    from ppctl.parallel.layout import GROUP_NAMES, ParallelLayout
    from ppctl.run.cluster import BANDWIDTH_BYTES

    sizes = dict(tp=2, pp=2, dp=2)
    layout = ParallelLayout(**sizes)
    result = ppctl("check-cluster", *(f"parallel.{k}={v}" for k, v in sizes.items()), f"trainer.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check-cluster" in result.stdout and "p2p pipeline" in result.stdout and "all-reduce" in result.stdout
    reports = json.loads((tmp_path / "cluster.json").read_text())
    assert [report["rank"] for report in reports] == list(range(layout.world_size))
    assert all(report["proofs"] == {name: "ok" for name in GROUP_NAMES} for report in reports)
    assert all(link["src"] == report["rank"] for report in reports for link in report["links"])
    links = [link for report in reports for link in report["links"]]
    assert sorted((link["src"], link["dst"]) for link in links) == pipeline_neighbours(layout)
    for link in links:
        assert link["payload"] == "ok" and link["bytes"] == BANDWIDTH_BYTES, link
        assert math.isfinite(link["latency_us"]) and link["latency_us"] > 0, link
        assert link["bandwidth_MBps"] == pytest.approx(link["bytes"] / link["transfer_s"] / 1e6, rel=1e-9), link
    measured = sorted((m["group"], m["ranks"]) for report in reports for m in report["allreduce"])
    assert measured == sorted((name, group) for name in ("tp", "dp") for group in layout.groups(name))


# The 8-rank command carries as much of the CLI's surface as one launch can: tp, cp (ring attention)
# with sequence parallelism, DualPipe's two parameter copies, the distributed optimizer, tied
# embeddings, vocabulary padding and a loss mask with holes. Its numbers are proven in process too
# (tests/distributed/test_context_parallel_equivalence.py, test_distributed_optimizer.py).
EIGHT_RANKS = ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=dualpipe",
               "parallel.cp_comm=ring", "parallel.sequence_parallel=true", "optimizer.distributed=true",
               "model.tie_embeddings=true", "optimizer.clip_grad=1.0", *MASKED]


@pytest.mark.timeout(300)
def test_train_8_ranks_writes_tensorboard(ppctl, single_run, tmp_path):
    """The 8-rank run writes the run files, says how it computes, and logs the single-process run's losses,
    gradient norms and learning rates."""
    from ppctl.config import padded_vocab_size
    from ppctl.resolve import compose_config

    settings = [*EIGHT_RANKS, *THREE_STEPS, "trainer.micro_batch_size=1"]
    model = compose_config(settings).model
    padded = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 2)
    assert padded != padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 1)
    single_run.start(settings)  # trains beside the 8 ranks, which spend seconds starting and meeting
    result = ppctl("train", *settings, f"trainer.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     3/3 | loss" in result.stdout
    assert f"vocab {model.vocab_size} padded to {padded}" in result.stdout
    assert "optimizer: distributed over 4 ranks (dp*cp x 2 parameter copies)" in result.stdout, result.stdout
    assert "context parallel attention: ring | sequence parallel" in result.stdout
    assert json.loads((tmp_path / "layout.json").read_text())["world_size"] == 8
    assert (tmp_path / "config.yaml").exists()
    accumulator = scalars(tmp_path)
    assert TB_TAGS <= set(accumulator.Tags()["scalars"])
    assert [event.step for event in accumulator.Scalars("train/loss")] == [0, 1, 2]
    assert "config/text_summary" in accumulator.Tags()["tensors"]
    times, speeds = accumulator.Scalars("train/step_time_s"), accumulator.Scalars("train/tokens_per_s")
    for time_event, speed_event in zip(times, speeds, strict=True):
        assert speed_event.value == pytest.approx(8 * 16 / time_event.value, rel=1e-5)  # gbs x seq_length / time
    assert_same_series(tmp_path, single_run(settings), ("train/loss", "train/grad_norm", "train/lr"))


@pytest.mark.timeout(120)
def test_failing_worker_is_named_quickly(ppctl, tmp_path):
    """A worker that raises is named, with its error, on the last stderr line within 90 s; its three peers
    (which then fail on "Connection closed by peer") are not; no process of the job is left. (A worker
    killed by a signal: tests/cli/test_cli_faults.py::test_killed_worker_ends_the_job_naming_it.)"""
    from tests.cli.test_cli_faults import leftovers

    started = time.monotonic()
    result = ppctl("train", "parallel.pp=4", "trainer.max_steps=50", *FAST_TRAIN,
                   "launcher.inject_fault=1:raise", f"trainer.out_dir={tmp_path}")
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: worker rank 1 failed: RuntimeError: injected fault on rank 1"), \
        result.stderr[-2000:]
    assert elapsed < 90
    assert leftovers([], tmp_path, within=5) == []


def steps_in_trace(trace: dict) -> dict[tuple[int, int], dict]:
    """(rank, step) -> actions in time order, waits before each, and summed wait and compute microseconds.

    A wait is the runtime taking one received input, so it belongs to the rank's next action.
    """
    by_rank = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            by_rank[event["tid"]].append(event)
    steps, pending = {}, {}
    for rank, events in by_rank.items():
        waits = []
        for event in sorted(events, key=lambda event: event["ts"]):
            if event["cat"] == "wait":
                waits.append(event["dur"])
                continue
            entry = steps.setdefault((rank, event["args"]["step"]),
                                     {"actions": [], "waits": [], "wait_us": 0.0, "compute_us": 0.0})
            entry["actions"].append((event["cat"], event["args"]["stage"], event["args"]["microbatch"]))
            entry["waits"].append(len(waits))
            entry["wait_us"] += sum(waits)
            entry["compute_us"] += event["dur"]
            waits = []
        pending[rank] = waits
    assert pending == {rank: [] for rank in by_rank}, "a wait after a rank's last action"
    return steps


def needs_remote_input(action, schedule, pp_rank: int) -> bool:
    """Whether ``action`` takes a message from another rank: an activation for F, a gradient for BW."""
    kind, stage, _ = action
    source = stage - 1 if kind == "F" else stage + 1
    return 0 <= source < schedule.placement.num_stages and schedule.placement.rank_of(source) != pp_rank


@pytest.mark.timeout(300)
def test_default_run_learns_and_its_trace_follows_the_schedule(ppctl, tmp_path):
    """The default run (python_stdlib bytes, pp=2 1F1B), traced: it learns (the last five losses average over
    1 below the first); each rank runs the schedule's actions in order, waiting exactly where an input comes
    from another rank; the logged measured bubble is the trace's wait/compute; both timelines are drawn."""
    from xml.etree import ElementTree

    from ppctl.config import num_microbatches
    from ppctl.resolve import compose_config
    from ppctl.pipeline.schedules import build_schedule

    steps_run = 20
    result = ppctl("train", f"trainer.max_steps={steps_run}", "trainer.trace=true", "trainer.log_every=1",
                   f"trainer.out_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    losses = [event.value for event in scalars(run_dir).Scalars("train/loss")]
    assert len(losses) == steps_run
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert "| bubble " in result.stdout
    config = compose_config([])
    assert (config.parallel.pp, config.schedule.name) == (2, "1f1b")
    schedule = build_schedule("1f1b", 2, 1, num_microbatches(config))
    steps = steps_in_trace(json.loads((run_dir / "trace.json").read_text()))
    assert sorted(steps) == [(rank, step) for rank in (0, 1) for step in range(steps_run)]
    for (rank, step), entry in steps.items():
        expected = [(action.kind, action.stage, action.microbatch) for action in schedule.actions[rank]]
        assert entry["actions"] == expected, (rank, step)
        assert entry["waits"] == [int(needs_remote_input(action, schedule, rank)) for action in expected], (rank, step)
    bubbles = {event.step: event.value for event in scalars(run_dir).Scalars("train/bubble_ratio_measured")}
    assert sorted(bubbles) == list(range(steps_run))
    for step, value in bubbles.items():
        ratios = [steps[rank, step]["wait_us"] / steps[rank, step]["compute_us"] for rank in (0, 1)]
        assert value == pytest.approx(sum(ratios) / 2, rel=1e-6, abs=1e-9), (step, value, ratios)
    for picture in ("timeline.svg", "timeline_simulated.svg"):
        root = ElementTree.parse(run_dir / picture).getroot()
        assert root.tag.endswith("svg")


@pytest.mark.timeout(300)
def test_two_nodes_rendezvous_through_c10d(single_run, tmp_path):
    """Two `ppctl train` launchers on this machine act as two nodes meeting at one c10d endpoint.

    The node whose worker holds the last stage logs; its losses are the single-process run's.
    """
    import subprocess
    import sys

    from tests.cli.conftest import REPO
    from tests.harness.spawn import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    overrides = ["parallel.pp=2", *THREE_STEPS, "launcher.nnodes=2", f"launcher.rdzv_endpoint={endpoint}"]
    single_run.start(overrides)  # trains while the two nodes start and meet
    launchers = [
        subprocess.Popen([sys.executable, "-m", "ppctl.cli.app", "train", *overrides, f"launcher.node_rank={node}",
                          f"trainer.out_dir={tmp_path / f'node{node}'}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    outputs = [launcher.communicate(timeout=150) for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert all(json.loads((tmp_path / f"node{node}" / "layout.json").read_text())["world_size"] == 2
               for node in (0, 1))
    logging_nodes = [node for node in (0, 1) if (tmp_path / f"node{node}" / "tensorboard").exists()]
    assert len(logging_nodes) == 1, outputs
    assert "step     3/3 | loss" in outputs[logging_nodes[0]][0]
    assert_same_series(tmp_path / f"node{logging_nodes[0]}", single_run(overrides))
