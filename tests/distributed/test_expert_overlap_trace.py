"""DualPipeV's overlapped pairs interleaved at ep=2, traced (``ppctl.pipeline.interleave``): each pair's halves are
cut at their expert all-to-alls into pieces, one piece computes at a time, each exchange travels while the other
half computes, and the trace draws the pieces and the all-to-alls on tracks of their own.

Four gloo workers train two steps of a Mixtral-like model (one MoE layer per chunk) at pp=2 dp=2 ep=2 with
``trainer.trace=true``; the second step's record is checked: a forward posts 3 exchanges per MoE layer (the row
counts, dispatch, combine) and a whole backward 2 (the reverses of dispatch and combine), so each pair is 4 + 3
pieces, and no two pieces of a rank overlap in time. Under ZB-V the same overlap makes weight fills: a W computes
while the backward before it waits for its exchanges (2 per MoE layer, so each fill's B is 3 pieces).
"""

import pytest

from tests.distributed.equivalence import BASE, MIXTRAL, composed_runs
from tests.harness.pool import run_workers

OVERLAPPED = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "schedule=dualpipev", "parallel.overlap_ep_comm=true",
              "trainer.trace=true"]


def _traced_second_step(rank, world_size, configs):
    """This rank's pp rank, its overlapped pairs' count and its tracer's record of the second step."""
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    run = resolve(configs[0], check=False)  # validated in the test process
    context = build_parallel_context(run.layout, 60)
    trainer = Trainer(run, context)
    trainer.train_steps(0, 2)
    schedule = trainer.program.schedule
    return {"pairs": len(schedule.pair_starts(context.pp_rank)), "fills": len(schedule.fill_starts(context.pp_rank)),
            "snapshot": trainer.tracer.snapshot()}


def _one_at_a_time(pieces) -> bool:
    spans = sorted((start, end) for _half, start, end in pieces)
    return all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:]))


@pytest.mark.timeout(240)
def test_interleaved_pairs_run_one_piece_at_a_time_and_the_trace_draws_them():
    from ppctl.pipeline.trace import EXCHANGE_CATEGORY, PIECE_CATEGORY, chrome_trace

    configs = composed_runs([BASE + MIXTRAL + OVERLAPPED])
    per_rank = run_workers(_traced_second_step, 4, configs, timeout=200)
    interleaved = 0
    for results in per_rank:
        pieces = results["snapshot"]["pieces"]
        assert _one_at_a_time(pieces), "two pieces at once"
        events = chrome_trace([results["snapshot"]], step=1)["traceEvents"]
        assert sum(event.get("cat") == PIECE_CATEGORY for event in events) == len(pieces)
        pieces = [piece for piece in pieces if not piece[0].startswith("fill")]  # DualPipeV's cool-down fills too
        assert results["pairs"] > 0 and len(pieces) == (4 + 3) * results["pairs"], (results["pairs"], len(pieces))
        halves = "".join(half for half, _start, _end in pieces)
        pairs = [halves[index:index + 7] for index in range(0, len(halves), 7)]
        assert all(sorted(pair) == sorted("FFFFBBB") for pair in pairs), pairs
        interleaved += sum(pair != "FFFFBBB" for pair in pairs)  # a backward piece before the forward ended
        assert sum(event.get("cat") == EXCHANGE_CATEGORY for event in events) == len(results["snapshot"]["exchanges"])
    assert interleaved, "no pair ran a piece of its backward between two of its forward"


def _ws_between_a_fills_b_pieces(halves: str) -> int:
    """The W pieces recorded between two B pieces of one fill (each fill: its B's 3 pieces, the first one first,
    its W's pieces among or after them)."""
    b_pieces, between = 0, 0
    for half in halves:
        b_pieces += half == "B"
        between += half == "W" and b_pieces % 3 != 0
    return between


@pytest.mark.timeout(240)
def test_weight_fills_compute_in_their_backwards_exchange_waits():
    zbv = [option.replace("dualpipev", "zbv") for option in OVERLAPPED]
    per_rank = run_workers(_traced_second_step, 4, composed_runs([BASE + MIXTRAL + zbv]), timeout=200)
    filled_waits = 0
    for results in per_rank:
        pieces = results["snapshot"]["pieces"]
        assert _one_at_a_time(pieces), "two pieces at once"
        halves = "".join(half[-1] for half, _start, _end in pieces)  # "fill B" and "fill W"
        assert halves.count("B") == 3 * results["fills"], (results["fills"], halves)
        filled_waits += _ws_between_a_fills_b_pieces(halves)
    assert sum(results["fills"] for results in per_rank) > 0
    assert filled_waits, "no W computed while its backward waited for an exchange"
