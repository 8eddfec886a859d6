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


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; print the report; exit status 1 on any failure."""
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=8)
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
