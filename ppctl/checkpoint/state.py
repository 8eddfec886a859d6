"""A trainer's checkpoint: what is saved, under which global names, and how it is loaded back.

Saved (every tensor as the dense tensor of one process, by global parameter name,
vocabulary unpadded, so any layout can read it):

* ``model/<name>``: every parameter, in the run's precision. A tied output layer is the
  word embedding (``model/embedding.word.weight``); DualPipe's second parameter copy and
  every other replica are the same rectangles, kept once by DCP.
* ``optimizer/<name>/exp_avg`` and ``.../exp_avg_sq``: AdamW's moments, from whole
  parameters (plain optimizer) or from the shard pieces of the distributed optimizer;
  ``optimizer/<name>/main``: the fp32 main parameter of a bf16/fp16 run.
* objects: ``optimizer/steps`` (AdamW's step count), ``trainer/skipped_steps``,
  ``trainer/loss_scaler`` (fp16), ``rng/torch`` (rank 0's generator state).

The learning rate is a function of the step and the data order a function of (seed,
step), so the step (in ``ppctl.json``) is the learning-rate schedule's state and the
data position. Loading creates AdamW state where the new layout has none yet, reads
every rectangle this rank holds (both DualPipe copies, every replica), then lets the
optimizer derive what follows from the parameters (fp32 main copies of fp32 runs).
"""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ppctl.checkpoint.files import DATA_KEYS, MODEL_KEYS, commit, read_index, temporary_dir
from ppctl.checkpoint.pieces import parameter_pieces
from ppctl.checkpoint.store import add_pieces, load_state, save_state
from ppctl.optim.grads import adam_steps, set_adam_steps

OBJECTS = ("optimizer/steps", "trainer/skipped_steps", "trainer/loss_scaler", "rng/torch")


def checkpoint_name(name: str, tie_embeddings: bool) -> str:
    """The global name a parameter is saved under (a tied output layer is the word embedding)."""
    return "embedding.word.weight" if tie_embeddings and name == "output_layer.weight" else name


def tensor_state(trainer, loading: bool, create_optimizer_state: bool = False) -> dict[str, Any]:
    """Every rectangle of the model and optimizer state this rank holds, by checkpoint name (views, no copies).

    ``loading``: every copy of a rectangle is a destination; saving keeps each once.
    """
    config, context = trainer.config, trainer.context
    tp_size, tp_rank, vocab = context.layout.tp, context.coords["tp"], config.model.vocab_size
    tie = config.model.tie_embeddings
    state: dict[str, Any] = {}
    for chunk in trainer.chunks.values():
        for name, param in chunk.named_parameters():
            shape, pieces = parameter_pieces(name, param.detach(), tp_size, tp_rank, vocab)
            add_pieces(state, f"model/{checkpoint_name(name, tie)}", shape, pieces, unique=not loading)
    for held in trainer.optimizer.state_tensors(create=create_optimizer_state):
        for kind, tensor in held.tensors.items():
            shape, pieces = parameter_pieces(held.name, tensor.detach(), tp_size, tp_rank, vocab,
                                             flat_start=held.flat_start, local_shape=held.shape)
            add_pieces(state, f"optimizer/{checkpoint_name(held.name, tie)}/{kind}", shape, pieces,
                       unique=not loading)
    return state


def checkpoint_index(trainer, step: int, reason: str) -> dict[str, Any]:
    """What ``ppctl.json`` records besides the files: the step, how the run was laid out, what it trains."""
    config, layout = trainer.config, trainer.context.layout
    return {
        "step": step,
        "reason": reason,
        "saved_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "world_size": layout.world_size,
        "layout": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "dp": layout.dp, "cp": layout.cp,
                   "schedule": config.schedule.name, "distributed_optimizer": config.optimizer.distributed},
        "precision": config.trainer.precision,
        "model": {key: getattr(config.model, key) for key in MODEL_KEYS},
        "data": {**{key: getattr(config.trainer, key) for key in DATA_KEYS}, "source": config.data.source},
        "optimizer_steps": adam_steps(trainer.optimizer.optimizer),
    }


def save_checkpoint(trainer, run_dir: Path, step: int, reason: str, keep_last: int) -> Path:
    """Save the trainer after ``step`` steps into ``<run_dir>/checkpoints`` (collective over every rank).

    Every rank writes its rectangles into a hidden directory; rank 0 then writes the
    index and commits it (``ppctl.checkpoint.files.commit``). Returns the checkpoint's directory.
    """
    trainer.optimizer.sync_parameters()  # a distributed optimizer may still be gathering parameters
    partial = temporary_dir(run_dir, step)
    if dist.get_rank() == 0:
        partial.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists():  # left by a save that died: start it again
            shutil.rmtree(partial)
    dist.barrier()
    state = tensor_state(trainer, loading=False)
    state.update(_objects(trainer))
    save_state(state, partial)
    dist.barrier()  # every rank's file is written (the coordinator has written .metadata)
    final = [None]
    if dist.get_rank() == 0:
        final[0] = commit(run_dir, step, checkpoint_index(trainer, step, reason), keep_last)
    dist.broadcast_object_list(final, src=0)
    return Path(final[0])


def _objects(trainer) -> dict[str, Any]:
    scaler = trainer.loss_scaler
    return {
        "optimizer/steps": adam_steps(trainer.optimizer.optimizer),
        "trainer/skipped_steps": trainer.skipped_steps,
        "trainer/loss_scaler": None if scaler is None else {"scale": scaler.scale, "good_steps": scaler.good_steps},
        "rng/torch": torch.get_rng_state(),
    }


def load_checkpoint(trainer, checkpoint: Path) -> int:
    """Load a checkpoint saved at any layout into ``trainer`` (collective); return its step."""
    checkpoint = Path(checkpoint)
    index = read_index(checkpoint)
    has_optimizer_state = index["optimizer_steps"] > 0
    state = tensor_state(trainer, loading=True, create_optimizer_state=has_optimizer_state)
    state.update({name: None for name in OBJECTS})
    objects = load_state(state, checkpoint)
    trainer.optimizer.after_load()
    if has_optimizer_state:
        set_adam_steps(trainer.optimizer.optimizer, objects["optimizer/steps"])
    trainer.skipped_steps = objects["trainer/skipped_steps"]
    if trainer.loss_scaler is not None and objects["trainer/loss_scaler"] is not None:
        trainer.loss_scaler.scale = objects["trainer/loss_scaler"]["scale"]
        trainer.loss_scaler.good_steps = objects["trainer/loss_scaler"]["good_steps"]
    torch.set_rng_state(objects["rng/torch"])
    return int(index["step"])
