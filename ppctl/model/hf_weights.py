"""Tensors between ppctl and Hugging Face checkpoints: an export's HF tensors, a TP rank's slices on import.

Export: a model's dense global tensors (a checkpoint's ``model/<name>``, the vocabulary unpadded) become the
HF tensors of its family's format (``ppctl.model.hf_format``): renamed, transposed, split, and the format's
zero tensors added. Import (``model.init_from``): each rank reads only the part of each HF tensor its shard
holds, with ``safetensors``' ``get_slice``, as its parameter's rule (``ppctl.model.rules``) says: the rows of
a ``ROWS`` shard, the columns of a ``COLUMNS`` one, its heads' rows of q, k and v for ``QKV_ROWS``, everything
for ``REPLICATED``; on a transposed HF tensor rows are read as columns and the other way round. Vocabulary
rows beyond the HF vocabulary (TP padding) stay zero. A tied output layer reads the word embedding. A tensor
stored without the base model's prefix (``h.0.attn.c_attn.weight`` for ``transformer.h.0.attn.c_attn.weight``)
is found under that name (``ppctl.model.hf_format.stored_name``). Stacked experts (``HFTensor.stacked``) are
one HF tensor per expert both ways: expert j's slice is written as, and read from, the j-th name. A part of a
fused HF tensor (``HFTensor.fused``: Phi-3's q, k and v in ``qkv_proj``) is read from its own rows, and the parts are
joined again on export. Each shard is planned as blocks (``shard_blocks``) and read straight into its parameter a
few MiB at a time, so a rank holds its own share and one such read, never a whole tensor (``benchmarks/hf_load.py``
measures it).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ppctl.model.hf_format import (HFError, HFTensor, INDEX_FILE, WEIGHTS_FILE, base_model_prefix, read_hf_config,
                                   spellings, stored_name, weight_files)
from ppctl.model.rules import COLUMNS, QKV_ROWS, ROWS, dense_shape, rule_of
from ppctl.parallel.expert_parallel import EPGroup
from ppctl.parallel.tensor_parallel import TPGroup

READ_ELEMENTS = 2**22  # the most elements one read holds (16 MiB in float32): a rank loads in its share plus this


def to_hf_tensors(hf, model, hf_config: dict, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors (contiguous, the dense tensors' dtype) of a model's dense global tensors, by HF name;
    ``HFError`` naming a tensor the format does not map or lacks, or one HF cannot hold."""
    specs = hf.tensors(model, hf_config)
    unmapped, missing = sorted(set(dense) - set(specs)), sorted(set(specs) - set(dense))
    if unmapped or missing:
        raise HFError(f"the checkpoint's tensors and the {hf_config['architectures'][0]} mapping differ "
                      f"(not mapped: {unmapped[:3]}, not in the checkpoint: {missing[:3]})")
    tensors, fused = {}, {}
    for name, spec in specs.items():
        if spec.fused:
            fused.setdefault(spec.names[0], []).append((spec.fused, dense[name]))
            continue
        tensors.update(_split(name, spec, dense[name]))
    tensors.update({hf_name: _joined(hf_name, parts) for hf_name, parts in fused.items()})
    dtype = next(iter(dense.values())).dtype
    tensors.update({name: torch.zeros(shape, dtype=dtype) for name, shape in hf.zero_tensors(model, hf_config).items()})
    return tensors


def _split(name: str, spec: HFTensor, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF parts of one ppctl tensor: its rows cut as ``spec`` says, each transposed when HF stores ``[in, out]``."""
    if not spec.names:
        if torch.count_nonzero(tensor):
            raise HFError(f"ppctl's {name} is not zero and the HF architecture has no such tensor")
        return {}
    if spec.stacked:
        return {hf_name: part.contiguous() for hf_name, part in zip(spec.names, tensor.unbind(0), strict=True)}
    rows = spec.rows or [tensor.shape[0] // len(spec.names)] * len(spec.names)
    parts = tensor.split(list(rows), dim=0)
    return {hf_name: (part.t() if spec.transpose and part.dim() == 2 else part).contiguous()
            for hf_name, part in zip(spec.names, parts)}


def _joined(hf_name: str, parts: list[tuple[tuple[int, int], torch.Tensor]]) -> torch.Tensor:
    """The fused HF tensor ``hf_name`` of its ppctl parts (``HFTensor.fused``), one below the other by offset;
    ``HFError`` unless they cover its rows exactly."""
    parts = sorted(parts, key=lambda part: part[0][0])
    offset, total = 0, parts[0][0][1]
    for (start, _rows), tensor in parts:
        if start != offset:
            raise HFError(f"the parts of {hf_name} leave a gap or overlap at row {offset} (the next starts at "
                          f"{start})")
        offset += tensor.shape[0]
    if offset != total:
        raise HFError(f"the parts of {hf_name} hold {offset} of its {total} rows")
    return torch.cat([tensor for _fused, tensor in parts], dim=0).contiguous()


class HFWeights(contextlib.ExitStack):
    """The safetensors files of an HF folder, open for reading slices (a context manager); each tensor named as the
    causal LM names it, found under that name or without the base model's ``prefix`` (``stored_name``)."""

    def __init__(self, folder: str | Path, prefix: str | None = None):
        super().__init__()
        from safetensors import safe_open

        self.slices, self.prefix = {}, prefix
        for file in weight_files(folder):
            try:
                handle = self.enter_context(safe_open(str(file), framework="pt"))
            except Exception as error:  # SafetensorError has no public base; validation's header check came first
                raise HFError(f"its {file.name} is no readable safetensors file ({str(error).splitlines()[0]})") \
                    from None
            self.slices.update({name: handle.get_slice(name) for name in handle.keys()})

    def ppctl_shape(self, name: str, transpose: bool) -> tuple[int, ...]:
        """The shape of HF tensor ``name`` in ppctl's orientation."""
        shape = tuple(self._slice(name).get_shape())
        return shape[::-1] if transpose and len(shape) == 2 else shape

    def read(self, name: str, transpose: bool, rows: tuple[int, int],
             columns: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` and columns (None: all) of HF tensor ``name`` in ppctl's orientation; nothing else
        is read."""
        part, row_range = self._slice(name), slice(*rows)
        if len(part.get_shape()) == 1:
            return part[row_range]
        column_range = slice(*columns) if columns else slice(None)
        return part[column_range, row_range].t() if transpose else part[row_range, column_range]

    def _slice(self, name: str):
        stored = stored_name(name, self.slices, self.prefix)
        if stored is None:
            raise HFError(f"no tensor {spellings(name, self.prefix)} in its {INDEX_FILE} or {WEIGHTS_FILE}")
        return self.slices[stored]


@dataclass(frozen=True)
class Block:
    """One piece of a TP rank's shard, placed below the previous piece: rows ``[start, stop)`` and ``columns``
    (None: all) of HF tensor ``name`` in ppctl's orientation; ``name`` None: that many zero rows (padding)."""

    name: str | None
    rows: tuple[int, int]
    columns: tuple[int, int] | None = None

    @property
    def height(self) -> int:
        return self.rows[1] - self.rows[0]


def local_ranges(split: str, dense: tuple[int, ...], tp: TPGroup) -> tuple[int, list[tuple[int, int]]]:
    """``(dim, ranges)``: the ranges of dimension ``dim`` of a dense tensor of shape ``dense`` that this TP rank's
    shard holds, one after the other."""
    if split == COLUMNS:
        width = dense[1] // tp.size
        return 1, [(tp.rank * width, (tp.rank + 1) * width)]
    if split == ROWS:
        height = dense[0] // tp.size
        return 0, [(tp.rank * height, (tp.rank + 1) * height)]
    if split == QKV_ROWS:  # [q; k; v], each split by heads: this rank's rows of each
        part, height = dense[0] // 3, dense[0] // 3 // tp.size
        return 0, [(index * part + tp.rank * height, index * part + (tp.rank + 1) * height) for index in range(3)]
    return 0, [(0, dense[0])]


def shard_blocks(weights: HFWeights, spec: HFTensor, split: str, dense: tuple[int, ...], tp: TPGroup,
                 vocab_rows: bool) -> list[Block]:
    """The blocks of this TP rank's shard of the ppctl tensor ``spec`` maps, top to bottom (nothing read yet)."""
    dim, ranges = local_ranges(split, dense, tp)
    if spec.fused:  # rows of one HF tensor from the part's offset
        offset, name = spec.fused[0], spec.names[0]
        if dim == 1:
            return [Block(name, (offset, offset + dense[0]), ranges[0])]
        return [Block(name, (offset + start, offset + stop)) for start, stop in ranges]
    if dim == 1:  # each HF part's rows, this rank's columns
        return [Block(name, (0, weights.ppctl_shape(name, spec.transpose)[0]), ranges[0]) for name in spec.names]
    return [block for start, stop in ranges for block in _row_blocks(weights, spec, start, stop, vocab_rows)]


def _row_blocks(weights: HFWeights, spec: HFTensor, start: int, stop: int, vocab_rows: bool) -> list[Block]:
    """The blocks of rows ``[start, stop)`` of the ppctl tensor, in whichever HF parts hold them; vocabulary rows
    beyond the HF tensor (padding) are zero."""
    blocks, offset = [], 0
    for name in spec.names:
        size = weights.ppctl_shape(name, spec.transpose)[0]
        low, high = max(start, offset), min(stop, offset + size)
        if low < high:
            blocks.append(Block(name, (low - offset, high - offset)))
        offset += size
    padding = stop - max(start, offset)
    if padding > 0 and vocab_rows:
        blocks.append(Block(None, (0, padding)))
    return blocks


def copy_shard(param: torch.Tensor, blocks: list[Block], weights: HFWeights, transpose: bool, name: str) -> None:
    """Fill ``param`` with its blocks, each read straight into its rows, at most ``READ_ELEMENTS`` at a time: no
    copy of a whole tensor or shard is held. ``HFError`` when the blocks do not make the parameter's shape."""
    widths = [tuple(param.shape[1:]) if block.name is None else _width(weights, block, transpose) for block in blocks]
    _check_fits(param, blocks, widths, name)
    offset = 0
    for block, width in zip(blocks, widths):
        rows = param[offset:offset + block.height]
        offset += block.height
        if block.name is None:
            rows.zero_()
            continue
        step = max(1, READ_ELEMENTS // math.prod(width))
        for first in range(0, block.height, step):
            last = min(first + step, block.height)
            rows[first:last].copy_(weights.read(block.name, transpose, (block.rows[0] + first, block.rows[0] + last),
                                                block.columns))


def _check_fits(param: torch.Tensor, blocks: list[Block], widths: list[tuple[int, ...]], name: str) -> None:
    """``HFError`` unless the blocks, one below the other, have the parameter's shape."""
    wrong = next((width for width in widths if width != tuple(param.shape[1:])), tuple(param.shape[1:]))
    height = sum(block.height for block in blocks)
    if (height, *wrong) != tuple(param.shape):
        names = ", ".join(dict.fromkeys(block.name for block in blocks if block.name))
        raise HFError(f"{names} give ppctl's {name} a slice of shape {[height, *wrong]}, its shard has "
                      f"{list(param.shape)}")


def _width(weights: HFWeights, block: Block, transpose: bool) -> tuple[int, ...]:
    """The trailing dimensions of a block read from the folder."""
    width = weights.ppctl_shape(block.name, transpose)[1:]
    return (block.columns[1] - block.columns[0],) if block.columns else width


def load_hf_weights(module: torch.nn.Module, folder: str | Path, hf, model, tp: TPGroup,
                    ep: EPGroup = EPGroup.single()) -> None:
    """Fill every parameter of ``module`` (a chunk: global names, rules attached) with this TP rank's slice of the
    HF folder's tensors (of stacked experts, EP rank ``ep.rank``'s experts); ``model`` is the family's shape.
    ``HFError`` (one line naming ``model.init_from``) when the folder lacks a tensor or a slice does not fit its
    parameter."""
    try:
        _load(module, folder, hf, model, tp, ep)
    except HFError as error:
        raise HFError(f"model.init_from={folder}: {error}") from None


@torch.no_grad()
def _load(module: torch.nn.Module, folder: str | Path, hf, model, tp: TPGroup, ep: EPGroup) -> None:
    hf_config = read_hf_config(folder)
    specs = hf.tensors(model, hf_config)
    with HFWeights(folder, base_model_prefix(hf, hf_config)) as weights:
        for name, param in module.named_parameters():
            rule = rule_of(param)
            spec = specs[rule.tied_to or name]
            if not spec.names:
                param.zero_()
                continue
            if spec.stacked:
                _copy_stacked(param, spec, weights, name, ep)
                continue
            blocks = shard_blocks(weights, spec, rule.split, dense_shape(rule, param.shape, tp), tp, rule.vocab_rows)
            copy_shard(param, blocks, weights, spec.transpose, name)


def _copy_stacked(param: torch.Tensor, spec: HFTensor, weights: HFWeights, name: str, ep: EPGroup) -> None:
    """Fill stacked expert weights (``[E / ep, out, in]``: EP rank ``ep.rank``'s experts) with one HF tensor per
    expert."""
    if len(spec.names) != param.shape[0] * ep.size:
        raise HFError(f"ppctl's {name} stacks {param.shape[0] * ep.size} experts, the mapping names {len(spec.names)}")
    for local, expert in enumerate(ep.local_experts(len(spec.names))):
        hf_name = spec.names[expert]
        rows = (0, weights.ppctl_shape(hf_name, spec.transpose)[0])
        copy_shard(param[local], [Block(hf_name, rows)], weights, spec.transpose, f"{name}[{expert}]")
