"""``ppctl plan``'s inputs (issue 46): ``--gpus`` bounded and read in one line, and a search that finds nothing says
why of every layout, those left out before validation included."""

import time

import pytest

from ppctl.resolve import compose_config
from ppctl.plan import search
from ppctl.plan.search import DEVICES, MAX_DEVICES, parse_devices, plan, search_space

GIB = 2 ** 30
STAGES = "pp x vpp outnumbers model.num_layers=4 (a stage would hold no layer)"
BATCH = "dp x the micro-batch size does not divide trainer.global_batch_size=8"
HEADS = "tp does not divide model.num_heads=4"


@pytest.fixture(scope="module")
def default():
    """The default model (4 layers, 4 heads) and batch (8 sequences)."""
    return compose_config(["data=synthetic"])


def test_gpus_is_a_whole_number_from_one_to_the_bound():
    assert parse_devices("8") == 8 and parse_devices(str(MAX_DEVICES)) == MAX_DEVICES == 2 ** 20
    for text, said in (("1e7", "--gpus 1e7: not a whole number of devices"),
                       ("0", "--gpus 0: a plan needs at least 1 device"),
                       ("-3", "--gpus -3: a plan needs at least 1 device"),
                       ("99999999999999999999999", "--gpus 99999999999999999999999: more devices than ppctl plan "
                                                   "searches"),
                       (str(MAX_DEVICES + 1), "more devices than ppctl plan searches")):
        with pytest.raises(ValueError) as raised:
            parse_devices(text)
        assert said in str(raised.value) and str(raised.value).endswith(
            "give --gpus a whole number from 1 to 1,048,576 (2**20)"), str(raised.value)


def test_the_divisors_are_found_up_to_the_square_root():
    for number in range(1, 300):
        assert search._divisors(number) == [d for d in range(1, number + 1) if number % d == 0]
    assert search._divisors(999_983) == [1, 999_983]  # a prime
    assert len(search._divisors(10 ** 6)) == 49 and len(search._divisors(2 ** 20)) == 21


def test_a_prime_count_of_devices_says_why_each_layout_was_left_out(default):
    """7 devices: tp = cp = 1; pp=7 gives 7 or 14 stages for 4 layers, and pp=1 a dp of 7 that divides no batch of
    8: nothing fits, and every layout is counted (each as its 3 or 6 variants), where the list used to be empty."""
    layouts, left_out = search_space(default, 7)
    # pp=7: 6 schedules x 4 micro-batch sizes, 3 variants each (no replicas); pp=1: 1f1b x 4, 6 variants each
    assert layouts == [] and left_out == {STAGES: 6 * 4 * 3, BATCH: 4 * 6}
    found = plan(default, 7, 80 * GIB, 5, DEVICES["h100"])
    assert found.candidates == [] and found.to_json()["refused"] == {STAGES: 72, BATCH: 24}


def test_a_million_devices_are_searched_in_seconds_and_counted(default):
    started = time.monotonic()
    for devices in (10 ** 6, MAX_DEVICES, 999_983):
        found = plan(default, devices, 80 * GIB, 5, DEVICES["h100"])
        assert found.candidates == [] and set(found.refused) <= {STAGES, BATCH, HEADS} and found.refused
    assert time.monotonic() - started < 60  # each took minutes, linear in --gpus, before


def test_layouts_left_out_before_validation_are_counted_beside_those_searched(default):
    """Where some fit, the ones left out before validation are counted too, under their rule."""
    layouts, left_out = search_space(default, 8)
    assert layouts and left_out[HEADS] > 0 and left_out[STAGES] > 0 and left_out[BATCH] > 0
    found = plan(default, 8, 80 * GIB, 3, DEVICES["h100"])
    assert found.candidates and all(found.refused[reason] == count for reason, count in left_out.items())
