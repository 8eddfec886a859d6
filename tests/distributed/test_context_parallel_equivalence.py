"""Context parallelism (every ``cp_comm`` mode) and sequence parallelism train exactly like one process.

Each launch trains several layouts of one world size; every run is compared with the
single-process run as a user would launch it (the same overrides with
``parallel=single``): per-step losses and grad norms, the forward-only loss, step-0
gradients and final parameters, within the tolerances of ``tests/harness/tolerances.py``. The pipeline messages must carry only the rank's part of the sequence:
seq/cp tokens, and seq/(cp*tp) with sequence parallelism.
"""

import pytest

from tests.distributed.equivalence import BASE, DOCUMENTS, FP64, LLAMA, MASKED, assert_equivalent

ROPE_TIED = ["model.position_embedding=rope", "model.tie_embeddings=true"]
SP = ["parallel.sequence_parallel=true"]
MODES = ("allgather", "ring", "a2a")
SEQ, HIDDEN, MICRO_BATCH = 16, 32, 1   # BASE's sizes
FLOAT32_BYTES = 4


def parallel(tp=1, cp=1, pp=1, dp=1, vpp=1, schedule="1f1b", comm="allgather"):
    """The overrides of one layout."""
    return [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
            f"parallel.vpp={vpp}", f"schedule={schedule}", f"parallel.cp_comm={comm}"]


def message_bytes(tokens: int, element_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes of one pipeline message holding ``tokens`` tokens of each sequence."""
    return MICRO_BATCH * tokens * HIDDEN * element_bytes


def assert_messages(per_rank: list, index: int, expected_bytes: int) -> None:
    """Every pipeline message of run ``index``, on every rank, had ``expected_bytes`` bytes (and there were some)."""
    sent = set().union(*(result[index]["message_bytes"] for result in per_rank))
    assert sent == {expected_bytes}, f"run {index}: pipeline messages of {sorted(sent)} bytes, expected {expected_bytes}"


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_two_ranks_cp2_in_every_mode_and_sequence_parallel_tp2():
    runs = []
    for comm in MODES:
        runs.append(BASE + parallel(cp=2, comm=comm))
        runs.append(BASE + parallel(cp=2, comm=comm) + ROPE_TIED + MASKED)
    runs.append(BASE + parallel(cp=2, comm="ring") + FP64)
    runs.append(BASE + parallel(tp=2) + SP)
    runs.append(BASE + parallel(tp=2) + SP + ROPE_TIED + MASKED)
    runs.append(BASE + parallel(tp=2) + SP + FP64)
    assert_equivalent(runs, world_size=2)


@pytest.mark.nccl
@pytest.mark.timeout(400)
def test_four_ranks_cp4_sequence_parallel_with_pipelines_and_cp_with_dp():
    # each mode at cp=4 with Llama's grouped-query heads below (GPT's at cp=2 in the two-rank launch)
    runs = [BASE + parallel(cp=4, comm="ring") + ROPE_TIED + MASKED]
    runs.append(BASE + parallel(tp=4) + SP)
    runs.append(BASE + parallel(tp=2, pp=2) + SP + ROPE_TIED + MASKED)
    runs.append(BASE + parallel(tp=2, pp=2, vpp=2, schedule="interleaved_1f1b") + SP)
    runs.append(BASE + parallel(cp=2, pp=2, comm="a2a") + ROPE_TIED + MASKED)
    runs += [BASE + parallel(cp=4, comm=comm) + LLAMA + FP64 for comm in MODES]  # GQA's heads through each mode
    runs.append(BASE + parallel(tp=2, pp=2) + SP + LLAMA)
    runs.append(BASE + parallel(cp=2, dp=2, comm="ring"))
    per_rank = assert_equivalent(runs, world_size=4)
    assert_messages(per_rank, 2, message_bytes(SEQ // 2))            # SP, tp=2: half the tokens
    assert_messages(per_rank, 3, message_bytes(SEQ // 2))            # interleaved, with local hand-overs too
    assert_messages(per_rank, 4, message_bytes(SEQ // 2))            # cp=2: this rank's half of the sequence


@pytest.mark.nccl
@pytest.mark.timeout(600)
def test_eight_ranks_tp2_cp2_pp2_in_every_mode_with_and_without_sequence_parallel():
    runs = [BASE + parallel(tp=2, cp=2, pp=2, comm="allgather") + ROPE_TIED + MASKED,
            BASE + parallel(tp=2, cp=2, pp=2, comm="ring") + SP + MASKED,
            BASE + parallel(tp=2, cp=2, pp=2, comm="a2a") + SP + ROPE_TIED + MASKED]
    # documents kept apart in each CP mode (tests/unit/test_documents_separate.py has the one-process proof)
    runs += [BASE + parallel(tp=2, cp=2, pp=2, comm=comm) + SP + LLAMA + DOCUMENTS + FP64 for comm in MODES]
    per_rank = assert_equivalent(runs, world_size=8, timeout=500)
    assert_messages(per_rank, 0, message_bytes(SEQ // 2))
    assert_messages(per_rank, 1, message_bytes(SEQ // 4))
    assert_messages(per_rank, 2, message_bytes(SEQ // 4))
