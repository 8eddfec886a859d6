"""Context-parallel attention against full causal attention, on gloo workers.

One launch of four workers runs every mode at cp=4 (all ranks) and cp=2 (two groups of
two). Each worker builds the full query/key/value from a fixed seed (the same on every
rank), takes its own tokens with the layout helpers, runs ``context_parallel_attention``
and compares the output and the gradients of its tokens' query, key and value with
``F.scaled_dot_product_attention(..., is_causal=True)`` on the full sequence. Workers
return ``(max |actual - expected|, max |expected|)`` per check; the tests judge them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ppctl.parallel.context_parallel import CP_COMM_MODES, CPGroup, context_parallel_attention
from ppctl.parallel.layout import context_parallel_positions
from tests.harness.pool import run_workers

pytestmark = pytest.mark.dist

WORLD_SIZE = 4
BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 32, 8
# The ring computes a chunk pair in tiles of RING_QUERY_TILE_ROWS query rows: one case has
# chunks longer than a tile (and not a multiple of it) so the tiled path is checked too.
LONG_SEQ = 2 * 2 * 160
# Against a float64 reference on the same (rounded) inputs; bfloat16 is as close as SDPA's own bfloat16 is.
RELATIVE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------

def _difference(actual: torch.Tensor, expected: torch.Tensor, expected_dtype: torch.dtype) -> tuple[float, float]:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected_dtype, f"dtype {actual.dtype} != {expected_dtype}"
    actual, expected = actual.detach().to(torch.float64), expected.detach()
    return (actual - expected).abs().max().item(), expected.abs().max().item()


def _full_inputs(seed: int, dtype: torch.dtype, seq: int, heads: int = HEADS):
    """Query, key, value and an upstream gradient of the full sequence, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, heads, seq, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype)
            for _ in range(4)]


def _check_against_full(cp: CPGroup, dtype: torch.dtype, seed: int, seq: int = SEQ) -> dict:
    """Output and q/k/v gradients of this rank's tokens against full causal attention (in float64)."""
    query, key, value, grad_out = _full_inputs(seed, dtype, seq)
    leaves = [tensor.to(torch.float64, copy=True).requires_grad_() for tensor in (query, key, value)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(grad_out.to(torch.float64))
    mine = torch.tensor(context_parallel_positions(seq, cp.rank, cp.size))
    local = [tensor[:, :, mine].clone().requires_grad_() for tensor in (query, key, value)]
    actual = context_parallel_attention(*local, cp)
    actual.backward(grad_out[:, :, mine])
    results = {"output": _difference(actual, expected[:, :, mine], dtype)}
    for name, local_leaf, full_leaf in zip(("grad_query", "grad_key", "grad_value"), local, leaves):
        results[name] = _difference(local_leaf.grad, full_leaf.grad[:, :, mine], dtype)
    with torch.no_grad():
        no_grad_output = context_parallel_attention(*local, cp)
        results["no_grad_output"] = _difference(no_grad_output, expected[:, :, mine], dtype)
    return results


def _cp_groups(rank: int, world_size: int) -> dict[int, tuple[object, tuple[int, ...]]]:
    """cp size -> (process group, its global ranks) containing ``rank``; every rank creates every group in order."""
    groups = {world_size: (dist.group.WORLD, tuple(range(world_size)))}
    for start in range(0, world_size, 2):
        ranks = (start, start + 1)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            groups[2] = (group, ranks)
    return groups


def _a2a_refuses_indivisible_heads(cp: CPGroup) -> str:
    """The ValueError message of a2a with a head count that cp does not divide ('' if none was raised)."""
    query, key, value, _ = _full_inputs(0, torch.float64, SEQ, heads=cp.size + 1)
    mine = torch.tensor(context_parallel_positions(SEQ, cp.rank, cp.size))
    try:
        context_parallel_attention(query[:, :, mine], key[:, :, mine], value[:, :, mine], cp)
    except ValueError as error:
        return str(error)
    return ""


def _worker(rank: int, world_size: int) -> dict:
    """This rank's results: ``{"checks": {(comm, cp, dtype, seq, name): (diff, scale)}, "refusals": {cp: message}}``."""
    checks, refusals = {}, {}
    for size, (group, ranks) in sorted(_cp_groups(rank, world_size).items()):
        for comm in CP_COMM_MODES:
            cp = CPGroup(group=group, size=size, rank=ranks.index(rank), ranks=ranks, comm=comm)
            cases = [(dtype, SEQ) for dtype in (torch.float64, torch.float32, torch.bfloat16)]
            cases += [(torch.float64, LONG_SEQ)] if size == 2 else []
            for dtype, seq in cases:
                for name, value in _check_against_full(cp, dtype, seed=10 * size + seq, seq=seq).items():
                    checks[(comm, size, dtype, seq, name)] = value
        a2a = CPGroup(group=group, size=size, rank=ranks.index(rank), ranks=ranks, comm="a2a")
        refusals[size] = _a2a_refuses_indivisible_heads(a2a)
    return {"checks": checks, "refusals": refusals}


# ---------------------------------------------------------------------------
# Test side
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker_results() -> list[dict]:
    return run_workers(_worker, WORLD_SIZE, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("comm", CP_COMM_MODES)
def test_matches_full_causal_attention_forward_and_backward(worker_results, comm):
    checked = 0
    for rank, results in enumerate(worker_results):
        for (mode, size, dtype, seq, name), (difference, scale) in results["checks"].items():
            if mode != comm:
                continue
            tolerance = RELATIVE_TOLERANCE[dtype]
            assert difference <= tolerance * scale, (
                f"rank {rank} {comm} cp={size} {dtype} seq={seq} {name}: max |diff| {difference:.3g} "
                f"> {tolerance:g} * {scale:.3g}")
            checked += 1
    # Per rank: cp 4 and 2 in float64, float32 and bfloat16, plus the long float64 case at cp=2; 5 checks each.
    assert checked == WORLD_SIZE * (2 * 3 + 1) * 5


@pytest.mark.timeout(150)
def test_a2a_refuses_a_head_count_cp_does_not_divide(worker_results):
    for rank, results in enumerate(worker_results):
        for size in (2, 4):
            message = results["refusals"][size]
            assert "divisible by cp" in message, f"rank {rank} cp={size}: a2a did not refuse {size + 1} heads"


def test_single_rank_is_scaled_dot_product_attention():
    query, key, value, grad_out = _full_inputs(3, torch.float64, SEQ)
    leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    single = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(grad_out)
    for comm in CP_COMM_MODES:
        cp = CPGroup(group=None, size=1, rank=0, comm=comm)
        actual = context_parallel_attention(*single, cp)
        assert torch.equal(actual, expected)
    context_parallel_attention(*single, CPGroup.single()).backward(grad_out)
    for leaf, reference in zip(single, leaves):
        assert torch.equal(leaf.grad, reference.grad)


def test_cp_group_validates_its_fields():
    with pytest.raises(ValueError, match="rank must be in"):
        CPGroup(group=None, size=2, rank=2, ranks=(0, 1))
    with pytest.raises(ValueError, match="comm="):
        CPGroup(group=None, size=1, rank=0, comm="p2p")
    with pytest.raises(ValueError, match="global ranks"):
        CPGroup(group=None, size=2, rank=0)
