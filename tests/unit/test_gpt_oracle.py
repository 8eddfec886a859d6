"""GPTChunk against the independent oracle GPT of ``tests/harness/gpt_oracle.py``, in float64.

One chunk holding every layer (tp=1) must give the oracle's logits, per-token losses
and every parameter's gradient to ~1e-10 relative, whatever the position embedding,
the tying of embeddings and the padding of the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ppctl.model.gpt.model import GPTChunk, GPTConfig
from ppctl.parallel.layout import StageLayers
from tests.harness.gpt_oracle import OracleConfig, OracleGPT

VOCAB, HIDDEN, HEADS, FFN, LAYERS = 37, 32, 4, 64, 3
BATCH, SEQ = 3, 12
POSITION_OFFSETS = (0, 2, 5)         # each batch row starts at its own position
MAX_SEQ = SEQ + max(POSITION_OFFSETS)
MODEL_SEED, DATA_SEED = 1234, 7
TOLERANCE = 1e-10                    # oracle vs GPTChunk, relative, per tensor
PADDING_TOLERANCE = 1e-14            # padded vs unpadded GPTChunk: rounding of differently shaped matmuls only
VOCABULARY_TENSORS = ("embedding.word.weight", "output_layer.weight")   # dim 0 is the padded vocabulary


@dataclass
class Batch:
    """Inputs of one step: token ids, position ids, labels and a 0/1 loss mask, all ``[batch, seq]``."""

    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


@dataclass
class StepResult:
    """What one model computed: logits over the real vocabulary, per-token losses, gradients by ppctl name."""

    logits: torch.Tensor
    losses: torch.Tensor
    gradients: dict[str, torch.Tensor]


def make_config(position_embedding: str, tie_embeddings: bool, padded_vocab_size: int) -> GPTConfig:
    """The small test model."""
    return GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS, ffn_hidden_size=FFN,
                     vocab_size=VOCAB, max_seq_length=MAX_SEQ, position_embedding=position_embedding,
                     tie_embeddings=tie_embeddings, padded_vocab_size=padded_vocab_size)


def oracle_config_of(config: GPTConfig) -> OracleConfig:
    """The oracle's config for the same model (it has no padding)."""
    return OracleConfig(num_layers=config.num_layers, hidden_size=config.hidden_size, num_heads=config.num_heads,
                        ffn_hidden_size=config.ffn_hidden_size, vocab_size=config.vocab_size,
                        max_seq_length=config.max_seq_length, position_embedding=config.position_embedding,
                        tie_embeddings=config.tie_embeddings, norm_epsilon=config.norm_epsilon,
                        rope_base=config.rope_base)


def build_chunk(config: GPTConfig) -> GPTChunk:
    """One float64 chunk holding every layer, embedding and output on one TP rank."""
    return GPTChunk(config, StageLayers.whole(config.num_layers), seed=MODEL_SEED, dtype=torch.float64)


def build_oracle(config: GPTConfig, chunk_parameters: dict[str, torch.Tensor]) -> OracleGPT:
    """An oracle loaded with the given parameter values (by ppctl global name)."""
    oracle = OracleGPT(oracle_config_of(config), torch.float64)
    oracle.load_ppctl_parameters(chunk_parameters)
    return oracle


def chunk_parameter_values(chunk: GPTChunk) -> dict[str, torch.Tensor]:
    """Detached copies of the chunk's parameters by global name."""
    return {name: param.detach().clone() for name, param in chunk.named_parameters()}


def make_batch() -> Batch:
    """Random tokens and labels, row-offset positions and a loss mask with some zeros."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.stack([torch.arange(SEQ) + offset for offset in POSITION_OFFSETS])
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.25).to(torch.float64)
    loss_mask[0, 0] = 0.0
    return Batch(tokens, positions, labels, loss_mask)


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the losses where the mask is 1."""
    return (losses * loss_mask).sum() / loss_mask.sum()


def run_chunk(chunk: GPTChunk, batch: Batch) -> StepResult:
    """Logits (real columns), losses and gradients (by global name, full padded shape) of the chunk."""
    chunk.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = chunk(batch.tokens, batch.positions)[..., :VOCAB]
    losses = chunk(batch.tokens, batch.positions, batch.labels)
    masked_mean(losses, batch.loss_mask).backward()
    gradients = {name: param.grad.detach().clone() for name, param in chunk.named_parameters()}
    return StepResult(logits, losses.detach(), gradients)


def run_oracle(oracle: OracleGPT, batch: Batch) -> StepResult:
    """Logits, losses and gradients (by ppctl global name, real vocabulary rows) of the oracle."""
    oracle.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = oracle(batch.tokens, batch.positions)
    losses = oracle.token_losses(batch.tokens, batch.positions, batch.labels)
    masked_mean(losses, batch.loss_mask).backward()
    return StepResult(logits, losses.detach(), oracle.ppctl_gradients())


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max absolute difference over the max absolute value (0 when both are all zero)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = max(actual.abs().max().item(), expected.abs().max().item())
    difference = (actual - expected).abs().max().item()
    return difference / scale if scale > 0 else difference


def real_rows(name: str, gradient: torch.Tensor) -> torch.Tensor:
    """The rows of a ppctl gradient that the oracle holds (the real vocabulary for vocabulary tensors)."""
    return gradient[:VOCAB] if name in VOCABULARY_TENSORS else gradient


def compare_gradients(chunk_gradients: dict[str, torch.Tensor], oracle_gradients: dict[str, torch.Tensor]) -> None:
    """Every chunk gradient matches the oracle's on the real rows and is exactly zero on padded rows."""
    assert sorted(chunk_gradients) == sorted(oracle_gradients)
    for name, gradient in chunk_gradients.items():
        if name in VOCABULARY_TENSORS:
            assert torch.count_nonzero(gradient[VOCAB:]) == 0, f"{name}: padded vocabulary rows have a gradient"
        error = relative_error(real_rows(name, gradient), oracle_gradients[name])
        assert error < TOLERANCE, f"{name}: relative gradient error {error:.3e}"


@pytest.mark.parametrize("padded_vocab_size", [VOCAB, 64])
@pytest.mark.parametrize("tie_embeddings", [False, True])
@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_chunk_matches_oracle(position_embedding, tie_embeddings, padded_vocab_size):
    """Logits, per-token losses and every parameter's gradient agree with the oracle to 1e-10."""
    config = make_config(position_embedding, tie_embeddings, padded_vocab_size)
    chunk = build_chunk(config)
    oracle = build_oracle(config, chunk_parameter_values(chunk))
    batch = make_batch()

    chunk_result, oracle_result = run_chunk(chunk, batch), run_oracle(oracle, batch)

    assert relative_error(chunk_result.logits, oracle_result.logits) < TOLERANCE
    assert relative_error(chunk_result.losses, oracle_result.losses) < TOLERANCE
    assert set(chunk_result.gradients) == {name for name, _ in chunk.named_parameters()}
    compare_gradients(chunk_result.gradients, oracle_result.gradients)


@pytest.mark.parametrize("tie_embeddings", [False, True])
@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_vocabulary_padding_changes_nothing(position_embedding, tie_embeddings):
    """Padded vocabularies give the unpadded model's logits, losses and real-row gradients.

    Not bit for bit: the CPU BLAS picks its kernel (and so its summation order) by the
    matrix shape, so ``F.linear`` with 37 output rows and with 64 (zero-padded) rows
    already differ in the last bit of some columns. The padding enters nothing else:
    the results agree to a few ulps (~5e-16 observed), far tighter than any real
    difference (letting the padded logits into the softmax would change the losses by ~0.5).
    """
    batch = make_batch()
    results = {padded: run_chunk(build_chunk(make_config(position_embedding, tie_embeddings, padded)), batch)
               for padded in (VOCAB, 64, 128)}
    unpadded = results[VOCAB]
    for padded, result in results.items():
        assert relative_error(result.logits, unpadded.logits) < PADDING_TOLERANCE, f"padded {padded}: logits"
        assert relative_error(result.losses, unpadded.losses) < PADDING_TOLERANCE, f"padded {padded}: losses"
        for name, gradient in result.gradients.items():
            error = relative_error(real_rows(name, gradient), unpadded.gradients[name])
            assert error < PADDING_TOLERANCE, f"padded {padded}: {name} gradient error {error:.3e}"


def test_perturbed_oracle_disagrees():
    """The comparison has teeth: one key weight off by 0.05 shows in the losses and gradients."""
    config = make_config("rope", False, 64)
    chunk = build_chunk(config)
    perturbed = chunk_parameter_values(chunk)
    qkv_name = "layers.1.attention.qkv.weight"
    perturbed[qkv_name][HIDDEN + 3, 5] += 0.05   # row HIDDEN + 3 is in the key part of [q; k; v]
    batch = make_batch()

    chunk_result = run_chunk(chunk, batch)
    oracle_result = run_oracle(build_oracle(config, perturbed), batch)

    assert relative_error(chunk_result.losses, oracle_result.losses) > 1e3 * TOLERANCE
    assert relative_error(chunk_result.gradients[qkv_name], oracle_result.gradients[qkv_name]) > 1e3 * TOLERANCE
