"""``ppctl verify``'s pure parts: the two runs' overrides, ``--shrink``, the metrics file and the comparison."""

import json

import pytest
import torch

from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.run.logging import METRICS_FILE, MetricsFile, read_metrics
from ppctl.verify.compare import (ParameterDifference, VerifyError, parameter_differences, parameter_row, relative,
                                  scalar_rows)
from ppctl.pipeline.schedules import build_schedule, schedule_csv
from ppctl.verify.runs import PARALLEL, SINGLE, earlier_verify, verify_plan
from ppctl.verify.shrink import shrink_overrides
from ppctl.verify.tolerance import tolerance_of


def test_the_single_run_drops_what_only_splits_the_run_and_verify_sets_what_it_compares(tmp_path):
    user = ["parallel=tp2_pp2_dp2", "parallel.vpp=2", "schedule=zbv", "launcher.nnodes=2", "launcher.backend=gloo",
            "model=llama_tiny", "trainer.max_steps=500", "+trainer.seed=3"]
    plan = verify_plan(user, 2, "fp32", tmp_path)
    single, parallel = plan.overrides[SINGLE], plan.overrides[PARALLEL]
    assert plan.replaced == ("trainer.max_steps=500",)
    assert "trainer.max_steps=500" not in parallel and "trainer.max_steps=2" in parallel
    assert {"parallel=tp2_pp2_dp2", "parallel.vpp=2", "schedule=zbv", "launcher.nnodes=2"} <= set(parallel)
    assert not {"parallel=tp2_pp2_dp2", "parallel.vpp=2", "schedule=zbv", "launcher.nnodes=2"} & set(single)
    assert {"parallel=single", "launcher.backend=gloo", "model=llama_tiny", "+trainer.seed=3",
            "trainer.precision=fp32", "trainer.allow_tf32=false"} <= set(single)
    assert single[-1] == f"trainer.out_dir={tmp_path / SINGLE}" and parallel[-1] == f"trainer.out_dir={tmp_path / PARALLEL}"


@pytest.mark.parametrize("layout", [
    ["model=llama3_8b", "parallel.tp=2", "parallel.pp=2", "schedule=zbv"],
    ["model=llama3_8b", "parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true", "parallel.pp=2"],
    ["model=gpt_small", "parallel.tp=2", "parallel.cp=2", "parallel.cp_comm=a2a", "parallel.dp=2"],
    ["model=llama3_1b", "parallel.pp=4", "schedule=interleaved_1f1b", "parallel.vpp=2", "parallel.dp=2"],
    ["model=mixtral_8x7b", "parallel.pp=4", "schedule=zbv", "parallel.dp=2"],
], ids=lambda layout: " ".join(layout))
def test_a_shrunk_layout_keeps_its_split_and_resolves(layout):
    original = resolve(compose_config(["data=synthetic", *layout]), data=False)
    extra, said = shrink_overrides(original.config)
    shrunk = resolve(compose_config(["data=synthetic", *layout, *extra]))
    model, before = shrunk.config.model, original.config.model
    shape, shape_before = shrunk.model.memory_shape, original.model.memory_shape
    assert (model.num_layers, model.num_heads, shape.kv_heads) == (before.num_layers, before.num_heads,
                                                                   shape_before.kv_heads)
    assert shrunk.layout == original.layout and dict(shrunk.layer_map) == dict(original.layer_map)
    assert shrunk.sizes.num_microbatches == min(original.sizes.num_microbatches, 2 * shrunk.layout.pp)
    assert model.hidden_size == 8 * model.num_heads and model.vocab_size == 64
    assert shrunk.config.trainer.seq_length <= 32 and shrunk.config.trainer.micro_batch_size == 1
    assert said[0].startswith(f"hidden {before.hidden_size} -> {model.hidden_size}")


def test_a_shrunk_schedule_file_keeps_the_microbatches_the_file_runs(tmp_path):
    # the file's actions name 8 microbatches: shrinking the batch to twice the pipeline ranks would contradict it
    path = tmp_path / "schedule.csv"
    path.write_text(schedule_csv(build_schedule("1f1b", 2, 1, 8)))
    layout = ["data=synthetic", "schedule=custom", f"schedule.file={path}", "parallel.pp=2",
              "trainer.global_batch_size=16", "trainer.micro_batch_size=2"]
    extra, said = shrink_overrides(resolve(compose_config(layout), data=False).config)
    shrunk = resolve(compose_config([*layout, *extra]))
    assert shrunk.sizes.num_microbatches == 8 and shrunk.config.trainer.micro_batch_size == 1
    assert said[2].endswith(f"global batch 16 -> 8 (8 -> 8 microbatches per DP rank: schedule.file {path} runs 8)")


@pytest.mark.parametrize("one_node, found", [(True, "parallel.log"), (False, "single")])
def test_an_earlier_verify_is_found_by_its_runs_and_logs(tmp_path, one_node, found):
    assert earlier_verify(tmp_path, one_node) is None
    (tmp_path / "parallel.log").write_text("an earlier verify\n")
    (tmp_path / "single").mkdir()
    # on several nodes the parallel run's folder and log are this verify's, the other nodes' part
    assert earlier_verify(tmp_path, one_node) == tmp_path / found


def test_the_metrics_file_is_exact_and_a_resumed_run_drops_the_steps_it_runs_again(tmp_path):
    path = tmp_path / METRICS_FILE
    first = MetricsFile(path, 0)
    for step in range(4):
        first.write({"step": step, "loss": 1 / 3 + step, "grad_norm": 0.1, "lr": 1e-3, "skipped": False})
    first.write({"step": 3, "val_loss": 2 / 3})
    first.close()
    assert [record["loss"] for record in read_metrics(path) if "loss" in record] == [1 / 3 + step for step in range(4)]
    resumed = MetricsFile(path, 2)  # its checkpoint was at step 2: steps 2 and 3 (and the validation) run again
    resumed.close()
    assert [record["step"] for record in read_metrics(path)] == [0, 1]


def _metrics(folder, losses, norms, validation):
    folder.mkdir()
    lines = [{"step": step, "loss": loss, "grad_norm": norm, "lr": 1e-3, "skipped": False}
             for step, (loss, norm) in enumerate(zip(losses, norms))] + [{"step": 1, "val_loss": validation}]
    (folder / METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_scalars_are_judged_step_by_step_and_a_missing_step_is_said(tmp_path):
    tolerance = tolerance_of("fp64")
    single = _metrics(tmp_path / "single", [2.0, 1.5], [0.5, 0.4], 1.4)
    equal = _metrics(tmp_path / "equal", [2.0 * (1 + 1e-12), 1.5], [0.5, 0.4], 1.4)
    rows = scalar_rows(equal, single, 2, tolerance)
    assert [row.quantity for row in rows] == ["loss", "grad norm", "validation loss"] and all(row.equal for row in rows)
    differs = _metrics(tmp_path / "differs", [2.0, 1.5], [0.5, 0.4 * (1 + 1e-6)], 1.4)
    norm = scalar_rows(differs, single, 2, tolerance)[1]
    assert not norm.equal and norm.where == "step 2" and norm.worst == pytest.approx(1e-6)
    with pytest.raises(VerifyError, match="no record of step 3"):
        scalar_rows(equal, single, 3, tolerance)


def test_the_worst_parameter_is_the_one_furthest_over_its_bound():
    single = {"a": torch.ones(3, dtype=torch.float64), "b": torch.full((2,), 2.0, dtype=torch.float64)}
    parallel = {"a": single["a"] + 1e-12, "b": single["b"] + torch.tensor([0.0, 1e-3], dtype=torch.float64)}
    differences = parameter_differences(parallel, single, {}, lambda expected, gradient: 1e-10 * expected.max().item())
    row, worst = parameter_row(differences, tolerance_of("fp64"))
    assert worst.name == "b" and not row.equal and worst.ratio == pytest.approx(1e-3 / 2e-10)
    assert ParameterDifference("c", 0.0, 0.0).ratio == 0.0
    with pytest.raises(VerifyError, match="different parameters"):
        parameter_differences({"a": single["a"]}, single, {}, lambda expected, gradient: 1.0)
    assert relative(1.0, 0.0) == 1.0 and relative(2.0, 1.0) == 1.0
