"""``inspect-layout``'s report past ``MAX_LISTED_RANKS`` ranks: summarised, fast and small at any size."""

import json
import time
import tracemalloc

import pytest

from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.cli.layout_report import (MAX_LISTED_RANKS, SUMMARY_MEMBERS, SUMMARY_RANKS, is_summarised, layout_report,
                                 print_layout)
from ppctl.parallel.layout import GROUP_NAMES, ParallelLayout, StageLayers
from ppctl.plan.memory import config_memory

HUGE = ["parallel.dp=10000000", "trainer.global_batch_size=10000000"]  # 20 million ranks (pp=2)


def timed(function, *args):
    """``function(*args)``, its seconds and its peak of Python memory (bytes)."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        value = function(*args)
        return value, time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# Time bounds that only a pathological path breaks (an enumeration of twenty million ranks takes minutes): the
# suite runs in two pytest processes beside multi-process tests, which can slow a unit test ten times. What
# proves the summary is the memory peak; speed figures belong in benchmarks.
QUICK_S = 10
LISTED_S = 30


def test_validation_and_the_json_report_of_twenty_million_ranks_are_quick_and_small():
    run, seconds, peak = timed(resolve, compose_config(HUGE))
    assert seconds < QUICK_S and peak < 10 << 20
    report, seconds, peak = timed(layout_report, run)
    text = json.dumps(report)
    assert seconds < QUICK_S and peak < 10 << 20 and len(text) < 64 << 10
    assert is_summarised(report) and report["world_size"] == 20_000_000
    assert set(report) == {"world_size", "order", "sizes", "experts", "placement", "sequence", "groups", "ranks",
                           "pipeline_layout", "layers"}
    dp = report["groups"]["dp"]
    assert (dp["count"], dp["size"]) == (2, 10_000_000)
    assert dp["first"] == {"head": list(range(SUMMARY_MEMBERS)),
                           "tail": list(range(10_000_000 - SUMMARY_MEMBERS, 10_000_000))}
    assert dp["last"]["tail"][-1] == 19_999_999
    assert report["groups"]["pp"]["first"] == {"head": [0, 10_000_000], "tail": []}
    ranks = report["ranks"]
    assert ranks["count"] == 20_000_000 and len(ranks["first"]) == len(ranks["last"]) == SUMMARY_RANKS
    last = ranks["last"][-1]
    assert {key: value for key, value in last.items() if key != "memory"} == {
        "rank": 19_999_999, "tp": 0, "cp": 0, "dp": 9_999_999, "pp": 1, "tokens": [[0, 64]],
        "residual_tokens": [[0, 64]]}
    assert last["memory"] == config_memory(resolve(compose_config(HUGE)))[1].to_json()


def test_the_table_of_twenty_million_ranks_is_quick(capsys):
    run = resolve(compose_config(HUGE))
    report = layout_report(run)
    _, seconds, _ = timed(print_layout, report, run)
    text = capsys.readouterr().out
    assert seconds < QUICK_S and "process groups (summarised)" in text and "10,000,000" in text
    assert "[0, 1, 2, 3, ...," in text and "19999999]" in text  # the first and the last group's ends


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=2", "parallel.cp=2", "parallel.dp=2", "parallel.pp=4", "model.num_layers=8"],
    ["schedule=dualpipe", "parallel.tp=2", "parallel.pp=4", "model.num_layers=8", "trainer.global_batch_size=16"],
])
def test_a_summary_agrees_with_the_listing_it_replaces(overrides, monkeypatch):
    """The same layout listed and (with the limit lowered) summarised: counts, sizes, ends and rank entries."""
    from ppctl.cli import layout_report as module

    run = resolve(compose_config(overrides))
    listed = layout_report(run)
    monkeypatch.setattr(module, "MAX_LISTED_RANKS", 4)
    summary = layout_report(run)
    assert not is_summarised(listed) and is_summarised(summary)
    for name in GROUP_NAMES:
        groups, summarised = listed["groups"][name], summary["groups"][name]
        assert (summarised["count"], summarised["size"]) == (len(groups), len(groups[0]))
        for end, group in (("first", groups[0]), ("last", groups[-1])):
            shown = summarised[end]["head"] + summarised[end]["tail"]
            assert shown == group[:SUMMARY_MEMBERS] + group[SUMMARY_MEMBERS:][-SUMMARY_MEMBERS:]
    assert summary["ranks"]["first"] == listed["ranks"][:SUMMARY_RANKS]
    assert summary["ranks"]["last"] == listed["ranks"][-SUMMARY_RANKS:]
    assert summary["layers"] == listed["layers"]


def test_up_to_the_limit_everything_is_listed():
    layout = ParallelLayout(tp=8, pp=16, dp=128)
    assert layout.world_size == MAX_LISTED_RANKS
    run = resolve(compose_config(["parallel.tp=8", "parallel.pp=16", "parallel.dp=128", "model.num_layers=32",
                                  "model.num_heads=8", "trainer.global_batch_size=1024"]))
    report, seconds, _ = timed(layout_report, run)
    assert not is_summarised(report) and len(report["ranks"]) == MAX_LISTED_RANKS and seconds < LISTED_S


def test_each_ranks_memory_holds_its_share_of_the_experts(capsys):
    """With ep=2 every rank's predicted parameters are those of the chunks it builds (its EP rank's experts),
    exactly, and the table says so; at ep=1 (the twin: experts whole) each rank holds every expert."""
    from ppctl.model.from_config import build_chunk
    from ppctl.parallel.expert_parallel import EPGroup
    from ppctl.parallel.groups import RankGroups

    overrides = ["model=mixtral_tiny", "data=synthetic", "parallel.pp=2", "parallel.dp=2"]
    split, whole = (resolve(compose_config(overrides + [f"parallel.ep={ep}"])) for ep in (2, 1))
    report = layout_report(split)
    assert report["experts"]["per_rank"] == 4
    for entry in report["ranks"]:
        group = EPGroup(None, 2, entry["expert"]["ep"])
        built = sum(param.numel() for stage in report["layers"] if stage["pp_rank"] == entry["pp"]
                    for param in build_chunk(split.config, StageLayers(0, tuple(stage["layers"]), stage["pre_process"],
                                                                 stage["post_process"]),
                                             RankGroups(ep=group)).parameters())
        assert entry["memory"]["parameters"] == 4 * built  # fp32
        assert layout_report(whole)["ranks"][entry["rank"]]["memory"]["parameters"] > entry["memory"]["parameters"]
    print_layout(report, split)
    out = capsys.readouterr().out
    assert "the parameters hold the rank's own experts" in out
    assert all(f"{entry['memory']['total'] / 2**20:.1f}" in out for entry in report["ranks"])
