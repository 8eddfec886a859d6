"""Which (query chunk, key chunk) pairs ring attention computes: coverage and load balance, exhaustively.

Pure logic, no processes: for every CP size up to 8, every rank's computed pairs must
cover exactly the keys its queries may see (each once), and every rank must do the
same amount of work at every ring step (the balance the two-chunk layout promises).
"""

from collections import Counter

import pytest

from ppctl.parallel.context_parallel import chunk_pair_mask, ring_block_owner, ring_step_pairs
from ppctl.parallel.layout import context_parallel_slices

CP_SIZES = range(1, 9)
CHUNK_TOKENS = 3


def pair_work(mask: str, chunk_tokens: int) -> int:
    """Score entries computed for one pair: the whole square, or its lower triangle with the diagonal."""
    return chunk_tokens * chunk_tokens if mask == "full" else chunk_tokens * (chunk_tokens + 1) // 2


def seq_length(cp_size: int) -> int:
    return CHUNK_TOKENS * (1 if cp_size == 1 else 2 * cp_size)


def covered_pairs(cp_rank: int, cp_size: int) -> Counter:
    """(query index, key index) -> how many times the ring computes that score on ``cp_rank``."""
    covered = Counter()
    for step in range(cp_size):
        owner = ring_block_owner(cp_rank, cp_size, step)
        for q_local, k_local, mask in ring_step_pairs(cp_rank, cp_size, step):
            queries = context_parallel_slices(seq_length(cp_size), cp_rank, cp_size)[q_local]
            keys = context_parallel_slices(seq_length(cp_size), owner, cp_size)[k_local]
            covered.update((query, key) for query in queries for key in keys if mask == "full" or key <= query)
    return covered


def test_chunk_pair_mask_by_chunk_order():
    assert chunk_pair_mask(3, 1) == "full"
    assert chunk_pair_mask(2, 2) == "causal"
    assert chunk_pair_mask(1, 3) == "skip"
    assert [chunk_pair_mask(q, k) for q in range(3) for k in range(3)] == [
        "causal", "skip", "skip", "full", "causal", "skip", "full", "full", "causal"]


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_every_query_sees_exactly_the_keys_before_it_once(cp_size):
    for cp_rank in range(cp_size):
        covered = covered_pairs(cp_rank, cp_size)
        queries = [query for piece in context_parallel_slices(seq_length(cp_size), cp_rank, cp_size) for query in piece]
        expected = {(query, key) for query in queries for key in range(query + 1)}
        assert set(covered) == expected, f"cp={cp_size} rank {cp_rank}: wrong keys"
        assert set(covered.values()) == {1}, f"cp={cp_size} rank {cp_rank}: a score computed twice"


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_each_rank_sees_every_block_once_passed_from_its_previous_rank(cp_size):
    for cp_rank in range(cp_size):
        owners = [ring_block_owner(cp_rank, cp_size, step) for step in range(cp_size)]
        assert owners[0] == cp_rank and sorted(owners) == list(range(cp_size))
        for step in range(1, cp_size):  # what arrives at step s is what the previous rank held at step s-1
            assert owners[step] == ring_block_owner((cp_rank - 1) % cp_size, cp_size, step - 1)


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_work_is_equal_across_ranks_at_every_step(cp_size):
    for step in range(cp_size):
        work = {cp_rank: sum(pair_work(mask, CHUNK_TOKENS) for *_, mask in ring_step_pairs(cp_rank, cp_size, step))
                for cp_rank in range(cp_size)}
        assert len(set(work.values())) == 1, f"cp={cp_size} step {step}: unequal work {work}"


@pytest.mark.parametrize("cp_size", range(2, 9))
def test_each_rank_computes_two_causal_and_two_cp_minus_one_full_pairs(cp_size):
    # Of the 4 * cp pairs a rank meets, 2 * cp - 1 are skipped: the masked upper half.
    for cp_rank in range(cp_size):
        masks = Counter(mask for step in range(cp_size) for *_, mask in ring_step_pairs(cp_rank, cp_size, step))
        assert masks == {"causal": 2, "full": 2 * cp_size - 1}
