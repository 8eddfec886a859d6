"""Datasets of token windows, the deterministic sample order, and microbatches.

Everything here is pure (no ``torch.distributed``). A sample is a window of
``seq_length + 1`` tokens; a microbatch's inputs are the window without its last
token and its labels the window without its first. The samples of global batch
``step`` depend on (seed, step) alone, so every parallel layout that shares the
global batch size trains on the same data in the same order.

With documents kept apart (``data.documents=separate``) a window still holds whole documents or
pieces of them, and its microbatch also says which document each input token belongs to
(``segment_ids``: the number of end-of-document ids before it in its row); positions restart at
each document's first token, and the label of an end-of-document input (the next document's
first token) weighs zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ppctl.data.cache import SPLITS, PreparedCorpus
from ppctl.data.corpus import CorpusSpec
from ppctl.data.indexed import IndexedCorpus, check_document_ends
from ppctl.data.prepare import indexed_pairs, prepare_corpus, prepared_indexed
from ppctl.data.tokenizer import build_tokenizer
from ppctl.parallel.layout import LayoutError, context_parallel_slices

SYNTHETIC_NUM_SAMPLES = 1 << 16
SYNTHETIC_VALIDATION_SAMPLES = 1024


class WindowDataset(torch.utils.data.Dataset):
    """Base of ppctl's datasets: ``len(self)`` windows of ``seq_length + 1`` token ids.

    ``loss_mask(window)`` gives the per-label weights of one window: all ones, or,
    with ``eod_mask_loss`` (Megatron-LM's ``--eod-mask-loss``), zero where the label is
    the end-of-document id ``eod_id``. ``loss_mask_all_ones`` promises all ones, which
    lets callers count loss tokens without reading any sample. ``separate_documents``
    (``data.documents=separate``): the label of an end-of-document input weighs zero too (it is
    the next document's first token), and ``document_fields`` gives each input its document and
    its position in it.
    """

    seq_length: int
    eod_id: int
    eod_mask_loss: bool = False
    separate_documents: bool = False

    @property
    def loss_mask_all_ones(self) -> bool:
        """True when every label has weight one (no masking configured)."""
        return not (self.eod_mask_loss or self.separate_documents)

    def loss_mask(self, window: torch.Tensor) -> torch.Tensor:
        """Return the float32 loss weights of the ``seq_length`` labels of ``window``."""
        if self.loss_mask_all_ones:
            return torch.ones(self.seq_length, dtype=torch.float32)
        weights = torch.ones(self.seq_length, dtype=torch.bool)
        if self.eod_mask_loss:
            weights &= window[1:] != self.eod_id
        if self.separate_documents:  # never predict a document's first token from the previous document
            weights &= window[:-1] != self.eod_id
        return weights.to(torch.float32)

    def document_fields(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(position_ids, segment_ids)`` of input rows ``[rows, seq]``: ``0..seq-1`` and None when documents are
        joined; else positions restarting at each document and each token's document (``document_segment_ids``)."""
        if not self.separate_documents:
            return torch.arange(inputs.shape[-1], dtype=torch.int64).repeat(inputs.shape[0], 1), None
        segment_ids = document_segment_ids(inputs, self.eod_id)
        return document_position_ids(segment_ids), segment_ids

    def samples_document_fields(self, sample_ids: list[int],
                                inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``document_fields`` of the input rows of samples ``sample_ids`` (a blend asks each row's source)."""
        return self.document_fields(inputs)

    def sample_loss_mask(self, index: int, window: torch.Tensor) -> torch.Tensor:
        """The loss weights of sample ``index`` (``window``): ``loss_mask(window)`` unless the data stores its own
        weights per token (instruction data)."""
        return self.loss_mask(window)

    def batch_sample_ids(self, seed: int, step: int, global_batch_size: int) -> list[int]:
        """The sample ids of global batch ``step``, a function of (seed, step) alone (a blend has its own order)."""
        return global_batch_sample_ids(seed, step, global_batch_size, len(self))

    def _check_index(self, index: int) -> int:
        """Return ``index`` as an int, raising IndexError when it is out of range."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for a dataset of {len(self)} samples")
        return int(index)


class TokenWindowDataset(WindowDataset):
    """Non-overlapping windows of ``seq_length + 1`` tokens inside one split of a prepared token file."""

    def __init__(self, prepared: PreparedCorpus, seq_length: int, split: str = "train", eod_mask_loss: bool = False,
                 *, separate_documents: bool = False):
        if seq_length < 1:
            raise ValueError(f"seq_length must be at least 1, got {seq_length}")
        prepared.check_split(split, seq_length)
        self.location = prepared.location
        self.index = prepared.index
        self.split = split
        self.seq_length = seq_length
        self.eod_id = int(self.index["eod_id"])
        self.eod_mask_loss, self.separate_documents = eod_mask_loss, separate_documents
        start, end = prepared.split(split)
        self.tokens = prepared.tokens().view(start, end)  # the split, across shards, read memory-mapped
        self.num_windows = len(self.tokens) // (seq_length + 1)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return window ``index`` as an int64 tensor of ``seq_length + 1`` token ids."""
        start = self._check_index(index) * (self.seq_length + 1)
        window = np.array(self.tokens[start:start + self.seq_length + 1], dtype=np.int64)
        return torch.from_numpy(window)


class SyntheticDataset(WindowDataset):
    """Uniformly random token windows; sample ``i`` is drawn from a generator seeded by (seed, i).

    The last id, ``vocab_size - 1``, stands for the end of a document (as the byte
    tokenizer's 256 does in its 257 ids), so ``eod_mask_loss`` masks about one label in
    ``vocab_size`` and ``separate_documents`` ends a document at about one token in ``vocab_size``.
    ``stream`` picks another random stream: stream s > 0 seeds sample ``i`` by (seed, i, s) (the
    validation split is stream 1).
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, eod_mask_loss: bool = False,
                 stream: int = 0, *, separate_documents: bool = False):
        if num_samples < 1 or seq_length < 1 or vocab_size < 1 or seed < 0 or stream < 0:
            raise ValueError(
                "synthetic dataset needs num_samples, seq_length, vocab_size >= 1 and seed, stream >= 0, got "
                f"num_samples={num_samples}, seq_length={seq_length}, vocab_size={vocab_size}, seed={seed}, "
                f"stream={stream}"
            )
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.stream = stream
        self.eod_id = vocab_size - 1
        self.eod_mask_loss, self.separate_documents = eod_mask_loss, separate_documents

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return the random window ``index``: the same ids for the same (seed, index, stream)."""
        entropy = [self.seed, self._check_index(index)] + ([self.stream] if self.stream else [])
        window = np.random.default_rng(entropy).integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
        return torch.from_numpy(window)


def build_dataset(
    corpus: CorpusSpec, seq_length: int, vocab_size: int, seed: int, split: str = "train",
    eod_mask_loss: bool = False, separate_documents: bool = False,
) -> TokenWindowDataset | SyntheticDataset:
    """Return split ``split`` (``train`` or ``validation``) of the dataset ``corpus`` describes.

    ``corpus.source == "synthetic"``: random windows, the train split ``SYNTHETIC_NUM_SAMPLES``
    of stream 0, the validation split ``SYNTHETIC_VALIDATION_SAMPLES`` of stream 1. Token-file
    sources are prepared (or reused) under ``corpus.cache_dir`` (``indexed``: read as they are); the model's
    ``vocab_size`` must cover the tokenizer. ``seed`` only shapes synthetic data; the sample order takes
    its own seed. ``eod_mask_loss`` gives end-of-document labels zero loss weight;
    ``separate_documents`` keeps documents apart (``WindowDataset``).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    if corpus.source == "synthetic":
        if split == "train":
            return SyntheticDataset(SYNTHETIC_NUM_SAMPLES, seq_length, vocab_size, seed, eod_mask_loss,
                                    separate_documents=separate_documents)
        return SyntheticDataset(SYNTHETIC_VALIDATION_SAMPLES, seq_length, vocab_size, seed, eod_mask_loss, stream=1,
                                separate_documents=separate_documents)
    check_vocab_size(corpus, vocab_size)
    if corpus.source == "indexed":  # Megatron-LM indexed datasets, read as they are (each pair read once)
        pairs = indexed_pairs(corpus)
        check_indexed_document_ends(corpus, pairs, eod_mask_loss, separate_documents)
        prepared = prepared_indexed(corpus, pairs)
    else:
        prepared = prepare_corpus(corpus)
    return TokenWindowDataset(prepared, seq_length, split, eod_mask_loss, separate_documents=separate_documents)


def check_indexed_document_ends(corpus: CorpusSpec, pairs: list[IndexedCorpus], eod_mask_loss: bool,
                                separate_documents: bool) -> None:
    """``data.source=indexed`` with ``data.documents=separate`` or ``data.eod_mask_loss``: ``DataError`` (one line
    naming the first pair at fault) unless each document of every pair of ``pairs`` ends with ``data.tokenizer``'s
    end-of-document id (joined documents need none)."""
    if not (separate_documents or eod_mask_loss):
        return
    why = "data.documents=separate" if separate_documents else "data.eod_mask_loss=true"
    tokenizer = build_tokenizer(corpus.tokenizer)
    for pair in pairs:
        check_document_ends(pair, tokenizer.eod_id, f"{why} (data.tokenizer={corpus.tokenizer}'s end of document)")


def check_vocab_size(corpus: CorpusSpec, vocab_size: int) -> None:
    """``ValueError`` when the model's ``vocab_size`` does not cover ``corpus``'s tokenizer."""
    tokenizer = build_tokenizer(corpus.tokenizer)
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model vocab_size={vocab_size} is smaller than the {tokenizer.name!r} tokenizer's "
            f"{tokenizer.vocab_size} ids; set vocab_size >= {tokenizer.vocab_size}"
        )


def global_batch_sample_ids(seed: int, step: int, global_batch_size: int, num_samples: int) -> list[int]:
    """Return the sample ids of global batch ``step``, a function of (seed, step) alone.

    The sample stream is epoch after epoch, each epoch a permutation of all
    ``num_samples`` samples seeded by (seed, epoch); batch ``step`` is positions
    ``[step*gbs, (step+1)*gbs)`` of that stream, so a batch may straddle epochs.
    """
    if seed < 0 or step < 0 or global_batch_size < 1 or num_samples < 1:
        raise ValueError(
            "sample order needs seed >= 0, step >= 0, global_batch_size >= 1 and num_samples >= 1, got "
            f"seed={seed}, step={step}, global_batch_size={global_batch_size}, num_samples={num_samples}"
        )
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size, dtype=np.int64)
    epochs = positions // num_samples
    sample_ids = np.empty(global_batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        sample_ids[in_epoch] = epoch_permutation(seed, int(epoch), num_samples)[positions[in_epoch] % num_samples]
    return sample_ids.tolist()


@functools.lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The order of the samples in ``epoch`` (read-only), drawn once: a training step takes a few ids
    of it, and permuting every id again per step cost 0.7 ms of a 40 ms step at gpt_tiny."""
    permutation = np.random.default_rng([seed, epoch]).permutation(num_samples)
    permutation.flags.writeable = False
    return permutation


@dataclass
class Microbatch:
    """One microbatch; a field is None on a rank that does not need it."""

    tokens: torch.Tensor | None  # [mbs, seq] int64: window[:-1], the model's inputs
    position_ids: torch.Tensor | None  # [mbs, seq] int64: 0..seq-1 (documents kept apart: from 0 in each)
    labels: torch.Tensor | None  # [mbs, seq] int64: window[1:], the next tokens
    loss_mask: torch.Tensor | None  # [mbs, seq] float32: weight of each label in the loss
    segment_ids: torch.Tensor | None = None  # [mbs, seq] int64: each input's document in its row; None: joined


def document_segment_ids(inputs: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Each input token's document within its row (``[..., seq]``): how many end-of-document ids precede it.

    The end-of-document token belongs to the document it ends; a row that begins inside a
    document calls that piece document 0.
    """
    ends = (inputs == eod_id).to(torch.int64)
    return ends.cumsum(-1) - ends


def document_position_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at the first token of each segment of ``segment_ids [..., seq]``."""
    index = torch.arange(segment_ids.shape[-1], dtype=torch.int64, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def microbatches_per_dp_rank(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Return how many microbatches each DP rank runs per step, checking that the sizes divide."""
    if global_batch_size < 1 or micro_batch_size < 1 or dp_size < 1:
        raise ValueError(
            f"global_batch_size, micro_batch_size and dp_size must be >= 1, got "
            f"{global_batch_size}, {micro_batch_size}, {dp_size}"
        )
    if global_batch_size % (micro_batch_size * dp_size) != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a multiple of micro_batch_size*dp_size="
            f"{micro_batch_size}*{dp_size}={micro_batch_size * dp_size}"
        )
    return global_batch_size // (micro_batch_size * dp_size)


def step_microbatches(
    dataset: WindowDataset, seed: int, step: int, global_batch_size: int, micro_batch_size: int,
    dp_rank: int, dp_size: int,
) -> list[Microbatch]:
    """Return DP rank ``dp_rank``'s microbatches of global batch ``step``, in order.

    DP rank d takes the contiguous slice ``[d*gbs/dp, (d+1)*gbs/dp)`` of the
    global batch and cuts it into microbatches of ``micro_batch_size`` samples.
    """
    num_microbatches = microbatches_per_dp_rank(global_batch_size, micro_batch_size, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
    samples_per_rank = global_batch_size // dp_size
    sample_ids = dataset.batch_sample_ids(seed, step, global_batch_size)
    rank_sample_ids = sample_ids[dp_rank * samples_per_rank:(dp_rank + 1) * samples_per_rank]
    return [
        build_microbatch(dataset, rank_sample_ids[index * micro_batch_size:(index + 1) * micro_batch_size])
        for index in range(num_microbatches)
    ]


def build_microbatch(dataset: WindowDataset, sample_ids: list[int]) -> Microbatch:
    """Return the microbatch made of ``dataset``'s windows ``sample_ids``, with every field (``segment_ids`` None
    when documents are joined)."""
    windows = torch.stack([dataset[sample_id] for sample_id in sample_ids])
    tokens = windows[:, :-1].contiguous()
    position_ids, segment_ids = dataset.samples_document_fields(sample_ids, tokens)
    return Microbatch(
        tokens=tokens,
        position_ids=position_ids,
        labels=windows[:, 1:].contiguous(),
        loss_mask=torch.stack([dataset.sample_loss_mask(sample_id, window)
                               for sample_id, window in zip(sample_ids, windows)]),
        segment_ids=segment_ids,
    )


def global_loss_tokens(dataset: WindowDataset, seed: int, step: int, global_batch_size: int) -> float:
    """Return the sum of the loss masks over all of global batch ``step`` (every DP rank's share).

    Reads no sample when the dataset's masks are all ones: then it is gbs*seq.
    """
    if dataset.loss_mask_all_ones:
        return float(global_batch_size * dataset.seq_length)
    sample_ids = dataset.batch_sample_ids(seed, step, global_batch_size)
    return float(sum(dataset.sample_loss_mask(sample_id, dataset[sample_id]).double().sum().item()
                     for sample_id in sample_ids))


def slice_for_context_parallel(tensor: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Return CP rank ``cp_rank``'s part of a ``[mbs, seq]`` tensor.

    The sequence is cut into ``2*cp_size`` equal chunks; the rank keeps chunks
    ``cp_rank`` and ``2*cp_size-1-cp_rank`` (in that order, see
    ``ppctl.parallel.layout.context_parallel_slices``), which balances
    causal-attention work across CP ranks. Identity for ``cp_size == 1``.
    """
    if cp_size == 1 and cp_rank == 0:
        return tensor
    try:
        pieces = context_parallel_slices(tensor.shape[1], cp_rank, cp_size)
    except LayoutError as error:
        raise ValueError(str(error)) from None
    return torch.cat([tensor[:, piece.start:piece.stop] for piece in pieces], dim=1)
