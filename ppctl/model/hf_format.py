"""Hugging Face checkpoints in ppctl's terms: what a family's HF format gives, and an HF folder read and checked.

A family that reads and writes Hugging Face (``transformers``) checkpoints names its format in
``ModelFamily.hf`` (its folder's ``hf.py``), an object with:

* ``architectures``: the ``transformers`` architectures it reads (``config.json``'s ``architectures``);
* ``base_model_prefixes``: each architecture's ``base_model_prefix`` in ``transformers`` (``transformer`` for
  GPT-2, ``model`` for Llama): a folder may store every tensor under it or without it (``stored_name``);
* ``hf_config(model)``: the ``config.json`` of a ppctl model (``model`` holds the ``model.*`` settings by
  name: a ``ModelConfig`` or the family's shape);
* ``model_types``: each ``config.json`` ``model_type`` it reads -> its architecture (``transformers`` builds a
  folder's model from its ``model_type``; ``architectures`` is not read, as ``AutoModelForCausalLM`` does not);
* ``word_embeddings``: each architecture's word embedding (what a tied ``lm_head.weight`` is);
* ``shape_from_hf(hf_config)``: the ``model.*`` settings a ``config.json`` describes (a dotted key such as
  ``moe.topk`` names a key of a section: ``run_setting``, ``set_setting``), or ``HFError`` in one line for what
  ppctl cannot compute exactly (each value type-checked as ``transformers`` checks it: ``check_keys``);
* ``tensors(model, hf_config)``: every ppctl global parameter name (as checkpoints store it; a tied output layer
  is the word embedding) -> its ``HFTensor``;
* ``dense_shapes(model)``: the dense (tp=1, vocabulary unpadded) shape of each of those parameters, checked against
  the safetensors headers before anything is allocated;
* ``moe_architecture`` (optional): the architecture a model with experts (``model.moe``) is written as;
* ``zero_tensors(model, hf_config)``: the HF tensors the architecture always has and a run may lack (GPT-2's
  ``c_attn.bias`` without ``model.qkv_bias``): written as zeros on export. A folder that holds them gives a
  shape with them (``shape_from_hf``), so a run that reads it has them.

This module reads ``config.json`` and the safetensors headers and checks a folder against a run
(``init_from_problem``) before any worker starts; ``ppctl.model.hf_weights`` moves the tensors. Every file is read
through ``folder_file``: a regular file inside the folder (a FIFO would block; an index entry such as
``../../outside.bin``, an absolute path or a link out of the folder is refused; a hub cache's snapshot links into its
``blobs`` folder are the cache's own layout). Every safetensors header is checked whole, as the ``safetensors``
library checks it (``tensor_headers``), so a malformed file is one line naming it, never a worker's traceback. Pure:
JSON and the safetensors header format, no torch.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
OUTPUT_LAYER = "lm_head.weight"  # every causal LM's output layer
# Keys of a shape that must equal the run's (``model.family`` and ``model.position_embedding`` name the architecture).
ARCHITECTURE_KEYS = ("family", "position_embedding")
# A hub cache keeps <repo>/snapshots/<revision>/<file> as links to <repo>/blobs/<hash>: a link there stays in the model.
HUB_SNAPSHOTS, HUB_BLOBS = "snapshots", "blobs"
# The safetensors library's own limit on a header, and the bytes of each dtype it reads with torch.
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
COMPARE_BYTES = 2**24  # how much of two tensors one comparison reads at a time (``distinct_output_layer``)
# JSON types as transformers' strict config fields take them: an int field takes no float or bool, a float no int.
JSON_TYPES = {int: "an integer", float: "a number with a fraction or exponent (such as 1e-05)", bool: "true or false",
              str: "a string", type(None): "null", list: "a list", dict: "an object"}


class HFError(ValueError):
    """An HF folder or config ppctl cannot read exactly; the message is one line."""


@dataclass(frozen=True)
class HFTensor:
    """Where one ppctl global tensor is in an HF checkpoint.

    ``names``: the HF tensors whose rows, one after the other, are the ppctl tensor's rows (one name: a rename;
    several: a split, such as q, k and v); empty: HF has no such tensor and ppctl's is zero. ``transpose``: HF
    stores each ``[in, out]`` (GPT-2's ``Conv1D``) where ppctl stores ``[out, in]``. ``rows``: each part's ppctl
    rows (None: equal parts). ``stacked``: each name is one slice of the ppctl tensor's first dimension instead
    (the experts of stacked expert weights, in order: Mixtral's ``experts.<j>.w1``). ``fused``: ``(offset,
    rows)``: the ppctl tensor is instead rows ``[offset, offset + its rows)`` of the one HF tensor named, which has
    ``rows`` rows in all (a part of a fused tensor: Phi-3's ``qkv_proj`` holds q, k and v one below the other);
    written back, the parts of one HF tensor are joined in row order.
    """

    names: tuple[str, ...]
    transpose: bool = False
    rows: tuple[int, ...] | None = None
    stacked: bool = False
    fused: tuple[int, int] | None = None


# --- the files of a folder ------------------------------------------------------------------------------------

def folder_file(folder: str | Path, name: str, what: str | None = None) -> Path | None:
    """File ``name`` of an HF folder, None when there is none; ``HFError`` (naming it as ``what``, by default ``its
    <name>``) when it is not a regular file (a FIFO would block the read for ever) or it leads outside the folder
    (``..``, an absolute path, a link out)."""
    what = what or f"its {name}"
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise HFError(f"{what} is outside the folder: a model's files are named inside it")
    folder, path = Path(folder), Path(folder) / name
    if not os.path.lexists(path):
        return None
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in _model_roots(folder)):
        raise HFError(f"{what} leads outside the folder (to {resolved}): a model's files are its own")
    try:
        mode = resolved.stat().st_mode
    except OSError as error:
        raise HFError(f"{what} is unreadable ({type(error).__name__}: {error.strerror})") from None
    if not stat.S_ISREG(mode):
        raise HFError(f"{what} is not a regular file (a FIFO, a device or a folder would block or never end)")
    return path


def _model_roots(folder: Path) -> list[Path]:
    """Where a folder's files may lead: the folder, and for a hub cache's snapshot its repository's blobs."""
    resolved = folder.resolve()
    roots = [resolved]
    if resolved.parent.name == HUB_SNAPSHOTS:
        roots.append(resolved.parent.parent / HUB_BLOBS)
    return roots


def read_folder_json(folder: str | Path, name: str) -> Any:
    """The JSON content of file ``name`` of an HF folder (``folder_file``), None when there is none; ``HFError`` in
    one line when it cannot be read or is no JSON."""
    path = folder_file(folder, name)
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise HFError(f"its {name} is unreadable ({reason})") from None


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an HF folder; ``HFError`` (one line, for the caller to prefix with the folder) when
    it is missing, not a regular file or not a JSON object."""
    if not Path(folder).is_dir():
        raise HFError("no such folder")
    config = read_folder_json(folder, CONFIG_FILE)
    if config is None:
        raise HFError(f"no {CONFIG_FILE} in it (not a Hugging Face model folder)")
    if not isinstance(config, dict):
        raise HFError(f"its {CONFIG_FILE} is not a JSON object")
    return config


# --- config.json's values, as transformers reads them ------------------------------------------------------------

def architecture_of(hf_config: dict[str, Any]) -> str:
    """The architecture of a ``config.json``: the one its ``model_type`` names among those a family reads, as
    ``AutoModelForCausalLM`` builds it (``architectures`` is not what transformers reads: a string, a number or
    another class there changes nothing); ``HFError`` when it has no ``model_type`` or one no family reads."""
    model_type = hf_config.get("model_type")
    readers = _model_types()
    if model_type in readers:
        return readers[model_type]
    known = ", ".join(readers)
    if model_type is None:
        raise HFError(f"its {CONFIG_FILE} has no model_type, which transformers reads the architecture from (one of "
                      f"{known})")
    raise HFError(f"its {CONFIG_FILE} has model_type={model_type!r}, which no model family reads (one of {known})")


def _model_types() -> dict[str, str]:
    """Every ``model_type`` a family reads -> its architecture."""
    from ppctl.model.family import installed_families

    types = {}
    for family in installed_families():
        if family.hf is not None:
            types.update(family.hf().model_types)
    return types


def check_keys(hf_config: dict[str, Any], types: dict[str, tuple[type, ...]], positive: tuple[str, ...]) -> None:
    """``HFError`` naming the first key of a ``config.json`` whose value has another JSON type than ``types`` allows
    (as transformers' strict config fields refuse it: ``"n_embd": "64"``, ``64.0`` or ``true`` for an integer), a
    number that is not finite, or a size in ``positive`` that is not above 0 (transformers reads ``"head_dim": 0``
    as 0, not as unset: null is unset)."""
    for key, allowed in types.items():
        if key not in hf_config:
            continue
        value = hf_config[key]
        if type(value) not in allowed:
            wanted = " or ".join(JSON_TYPES[kind] for kind in allowed)
            raise HFError(f"its {key}={json.dumps(value)} is {JSON_TYPES.get(type(value), type(value).__name__)}, "
                          f"not {wanted}: transformers refuses it")
        if type(value) is float and not math.isfinite(value):
            raise HFError(f"its {key}={value} is not a finite number")
        if key in positive and value is not None and value <= 0:
            raise HFError(f"its {key}={value} must be above 0 (transformers reads it as it is, not as unset: null "
                          f"or no key is unset)")


def rope_of(hf_config: dict[str, Any], default_theta: float) -> tuple[str, dict[str, Any]]:
    """``(key, parameters)``: the rotary parameters transformers computes a ``config.json``'s model with, and the key
    they come from (for a message). A non-empty ``rope_scaling`` (the older key) replaces ``rope_parameters`` whole;
    ``rope_theta`` and the kind (``rope_type``, or the older ``type``) come from the dict, else from the top-level
    ``rope_theta``, else the architecture's ``default_theta``. ``HFError`` for a dict that is none, or a base that is
    not a positive finite number."""
    scaling, parameters = hf_config.get("rope_scaling"), hf_config.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if value is not None and not isinstance(value, dict):
            raise HFError(f"its {key}={json.dumps(value)} is not a JSON object of rotary parameters")
    key, rope = ("rope_scaling", dict(scaling)) if scaling else ("rope_parameters", dict(parameters or {}))
    theta_key = f"{key}.rope_theta" if "rope_theta" in rope else "rope_theta"
    rope.setdefault("rope_theta", hf_config.get("rope_theta", default_theta))
    rope.setdefault("rope_type", rope.get("type", "default"))
    theta = rope["rope_theta"]
    if type(theta) not in (int, float) or not math.isfinite(theta) or theta <= 0:
        raise HFError(f"its {theta_key}={json.dumps(theta)}: a rotary base is a positive finite number (transformers "
                      f"reads it as it is: 0 gives infinite frequencies)")
    if not isinstance(rope["rope_type"], str):
        raise HFError(f"its {key}.rope_type={json.dumps(rope['rope_type'])} is not a string")
    if key == "rope_scaling" and parameters:
        key = "rope_scaling (which transformers reads over its rope_parameters)"
    return key, rope


def hf_format_of(family) -> Any:
    """The HF format of a ``ModelFamily``; ``HFError`` when the family has none."""
    if family.hf is None:
        raise HFError(f"model.family={family.name} reads and writes no Hugging Face checkpoints")
    return family.hf()


# --- the safetensors files and their headers ---------------------------------------------------------------------

@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors file: its file, dtype, shape and byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of an HF folder: the index's shards, else ``model.safetensors``; each a regular file of
    the folder (``folder_file``), ``HFError`` naming the index entry otherwise."""
    index = read_folder_json(folder, INDEX_FILE)
    if index is not None:
        shards = {}
        for tensor, shard in _weight_map(index).items():
            shards.setdefault(shard, tensor)
        return [_shard(folder, shard, tensor) for shard, tensor in sorted(shards.items())]
    weights = folder_file(folder, WEIGHTS_FILE)
    if weights is not None:
        return [weights]
    raise HFError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in it (ppctl reads safetensors weights only)")


def _weight_map(index: Any) -> dict[str, str]:
    """The ``weight_map`` of an index (tensor name -> shard file); ``HFError`` for one that is not such an object."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise HFError(f"its {INDEX_FILE} has no weight_map object (tensor name -> shard file), it has "
                      f"{json.dumps(weight_map)[:60]}")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise HFError(f"its {INDEX_FILE} maps {tensor} to {json.dumps(shard)[:60]}, not a shard file name")
    return weight_map


def _shard(folder: str | Path, shard: str, tensor: str) -> Path:
    """The shard file an index entry names, a regular file of the folder."""
    what = f"its {INDEX_FILE} entry {tensor}: {shard}"
    path = folder_file(folder, shard, what)
    if path is None:
        raise HFError(f"{what} is not in the folder")
    return path


def tensor_headers(folder: str | Path) -> dict[str, TensorHeader]:
    """Every tensor of an HF folder's safetensors files, by name, from the files' headers (no tensor is read); each
    header checked as the ``safetensors`` library checks it (``HFError`` naming the file, the tensor and what is
    wrong)."""
    headers = {}
    for file in weight_files(folder):
        try:
            headers.update(_file_headers(file))
        except HFError as error:
            raise HFError(f"its {file.name} is no readable safetensors file: {error}") from None
        except OSError as error:
            raise HFError(f"its {file.name} is unreadable ({type(error).__name__}: {error.strerror})") from None
    return headers


def _file_headers(file: Path) -> dict[str, TensorHeader]:
    """The tensors of one safetensors file: its 8-byte header length, its JSON header, each entry checked, and the
    entries' byte ranges covering the data one after the other."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise HFError(f"{size} bytes, less than the 8 of its header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise HFError(f"its header length {length} is beyond the file's {size} bytes (a truncated file, or no "
                          f"safetensors)")
        if length > MAX_HEADER_BYTES:
            raise HFError(f"its header is {length:,} bytes, beyond safetensors' limit of {MAX_HEADER_BYTES:,}")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as error:
        raise HFError(f"its header is no JSON ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise HFError(f"its header is {JSON_TYPES.get(type(header), type(header).__name__)}, not a JSON object")
    data_start, data_bytes = 8 + length, size - 8 - length
    entries = {name: _entry(name, entry, data_bytes) for name, entry in header.items() if name != "__metadata__"}
    _check_coverage(entries, data_bytes)
    return {name: TensorHeader(file, dtype, shape, data_start + start, data_start + end)
            for name, (dtype, shape, start, end) in entries.items()}


def _entry(name: str, entry: Any, data_bytes: int) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, start, end)`` of one header entry; ``HFError`` naming the tensor and what is wrong."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise HFError(f"tensor {name}: its entry is {json.dumps(entry)[:80]}, not an object with dtype, shape and "
                      f"data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise HFError(f"tensor {name}: unknown dtype {json.dumps(dtype)} (safetensors' are {', '.join(DTYPE_BYTES)})")
    if not isinstance(shape, list) or any(type(size) is not int or size < 0 for size in shape):
        raise HFError(f"tensor {name}: shape {json.dumps(shape)[:80]} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or any(type(offset) is not int for offset in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise HFError(f"tensor {name}: data_offsets {json.dumps(offsets)[:80]} are not [start, end]")
    if offsets[1] > data_bytes:
        raise HFError(f"tensor {name}: data_offsets {offsets} end past the file's {data_bytes} data bytes (a truncated "
                      f"file)")
    if math.prod(shape) * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
        raise HFError(f"tensor {name}: {dtype} of shape {shape} is {math.prod(shape) * DTYPE_BYTES[dtype]} bytes, its "
                      f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_coverage(entries: dict[str, tuple], data_bytes: int) -> None:
    """``HFError`` unless the entries' byte ranges, in order, cover the data exactly (as ``safetensors`` requires:
    no overlap, no gap, nothing after)."""
    end = 0
    for name, (_dtype, _shape, start, stop) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if start != end:
            raise HFError(f"tensor {name}: data_offsets start at {start}, where the previous tensor ends at {end} "
                          f"(overlapping or with a gap)")
        end = stop
    if end != data_bytes:
        raise HFError(f"its tensors cover {end} of its {data_bytes} data bytes")


# --- names --------------------------------------------------------------------------------------------------------

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


# --- a folder against a run ---------------------------------------------------------------------------------------

def folder_shape(folder: str | Path, hf, hf_config: dict[str, Any],
                 headers: dict[str, TensorHeader] | None = None) -> dict[str, Any]:
    """The ``model.*`` settings of an HF folder as transformers reads it: its ``config.json``'s (``shape_from_hf``),
    untied when ``tie_word_embeddings`` is true but the folder holds an output layer of other values (transformers
    then keeps both: ``distinct_output_layer``)."""
    shape = hf.shape_from_hf(hf_config)
    if shape.get("tie_embeddings") and distinct_output_layer(folder, hf, hf_config, headers):
        shape["tie_embeddings"] = False
    return shape


def distinct_output_layer(folder: str | Path, hf, hf_config: dict[str, Any],
                          headers: dict[str, TensorHeader] | None = None) -> bool:
    """Whether the folder holds both ``lm_head.weight`` and the word embedding with other values (bytes, dtype or
    shape): transformers' ``tie_weights`` then ties nothing, whatever ``tie_word_embeddings`` says."""
    headers = tensor_headers(folder) if headers is None else headers
    prefix = base_model_prefix(hf, hf_config)
    output = stored_name(OUTPUT_LAYER, headers, prefix)
    embedding = stored_name(hf.word_embeddings[architecture_of(hf_config)], headers, prefix)
    if output is None or embedding is None:
        return False
    try:
        return not _same_values(headers[output], headers[embedding])
    except OSError as error:
        raise HFError(f"its {headers[output].file.name} is unreadable ({type(error).__name__}: {error.strerror})") \
            from None


def _same_values(first: TensorHeader, second: TensorHeader) -> bool:
    """Whether two tensors have one dtype, one shape and the same bytes (read a block at a time)."""
    if (first.dtype, first.shape) != (second.dtype, second.shape):
        return False
    with open(first.file, "rb") as one, open(second.file, "rb") as other:
        for offset in range(0, first.end - first.start, COMPARE_BYTES):
            size = min(COMPARE_BYTES, first.end - first.start - offset)
            one.seek(first.start + offset)
            other.seek(second.start + offset)
            if one.read(size) != other.read(size):
                return False
    return True


def folder_model(folder: str | Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``(family, config.json, settings)`` of an HF folder: the family that reads its architecture and the ``model.*``
    settings it describes as transformers reads it (``folder_shape``). The one reader of a folder's model: composition
    puts its settings in the model preset's place (``ppctl.resolve.init_from``), ``ppctl generate`` builds from them;
    ``HFError`` in one line for a folder neither can read."""
    hf_config = read_hf_config(folder)
    family = family_reading(architecture_of(hf_config))
    return family, hf_config, folder_shape(folder, hf_format_of(family), hf_config)


def family_reading(architecture: str):
    """The installed model family whose Hugging Face format reads ``architecture``; ``HFError`` naming those that
    exist and what each reads."""
    from ppctl.model.family import installed_families

    readers = {}
    for family in installed_families():
        if family.hf is not None:
            readers[family.name] = family.hf().architectures
            if architecture in readers[family.name]:
                return family
    known = ", ".join(f"{name}: {', '.join(names)}" for name, names in readers.items())
    raise HFError(f"its {CONFIG_FILE} is {architecture}, which no model family reads ({known})")


def init_from_problem(model, family) -> str | None:
    """Why the HF folder ``model.init_from`` names cannot start a run of ``model`` (a ``ModelConfig``, its
    vocabulary filled) in ``family`` (None when it can): its architecture, a shape key, a malformed file, or a
    tensor missing or of another shape than the run's model has (checked before anything is allocated)."""
    folder = model.init_from
    try:
        hf_config = read_hf_config(folder)
        _check_architecture(architecture_of(hf_config), family)
        hf = hf_format_of(family)
        headers = tensor_headers(folder)
        configured = hf.shape_from_hf(hf_config)
        shape = folder_shape(folder, hf, hf_config, headers)
        for key, value in shape.items():
            if run_setting(model, key) != value:
                raise HFError(f"{_gives(hf_config, key, value, configured)}, this run has "
                              f"model.{key}={run_setting(model, key)}")
        _check_tensors(headers, model, hf, hf_config)
    except HFError as error:
        return f"model.init_from={folder}: {error}"
    return None


def _gives(hf_config: dict[str, Any], key: str, value: Any, configured: dict[str, Any]) -> str:
    """What a folder gives setting ``key``, said by where it comes from."""
    if key in ARCHITECTURE_KEYS:
        return f"its {CONFIG_FILE} is {architecture_of(hf_config)} (model.{key}={value})"
    if configured.get(key) != value:  # untied by its tensors (folder_shape)
        return (f"its {OUTPUT_LAYER} differs from its word embedding, so transformers does not tie them whatever "
                f"tie_word_embeddings says (model.{key}={value})")
    return f"its {CONFIG_FILE} gives model.{key}={value}"


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
    """``HFError`` naming the family that reads ``architecture`` when ``family`` does not."""
    if architecture in hf_format_of(family).architectures:
        return
    raise HFError(f"its {CONFIG_FILE} is {architecture} (model.family={family_reading(architecture).name}), this run "
                  f"has model.family={family.name}")


def _check_tensors(headers: dict[str, TensorHeader], model, hf, hf_config: dict[str, Any]) -> None:
    """``HFError`` for a tensor the mapping needs that the folder lacks (under either spelling of its name), or whose
    shape is not the one the run's model needs (its ``dense_shapes``; transposed, split into rows or stacked as
    the mapping says): checked on the headers, before anything is allocated."""
    prefix = base_model_prefix(hf, hf_config)
    dense = hf.dense_shapes(model)
    for name, spec in hf.tensors(model, hf_config).items():
        for hf_name, expected in zip(spec.names, _hf_shapes(spec, dense[name])):
            stored = stored_name(hf_name, headers, prefix)
            if stored is None:
                raise HFError(f"it has no tensor {spellings(hf_name, prefix)} (ppctl's {name})")
            if headers[stored].shape != expected:
                raise HFError(f"its tensor {stored} has shape {list(headers[stored].shape)}, its {CONFIG_FILE} makes "
                              f"it {list(expected)} (ppctl's {name} is {list(dense[name])})")


def _hf_shapes(spec: HFTensor, dense: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shape each HF tensor of ``spec`` must have for a ppctl tensor of shape ``dense``."""
    if spec.stacked:
        return [tuple(dense[1:])] * len(spec.names)
    if spec.fused:  # the whole fused tensor
        return [(spec.fused[1], *dense[1:])]
    if not spec.names:
        return []
    rows = spec.rows or [dense[0] // len(spec.names)] * len(spec.names)
    shapes = [(part, *dense[1:]) for part in rows]
    return [shape[::-1] if spec.transpose and len(shape) == 2 else shape for shape in shapes]
