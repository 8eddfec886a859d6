"""``ppctl export`` and ``ppctl generate`` from a run directory: what can go wrong around the read and the write.

- A full disk under the export: one line naming the folder, the OS's reason and the file, nothing left (the
  safetensors library reports the write's failure as its own ``SafetensorError``, which went up as a traceback and
  left the hidden ``.<out>.partial``). A signal (ppctl's SIGTERM handler, Ctrl-C's ``KeyboardInterrupt``) while
  writing: the hidden folder removed; the command says so in one line, exit 128 + the signal.
- A run saving meanwhile with ``trainer.keep_last=1``: the checkpoint read is pinned, so the run's pruning skips
  it; ``latest`` deleted before it is pinned gives the new one; both commands say the step they read.
- A ``config.yaml`` edited since the checkpoint (``model.activation``): refused as ``trainer.resume_from``
  refuses it (the same check), instead of an export as ``gelu_new`` or a generation with the wrong GELU.

Every run directory is made in this process (``tests/harness/tiny_run.py``: a 1-layer GPT, no workers), and each
race is made deterministic by running the saver's commit inside the reader, at the moment the race needs.
"""

import json
import signal

import pytest
from typer.testing import CliRunner

from ppctl.checkpoint import hf_export
from ppctl.checkpoint.files import checkpoints_dir, list_checkpoints, read_index, resume_problem
from ppctl.checkpoint.hf_export import ExportError, export_run
from ppctl.generate import source
from ppctl.generate.source import GenerateError, load_model
from tests.harness.tiny_run import save_step, tiny_run

# What safetensors 0.8 raised when a real 64 KiB tmpfs filled up under ``save_file`` (measured).
FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture
def run(tmp_path):
    """``(run directory, its config)``: a tiny run that saved steps 1 and 2 with ``trainer.keep_last=2``."""
    run_dir = tmp_path / "run"
    config = tiny_run(run_dir)
    save_step(run_dir, config, 1, keep_last=2)
    save_step(run_dir, config, 2, keep_last=2)
    return run_dir, config


def _invoke(*args: str, **extra):
    from ppctl.cli.app import app

    return CliRunner().invoke(app, list(args), **extra)


def _left(tmp_path) -> list[str]:
    """What an export left beside its output folder (its hidden ``.<name>.partial`` included)."""
    return sorted(path.name for path in tmp_path.iterdir() if path.name != "run")


# --- a full disk, a signal -----------------------------------------------------------------------------------------

def _writing_then(monkeypatch, failure):
    """Make the weights' writer write part of its file, then fail with ``failure()`` (as the disk fills up, or a
    signal comes)."""
    from safetensors import torch as safetensors_torch

    def partly_written(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 100)
        failure()

    monkeypatch.setattr(safetensors_torch, "save_file", partly_written)


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP reads without a process group
def test_a_full_disk_is_one_line_naming_the_folder_and_nothing_is_left(run, tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from ppctl.fileio import mount_point

    def full():
        raise SafetensorError(FULL_DISK)

    _writing_then(monkeypatch, full)
    out = tmp_path / "hf"
    result = _invoke("export", str(run[0]), str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: cannot write {out}: No space left on device (writing model.safetensors, on the "
                             f"file system mounted at {mount_point(tmp_path)}); nothing of it was left\n")
    assert _left(tmp_path) == []


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sigterm_while_writing_is_one_line_and_removes_the_hidden_folder(run, tmp_path, monkeypatch):
    """The handler ppctl's ``main`` installs and hands to the command, and a real SIGTERM to this process while the
    weights are written."""
    import os

    from ppctl.run.interrupt import BeforeStartSignals

    _writing_then(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))
    signals = BeforeStartSignals()
    signals.installer_pid = os.getpid()
    saved = signal.signal(signal.SIGTERM, signals)
    try:
        out = tmp_path / "hf"
        result = _invoke("export", str(run[0]), str(out), obj=signals)
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert result.exit_code == 143
    assert result.stderr == f"error: interrupted by SIGTERM while exporting to {out} (written whole or not at all)\n"
    assert _left(tmp_path) == []


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ctrl_c_while_writing_removes_the_hidden_folder(run, tmp_path, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    _writing_then(monkeypatch, interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_run(run[0], tmp_path / "hf")
    assert _left(tmp_path) == []


# --- a run saving meanwhile with trainer.keep_last=1 ---------------------------------------------------------------

def _saving_during(monkeypatch, module, name, run_dir, config, step=3):
    """Make ``module.name`` (a reader's step) first let the run commit ``step`` with ``trainer.keep_last=1``, which
    prunes every checkpoint it is free to delete."""
    original = getattr(module, name)

    def saving_first(*args, **kwargs):
        if step not in [info.step for info in list_checkpoints(run_dir)]:
            save_step(run_dir, config, step, keep_last=1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, saving_first)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_export_reads_its_pinned_checkpoint_while_the_run_prunes(run, tmp_path, monkeypatch):
    run_dir, config = run
    _saving_during(monkeypatch, hf_export, "load_state", run_dir, config)  # while the tensors are read
    out = tmp_path / "hf"
    result = _invoke("export", str(run_dir), str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out} from {checkpoints_dir(run_dir) / 'step_00000002'} (step 2)\n"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert [info.step for info in list_checkpoints(run_dir)] == [2, 3]  # step 2 outlived the prune: it was pinned


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_generate_reads_its_pinned_checkpoint_while_the_run_prunes(run, monkeypatch):
    run_dir, config = run
    _saving_during(monkeypatch, source, "read_dense_model", run_dir, config)
    model = load_model(run_dir)
    assert (model.checkpoint, model.step) == (checkpoints_dir(run_dir) / "step_00000002", 2)
    assert [info.step for info in list_checkpoints(run_dir)] == [2, 3]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("reader", ["export", "generate"])
def test_latest_pruned_before_it_is_read_gives_the_new_latest(run, tmp_path, monkeypatch, reader):
    """The run commits step 3 (``latest``) and prunes step 2 just after the reader read ``latest``: the reader takes
    step 3 (before: export refused ``no complete checkpoint``, generate ``no readable ppctl.json``)."""
    run_dir, config = run
    module = hf_export if reader == "export" else source
    original = module.latest_checkpoint

    def then_saved(run_dir_read):
        named = original(run_dir_read)
        if named.name == "step_00000002":
            save_step(run_dir, config, 3, keep_last=1)
        return named

    monkeypatch.setattr(module, "latest_checkpoint", then_saved)
    if reader == "export":
        assert export_run(run_dir, tmp_path / "hf").step == 3
    else:
        assert load_model(run_dir).step == 3


def test_generate_says_the_step_it_read(run):
    result = _invoke("generate", str(run[0]), "--prompt", "ab", "--max-new-tokens", "2", "--temperature", "0",
                     "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert (printed["checkpoint"], printed["step"]) == (str(checkpoints_dir(run[0]) / "step_00000002"), 2)
    result = _invoke("generate", str(run[0]), "--prompt", "ab", "--max-new-tokens", "2")
    assert result.stderr.rstrip().endswith(f"; read {checkpoints_dir(run[0]) / 'step_00000002'} (step 2)")


# --- a config.yaml edited since the checkpoint ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_edited_activation_is_refused_as_resume_refuses_it(run, tmp_path):
    run_dir, config = run
    config_file = run_dir / "config.yaml"
    config_file.write_text(config_file.read_text().replace("activation: gelu\n", "activation: gelu_tanh\n"))
    checkpoint = checkpoints_dir(run_dir) / "step_00000002"
    edited = dict(vars(config.model), activation="gelu_tanh")
    resume = resume_problem(read_index(checkpoint), edited, vars(config.trainer), config.trainer.precision, 10)
    assert resume == "it was saved with model.activation=gelu, this run has gelu_tanh"
    expected = (f"{config_file} does not describe checkpoint {checkpoint}: it was saved with model.activation=gelu, "
                f"config.yaml has gelu_tanh (config.yaml was edited after the checkpoint was saved: put the saved "
                f"value back)")
    with pytest.raises(ExportError) as refused:
        export_run(run_dir, tmp_path / "hf")
    assert str(refused.value) == expected and _left(tmp_path) == []
    with pytest.raises(GenerateError) as refused:
        load_model(run_dir)
    assert str(refused.value) == expected
    result = _invoke("export", str(run_dir), str(tmp_path / "hf"))
    assert (result.exit_code, result.stderr) == (2, f"error: {expected}\n")
