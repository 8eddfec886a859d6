"""Which backend the multi-process tests run on: ``PPCTL_TEST_BACKEND`` (``gloo``, the default, or ``nccl``).

Under ``nccl`` every pool worker takes the GPU of its rank (``cuda:RANK``, one GPU per rank,
as ``launcher.backend=nccl`` gives one per worker), the equivalence cases train on it, and a
case whose world needs more GPUs than the machine has is skipped, named. Only the tests marked
``nccl`` (the equivalence suite: ppctl's trainer against the single process on the CPU) run under
it; the rest exercise gloo-specific or CPU-only paths (CPU tensors on raw collectives, host memory
accounting, gloo timeouts) and skip. ``make gpu-check`` runs it.

Pure: no torch import here (``gpu_count`` imports it when asked).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

BACKENDS = ("gloo", "nccl")
VARIABLE = "PPCTL_TEST_BACKEND"


def chosen_backend(environ: Mapping[str, str] = os.environ) -> str:
    """The backend the multi-process tests run on; ``ValueError`` naming the variable for an unknown one."""
    backend = environ.get(VARIABLE, "gloo").strip().lower() or "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"{VARIABLE}={backend!r}: must be one of {', '.join(BACKENDS)}")
    return backend


def rank_device(backend: str, rank: int) -> str:
    """The device a pool worker of ``rank`` computes on: its own GPU under NCCL, else the CPU."""
    return f"cuda:{rank}" if backend == "nccl" else "cpu"


def missing_gpus(backend: str, world_size: int, gpus: int) -> str | None:
    """Why a world of ``world_size`` workers cannot run here (one GPU per rank under NCCL), or None."""
    if backend == "nccl" and world_size > gpus:
        return f"{VARIABLE}=nccl: a world of {world_size} ranks needs {world_size} GPUs, this machine has {gpus}"
    return None


def gpu_count() -> int:
    """The CUDA devices torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gloo_only_reason(backend: str) -> str | None:
    """Why a test not marked ``nccl`` skips under ``backend``, or None where it runs."""
    if backend == "nccl":
        return (f"{VARIABLE}=nccl runs only the tests marked nccl (the equivalence suite); "
                "this one exercises a gloo or CPU-only path")
    return None
