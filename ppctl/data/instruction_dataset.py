"""Windows of instruction data (``data=chat``, ``data=prompt_completion``) with their stored loss weights.

Each row of the corpus is one document (its tokens end with the end-of-document id). A document
longer than a window of ``seq_length + 1`` tokens is cut to its first ``seq_length`` tokens and the
end-of-document id (weight 0) with ``data.too_long=truncate``, or refused naming its file and row
with ``refuse``. ``data.packing=packed`` cuts non-overlapping windows from the documents one after
the other (a window may begin inside one); ``padded`` makes each document one sample, padded with
the end-of-document id at weight 0. The loss weight of label ``t`` is the stored weight of token
``t + 1``: a label is trained on exactly when the token it predicts is the assistant's (or the
completion's). ``window_segment_ids`` gives each token's document within its window (padding is a
document of its own), for attention that stays inside documents.
"""

from __future__ import annotations

import numpy as np
import torch

from ppctl.data.cache import PreparedCorpus, document_starts
from ppctl.data.corpus import CorpusSpec, DataError
from ppctl.data.dataset import WindowDataset, check_vocab_size
from ppctl.data.prepare import prepare_corpus

PACKINGS = ("packed", "padded")


class InstructionWindowDataset(WindowDataset):
    """Split ``split`` of a prepared instruction corpus as windows of ``seq_length + 1`` tokens (see the module).

    ``separate_documents`` (``data.documents=separate``) reads each row's end from the end-of-document ids, as
    every window dataset does: a corpus whose rows hold that id inside (a template that writes the end-of-text
    token between turns) is refused then.
    """

    def __init__(self, prepared: PreparedCorpus, seq_length: int, split: str = "train", packing: str = "packed",
                 eod_mask_loss: bool = False, *, separate_documents: bool = False):
        if packing not in PACKINGS:
            raise ValueError(f"data.packing={packing!r} must be one of {', '.join(PACKINGS)}")
        inner = prepared.index.get("rows_with_inner_eod", 0)
        if separate_documents and inner:
            raise DataError(f"{prepared.label}: {inner:,} row(s) hold the end-of-document id "
                            f"{prepared.index['eod_id']} before their end (the template writes it between turns): "
                            f"with data.documents=separate each would be cut into several documents; use "
                            f"data.packing=padded with data.documents=joined")
        self.separate_documents = separate_documents
        if packing == "packed":
            prepared.check_split(split, seq_length)
        prepared.check_lengths(seq_length)
        self.seq_length, self.packing, self.eod_mask_loss = seq_length, packing, eod_mask_loss
        self.eod_id = int(prepared.index["eod_id"])
        self.tokens = np.memmap(prepared.location, dtype=np.dtype(prepared.index["dtype"]), mode="r")
        self.weights = prepared.loss_weights()
        self.starts, self.lengths = split_documents(prepared, split, seq_length)
        self.piece_ends = np.cumsum(self.lengths)  # where each (cut) document ends in the split's packed stream
        if not len(self):
            raise DataError(f"{prepared.label}: the {split} split holds no {packing} sample of trainer.seq_length+1="
                            f"{seq_length + 1} tokens")

    @property
    def loss_mask_all_ones(self) -> bool:
        """Never: the weights come from the data."""
        return False

    def __len__(self) -> int:
        if self.packing == "padded":
            return len(self.starts)
        return int(self.piece_ends[-1]) // (self.seq_length + 1) if len(self.piece_ends) else 0

    def __getitem__(self, index: int) -> torch.Tensor:
        """Window ``index``'s ``seq_length + 1`` token ids (int64)."""
        return torch.from_numpy(self.window(self._check_index(index))[0])

    def sample_loss_mask(self, index: int, window: torch.Tensor) -> torch.Tensor:
        """The float32 loss weights of window ``index``'s ``seq_length`` labels: the stored weight of each label's
        token, times what every window dataset masks (``loss_mask``: ``eod_mask_loss`` and the like)."""
        return torch.from_numpy(self.window(index)[1][1:].astype(np.float32)) * self.loss_mask(window)

    def window_segment_ids(self, index: int) -> torch.Tensor:
        """For each of window ``index``'s ``seq_length + 1`` tokens, its document's index within the window."""
        return torch.from_numpy(self.window(index)[2])

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Window ``index``'s ids, weights (uint8) and segment ids (int64)."""
        if self.packing == "padded":
            return self._padded(index)
        return self._packed(index * (self.seq_length + 1))

    def _piece(self, document: int) -> tuple[np.ndarray, np.ndarray]:
        """Document ``document`` of the split as kept: whole, or cut to ``seq_length`` tokens and the end of it."""
        start, length = int(self.starts[document]), int(self.lengths[document])
        ids = np.array(self.tokens[start:start + length], dtype=np.int64)
        weights = np.array(self.weights[start:start + length], dtype=np.uint8)
        if ids[-1] != self.eod_id:  # cut: the end of the document stays, so boundaries read from it hold
            ids[-1], weights[-1] = self.eod_id, 0
        return ids, weights

    def _padded(self, document: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One document padded to the window with the end-of-document id (weight 0, a segment of its own)."""
        ids, weights = self._piece(document)
        padding = self.seq_length + 1 - len(ids)
        segments = np.concatenate([np.zeros(len(ids), dtype=np.int64), np.ones(padding, dtype=np.int64)])
        return (np.concatenate([ids, np.full(padding, self.eod_id, dtype=np.int64)]),
                np.concatenate([weights, np.zeros(padding, dtype=np.uint8)]), segments)

    def _packed(self, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ``seq_length + 1`` tokens from ``offset`` of the split's packed stream of (cut) documents."""
        window_length = self.seq_length + 1
        first = int(np.searchsorted(self.piece_ends, offset, side="right"))
        last = int(np.searchsorted(self.piece_ends, offset + window_length - 1, side="right"))
        pieces = [self._piece(document) for document in range(first, last + 1)]
        piece_start = int(self.piece_ends[first] - self.lengths[first])
        skip = offset - piece_start
        ids = np.concatenate([piece[0] for piece in pieces])[skip:skip + window_length]
        weights = np.concatenate([piece[1] for piece in pieces])[skip:skip + window_length]
        segments = np.concatenate([np.full(len(piece[0]), number, dtype=np.int64)
                                   for number, piece in enumerate(pieces)])[skip:skip + window_length]
        return ids, weights, segments


def build_instruction_dataset(corpus: CorpusSpec, seq_length: int, vocab_size: int, split: str = "train",
                              eod_mask_loss: bool = False, *, separate_documents: bool = False
                              ) -> InstructionWindowDataset:
    """Split ``split`` of ``data=chat`` or ``data=prompt_completion`` (prepared or reused), packed or padded as
    ``corpus.packing`` says; the model's ``vocab_size`` must cover the tokenizer."""
    check_vocab_size(corpus, vocab_size)
    return InstructionWindowDataset(prepare_corpus(corpus), seq_length, split, corpus.packing, eod_mask_loss,
                                    separate_documents=separate_documents)


def split_documents(prepared: PreparedCorpus, split: str, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The start of each document inside split ``split`` and its kept length (at most ``seq_length + 1``)."""
    table = prepared.document_table()
    starts, ends = document_starts(table), table[:, 0]
    split_start, split_end = prepared.split(split)
    inside = (starts >= split_start) & (ends <= split_end)
    return starts[inside], np.minimum(ends[inside] - starts[inside], seq_length + 1)
