"""Files written whole or not at all, and their digests: shared by the data cache and checkpoints. Pure."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomically(final_path: Path, write: Callable) -> None:
    """Call ``write(file)`` on a temporary file next to ``final_path``, flush it to disk, rename it into place."""
    descriptor, temp_name = tempfile.mkstemp(dir=final_path.parent, prefix=f".{final_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as temp_file:
            write(temp_file)
            temp_file.flush()
            os.fsync(temp_file.fileno())
        os.chmod(temp_name, 0o644)  # mkstemp creates 0600; caches and checkpoints are meant to be shared
        os.replace(temp_name, final_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
