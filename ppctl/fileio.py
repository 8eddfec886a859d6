"""Files written whole or not at all, their digests, the error behind a file reader's wrapped one, and why an OS
call failed in words.

Shared by the data cache, checkpoints, config files, the run directory and the command line. Pure.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional


def write_atomically(final_path: Path, write: Callable, suffix: str = ".tmp") -> None:
    """Call ``write(file)`` on a temporary file next to ``final_path`` (its name ending in ``suffix``), flush it
    to disk, rename it into place."""
    descriptor, temp_name = tempfile.mkstemp(dir=final_path.parent, prefix=f".{final_path.name}.", suffix=suffix)
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


def exception_in_chain(error: Optional[BaseException], kind: type) -> Optional[BaseException]:
    """The first exception of type ``kind`` in ``error``'s chain (itself, its causes and contexts), or None.

    Readers wrap what went wrong (``datasets`` a decoding error, Hydra a YAML or override error);
    the one-line message is built from the original.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds ``path``."""
    found = Path(os.path.abspath(path))
    while not os.path.ismount(found) and found != found.parent:
        found = found.parent
    return found


def os_reason(error: OSError, named: Optional[Path] = None) -> str:
    """Why an OS call failed, and on which file when that is not ``named`` (already in the message)."""
    reason = error.strerror or str(error)
    if error.filename and (named is None or Path(error.filename) != named):
        reason += f" ({error.filename})"
    return reason
