"""A reader's pin on a checkpoint: the pruning of a run saving meanwhile (``trainer.keep_last``) skips it.

``ppctl export`` and ``ppctl generate`` read a run's checkpoint while the run may go on saving; before the pin,
its pruning deleted the checkpoint under the reader (``FileNotFoundError`` on ``.metadata``, DCP's assertions).
Each case is made deterministic by running the saver's commit at the moment the race needs, in this process: a
flock is held by an open file description, so a second descriptor of the same process conflicts with it as
another process's would. The readers themselves: ``tests/unit/test_export_inputs.py``.
"""

import pytest

from ppctl.checkpoint.files import (CheckpointError, checkpoints_dir, latest_checkpoint, list_checkpoints,
                                    pinned_checkpoint, prune)
from tests.unit.test_checkpoint_files import write_checkpoint


def _steps(run_dir) -> list[int]:
    return [info.step for info in list_checkpoints(run_dir)]


def test_a_prune_skips_a_pinned_checkpoint_and_a_later_one_deletes_it(tmp_path):
    write_checkpoint(tmp_path, 1, keep_last=1)
    with pinned_checkpoint(lambda: latest_checkpoint(tmp_path), follow_latest=True) as checkpoint:
        write_checkpoint(tmp_path, 2, keep_last=1)  # the run saves on and prunes
        write_checkpoint(tmp_path, 3, keep_last=1)
        assert checkpoint.name == "step_00000001" and _steps(tmp_path) == [1, 3]
        assert sorted(path.name for path in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "ppctl.json"]
    assert prune(tmp_path, keep_last=1) == [checkpoint]  # unpinned: the next prune deletes it
    assert _steps(tmp_path) == [3]


def test_latest_deleted_before_it_is_pinned_gives_the_new_latest(tmp_path):
    write_checkpoint(tmp_path, 1, keep_last=1)
    named = []

    def resolve_then_save():
        named.append(latest_checkpoint(tmp_path))
        if len(named) == 1:  # the run commits step 2 and prunes step 1 between reading latest and the pin
            write_checkpoint(tmp_path, 2, keep_last=1)
        return named[-1]

    with pinned_checkpoint(resolve_then_save, follow_latest=True) as checkpoint:
        assert checkpoint.name == "step_00000002"
    assert [path.name for path in named] == ["step_00000001", "step_00000002"]


def test_a_named_checkpoint_deleted_before_it_is_pinned_is_refused_in_one_line(tmp_path):
    first = write_checkpoint(tmp_path, 1, keep_last=1)

    def resolve_then_save():
        write_checkpoint(tmp_path, 2, keep_last=1)
        return first

    with pytest.raises(CheckpointError) as refused:
        with pinned_checkpoint(resolve_then_save, follow_latest=False):
            pass
    assert str(refused.value) == (
        f"checkpoint {first} was deleted before it could be read (a run saving into this directory prunes all but "
        f"its trainer.keep_last newest): read it again, or name a checkpoint it keeps")


def test_a_latest_that_names_a_missing_checkpoint_is_refused_not_followed_for_ever(tmp_path):
    write_checkpoint(tmp_path, 1, keep_last=1)
    (checkpoints_dir(tmp_path) / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match=r"step_00000009 refused: no such checkpoint \(the one .*/latest names\)"):
        with pinned_checkpoint(lambda: latest_checkpoint(tmp_path), follow_latest=True):
            pass


def test_a_checkpoint_deleted_under_a_reader_without_a_pin_is_refused_in_one_line(tmp_path, monkeypatch):
    """Where the file system has no flock, the reader's own error (here a FileNotFoundError) becomes the one line."""
    import errno
    import fcntl

    def no_flock(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    write_checkpoint(tmp_path, 1, keep_last=1)
    with pytest.raises(CheckpointError, match=r"step_00000001 was deleted before it could be read"):
        with pinned_checkpoint(lambda: latest_checkpoint(tmp_path), follow_latest=True) as checkpoint:
            write_checkpoint(tmp_path, 2, keep_last=1)  # nothing pinned: the prune deletes it
            (checkpoint / ".metadata").read_bytes()
