"""A decoder-only transformer as pipeline stage chunks: what every model family's chunk shares.

A chunk holds the (vocab-parallel) embedding when it is the first stage (``pre_process``), a
run of decoder layers named by their global ids, and, when it is the last stage
(``post_process``), the final norm, the vocab-parallel output layer and the vocab-parallel
cross-entropy. Running the chunks of a model in order computes exactly what one chunk holding
every layer computes. A family subclasses ``DecoderChunk`` and says how its embedding, layers,
final norm, positions and parameter rules are made; the parameter names above the layers
(``embedding.word``, ``layers.<id>``, ``final_norm``, ``output_layer``) are the same in every family.
A chunk holding the whole model on one process also decodes incrementally (``generate_step``, with a
``ppctl.model.kv_cache.KVCache``), for ``ppctl generate``. With documents kept apart (``data.documents=separate``)
the forward takes each token's document index, builds the block-causal mask once (beside the rotary tables) and
hands that one ``ppctl.model.attention_mask.DocumentMask`` to every layer.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ppctl.autograd.checkpoint import recomputed
from ppctl.autograd.weight_grad import DefersWeightGrads
from ppctl.model.attention_mask import DocumentMask, document_mask
from ppctl.model.kv_cache import KVCache
from ppctl.model.recompute import Recompute
from ppctl.model.rules import attach_rules, initialise
from ppctl.parallel.groups import RankGroups
from ppctl.parallel.layout import StageLayers
from ppctl.parallel.tensor_parallel import ColumnParallelLinear, column_parallel_linear, vocab_parallel_cross_entropy


class DecoderChunk(DefersWeightGrads, nn.Module):
    """One pipeline stage chunk of a decoder-only model on one TP rank.

    ``config`` is the family's shape (``num_layers``, ``hidden_size``, ``padded_vocab_size``, ``vocab_size``,
    ``tie_embeddings``, and ``moe``: the ``MoEShape`` that makes some layers' MLP routed experts, or None).
    ``stage`` (``ppctl.parallel.layout.StageLayers``) names the global ids of the decoder layers it runs, in order
    (``layer_ids``); its ``pre_process`` adds the embedding, its ``post_process`` the final norm, output layer and
    loss. ``groups`` (``ppctl.parallel.groups.RankGroups``; one process by default) are the rank groups its layers
    communicate in: ``tp``, ``cp`` (attention reaches the rest of the sequence through it), ``ep`` (its MoE layers
    split their experts over it) and the ``token_split`` of each microbatch. Parameters are initialised from ``seed``
    independently of the layout (see ``ppctl.model.rules``); with ``seed`` None they stay zero for the caller to
    fill (``model.init_from`` reads every one: drawing dense values would only hold whole tensors). Its norms and
    linear layers (the output layer too, tied or not) can defer their weight gradients to a pipeline W: a stage
    hands them its store (``ppctl.autograd.weight_grad.attach_weight_grad_store``). ``recompute``: which of its
    layers run their forward again in the backward (``ppctl.model.recompute``; the same numbers, less memory).
    """

    def __init__(self, config, stage: StageLayers, groups: RankGroups = RankGroups.single(), *, seed: int | None,
                 dtype: torch.dtype = torch.float32, recompute: Recompute = Recompute()):
        super().__init__()
        self.check_tp_divides(config, groups.tp.size)
        self.layer_ids = _checked_layer_ids(stage.layers, config.num_layers)
        self.config, self.groups = config, groups
        self.tp, self.cp, self.ep = groups.tp, groups.cp, groups.ep
        self.recompute = recompute
        self.pre_process, self.post_process = stage.pre_process, stage.post_process
        self.shares_output_weight = self.pre_process and self.post_process and config.tie_embeddings

        if self.pre_process:
            self.embedding = self.make_embedding(dtype)
        self.layers = nn.ModuleDict({str(layer_id): self.make_layer(dtype, recompute.attention_core,
                                                                    self._moe_mlp_of(layer_id, dtype))
                                     for layer_id in self.layer_ids})
        if self.post_process:
            self.final_norm = self.make_final_norm(dtype)
            if not self.shares_output_weight:
                self.output_layer = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, self.tp,
                                                         bias=False, dtype=dtype)
        attach_rules(self, self.parameter_rule)
        if seed is not None:
            self.reset_parameters(seed)

    # --- what a family says ------------------------------------------------------------------------

    @staticmethod
    def check_tp_divides(config, tp_size: int) -> None:
        """Raise ValueError (one line) unless the shape splits evenly over ``tp_size`` ranks."""
        raise NotImplementedError

    def make_embedding(self, dtype: torch.dtype) -> nn.Module:
        """The embedding: a module with a vocab-parallel ``word`` table, called as ``(token_ids, position_ids)``."""
        raise NotImplementedError

    def make_layer(self, dtype: torch.dtype, recompute_attention_core: bool, mlp: nn.Module | None) -> nn.Module:
        """One decoder layer, called as ``(hidden, rotary)`` (and ``mask=``, a ``DocumentMask`` or None); ``mlp``: its
        MLP when not the family's dense one."""
        raise NotImplementedError

    def make_moe_mlp(self, dtype: torch.dtype) -> nn.Module:
        """An MoE layer's MLP (``ppctl.model.moe.layer.MoEMLP``) with the family's experts and shared experts."""
        raise NotImplementedError

    def make_final_norm(self, dtype: torch.dtype) -> nn.Module:
        """The norm before the output layer."""
        raise NotImplementedError

    def parameter_rule(self, name: str):
        """The ``ParameterRule`` of a global parameter name of this family."""
        raise NotImplementedError

    @property
    def layers_read_positions(self) -> bool:
        """Whether its layers read the tokens' positions (rotary), beyond the embedding."""
        raise NotImplementedError

    def rotary_tables(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """The layers' rotary ``(cos, sin)`` for ``position_ids``, or None."""
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------------

    def _moe_mlp_of(self, layer_id: int, dtype: torch.dtype) -> nn.Module | None:
        """The MoE MLP of layer ``layer_id`` when the shape's ``moe`` makes it an MoE layer, else None (dense)."""
        moe = getattr(self.config, "moe", None)
        return self.make_moe_mlp(dtype) if moe is not None and moe.is_moe_layer(layer_id) else None

    def reset_parameters(self, seed: int) -> None:
        """Fill every parameter with this rank's slice (TP, and EP's experts) of its layout-independent dense value."""
        initialise(self, seed, self.config, self.tp, self.ep)

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the chunk.

        ``inputs``: token ids ``[batch, seq]`` (int64) with ``pre_process``, else hidden
        states ``[batch, seq, hidden]`` (``seq / tp`` tokens with sequence parallelism).
        ``seq`` is this CP rank's part of the sequence. ``position_ids [batch, seq]``:
        positions of the tokens (default ``0..seq-1``; pass them when the sequence is sliced).
        ``segment_ids [batch, seq]``: each token's document within its row (documents kept apart:
        no token attends across a document; pass the positions restarting with them); None: one
        causal sequence.
        Returns per-token losses ``[batch, seq]`` (float32, float64 for a float64 model)
        when ``post_process`` and ``labels`` are given, this rank's logits shard
        ``[batch, seq, padded_vocab/tp]`` when ``post_process`` alone (columns at ids >=
        ``vocab_size`` are padding, not classes), else hidden states.
        """
        if position_ids is None and self._reads_positions():
            position_ids = self._whole_sequence_positions(inputs)
        hidden = self.embedding(inputs, position_ids) if self.pre_process else inputs
        rotary = self._rotary(position_ids, hidden.dtype)
        mask = document_mask(segment_ids, self.cp)  # once per microbatch, for every layer
        layers = list(self.layers.values())
        for first, end, recompute in self.recompute.layer_groups(len(layers)):
            if recompute:
                hidden = recomputed(_run_layers, hidden, rotary, layers[first:end], mask)
            else:
                hidden = _run_layers(hidden, rotary, layers[first:end], mask)
        if not self.post_process:
            # An empty stage (a layout string's "||") passes its input on as a new tensor: the pipeline
            # frees a sent output's memory and back-propagates from it, which the received input must survive.
            return hidden.clone() if hidden is inputs else hidden
        logits_shard = self._logits_shard(self.final_norm(hidden))
        if labels is None:
            return logits_shard
        return vocab_parallel_cross_entropy(logits_shard, labels, self.tp, self.config.vocab_size)

    def generate_step(self, token_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One step of incremental decoding (one process: the whole model in this chunk, no TP, no CP).

        ``token_ids [batch, new]`` at ``position_ids [batch, new]`` are the positions after the ``cache.length``
        ones ``cache`` holds (the prompt as one step, then one token a step); each layer's keys and values join
        ``cache``. Returns the last position's logits over the vocabulary, ``[batch, vocab_size]``, from the
        output weight as ``cache`` lays it out for decoding (``KVCache.output_weight``).
        """
        if not (self.pre_process and self.post_process) or self.tp.size > 1 or self.cp.size > 1:
            raise ValueError("generate_step runs the whole model in one process: one chunk with every layer, "
                             "tp=1, cp=1")
        hidden = self.embedding(token_ids, position_ids)
        rotary = self._rotary(position_ids, hidden.dtype)
        for layer_id, layer in self.layers.items():
            hidden = layer(hidden, rotary, cache.layer(layer_id))
        weight = self.embedding.word.weight if self.shares_output_weight else self.output_layer.weight
        return self.final_norm(hidden[:, -1]) @ cache.output_weight(weight[:self.config.vocab_size])

    def _logits_shard(self, normed: torch.Tensor) -> torch.Tensor:
        """This rank's logits shard of the final norm's output."""
        # The output layer runs as a module (its forward pre-hooks fire: the distributed optimizer
        # waits there for its weight's all-gather); a shared weight is the embedding's, already waited for.
        if self.shares_output_weight:
            return column_parallel_linear(normed, self.embedding.word.weight, None, self.tp, self.weight_grad_store)
        return self.output_layer(normed)

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

    def _reads_positions(self) -> bool:
        return self.pre_process or self.layers_read_positions

    def _whole_sequence_positions(self, inputs: torch.Tensor) -> torch.Tensor:
        """``0..seq-1`` for each sequence: right only when the chunk sees whole sequences."""
        if self.cp.size > 1 or self.tp.sequence_parallel:
            raise ValueError(f"{type(self).__name__}: a sliced sequence (CP or SP) needs explicit position_ids")
        return torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)

    def _rotary(self, position_ids: torch.Tensor | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.layers_read_positions:
            return None
        return self.rotary_tables(position_ids, dtype)


def _run_layers(hidden: torch.Tensor, rotary, layers: Sequence[nn.Module],
                mask: DocumentMask | None = None) -> torch.Tensor:
    """``hidden`` through ``layers`` in order (``mask``: the microbatch's documents kept apart, or None)."""
    for layer in layers:
        hidden = layer(hidden, rotary, mask=mask)
    return hidden


def _checked_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(layer_id) for layer_id in layer_ids]
    if len(set(ids)) != len(ids) or any(not 0 <= layer_id < num_layers for layer_id in ids):
        raise ValueError(f"a chunk's layer_ids must be distinct ids in [0, {num_layers}), got {ids}")
    return ids
