"""The process's stdout guarded: a write that fails ends ``ppctl`` in one line, not a traceback.

What a command prints goes to ``sys.stdout``; when that write fails (a full disk, ``/dev/full``, a
pipe whose reader went away, as ``ppctl ... | head`` does), ``run_guarding_stdout`` ends the command
with exit status 1 and one line on stderr (none for a reader that went away: it wants no message).
The failure travels as ``StdoutError``, which is not an ``OSError``, so that neither Click nor a
command's own file handling takes it for theirs. Afterwards stdout's descriptor points at
``/dev/null``: the interpreter's last flush must not fail again. Built for the process's entry point
(``ppctl.cli.app.main``); nothing here imports torch or the command line.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable

from ppctl.run.supervise import say

STDOUT_FD = 1


class StdoutError(Exception):
    """Writing to stdout failed (a full disk, ``/dev/full``, a closed pipe): not an ``OSError``, so that neither
    Click nor a command's own file handling takes it for theirs."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror)
        self.errno, self.strerror = error.errno, error.strerror or str(error)


class GuardedStdout:
    """``sys.stdout`` whose failed writes raise ``StdoutError``; everything else is the stream's own."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        """Write ``text``; ``StdoutError`` when the stream refuses it."""
        try:
            return self._stream.write(text)
        except OSError as error:
            raise StdoutError(error) from None

    def flush(self) -> None:
        """Flush; ``StdoutError`` when the stream refuses it."""
        try:
            self._stream.flush()
        except OSError as error:
            raise StdoutError(error) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def run_guarding_stdout(command: Callable[[], object]) -> None:
    """Run ``command`` with ``sys.stdout`` guarded; a write that fails ends it with exit status 1 and one line on
    stderr (none when the reader went away)."""
    sys.stdout = GuardedStdout(sys.stdout)
    try:
        command()
    except StdoutError as error:
        os.dup2(os.open(os.devnull, os.O_WRONLY), STDOUT_FD)  # the interpreter's last flush must not fail again
        if error.errno != errno.EPIPE:  # a reader that went away (`| head`) wants no message
            say(f"error: cannot write the output to stdout: {error.strerror}")
        raise SystemExit(1) from None
