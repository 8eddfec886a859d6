"""``ppctl export``: a run's checkpoint as a Hugging Face model folder.

A checkpoint holds every parameter as the dense tensor of one process, by global name, the vocabulary
unpadded (``model/<name>``): this module reads those in one process (DCP, no process group), whatever
layout saved them, and writes what ``transformers`` loads: ``config.json`` (the family's architecture for the
run's shape, ``ppctl.model.hf_format``; a model with experts as Mixtral, ``ppctl.model.llama.hf``),
``model.safetensors`` (or shards of at most ``max_shard_bytes`` and ``model.safetensors.index.json``),
``generation_config.json`` and, when the run read a tokenizer file, that file as ``tokenizer.json`` with a
``tokenizer_config.json`` (the byte tokenizer has no HF form: a note says so; a ``data=chat`` run's config carries
the chat template it rendered with and that template's special tokens). The weights keep the checkpoint's
dtype (``model/``: the run's precision). The folder is written under a hidden name beside ``out_dir`` and renamed
into place, so it is complete or absent: a failure (a full disk) or a signal removes the hidden folder; an
``out_dir`` that exists and is not empty is refused. The checkpoint is pinned while it is read (a run saving with
``trainer.keep_last`` does not delete it meanwhile), and the run's ``config.yaml`` must describe the model it saved
(the check ``trainer.resume_from`` makes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ppctl.checkpoint.files import (CheckpointError, checkpoint_problem, checkpoints_dir, latest_checkpoint,
                                    list_checkpoints, locate_run, model_problem, pinned_checkpoint, read_index,
                                    step_dir_name)
from ppctl.checkpoint.pieces import Piece
from ppctl.checkpoint.store import Sharded, load_state
from ppctl.config import PpctlConfig
from ppctl.resolve import load_config_file
from ppctl.fileio import mount_point
from ppctl.model.family import ResolvedModel, hf_experts_formats, resolve_model
from ppctl.model.hf_format import CONFIG_FILE, GENERATION_FILE, INDEX_FILE, WEIGHTS_FILE, HFError, hf_format_of
from ppctl.model.hf_weights import to_hf_tensors
from ppctl.model.rules import QKV_ROWS

DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
MODEL_PREFIX = "model/"
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}


class ExportError(ValueError):
    """A run or folder ``ppctl export`` cannot use; the message is one line."""


@dataclass(frozen=True)
class Exported:
    """What ``export_run`` read (the checkpoint and its step) and the notes to show (what was not written, and why)."""

    checkpoint: Path
    step: int
    notes: list[str]


def export_run(run_dir: Path, out_dir: Path, step: int | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Exported:
    """Export the checkpoint of ``run_dir`` at ``step`` (default: ``latest``) into ``out_dir``. ``ExportError`` (one
    line) for what cannot be exported. The checkpoint is pinned while it is read; ``latest`` deleted before it is
    pinned gives the new one."""
    refuse_occupied(out_dir)
    run_dir, named = locate_run(Path(run_dir))
    if named is not None and step is not None:
        raise ExportError(f"{named} is one checkpoint: give its run directory with --step {step}, or drop --step")
    resolve = (lambda: _existing(named)) if named is not None else (lambda: _checkpoint_at(run_dir, step))
    try:
        with pinned_checkpoint(resolve, follow_latest=named is None and step is None) as checkpoint:
            config = _run_config(run_dir, _verified(checkpoint))
            notes = export_checkpoint(checkpoint, config, out_dir, max_shard_bytes)
            return Exported(checkpoint, read_index(checkpoint)["step"], notes)
    except CheckpointError as error:
        raise ExportError(str(error)) from None


def _run_config(run_dir: Path, checkpoint: Path) -> PpctlConfig:
    """The run's ``config.yaml``, which must describe the model ``checkpoint`` holds (as ``trainer.resume_from``
    checks it: ``model_problem``); else ``ExportError``."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ExportError(f"{run_dir}: no config.yaml (not a ppctl run directory): give the trainer.out_dir of a run")
    config = load_config_file(config_file)
    problem = run_config_problem(config_file, checkpoint, read_index(checkpoint), vars(config.model))
    if problem is not None:
        raise ExportError(problem)
    return config


def run_config_problem(config_file: Path, checkpoint: Path, index: dict[str, Any],
                       model: dict[str, Any]) -> str | None:
    """Why a run's ``config.yaml`` (its ``model``) does not describe the weights of its ``checkpoint`` (whose
    ``ppctl.json`` is ``index``): the check of ``trainer.resume_from``; None when it does. The file was edited since
    the checkpoint was saved: read as it says, the weights would compute another function."""
    problem = model_problem(index, model, having=f"{config_file.name} has")
    if problem is None:
        return None
    return (f"{config_file} does not describe checkpoint {checkpoint}: {problem} ({config_file.name} was edited after "
            f"the checkpoint was saved: put the saved value back)")


def refuse_occupied(out_dir: Path) -> None:
    """``ExportError`` unless ``out_dir`` is absent or an empty folder: nothing is replaced without asking."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not empty: choose a new folder (nothing is replaced)")


def _checkpoint_at(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of ``run_dir`` at ``step`` (None: the one ``latest`` names, which ``pinned_checkpoint`` finds
    there or not), not yet verified."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    try:
        checkpoint = latest_checkpoint(run_dir) if step is None else checkpoints_dir(run_dir) / step_dir_name(step)
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    if checkpoint is None or (step is not None and not checkpoint.is_dir()):
        saved = [str(info.step) for info in list_checkpoints(run_dir) if info.complete]
        which = "no complete checkpoint" if step is None else f"no checkpoint at step {step}"
        raise ExportError(f"{run_dir}: {which} (complete checkpoints at steps: {', '.join(saved) or 'none'})")
    return checkpoint


def _existing(checkpoint: Path) -> Path:
    """``checkpoint``, one a user named, when it is a directory; else ``ExportError``."""
    if not checkpoint.is_dir():
        raise ExportError(f"checkpoint {checkpoint} refused: no such checkpoint")
    return checkpoint


def _verified(checkpoint: Path) -> Path:
    """``checkpoint`` when it is complete and intact (every file's size and SHA-256), else ``ExportError``."""
    problem = checkpoint_problem(checkpoint, verify_digests=True) if checkpoint.is_dir() else "no such checkpoint"
    if problem is not None:
        raise ExportError(f"checkpoint {checkpoint} refused: {problem}")
    return checkpoint


def export_checkpoint(checkpoint: Path, config: PpctlConfig, out_dir: Path,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write the HF folder of ``checkpoint`` (saved by a run of ``config``) into ``out_dir``; return the notes."""
    refuse_occupied(out_dir)
    try:
        model = resolve_model(config)
        hf = hf_format_of(model.family)
        _check_experts_writable(model)
        architecture = hf.hf_config(model.shape)  # refuses what the format cannot express before anything is read
        dense = read_dense_model(checkpoint, model.rules)
        dtype = next(iter(dense.values())).dtype
        tokenizer, notes = tokenizer_files(config, read_index(checkpoint))
        hf_config = {**architecture, "dtype": DTYPE_NAMES[dtype], **_special_tokens(tokenizer)}
        tensors = to_hf_tensors(hf, model.shape, hf_config, dense)
    except HFError as error:
        raise ExportError(f"{checkpoint}: {error}") from None
    _write_folder(out_dir, hf_config, tensors, tokenizer, max_shard_bytes)
    return notes


def _check_experts_writable(model: ResolvedModel) -> None:
    """``HFError`` for a model with experts whose family's format writes none (its capability
    ``hf_moe_architecture``)."""
    experts = model.settings.moe.num_experts
    if experts and model.hf_moe_architecture is None:
        raise HFError(f"model.moe.num_experts={experts} with model.family={model.family.name}: this family's "
                      f"Hugging Face format writes no mixture of experts (ppctl writes them as {hf_experts_formats()})")


def read_dense_model(checkpoint: Path, rule_for) -> dict[str, torch.Tensor]:
    """Every ``model/<name>`` tensor of a checkpoint, whole, by global name (the fused QKV weight back in its
    ``[3 * rows, ...]`` shape), read in this process with no process group."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {}
    for key, meta in stored.items():
        if key.startswith(MODEL_PREFIX) and hasattr(meta, "size"):
            tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            state[key] = Sharded(tuple(meta.size), [Piece((0,) * len(meta.size), tensor)])
    load_state(state, checkpoint, alone=True)
    dense = {}
    for key, entry in state.items():
        name, tensor = key[len(MODEL_PREFIX):], entry.pieces[0].tensor
        dense[name] = tensor.flatten(0, 1) if rule_for(name).split == QKV_ROWS else tensor
    return dense


def tokenizer_files(config: PpctlConfig, index: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """``(the run's tokenizer: its end-of-document id and the file to copy, if any; notes)``: a tokenizer file is
    copied when it is still the one the checkpoint recorded; the byte tokenizer and synthetic data have none."""
    from ppctl.data.tokenizer import build_tokenizer

    data = config.data
    if data.source == "synthetic":
        return None, ["note: synthetic data has no tokenizer: no tokenizer files written"]
    if data.tokenizer == "byte":
        return ({"eod_id": build_tokenizer("byte").eod_id},
                ["note: data.tokenizer=byte (UTF-8 bytes, 256 = end of document) has no Hugging Face tokenizer file: "
                 "no tokenizer files written"])
    recorded = (index.get("data") or {}).get("tokenizer") or {}
    tokenizer = build_tokenizer(data.tokenizer) if Path(data.tokenizer).is_file() else None
    if tokenizer is None or recorded.get("vocab_sha256") not in (None, tokenizer.vocabulary_sha256):
        return None, [f"note: the tokenizer file {data.tokenizer} is gone or changed since the checkpoint was saved: "
                      f"no tokenizer files written"]
    eod_token = {token_id: token for token, token_id in tokenizer.vocabulary_tokens()}.get(tokenizer.eod_id)
    notes = [] if eod_token is not None else [
        f"note: {data.tokenizer} has no end-of-text token; the end-of-document id {tokenizer.eod_id} is ppctl's own, "
        f"which the copied tokenizer.json does not know"]
    template, template_notes = run_chat_template(config)
    return ({"path": Path(data.tokenizer), "eod_id": tokenizer.eod_id, "eod_token": eod_token,
             "chat_template": template}, notes + template_notes)


def run_chat_template(config: PpctlConfig) -> tuple[Any, list[str]]:
    """``(the chat template a data=chat run rendered its conversations with, notes)``: a
    ``ppctl.data.chat.ChatTemplate``, so that the export renders a conversation as the run did
    (``apply_chat_template``); None for other data, or with a note when it can no longer be read."""
    from ppctl.data.chat import TemplateError, load_chat_template

    if config.data.source != "chat":
        return None, []
    where = config.data.chat_template or Path(config.data.tokenizer).parent
    try:
        return load_chat_template(where), []
    except TemplateError as error:
        return None, [f"note: the run's chat template cannot be read ({error}): no chat template written"]


def _special_tokens(tokenizer: dict[str, Any] | None) -> dict[str, Any]:
    """``bos_token_id`` and ``eos_token_id``: the end-of-document id (None when the run had no tokenizer)."""
    eod = tokenizer["eod_id"] if tokenizer is not None else None
    return {"bos_token_id": eod, "eos_token_id": eod}


def _write_folder(out_dir: Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                  tokenizer: dict[str, Any] | None, max_shard_bytes: int) -> None:
    """Write the folder under a hidden name beside ``out_dir``, then rename it into place. Whatever ends the write
    (a full disk; Ctrl-C or SIGTERM: ``KeyboardInterrupt``, or the ``SystemExit`` of ppctl's handler) removes the
    hidden folder; an OS error is ``ExportError`` (``write_failure``), anything else goes on up."""
    partial = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        _write_json(partial / CONFIG_FILE, hf_config)
        _write_json(partial / GENERATION_FILE, {"_from_model_config": True, "bos_token_id": hf_config["bos_token_id"],
                                                "eos_token_id": hf_config["eos_token_id"]})
        write_weights(partial, tensors, max_shard_bytes)
        if tokenizer is not None and "path" in tokenizer:
            write_tokenizer(partial, tokenizer, hf_config)
        mode = (partial / CONFIG_FILE).stat().st_mode & 0o777  # as this process makes files (safetensors: 0600)
        for file in partial.glob("*.safetensors"):
            file.chmod(mode)
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (refuse_occupied): the rename takes its place
        os.replace(partial, out_dir)
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, OSError):
            raise ExportError(write_failure(out_dir, partial, error)) from None
        raise


def write_failure(out_dir: Path, partial: Path, error: OSError) -> str:
    """One line: ``out_dir`` could not be written, the OS's reason, the file it was writing and the file system
    (where a full disk is to be freed), and that nothing of it was left."""
    reason = error.strerror or str(error)
    file = Path(error.filename) if error.filename else None
    writing = f"writing {file.name}, " if file is not None and file.parent == partial else ""
    return (f"cannot write {out_dir}: {reason} ({writing}on the file system mounted at {mount_point(out_dir.parent)}"
            f"); nothing of it was left")


def write_tokenizer(folder: Path, tokenizer: dict[str, Any], hf_config: dict[str, Any]) -> None:
    """The run's tokenizer file as ``tokenizer.json``, and a ``tokenizer_config.json`` that makes ``AutoTokenizer``
    read that file as it is (without one it picks the architecture's own tokenizer class, another tokenizer)."""
    with _naming(folder / TOKENIZER_FILE):
        shutil.copyfile(tokenizer["path"], folder / TOKENIZER_FILE)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": hf_config.get(
        "n_positions", hf_config.get("max_position_embeddings"))}
    if tokenizer["eod_token"] is not None:
        settings.update(eos_token=tokenizer["eod_token"], bos_token=tokenizer["eod_token"])
    template = tokenizer.get("chat_template")
    if template is not None:  # the template with the special tokens it renders (a bos_token it writes, say)
        settings.update(dict(template.special_tokens), chat_template=template.text)
    _write_json(folder / TOKENIZER_CONFIG_FILE, settings)


def write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` each (a bigger tensor alone in its shard)
    named ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + size > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += size
    if len(shards) == 1:
        save_safetensors(shards[0], folder / WEIGHTS_FILE)
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, folder / file)
        weight_map.update({name: file for name in shard})
    _write_json(folder / INDEX_FILE, {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map})


def save_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """``tensors`` as the safetensors file ``file``. The library reports a failed write (a full disk) as its own
    ``SafetensorError`` (``I/O error: No space left on device (os error 28)``): it is raised as the ``OSError`` it
    was, on ``file``."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(file), metadata={"format": "pt"})
    except SafetensorError as error:
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(file)) from error


def _write_json(path: Path, content: dict[str, Any]) -> None:
    with _naming(path):
        path.write_text(json.dumps(content, indent=2) + "\n")


@contextlib.contextmanager
def _naming(file: Path) -> Iterator[None]:
    """An OS error within the block names ``file`` (one raised when a write is flushed names none)."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(file)) from error
