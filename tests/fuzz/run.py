"""The composition fuzzer: ``python -m tests.fuzz.run --seed S --count N`` (``make fuzz SEED=S N=N``).

Draws ``N`` valid configurations from seed ``S`` (``tests.fuzz.draw``), trains those of one world size in one
launch of the worker pools (``tests.distributed.equivalence.train_in_workers``) and proves each equal to one
process by every comparison the equivalence tests make. Prints the refusals by rule, one line per
configuration proven, and for each failure the seed, its index, the first comparison that failed and the
``ppctl verify`` line that reproduces it; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import defaultdict
from dataclasses import dataclass

from tests.fuzz.draw import drawn, world_size


@dataclass(frozen=True)
class Failure:
    """A drawn configuration that is not equal to one process (or did not run)."""

    seed: int
    index: int
    overrides: list[str]
    what: str

    def reproduce(self) -> str:
        """The command that proves it again."""
        return "ppctl verify " + " ".join(shlex.quote(item) for item in self.overrides)


def prove(seed: int, count: int, timeout: float = 600,
          world: int | None = None) -> tuple[list[list[str]], list[Failure], dict]:
    """Draw ``count`` configurations from ``seed`` (of ``world`` workers only, when given) and prove each; (the
    drawn ones, the failures, the refusals)."""
    from tests.distributed.equivalence import equivalence_checks, train_in_workers

    runs, refused = drawn(seed, count, world)
    by_world: dict[int, list[int]] = defaultdict(list)
    for index, overrides in enumerate(runs):
        by_world[world_size(overrides)].append(index)
    failures = []
    for world, indices in sorted(by_world.items()):
        batch = [runs[index] for index in indices]
        try:
            per_rank = train_in_workers(batch, world, timeout=timeout)
        except Exception as error:  # a launch that fails fails each of its configurations: the line says why
            failures += [Failure(seed, index, runs[index], f"the launch failed: {str(error).splitlines()[0]}")
                         for index in indices]
            continue
        for position, index in enumerate(indices):
            failures += _checked(seed, index, runs[index], per_rank, position, equivalence_checks)
    return runs, failures, dict(refused)


def _checked(seed, index, overrides, per_rank, position, equivalence_checks) -> list[Failure]:
    """The first comparison of one configuration that fails, if any."""
    try:
        for name, check in equivalence_checks(overrides, per_rank, position).items():
            try:
                check()
            except AssertionError as error:
                return [Failure(seed, index, overrides, f"{name}: {str(error).splitlines()[0][-300:]}")]
    except Exception as error:  # the single process could not run it, or the results lack a part
        return [Failure(seed, index, overrides, f"{type(error).__name__}: {str(error).splitlines()[0][-300:]}")]
    return []


def _whole_number(text: str, option: str) -> int:
    """``text`` as an int, or argparse's error naming the ``make fuzz`` variable ``option`` comes from."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ({option})") from None


def count_of_draws(text: str) -> int:
    """``--count`` (``make fuzz N=``): at least 1; none proves nothing, and would say so with exit 0."""
    count = _whole_number(text, "make fuzz N=")
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: draw at least 1 configuration (make fuzz N=1 or more)")
    return count


def seed_of_draws(text: str) -> int:
    """``--seed`` (``make fuzz SEED=``): 0 or more (Python's ``random`` draws the same from -S as from S)."""
    seed = _whole_number(text, "make fuzz SEED=")
    if seed < 0:
        raise argparse.ArgumentTypeError(f"{seed}: a seed is 0 or more (random draws the same from {seed} as from "
                                         f"{-seed}, which failures would then name)")
    return seed


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; print the report; exit status 1 on any failure (2, argparse's, on a bad argument)."""
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=seed_of_draws, default=0)
    parser.add_argument("--count", type=count_of_draws, default=8)
    args = parser.parse_args(argv)
    runs, failures, refused = prove(args.seed, args.count)
    print(f"seed {args.seed}: {len(runs)} drawn configurations proven, {sum(refused.values())} refused by validation "
          f"({', '.join(f'{rule}: {count}' for rule, count in sorted(refused.items()))})")
    failed = {failure.index for failure in failures}
    for index, overrides in enumerate(runs):
        if index not in failed:
            print(f"  equal  #{index}: {' '.join(overrides[len(BASE_PREFIX):])}")
    for failure in failures:
        print(f"  FAILED seed {failure.seed} #{failure.index}: {failure.what}\n    {failure.reproduce()}")
    return 1 if failures else 0


BASE_PREFIX = __import__("tests.distributed.equivalence", fromlist=["BASE"]).BASE

if __name__ == "__main__":
    sys.exit(main())
