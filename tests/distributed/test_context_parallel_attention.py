"""Context-parallel attention against full causal attention, on gloo workers.

One launch of four workers runs every mode at cp=4 (all ranks) and cp=2 (two groups of
two). Each worker builds the full query/key/value from a fixed seed (the same on every
rank), takes its own tokens with the layout helpers, runs ``context_parallel_attention``
and compares the output and the gradients of its tokens' query, key and value with
``F.scaled_dot_product_attention(..., is_causal=True)`` on the full sequence. Workers
return ``(max |actual - expected|, max |expected|)`` per check; the tests judge them.

Documents kept apart: the same launch runs every mode with ``CPSegments`` built as a chunk builds
them (``CPSegments.gathered`` from the rank's slice of the segment ids) on rows of several documents
(a boundary exactly at a chunk boundary, a document over several chunks, one-token documents, rows
that see nothing of a ring block, pairs of chunks no row sees), against each document run alone as its
own causal sequence (float64); and an all-gather mask letting one key of another document through,
which must differ.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ppctl.parallel.context_parallel import (
    CP_COMM_MODES, CPGroup, CPSegments, context_parallel_attention, ring_block_owner, ring_step_pairs,
    visible_chunk_pairs,
)
from ppctl.parallel.layout import context_parallel_positions, context_parallel_slices
from tests.harness.pool import run_workers

pytestmark = pytest.mark.dist

WORLD_SIZE = 4
BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 32, 8
# The ring computes a chunk pair in tiles of RING_QUERY_TILE_ROWS query rows: one case has
# chunks longer than a tile (and not a multiple of it) so the tiled path is checked too.
LONG_SEQ = 2 * 2 * 160
# Against a float64 reference on the same (rounded) inputs; bfloat16 is as close as SDPA's own bfloat16 is.
RELATIVE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Document lengths of each row (BATCH rows), by sequence length. At SEQ: row 0's first boundary (8) is a
# chunk boundary at cp=2 and cp=4 and its second document spans five cp=4 chunks; row 1 has the boundary
# at 8 too (so at cp=4 no row sees chunks 0-1 from chunk 2 on: skipped ring pairs) and a one-token document.
# At LONG_SEQ (cp=2, chunks of 160 rows, tiled by the ring): boundaries at a chunk boundary and inside tiles.
DOCUMENTS = {SEQ: ((8, 19, 5), (3, 5, 1, 13, 10)), LONG_SEQ: ((160, 250, 7, 223), (1, 300, 339))}


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


def segment_ids_of(lengths_per_row) -> torch.Tensor:
    """``[rows, seq]`` int64: the index of each token's document in its row, from the documents' lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                        for lengths in lengths_per_row])


def each_document_alone(query, key, value, lengths_per_row) -> torch.Tensor:
    """Causal attention of every document run as its own sequence, put back in place (the reference)."""
    rows = []
    for row, lengths in enumerate(lengths_per_row):
        pieces, start = [], 0
        for length in lengths:
            window = slice(start, start + length)
            pieces.append(F.scaled_dot_product_attention(query[row:row + 1, :, window], key[row:row + 1, :, window],
                                                         value[row:row + 1, :, window], is_causal=True))
            start += length
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


def _check_documents(cp: CPGroup, seed: int, seq: int) -> dict:
    """Output and q/k/v gradients of this rank's tokens with documents kept apart against each document alone."""
    lengths = DOCUMENTS[seq]
    query, key, value, grad_out = _full_inputs(seed, torch.float64, seq)
    leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    expected = each_document_alone(*leaves, lengths)
    expected.backward(grad_out)
    mine = torch.tensor(context_parallel_positions(seq, cp.rank, cp.size))
    segment_ids = segment_ids_of(lengths)
    segments = CPSegments.gathered(segment_ids[:, mine], cp)  # as a chunk builds it: one all-gather
    _assert_same_segments(segments, CPSegments.of_row(segment_ids, cp))
    local = [tensor[:, :, mine].clone().requires_grad_() for tensor in (query, key, value)]
    actual = context_parallel_attention(*local, cp, segments=segments)
    actual.backward(grad_out[:, :, mine])
    results = {"output": _difference(actual, expected[:, :, mine], torch.float64)}
    for name, local_leaf, full_leaf in zip(("grad_query", "grad_key", "grad_value"), local, leaves):
        results[name] = _difference(local_leaf.grad, full_leaf.grad[:, :, mine], torch.float64)
    with torch.no_grad():
        no_grad_output = context_parallel_attention(*local, cp, segments=segments)
        results["no_grad_output"] = _difference(no_grad_output, expected[:, :, mine], torch.float64)
    return results


def _assert_same_segments(gathered: CPSegments, of_row: CPSegments) -> None:
    """The all-gathered rows build exactly what the whole rows build."""
    assert (gathered.comm, gathered.size, gathered.local_seq) == (of_row.comm, of_row.size, of_row.local_seq)
    assert all(torch.equal(left, right) for left, right in zip(gathered.masks, of_row.masks, strict=True))
    assert gathered.visible_pairs == of_row.visible_pairs
    assert (gathered.chunk_segments is None) == (of_row.chunk_segments is None)
    assert gathered.chunk_segments is None or torch.equal(gathered.chunk_segments, of_row.chunk_segments)


def _leak_one_key(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (``[batch, 1, rows, keys]``, causal lower right) with the first key of another document that row 0's
    queries precede opened to its query."""
    rows, keys = mask.shape[-2:]
    causal = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    hidden = (causal & ~mask[0, 0]).nonzero()
    leaky = mask.clone()
    if len(hidden):
        leaky[0, 0, hidden[0, 0], hidden[0, 1]] = True
    return leaky


def _broken_twin_difference(cp: CPGroup, seed: int) -> tuple[float, float]:
    """The all-gather output with one key of another document let through, against each document alone."""
    lengths = DOCUMENTS[SEQ]
    query, key, value, _ = _full_inputs(seed, torch.float64, SEQ)
    expected = each_document_alone(query, key, value, lengths)
    mine = torch.tensor(context_parallel_positions(SEQ, cp.rank, cp.size))
    segments = CPSegments.of_row(segment_ids_of(lengths), cp)
    leaky = dataclasses.replace(segments, masks=tuple(_leak_one_key(mask) for mask in segments.masks))
    actual = context_parallel_attention(query[:, :, mine], key[:, :, mine], value[:, :, mine], cp, segments=leaky)
    return _difference(actual, expected[:, :, mine], torch.float64)


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
    """This rank's results: ``{"checks": {(comm, cp, dtype, seq, name): (diff, scale)}, "refusals": {cp: message},
    "documents": {(comm, cp, seq, name): (diff, scale)}, "broken_twin": {cp: (diff, scale)}}``."""
    checks, refusals, documents, broken_twin = {}, {}, {}, {}
    for size, (group, ranks) in sorted(_cp_groups(rank, world_size).items()):
        for comm in CP_COMM_MODES:
            cp = CPGroup(group=group, size=size, rank=ranks.index(rank), ranks=ranks, comm=comm)
            cases = [(dtype, SEQ) for dtype in (torch.float64, torch.float32, torch.bfloat16)]
            cases += [(torch.float64, LONG_SEQ)] if size == 2 else []
            for dtype, seq in cases:
                for name, value in _check_against_full(cp, dtype, seed=10 * size + seq, seq=seq).items():
                    checks[(comm, size, dtype, seq, name)] = value
            for seq in (SEQ, LONG_SEQ) if size == 2 else (SEQ,):
                for name, value in _check_documents(cp, seed=7 * size + seq, seq=seq).items():
                    documents[(comm, size, seq, name)] = value
        a2a = CPGroup(group=group, size=size, rank=ranks.index(rank), ranks=ranks, comm="a2a")
        refusals[size] = _a2a_refuses_indivisible_heads(a2a)
        allgather = CPGroup(group=group, size=size, rank=ranks.index(rank), ranks=ranks, comm="allgather")
        broken_twin[size] = _broken_twin_difference(allgather, seed=size)
    return {"checks": checks, "refusals": refusals, "documents": documents, "broken_twin": broken_twin}


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


@pytest.mark.timeout(150)
@pytest.mark.parametrize("comm", CP_COMM_MODES)
def test_documents_kept_apart_match_each_document_alone_forward_and_backward(worker_results, comm):
    checked = 0
    for rank, results in enumerate(worker_results):
        for (mode, size, seq, name), (difference, scale) in results["documents"].items():
            if mode != comm:
                continue
            tolerance = RELATIVE_TOLERANCE[torch.float64]
            assert difference <= tolerance * scale, (
                f"rank {rank} {comm} cp={size} seq={seq} documents {DOCUMENTS[seq]} {name}: max |diff| "
                f"{difference:.3g} > {tolerance:g} * {scale:.3g}")
            checked += 1
    # Per rank: cp 4 and 2 at SEQ, plus LONG_SEQ at cp=2; 5 checks each.
    assert checked == WORLD_SIZE * 3 * 5


@pytest.mark.timeout(150)
def test_broken_twin_one_key_of_another_document_let_through_is_caught(worker_results):
    tolerance = RELATIVE_TOLERANCE[torch.float64]
    for size in (2, 4):
        differences = [results["broken_twin"][size] for results in worker_results]
        assert any(difference > tolerance * scale for difference, scale in differences), (
            f"cp={size}: an all-gather mask with one key of another document let through matched each document "
            f"alone: {differences}")


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


def test_single_rank_documents_match_each_document_alone():
    lengths = DOCUMENTS[SEQ]
    query, key, value, grad_out = _full_inputs(5, torch.float64, SEQ)
    reference = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    expected = each_document_alone(*reference, lengths)
    expected.backward(grad_out)
    cp = CPGroup.single()
    local = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    actual = context_parallel_attention(*local, cp, segments=CPSegments.gathered(segment_ids_of(lengths), cp))
    actual.backward(grad_out)
    tolerance = RELATIVE_TOLERANCE[torch.float64]
    for name, actual_tensor, expected_tensor in [("output", actual, expected)] + [
            (f"grad {index}", leaf.grad, reference_leaf.grad)
            for index, (leaf, reference_leaf) in enumerate(zip(local, reference))]:
        difference, scale = _difference(actual_tensor, expected_tensor, torch.float64)
        assert difference <= tolerance * scale, f"{name}: max |diff| {difference:.3g} > {tolerance:g} * {scale:.3g}"


def _visible_by_token_pairs(segment_ids: torch.Tensor, num_chunks: int) -> set[tuple[int, int]]:
    """The (query chunk, key chunk) pairs holding a block-causally visible (query, key) token pair, one by one."""
    chunk = segment_ids.shape[1] // num_chunks
    return {(query // chunk, key // chunk) for row in segment_ids.tolist() for query in range(len(row))
            for key in range(query + 1) if row[key] == row[query]}


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_visible_chunk_pairs_are_those_with_a_visible_token_pair(sorted_ids):
    generator = torch.Generator().manual_seed(11)
    for _ in range(8):
        segment_ids = torch.randint(0, 5, (2, 24), generator=generator) * 7 - 3  # any ids, not only 0, 1, ...
        if sorted_ids:
            segment_ids = segment_ids.sort(dim=1).values
        for num_chunks in (2, 4, 8):
            actual = visible_chunk_pairs(segment_ids.unflatten(1, (num_chunks, -1)))
            assert actual == _visible_by_token_pairs(segment_ids, num_chunks)


def test_ring_skips_the_pairs_no_query_sees():
    segment_ids = segment_ids_of(DOCUMENTS[SEQ])
    visible = visible_chunk_pairs(segment_ids.unflatten(1, (8, -1)))
    # cp=4, rank 0 holds chunks 0 and 7; at step 2 it holds rank 2's block (chunks 2 and 5): (7, 5) only, as
    # no row has a document in chunks 2 and 7 (row 0: 1 and 2; row 1: 2, 3 and 4), while row 1's document 4 is in 5.
    assert ring_step_pairs(0, 4, 2) == [(1, 0, "full"), (1, 1, "full")]
    assert ring_step_pairs(0, 4, 2, visible) == [(1, 1, "full")]
    # cp=4, rank 2 (chunks 2 and 5) at step 1 (rank 1's chunks 1 and 6): both documents start at 8, nothing seen.
    assert ring_step_pairs(2, 4, 1, visible) == []
    # Every pair computed with documents is one computed without them; the diagonal is never skipped.
    for cp_rank in range(4):
        for step in range(4):
            assert set(ring_step_pairs(cp_rank, 4, step, visible)) <= set(ring_step_pairs(cp_rank, 4, step))
        assert set(ring_step_pairs(cp_rank, 4, 0, visible)) >= {(0, 0, "causal"), (1, 1, "causal")}


def _ring_covered_token_pairs(segment_ids: list[list[int]], cp_rank: int, cp_size: int, visible) -> Counter:
    """(row, query, key) -> how many times the ring computes that score with documents kept apart on ``cp_rank``."""
    seq, covered = len(segment_ids[0]), Counter()
    for step in range(cp_size):
        key_slices = context_parallel_slices(seq, ring_block_owner(cp_rank, cp_size, step), cp_size)
        for q_local, k_local, mask in ring_step_pairs(cp_rank, cp_size, step, visible):
            queries, keys = context_parallel_slices(seq, cp_rank, cp_size)[q_local], key_slices[k_local]
            covered.update((row, query, key) for row in range(len(segment_ids)) for query in queries for key in keys
                           if (mask == "full" or key <= query) and segment_ids[row][key] == segment_ids[row][query])
    return covered


@pytest.mark.parametrize("cp_size", (2, 3, 4))
def test_ring_with_documents_computes_every_visible_token_pair_once(cp_size):
    generator = torch.Generator().manual_seed(cp_size)
    seq = 4 * cp_size * 3
    for _ in range(5):  # sorted random ids: documents of random lengths, some shorter than a chunk
        segment_ids = torch.randint(0, seq // 5, (2, seq), generator=generator).sort(dim=1).values
        visible = visible_chunk_pairs(segment_ids.unflatten(1, (2 * cp_size, -1)))
        for cp_rank in range(cp_size):
            rows = segment_ids.tolist()
            covered = _ring_covered_token_pairs(rows, cp_rank, cp_size, visible)
            queries = [query for piece in context_parallel_slices(seq, cp_rank, cp_size) for query in piece]
            expected = {(row, query, key) for row in range(2) for query in queries for key in range(query + 1)
                        if rows[row][key] == rows[row][query]}
            assert set(covered) == expected and set(covered.values()) == {1}, f"cp={cp_size} rank {cp_rank}"


def test_cp_segments_refuse_another_group_or_length():
    segments = CPSegments.of_row(segment_ids_of(DOCUMENTS[SEQ]), CPGroup(group=None, size=2, rank=0, ranks=(0, 1),
                                                                          comm="ring"))
    query = torch.zeros(BATCH, HEADS, SEQ // 2, HEAD_DIM)
    other_mode = CPGroup(group=None, size=2, rank=0, ranks=(0, 1), comm="a2a")
    with pytest.raises(ValueError, match="CPSegments built for cp=2 cp_comm=ring"):
        context_parallel_attention(query, query, query, other_mode, segments=segments)
    with pytest.raises(ValueError, match="used with cp=1"):
        context_parallel_attention(query, query, query, CPGroup.single(), segments=segments)
