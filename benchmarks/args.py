"""Argument types and checks the benchmark scripts share: a bad argument is argparse's one-line error (exit 2).

Every script checks its arguments before it builds a model, writes a folder or starts a worker: a
count that must be positive is ``type=positive_int``, a list of names is ``type=names_in(...)``, and
a script whose arguments become ``ppctl`` config overrides has them validated as ``ppctl train`` would
(``check_ppctl_config``), so that a layout the run cannot take is said before anything runs.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Iterable


def _whole_number(text: str) -> int:
    """``text`` as an int; ``ArgumentTypeError`` naming it otherwise."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """``type=`` of a count that must be at least 1."""
    number = _whole_number(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not at least 1")
    return number


def non_negative_int(text: str) -> int:
    """``type=`` of a count that may be 0 (warm-up rounds)."""
    number = _whole_number(text)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{number} is negative; 0 or more")
    return number


def at_least(minimum: int, why: str) -> Callable[[str], int]:
    """``type=`` of a count that must be at least ``minimum`` (``why`` says why, in the error)."""
    def parse(text: str) -> int:
        number = _whole_number(text)
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} is less than {minimum}: {why}")
        return number
    return parse


def positive_float(text: str) -> float:
    """``type=`` of a finite number above 0 (an interval)."""
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return number


def names_in(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """``type=`` of a comma-separated list of distinct names, each one of ``choices``."""
    known = list(choices)

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        unknown = [name for name in names if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(repr(name) for name in unknown)} not among "
                                             f"{', '.join(known)} (comma-separated)")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} names one twice")
        return names
    return parse


def divides(parser: argparse.ArgumentParser, whole: tuple[str, int], part: tuple[str, int]) -> None:
    """``parser.error`` unless ``part``'s value divides ``whole``'s: each is (option, value)."""
    (whole_name, whole_value), (part_name, part_value) = whole, part
    if whole_value % part_value:
        parser.error(f"{whole_name} {whole_value} is not a multiple of {part_name} {part_value}")


def check_ppctl_config(parser: argparse.ArgumentParser, overrides: list[str]) -> None:
    """``parser.error`` with ppctl's own line when ``overrides`` do not make a valid run (as ``ppctl train``
    composes and validates them); the data is synthetic or prepared by the run itself, so not checked here."""
    from ppctl.config import ConfigError
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve

    try:
        resolve(compose_config(overrides), data=False)
    except ConfigError as error:
        parser.error(f"these arguments make a run ppctl refuses: {error}")


def parse_block_args(description: str, layers: int, argv: list[str] | None = None) -> argparse.Namespace:
    """The options of a benchmark timing GPT layers as one middle stage (``--hidden``, ``--heads``, ``--layers``
    (default ``layers``), ``--seq``, ``--micro-batch``, ``--repeats``, ``--warmup``); ``--heads`` must divide
    ``--hidden``. A bad one is argparse's error, exit 2, before any model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hidden", type=positive_int, default=768)
    parser.add_argument("--heads", type=positive_int, default=12)
    parser.add_argument("--layers", type=positive_int, default=layers)
    parser.add_argument("--seq", type=positive_int, default=256)
    parser.add_argument("--micro-batch", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    args = parser.parse_args(argv)
    divides(parser, ("--hidden", args.hidden), ("--heads", args.heads))
    return args
