"""A checkpoint save that fails ends in one line naming the checkpoint and why, not DCP's
``CheckpointException ranks:dict_keys([0, 1])``."""

import traceback

import pytest
import torch

from ppctl.checkpoint.store import CheckpointSaveError, save_failure, save_state


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that it saves without a process group
def test_a_save_that_cannot_write_names_the_checkpoint_and_the_reason(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the checkpoints folder should be")
    partial = tmp_path / "checkpoints" / ".step_00000004.partial"
    with pytest.raises(CheckpointSaveError) as failed:
        save_state({"weight": torch.ones(2)}, partial)
    assert str(failed.value) == f"cannot save the checkpoint {partial}: rank 0: Not a directory ({partial})"
    assert "\n" not in str(failed.value)
    assert failed.value.__cause__ is not None  # DCP's exception, with every rank's traceback, stays attached


def wrapped(error: BaseException):
    """A rank's failure as DCP gathers it: the exception and its stack summary."""
    return error, traceback.StackSummary.from_list([])


def test_the_first_failing_rank_is_named_and_the_others_counted():
    denied = PermissionError(13, "Permission denied", "/run/checkpoints/.step_00000004.partial/__1_0.distcp")
    failures = {1: wrapped(denied), 3: wrapped(RuntimeError("disk gone\nmore"))}
    assert save_failure("/run/checkpoints/.step_00000004.partial", failures) == (
        "cannot save the checkpoint /run/checkpoints/.step_00000004.partial: rank 1: Permission denied "
        "(/run/checkpoints/.step_00000004.partial/__1_0.distcp) (and 1 more rank(s))")
    assert save_failure("ckpt", {0: wrapped(RuntimeError("disk gone\nmore"))}) == \
        "cannot save the checkpoint ckpt: rank 0: RuntimeError: disk gone"
