"""Activation recomputation changes memory, not numbers (gloo workers).

Each layout runs twice in one launch, without and with ``model.recompute``: the run that
recomputes must match one process (``assert_equivalent``) and, rank by rank, its own
layout without recomputation: losses, norms, step-0 gradients and final parameters within
1e-6 relative in float32 (the forward run again gives the same tensors, so in practice
bitwise). Covered: full (uniform groups of 2, block of 1), selective, with 1F1B,
interleaved 1F1B and zero-bubble schedules (whose split backward must recompute once,
in B, and hand W what it needs), TP with sequence parallelism, CP (all-gather and ring)
and the distributed optimizer with overlapped parameter gathers (whose forward hooks
fire again in a recomputation).
"""

import pytest
import torch

from tests.distributed.equivalence import BASE, FP64, LLAMA, assert_equivalent

FULL_UNIFORM = ["model.recompute=full", "model.recompute_method=uniform", "model.recompute_num_layers=2"]
FULL_BLOCK = ["model.recompute=full", "model.recompute_method=block", "model.recompute_num_layers=1"]
SELECTIVE = ["model.recompute=selective"]
SAME = 1e-6  # relative, float32: recomputing gives the same tensors


def assert_same_as_without(per_rank: list[list[dict]], without: int, recomputing: int) -> None:
    """Run ``recomputing`` matches run ``without`` on every rank: losses, norms, gradients and parameters."""
    for rank_results in per_rank:
        plain, again = rank_results[without], rank_results[recomputing]
        for key in ("losses", "norms"):
            for expected, actual in zip(plain[key], again[key]):
                assert (expected is None) == (actual is None)
                if expected is not None:
                    assert actual == pytest.approx(expected, rel=SAME), (key, expected, actual)
        for key in ("gradients", "shards"):
            assert plain[key].keys() == again[key].keys()
            for name, expected in plain[key].items():
                difference = (again[key][name] - expected).abs().max().item()
                scale = max(expected.abs().max().item(), 1e-12)
                assert difference <= SAME * scale, (key, name, difference, scale)


LAYOUTS = {
    "llama 1f1b tp2 pp2, selective": (["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b", *LLAMA],
                                      SELECTIVE),
    "1f1b tp2 pp2 sp, full uniform": (["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b",
                                       "parallel.sequence_parallel=true"], FULL_UNIFORM),
    "interleaved pp2 vpp2 dp2, full block": (["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2",
                                              "schedule=interleaved_1f1b", "model.num_layers=8"], FULL_BLOCK),
    "zbv pp2 dp2, full uniform": (["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "schedule=zbv"],
                                  FULL_UNIFORM),
    "zb_h1 tp2 pp2, selective": (["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=zb_h1"], SELECTIVE),
    "1f1b pp2 cp2 ring, selective": (["parallel.pp=2", "parallel.dp=1", "parallel.cp=2", "parallel.cp_comm=ring",
                                      "schedule=1f1b"], SELECTIVE),
    "gpipe pp1 cp2 dp2 allgather, distributed overlap, full": (
        ["parallel.pp=1", "parallel.dp=2", "parallel.cp=2", "optimizer.distributed=true",
         "optimizer.overlap_param_gather=true"], FULL_BLOCK),
}


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_recompute_trains_like_one_process_and_like_no_recompute():
    runs = []
    for layout, recompute in LAYOUTS.values():
        runs += [BASE + layout, BASE + layout + recompute]
    per_rank = assert_equivalent(runs, world_size=4)
    for index in range(0, len(runs), 2):
        assert_same_as_without(per_rank, index, index + 1)


def test_recompute_keeps_fewer_tensors_for_the_backward():
    """One chunk of 4 layers: full recomputation keeps each group's input only, block keeps the layers it does not
    recompute, selective drops the attention core's tensors; the gradients are bitwise those without."""
    from torch.autograd.graph import saved_tensors_hooks

    from ppctl.model.gpt.model import GPTChunk, GPTConfig
    from ppctl.model.recompute import Recompute
    from ppctl.parallel.layout import StageLayers

    config = GPTConfig(num_layers=4, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=64,
                       max_seq_length=16)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def saved_bytes_and_grads(recompute: Recompute):
        chunk = GPTChunk(config, StageLayers.whole(4), seed=7, dtype=torch.float64, recompute=recompute)
        saved = {}

        def pack(tensor):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = chunk(tokens, labels=tokens).sum()
        loss.backward()
        return sum(saved.values()), {name: param.grad for name, param in chunk.named_parameters()}

    kept, reference = saved_bytes_and_grads(Recompute())
    for recompute in (Recompute("full", "uniform", 1), Recompute("full", "uniform", 2), Recompute("full", "block", 2),
                      Recompute("selective")):
        fewer, grads = saved_bytes_and_grads(recompute)
        assert fewer < kept, recompute
        assert all(torch.equal(grads[name], grad) for name, grad in reference.items()), recompute
    assert saved_bytes_and_grads(Recompute("full", "uniform", 2))[0] < saved_bytes_and_grads(
        Recompute("full", "block", 2))[0]
