"""PipelineDataIterator on 4 gloo workers: TP-source reads, broadcast to the TP group, stage roles."""

import pytest

from ppctl.data.dataset import SyntheticDataset
from tests.harness.pool import run_workers

SEED = 11
GLOBAL_BATCH_SIZE = 8
MICRO_BATCH_SIZE = 2
SEQ_LENGTH = 12
VOCAB_SIZE = 50
NUM_SAMPLES = 40
STEPS = (0, 1, 6)


class CountingDataset(SyntheticDataset):
    """Synthetic windows that count how often they are read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


class MaskedCountingDataset(CountingDataset):
    """Counting dataset whose loss mask drops labels below 10, so the mask is not all ones."""

    loss_mask_all_ones = False

    def loss_mask(self, window):
        return (window[1:] >= 10).float()


def _new_dataset(dataset_class=CountingDataset):
    return dataset_class(NUM_SAMPLES, SEQ_LENGTH, VOCAB_SIZE, SEED)


def _check_step(iterator, step, dp_rank, dp_size, needs_inputs, needs_labels, dataset_class, dp_group):
    """Compare the iterator's microbatches of ``step`` with the pure function's, field by field, and its global
    loss-token count (each DP rank's share added over ``dp_group``) with the pure function's."""
    from ppctl.data.dataset import global_loss_tokens, step_microbatches

    reference_dataset = _new_dataset(dataset_class)
    expected = step_microbatches(
        reference_dataset, SEED, step, GLOBAL_BATCH_SIZE, MICRO_BATCH_SIZE, dp_rank, dp_size,
    )
    received = iterator.microbatches(step)
    assert len(received) == len(expected) == GLOBAL_BATCH_SIZE // dp_size // MICRO_BATCH_SIZE
    wanted = {
        "tokens": needs_inputs, "position_ids": needs_inputs, "labels": needs_labels, "loss_mask": needs_labels,
    }
    for got, want in zip(received, expected):
        for field, is_needed in wanted.items():
            value = getattr(got, field)
            if not is_needed:
                assert value is None, f"step {step}: {field} should be None"
                continue
            reference = getattr(want, field)
            assert value.dtype == reference.dtype and value.shape == (MICRO_BATCH_SIZE, SEQ_LENGTH)
            assert value.equal(reference), f"step {step}: {field} differs from the pure function"
    if needs_labels:
        expected_tokens = global_loss_tokens(reference_dataset, SEED, step, GLOBAL_BATCH_SIZE)
        assert iterator.global_loss_tokens(step, received, dp_group) == expected_tokens


def _run_phase(
    tp_group, tp_ranks, rank, dp_rank, dp_size, needs_inputs, needs_labels, dataset_class=CountingDataset,
    dp_group=None,
):
    """Run every step of one role assignment; return how often this rank read its dataset."""
    from ppctl.data.iterator import PipelineDataIterator

    dataset = _new_dataset(dataset_class)
    iterator = PipelineDataIterator(
        dataset, SEED, GLOBAL_BATCH_SIZE, MICRO_BATCH_SIZE, SEQ_LENGTH, dp_rank, dp_size,
        tp_group=tp_group, tp_src_rank=tp_ranks[0], is_tp_src=rank == tp_ranks[0],
        fields=(("tokens", "position_ids") if needs_inputs else ()) + (("labels", "loss_mask") if needs_labels else ()),
    )
    for step in STEPS:
        _check_step(iterator, step, dp_rank, dp_size, needs_inputs, needs_labels, dataset_class, dp_group)
    return dataset.reads


def _worker(rank, world_size):
    """tp=2 groups [0,1] and [2,3]; check pp=2 roles, middle stages, and tp=2 x dp=2 single stage."""
    import torch.distributed as dist

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_ranks = [0, 1] if rank < 2 else [2, 3]
    tp_group = tp_groups[rank // 2]
    dp_group = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]  # the dp2 phases' DP groups
    is_first_stage = rank < 2
    return {
        "pp2": _run_phase(tp_group, tp_ranks, rank, 0, 1, is_first_stage, not is_first_stage),
        "middle": _run_phase(tp_group, tp_ranks, rank, 0, 1, False, False),
        "dp2": _run_phase(tp_group, tp_ranks, rank, rank // 2, 2, True, True, dp_group=dp_group),
        "dp2_masked": _run_phase(tp_group, tp_ranks, rank, rank // 2, 2, True, True, MaskedCountingDataset,
                                 dp_group),
    }


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_tp_source_reads_and_broadcasts_by_stage_role():
    reads = run_workers(_worker, 4, timeout=150)
    samples_per_phase = GLOBAL_BATCH_SIZE * len(STEPS)
    for source_rank, other_rank in ((0, 1), (2, 3)):
        assert reads[other_rank] == {"pp2": 0, "middle": 0, "dp2": 0, "dp2_masked": 0}
        assert reads[source_rank]["pp2"] == samples_per_phase
        assert reads[source_rank]["middle"] == 0
        assert reads[source_rank]["dp2"] == samples_per_phase // 2
        # the loss-token count of a masked batch adds each DP rank's share: no rank reads another's samples
        assert reads[source_rank]["dp2_masked"] == samples_per_phase // 2

