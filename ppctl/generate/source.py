"""The model ``ppctl generate`` runs: a run's latest checkpoint, or a Hugging Face model folder, with its tokenizer.

Both give the whole model as one chunk in this process (``TPGroup.single()``, no recomputation), as the
single-process reference builds it. A run directory (its ``config.yaml``; or one of its checkpoints) gives
the config, the checkpoint's dense ``model/<name>`` tensors read with no process group
(``ppctl.checkpoint.hf_export.read_dense_model``) and the run's tokenizer, checked against the one the
checkpoint recorded. A Hugging Face folder (``config.json``) gives the family that reads its architecture, the
shape its ``config.json`` describes (the family's ``shape_from_hf``), the weights through ``model.init_from``,
its ``tokenizer.json``, and the end-of-text ids of ``config.json`` and ``generation_config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ppctl.checkpoint.files import CheckpointError, checkpoint_problem, latest_checkpoint, locate_run, read_index
from ppctl.checkpoint.hf_export import read_dense_model
from ppctl.config import ConfigError, compose_config, load_config_file
from ppctl.data.tokenizer import Tokenizer, TokenizerFile, build_tokenizer, tokenizer_record
from ppctl.model.family import family_names, model_family
from ppctl.model.from_config import build_chunk, parameter_rules
from ppctl.model.hf_format import (CONFIG_FILE, GENERATION_FILE, HFError, architecture_of, hf_format_of,
                                   init_from_problem, read_hf_config, set_setting)
from ppctl.model.recompute import Recompute
from ppctl.model.rules import rule_of
from ppctl.parallel.tensor_parallel import TPGroup

RUN_CONFIG = "config.yaml"
HF_TOKENIZER = "tokenizer.json"


class GenerateError(ValueError):
    """A model, tokenizer or setting ``ppctl generate`` cannot use; the message is one line."""


@dataclass
class Model:
    """The whole model as one chunk, its tokenizer, the ids that end a text, and the longest sequence it takes."""

    chunk: torch.nn.Module
    tokenizer: Tokenizer
    stop_ids: frozenset[int]
    max_seq_length: int
    vocab_size: int

    def prompt_ids(self, prompt: str, max_new_tokens: int) -> list[int]:
        """The token ids of ``prompt``; ``GenerateError`` when it is empty, holds an id beyond the model's
        vocabulary, or leaves no room for ``max_new_tokens`` within ``model.max_seq_length`` (the learned position
        table ends there; rotary models were trained no further)."""
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise GenerateError("--prompt is empty: give the text to continue")
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
    if (Path(path) / CONFIG_FILE).is_file():
        return _from_hf(Path(path), precision or "fp32")
    if not Path(path).exists():
        raise GenerateError(f"{path}: no such run directory or model folder")
    raise GenerateError(f"{path}: neither a run directory (no {RUN_CONFIG}) nor a Hugging Face model folder "
                        f"(no {CONFIG_FILE})")


def _whole_model(config) -> torch.nn.Module:
    """Every layer of ``config``'s model as one chunk on one process, no recomputation, in eval mode."""
    chunk = build_chunk(config, range(config.model.num_layers), True, True, TPGroup.single(), recompute=Recompute())
    return chunk.eval().requires_grad_(False)


def _model(chunk, tokenizer, stop_ids, config) -> Model:
    model = config.model
    return Model(chunk, tokenizer, frozenset(stop_ids), model.max_seq_length, model.vocab_size)


# --- a run directory ---------------------------------------------------------------------------------------------

def _from_run(run_dir: Path, named: Path | None, precision: str | None) -> Model:
    """The model of ``run_dir``'s checkpoint ``named`` (default: the latest complete one) and the run's tokenizer."""
    try:
        config = load_config_file(run_dir / RUN_CONFIG)
    except Exception as error:  # OmegaConf's and YAML's errors have no common base
        raise GenerateError(f"{run_dir / RUN_CONFIG}: unreadable ({type(error).__name__})") from None
    checkpoint = named or _latest(run_dir)
    problem = checkpoint_problem(checkpoint, verify_digests=True)
    if problem is not None:
        raise GenerateError(f"checkpoint {checkpoint} refused: {problem}")
    tokenizer = run_tokenizer(config, read_index(checkpoint), run_dir)
    config = replace(config, model=replace(config.model, init_from=None),  # the checkpoint holds the weights
                     trainer=replace(config.trainer, precision=precision or config.trainer.precision))
    chunk = _whole_model(config)
    load_dense_model(chunk, read_dense_model(checkpoint, parameter_rules(config)), checkpoint)
    return _model(chunk, tokenizer, {tokenizer.eod_id}, config)


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
    """The model of an HF folder, read as ``model.init_from`` reads it, with the folder's ``tokenizer.json``."""
    folder = folder.expanduser().resolve()
    try:
        hf_config = read_hf_config(folder)
        family = _family_reading(architecture_of(hf_config))
        config = compose_config(["parallel=single", "data=synthetic", f"trainer.precision={precision}"])
        for key, value in hf_format_of(family).shape_from_hf(hf_config).items():
            set_setting(config.model, key, value)
        config.model.name, config.model.init_from = folder.name, str(folder)
        family.check(config)
        problem = init_from_problem(config.model, family)
    except (HFError, ConfigError) as error:
        raise GenerateError(f"{folder}: {error}") from None
    if problem is not None:
        raise GenerateError(problem)
    tokenizer = _hf_tokenizer(folder)
    return _model(_whole_model(config), tokenizer, hf_stop_ids(folder, hf_config, tokenizer), config)


def _family_reading(architecture: str):
    """The model family whose Hugging Face format reads ``architecture``; ``HFError`` naming those that exist."""
    readers = {}
    for name in family_names():
        family = model_family(name)
        if family.hf is not None:
            readers[name] = family.hf().architectures
            if architecture in readers[name]:
                return family
    known = ", ".join(f"{name}: {', '.join(names)}" for name, names in readers.items())
    raise HFError(f"its {CONFIG_FILE} is {architecture}, which no model family reads ({known})")


def _hf_tokenizer(folder: Path) -> TokenizerFile:
    """The folder's ``tokenizer.json``; ``GenerateError`` when it has none or it is not a tokenizers file."""
    path = folder / HF_TOKENIZER
    if not path.is_file():
        raise GenerateError(f"{folder}: no {HF_TOKENIZER} in it: ppctl generate reads the prompt with the folder's "
                            f"Hugging Face tokenizers file")
    try:
        return TokenizerFile(path)
    except (OSError, ValueError) as error:
        raise GenerateError(f"{path}: {str(error).removeprefix(f'data.tokenizer={path}: ')}") from None


def hf_stop_ids(folder: Path, hf_config: dict, tokenizer: TokenizerFile) -> set[int]:
    """The ids that end a text: ``eos_token_id`` of ``config.json`` and ``generation_config.json`` (an id or a
    list), and the tokenizer file's own end-of-text token when it has one."""
    stop_ids = set()
    configs = [hf_config]
    try:
        configs.append(json.loads((folder / GENERATION_FILE).read_text()))
    except (OSError, ValueError):
        pass  # optional: a folder without one (or an unreadable one) ends texts by config.json's ids alone
    for content in configs:
        eos = content.get("eos_token_id") if isinstance(content, dict) else None
        stop_ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tokenizer.eod_id in {token_id for _token, token_id in tokenizer.vocabulary_tokens()}:
        stop_ids.add(tokenizer.eod_id)
    return stop_ids
