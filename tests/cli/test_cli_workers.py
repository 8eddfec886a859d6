"""End-to-end runs that start torchrun workers (gloo): check-cluster, train, failures."""

import json
import time

import pytest

FAST_TRAIN = ["data=synthetic", "trainer.seq_length=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
TB_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/step_time_s", "train/tokens_per_s"}


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return accumulator


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"],
    ["parallel.tp=1", "parallel.cp=2", "parallel.pp=2", "parallel.dp=1"],
], ids=["tp2-pp2-dp2", "cp2-pp2"])
def test_check_cluster_proves_every_group(ppctl, tmp_path, layout):
    result = ppctl("check-cluster", *layout, f"trainer.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check-cluster" in result.stdout and "p2p pipeline" in result.stdout and "all-reduce" in result.stdout
    reports = json.loads((tmp_path / "cluster.json").read_text())
    world = 8 if "parallel.dp=2" in layout else 4
    assert len(reports) == world
    assert all(text == "ok" for report in reports for text in report["proofs"].values())
    links = [link for report in reports for link in report["links"]]
    assert links and all(link["latency_us"] > 0 and link["bandwidth_MBps"] > 0 for link in links)


@pytest.mark.timeout(240)
def test_train_8_ranks_writes_tensorboard(ppctl, tmp_path):
    result = ppctl("train", "model=gpt_tiny", "parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                   "trainer.max_steps=3", "trainer.log_every=1", *FAST_TRAIN, f"trainer.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     3/3 | loss" in result.stdout
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "layout.json").exists()
    accumulator = scalars(tmp_path)
    assert TB_TAGS <= set(accumulator.Tags()["scalars"])
    assert [event.step for event in accumulator.Scalars("train/loss")] == [0, 1, 2]
    assert "config/text_summary" in accumulator.Tags()["tensors"]


@pytest.mark.timeout(300)
def test_default_config_loss_falls(ppctl, tmp_path):
    result = ppctl("train", "trainer.max_steps=30", f"trainer.out_dir={tmp_path / 'run'}",
                   f"data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [event.value for event in scalars(tmp_path / "run").Scalars("train/loss")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault, expected", [("1:raise", "RuntimeError: injected fault on rank 1"),
                                             ("2:kill", "killed by signal 9")])
def test_failing_worker_is_named_quickly(ppctl, tmp_path, fault, expected):
    started = time.monotonic()
    result = ppctl("train", "parallel.pp=4", "trainer.max_steps=50", *FAST_TRAIN,
                   f"launcher.inject_fault={fault}", f"trainer.out_dir={tmp_path}")
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: worker rank"), result.stderr[-2000:]
    assert expected in lines[-1] and f"rank {fault.split(':')[0]}" in lines[-1]
    assert elapsed < 90


@pytest.mark.timeout(240)
def test_traced_run_writes_trace_timeline_and_measured_bubble(ppctl, tmp_path):
    from xml.etree import ElementTree

    result = ppctl("train", "parallel.pp=2", "schedule=1f1b", "trainer.trace=true", "trainer.max_steps=3",
                   "trainer.log_every=1", *FAST_TRAIN, f"trainer.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| bubble " in result.stdout
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    tracks = {event["tid"] for event in spans}
    assert tracks == {0, 1}
    computed = [event for event in spans if event["cat"] in ("F", "BW")]
    assert len(computed) == 3 * 2 * 2 * 4  # steps x ranks x (F, BW) x microbatches
    assert any(event["cat"] == "wait" for event in spans)
    for picture in ("timeline.svg", "timeline_simulated.svg"):
        root = ElementTree.parse(tmp_path / picture).getroot()
        assert root.tag.endswith("svg")
    bubbles = scalars(tmp_path).Scalars("train/bubble_ratio_measured")
    assert len(bubbles) == 3 and all(event.value >= 0 for event in bubbles)


@pytest.mark.timeout(180)
def test_two_nodes_rendezvous_through_c10d(tmp_path):
    """Two `ppctl train` launchers on this machine act as two nodes meeting at one c10d endpoint."""
    import subprocess
    import sys

    from ppctl.testing import free_port
    from tests.cli.conftest import REPO

    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [
        subprocess.Popen([sys.executable, "-m", "ppctl.cli", "train", "parallel.pp=2", "trainer.max_steps=2",
                          "trainer.log_every=1", *FAST_TRAIN, "launcher.nnodes=2", f"launcher.node_rank={node}",
                          f"launcher.rdzv_endpoint={endpoint}", f"trainer.out_dir={tmp_path / f'node{node}'}"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    outputs = [launcher.communicate(timeout=150) for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert any("step     2/2 | loss" in stdout for stdout, _ in outputs)
    layout = json.loads((tmp_path / "node0" / "layout.json").read_text())
    assert layout["world_size"] == 2
