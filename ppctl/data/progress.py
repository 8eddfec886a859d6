"""How a preparation says where it is: a progress bar on a terminal, one line per shard otherwise, or nothing.

The bar counts input bytes (its rate and ETA) with the tokens per second beside it; a line says a shard's
documents, tokens, input and rate, and how many shards are done. Both go to stderr.
"""

from __future__ import annotations

import sys
import time

from ppctl.data.shards import Shard

MIB = 1 << 20


class ShardProgress:
    """``mode``: ``bar`` (tqdm), ``lines`` (one per shard of ``shards``, those to do, when the corpus has more than
    one: ``corpus_shards``) or None (silent)."""

    def __init__(self, mode: str | None, shards: list[Shard], label: str, corpus_shards: int):
        self.mode, self.total_shards, self.label = mode, len(shards), label
        # a resumed preparation's last shard still says so: one line per shard is about the corpus, not what is left
        self.lines = mode == "lines" and corpus_shards > 1
        self.started = self.shard_started = time.monotonic()
        self.tokens, self.done = 0, 0
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=sum(shard.input_bytes for shard in shards), unit="B", unit_scale=True,
                            unit_divisor=1024, desc=f"tokenising {len(shards)} shard(s)", file=sys.stderr,
                            dynamic_ncols=True)

    def advance(self, input_bytes: int, tokens: int) -> None:
        """A block was tokenised: ``input_bytes`` read, ``tokens`` written."""
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(input_bytes)
            self.bar.set_postfix_str(f"{self.tokens / max(time.monotonic() - self.started, 1e-9):,.0f} tokens/s",
                                     refresh=False)

    def shard_done(self, shard: Shard, record: dict) -> None:
        """Shard ``shard`` is complete (``record``: its counts)."""
        self.done += 1
        if not self.lines:
            return
        now = time.monotonic()
        elapsed, rate = now - self.started, self.tokens / max(now - self.started, 1e-9)
        left = elapsed / self.done * (self.total_shards - self.done)
        sys.stderr.write(f"{shard.name}: {record['num_documents']:,} documents, {record['num_tokens']:,} tokens from "
                         f"{shard.input_bytes / MIB:,.1f} MiB; {self.done} of {self.total_shards} shard(s) done, "
                         f"{rate:,.0f} tokens/s, ETA {_clock(left)}\n")
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar (if any)."""
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    """``h:mm:ss``."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
