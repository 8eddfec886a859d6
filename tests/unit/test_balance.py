"""``parallel.balance=auto``: the greedy split is the optimum (against every split, for small sizes), for looped,
interleaved, V, wave and DualPipe placements; the memory limit moves layers off a rank that would not fit; the
settings are refused in one line where they cannot hold; every schedule reads the string it gets."""

import itertools

import pytest

from ppctl.config import ConfigError, schedule_spec
from ppctl.resolve import compose_config, validate
from ppctl.resolve.resolved import resolve, stage_counts
from ppctl.parallel.layout import parse_pipeline_layout
from ppctl.parallel.placement import looped_placement, v_placement, wave_placement
from ppctl.pipeline.schedules import SCHEDULE_SPECS
from ppctl.plan.balance import (GIB, PartCosts, balance_summary, balanced_counts, model_part_costs, even_counts,
                                layers_held, layout_string, part_costs, rank_loads)
from ppctl.plan.memory import config_memory

# (layer, embedding, loss): a loss of none, a fraction of a layer, one, several; an embedding that ties or not
COSTS = [PartCosts(10, 0, 0), PartCosts(10, 1, 4), PartCosts(10, 1, 10), PartCosts(10, 3, 27), PartCosts(7, 2, 50)]


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` non-negative integers, in order."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        bounds = (-1, *cuts, total + parts - 1)
        yield tuple(bounds[index + 1] - bounds[index] - 1 for index in range(parts))


def optimum(num_layers, placement, costs, caps=None):
    """The smallest slowest-rank load over every split (that keeps each rank within its cap), or None."""
    loads = [max(rank_loads(placement, costs, counts))
             for counts in compositions(num_layers, placement.stages_per_copy)
             if caps is None or all(cap is None or held <= cap
                                    for held, cap in zip(layers_held(placement, counts), caps))]
    return min(loads, default=None)


def assert_optimal(num_layers, placement, costs, caps=None):
    counts = balanced_counts(num_layers, placement, costs, caps)
    best = optimum(num_layers, placement, costs, caps)
    if best is None:
        assert counts is None
        return
    assert sum(counts) == num_layers and len(counts) == placement.stages_per_copy
    assert max(rank_loads(placement, costs, counts)) == best, (num_layers, placement, costs, counts)


def composed(*overrides):
    return compose_config(list(overrides))


# --- the greedy split is the optimum ----------------------------------------------------------

@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("costs", COSTS)
def test_looped_one_chunk_split_is_the_optimum(pp, costs):
    for num_layers in range(11):
        assert_optimal(num_layers, looped_placement(pp, 1), costs)


@pytest.mark.parametrize("placement", [looped_placement(2, 2), looped_placement(3, 2), looped_placement(2, 3),
                                       v_placement(2), v_placement(3), v_placement(4), wave_placement(2, 2),
                                       v_placement(2, copies=2), v_placement(3, copies=2), v_placement(4, copies=2)],
                         ids=["looped2x2", "looped3x2", "looped2x3", "v2", "v3", "v4", "waves2x2", "dualpipe2",
                              "dualpipe3", "dualpipe4"])
@pytest.mark.parametrize("costs", COSTS[1:4])
def test_interleaved_v_wave_and_dualpipe_splits_are_the_optimum(placement, costs):
    for num_layers in range(9 if placement.stages_per_copy <= 6 else 7):
        assert_optimal(num_layers, placement, costs)


@pytest.mark.parametrize("placement", [looped_placement(3, 1), looped_placement(2, 2), v_placement(2),
                                       v_placement(4, copies=2)], ids=["looped3", "looped2x2", "v2", "dualpipe4"])
def test_split_under_layer_caps_is_the_optimum(placement):
    pp = max(placement.owners) + 1
    for caps in itertools.product([None, 0, 1, 3], repeat=pp):
        for num_layers in (3, 6, 9):
            assert_optimal(num_layers, placement, PartCosts(10, 1, 14), caps)


def test_ties_break_towards_fewer_layers_then_the_lower_stage():
    assert balanced_counts(10, looped_placement(4, 1), PartCosts(10, 1, 4)) == (2, 3, 3, 2)
    assert balanced_counts(8, looped_placement(4, 1), PartCosts(10, 0, 0)) == (2, 2, 2, 2)
    assert balanced_counts(2, looped_placement(4, 1), PartCosts(10, 0, 0)) == (1, 1, 0, 0)


def test_layout_strings_and_the_even_split():
    assert layout_string((2, 3, 3, 2)) == "Ett|ttt|ttt|ttL"
    assert layout_string((0, 1, 0)) == "E|t|L" and layout_string((3,)) == "EtttL"
    assert even_counts(10, 4) == (3, 3, 2, 2) and even_counts(8, 4) == (2, 2, 2, 2)
    assert [len(stage) for stage in parse_pipeline_layout(layout_string((0, 4, 0, 1)), 5, 4)] == [0, 4, 0, 1]


def test_part_costs_follow_the_flop_count():
    costs = part_costs(hidden_size=64, ffn_hidden_size=256, seq_length=64, padded_vocab_size=320)
    assert costs.layer == 2 * 4 * 64**2 + 2 * 2 * 64 * 256 + 2 * 2 * 64 * 64
    assert costs.loss == 2 * 64 * 320 + 5 * 320 and costs.embedding == 64


# --- from a config ---------------------------------------------------------------------------

def assert_config_optimal(run):
    """The resolved config's split is the optimum over every split, and no slower than the even one."""
    config, placement = run.config, run.layout.placement
    costs, counts = model_part_costs(run.model, config.trainer.seq_length), list(stage_counts(run))
    assert max(rank_loads(placement, costs, counts)) == optimum(config.model.num_layers, placement, costs)
    summary = balance_summary(run, counts)
    assert summary.layout == run.pipeline_layout and summary.slowest_flops <= summary.even_slowest_flops
    return counts, layers_held(placement, counts)


GPT_SMALL_LIKE = ("model=gpt_small", "model.vocab_size=50257", "parallel.balance=auto")  # the output layer: 5.4 layers


def test_gpt_small_at_pp4_gives_the_loss_stage_fewer_layers():
    run = resolve(composed(*GPT_SMALL_LIKE, "parallel.pp=4", "model.num_layers=24"))
    counts, _ = assert_config_optimal(run)
    assert run.pipeline_layout == "Ettttttt|tttttttt|ttttttt|ttL"
    assert counts[-1] < min(counts[1:-1]) and counts[0] <= max(counts[1:-1])  # the embedding's stage: no more
    summary = balance_summary(run, counts)
    assert summary.even_layout == "Etttttt|tttttt|tttttt|ttttttL"
    assert summary.slowest_flops < 0.75 * summary.even_slowest_flops  # the last rank ran 6 layers and the output
    assert resolve(composed(*GPT_SMALL_LIKE, "parallel.pp=4")).pipeline_layout == "Etttt|tttt|tttt|L"  # 12 layers


def test_interleaved_gives_the_rank_with_the_loss_fewer_layers():
    run = resolve(composed(*GPT_SMALL_LIKE, "schedule=interleaved_1f1b", "parallel.pp=2", "parallel.vpp=2",
                           "model.num_layers=10"))
    _, held = assert_config_optimal(run)
    assert held[1] < held[0] and sum(held) == 10


def test_zbv_gives_rank_0_both_ends_and_fewer_layers():
    run = resolve(composed(*GPT_SMALL_LIKE, "schedule=zbv", "parallel.pp=2", "model.num_layers=10"))
    counts, held = assert_config_optimal(run)
    assert run.layout.placement.owners == (0, 1, 1, 0)
    assert held[0] < held[1] and counts[-1] < counts[1]


def test_dualpipe_balances_the_mirror_pairs():
    run = resolve(composed(*GPT_SMALL_LIKE, "schedule=dualpipe", "parallel.pp=4", "model.num_layers=24",
                           "trainer.global_batch_size=8"))
    counts, held = assert_config_optimal(run)
    # ranks 0 and 3 hold model stages 0 and 3 (the embedding and the loss), ranks 1 and 2 stages 1 and 2
    assert held[0] == held[3] == counts[0] + counts[3] == 9 and held[1] == held[2] == counts[1] + counts[2] == 15
    layers = run.layer_map
    assert sorted(layer for stage in layers.values() for layer in stage.layers) == sorted(list(range(24)) * 2)


def test_without_auto_the_split_is_unchanged():
    assert resolve(composed("parallel.pp=4", "model.num_layers=8")).pipeline_layout is None
    assert resolve(composed("parallel.balance=even", "parallel.pipeline_layout=Ett|ttL")).pipeline_layout == "Ett|ttL"


# a vocabulary whose output layer costs less than a layer, or as much as 56 of gpt_tiny's (empty stages)
@pytest.mark.parametrize("vocab", [257, 50257])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", sorted(SCHEDULE_SPECS))
def test_every_schedule_reads_the_string_auto_gives(name, pp, vocab):
    spec = SCHEDULE_SPECS[name]
    overrides = [f"schedule={name}", f"parallel.pp={pp}", "model.num_layers=7", "trainer.global_batch_size=16",
                 f"model.vocab_size={vocab}", "parallel.balance=auto"]
    if spec.multi_chunk and spec.chunks_per_rank is None and spec.chunks_per_wave is None:
        overrides.append("parallel.vpp=2")
    if spec.streams_steps:
        overrides += ["optimizer.gradient_delay=1", "optimizer.clip_grad=0"]
    run = resolve(composed(*overrides))
    placement, text = run.layout.placement, run.pipeline_layout
    assert text.count("t") == 7 and text.count("|") == placement.stages_per_copy - 1
    assert sum(len(stage) for stage in parse_pipeline_layout(text, 7, placement.stages_per_copy)) == 7
    held = sorted(layer for stage in run.layer_map.values() for layer in stage.layers)
    assert held == sorted(list(range(7)) * placement.copies), schedule_spec(run.config).name


# --- the memory limit -------------------------------------------------------------------------

MEMORY_CASE = ("parallel.pp=4", "model.num_layers=10", "parallel.balance=auto")


def test_the_memory_limit_moves_layers_off_the_rank_that_would_not_fit():
    free = resolve(composed(*MEMORY_CASE))
    free_counts, free_memory = stage_counts(free), [parts.total for parts in config_memory(free)]
    # rank 1: three layers with pp-1 microbatches in flight (1F1B) needs the most; a limit just under it
    assert free_counts == (2, 3, 3, 2) and free_memory.index(max(free_memory)) == 1
    limit_gb = (free_memory[1] - 1) / GIB
    run = resolve(composed(*MEMORY_CASE, f"parallel.balance_memory_gb={limit_gb!r}"))
    counts = stage_counts(run)
    assert sum(counts) == 10 and counts[1] < free_counts[1]
    assert all(parts.total <= limit_gb * GIB for parts in config_memory(run))


def test_no_split_that_fits_is_refused_in_one_line():
    config = composed(*MEMORY_CASE, "parallel.balance_memory_gb=0.001")
    with pytest.raises(ConfigError, match=r"^parallel.balance=auto: no split of 10 layers over 4 stages fits "
                                          r"parallel.balance_memory_gb=0.001 \(rank \d needs [\d.]+ GiB holding "
                                          r"\d layers, and fewer leave too many for the other ranks\)$") as error:
        resolve(config)
    assert "\n" not in str(error.value)


def test_a_limit_no_rank_can_meet_even_empty_is_refused():
    config = composed(*MEMORY_CASE, "parallel.balance_memory_gb=0.00001")
    with pytest.raises(ConfigError, match=r"\(rank \d needs [\d.]+ GiB at best, holding no transformer layer\)$"):
        resolve(config)


# --- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.balance=fast"], "parallel.balance='fast' must be one of even, auto"),
    (["parallel.balance=auto", "parallel.pipeline_layout=Ett|ttL"],
     "parallel.balance=auto chooses the split itself: leave parallel.pipeline_layout unset"),
    (["parallel.balance=auto", "parallel.account_for_embedding_in_split=true"],
     "parallel.balance=auto counts the embedding and the loss by their FLOPs itself: leave "
     "parallel.account_for_embedding_in_split false"),
    (["parallel.balance=auto", "parallel.account_for_loss_in_split=true"],
     "leave parallel.account_for_loss_in_split false"),
    (["parallel.balance=auto", "parallel.balance_memory_gb=0"], "parallel.balance_memory_gb=0.0 must be positive"),
    (["parallel.balance=auto", "parallel.balance_memory_gb=-2"], "parallel.balance_memory_gb=-2.0 must be positive"),
    (["parallel.balance_memory_gb=8"], "parallel.balance_memory_gb=8.0 is the limit the split of "
                                       "parallel.balance=auto must fit; set parallel.balance=auto"),
])
def test_balance_settings_that_cannot_hold_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        validate(composed(*overrides))
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_the_settings_are_checked_without_the_layer_split_too():
    with pytest.raises(ConfigError, match="parallel.balance='fast'"):
        validate(composed("parallel.balance=fast"), layer_split=False)
