"""A signal that comes while Python runs code whose exceptions reach no caller still ends ``ppctl`` in one line.

``BeforeStartSignals`` raises ``SystemExit`` wherever the main thread is. In a ``__del__`` (a
``datasets.Dataset`` going away while ``prepare-data`` tokenises), a weakref callback or an at-fork hook
(logging's lock release), Python prints "Exception ignored in ..." with a traceback and goes on: the
command said "interrupted", printed a traceback, then tokenised to the end and exited 0 (about one Ctrl-C in
ten on a loaded machine). Here the signal is sent from inside such code, deterministically.
"""

import os
import signal
import sys
import time
import weakref

import pytest

from ppctl.run.interrupt import BeforeStartSignals

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def before_start_handlers(monkeypatch):
    """A ``BeforeStartSignals`` installed as ``main`` installs it, saying it tokenises; handlers and unraisable hook
    restored after."""
    saved = {signum: signal.getsignal(signum) for signum in SIGNALS}
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # a hook of its own, no state shared
    signals = BeforeStartSignals()
    with signals.saying("while tokenising data.path=corpus.jsonl"):
        signals.install()
        yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


class SignalsWhenDeleted:
    """Sends ``signum`` to this process from its ``__del__``: the handler runs inside the ``__del__``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        self.signum = None  # Python code after the signal: the handler has run by now


def deleted(signum: int) -> None:
    """Drop the last reference to a ``SignalsWhenDeleted``: its ``__del__`` runs here."""
    doomed = SignalsWhenDeleted(signum)
    del doomed


def weakref_callback(signum: int) -> None:
    """A weakref callback (as ``weakref.finalize`` and ``tempfile`` use) that sends ``signum``."""
    class Referent:
        pass

    referent = Referent()
    callback = weakref.ref(referent, lambda _ref: os.kill(os.getpid(), signum))
    del referent
    assert callback() is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("swallowing", [deleted, weakref_callback])
@pytest.mark.parametrize("signum", SIGNALS)
def test_a_signal_while_a_finalizer_runs_still_ends_the_command_in_one_line(before_start_handlers, capfd, swallowing,
                                                                           signum):
    with pytest.raises(SystemExit) as ended:
        swallowing(signum)
        time.sleep(5)  # what the command goes on doing; the interruption, raised again, ends it
    assert ended.value.code == 128 + signum
    name = signal.Signals(signum).name
    assert capfd.readouterr().err.splitlines() == [
        f"error: interrupted by {name} while tokenising data.path=corpus.jsonl"]


@pytest.mark.timeout(30)
def test_a_second_signal_after_one_raised_again_says_its_line(before_start_handlers, capfd):
    with pytest.raises(SystemExit):
        deleted(signal.SIGINT)
        time.sleep(5)
    with pytest.raises(SystemExit) as ended:  # a new Ctrl-C: the mark of the first, raised again, is gone
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert ended.value.code == 128 + signal.SIGINT
    assert capfd.readouterr().err.splitlines() == [
        "error: interrupted by SIGINT while tokenising data.path=corpus.jsonl"] * 2


def test_other_unraisable_exceptions_go_to_the_hook_it_replaced(before_start_handlers):
    from ppctl.run.interrupt import RaiseSwallowedAgain

    seen = []
    sys.unraisablehook = RaiseSwallowedAgain(seen.append)
    error = ValueError("in a __del__")
    sys.unraisablehook(type("Unraisable", (), {"exc_value": error})())
    assert [item.exc_value for item in seen] == [error]


class RaisesWhenDeleted:
    """Raises ``ValueError`` from its ``__del__``: an unraisable exception that is not an interruption."""

    def __del__(self) -> None:
        raise ValueError("in a __del__")


@pytest.mark.timeout(30)
def test_a_signal_while_the_hook_itself_runs_is_raised_after_it(before_start_handlers, capfd):
    # The hook passes other unraisable exceptions on; a signal that comes meanwhile must not be raised in the hook
    # (Python would swallow it as the hook's own error), but after it.
    sys.unraisablehook.previous = lambda _unraisable: os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(SystemExit) as ended:
        doomed = RaisesWhenDeleted()
        del doomed
        time.sleep(5)
    assert ended.value.code == 130
    assert capfd.readouterr().err.splitlines() == [
        "error: interrupted by SIGINT while tokenising data.path=corpus.jsonl"]


@pytest.fixture
def not_sent_again(monkeypatch):
    """The thread that would send a swallowed signal again sends nothing: the main thread runs on as if the signal
    had not arrived yet (the window in which the code the exit cut short fails on its own)."""
    from ppctl.run.interrupt import RaiseSwallowedAgain

    monkeypatch.setattr(RaiseSwallowedAgain, "_signal_main_thread", lambda self, signum, handler: None)


@pytest.fixture
def installed(not_sent_again, monkeypatch):
    """A ``BeforeStartSignals`` installed (nothing sent again); the handlers and the unraisable hook restored after."""
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # a hook of its own, no state shared
    saved = {signum: signal.getsignal(signum) for signum in SIGNALS}
    try:
        yield BeforeStartSignals().install()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", SIGNALS)
def test_an_error_after_a_swallowed_signal_gives_way_to_it(installed, capfd, signum):
    """The swallowed exit cut a ``__del__`` short; what the command runs into next (here an OSError, as a closed file
    gave in one CI run: exit 2 and a second line) is its consequence: the signal's line and status stand alone."""
    with pytest.raises(SystemExit) as ended:
        with installed.saying("while tokenising data.path=corpus.jsonl"):
            deleted(signum)
            raise OSError(9, "Bad file descriptor")
    assert ended.value.code == 128 + signum
    assert capfd.readouterr().err.splitlines() == [
        f"error: interrupted by {signal.Signals(signum).name} while tokenising data.path=corpus.jsonl"]


@pytest.mark.timeout(30)
def test_a_command_failing_after_a_swallowed_signal_exits_as_the_signal(installed, capfd):
    """``fail`` (the commands' one-line exit) gives way to a swallowed signal too, saying nothing more."""
    from ppctl.cli.app import fail

    deleted(signal.SIGINT)
    with pytest.raises(SystemExit) as ended:
        fail("data.source=text data.path=corpus.jsonl: [Errno 9] Bad file descriptor")
    assert ended.value.code == 130
    os.kill(os.getpid(), signal.SIGINT)  # the signal sent again after the exit was raised is ignored once
    time.sleep(0.1)
    assert capfd.readouterr().err.splitlines() == ["error: interrupted by SIGINT before any worker started"]


@pytest.mark.timeout(60)
def test_a_swallowed_signal_keeps_the_tokenised_corpus_out_of_the_cache(installed, tmp_path):
    """A signal swallowed while tokenising (its re-sent copy not arrived yet) stops ``prepare_corpus`` before its entry
    is put in place: the cache is left as the line says."""
    from ppctl.data.corpus import CorpusSpec
    from ppctl.data.prepare import prepare_corpus

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some words to tokenise\n" * 50)
    cache_dir = tmp_path / "cache"
    deleted(signal.SIGINT)
    with pytest.raises(SystemExit) as ended:
        prepare_corpus(CorpusSpec("text", str(corpus), cache_dir))
    assert ended.value.code == 130
    assert not any(path.suffix in (".bin", ".json") and path.name != "file-digests.json"
                   for path in cache_dir.iterdir()), sorted(cache_dir.iterdir())


def test_an_entry_interrupted_between_its_two_files_leaves_neither(tmp_path, monkeypatch):
    """``commit_entry`` renames the tokens into place, then writes their index: a signal between the two removes the
    tokens again, so no token file without its index is left."""
    from ppctl.data import cache

    staged, token_file = tmp_path / ".staged.tmp", tmp_path / "corpus.bin"
    staged.write_bytes(b"\0" * 8)

    def interrupted(_token_file, _index):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "write_index", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.commit_entry(staged, token_file, {})
    assert sorted(tmp_path.iterdir()) == []
