"""Model chunks as pipeline stages: the data contract, the loss and each stage's I/O spec.

This is the training side of the stage boundary (``ppctl.pipeline.stage``): the runtime
calls stages, and the stages call back into what is defined here:

- ``chunk_forward``: the first stage embeds the microbatch's tokens, every stage passes
  position ids (and, with documents kept apart, each token's document) to its layers, the
  last stage computes per-token losses from the labels;
- ``MaskedTokenLoss``: the masked sum of per-token losses divided by the loss-token
  count of the whole global batch, so the accumulated gradient equals the full-batch
  mean-token-loss gradient for any mask and any layout;
- ``stage_io``: message shapes and dtypes, and the microbatch fields each stage reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ppctl.config import PpctlConfig, message_seq_length
from ppctl.model.from_config import parameter_dtype
from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec


def chunk_forward(chunk: nn.Module, stage_input: torch.Tensor | None, microbatch) -> torch.Tensor:
    """Run one model chunk on one microbatch (tokens on the first stage, labels on the last, each token's document
    on every stage when documents are kept apart)."""
    inputs = microbatch.tokens if chunk.pre_process else stage_input
    labels = microbatch.labels if chunk.post_process else None
    return chunk(inputs, position_ids=microbatch.position_ids, labels=labels, segment_ids=microbatch.segment_ids)


@dataclass(frozen=True)
class MaskedTokenLoss:
    """The loss of one step: ``sum(loss * mask) / normalizer`` per microbatch.

    ``normalizer`` is the loss-token count of the whole global batch (every DP rank's
    share), so summing over microbatches and DP ranks gives the global mean token loss.
    ``scale`` multiplies the loss that is back-propagated (fp16 loss scaling; the
    optimizer divides the gradients by it again). Returns (the loss to back-propagate,
    the masked sum to report).
    """

    normalizer: float
    scale: float = 1.0

    def __call__(self, token_losses: torch.Tensor, microbatch) -> tuple[torch.Tensor, torch.Tensor]:
        masked_sum = (token_losses * microbatch.loss_mask.to(token_losses.dtype)).sum()
        return masked_sum * self.scale / self.normalizer, masked_sum  # x * 1.0 is exact: unscaled runs unchanged


def chunk_fields(chunk: nn.Module, separate_documents: bool = False) -> tuple[str, ...]:
    """The microbatch fields a chunk reads: tokens and positions first, positions for rotary, labels and mask last;
    with ``separate_documents`` (``data.documents=separate``) every chunk holding layers reads the documents too."""
    fields = []
    if chunk.pre_process:
        fields += ["tokens", "position_ids"]
    elif chunk.layers_read_positions:
        fields.append("position_ids")
    if chunk.post_process:
        fields += ["labels", "loss_mask"]
    if separate_documents and chunk.layer_ids:
        fields.append("segment_ids")
    return tuple(fields)


def stage_io(chunk: nn.Module, config: PpctlConfig) -> StageIO:
    """The chunk's messages (``[micro_batch, message_seq_length, hidden]`` in the parameter dtype) and fields."""
    activation = TensorSpec((config.trainer.micro_batch_size, message_seq_length(config), config.model.hidden_size),
                            parameter_dtype(config))
    return StageIO(input=None if chunk.pre_process else activation,
                   output=None if chunk.post_process else activation,
                   fields=chunk_fields(chunk, config.data.documents == "separate"))


def build_stages(chunks: dict[int, nn.Module], config: PpctlConfig,
                 split_backward: bool = False) -> dict[int, PipelineStage]:
    """Global stage -> ``PipelineStage`` for this rank's chunks (``split_backward``: the schedule has B and W)."""
    return {index: PipelineStage(index, chunk, stage_io(chunk, config), chunk_forward, chunk.post_process,
                                 split_backward)
            for index, chunk in chunks.items()}
