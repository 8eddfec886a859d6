"""Checkpoint directories: atomic commit, ``latest``, pruning, listing, refusal of partial or corrupt ones."""

import json

import pytest

from ppctl.checkpoint.files import (CheckpointError, checkpoint_problem, checkpoints_dir, commit, latest_checkpoint,
                                    list_checkpoints, resolve_checkpoint, resume_problem, temporary_dir)

INDEX = {"layout": {"tp": 1, "pp": 2, "vpp": 1, "dp": 1, "cp": 1, "schedule": "1f1b",
                    "distributed_optimizer": False},
         "precision": "fp32", "reason": "end",
         "model": {"num_layers": 4, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64, "vocab_size": 257,
                   "max_seq_length": 256, "position_embedding": "learned", "tie_embeddings": False},
         "data": {"seed": 1234, "global_batch_size": 8, "seq_length": 16}}


def write_checkpoint(run_dir, step, keep_last=2):
    """What the ranks write (DCP's files), then the commit one rank makes."""
    partial = temporary_dir(run_dir, step)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"metadata" * step)
    (partial / "__0_0.distcp").write_bytes(bytes(range(100)))
    return commit(run_dir, step, INDEX, keep_last)


def test_commit_renames_into_place_points_latest_and_keeps_the_last(tmp_path):
    paths = [write_checkpoint(tmp_path, step) for step in (3, 6, 9)]
    assert [path.name for path in paths] == ["step_00000003", "step_00000006", "step_00000009"]
    assert latest_checkpoint(tmp_path) == paths[-1]
    listed = list_checkpoints(tmp_path)
    assert [(info.step, info.complete) for info in listed] == [(6, True), (9, True)]  # keep_last=2
    index = json.loads((paths[-1] / "ppctl.json").read_text())
    assert index["step"] == 9 and set(index["files"]) == {".metadata", "__0_0.distcp"}
    assert not any(path.name.startswith(".step") for path in checkpoints_dir(tmp_path).iterdir())


def test_partial_checkpoint_is_listed_incomplete_and_never_latest(tmp_path):
    write_checkpoint(tmp_path, 2)
    temporary_dir(tmp_path, 4).mkdir()  # a save that died before its commit
    listed = list_checkpoints(tmp_path)
    assert [(info.step, info.complete) for info in listed] == [(2, True), (4, False)]
    assert "partial" in listed[1].problem
    assert resolve_checkpoint(tmp_path).name == "step_00000002"


@pytest.mark.parametrize("damage, fragment", [
    (lambda path: (path / "__0_0.distcp").write_bytes(b"short"), "has 5 bytes, 100 were written"),
    (lambda path: (path / "__0_0.distcp").write_bytes(bytes(range(1, 101))), "is corrupt"),
    (lambda path: (path / ".metadata").unlink(), ".metadata is missing"),
    (lambda path: (path / "ppctl.json").write_text("{"), "no readable ppctl.json"),
])
def test_damaged_checkpoint_is_refused_with_one_line(tmp_path, damage, fragment):
    damage(write_checkpoint(tmp_path, 5))
    with pytest.raises(CheckpointError, match=fragment) as refused:
        resolve_checkpoint(tmp_path)
    assert "\n" not in str(refused.value)


def test_resume_from_names_a_run_or_a_checkpoint(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 7)
    assert resolve_checkpoint(checkpoint) == resolve_checkpoint(tmp_path) == checkpoint.resolve()
    with pytest.raises(CheckpointError, match="no such run or checkpoint directory"):
        resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "other_run").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint in this run directory"):
        resolve_checkpoint(tmp_path / "other_run")
    assert checkpoint_problem(checkpoint, verify_digests=True) is None


def test_resume_rules_name_the_setting_that_changed():
    model, data = dict(INDEX["model"]), dict(INDEX["data"])
    index = {**INDEX, "step": 4}
    assert resume_problem(index, model, data, "fp32", max_steps=10) is None
    assert "model.hidden_size=32, this run has 64" in resume_problem(index, {**model, "hidden_size": 64}, data,
                                                                     "fp32", 10)
    assert "trainer.global_batch_size=8" in resume_problem(index, model, {**data, "global_batch_size": 16},
                                                           "fp32", 10)
    assert "trainer.precision=fp32, this run has bf16" in resume_problem(index, model, data, "bf16", 10)
    assert "raise trainer.max_steps" in resume_problem(index, model, data, "fp32", 4)
    assert "optimizer.gradient_delay=0, this run has 1" in resume_problem(index, model, data, "fp32", 10, 1)
    assert resume_problem({**index, "gradient_delay": 1}, model, data, "fp32", 10, 1) is None


def _saved_by(overrides: list[str]) -> dict:
    """The ``ppctl.json`` of a step-4 checkpoint of a run with these model overrides, as ``checkpoint_index``
    writes it (through JSON)."""
    import json
    from types import SimpleNamespace

    from ppctl.checkpoint.state import checkpoint_index
    from ppctl.resolve import compose_config

    layout = SimpleNamespace(world_size=1, tp=1, pp=1, vpp=1, dp=1, cp=1, ep=1)
    trainer = SimpleNamespace(config=compose_config(["data=synthetic", *overrides]),
                              context=SimpleNamespace(layout=layout))
    return json.loads(json.dumps(checkpoint_index(trainer, 4, "end", 4)))


MIXTRAL = ["model=mixtral_tiny"]
CHANGED_MODELS = [
    (MIXTRAL + ["model.moe.num_experts=4"], "model.moe.num_experts=8, this run has 4"),
    (MIXTRAL + ["model.moe.topk=1"], "model.moe.topk=2, this run has 1"),
    (MIXTRAL + ["model.moe.layer_freq=2"], "model.moe.layer_freq=1, this run has 2"),
    (MIXTRAL + ["model.moe.first_dense_layers=1"], "model.moe.first_dense_layers=0, this run has 1"),
    (MIXTRAL + ["model.moe.shared_experts=1"], "model.moe.shared_experts=0, this run has 1"),
    (MIXTRAL + ["model.moe.expert_ffn_hidden_size=64"], "model.moe.expert_ffn_hidden_size=128, this run has 64"),
    (MIXTRAL + ["model.moe.router_score=sigmoid"], "model.moe.router_score=softmax, this run has sigmoid"),
    (MIXTRAL + ["model.moe.router_topk_norm=false"], "model.moe.router_topk_norm=True, this run has False"),
    (MIXTRAL + ["model.moe.expert_bias=true"], "model.moe.expert_bias=False, this run has True"),
    (["model=llama_tiny", "model.moe.num_experts=8"], "model.moe.num_experts=0, this run has 8"),
    (["model=gpt_tiny", "model.activation=gelu_tanh"], "model.activation=gelu, this run has gelu_tanh"),
]


@pytest.mark.parametrize("overrides, fragment", CHANGED_MODELS, ids=[case[0][-1] for case in CHANGED_MODELS])
def test_a_resume_with_another_mixture_or_activation_is_refused_naming_it(overrides, fragment):
    """The checkpoint of ``overrides[0]``'s model (Mixtral's; Llama's; GPT's) refuses a run that changed one setting."""
    from ppctl.resolve import compose_config

    saved = _saved_by(overrides[:1])
    config = compose_config(["data=synthetic", *overrides])
    problem = resume_problem(saved, vars(config.model), vars(config.trainer), "fp32", 10)
    assert problem == f"it was saved with {fragment}", problem


def test_what_a_resume_may_change_of_a_mixture_and_what_an_older_checkpoint_lacks():
    """Router losses, the capacity and the bias's rate are training choices; an expert width set to the width it
    had unset is the same model; a checkpoint saved before the mixture was recorded is taken as it is."""
    from ppctl.resolve import compose_config

    saved = _saved_by(MIXTRAL)
    for overrides in (["model.moe.aux_loss_coeff=0.1", "model.moe.z_loss_coeff=0.01"],
                      ["model.moe.capacity_factor=1.25"], ["model.moe.expert_ffn_hidden_size=128"]):
        config = compose_config(["data=synthetic", *MIXTRAL, *overrides])
        assert resume_problem(saved, vars(config.model), vars(config.trainer), "fp32", 10) is None, overrides
    older = {**saved, "model": {key: value for key, value in saved["model"].items()
                                if not key.startswith("moe.") and key != "activation"}}
    config = compose_config(["data=synthetic", *MIXTRAL, "model.moe.topk=1"])
    assert resume_problem(older, vars(config.model), vars(config.trainer), "fp32", 10) is None


def edit_index(checkpoint, **changes):
    """Write other values into a checkpoint's ppctl.json, as a hand (or a tool) would."""
    index = json.loads((checkpoint / "ppctl.json").read_text())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            index[section][name] = value
        else:
            index[key] = value
    (checkpoint / "ppctl.json").write_text(json.dumps(index, indent=1))


@pytest.mark.parametrize("changes", [{"step": 3}, {"layout__tp": 4}, {"data__seq_length": 32}, {"reason": "end!"}])
def test_an_edited_index_is_refused_like_a_corrupt_file(tmp_path, changes):
    checkpoint = write_checkpoint(tmp_path, 5)
    edit_index(checkpoint, **changes)
    with pytest.raises(CheckpointError) as refused:
        resolve_checkpoint(tmp_path)
    assert str(refused.value) == (f"checkpoint {checkpoint} refused: ppctl.json is corrupt (its SHA-256 differs from "
                                  "the one written: the index was changed)")
    assert [info.complete for info in list_checkpoints(tmp_path)] == [False]


def test_an_index_with_its_digest_recomputed_must_still_name_its_own_step(tmp_path):
    from ppctl.checkpoint.files import index_digest

    checkpoint = write_checkpoint(tmp_path, 5)
    index = json.loads((checkpoint / "ppctl.json").read_text())
    index["step"] = 3
    index["index_sha256"] = index_digest(index)
    (checkpoint / "ppctl.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="ppctl.json says step 3, the directory step 5"):
        resolve_checkpoint(tmp_path)


def test_an_index_without_a_digest_is_refused_by_its_format(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 5)
    index = json.loads((checkpoint / "ppctl.json").read_text())
    del index["index_sha256"]
    index["format_version"] = 1
    (checkpoint / "ppctl.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="ppctl.json has format 1, this ppctl reads 3"):
        resolve_checkpoint(tmp_path)


@pytest.mark.parametrize("pointer", ["../../elsewhere", "/tmp/step_00000005", "step_00000005/../../x", "link"])
def test_a_latest_pointer_leaving_the_checkpoints_folder_is_refused(tmp_path, pointer):
    write_checkpoint(tmp_path, 5)
    run = tmp_path / "run"
    write_checkpoint(run, 2)
    if pointer == "link":  # a step_<N> name that is a link to another run's checkpoint
        (checkpoints_dir(run) / "step_00000009").symlink_to(checkpoints_dir(tmp_path) / "step_00000005")
        pointer = "step_00000009"
    (checkpoints_dir(run) / "latest").write_text(pointer + "\n")
    with pytest.raises(CheckpointError) as refused:
        resolve_checkpoint(run)
    assert str(refused.value) == (f"{checkpoints_dir(run) / 'latest'} names {pointer!r}, which leaves "
                                  f"{checkpoints_dir(run)}: refused (it must name one of the step_<N> checkpoints in "
                                  "that folder)")
