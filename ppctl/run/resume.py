"""Whether a checkpoint's model is this run's model: every tensor, by name and shape, before any worker starts.

A checkpoint's ``ppctl.json`` records some model settings (``ppctl.checkpoint.files.MODEL_KEYS``), not all that
decide its tensors (``model.family``, ``qkv_bias``, ``head_dim``, ``num_kv_heads``, or one added later). So the
model is compared whole: the checkpoint's tensors as its DCP ``.metadata`` lists them (``model/<name>``, global
shapes, vocabulary unpadded) against those a run with this config would save, its model built on the meta
device (no memory, no values) and named as ``ppctl.checkpoint.state`` names them. A difference is said as the
setting that explains it (the one whose other value gives the checkpoint's tensors), else as the first tensor
that differs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ppctl.config.schema import ModelConfig, PpctlConfig

MODEL_PREFIX = "model/"
# Model settings that decide tensors and that ppctl.json does not record (the recorded ones are compared first):
# the values tried to say which of them a checkpoint was saved with.
UNRECORDED_SHAPE_SETTINGS = ("family", "qkv_bias", "head_dim", "num_kv_heads")

Shapes = dict[str, tuple[int, ...]]


def checkpoint_model_shapes(checkpoint: Path) -> Shapes | None:
    """Global name -> shape of every model tensor a checkpoint holds (from its DCP ``.metadata``); None when that
    file is not DCP's metadata (the load names what is wrong with it)."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    except Exception:  # noqa: BLE001  (pickle raises anything of a file that is not its own)
        return None
    return {key.removeprefix(MODEL_PREFIX): tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and hasattr(entry, "size")}


def run_model_shapes(config: PpctlConfig) -> Shapes:
    """Global name -> shape of every model tensor a run of ``config`` saves: its whole model on one rank, built on
    the meta device, each tensor in the checkpoint's view (``ppctl.checkpoint.pieces``), a tied output layer
    saved as the embedding it copies."""
    import torch

    from ppctl.checkpoint.pieces import checkpoint_view
    from ppctl.checkpoint.state import checkpoint_name
    from ppctl.model.family import resolve_model
    from ppctl.model.recompute import Recompute
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers

    resolved = resolve_model(config)
    with torch.device("meta"):
        model = resolved.build_chunk(StageLayers.whole(config.model.num_layers), RankGroups.single(), seed=None,
                                     dtype=torch.float32, recompute=Recompute())
    rule_of = resolved.rules
    shapes = {}
    for name, tensor in model.state_dict().items():
        rule = rule_of(name)
        view = checkpoint_view(rule, tuple(tensor.shape), 1, 0, config.model.vocab_size)
        shapes[checkpoint_name(name, rule)] = view.global_shape
    return shapes


def model_shape_problem(config: PpctlConfig, checkpoint: Path) -> str | None:
    """Why the checkpoint's model tensors are not those of ``config``'s model (None when they are, or when the
    checkpoint's ``.metadata`` cannot be read here): ``it was saved with model.X=A, this run has B`` when one
    unrecorded setting explains the difference, else the first tensor that differs."""
    saved = checkpoint_model_shapes(checkpoint)
    if saved is None:
        return None
    ours = run_model_shapes(config)
    if saved == ours:
        return None
    for key, value in _candidate_values(config, saved):
        if _shapes_with(config, key, value) == saved:
            return (f"it was saved with model.{key}={_shown(value)}, this run has "
                    f"{_shown(getattr(config.model, key))}: its tensors are another model's")
    return _first_difference(saved, ours)


def _candidate_values(config: PpctlConfig, saved: Shapes):
    """``(setting, value)`` pairs to try: the other families and ``qkv_bias``, and the head counts and widths the
    checkpoint's dimensions allow."""
    from ppctl.model.family import family_names

    model = config.model
    yield from (("family", name) for name in family_names() if name != model.family)
    yield "qkv_bias", not model.qkv_bias
    yield from _attention_widths(model, saved)


def _attention_widths(model, saved: Shapes):
    """``(setting, value)`` pairs of the head widths and key/value head counts the checkpoint's dimensions allow,
    for those of the two settings the model's family has."""
    declared = {item.name for item in dataclasses.fields(model)}
    dims = sorted({size for shape in saved.values() for size in shape})
    head_dim = getattr(model, "head_dim", None)
    if "head_dim" in declared:
        head_dims = {dim // model.num_heads for dim in dims if dim % model.num_heads == 0}
        yield from (("head_dim", width) for width in sorted(head_dims) if width != head_dim)
        if head_dim is not None:
            yield "head_dim", None
    if "num_kv_heads" in declared:
        width = head_dim if head_dim is not None else model.hidden_size // model.num_heads
        kv_heads = {dim // width for dim in dims if dim % width == 0 and 0 < dim // width <= model.num_heads}
        yield from (("num_kv_heads", heads) for heads in sorted(kv_heads) if heads != model.num_kv_heads)
        if model.num_kv_heads is not None:
            yield "num_kv_heads", None


def _shapes_with(config: PpctlConfig, key: str, value) -> Shapes | None:
    """``run_model_shapes`` of ``config`` with ``model.<key>=value`` (another family with the shared keys alone, its
    own at their defaults); None when that model cannot be built."""
    model = config.model
    if key == "family":
        model = ModelConfig(**{item.name: getattr(model, item.name) for item in dataclasses.fields(ModelConfig)})
    changed = dataclasses.replace(config, model=dataclasses.replace(model, **{key: value}))
    try:
        return run_model_shapes(changed)
    except Exception:  # noqa: BLE001  (a candidate no model has, whatever the layer says: not the explanation)
        return None


def _first_difference(saved: Shapes, ours: Shapes) -> str:
    """The first tensor (in the checkpoint's order, then this run's) that one model lacks or shapes otherwise."""
    for name, shape in saved.items():
        if name not in ours:
            return f"it holds the tensor {name} {list(shape)}, which this run's model has not: its model is another"
        if ours[name] != shape:
            return (f"its tensor {name} is {list(shape)}, this run's model has {list(ours[name])}: its model is "
                    f"another")
    name = next(name for name in ours if name not in saved)
    return f"it lacks the tensor {name} {list(ours[name])} of this run's model: its model is another"


def _shown(value) -> str:
    """A setting's value as a user writes it (``true``, ``null``)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)
