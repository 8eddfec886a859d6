"""A trainer's checkpoint: its stateful parts, saved under global names, and loaded back at any layout.

Each part is a ``Stateful`` in ``torch.distributed.checkpoint.stateful``'s sense (a
``state_dict`` and a ``load_state_dict``), and the checkpoint saves what those give:

* ``model``: the model chunks (``torch.nn.Module``), as ``model/<name>``: every parameter,
  in the run's precision. A tied output layer is the word embedding
  (``model/embedding.word.weight``); DualPipe's second parameter copy and every other
  replica are the same rectangles, kept once by DCP.
* ``optimizer`` (``ppctl.optim.grads.AdamWStateful``): AdamW's moments as
  ``optimizer/<name>/exp_avg`` and ``.../exp_avg_sq``, from whole parameters (plain
  optimizer) or from the shard pieces of the distributed optimizer;
  ``optimizer/<name>/main``: the fp32 main parameter of a bf16/fp16 run; and
  ``optimizer/steps``, AdamW's step count.
* ``previous`` (``optimizer.gradient_delay=1`` only; ``ppctl.optim.delay.DelayedWeights``): the
  previous weight version as ``previous/<name>``, like the model.
* objects, each one part's whole ``state_dict``: ``trainer`` (its skipped steps),
  ``loss_scaler`` (fp16; None otherwise), ``data`` (the data position: the order is a
  function of (seed, step), so the next step is all of it; the learning rate follows the
  step too) and ``rng`` (this rank's torch generator, as rank 0 saves it).

Every tensor is saved as the dense tensor of one process, by global parameter name,
vocabulary unpadded, so any layout can read it. Loading asks each part for its
``state_dict`` (views of the live tensors), lets DCP read every rectangle this rank
holds into them (both DualPipe copies, every replica), then hands each part its state.
"""

from __future__ import annotations

import datetime
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ppctl.checkpoint.files import DATA_KEYS, commit, model_record, read_index, temporary_dir
from ppctl.checkpoint.pieces import parameter_pieces
from ppctl.checkpoint.store import add_pieces, load_state, save_state
from ppctl.data.tokenizer import tokenizer_record

OBJECTS = ("optimizer/steps", "trainer", "loss_scaler", "data", "rng")


def checkpoint_name(name: str, rule) -> str:
    """The global name a parameter is saved under (a tied output layer: the word embedding it copies)."""
    return rule.tied_to or name


@dataclass
class DataPosition:
    """Where the data stream stands, as a ``Stateful``: the sample order is a function of (seed, step)."""

    step: int = 0

    def state_dict(self) -> dict:
        """The next step to train."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved step."""
        self.step = int(state["step"])


class TorchRng:
    """The torch random generator of this process, as a ``Stateful``."""

    def state_dict(self) -> dict:
        """The generator's state."""
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue the generator from a saved state."""
        torch.set_rng_state(state["torch"])


class _Absent:
    """A part a run does not have (the loss scaler of a run not in fp16): saved as None, nothing to load."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any) -> None:
        """Nothing to continue."""


def trainer_parts(trainer, step: int = 0) -> dict[str, Any]:
    """The ``Stateful`` parts of ``trainer`` by checkpoint name, the data position at ``step``."""
    return {"model": list(trainer.chunks.values()), "optimizer": trainer.optimizer, "trainer": trainer,
            "loss_scaler": trainer.loss_scaler if trainer.loss_scaler is not None else _Absent(),
            "data": DataPosition(step), "rng": TorchRng(),
            "previous": trainer.delayed if trainer.delayed is not None else _Absent()}


def part_states(parts: dict[str, Any]) -> dict[str, Any]:
    """Each part's ``state_dict()`` (the model: one per chunk); tensors are views of the parts' own."""
    return {name: [chunk.state_dict() for chunk in part] if name == "model" else part.state_dict()
            for name, part in parts.items()}


def checkpoint_state(trainer, states: dict[str, Any], loading: bool) -> dict[str, Any]:
    """The flat DCP state of the parts' ``states``: every rectangle of the model and optimizer by global name,
    then the objects. ``loading``: every copy of a rectangle is a destination; saving keeps each once."""
    config, context = trainer.config, trainer.context
    tp_size, tp_rank, vocab = context.layout.tp, context.coords["tp"], config.model.vocab_size
    experts = {"ep_size": context.layout.ep, "ep_rank": context.layout.expert_coords(context.rank)["ep"]}
    rule_for = trainer.resolved.model.rules
    state: dict[str, Any] = {}
    weights = [("model", chunk_state) for chunk_state in states["model"]]
    if states["previous"] is not None:  # optimizer.gradient_delay=1: the previous version too
        weights.append(("previous", states["previous"]["previous"]))
    for prefix, named in weights:
        for name, tensor in named.items():
            rule = rule_for(name)
            shape, pieces = parameter_pieces(rule, tensor, tp_size, tp_rank, vocab, **experts)
            add_pieces(state, f"{prefix}/{checkpoint_name(name, rule)}", shape, pieces, unique=not loading)
    for held in states["optimizer"]["tensors"]:
        for kind, tensor in held.tensors.items():
            rule = rule_for(held.name)
            shape, pieces = parameter_pieces(rule, tensor.detach(), tp_size, tp_rank, vocab,
                                             flat_start=held.flat_start, local_shape=held.shape, **experts)
            add_pieces(state, f"optimizer/{checkpoint_name(held.name, rule)}/{kind}", shape, pieces,
                       unique=not loading)
    state["optimizer/steps"] = states["optimizer"]["steps"]
    for name in OBJECTS[1:]:
        state[name] = states[name]
    return state


def checkpoint_index(trainer, step: int, reason: str, optimizer_steps: int) -> dict[str, Any]:
    """What ``ppctl.json`` records besides the files: the step, how the run was laid out, what it trains."""
    config, layout = trainer.config, trainer.context.layout
    return {
        "step": step,
        "reason": reason,
        "saved_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "world_size": layout.world_size,
        "layout": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "dp": layout.dp, "cp": layout.cp,
                   "ep": layout.ep,
                   "schedule": config.schedule.name, "distributed_optimizer": config.optimizer.distributed},
        "precision": config.trainer.precision,
        "model": model_record(vars(config.model)),
        "data": {**{key: getattr(config.trainer, key) for key in DATA_KEYS}, "source": config.data.source,
                 "tokenizer": _tokenizer_of(config)},
        "optimizer_steps": optimizer_steps,
        "gradient_delay": config.optimizer.gradient_delay,
    }


def _tokenizer_of(config) -> dict[str, Any] | None:
    """The record of the run's tokenizer (``tokenizer_record``); None when its file is gone since the run began: a
    save does not fail for want of it, and a resume then checks nothing of it, as of a checkpoint without one."""
    try:
        return tokenizer_record(config.data)
    except (OSError, ValueError):
        return None


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
    state = checkpoint_state(trainer, part_states(trainer_parts(trainer, step)), loading=False)
    save_state(state, partial)
    dist.barrier()  # every rank's file is written (the coordinator has written .metadata)
    final = [None]
    if dist.get_rank() == 0:
        index = checkpoint_index(trainer, step, reason, state["optimizer/steps"])
        final[0] = commit(run_dir, step, index, keep_last)
    dist.broadcast_object_list(final, src=0)
    return Path(final[0])


def load_checkpoint(trainer, checkpoint: Path) -> int:
    """Load a checkpoint saved at any layout into ``trainer``'s parts (collective); return its step.

    As DCP loads ``Stateful`` objects: each part's ``state_dict()`` gives the destinations,
    the tensors are read into them in place, then each part gets its state back.
    """
    parts = trainer_parts(trainer)
    states = part_states(parts)
    objects = load_state(checkpoint_state(trainer, states, loading=True), Path(checkpoint))
    for chunk, chunk_state in zip(parts["model"], states["model"]):
        chunk.load_state_dict(chunk_state)
    parts["optimizer"].load_state_dict({**states["optimizer"], "steps": objects["optimizer/steps"]})
    for name in OBJECTS[1:]:
        parts[name].load_state_dict(objects[name])
    parts["previous"].load_state_dict(states["previous"])  # read in place; nothing for a run without delay
    return parts["data"].step
