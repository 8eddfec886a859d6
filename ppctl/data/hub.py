"""The Hugging Face libraries: a hub dataset loaded or refused in one line, their logs and progress bars.

A hub dataset is not tried where it cannot load: offline (``HF_DATASETS_OFFLINE`` or
``HF_HUB_OFFLINE``) only the local cache is read, and online a hub that does not accept a
connection within ``HUB_CONNECT_S`` fails at once rather than through the library's retries.
The log records ``datasets`` and ``huggingface_hub`` print on their way to an error are
silenced while ppctl turns the error into one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Iterator

from ppctl.data.corpus import Corpus, DataError, one_line

LIBRARY_LOGGERS = ("datasets", "huggingface_hub")  # silenced while ppctl turns their errors into one line
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
HUB_CONNECT_S = 5.0  # how long the hub may take to accept a connection before it counts as unreachable
TRUE_VALUES = ("1", "ON", "YES", "TRUE")  # what the Hugging Face libraries read as a set flag


def load_hub(corpus: Corpus, progress: bool):
    """Load the ``train`` split of a hub dataset (into the ``datasets`` cache; needs the network once).

    Offline (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``) only the local cache is read; online, a hub
    that does not accept a connection fails at once instead of through the library's retries.
    """
    failed = f"{corpus.label}: no such file, folder or glob, and loading it as a Hugging Face hub dataset failed"
    offline = offline_flag()
    if offline is None:
        unreachable = hub_unreachable()
        if unreachable is not None:
            raise DataError(f"{failed}: {unreachable}; with the dataset in the local cache, set HF_HUB_OFFLINE=1")
    with datasets_progress(progress) as datasets, quiet_library_logs():
        try:
            return datasets.load_dataset(corpus.hub_name, split="train")
        except Exception as error:
            if offline is not None:
                raise DataError(f"{failed}: it is not in the local cache, and {offline} (offline) keeps the hub out "
                                f"of reach") from None
            raise DataError(f"{failed}: {one_line(error)}") from None


def hub_fingerprint(corpus: Corpus, documents) -> str:
    """What a hub dataset's documents depend on: its name and the ``datasets`` fingerprint of its train split."""
    return f"hub|{corpus.hub_name}|{documents._fingerprint}"


def offline_flag() -> str | None:
    """The setting that makes the Hugging Face libraries offline (``HF_DATASETS_OFFLINE=1``, else
    ``HF_HUB_OFFLINE=1``, as ``datasets`` reads them), or None when they may use the network."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        value = os.environ.get(name)
        if value is not None:
            return f"{name}={value}" if value.upper() in TRUE_VALUES else None
    return None


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``) cannot be reached now, or None when it accepts a connection."""
    from urllib.parse import urlsplit

    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_HUB_ENDPOINT)
    parts = urlsplit(endpoint)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=HUB_CONNECT_S):
            return None
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        return f"the hub {endpoint} cannot be reached ({reason})"


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
    """Silence the log records of ``datasets`` and ``huggingface_hub`` for the block, then restore their levels:
    on the way to an error they print lines of their own, and ppctl reports the error in one."""
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def datasets_progress(shown: bool) -> Iterator:
    """Import ``datasets``, show or hide its progress bars for the block, then restore their state."""
    import datasets

    were_disabled = datasets.are_progress_bars_disabled()
    datasets.enable_progress_bars() if shown else datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.disable_progress_bars() if were_disabled else datasets.enable_progress_bars()
