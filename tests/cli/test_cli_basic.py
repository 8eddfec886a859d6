"""CLI contracts that start no worker: inspect-layout, refusals, dry runs."""

import json

import pytest

from ppctl.parallel.layout import GROUP_NAMES, ParallelLayout


@pytest.mark.timeout(60)
def test_inspect_layout_json_matches_layout(ppctl):
    result = ppctl("inspect-layout", "parallel.tp=2", "parallel.pp=4", "parallel.dp=2", "model.num_layers=8",
                   "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"world_size", "order", "sizes", "experts", "placement", "sequence", "groups", "ranks",
                           "pipeline_layout", "layers"}
    layout = ParallelLayout(tp=2, pp=4, dp=2)
    assert report["world_size"] == 16 and report["order"] == "tp-cp-dp-pp"
    assert report["sizes"] == {"tp": 2, "cp": 1, "dp": 2, "pp": 4, "vpp": 1}
    assert set(report["groups"]) == set(GROUP_NAMES)
    for name in GROUP_NAMES:
        assert report["groups"][name] == layout.groups(name)
    memory = report["ranks"][5].pop("memory")
    assert report["ranks"][5] == {"rank": 5, **layout.coords(5), "tokens": [[0, 64]], "residual_tokens": [[0, 64]]}
    assert set(memory) == {"parameters", "gradients", "optimizer", "activations", "buffers", "total"}
    assert memory["total"] == sum(value for key, value in memory.items() if key != "total") > 0
    assert report["ranks"][6]["memory"] == memory  # the same pp rank (tp and dp differ)
    assert [entry["layers"] for entry in report["layers"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert report["layers"][0]["pre_process"] and report["layers"][-1]["post_process"]
    assert report["pipeline_layout"] == "Ett|tt|tt|ttL"  # the even split, written out


@pytest.mark.timeout(60)
def test_inspect_layout_shows_the_split_balance_auto_chooses(ppctl):
    args = ["parallel.pp=4", "model.num_layers=10", "parallel.balance=auto"]
    report = json.loads(ppctl("inspect-layout", *args, "--json").stdout)
    stages = report["pipeline_layout"].split("|")
    assert len(stages) == 4 and report["pipeline_layout"].count("t") == 10
    assert report["pipeline_layout"] == "Ett|ttt|ttt|ttL"  # the loss's stage and the embedding's take the fewer
    assert [entry["layers"] for entry in report["layers"]] == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    text = ppctl("inspect-layout", *args).stdout
    assert "pipeline layout: Ett|ttt|ttt|ttL (balance=auto: the slowest rank's predicted work" in text
    assert "with the even split Ettt|ttt|tt|ttL)" in text


@pytest.mark.timeout(60)
def test_inspect_layout_shows_cp_groups_and_each_rank_sequence_slices(ppctl):
    args = ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
            "parallel.cp_comm=ring", "trainer.seq_length=16"]
    report = json.loads(ppctl("inspect-layout", *args, "--json").stdout)
    assert report["groups"]["cp"] == ParallelLayout(tp=2, cp=2, pp=2).groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert report["sequence"] == {"seq_length": 16, "cp_comm": "ring", "sequence_parallel": True, "message_tokens": 4}
    by_coords = {(r["tp"], r["cp"]): (r["tokens"], r["residual_tokens"]) for r in report["ranks"]}
    # CP rank 0 holds chunks 0 and 3 of 4 (tokens 0-3 and 12-15); SP gives TP rank 1 the second half of those.
    assert by_coords[0, 0] == ([[0, 4], [12, 16]], [[0, 4]])
    assert by_coords[1, 0] == ([[0, 4], [12, 16]], [[12, 16]])
    assert by_coords[1, 1] == ([[4, 12]], [[8, 12]])
    text = ppctl("inspect-layout", *args).stdout
    assert "attention: ring" in text and "4 tokens of each sequence per pipeline message" in text and "0-3 12-15" in text


@pytest.mark.timeout(60)
def test_inspect_layout_tables_and_interleaved_map(ppctl):
    result = ppctl("inspect-layout", "schedule=interleaved_1f1b", "parallel.pp=2", "parallel.vpp=2")
    assert result.returncode == 0, result.stderr
    for text in ("process groups", "layer map", "embedding", "loss", "padded"):
        assert text in result.stdout
    report = json.loads(ppctl("inspect-layout", "schedule=interleaved_1f1b", "parallel.pp=2", "parallel.vpp=2",
                              "--json").stdout)
    assert [(e["pp_rank"], e["vp_stage"], e["layers"]) for e in report["layers"]] == [
        (0, 0, [0]), (0, 1, [2]), (1, 0, [1]), (1, 1, [3])]


@pytest.mark.timeout(60)
def test_inspect_layout_at_scale(ppctl):
    result = ppctl("inspect-layout", "parallel.tp=8", "parallel.pp=16", "parallel.dp=128", "model.num_layers=32",
                   "model.num_heads=8", "trainer.global_batch_size=1024", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["world_size"] == 16384 and len(report["ranks"]) == 16384


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, fragment", [
    (("inspect-layout", "parallel.tpp=2"), "tpp"),
    (("train", "parallel.tp=3"), "model.num_heads=4 must be divisible by parallel.tp=3"),
    (("train", "trainer.global_batch_size=7", "trainer.micro_batch_size=2"),
     "trainer.global_batch_size=7 must be divisible"),
    (("train", "schedule=dualpipe", "parallel.pp=3", "model.num_layers=6"), "schedule dualpipe: pp=3 must be even"),
    (("inspect-layout", "parallel.tp=3"), "model.num_heads=4 must be divisible by parallel.tp=3"),
    (("inspect-layout", "schedule=zbv", "parallel.pp=2", "parallel.vpp=1"), "schedule zbv places exactly 2 chunks"),
    (("inspect-layout", "parallel.balance=auto", "parallel.balance_memory_gb=0.0001"),
     "parallel.balance=auto: no split of 4 layers over 2 stages fits parallel.balance_memory_gb=0.0001"),
    (("inspect-schedule", "trainer.global_batch_size=7", "trainer.micro_batch_size=2"),
     "trainer.global_batch_size=7 must be divisible"),
    (("check-cluster", "launcher.nproc_per_node=3"), "launcher.nproc_per_node"),
])
def test_bad_config_exits_2_with_one_line(ppctl, args, fragment, tmp_path):
    result = ppctl(*args, f"trainer.out_dir={tmp_path / 'run'}") if args[0] != "inspect-layout" else ppctl(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was created or started


@pytest.mark.timeout(60)
def test_train_dry_run_prints_torchrun_command(ppctl, tmp_path):
    run_dir = tmp_path / "run"
    result = ppctl("train", "--dry-run", "parallel=tp2_pp2_dp2", f"trainer.out_dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert f"run directory: {run_dir}" in result.stdout
    assert "torch.distributed.run" in result.stdout and "--nproc-per-node 8" in result.stdout
    # its own rendezvous on a port the OS picks (what --standalone means in recent torch, spelled out)
    assert "--rdzv-backend c10d --rdzv-endpoint localhost:0 --rdzv-id ppctl-" in result.stdout
    assert "ppctl.cli.worker" in result.stdout
    assert "OMP_NUM_THREADS=1" in result.stdout
    assert not run_dir.exists()


@pytest.mark.timeout(60)
def test_multi_node_dry_run_uses_c10d_rendezvous(ppctl, tmp_path):
    result = ppctl("train", "--dry-run", "parallel=tp2_pp2_dp2", "launcher.nnodes=2", "launcher.node_rank=1",
                   "launcher.rdzv_endpoint=node0:29400", "launcher.rdzv_id=job7", f"trainer.out_dir={tmp_path}/r")
    assert result.returncode == 0, result.stderr
    for text in ("--nnodes 2", "--nproc-per-node 4", "--rdzv-backend c10d", "--rdzv-endpoint node0:29400",
                 "--rdzv-id job7", "--node-rank 1"):
        assert text in result.stdout
    assert "--standalone" not in result.stdout


@pytest.mark.timeout(60)
def test_inspect_schedule_json_and_picture(ppctl, tmp_path):
    from xml.etree import ElementTree

    picture = tmp_path / "t.svg"
    result = ppctl("inspect-schedule", "schedule=interleaved_1f1b", "parallel.pp=4", "parallel.vpp=2",
                   "model.num_layers=8", "trainer.global_batch_size=16", "trainer.micro_batch_size=2",
                   "--cost", "F=1,B=2,W=0,comm=0", "--json", "--out", str(picture))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"schedule", "pp", "vpp", "microbatches", "costs", "makespan", "bubble_ratio", "steps",
                           "step_ends", "steady_step_time", "steady_bubble_ratio", "weight_versions", "ranks",
                           "program", "calibration"}
    assert (report["schedule"], report["pp"], report["vpp"], report["microbatches"]) == ("interleaved_1f1b", 4, 2, 8)
    program = report["program"]  # the lowered program: each remote message sent once and received once
    sent = sorted(n for rank in program["ranks"] for step in rank["steps"] for n in step["sends"])
    received = sorted(n for rank in program["ranks"]
                      for n in rank["initial_receives"] + [n for step in rank["steps"] for n in step["receives"]])
    assert sent == received == list(range(len(program["messages"]))) == list(range(8 * 2 * (8 - 1)))
    assert report["costs"] == {"F": 1.0, "B": 2.0, "W": 0.0, "comm": 0.0}
    assert report["bubble_ratio"] == pytest.approx((4 - 1) / (2 * 8))
    rank0 = report["ranks"][0]
    assert set(rank0) == {"rank", "peak_activations", "actions", "activation_bytes", "activation_bytes_over_time"}
    assert rank0["activation_bytes"] == max(held for _, held in rank0["activation_bytes_over_time"]) > 0
    assert len(rank0["actions"]) == 2 * 2 * 8
    assert set(rank0["actions"][0]) == {"kind", "stage", "microbatch", "start", "end"}
    assert {action["kind"] for action in rank0["actions"]} == {"F", "BW"}
    root = ElementTree.parse(picture).getroot()
    assert root.tag.endswith("svg")
    assert len([path for path in root.iter("{http://www.w3.org/2000/svg}path") if path.get("class") == "memory"]) == 4


@pytest.mark.timeout(60)
def test_inspect_schedule_terminal_and_refusals(ppctl, tmp_path):
    result = ppctl("inspect-schedule", "parallel.pp=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=1")
    assert result.returncode == 0, result.stderr
    assert "rank 3" in result.stdout and "bubble ratio 37.5%" in result.stdout  # (pp-1)/m = 3/8
    stream = ppctl("inspect-schedule", "parallel.pp=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=1",
                   "schedule=pipedream_2bw", "optimizer.gradient_delay=1", "optimizer.clip_grad=0", "--steps", "3")
    assert stream.returncode == 0, stream.stderr
    assert "after the first: 24 per step, bubble ratio 0.0% per step" in stream.stdout  # the fill shows once
    assert "kept in 2 weight versions" in stream.stdout
    bad_cost = ppctl("inspect-schedule", "--cost", "F=x")
    assert bad_cost.returncode == 2 and bad_cost.stderr.startswith("error: ") and len(bad_cost.stderr.splitlines()) == 1
    bad_out = ppctl("inspect-schedule", "--out", str(tmp_path / "t.pdf"))
    assert bad_out.returncode == 2 and "suffix" in bad_out.stderr


@pytest.mark.timeout(120)
def test_prepare_data_text_corpus_and_one_line_errors(ppctl, tmp_path):
    missing = ppctl("prepare-data", "data=text", f"data.path={tmp_path / 'nope.txt'}", f"data.cache_dir={tmp_path}")
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [f"error: data.path={tmp_path / 'nope.txt'}: no such file, folder or glob"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "part.jsonl").write_text("".join(json.dumps({"body": "x" * 300, "n": n}) + "\n" for n in range(4)))
    args = ["data=text", f"data.path={corpus}", "data.text_field=body", f"data.cache_dir={tmp_path / 'cache'}"]
    # 4 documents of 301 tokens: the default 5% validation split (60 tokens) is shorter than one window (65);
    # train prepares before it starts any worker (its "run directory: ..." line) and refuses in one line
    short = ppctl("train", *args, f"trainer.out_dir={tmp_path / 'run'}")
    assert short.returncode == 2 and short.stderr.splitlines() == [
        f"error: data.path={corpus}: the validation split holds 60 tokens (data.validation_fraction=0.05 of 1,204), "
        "fewer than one window of trainer.seq_length+1=65; raise data.validation_fraction or set trainer.eval_every=0"]
    result = ppctl("prepare-data", *args, "data.validation_fraction=0.25")
    assert result.returncode == 0, result.stderr
    (entry,) = (tmp_path / "cache").glob("text-part-byte-*")
    assert result.stdout == (f"{entry}: 1,204 tokens from 4 document(s) in 1 file(s); train 903, validation 301 "
                             "(data.validation_fraction=0.25)\n")


@pytest.mark.timeout(60)
def test_nccl_without_a_gpu_per_worker_is_refused_before_anything_starts(ppctl, tmp_path):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this node has a GPU for each of the 2 workers")
    result = ppctl("train", "launcher.backend=nccl", f"trainer.out_dir={tmp_path / 'run'}", "--dry-run")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "launcher.backend=nccl needs a GPU per worker on the node" in result.stderr
    assert not (tmp_path / "run").exists()
