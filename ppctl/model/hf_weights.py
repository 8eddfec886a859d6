"""Tensors between ppctl and Hugging Face checkpoints: an export's HF tensors, a TP rank's slices on import.

Export: a model's dense global tensors (a checkpoint's ``model/<name>``, the vocabulary unpadded) become the
HF tensors of its family's format (``ppctl.model.hf_format``): renamed, transposed, split, and the format's
zero tensors added. Import (``model.init_from``): each rank reads only the part of each HF tensor its shard
holds, with ``safetensors``' ``get_slice``, as its parameter's rule (``ppctl.model.rules``) says: the rows of
a ``ROWS`` shard, the columns of a ``COLUMNS`` one, its heads' rows of q, k and v for ``QKV_ROWS``, everything
for ``REPLICATED``; on a transposed HF tensor rows are read as columns and the other way round. Vocabulary
rows beyond the HF vocabulary (TP padding) stay zero. A tied output layer reads the word embedding. A tensor
stored without the base model's prefix (``h.0.attn.c_attn.weight`` for ``transformer.h.0.attn.c_attn.weight``)
is found under that name (``ppctl.model.hf_format.stored_name``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ppctl.model.hf_format import (HFError, HFTensor, INDEX_FILE, WEIGHTS_FILE, base_model_prefix, read_hf_config,
                                   spellings, stored_name, weight_files)
from ppctl.model.rules import COLUMNS, QKV_ROWS, ROWS, dense_shape, rule_of
from ppctl.parallel.tensor_parallel import TPGroup


def to_hf_tensors(hf, model, hf_config: dict, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors (contiguous, the dense tensors' dtype) of a model's dense global tensors, by HF name;
    ``HFError`` naming a tensor the format does not map or lacks, or one HF cannot hold."""
    specs = hf.tensors(model, hf_config)
    unmapped, missing = sorted(set(dense) - set(specs)), sorted(set(specs) - set(dense))
    if unmapped or missing:
        raise HFError(f"the checkpoint's tensors and the {hf_config['architectures'][0]} mapping differ "
                      f"(not mapped: {unmapped[:3]}, not in the checkpoint: {missing[:3]})")
    tensors = {}
    for name, spec in specs.items():
        tensors.update(_split(name, spec, dense[name]))
    dtype = next(iter(dense.values())).dtype
    tensors.update({name: torch.zeros(shape, dtype=dtype) for name, shape in hf.zero_tensors(model, hf_config).items()})
    return tensors


def _split(name: str, spec: HFTensor, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF parts of one ppctl tensor: its rows cut as ``spec`` says, each transposed when HF stores ``[in, out]``."""
    if not spec.names:
        if torch.count_nonzero(tensor):
            raise HFError(f"ppctl's {name} is not zero and the HF architecture has no such tensor")
        return {}
    rows = spec.rows or [tensor.shape[0] // len(spec.names)] * len(spec.names)
    parts = tensor.split(list(rows), dim=0)
    return {hf_name: (part.t() if spec.transpose and part.dim() == 2 else part).contiguous()
            for hf_name, part in zip(spec.names, parts)}


class HFWeights(contextlib.ExitStack):
    """The safetensors files of an HF folder, open for reading slices (a context manager); each tensor named as the
    causal LM names it, found under that name or without the base model's ``prefix`` (``stored_name``)."""

    def __init__(self, folder: str | Path, prefix: str | None = None):
        super().__init__()
        from safetensors import safe_open

        self.slices, self.prefix = {}, prefix
        for file in weight_files(folder):
            handle = self.enter_context(safe_open(str(file), framework="pt"))
            self.slices.update({name: handle.get_slice(name) for name in handle.keys()})

    def ppctl_rows(self, name: str, transpose: bool) -> int:
        """How many ppctl rows HF tensor ``name`` holds."""
        shape = self._slice(name).get_shape()
        return shape[1] if transpose and len(shape) == 2 else shape[0]

    def read(self, name: str, transpose: bool, rows: tuple[int, int] | None = None,
             columns: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` (or columns) of HF tensor ``name`` in ppctl's orientation; nothing else is read."""
        part = self._slice(name)
        if len(part.get_shape()) == 1:
            return part[rows[0]:rows[1]]
        if not transpose:
            return part[rows[0]:rows[1]] if rows else part[:, columns[0]:columns[1]]
        return (part[:, rows[0]:rows[1]] if rows else part[columns[0]:columns[1]]).t()

    def _slice(self, name: str):
        stored = stored_name(name, self.slices, self.prefix)
        if stored is None:
            raise HFError(f"no tensor {spellings(name, self.prefix)} in its {INDEX_FILE} or {WEIGHTS_FILE}")
        return self.slices[stored]


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


def read_shard(weights: HFWeights, spec: HFTensor, split: str, dense: tuple[int, ...], tp: TPGroup,
               vocab_rows: bool) -> torch.Tensor:
    """This TP rank's shard of the ppctl tensor ``spec`` maps, read from ``weights``."""
    dim, ranges = local_ranges(split, dense, tp)
    if dim == 1:
        return torch.cat([weights.read(name, spec.transpose, columns=ranges[0]) for name in spec.names])
    return torch.cat([_rows(weights, spec, start, stop, dense, vocab_rows) for start, stop in ranges])


def _rows(weights: HFWeights, spec: HFTensor, start: int, stop: int, dense: tuple[int, ...],
          vocab_rows: bool) -> torch.Tensor:
    """Rows ``[start, stop)`` of the ppctl tensor, from whichever HF parts hold them; vocabulary rows beyond the
    HF tensor (padding) are zero."""
    blocks, offset = [], 0
    for name in spec.names:
        size = weights.ppctl_rows(name, spec.transpose)
        low, high = max(start, offset), min(stop, offset + size)
        if low < high:
            blocks.append(weights.read(name, spec.transpose, rows=(low - offset, high - offset)))
        offset += size
    padding = stop - max(start, offset)
    if padding > 0 and vocab_rows:
        blocks.append(torch.zeros((padding, *dense[1:]), dtype=blocks[0].dtype if blocks else torch.float32))
    return torch.cat(blocks)


def load_hf_weights(module: torch.nn.Module, folder: str | Path, hf, model, tp: TPGroup) -> None:
    """Fill every parameter of ``module`` (a chunk: global names, rules attached) with this TP rank's slice of the
    HF folder's tensors; ``model`` is the family's shape. ``HFError`` (one line naming ``model.init_from``) when the
    folder lacks a tensor or a slice does not fit its parameter."""
    try:
        _load(module, folder, hf, model, tp)
    except HFError as error:
        raise HFError(f"model.init_from={folder}: {error}") from None


@torch.no_grad()
def _load(module: torch.nn.Module, folder: str | Path, hf, model, tp: TPGroup) -> None:
    hf_config = read_hf_config(folder)
    specs = hf.tensors(model, hf_config)
    with HFWeights(folder, base_model_prefix(hf, hf_config)) as weights:
        for name, param in module.named_parameters():
            rule = rule_of(param)
            spec = specs[rule.tied_to or name]
            if not spec.names:
                param.zero_()
                continue
            value = read_shard(weights, spec, rule.split, dense_shape(rule, param.shape, tp), tp, rule.vocab_rows)
            if value.shape != param.shape:
                raise HFError(f"{', '.join(spec.names)} give ppctl's {name} a slice of shape {list(value.shape)}, "
                              f"its shard has {list(param.shape)}")
            param.copy_(value)
