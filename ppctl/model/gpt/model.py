"""GPT as pipeline stage chunks, with Megatron tensor parallelism.

A ``GPTChunk`` holds the word/position embedding when it is the first stage
(``pre_process``), a run of transformer layers named by their global ids, and, when
it is the last stage (``post_process``), the final norm, the vocab-parallel output
layer and the vocab-parallel cross-entropy. Running the chunks of a model in order
computes exactly what one chunk holding every layer computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ppctl.autograd.checkpoint import recomputed
from ppctl.autograd.weight_grad import DefersWeightGrads
from ppctl.model.gpt.rules import gpt_rule
from ppctl.model.layers import Embedding, LayerNorm, TransformerLayer, rotary_cos_sin
from ppctl.model.recompute import Recompute
from ppctl.model.rules import attach_rules, initialise
from ppctl.parallel.context_parallel import CPGroup
from ppctl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    TPGroup,
    column_parallel_linear,
    vocab_parallel_cross_entropy,
)

POSITION_EMBEDDINGS = ("learned", "rope")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT model.

    num_layers: transformer layers in the whole model.
    hidden_size: width of the residual stream.
    num_heads: attention heads (divides hidden_size; TP splits them).
    ffn_hidden_size: MLP inner width (TP splits it).
    vocab_size: the tokenizer's vocabulary: the classes the model predicts.
    padded_vocab_size: rows of the embedding and output layer (>= vocab_size, a multiple of tp;
        default vocab_size). Padded rows start at zero and never enter the math: no token
        looks them up and the cross-entropy excludes their logits, so the model is the same
        whatever the padding (Megatron-LM lets them into the softmax).
    max_seq_length: longest sequence (size of the learned position table).
    position_embedding: "learned" (table added to the embedding) or "rope" (rotary on q and k).
    tie_embeddings: the output layer reuses (or, on another stage, starts equal to) the word embedding.
    norm_epsilon: LayerNorm epsilon.
    init_std: standard deviation of the normal weight initialisation.
    rope_base: base of the rotary frequencies.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_length: int
    position_embedding: str = "learned"
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    rope_base: float = 10000.0
    padded_vocab_size: int | None = None

    def __post_init__(self):
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        for field in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "max_seq_length"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"GPTConfig.padded_vocab_size {self.padded_vocab_size} must be >= "
                             f"vocab_size {self.vocab_size}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"GPTConfig: hidden_size {self.hidden_size} must be a multiple of "
                             f"num_heads {self.num_heads}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"GPTConfig.position_embedding must be one of {POSITION_EMBEDDINGS}, "
                             f"got {self.position_embedding!r}")
        if self.position_embedding == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"GPTConfig: rope needs an even head dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


def check_tp_divides(config: GPTConfig, tp_size: int) -> None:
    """Raise ValueError unless heads, MLP width and padded vocabulary split evenly over ``tp_size`` ranks."""
    for field in ("num_heads", "ffn_hidden_size", "padded_vocab_size"):
        if getattr(config, field) % tp_size != 0:
            raise ValueError(f"model.{field}={getattr(config, field)} must be a multiple of parallel.tp={tp_size}")


class GPTChunk(DefersWeightGrads, nn.Module):
    """One pipeline stage chunk of the GPT model on one TP rank.

    ``layer_ids`` are the global ids of the transformer layers it runs, in order;
    ``pre_process`` adds the embedding, ``post_process`` the final norm, output layer
    and loss. Parameters are initialised from ``seed`` independently of the layout
    (see ``ppctl.model.rules``). ``cp``: the context-parallel group attention reaches
    the rest of the sequence through (one rank by default). Its norms and linear layers
    (the output layer too, tied or not) can defer their weight gradients to a pipeline
    W: a stage hands them its store (``ppctl.autograd.weight_grad.attach_weight_grad_store``).
    ``recompute``: which of its layers run their forward again in the backward
    (``ppctl.model.recompute``; the same numbers, less memory).
    """

    def __init__(self, config: GPTConfig, layer_ids: Sequence[int], pre_process: bool, post_process: bool,
                 tp: TPGroup, seed: int, dtype: torch.dtype = torch.float32, cp: CPGroup | None = None,
                 recompute: Recompute = Recompute()):
        super().__init__()
        check_tp_divides(config, tp.size)
        self.layer_ids = _checked_layer_ids(layer_ids, config.num_layers)
        self.config, self.tp, self.cp = config, tp, cp or CPGroup.single()
        self.recompute = recompute
        self.pre_process, self.post_process = pre_process, post_process
        self.shares_output_weight = pre_process and post_process and config.tie_embeddings

        if pre_process:
            self.embedding = Embedding(config.padded_vocab_size, config.hidden_size, config.max_seq_length,
                                       config.position_embedding == "learned", tp, dtype)
        self.layers = nn.ModuleDict({
            str(layer_id): TransformerLayer(config.hidden_size, config.num_heads, config.ffn_hidden_size,
                                            config.norm_epsilon, tp, dtype, self.cp, recompute.attention_core)
            for layer_id in self.layer_ids
        })
        if post_process:
            self.final_norm = LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype)
            if not self.shares_output_weight:
                self.output_layer = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, tp,
                                                         bias=False, dtype=dtype)
        attach_rules(self, lambda name: gpt_rule(name, config.tie_embeddings))
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Fill every parameter with this TP rank's slice of its layout-independent dense value."""
        initialise(self, seed, self.config, self.tp)

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """Run the chunk.

        ``inputs``: token ids ``[batch, seq]`` (int64) with ``pre_process``, else hidden
        states ``[batch, seq, hidden]`` (``seq / tp`` tokens with sequence parallelism).
        ``seq`` is this CP rank's part of the sequence. ``position_ids [batch, seq]``:
        positions of the tokens (default ``0..seq-1``; pass them when the sequence is sliced).
        Returns per-token losses ``[batch, seq]`` (float32, float64 for a float64 model)
        when ``post_process`` and ``labels`` are given, this rank's logits shard
        ``[batch, seq, padded_vocab/tp]`` when ``post_process`` alone (columns at ids >=
        ``vocab_size`` are padding, not classes), else hidden states.
        """
        if position_ids is None and self._reads_positions():
            position_ids = self._whole_sequence_positions(inputs)
        hidden = self.embedding(inputs, position_ids) if self.pre_process else inputs
        rotary = self._rotary(position_ids, hidden.dtype)
        layers = list(self.layers.values())
        for first, end, recompute in self.recompute.layer_groups(len(layers)):
            if recompute:
                hidden = recomputed(_run_layers, hidden, rotary, layers[first:end])
            else:
                hidden = _run_layers(hidden, rotary, layers[first:end])
        if not self.post_process:
            # An empty stage (a layout string's "||") passes its input on as a new tensor: the pipeline
            # frees a sent output's memory and back-propagates from it, which the received input must survive.
            return hidden.clone() if hidden is inputs else hidden
        normed = self.final_norm(hidden)
        # The output layer runs as a module (its forward pre-hooks fire: the distributed optimizer
        # waits there for its weight's all-gather); a shared weight is the embedding's, already waited for.
        logits_shard = (column_parallel_linear(normed, self.embedding.word.weight, None, self.tp,
                                               self.weight_grad_store)
                        if self.shares_output_weight else self.output_layer(normed))
        if labels is None:
            return logits_shard
        return vocab_parallel_cross_entropy(logits_shard, labels, self.tp, self.config.vocab_size)

    def embedding_weight_for_tying(self) -> nn.Parameter | None:
        """The weight whose gradient is all-reduced across the first and last stage when embeddings are tied.

        The word embedding on a ``pre_process`` chunk, the output-layer weight on a
        ``post_process``-only chunk; None when embeddings are not tied or the chunk has neither.
        """
        if not self.config.tie_embeddings:
            return None
        if self.pre_process:
            return self.embedding.word.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    @property
    def layers_read_positions(self) -> bool:
        """Whether its layers read the tokens' positions (rotary), beyond the embedding."""
        return self.config.position_embedding == "rope" and bool(self.layer_ids)

    def _reads_positions(self) -> bool:
        return self.pre_process or self.layers_read_positions

    def _whole_sequence_positions(self, inputs: torch.Tensor) -> torch.Tensor:
        """``0..seq-1`` for each sequence: right only when the chunk sees whole sequences."""
        if self.cp.size > 1 or self.tp.sequence_parallel:
            raise ValueError("GPTChunk: a sliced sequence (CP or SP) needs explicit position_ids")
        return torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)

    def _rotary(self, position_ids: torch.Tensor | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.config.position_embedding != "rope" or not self.layer_ids:
            return None
        return rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_base, dtype)


def _run_layers(hidden: torch.Tensor, rotary, layers: Sequence[TransformerLayer]) -> torch.Tensor:
    """``hidden`` through ``layers`` in order."""
    for layer in layers:
        hidden = layer(hidden, rotary)
    return hidden


def _checked_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(layer_id) for layer_id in layer_ids]
    if len(set(ids)) != len(ids) or any(not 0 <= layer_id < num_layers for layer_id in ids):
        raise ValueError(f"GPTChunk: layer_ids must be distinct ids in [0, {num_layers}), got {ids}")
    return ids
