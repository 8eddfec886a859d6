"""A resume whose model is not the checkpoint's is refused before any worker starts, in one line naming the setting.

Real checkpoints (saved by two workers of the session's pool, nothing trained: the tensors' names and shapes are
what count) of a GPT with tied embeddings, a Llama with grouped-query attention and q/k/v biases, a mixture of
experts split over ep=2 and a DeepSeek-like mixture with a dense first layer, a shared expert and the expert bias.
Each is read back by the check with the run's own config (accepted: the meta-built model names and shapes every
tensor as the save did), and with one unrecorded shape setting changed either way (refused, naming it).
"""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.distributed.equivalence import BASE, DEEPSEEK, LLAMA, MIXTRAL
from tests.harness.pool import run_workers

LAYOUT = ["parallel.pp=1", "parallel.dp=2"]
SAVED = {
    "gpt": BASE + LAYOUT + ["model.tie_embeddings=true", "model.qkv_bias=true"],
    "llama": BASE + LAYOUT + LLAMA + ["model.qkv_bias=true"],
    "mixtral": BASE + LAYOUT + MIXTRAL + ["parallel.ep=2"],
    "deepseek": BASE + LAYOUT + DEEPSEEK,
}


def _save_each(rank, world_size, root):
    """Save one checkpoint of each ``SAVED`` model into ``root/<name>`` (collective); return the checkpoints."""
    from ppctl.checkpoint.state import save_checkpoint
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    context, saved = None, {}
    for name, overrides in SAVED.items():
        run = resolve(compose_config(overrides))
        context = context or build_parallel_context(run.layout, 60)
        saved[name] = str(save_checkpoint(Trainer(run, context), Path(root) / name, 1, "test", keep_last=1))
    return saved


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Model name -> its checkpoint directory."""
    root = tmp_path_factory.mktemp("saved")
    return {name: Path(path) for name, path in run_workers(_save_each, 2, str(root), timeout=150)[0].items()}


def _problem(overrides, checkpoint):
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.run.resume import model_shape_problem

    return model_shape_problem(resolve(compose_config(overrides)).config, checkpoint)


@pytest.mark.timeout(200)
def test_each_saved_model_is_read_as_the_runs_own(checkpoints):
    for name, overrides in SAVED.items():
        assert _problem(overrides, checkpoints[name]) is None, name
    # The layout may change: the model is the same whatever its split.
    assert _problem([*SAVED["mixtral"], "parallel.ep=1"], checkpoints["mixtral"]) is None


CHANGED = [
    ("gpt", ["model.qkv_bias=false"], "it was saved with model.qkv_bias=true, this run has false"),
    ("llama", ["model.qkv_bias=false"], "it was saved with model.qkv_bias=true, this run has false"),
    ("llama", ["model.head_dim=16"], "it was saved with model.head_dim=8, this run has 16"),
    ("llama", ["model.num_kv_heads=4"], "it was saved with model.num_kv_heads=2, this run has 4"),
    ("llama", ["model.num_kv_heads=null"], "it was saved with model.num_kv_heads=2, this run has null"),
    # The other way round: the run has tensors the checkpoint lacks.
    ("deepseek", ["model.qkv_bias=true"], "it was saved with model.qkv_bias=false, this run has true"),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name, change, said", CHANGED, ids=[f"{case[0]}-{case[1][0]}" for case in CHANGED])
def test_a_changed_shape_setting_is_named_with_both_values(checkpoints, name, change, said):
    assert _problem([*SAVED[name], *change], checkpoints[name]) == f"{said}: its tensors are another model's"


@pytest.mark.timeout(200)
def test_a_difference_no_one_setting_explains_names_the_first_tensor(checkpoints):
    problem = _problem([*SAVED["llama"], "model.qkv_bias=false", "model.num_kv_heads=4"], checkpoints["llama"])
    assert problem.startswith("it holds the tensor layers.") and problem.endswith(
        ", which this run's model has not: its model is another"), problem


@pytest.mark.timeout(200)
def test_train_refuses_the_resume_in_one_line_before_any_worker(checkpoints, tmp_path):
    from ppctl.cli.app import app

    checkpoint = checkpoints["llama"]
    result = CliRunner().invoke(app, ["train", *SAVED["llama"], "model.qkv_bias=false", "trainer.max_steps=3",
                                      f"trainer.resume_from={checkpoint}", f"trainer.out_dir={tmp_path / 'run'}"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, (result.stdout, result.stderr)
    assert lines[0] == (f"error: trainer.resume_from={checkpoint}: cannot resume from {checkpoint}: it was saved "
                        f"with model.qkv_bias=true, this run has false: its tensors are another model's")
    assert not (tmp_path / "run").exists()
    accepted = CliRunner().invoke(app, ["train", *SAVED["llama"], "trainer.max_steps=3", "--dry-run",
                                        f"trainer.resume_from={checkpoint}", f"trainer.out_dir={tmp_path / 'run'}"])
    assert accepted.exit_code == 0, accepted.stderr
