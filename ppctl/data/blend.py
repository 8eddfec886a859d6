"""Blends: several prepared sources drawn in fixed proportions (``data.blend``), as Megatron-Core's BlendedDataset.

The training stream is a sequence of positions; global batch ``step`` holds positions
``[step*gbs, (step+1)*gbs)`` (DP rank d takes its contiguous slice, as for one source). Each
position goes to the source most behind its target share, Megatron-Core's
``build_blending_indices``: with the weights normalised to sum to 1 and ``c_s`` the positions
given to source s before position p, p goes to the first s that maximises
``w_s * max(p, 1) - c_s``, and is that source's draw number ``c_s``. Draw k of source s is its
sample ``permutation(seed, s, k // n_s)[k % n_s]`` (n_s its samples): every epoch of a source
is a fresh permutation of all its samples, as one source is drawn
(``ppctl.data.dataset.global_batch_sample_ids``), each source with its own.

All of it is a function of (seed, position): a run resumed at step k draws what the uninterrupted
run drew there, and every layout that shares the global batch size draws the same samples. The
greedy rule is sequential, so the counts at block boundaries are remembered per dataset (a run
resumed late computes them once, about a microsecond per position): a cache of a pure function,
not state.

The rule's bound (``deficit_bound``): after any n >= 1 positions each source's count c_s(n) lies
strictly within (w_s*n - (S-1), w_s*n + 1) for S sources, so the samples of any stretch of the stream,
a global batch included, are within S of its weight's share.

A sample is its source's own: its tokens, its loss weights (``sample_loss_mask``: an instruction source's
stored weights) and, with documents kept apart, its segment ids and restarting positions
(``samples_document_fields``) are what the source dataset alone gives for that window.
"""

from __future__ import annotations

import numpy as np
import torch

from ppctl.data.cache import PreparedCorpus
from ppctl.data.corpus import INSTRUCTION_SOURCES, BlendSpec, CorpusSpec, DataError
from ppctl.data.dataset import WindowDataset, build_dataset
from ppctl.data.instruction_dataset import build_instruction_dataset, split_documents

BLOCK_POSITIONS = 1 << 16  # positions per block of the blend order; counts are remembered at block boundaries
BLOCKS_KEPT = 2  # assigned blocks kept: a global batch may straddle two


def normalised_weights(weights) -> tuple[float, ...]:
    """The weights divided by their sum in float64, as Megatron-Core normalises them (bit for bit)."""
    array = np.asarray(weights, dtype=np.float64)
    return tuple((array / np.sum(array)).tolist())


def deficit_bound(num_sources: int) -> tuple[float, float]:
    """``(low, high)``: after n >= 1 positions, ``low < w_s*n - c_s(n) < high`` for every source s.

    Why: at a position p >= 1 the deficits ``w_s*p - c_s`` sum to p - p = 0, so the source chosen (the
    largest) has a deficit >= 0, and one position later its deficit is that + w_s - 1 > -1; the others'
    deficits only grow. After position 0 each deficit is w_s or w_s - 1, above -1. Deficits above -1
    that sum to 0 are each below S - 1.
    """
    return -1.0, float(num_sources - 1)


def assign_positions(weights: tuple[float, ...], counts: tuple[int, ...], start: int,
                     length: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The greedy rule over positions ``[start, start+length)``, given each source's ``counts`` before ``start``.

    Returns each position's source, its draw number in that source, and the counts after the last.
    The arithmetic is Megatron-Core's (float64 ``w_s * max(p, 1) - c_s``; a tie goes to the first source).
    """
    counts = list(counts)
    sources, draws = [0] * length, [0] * length
    num_sources = len(weights)
    for offset in range(length):
        time = float(max(start + offset, 1))
        best, best_deficit = 0, weights[0] * time - counts[0]
        for source in range(1, num_sources):
            deficit = weights[source] * time - counts[source]
            if deficit > best_deficit:
                best, best_deficit = source, deficit
        sources[offset], draws[offset] = best, counts[best]
        counts[best] += 1
    return np.array(sources, dtype=np.int64), np.array(draws, dtype=np.int64), tuple(counts)


class BlendOrder:
    """Which source each position of the stream goes to, and which draw of it: ``assign_positions`` from 0,
    computed block by block with the counts at block boundaries remembered (any position costs at most one
    block once the blocks before it were passed)."""

    def __init__(self, weights):
        self.weights = normalised_weights(weights)
        self._counts_at_block = {0: (0,) * len(self.weights)}  # counts before each block's first position
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def positions(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The sources and draw numbers of positions ``[start, stop)``."""
        if not 0 <= start < stop:
            raise ValueError(f"positions need 0 <= start < stop, got [{start}, {stop})")
        first, last = start // BLOCK_POSITIONS, (stop - 1) // BLOCK_POSITIONS
        blocks = [self._block(block) for block in range(first, last + 1)]
        offset = start - first * BLOCK_POSITIONS
        sources = np.concatenate([block[0] for block in blocks])[offset:offset + stop - start]
        draws = np.concatenate([block[1] for block in blocks])[offset:offset + stop - start]
        return sources, draws

    def counts(self, num_positions: int) -> tuple[int, ...]:
        """How many of the first ``num_positions`` positions go to each source."""
        block, offset = divmod(num_positions, BLOCK_POSITIONS)
        before = self._counts_before(block)
        if offset == 0:
            return before
        in_block = np.bincount(self._block(block)[0][:offset], minlength=len(self.weights))
        return tuple(count + int(extra) for count, extra in zip(before, in_block))

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The sources and draws of block ``block``'s positions (kept for the next call)."""
        if block not in self._blocks:
            sources, draws, after = assign_positions(self.weights, self._counts_before(block),
                                                     block * BLOCK_POSITIONS, BLOCK_POSITIONS)
            self._counts_at_block[block + 1] = after
            if len(self._blocks) >= BLOCKS_KEPT:
                self._blocks.pop(min(self._blocks))
            self._blocks[block] = (sources, draws)
        return self._blocks[block]

    def _counts_before(self, block: int) -> tuple[int, ...]:
        """Each source's count before block ``block``, passing the blocks after the last one remembered."""
        known = max(index for index in self._counts_at_block if index <= block)
        counts = self._counts_at_block[known]
        for index in range(known, block):
            counts = assign_positions(self.weights, counts, index * BLOCK_POSITIONS, BLOCK_POSITIONS)[2]
            self._counts_at_block[index + 1] = counts
        return counts


class BlendedDataset(WindowDataset):
    """The windows of several datasets as one, drawn in the weights' proportions (see the module docstring).

    Sample id ``offsets[s] + i`` is window i of source s, so ``dataset[id]`` reads like any
    dataset's; ``batch_sample_ids`` gives the blend's order. The sources share the window
    length, the end-of-document id, ``eod_mask_loss`` and ``separate_documents`` (one tokenizer, one
    ``data`` section); each sample's loss weights and document fields are its source's own.
    """

    def __init__(self, datasets: list[WindowDataset], weights):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"a blend needs one weight per dataset, got {len(datasets)} datasets and "
                             f"{len(weights)} weights")
        first = datasets[0]
        shared = ("seq_length", "eod_id", "eod_mask_loss", "separate_documents")
        for dataset in datasets[1:]:
            if any(getattr(dataset, name) != getattr(first, name) for name in shared):
                raise ValueError(f"the datasets of a blend must share {', '.join(shared)}")
        self.datasets = list(datasets)
        self.seq_length, self.eod_id, self.eod_mask_loss = first.seq_length, first.eod_id, first.eod_mask_loss
        self.separate_documents = first.separate_documents
        self.order = BlendOrder(weights)
        self.offsets = np.cumsum([0] + [len(dataset) for dataset in datasets])
        self._permutations: dict[tuple[int, int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        """Window ``index`` of the concatenated sources."""
        source, local = self.locate(index)
        return self.datasets[source][local]

    @property
    def loss_mask_all_ones(self) -> bool:
        """True when every source's labels all weigh one."""
        return all(dataset.loss_mask_all_ones for dataset in self.datasets)

    def sample_loss_mask(self, index: int, window: torch.Tensor) -> torch.Tensor:
        """Sample ``index``'s loss weights as its source gives them (an instruction source's stored weights)."""
        source, local = self.locate(index)
        return self.datasets[source].sample_loss_mask(local, window)

    def samples_document_fields(self, sample_ids: list[int],
                                inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(position_ids, segment_ids)`` of the rows of ``sample_ids``: each row's from its own source."""
        located = [self.locate(sample_id) for sample_id in sample_ids]
        position_ids, segment_ids = torch.empty_like(inputs), None
        for source in sorted({source for source, _ in located}):
            rows = [row for row, (owner, _) in enumerate(located) if owner == source]
            positions, segments = self.datasets[source].samples_document_fields(
                [located[row][1] for row in rows], inputs[rows])
            position_ids[rows] = positions
            if segments is not None:  # every source keeps documents apart or none does (checked when built)
                segment_ids = torch.zeros_like(inputs) if segment_ids is None else segment_ids
                segment_ids[rows] = segments
        return position_ids, segment_ids

    def source_of(self, sample_id: int) -> int:
        """The source a sample id belongs to."""
        return int(np.searchsorted(self.offsets, sample_id, side="right")) - 1

    def locate(self, sample_id: int) -> tuple[int, int]:
        """``(source, index in that source)`` of a sample id of the blend."""
        source = self.source_of(self._check_index(sample_id))
        return source, int(sample_id) - int(self.offsets[source])

    def batch_sample_ids(self, seed: int, step: int, global_batch_size: int) -> list[int]:
        """The sample ids of global batch ``step``: positions ``[step*gbs, (step+1)*gbs)`` of the blend's order."""
        if seed < 0 or step < 0 or global_batch_size < 1:
            raise ValueError(f"sample order needs seed >= 0, step >= 0 and global_batch_size >= 1, got seed={seed}, "
                             f"step={step}, global_batch_size={global_batch_size}")
        sources, draws = self.order.positions(step * global_batch_size, (step + 1) * global_batch_size)
        sample_ids = np.empty(global_batch_size, dtype=np.int64)
        for source in np.unique(sources):
            chosen = sources == source
            sample_ids[chosen] = self.offsets[source] + self._source_sample_ids(seed, int(source), draws[chosen])
        return sample_ids.tolist()

    def _source_sample_ids(self, seed: int, source: int, draws: np.ndarray) -> np.ndarray:
        """Source ``source``'s samples of its draws ``draws``: each epoch of it a permutation of its own."""
        num_samples = len(self.datasets[source])
        epochs = draws // num_samples
        sample_ids = np.empty_like(draws)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            sample_ids[in_epoch] = self._permutation(seed, source, int(epoch))[draws[in_epoch] % num_samples]
        return sample_ids

    def _permutation(self, seed: int, source: int, epoch: int) -> np.ndarray:
        """The order of source ``source``'s samples in its epoch ``epoch`` (the two latest of each source kept)."""
        key = (seed, source, epoch)
        if key not in self._permutations:
            stale = [known for known in self._permutations if known[:2] == key[:2] and known[2] < epoch - 1]
            for known in stale:
                del self._permutations[known]
            self._permutations[key] = np.random.default_rng([seed, source, epoch]).permutation(
                len(self.datasets[source]))
        return self._permutations[key]


def build_blended_dataset(blend: BlendSpec, seq_length: int, vocab_size: int, seed: int, split: str = "train",
                          eod_mask_loss: bool = False, *, separate_documents: bool = False) -> BlendedDataset:
    """Split ``split`` of each source of ``blend`` (each prepared or reused in the cache as one source is), blended.

    Each source's dataset is the one it would be alone (``source_dataset``). A source that cannot be prepared,
    or whose split holds no window, fails as ``DataError`` naming it.
    """
    datasets = []
    for index, spec in enumerate(blend.specs):
        try:
            datasets.append(source_dataset(spec, seq_length, vocab_size, seed, split, eod_mask_loss,
                                           separate_documents))
        except DataError as error:
            raise DataError(f"data.blend[{index}]: {error}") from None
    return BlendedDataset(datasets, blend.weights)


def source_dataset(spec: CorpusSpec, seq_length: int, vocab_size: int, seed: int, split: str, eod_mask_loss: bool,
                   separate_documents: bool) -> WindowDataset:
    """Split ``split`` of one source of a blend, as that source alone reads it: instruction data (``data=chat``,
    ``data=prompt_completion``) with its stored loss weights and ``data.packing``, text as token windows."""
    if spec.source in INSTRUCTION_SOURCES:
        return build_instruction_dataset(spec, seq_length, vocab_size, split, eod_mask_loss,
                                         separate_documents=separate_documents)
    return build_dataset(spec, seq_length, vocab_size, seed, split, eod_mask_loss,
                         separate_documents=separate_documents)


def train_windows(spec: CorpusSpec, corpus: PreparedCorpus, seq_length: int) -> int:
    """How many samples the train split of one prepared source holds: packed instruction documents (each cut to a
    window) or token windows, or one per document when instruction data is padded (``data.packing=padded``)."""
    if spec.source not in INSTRUCTION_SOURCES:
        start, end = corpus.split("train")
        return (end - start) // (seq_length + 1)
    _, lengths = split_documents(corpus, "train", seq_length)
    return len(lengths) if spec.packing == "padded" else int(lengths.sum()) // (seq_length + 1)


def blend_lines(blend: BlendSpec, prepared: list[PreparedCorpus], seq_length: int, max_steps: int,
                global_batch_size: int) -> list[str]:
    """One line per source of ``blend`` (``prepared``: each one's ``PreparedCorpus``, in order): its tokens, its
    weight and share, and how many epochs of its train windows the ``max_steps * global_batch_size`` samples of a
    run draw (the blend order's exact counts)."""
    num_samples = max_steps * global_batch_size
    draws = BlendOrder(blend.weights).counts(num_samples)
    shares = normalised_weights(blend.weights)
    lines = []
    for index, corpus in enumerate(prepared):
        windows = train_windows(blend.specs[index], corpus, seq_length)
        lines.append(f"{blend.label(index)}: {corpus.index['num_tokens']:,} tokens, weight {blend.weights[index]:g} "
                     f"({shares[index]:.1%} of the samples), {draws[index] / windows:.2f} epochs in trainer.max_steps="
                     f"{max_steps} ({draws[index]:,} samples from its {windows:,} train windows); {corpus.location}")
    return lines
