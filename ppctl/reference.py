"""The single-process reference: a plain PyTorch loop on the same model, data and optimizer.

No pipeline, no runtime, no process group: one ``GPTChunk`` holding every layer takes
the whole global batch in one forward, the mean token loss is back-propagated, the
gradient clipped with ``torch.nn.utils.clip_grad_norm_`` and AdamW steps. Equivalence
tests compare every layout and schedule against it; the pp=1 overhead benchmark
times it against ``ppctl train``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ppctl.config import PpctlConfig
from ppctl.data.dataset import build_dataset, build_microbatch, global_batch_sample_ids
from ppctl.model.gpt import GPTChunk
from ppctl.optim.grads import build_optimizer
from ppctl.parallel.tensor_parallel import TPGroup


@dataclass
class ReferenceRun:
    """Per-step losses and grad norms, and the final dense parameters by global name."""

    losses: list[float]
    grad_norms: list[float]
    parameters: dict[str, torch.Tensor]


def reference_model(config: PpctlConfig, padded_vocab: int | None = None) -> GPTChunk:
    """The whole GPT as one chunk, with the vocabulary padded as ``config``'s layout pads it."""
    from dataclasses import replace

    from ppctl.train import DTYPES, gpt_config

    shape = gpt_config(config)
    if padded_vocab is not None:
        shape = replace(shape, vocab_size=padded_vocab)
    layers = range(config.model.num_layers)
    return GPTChunk(shape, layers, True, True, TPGroup.single(), config.trainer.seed, DTYPES[config.trainer.precision])


def reference_step(model: GPTChunk, optimizer, batch, clip_grad: float) -> tuple[float, float]:
    """One full-batch step; returns (mean token loss, grad norm before clipping)."""
    optimizer.zero_grad(set_to_none=False)
    losses = model(batch.tokens, position_ids=batch.position_ids, labels=batch.labels)
    mask = batch.loss_mask.to(losses.dtype)
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
    optimizer.step()
    return float(loss.detach()), float(grad_norm)


def run_reference(config: PpctlConfig, steps: int | None = None, padded_vocab: int | None = None) -> ReferenceRun:
    """Train ``steps`` (default ``trainer.max_steps``) full-batch steps in this process."""
    trainer, data = config.trainer, config.data
    model = reference_model(config, padded_vocab)
    optimizer = build_optimizer([model], config.optimizer)
    dataset = build_dataset(data.source, data.path, Path(data.cache_dir), trainer.seq_length,
                            config.model.vocab_size, trainer.seed, data.tokenizer)
    losses, norms = [], []
    for step in range(trainer.max_steps if steps is None else steps):
        ids = global_batch_sample_ids(trainer.seed, step, trainer.global_batch_size, len(dataset))
        loss, norm = reference_step(model, optimizer, build_microbatch(dataset, ids), config.optimizer.clip_grad)
        losses.append(loss)
        norms.append(norm)
    parameters = {name: param.detach().clone() for name, param in model.named_parameters()}
    return ReferenceRun(losses, norms, parameters)
