"""The model ``ppctl generate`` runs: a run's latest checkpoint, or a Hugging Face model folder, with its tokenizer.

Both give the whole model as one chunk in this process (``TPGroup.single()``, no recomputation), as the
single-process reference builds it. A run directory (its ``config.yaml``; or one of its checkpoints) gives
the config, the checkpoint's dense ``model/<name>`` tensors read with no process group
(``ppctl.checkpoint.hf_export.read_dense_model``) and the run's tokenizer, checked against the one the
checkpoint recorded. A Hugging Face folder (``config.json``) gives the family that reads its architecture, the
shape its ``config.json`` describes (the family's ``shape_from_hf``), the weights through ``model.init_from``,
its ``tokenizer.json`` (a prompt encoded as transformers' ``tokenizer(prompt)`` encodes it, the special tokens its
post-processor adds kept), and the end-of-text ids transformers' ``generate`` stops at (``generation_config.json``'s,
else ``config.json``'s).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ppctl.checkpoint.files import (CheckpointError, checkpoint_problem, latest_checkpoint, locate_run,
                                    pinned_checkpoint, read_index)
from ppctl.checkpoint.hf_export import read_dense_model, run_config_problem
from ppctl.config import ConfigError
from ppctl.resolve import compose_config, load_config_file
from ppctl.data.tokenizer import (FOLDER_TOKENIZER, Tokenizer, TokenizerFile, build_tokenizer, folder_tokenizer,
                                  tokenizer_record)
from ppctl.generate.inputs import prompt_problem
from ppctl.model.family import resolve_model
from ppctl.model.from_config import build_chunk
from ppctl.model.hf_format import (CONFIG_FILE, GENERATION_FILE, HFError, folder_model, init_from_problem,
                                   read_folder_json, set_setting)
from ppctl.model.recompute import Recompute
from ppctl.model.rules import rule_of
from ppctl.parallel.layout import StageLayers

RUN_CONFIG = "config.yaml"


class GenerateError(ValueError):
    """A model, tokenizer or setting ``ppctl generate`` cannot use; the message is one line."""


@dataclass
class Model:
    """The whole model as one chunk, its tokenizer, the ids that end a text, and the longest sequence it takes; from
    a run, the checkpoint read and its step."""

    chunk: torch.nn.Module
    tokenizer: Tokenizer
    stop_ids: frozenset[int]
    max_seq_length: int
    vocab_size: int
    checkpoint: Path | None = None  # a run's: the checkpoint read, and its step
    step: int | None = None
    special_tokens: bool = False  # a folder's: the prompt with the tokens its tokenizer adds, as transformers'

    def prompt_ids(self, prompt: str, max_new_tokens: int) -> list[int]:
        """The token ids of ``prompt`` (a run's: as its training data was encoded; a folder's: with the special tokens
        its tokenizer adds); ``GenerateError`` when it is empty or not UTF-8, gives no token, holds an id beyond the
        model's vocabulary, or leaves no room for ``max_new_tokens`` within ``model.max_seq_length`` (the learned
        position table ends there; rotary models were trained no further)."""
        if prompt_problem(prompt) is not None:
            raise GenerateError(prompt_problem(prompt))
        if not prompt:
            raise GenerateError("--prompt is empty: give the text to continue")
        ids = (self.tokenizer.encode_with_special_tokens(prompt) if self.special_tokens
               else self.tokenizer.encode(prompt))
        if not ids:
            raise GenerateError(f"--prompt {prompt!r} gives no token with the tokenizer {self.tokenizer.name}: give "
                                f"text it reads")
        if max(ids) >= self.vocab_size:
            raise GenerateError(f"--prompt: token id {max(ids)} is beyond the model's vocabulary of "
                                f"{self.vocab_size} ids (a tokenizer of another model?)")
        if len(ids) + max_new_tokens > self.max_seq_length:
            room = self.max_seq_length - len(ids)
            fix = (f"use --max-new-tokens {room} or less" if room > 0
                   else f"shorten the prompt to at most {self.max_seq_length - 1} tokens")
            raise GenerateError(f"--prompt is {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                                f"{len(ids) + max_new_tokens}, beyond model.max_seq_length={self.max_seq_length}: "
                                f"{fix}")
        return ids


def load_model(path: Path, precision: str | None = None) -> Model:
    """The model of a run directory (or one of its checkpoints) or of a Hugging Face folder. ``precision``: the
    parameters' (``fp32``, ``fp64``, ``bf16``, ``fp16``; default: the run's, fp32 for a folder)."""
    run_dir, named = locate_run(Path(path))
    if (run_dir / RUN_CONFIG).is_file():
        return _from_run(run_dir, named, precision)
    if os.path.lexists(Path(path) / CONFIG_FILE):  # read_hf_config says what is wrong with one that is no file
        return _from_hf(Path(path), precision or "fp32")
    if not Path(path).exists():
        raise GenerateError(f"{path}: no such run directory or model folder")
    raise GenerateError(f"{path}: neither a run directory (no {RUN_CONFIG}) nor a Hugging Face model folder "
                        f"(no {CONFIG_FILE})")


def _whole_model(config, model=None) -> torch.nn.Module:
    """Every layer of ``config``'s model (its ``ResolvedModel``, resolved here if not given) as one chunk on one
    process, no recomputation, in eval mode."""
    chunk = build_chunk(config, StageLayers.whole(config.model.num_layers), recompute=Recompute(), model=model)
    return chunk.eval().requires_grad_(False)


def _model(chunk, tokenizer, stop_ids, config) -> Model:
    model = config.model
    return Model(chunk, tokenizer, frozenset(stop_ids), model.max_seq_length, model.vocab_size)


# --- a run directory ---------------------------------------------------------------------------------------------

def _from_run(run_dir: Path, named: Path | None, precision: str | None) -> Model:
    """The model of ``run_dir``'s checkpoint ``named`` (default: the latest complete one) and the run's tokenizer.

    The checkpoint is pinned while it is read (a run saving with ``trainer.keep_last`` does not delete it meanwhile;
    ``latest`` deleted before it is pinned gives the new one), and the run's ``config.yaml`` must describe the model
    it holds, as ``trainer.resume_from`` checks it."""
    try:
        config = load_config_file(run_dir / RUN_CONFIG)
    except Exception as error:  # OmegaConf's and YAML's errors have no common base
        raise GenerateError(f"{run_dir / RUN_CONFIG}: unreadable ({type(error).__name__})") from None
    resolve = (lambda: _named(named)) if named is not None else (lambda: _latest(run_dir))
    try:
        with pinned_checkpoint(resolve, follow_latest=named is None) as checkpoint:
            problem = checkpoint_problem(checkpoint, verify_digests=True)
            if problem is not None:
                raise GenerateError(f"checkpoint {checkpoint} refused: {problem}")
            index = read_index(checkpoint)
            problem = run_config_problem(run_dir / RUN_CONFIG, checkpoint, index, vars(config.model))
            if problem is not None:
                raise GenerateError(problem)
            tokenizer = run_tokenizer(config, index, run_dir)
            config = replace(config, model=replace(config.model, init_from=None),  # the checkpoint holds the weights
                             trainer=replace(config.trainer, precision=precision or config.trainer.precision))
            model = resolve_model(config)
            chunk = _whole_model(config, model)
            load_dense_model(chunk, read_dense_model(checkpoint, model.rules), checkpoint)
    except CheckpointError as error:
        raise GenerateError(str(error)) from None
    return replace(_model(chunk, tokenizer, {tokenizer.eod_id}, config), checkpoint=checkpoint, step=index["step"])


def _latest(run_dir: Path) -> Path:
    """The checkpoint ``latest`` names; ``GenerateError`` when the run has none."""
    try:
        checkpoint = latest_checkpoint(run_dir)
    except CheckpointError as error:
        raise GenerateError(str(error)) from None
    if checkpoint is None:
        raise GenerateError(f"{run_dir}: no checkpoint to generate from (no {run_dir / 'checkpoints' / 'latest'}): "
                            f"train it first, or give a run that saved one")
    return checkpoint


def _named(checkpoint: Path) -> Path:
    """``checkpoint``, one a user named, when it is a directory; else ``GenerateError``."""
    if not checkpoint.is_dir():
        raise GenerateError(f"checkpoint {checkpoint} refused: {checkpoint_problem(checkpoint)}")
    return checkpoint


def run_tokenizer(config, index: dict, run_dir: Path) -> Tokenizer:
    """The run's tokenizer (``data.tokenizer``), the one its checkpoint was trained with; ``GenerateError`` for
    synthetic data (its ids stand for no text), a tokenizer file gone, or one changed since."""
    data = config.data
    if data.source == "synthetic":
        raise GenerateError(f"{run_dir}: trained on data.source=synthetic, random ids that stand for no text: "
                            f"generate from a run trained on text")
    try:
        tokenizer, current = build_tokenizer(data.tokenizer), tokenizer_record(data)
    except (OSError, ValueError) as error:
        raise GenerateError(f"{run_dir}: its tokenizer: {error}") from None
    saved = (index.get("data") or {}).get("tokenizer")
    if saved and saved.get("vocab_sha256") != current["vocab_sha256"]:
        raise GenerateError(f"{run_dir}: its tokenizer {data.tokenizer} changed since the checkpoint was saved "
                            f"(vocabulary {saved['vocab_sha256'][:12]} then, {current['vocab_sha256'][:12]} now): "
                            f"its ids would stand for other tokens")
    return tokenizer


@torch.no_grad()
def load_dense_model(chunk: torch.nn.Module, dense: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Fill every parameter (and saved buffer: a mixture's expert biases) of a whole-model chunk from a checkpoint's
    dense tensors (a tied output layer reads the word embedding; vocabulary rows beyond the checkpoint's, TP padding,
    are zero)."""
    for name, param in chunk.named_parameters():
        rule = rule_of(param)
        stored = dense.get(rule.tied_to or name)
        if stored is None:
            raise GenerateError(f"checkpoint {checkpoint}: no tensor model/{rule.tied_to or name} (the run's "
                                f"config.yaml describes another model)")
        target = param[:stored.shape[0]] if rule.vocab_rows else param
        if target.shape != stored.shape:
            raise GenerateError(f"checkpoint {checkpoint}: model/{name} has shape {list(stored.shape)}, the run's "
                                f"config.yaml gives {list(target.shape)}")
        param.zero_()
        target.copy_(stored)
    for name, buffer in chunk.named_buffers():
        if name in dense:  # a mixture's expert biases: saved like parameters, never trained
            buffer.copy_(dense[name])


# --- a Hugging Face folder ---------------------------------------------------------------------------------------

def _from_hf(folder: Path, precision: str) -> Model:
    """The model of an HF folder, read as ``model.init_from`` reads it, with the folder's ``tokenizer.json`` and the
    ids transformers' ``generate`` stops at; ``GenerateError`` naming the folder for whatever of it cannot be read
    (every reader's ``HFError``, the weights' too)."""
    folder = folder.expanduser().resolve()
    try:
        config, hf_config = _hf_run_config(folder, precision)
        tokenizer = _hf_tokenizer(folder, config.model.vocab_size)
        stop_ids = hf_stop_ids(folder, hf_config)
        chunk = _whole_model(config)
    except (HFError, ConfigError) as error:  # init_from's messages name the setting: here the folder is the source
        raise GenerateError(f"{folder}: {str(error).removeprefix(f'model.init_from={folder}: ')}") from None
    return replace(_model(chunk, tokenizer, stop_ids, config), special_tokens=True)


def _hf_run_config(folder: Path, precision: str):
    """``(the config of a single-process run of the folder's model, its config.json)``; ``HFError`` or
    ``ConfigError`` where ``model.init_from`` would refuse the folder."""
    family, hf_config, settings = folder_model(folder)
    config = compose_config(["parallel=single", "data=synthetic", f"trainer.precision={precision}",
                             f"model.family={family.name}"])  # config.model: the family's settings, to set
    for key, value in settings.items():
        set_setting(config.model, key, value)
    config.model.name, config.model.init_from = folder.name, str(folder)
    family.check(config.model, config)
    problem = init_from_problem(config.model, family)
    if problem is not None:
        raise HFError(problem)
    return config, hf_config


def _hf_tokenizer(folder: Path, vocab_size: int) -> TokenizerFile:
    """The folder's ``tokenizer.json``; ``HFError`` when it has none, is no tokenizers file, has no token, or more
    ids than the model's ``vocab_size`` (a prompt whose ids happen to fit would pass unseen)."""
    try:
        tokenizer = folder_tokenizer(folder)
    except ValueError as error:
        raise HFError(str(error)) from None
    if tokenizer is None:
        raise HFError(f"no {FOLDER_TOKENIZER} in it: ppctl generate reads the prompt with the folder's Hugging Face "
                      f"tokenizers file")
    if tokenizer.file_vocab_size == 0:
        raise HFError(f"its {FOLDER_TOKENIZER} has an empty vocabulary: no token to read the prompt with")
    if tokenizer.file_vocab_size > vocab_size:
        raise HFError(f"its {FOLDER_TOKENIZER} has {tokenizer.file_vocab_size} ids, more than the model's vocabulary "
                      f"of {vocab_size} ({CONFIG_FILE}'s vocab_size): a tokenizer of another model?")
    return tokenizer


def hf_stop_ids(folder: Path, hf_config: dict) -> set[int]:
    """The ids transformers' ``generate`` stops at with the folder's own generation config: ``eos_token_id`` (an id
    or a list) of ``generation_config.json`` when the folder has one (none there: no stop; ``config.json``'s is then
    not read), else of ``config.json``; a tokenizer's end-of-text token is none of its own. ``HFError`` for a
    ``generation_config.json`` that is no JSON object (transformers would quietly take ``config.json``'s ids) or an
    ``eos_token_id`` that is no id."""
    content = read_folder_json(folder, GENERATION_FILE)  # a FIFO, a link out, no JSON: refused by name
    if content is None:
        return _eos_ids(hf_config.get("eos_token_id"), CONFIG_FILE)
    if not isinstance(content, dict):
        raise HFError(f"its {GENERATION_FILE} is not a JSON object")
    return _eos_ids(content.get("eos_token_id"), GENERATION_FILE)


def _eos_ids(value, file: str) -> set[int]:
    """The ids of an ``eos_token_id`` (None, an id or a list of ids) read from ``file``; ``HFError`` otherwise."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in ids):
        raise HFError(f"its {file} has eos_token_id={value!r}: an id or a list of ids (integers >= 0) is what "
                      f"generation stops at")
    return set(ids)
