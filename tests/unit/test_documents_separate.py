"""Documents kept apart (``data.documents=separate``): a packed batch computes what each document computes alone.

The proof, in float64 on one process: the microbatch the data side builds from packed windows (its
``segment_ids``, its positions restarting at each document, its loss mask) run through the model gives, token by
token, the same losses as each document run as its own sequence (positions from 0, plain causal attention), and
the masked loss of the batch has the same gradients as the sum of the documents' masked losses; for GPT (learned
and rotary positions), Llama (grouped-query heads) and OLMo 2 (its own attention), and with full and selective
recomputation.
Broken twins: a mask that lets one token see the last token of the previous document, and positions that run on
across documents, must both fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from ppctl.data.dataset import (Microbatch, WindowDataset, build_microbatch, document_position_ids,
                                document_segment_ids, global_batch_sample_ids)
from ppctl.data.iterator import PipelineDataIterator
from ppctl.model import attention_mask
from ppctl.model.attention_mask import DocumentMask
from ppctl.model.from_config import build_chunk
from ppctl.model.stages import chunk_fields
from ppctl.parallel.context_parallel import CPGroup, context_parallel_attention
from ppctl.parallel.layout import StageLayers

EOD = 15  # the last of 16 ids, as synthetic data's end of document
SMALL = ["data=synthetic", "model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
         "model.ffn_hidden_size=64", "model.vocab_size=16", "trainer.seq_length=16", "trainer.precision=fp64",
         "parallel=single", "data.documents=separate"]
FAMILIES = {
    "gpt-learned": SMALL,
    "gpt-rope": SMALL + ["model.position_embedding=rope"],
    "llama-gqa": SMALL + ["model.family=llama", "model.position_embedding=rope", "model.num_kv_heads=2"],
    "olmo2": SMALL + ["model.family=olmo2", "model.position_embedding=rope", "model.num_kv_heads=2"],
}
# Two packed windows of 17 tokens: row 0 holds a 4-token document, a 6-token one and the start of a third; row 1
# the end of a document, a 2-token one, an end of document right after it (a 1-token document) and a longer one.
WINDOWS = torch.tensor([[3, 1, 4, EOD, 1, 5, 9, 2, 6, EOD, 5, 3, 5, 8, 9, 7, 9],
                        [2, 7, 1, 8, EOD, 2, EOD, EOD, 8, 1, 8, 2, 8, 4, 5, 9, 0]])


class FixedWindows(WindowDataset):
    """``WINDOWS`` as a dataset, documents kept apart (``eod_mask_loss`` as asked)."""

    def __init__(self, eod_mask_loss: bool = False):
        self.seq_length, self.eod_id = WINDOWS.shape[1] - 1, EOD
        self.eod_mask_loss, self.separate_documents = eod_mask_loss, True

    def __len__(self) -> int:
        return WINDOWS.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return WINDOWS[self._check_index(index)]


# --- the data side --------------------------------------------------------------------------------------------

def test_segments_positions_and_loss_weights_of_a_packed_window():
    microbatch = build_microbatch(FixedWindows(), [0, 1])
    assert microbatch.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2],
                                               [0, 0, 0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3]]
    assert microbatch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5],
                                                [0, 1, 2, 3, 4, 0, 1, 0, 0, 1, 2, 3, 4, 5, 6, 7]]
    # The label of an end-of-document input is the next document's first token: weight 0.
    assert microbatch.loss_mask.tolist()[1] == [1, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    # With eod_mask_loss the end-of-document labels weigh 0 as well: both rules at once.
    composed = build_microbatch(FixedWindows(eod_mask_loss=True), [1])
    assert composed.loss_mask.tolist()[0] == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]


def test_joined_documents_keep_todays_microbatch():
    joined = FixedWindows()
    joined.separate_documents = False
    microbatch = build_microbatch(joined, [0, 1])
    assert microbatch.segment_ids is None and joined.loss_mask_all_ones
    assert torch.equal(microbatch.position_ids, torch.arange(16).repeat(2, 1))
    assert torch.equal(microbatch.loss_mask, torch.ones(2, 16))


def test_positions_follow_any_segments_and_the_first_piece_of_a_row_is_document_zero():
    segments = document_segment_ids(torch.tensor([EOD, 4, EOD, EOD]), EOD)
    assert segments.tolist() == [0, 1, 1, 2]
    assert document_position_ids(torch.tensor([[0, 0, 1, 1, 1, 4]])).tolist() == [[0, 1, 0, 1, 2, 0]]


def test_every_stage_with_layers_reads_the_documents_and_the_iterator_hands_them_over():
    middle = build_chunk(compose_config(FAMILIES["gpt-learned"]), StageLayers(1, (1,), False, False))
    assert chunk_fields(middle) == () and chunk_fields(middle, separate_documents=True) == ("segment_ids",)
    iterator = PipelineDataIterator(FixedWindows(), seed=0, global_batch_size=2, micro_batch_size=2, seq_length=16,
                                    dp_rank=0, dp_size=1, tp_group=None, tp_src_rank=0, is_tp_src=True,
                                    fields=("tokens", "position_ids", "segment_ids"))
    [microbatch] = iterator.microbatches(0)
    expected = build_microbatch(FixedWindows(), global_batch_sample_ids(0, 0, 2, 2))
    assert torch.equal(microbatch.segment_ids, expected.segment_ids) and microbatch.labels is None


def test_the_mask_is_block_causal():
    visible = DocumentMask.of(torch.tensor([[0, 0, 1, 1, 1]])).visible[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(visible, expected.bool())


# --- the proof: packed equals each document alone --------------------------------------------------------------

def packed_against_alone(model: torch.nn.Module, microbatch: Microbatch) -> tuple[float, float]:
    """The largest difference of a per-token loss, and of a gradient element (relative to the largest), between the
    packed microbatch and each of its documents run alone (positions from 0, no mask)."""
    model.zero_grad()
    packed = model(microbatch.tokens, position_ids=microbatch.position_ids, labels=microbatch.labels,
                   segment_ids=microbatch.segment_ids)
    (packed * microbatch.loss_mask.double()).sum().backward()
    packed_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    alone = torch.empty_like(packed)
    total = packed.new_zeros(())
    for row in range(microbatch.tokens.shape[0]):
        for segment in microbatch.segment_ids[row].unique():
            where = microbatch.segment_ids[row] == segment
            tokens, labels = microbatch.tokens[row, where][None], microbatch.labels[row, where][None]
            losses = model(tokens, position_ids=torch.arange(tokens.shape[1])[None], labels=labels)
            alone[row, where] = losses[0].detach()
            total = total + (losses[0] * microbatch.loss_mask[row, where].double()).sum()
    total.backward()
    loss_difference = (packed.detach() - alone).abs().max().item()
    grad_difference = max((packed_grads[name] - param.grad).abs().max().item() / param.grad.abs().max().item()
                          for name, param in model.named_parameters() if param.grad.abs().max() > 0)
    return loss_difference, grad_difference


def assert_packed_equals_alone(overrides: list[str]) -> None:
    """The packed batch's per-token losses and gradients equal its documents' alone, to float64 roundoff."""
    config = compose_config(overrides)
    validate(config)
    model = build_chunk(config, StageLayers.whole(config.model.num_layers))  # recomputing as configured
    microbatch = build_microbatch(FixedWindows(), [0, 1])
    loss_difference, grad_difference = packed_against_alone(model, microbatch)
    assert loss_difference < 1e-12, f"a per-token loss differs by {loss_difference:.2e}"
    assert grad_difference < 1e-12, f"a gradient differs by {grad_difference:.2e} of its largest element"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_train_as_each_document_alone(family):
    assert_packed_equals_alone(FAMILIES[family])


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_packed_documents_with_recomputation(recompute):
    """The layers (full) or the attention cores (selective) run again in the backward, with the same mask."""
    assert_packed_equals_alone(FAMILIES["llama-gqa"] + [f"model.recompute={recompute}"])


BLOCK_CAUSAL = DocumentMask.of  # the mask as built, before a twin replaces it


def leaky_mask(segment_ids: torch.Tensor) -> DocumentMask:
    """The block-causal mask, but the first token of row 0's second document also sees the token before it."""
    mask = BLOCK_CAUSAL(segment_ids)
    first = int((segment_ids[0] == 1).nonzero()[0])
    mask.visible[0, 0, first, first - 1] = True
    return mask


@pytest.mark.parametrize("family", ["gpt-learned", "llama-gqa"])
def test_broken_twin_a_mask_that_lets_one_token_see_across_a_boundary_fails(family, monkeypatch):
    monkeypatch.setattr(DocumentMask, "of", staticmethod(leaky_mask))
    with pytest.raises(AssertionError, match="per-token loss differs"):
        assert_packed_equals_alone(FAMILIES[family])


def test_broken_twin_positions_that_run_on_across_documents_fail(monkeypatch):
    monkeypatch.setattr(WindowDataset, "document_fields", _running_positions)
    with pytest.raises(AssertionError, match="per-token loss differs"):
        assert_packed_equals_alone(FAMILIES["gpt-learned"])


def _running_positions(self, inputs: torch.Tensor):
    """Today's positions ``0..seq-1`` beside the documents: what forgetting ``--reset-position-ids`` gives."""
    segment_ids = document_segment_ids(inputs, self.eod_id)
    return torch.arange(inputs.shape[-1]).repeat(inputs.shape[0], 1), segment_ids


# --- the setting ------------------------------------------------------------------------------------------------

def test_an_unknown_documents_mode_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^data.documents='apart' must be one of joined, separate$"):
        validate(compose_config(SMALL[:-1] + ["data.documents=apart"]))


def test_attend_without_a_mask_is_todays_attention():
    query, key, value = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    assert torch.equal(attention_mask.attend(query, key, value, CPGroup.single()),
                       context_parallel_attention(query, key, value, CPGroup.single()))
