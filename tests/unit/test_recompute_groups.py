"""Which layers of a chunk ``model.recompute`` checkpoints, for every mode, method and size."""

import pytest

from ppctl.model.recompute import Recompute


@pytest.mark.parametrize("count", range(0, 9))
@pytest.mark.parametrize("num_layers", range(1, 6))
@pytest.mark.parametrize("mode,method", [("none", "uniform"), ("selective", "block"), ("full", "uniform"),
                                         ("full", "block")])
def test_groups_cover_every_layer_once_in_order(count, num_layers, mode, method):
    groups = Recompute(mode, method, num_layers).layer_groups(count)
    covered = [index for first, end, _ in groups for index in range(first, end)]
    assert covered == list(range(count)) and all(first < end for first, end, _ in groups)
    recomputed = [end - first for first, end, checkpointed in groups if checkpointed]
    if mode != "full":
        assert recomputed == []
    elif method == "uniform":  # groups of num_layers, the last one shorter
        assert recomputed == [min(num_layers, count - first) for first in range(0, count, num_layers)]
    else:  # the first num_layers layers one by one, the rest kept
        assert recomputed == [1] * min(num_layers, count)
        assert all(not checkpointed for first, _, checkpointed in groups if first >= num_layers)


def test_megatron_examples():
    assert Recompute("full", "uniform", 2).layer_groups(4) == [(0, 2, True), (2, 4, True)]
    assert Recompute("full", "block", 1).layer_groups(3) == [(0, 1, True), (1, 3, False)]
    assert Recompute("selective").attention_core and not Recompute("full").attention_core


@pytest.mark.parametrize("bad,words", [(dict(mode="partial"), "mode must be one of none, full, selective"),
                                       (dict(method="every"), "method must be one of uniform, block"),
                                       (dict(num_layers=0), "num_layers must be >= 1")])
def test_bad_settings_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        Recompute(**bad)
