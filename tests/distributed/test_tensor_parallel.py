"""Tensor parallelism against dense equivalents, on gloo workers.

One launch per TP size runs every check in both float32 and float64 and returns,
for each compared tensor, ``(max |actual - expected|, max |expected|)``; the tests
below judge those numbers. Dense references are computed in each worker from the
same seeds, so every rank compares against the same dense model.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.pool import run_workers
from tests.unit.test_model_single import run_pipeline

pytestmark = pytest.mark.dist

DTYPES = {"float32": torch.float32, "float64": torch.float64}
RELATIVE_TOLERANCE = {"float32": 1e-5, "float64": 1e-11}
GPT_CASES = {
    "learned_tied_one_chunk": dict(position_embedding="learned", tie_embeddings=True, layer_groups=[[0, 1]]),
    "rope_one_chunk": dict(position_embedding="rope", tie_embeddings=False, layer_groups=[[0, 1]]),
    "rope_tied_two_chunks": dict(position_embedding="rope", tie_embeddings=True, layer_groups=[[0], [1]]),
}
BATCH, SEQ = 2, 16


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------

def _difference(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return (actual.detach() - expected.detach()).abs().max().item(), expected.detach().abs().max().item()


def _random(generator, *shape, dtype):
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def _dense_linear(inputs, weight, bias, grad_outputs):
    """Dense reference: outputs and the gradients of inputs, weight and bias."""
    leaves = [tensor.clone().requires_grad_() for tensor in (inputs, weight, bias)]
    outputs = torch.nn.functional.linear(*leaves)
    outputs.backward(grad_outputs)
    return outputs.detach(), *(leaf.grad for leaf in leaves)


def _column_parallel_checks(tp, dtype, generator) -> dict:
    from ppctl.parallel.tensor_parallel import ColumnParallelLinear

    inputs, weight, bias = (_random(generator, 2, 5, 16, dtype=dtype), _random(generator, 24, 16, dtype=dtype),
                            _random(generator, 24, dtype=dtype))
    grad_outputs = _random(generator, 2, 5, 24, dtype=dtype)
    outputs, grad_inputs, grad_weight, grad_bias = _dense_linear(inputs, weight, bias, grad_outputs)
    results = {}
    for gather_output in (False, True):
        layer = ColumnParallelLinear(16, 24, tp, gather_output=gather_output, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(tp.shard(weight, 0))
            layer.bias.copy_(tp.shard(bias, 0))
        local_inputs = inputs.clone().requires_grad_()
        local_outputs = layer(local_inputs)
        local_outputs.backward(grad_outputs if gather_output else tp.shard(grad_outputs, -1))
        tag = f"column(gather_output={gather_output})"
        results[f"{tag}/output"] = _difference(local_outputs, outputs if gather_output else tp.shard(outputs, -1))
        results[f"{tag}/grad_input"] = _difference(local_inputs.grad, grad_inputs)
        results[f"{tag}/grad_weight"] = _difference(layer.weight.grad, tp.shard(grad_weight, 0))
        results[f"{tag}/grad_bias"] = _difference(layer.bias.grad, tp.shard(grad_bias, 0))
    return results


def _row_parallel_checks(tp, dtype, generator) -> dict:
    from ppctl.parallel.tensor_parallel import RowParallelLinear

    inputs, weight, bias = (_random(generator, 2, 5, 24, dtype=dtype), _random(generator, 16, 24, dtype=dtype),
                            _random(generator, 16, dtype=dtype))
    grad_outputs = _random(generator, 2, 5, 16, dtype=dtype)
    outputs, grad_inputs, grad_weight, grad_bias = _dense_linear(inputs, weight, bias, grad_outputs)
    results = {}
    for input_is_parallel in (True, False):
        layer = RowParallelLinear(24, 16, tp, input_is_parallel=input_is_parallel, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(tp.shard(weight, 1))
            layer.bias.copy_(bias)
        local_inputs = (tp.shard(inputs, -1) if input_is_parallel else inputs).clone().requires_grad_()
        local_outputs = layer(local_inputs)
        local_outputs.backward(grad_outputs)
        tag = f"row(input_is_parallel={input_is_parallel})"
        results[f"{tag}/output"] = _difference(local_outputs, outputs)
        expected_grad_inputs = tp.shard(grad_inputs, -1) if input_is_parallel else grad_inputs
        results[f"{tag}/grad_input"] = _difference(local_inputs.grad, expected_grad_inputs)
        results[f"{tag}/grad_weight"] = _difference(layer.weight.grad, tp.shard(grad_weight, 1))
        results[f"{tag}/grad_bias"] = _difference(layer.bias.grad, grad_bias)
    return results


def _embedding_checks(tp, dtype, generator) -> dict:
    from ppctl.parallel.tensor_parallel import VocabParallelEmbedding

    vocab_size, width = 32, 8
    weight = _random(generator, vocab_size, width, dtype=dtype)
    token_ids = torch.randint(0, vocab_size, (3, 7), generator=generator)
    grad_outputs = _random(generator, 3, 7, width, dtype=dtype)
    dense_weight = weight.clone().requires_grad_()
    outputs = torch.nn.functional.embedding(token_ids, dense_weight)
    outputs.backward(grad_outputs)

    layer = VocabParallelEmbedding(vocab_size, width, tp, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(tp.shard(weight, 0))
    local_outputs = layer(token_ids)
    local_outputs.backward(grad_outputs)
    return {"embedding/output": _difference(local_outputs, outputs),
            "embedding/grad_weight": _difference(layer.weight.grad, tp.shard(dense_weight.grad, 0))}


def _cross_entropy_checks(tp, dtype, generator) -> dict:
    from ppctl.parallel.tensor_parallel import vocab_parallel_cross_entropy

    vocab_size = 32
    logits = _random(generator, 3, 7, vocab_size, dtype=dtype) * 4
    targets = torch.randint(0, vocab_size, (3, 7), generator=generator)
    loss_weights = _random(generator, 3, 7, dtype=dtype)
    dense_logits = logits.clone().requires_grad_()
    losses = torch.nn.functional.cross_entropy(dense_logits.transpose(1, 2), targets, reduction="none")
    (losses * loss_weights).sum().backward()

    local_logits = tp.shard(logits, -1).clone().requires_grad_()
    local_losses = vocab_parallel_cross_entropy(local_logits, targets, tp)
    (local_losses * loss_weights).sum().backward()
    return {"cross_entropy/loss": _difference(local_losses, losses),
            "cross_entropy/grad_logits": _difference(local_logits.grad, tp.shard(dense_logits.grad, -1))}


def _gpt_checks(tp, dtype, case: dict) -> dict:
    """A GPT model on this TP layout against the same model built with tp=1 in this process."""
    from ppctl.model.gpt.model import GPTChunk, GPTConfig
    from ppctl.model.rules import dense_to_tp_shard, rule_of
    from ppctl.parallel.groups import RankGroups
    from ppctl.parallel.layout import StageLayers
    from ppctl.parallel.tensor_parallel import TPGroup

    config = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=64,
                       max_seq_length=SEQ, position_embedding=case["position_embedding"],
                       tie_embeddings=case["tie_embeddings"])
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    groups = case["layer_groups"]
    last = len(groups) - 1

    def build(group):
        return [GPTChunk(config, StageLayers(index, tuple(ids), index == 0, index == last), RankGroups(tp=group),
                         seed=99, dtype=dtype)
                for index, ids in enumerate(groups)]

    dense_chunks, tp_chunks = build(TPGroup.single()), build(tp)
    results = {"loss": _difference(run_pipeline(tp_chunks, tokens, positions, labels),
                                   run_pipeline(dense_chunks, tokens, positions, labels))}
    for index, (dense_chunk, tp_chunk) in enumerate(zip(dense_chunks, tp_chunks)):
        dense_params = dict(dense_chunk.named_parameters())
        for name, param in tp_chunk.named_parameters():
            expected = dense_to_tp_shard(rule_of(param), dense_params[name].grad, tp)
            results[f"chunk{index}/{name}/grad"] = _difference(param.grad, expected)
            results[f"chunk{index}/{name}/value"] = _difference(param, dense_to_tp_shard(rule_of(param), dense_params[name],
                                                                                           tp))
    return results


def tp_worker(rank: int, world_size: int, case_names: list[str], with_layers: bool) -> dict:
    """Every check on one TP group spanning the whole world; returns {dtype/check: (diff, scale)}."""
    import torch.distributed as dist

    from ppctl.parallel.tensor_parallel import TPGroup

    tp = TPGroup(dist.group.WORLD, world_size, rank)
    results = {}
    for dtype_name, dtype in DTYPES.items():
        generator = torch.Generator().manual_seed(3)
        checks = {}
        if with_layers:
            for layer_checks in (_column_parallel_checks, _row_parallel_checks, _embedding_checks,
                                 _cross_entropy_checks):
                checks.update({f"layers/{key}": value for key, value in layer_checks(tp, dtype, generator).items()})
        for case_name in case_names:
            checks.update({f"gpt/{case_name}/{key}": value
                           for key, value in _gpt_checks(tp, dtype, GPT_CASES[case_name]).items()})
        results.update({f"{dtype_name}/{key}": value for key, value in checks.items()})
    return results


# ---------------------------------------------------------------------------
# Test side
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp2_results():
    return run_workers(tp_worker, 2, list(GPT_CASES), True, timeout=240)


@pytest.fixture(scope="module")
def tp4_results():
    return run_workers(tp_worker, 4, ["rope_one_chunk"], False, timeout=240)


def _assert_all_close(rank_results: list[dict], prefix: str) -> int:
    """Assert every entry under ``<dtype>/<prefix>`` is within tolerance; return how many were checked."""
    checked = 0
    for rank, results in enumerate(rank_results):
        for key, (difference, scale) in results.items():
            dtype_name, rest = key.split("/", 1)
            if not rest.startswith(prefix):
                continue
            tolerance = RELATIVE_TOLERANCE[dtype_name] * max(scale, 1e-3)
            assert difference <= tolerance, f"rank {rank} {key}: max diff {difference:.3g} > {tolerance:.3g}"
            checked += 1
    assert checked > 0, f"no results under {prefix!r}"
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layer", ["column", "row", "embedding", "cross_entropy"])
def test_tp2_layers_match_dense(tp2_results, layer):
    _assert_all_close(tp2_results, f"layers/{layer}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case_name", list(GPT_CASES))
def test_tp2_gpt_matches_tp1(tp2_results, case_name):
    checked = _assert_all_close(tp2_results, f"gpt/{case_name}/")
    names = {key for key in tp2_results[0] if f"/{case_name}/" in key and key.endswith("/grad")}
    assert any("attention.qkv.weight" in name for name in names)
    assert any("embedding.word.weight" in name for name in names)
    assert checked >= len(names)


@pytest.mark.timeout(300)
def test_tp4_gpt_matches_tp1(tp4_results):
    _assert_all_close(tp4_results, "gpt/rope_one_chunk/")
