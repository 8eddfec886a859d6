"""Hugging Face checkpoints in ppctl's terms: what a family's HF format gives, and an HF folder read and checked.

A family that reads and writes Hugging Face (``transformers``) checkpoints names its format in
``ModelFamily.hf`` (its folder's ``hf.py``), an object with:

* ``architectures``: the ``transformers`` architectures it reads (``config.json``'s ``architectures``);
* ``base_model_prefixes``: each architecture's ``base_model_prefix`` in ``transformers`` (``transformer`` for
  GPT-2, ``model`` for Llama): a folder may store every tensor under it or without it (``stored_name``);
* ``hf_config(model)``: the ``config.json`` of a ppctl model (``model`` holds the ``model.*`` settings by
  name: a ``ModelConfig`` or the family's shape);
* ``shape_from_hf(hf_config)``: the ``model.*`` settings a ``config.json`` describes (a dotted key such as
  ``moe.topk`` names a key of a section: ``run_setting``, ``set_setting``), or ``HFError`` in one line for what
  ppctl cannot compute exactly;
* ``tensors(model, hf_config)``: every ppctl global parameter name (as checkpoints store it; a tied output layer
  is the word embedding) -> its ``HFTensor``;
* ``moe_architecture`` (optional): the architecture a model with experts (``model.moe``) is written as;
* ``zero_tensors(model, hf_config)``: the HF tensors the architecture always has and a run may lack (GPT-2's
  ``c_attn.bias`` without ``model.qkv_bias``): written as zeros on export. A folder that holds them gives a
  shape with them (``shape_from_hf``), so a run that reads it has them.

This module reads ``config.json`` and the safetensors headers and checks a folder against a run
(``init_from_problem``) before any worker starts; ``ppctl.model.hf_weights`` moves the tensors. Pure:
JSON and the safetensors header format, no torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
# Keys of a shape that must equal the run's (``model.family`` and ``model.position_embedding`` name the architecture).
ARCHITECTURE_KEYS = ("family", "position_embedding")


class HFError(ValueError):
    """An HF folder or config ppctl cannot read exactly; the message is one line."""


@dataclass(frozen=True)
class HFTensor:
    """Where one ppctl global tensor is in an HF checkpoint.

    ``names``: the HF tensors whose rows, one after the other, are the ppctl tensor's rows (one name: a rename;
    several: a split, such as q, k and v); empty: HF has no such tensor and ppctl's is zero. ``transpose``: HF
    stores each ``[in, out]`` (GPT-2's ``Conv1D``) where ppctl stores ``[out, in]``. ``rows``: each part's ppctl
    rows (None: equal parts). ``stacked``: each name is one slice of the ppctl tensor's first dimension instead
    (the experts of stacked expert weights, in order: Mixtral's ``experts.<j>.w1``).
    """

    names: tuple[str, ...]
    transpose: bool = False
    rows: tuple[int, ...] | None = None
    stacked: bool = False


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an HF folder; ``HFError`` (one line, for the caller to prefix with the folder) when
    it is missing or not a JSON object."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise HFError("no such folder")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"no {CONFIG_FILE} in it (not a Hugging Face model folder)") from None
    except (OSError, ValueError) as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
        raise HFError(f"its {CONFIG_FILE} is unreadable ({reason})") from None
    if not isinstance(config, dict):
        raise HFError(f"its {CONFIG_FILE} is not a JSON object")
    return config


def architecture_of(hf_config: dict[str, Any]) -> str:
    """The architecture a ``config.json`` names (its first ``architectures`` entry, else its ``model_type``)."""
    names = hf_config.get("architectures") or [hf_config.get("model_type", "?")]
    return str(names[0])


def hf_format_of(family) -> Any:
    """The HF format of a ``ModelFamily``; ``HFError`` when the family has none."""
    if family.hf is None:
        raise HFError(f"model.family={family.name} reads and writes no Hugging Face checkpoints")
    return family.hf()


@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors file: its file, dtype, shape and byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of an HF folder: the index's shards, else ``model.safetensors``."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise HFError(f"its {INDEX_FILE} is unreadable ({type(error).__name__})") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    raise HFError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in it (ppctl reads safetensors weights only)")


def tensor_headers(folder: str | Path) -> dict[str, TensorHeader]:
    """Every tensor of an HF folder's safetensors files, by name, from the files' headers (no tensor is read)."""
    headers = {}
    for file in weight_files(folder):
        try:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
        except (OSError, ValueError, struct.error) as error:
            raise HFError(f"its {file.name} is no readable safetensors file ({type(error).__name__})") from None
        data_start = 8 + length
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                headers[name] = TensorHeader(file, entry["dtype"], tuple(entry["shape"]), data_start + start,
                                             data_start + end)
    return headers


def base_model_prefix(hf, hf_config: dict[str, Any]) -> str | None:
    """The base-model prefix of the architecture a ``config.json`` names, in format ``hf`` (None: it has none)."""
    return hf.base_model_prefixes.get(architecture_of(hf_config))


def stored_name(name: str, stored, prefix: str | None) -> str | None:
    """The name HF tensor ``name`` has among the ``stored`` ones: itself (as ``transformers`` saves a causal LM), or
    itself without the base model's ``prefix`` (as it saves the base model alone, and as the hub's ``gpt2`` files
    are); None when neither is there. Anything else a folder holds (GPT-2's causal mask buffers) is not read."""
    if name in stored:
        return name
    short = name.removeprefix(f"{prefix}.") if prefix else name
    return short if short != name and short in stored else None


def spellings(name: str, prefix: str | None) -> str:
    """``name``, and its spelling without the base-model ``prefix`` when it has one: for a one-line refusal."""
    short = name.removeprefix(f"{prefix}.") if prefix else name
    return name if short == name else f"{name} (or {short})"


def init_from_problem(model, family) -> str | None:
    """Why the HF folder ``model.init_from`` names cannot start a run of ``model`` (a ``ModelConfig``, its
    vocabulary filled) in ``family`` (None when it can): its architecture, a shape key or a missing tensor."""
    folder = model.init_from
    try:
        hf_config = read_hf_config(folder)
        _check_architecture(architecture_of(hf_config), family)
        shape = hf_format_of(family).shape_from_hf(hf_config)
        for key, value in shape.items():
            if run_setting(model, key) != value:
                gives = (f"is {architecture_of(hf_config)} (model.{key}={value})" if key in ARCHITECTURE_KEYS
                         else f"gives model.{key}={value}")
                raise HFError(f"its {CONFIG_FILE} {gives}, this run has model.{key}={run_setting(model, key)}")
        _check_tensors(folder, model, family, hf_config)
    except HFError as error:
        return f"model.init_from={folder}: {error}"
    return None


def run_setting(model, key: str) -> Any:
    """Setting ``key`` of ``model`` (a ``ModelConfig``); ``moe.<key>`` reads the resolved mixture (``MoEShape``: an
    unset expert width is ``ffn_hidden_size``), or ``model.moe`` itself for a dense model."""
    from ppctl.model.moe.shape import moe_shape_of

    section, _, name = key.rpartition(".")
    if section != "moe":
        return getattr(model, key)
    return getattr(moe_shape_of(model) or model.moe, name)


def set_setting(model, key: str, value: Any) -> None:
    """Set ``key`` of ``model`` (a ``ModelConfig``), a dotted key in its section."""
    section, _, name = key.rpartition(".")
    setattr(getattr(model, section) if section else model, name, value)


def _check_architecture(architecture: str, family) -> None:
    """``HFError`` naming the family that reads ``architecture`` when ``family`` does not (or that none does)."""
    from ppctl.model.family import family_names, model_family

    if architecture in hf_format_of(family).architectures:
        return
    readers = {name: model_family(name) for name in family_names()}
    reader = next((name for name, other in readers.items()
                   if other.hf is not None and architecture in other.hf().architectures), None)
    if reader is not None:
        raise HFError(f"its {CONFIG_FILE} is {architecture} (model.family={reader}), this run has "
                      f"model.family={family.name}")
    known = ", ".join(f"{name}: {', '.join(other.hf().architectures)}" for name, other in readers.items()
                      if other.hf is not None)
    raise HFError(f"its {CONFIG_FILE} is {architecture}, which no model family reads ({known})")


def _check_tensors(folder, model, family, hf_config: dict[str, Any]) -> None:
    """``HFError`` for a tensor the mapping needs that the folder lacks (under either spelling of its name)."""
    hf = hf_format_of(family)
    headers, prefix = tensor_headers(folder), base_model_prefix(hf, hf_config)
    for name, spec in hf.tensors(model, hf_config).items():
        for hf_name in spec.names:
            if stored_name(hf_name, headers, prefix) is None:
                raise HFError(f"it has no tensor {spellings(hf_name, prefix)} (ppctl's {name})")
