"""Activation checkpointing for ``model.recompute`` (which layers: ``ppctl.model.recompute``)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


def recomputed(function: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``function(*args)`` keeping only ``args`` for the backward, which runs ``function`` again first.

    Without re-entry, the backward graph is the first forward's, so a split backward
    recomputes once, in B; no RNG state is kept, as the layers draw no random numbers.
    """
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)
