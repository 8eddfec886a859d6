"""The composition fuzzer in CI: a fixed seed's few drawn configurations, each proven equal to one process.

``make fuzz SEED=S N=N`` runs any number (``tests/fuzz/run.py``); a failure prints the seed and the ``ppctl
verify`` line that reproduces it. The draw itself is checked here too: the same seed draws the same
configurations, each valid, spread over world sizes and schedules.
"""

import pytest

from tests.fuzz.draw import drawn, world_size
from tests.fuzz.run import prove

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
CI_SEED, CI_COUNT = 0, 4


def test_a_seed_draws_the_same_valid_configurations_across_the_space():
    runs, _ = drawn(7, 12)
    assert drawn(7, 12)[0] == runs
    assert len({world_size(overrides) for overrides in runs}) >= 3
    assert len({item for overrides in runs for item in overrides if item.startswith("schedule=")}) >= 5


def test_the_ci_seeds_configurations_equal_one_process():
    runs, failures, _ = prove(CI_SEED, CI_COUNT)
    assert len(runs) == CI_COUNT
    assert not failures, "\n".join(f"{failure.what}\n  {failure.reproduce()}" for failure in failures)
