"""Checkpoint directories: naming, the atomic commit, ``latest``, pruning, listing and verification.

A run directory holds ``checkpoints/step_<NNNNNNNN>/``, each a complete checkpoint: the
files of ``torch.distributed.checkpoint`` (``.metadata`` and one ``.distcp`` file per
rank) and ``ppctl.json`` (step, layout, model, data position, every file's size and
SHA-256, and the SHA-256 of the index itself, so that an edited index is refused like a
corrupt file). A checkpoint is written under a hidden temporary name and renamed into place
only after every rank has written its part and ``ppctl.json`` is on disk, so a
checkpoint directory is complete or absent; ``checkpoints/latest`` (a one-line file,
replaced atomically) names the newest complete one, a ``step_<N>`` directory beside it
(a pointer anywhere else is refused). A reader (``ppctl export``, ``ppctl generate``) pins the checkpoint it
reads (``pinned_checkpoint``: a shared ``flock`` on its directory) and the pruning of a run saving meanwhile
skips a pinned one, so ``trainer.keep_last`` never deletes a checkpoint under its reader. Pure: files and JSON only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ppctl.fileio import file_sha256, write_atomically

FORMAT_VERSION = 3  # 2: the index carries its own digest; 3: the parts are Stateful (objects trainer, loss_scaler, data, rng)
INDEX_NAME = "ppctl.json"
INDEX_DIGEST_KEY = "index_sha256"
LATEST_NAME = "latest"
CHECKPOINTS_FOLDER = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the checkpoint and the reason."""


def checkpoints_dir(run_dir: Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(run_dir) / CHECKPOINTS_FOLDER


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` steps."""
    return f"step_{step:08d}"


def temporary_dir(run_dir: Path, step: int) -> Path:
    """The hidden directory a checkpoint is written into before its commit."""
    return checkpoints_dir(run_dir) / f".{step_dir_name(step)}.partial"


def commit(run_dir: Path, step: int, index: dict[str, Any], keep_last: int) -> Path:
    """Make the checkpoint written in ``temporary_dir(run_dir, step)`` complete and current.

    Writes ``ppctl.json`` (with every file's size and digest), renames the directory into
    place, points ``latest`` at it, then deletes all but the ``keep_last`` newest complete
    checkpoints. Returns the checkpoint's directory. Called by one rank, after every rank
    has written its files.
    """
    partial, final = temporary_dir(run_dir, step), checkpoints_dir(run_dir) / step_dir_name(step)
    files = {path.name: {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
             for path in sorted(partial.iterdir()) if path.is_file()}
    index = {**index, "format_version": FORMAT_VERSION, "step": step, "files": files}
    index[INDEX_DIGEST_KEY] = index_digest(index)
    write_atomically(partial / INDEX_NAME, lambda handle: handle.write(json.dumps(index, indent=1).encode()))
    _fsync_dir(partial)
    if final.exists():  # the same step saved again (a resumed run repeating it): the new one wins
        shutil.rmtree(final)
    os.replace(partial, final)
    write_atomically(checkpoints_dir(run_dir) / LATEST_NAME, lambda handle: handle.write(f"{final.name}\n".encode()))
    _fsync_dir(checkpoints_dir(run_dir))
    prune(run_dir, keep_last)
    return final


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the ``keep_last`` newest (never ``latest``'s, nor one a reader has pinned:
    a later prune deletes it) and stale partial ones; return those deleted."""
    complete = [info.path for info in list_checkpoints(run_dir) if info.complete]
    keep = set(complete[-keep_last:]) | {latest_checkpoint(run_dir)}
    removed = [path for path in complete if path not in keep and _delete_unless_pinned(path)]
    partial = [path for path in checkpoints_dir(run_dir).glob(".step_*.partial") if path.is_dir()]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return removed + partial


# A reader's pin: a shared flock on the checkpoint's directory (no file is written: a reader may not own the run).
# The kernel lets it go when the reader ends, however it ends, so no pin outlives its reader. Where the file system
# has no flock, nothing is pinned: a checkpoint deleted under its reader is then refused in one line.
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.EBADF)
PIN_TRIES = 5  # how often a reader of ``latest`` reads it again when the checkpoint it named was deleted meanwhile


def _delete_unless_pinned(checkpoint: Path) -> bool:
    """Delete ``checkpoint`` unless a reader pins it; whether it is gone. The exclusive lock is held while deleting,
    so a reader that pins it meanwhile waits, then finds it gone."""
    try:
        descriptor = os.open(checkpoint, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return False
    except OSError as error:
        if error.errno not in NO_FLOCK:
            os.close(descriptor)
            raise
    try:
        shutil.rmtree(checkpoint, ignore_errors=True)
    finally:
        os.close(descriptor)
    return not checkpoint.exists()


def _pin(checkpoint: Path) -> int | None:
    """A shared lock on ``checkpoint``'s directory (its descriptor; None where this reader may not open it, which
    pins nothing); ``FileNotFoundError`` when it is gone, deleted since it was named (or while this waited for its
    deletion to end)."""
    try:
        descriptor = os.open(checkpoint, os.O_RDONLY | os.O_DIRECTORY)
    except PermissionError:  # a directory one may read files of but not list: its files are read unpinned
        return None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH)
        except OSError as error:
            if error.errno not in NO_FLOCK:
                raise
        held, named = os.fstat(descriptor), os.stat(checkpoint)  # raises when it was deleted meanwhile
        if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):  # the same step saved again meanwhile
            raise FileNotFoundError(errno.ENOENT, "replaced while it was pinned", str(checkpoint))
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


@contextlib.contextmanager
def pinned_checkpoint(resolve: Callable[[], Path], follow_latest: bool) -> Iterator[Path]:
    """The checkpoint ``resolve()`` names, pinned for the block: the pruning of a run saving meanwhile
    (``trainer.keep_last``) skips it. With ``follow_latest`` (``resolve`` reads ``latest``), a checkpoint deleted
    between ``resolve()`` and the pin is replaced by the one ``latest`` names then (a run's commit points ``latest``
    at its new checkpoint before it prunes the old one), and a ``latest`` that names the same missing one twice is
    refused; else, or after ``PIN_TRIES``, ``CheckpointError``. Where nothing can be pinned (no flock), a block that
    fails because the checkpoint was deleted under it is ``CheckpointError`` too, not the reader's own error."""
    previous = None
    for attempt in range(1, PIN_TRIES + 1):
        checkpoint = resolve()
        try:
            descriptor = _pin(checkpoint)
            break
        except (FileNotFoundError, NotADirectoryError):
            if follow_latest and checkpoint == previous:  # not moved on: ``latest`` names what is not there
                raise CheckpointError(f"checkpoint {checkpoint} refused: no such checkpoint (the one "
                                      f"{checkpoint.parent / LATEST_NAME} names)") from None
            if not follow_latest or attempt == PIN_TRIES:
                raise CheckpointError(deleted_while_read(checkpoint)) from None
            previous = checkpoint
    try:
        yield checkpoint
    except Exception:
        if checkpoint.is_dir():
            raise
        raise CheckpointError(deleted_while_read(checkpoint)) from None
    finally:
        if descriptor is not None:
            os.close(descriptor)


def deleted_while_read(checkpoint: Path) -> str:
    """One line: ``checkpoint`` was deleted before or while it was read."""
    return (f"checkpoint {checkpoint} was deleted before it could be read (a run saving into this directory prunes "
            f"all but its trainer.keep_last newest): read it again, or name a checkpoint it keeps")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory as ``ppctl checkpoints`` lists it."""

    path: Path
    step: int
    complete: bool
    problem: str | None
    bytes: int
    index: dict[str, Any]


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Every checkpoint directory of a run (partial ones too), oldest first."""
    found = []
    for path in checkpoints_dir(run_dir).glob("*step_*"):
        match = _STEP_DIR.match(path.name.removeprefix(".").removesuffix(".partial"))
        if not path.is_dir() or not match:
            continue
        problem = "partial (never committed)" if path.name.endswith(".partial") else checkpoint_problem(path)
        size = sum(item.stat().st_size for item in path.iterdir() if item.is_file())
        index = read_index(path) if problem is None else {}
        found.append(CheckpointInfo(path, int(match.group(1)), problem is None, problem, size, index))
    return sorted(found, key=lambda info: (info.step, info.complete))


def locate_run(path: Path) -> tuple[Path, Path | None]:
    """``(run directory, the one checkpoint named or None)`` for a path a user gives: a run directory, its
    checkpoints folder, or one of its checkpoints (``.../checkpoints/step_<N>``, as ``trainer.resume_from`` takes)."""
    bare_name = path.name.removeprefix(".").removesuffix(".partial")
    if path.parent.name == CHECKPOINTS_FOLDER and (_STEP_DIR.match(bare_name) or (path / INDEX_NAME).exists()):
        return path.parent.parent, path
    if path.name == CHECKPOINTS_FOLDER and not checkpoints_dir(path).is_dir():
        return path.parent, None
    return path, None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None; ``CheckpointError`` when it names anything but a ``step_<N>``
    directory in the run's checkpoints folder (``../elsewhere``, a path, a link out of the folder)."""
    folder = checkpoints_dir(run_dir)
    pointer = folder / LATEST_NAME
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    target = folder / name
    if not _STEP_DIR.match(name) or (target.exists() and target.resolve().parent != folder.resolve()):
        raise CheckpointError(f"{pointer} names {name!r}, which leaves {folder}: refused (it must name one of the "
                              f"step_<N> checkpoints in that folder)")
    return target


def index_digest(index: dict[str, Any]) -> str:
    """SHA-256 of an index without its own digest, in a canonical form (sorted keys, no spaces)."""
    content = {key: value for key, value in index.items() if key != INDEX_DIGEST_KEY}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoint_problem(path: Path, verify_digests: bool = False) -> str | None:
    """Why ``path`` is not a complete checkpoint (None when it is): missing or edited index, missing files, wrong
    sizes or (with ``verify_digests``) digests."""
    try:
        index = read_index(path)
    except (OSError, ValueError) as error:
        return f"no readable {INDEX_NAME} ({type(error).__name__}): not a complete checkpoint"
    if not isinstance(index, dict) or index.get("format_version") != FORMAT_VERSION:
        version = index.get("format_version") if isinstance(index, dict) else None
        return f"{INDEX_NAME} has format {version!r}, this ppctl reads {FORMAT_VERSION}"
    if index.get(INDEX_DIGEST_KEY) != index_digest(index):
        return f"{INDEX_NAME} is corrupt (its SHA-256 differs from the one written: the index was changed)"
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != index.get("step"):
        return f"{INDEX_NAME} says step {index.get('step')!r}, the directory step {int(match.group(1))}"
    files = index.get("files", {})
    if ".metadata" not in files:
        return "its index lists no .metadata file"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {expected['bytes']} were written"
        if verify_digests and file_sha256(file) != expected["sha256"]:
            return f"{name} is corrupt (its SHA-256 differs from the one written)"
    return None


def resolve_checkpoint(location: str | os.PathLike) -> Path:
    """The checkpoint directory ``trainer.resume_from`` names (a run directory: its ``latest``), verified.

    Raises ``CheckpointError`` with one line when there is none or it is incomplete or corrupt.
    """
    path = Path(location)
    if not path.exists():
        raise CheckpointError(f"trainer.resume_from={location}: no such run or checkpoint directory")
    if (path / INDEX_NAME).exists() or _STEP_DIR.match(path.name):
        checkpoint = path
    else:
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise CheckpointError(f"trainer.resume_from={location}: no complete checkpoint in this run directory "
                                  f"(no {checkpoints_dir(path) / LATEST_NAME})")
    problem = checkpoint_problem(checkpoint, verify_digests=True)
    if problem is not None:
        raise CheckpointError(f"checkpoint {checkpoint} refused: {problem}")
    return checkpoint.resolve()


def read_index(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's ``ppctl.json``."""
    return json.loads((Path(checkpoint) / INDEX_NAME).read_text())


# What must match for a checkpoint's tensors to fit this run's model.
MODEL_KEYS = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "max_seq_length",
              "position_embedding", "tie_embeddings")
# The same of model.moe, and what the weights computed when they learnt: which layers have experts, how many, how
# wide, how tokens are routed to them (the router losses, the capacity and the bias's rate are training choices a
# resume may change).
MOE_KEYS = ("num_experts", "topk", "expert_ffn_hidden_size", "layer_freq", "first_dense_layers", "shared_experts",
            "router_score", "router_topk_norm", "expert_bias")
# Model settings checkpoints record since issue 45 (an older one is taken as it is): the activation (what the
# weights computed), the mixture.
RECORDED_LATER = ("activation", *(f"moe.{key}" for key in MOE_KEYS))
# What must match for the data to go on where it stopped: the sample order is a function of (seed, step)
# for a given global batch size and window length.
DATA_KEYS = ("seed", "global_batch_size", "seq_length")


def model_record(model: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the model (``vars`` of its family's ``ModelConfig``): its ``MODEL_KEYS``, its
    activation where its family has one (GPT's), and ``model.moe``'s ``MOE_KEYS`` as ``moe.<key>`` (with experts, an
    unset expert width is ``ffn_hidden_size``)."""
    record = {key: model[key] for key in (*MODEL_KEYS, "activation") if key in model}
    moe = model["moe"]
    record.update({f"moe.{key}": getattr(moe, key) for key in MOE_KEYS})
    if moe.num_experts and moe.expert_ffn_hidden_size is None:
        record["moe.expert_ffn_hidden_size"] = model["ffn_hidden_size"]
    return record


def resume_problem(index: dict[str, Any], model: dict[str, Any], data: dict[str, Any], precision: str,
                   max_steps: int, gradient_delay: int = 0, tokenizer: dict[str, Any] | None = None) -> str | None:
    """Why a run with this model (``vars`` of its ``ModelConfig``, or its ``model_record``), data position,
    precision, ``max_steps``, ``optimizer.gradient_delay`` and ``tokenizer``
    (``ppctl.data.tokenizer.tokenizer_record``) cannot resume from a checkpoint whose ``ppctl.json`` is ``index``
    (None when it can). The layout, schedule and optimizer sharding may change. A setting the checkpoint does not
    record (saved before ppctl recorded it) is taken as it is."""
    problem = model_problem(index, model)
    if problem is not None:
        return problem
    for key in DATA_KEYS:
        if index["data"].get(key) != data[key]:
            return f"it was saved with trainer.{key}={index['data'].get(key)}, this run has {data[key]}"
    problem = tokenizer_problem(index["data"].get("tokenizer"), tokenizer)
    if problem is not None:
        return problem
    if index["precision"] != precision:
        return f"it was saved with trainer.precision={index['precision']}, this run has {precision}"
    if index.get("gradient_delay", 0) != gradient_delay:
        return (f"it was saved with optimizer.gradient_delay={index.get('gradient_delay', 0)}, this run has "
                f"{gradient_delay} (the previous weight version is saved only with a delay)")
    if index["step"] >= max_steps:
        return f"it is at step {index['step']}, not before trainer.max_steps={max_steps}: raise trainer.max_steps"
    return None


def model_problem(index: dict[str, Any], model: dict[str, Any], having: str = "this run has") -> str | None:
    """Why the weights of a checkpoint whose ``ppctl.json`` is ``index`` are not those of ``model`` (``vars`` of a
    ``ModelConfig``, or its ``model_record``): the first recorded setting that differs, ``having`` naming where
    ``model`` comes from (None when none differs). A setting the checkpoint does not record (saved before ppctl
    recorded it) is taken as it is. Resuming, exporting and generating all ask it."""
    model = model_record(model) if "moe" in model else model
    for key in MODEL_KEYS + RECORDED_LATER:
        if key in RECORDED_LATER and (key not in index["model"] or key not in model):
            continue  # recorded since issue 45, or a key this model's family has not (Llama's MLP has no GELU)
        saved = index["model"].get(key)
        if saved != model[key]:
            return f"it was saved with model.{key}={saved}, {having} {model[key]}"
    return None


def tokenizer_problem(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> str | None:
    """Why weights trained on the tokens of ``saved`` cannot go on with those of ``current`` (None when they can):
    another vocabulary gives each embedding row another token. A checkpoint without the record (saved before
    ppctl kept one, or on synthetic data) is taken as it is."""
    if not saved or not current or saved.get("vocab_sha256") == current.get("vocab_sha256"):
        return None
    then, now = _tokenizer_named(saved), _tokenizer_named(current)
    if then == now:  # the same file, edited since
        then += f" (vocabulary {saved['vocab_sha256'][:12]})"
        now += f" (vocabulary {current['vocab_sha256'][:12]})"
    if saved.get("vocab_size") == current.get("vocab_size"):
        sizes = "same vocabulary size, different tokens"
    else:
        sizes = f"{saved.get('vocab_size'):,} ids then, {current.get('vocab_size'):,} now"
    return (f"it was trained with tokenizer {then}; this run's data.tokenizer is {now} ({sizes}): each embedding row "
            f"would stand for another token; resume with the tokenizer it was trained with, or start a new run "
            f"without trainer.resume_from")


def _tokenizer_named(record: dict[str, Any]) -> str:
    """A tokenizer as a message names it: a file by its path, else by its name (``byte``)."""
    return record.get("path") or record.get("name", "?")


def is_run_dir_checkpoint(location: str | os.PathLike) -> bool:
    """Whether ``trainer.resume_from`` names a run directory (rather than one checkpoint)."""
    path = Path(location)
    return path.is_dir() and not (path / INDEX_NAME).exists() and not _STEP_DIR.match(path.name)


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename) to disk, where the platform allows it."""
    with contextlib.suppress(OSError):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
