"""The simulator's expert all-to-all cost (``Costs.A2A``): every plain forward and input-gradient backward waits it
out, an overlapped pair hides one half's behind the other's compute, and each rank's exposed share is reported.

The figures are small enough to check by hand: with F=B=W=1, one microbatch's all-to-all of ``a`` each way, a rank
of 1F1B (pp=2, 8 microbatches, one chunk) exposes 16 * a; DualPipeV's pairs (a forward of one microbatch with the
whole backward of another) run interleaved, their pieces alternating between exchanges, and expose only what
exceeds the other half's compute.
"""

import pytest

from ppctl.pipeline.replay import action_durations, pair_durations
from ppctl.pipeline.schedules import build_schedule
from ppctl.pipeline.schedules.base import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ppctl.pipeline.simulate import Costs, parse_costs, simulate


def test_plain_actions_wait_out_the_all_to_all_and_a_weight_gradient_does_not():
    durations = action_durations(2, Costs(F=1, B=2, W=1, A2A=0.5))
    assert durations == {FORWARD: 0.75, BACKWARD_INPUT: 1.25, BACKWARD_WEIGHT: 0.5, BACKWARD: 1.75}


# Per chunk (2 chunks): forward compute 0.5, whole backward compute 1.5, each half's all-to-all ``exchange`` in
# ``splits`` exchanges. One split: F0 (0.25), B0 (0.75), F1 once its exchange arrived, B1 once its own did. At
# exchange 1: F0 0-0.25 (arrives 1.25), B0 0.25-1 (arrives 2), F1 1.25-1.5, B1 2-2.75. At 2 splits of 0.5 each the
# pieces are 1/6 and 1/2: F0 ends 1/6, B0 2/3, F1 5/6, B1 7/6-5/3, F2 5/3-11/6, B2 13/6-8/3.
@pytest.mark.parametrize("exchange, splits, pair", [(0.25, 1, 2.0), (1.0, 1, 2.75), (3.0, 1, 4.75), (1.0, 2, 8 / 3)])
def test_a_pair_alternates_its_pieces_each_waiting_for_its_own_exchange(exchange, splits, pair):
    costs = Costs(F=1, B=2, W=1, A2A=2 * exchange, A2A_SPLIT=splits)
    forward, backward = pair_durations(2, costs, BACKWARD)
    assert forward + backward == pytest.approx(pair)
    assert forward / backward == pytest.approx((0.5 + exchange) / (1.5 + exchange))  # shares kept


def test_the_split_is_parsed_as_a_whole_number_of_exchanges():
    assert parse_costs("A2A=1,A2A_SPLIT=4").A2A_SPLIT == 4
    for bad in ("A2A_SPLIT=0", "A2A_SPLIT=1.5"):
        with pytest.raises(ValueError, match="must be a whole number >= 1"):
            parse_costs(bad)


def test_1f1b_exposes_every_all_to_all_and_dualpipev_hides_most():
    costs = Costs(F=1, B=1, W=1, A2A=0.5)
    plain = simulate(build_schedule("1f1b", 2, 1, 8), costs)
    assert plain.exposed_exchanges() == pytest.approx([16 * 0.5, 16 * 0.5])
    assert plain.to_json()["exposed_a2a"] == pytest.approx([8.0, 8.0])
    paired = simulate(build_schedule("dualpipev", 2, 2, 8), costs)
    exposed = paired.exposed_exchanges()
    assert all(0 < time < 8.0 for time in exposed), exposed  # the unpaired actions still expose theirs
    # the same schedule with its pairs run one half after the other (FB = both halves with their exchanges)
    sequential = simulate(build_schedule("dualpipev", 2, 2, 8), Costs(F=1, B=1, W=1, A2A=0.5, FB=4.0))
    assert paired.makespan < sequential.makespan


@pytest.mark.parametrize("weight, hidden", [(1.0, 0.25), (0.25, 0.125)])
def test_a_weight_fill_hides_its_backwards_all_to_all_behind_the_ws_compute(weight, hidden):
    """ZB-V at pp=2 (2 chunks, 4 microbatches): rank 1's 3 fills each hide min(W, a2a) per chunk, a2a = 0.5 / 2, and
    the W takes only what exceeds it; rank 0 has none (its stage 0 is a first stage)."""
    costs = Costs(F=1, B=1, W=weight, A2A=0.5)
    plain = build_schedule("zbv", 2, 2, 4)
    filled = plain.with_weight_fills()
    assert [len(filled.fill_starts(rank)) for rank in range(2)] == [0, 3]
    unfilled, result = simulate(plain, costs).exposed_exchanges(), simulate(filled, costs)
    assert result.exposed_exchanges() == pytest.approx([unfilled[0], unfilled[1] - 3 * hidden])
    w_times = [action.end - action.start for action in result.ranks[1].actions if action.kind == BACKWARD_WEIGHT]
    assert sorted(w_times)[:3] == pytest.approx([weight / 2 - hidden] * 3)
    assert [program["filled"] for program in result.to_json()["program"]["ranks"]] == [[], list(filled.filled[1])]
    fills = [action for action in result.to_json()["ranks"][1]["actions"] if "fill" in action]
    assert [(action["kind"], action["fill"]) for action in fills] == [("B", 0), ("W", 0), ("B", 1), ("W", 1),
                                                                       ("B", 2), ("W", 2)]


def test_the_timeline_marks_each_weight_fills_backward_with_an_ampersand():
    from ppctl.pipeline.render import render_plain, weight_fills

    result = simulate(build_schedule("zbv", 2, 2, 4).with_weight_fills(), Costs(A2A=0.5))
    assert [len(weight_fills(timeline)) for timeline in result.ranks] == [0, 3]
    drawn = render_plain(result.ranks)
    rank1 = next(line for line in drawn.splitlines() if line.startswith("rank 1"))
    assert rank1.count("&") == 3 and "B0.0&" in rank1
    assert "X& then W: a weight fill" in drawn


def test_no_all_to_all_cost_leaves_every_timeline_as_it_was():
    schedule = build_schedule("dualpipev", 2, 2, 8)
    assert simulate(schedule, Costs()).makespan == simulate(schedule, parse_costs("A2A=0")).makespan
    assert "exposed_a2a" not in simulate(schedule, Costs()).to_json()


def test_measured_exposed_all_to_all_counts_only_what_no_compute_covers():
    from ppctl.pipeline.trace import exposed_exchange_seconds

    # one after another: a forward (exchange 1-2 inside 0-3), then a backward (exchange 4-5 inside 3-6)
    assert exposed_exchange_seconds([("F", 0, 3), ("BW", 3, 6)], [(1, 2, 0), (4, 5, 1)]) == 2
    # a pair at once: the forward's exchange 1-2 while the backward computes (its own exchange is 4-5, after the
    # forward ended): only 4-5 is exposed
    assert exposed_exchange_seconds([("F", 0, 3), ("BW", 0.5, 6)], [(1, 2, 0), (4, 5, 1)]) == 1
    # both halves exchanging at once: 1.5-2 is covered by neither
    assert exposed_exchange_seconds([("F", 0, 3), ("BW", 0, 3)], [(1, 2, 0), (1.5, 2.5, 1)]) == 0.5
    # the first stage's W runs its whole backward: its exchanges are its own
    assert exposed_exchange_seconds([("W", 0, 2)], [(0.5, 1, 1)]) == 0.5
    # a weight fill: B 0-1 posts an exchange 1-2.5 (W computes 1-2), B 2.5-3; the W's last piece 3-3.5. Both actions
    # span the fill: its pieces say what computed, so 2-2.5 alone is exposed
    fill = [("fill B", 0, 1), ("fill W", 1, 2), ("fill B", 2.5, 3), ("fill W", 3, 3.5)]
    assert exposed_exchange_seconds([("B", 0, 3), ("W", 0.5, 3.5)], [(1, 2.5, 1)], fill) == 0.5
    assert exposed_exchange_seconds([("B", 0, 3), ("W", 0.5, 3.5)], [(1, 2.5, 1)]) == 1.5  # pieces unknown


def test_costs_fitted_from_a_trace_split_each_action_into_compute_and_its_own_all_to_all():
    from ppctl.pipeline.trace import exchange_costs

    # one rank, two chunks: forwards of 3 ms waiting 1 ms each, whole backwards of 5 ms waiting 1 ms each
    actions = [("F", 0.000, 0.003), ("F", 0.003, 0.006), ("BW", 0.006, 0.011), ("BW", 0.011, 0.016)]
    exchanges = [(0.001, 0.002, 0), (0.004, 0.005, 0), (0.007, 0.008, 1), (0.012, 0.013, 1)]
    costs = exchange_costs([(actions, exchanges)], chunks_per_copy=2, pairs_at_once=True)
    assert (costs.F, costs.B, costs.W, costs.A2A) == pytest.approx((4.0, 8.0, 0.0, 2.0)) and costs.FB is None
    # pairs run one half after the other: a pair lasts both halves, each with its all-to-all
    assert exchange_costs([(actions, exchanges)], 2, pairs_at_once=False).FB == pytest.approx(4 + 8 + 0 + 2 * 2)
    # the forward lane's exchange inside a backward is the other half's, not the backward's own
    paired = exchange_costs([([("F", 0, 0.003), ("BW", 0, 0.005)], [(0.001, 0.002, 0)])], chunks_per_copy=1,
                            pairs_at_once=True)
    assert (paired.F, paired.B, paired.A2A) == pytest.approx((2.0, 5.0, 1.0))
    # a weight fill's B and W are left out of the fit (each span holds both halves): the plain ones give the costs
    plain = [("B", 0.0, 0.004), ("W", 0.004, 0.006)]
    filled = [("B", 0.006, 0.012), ("W", 0.007, 0.013)]
    pieces = [("fill B", 0.006, 0.008), ("fill W", 0.008, 0.010), ("fill B", 0.010, 0.012), ("fill W", 0.012, 0.013)]
    exchanges = [(0.001, 0.002, 1), (0.008, 0.010, 1)]
    costs = exchange_costs([(plain + filled, exchanges, pieces)], chunks_per_copy=1, pairs_at_once=True)
    assert (costs.B, costs.W) == pytest.approx((3.0, 2.0))


@pytest.mark.parametrize("arriving", [[[2, 0, 1], [1, 3, 0]], [[0, 0], [0, 0]], [[1], [2], [0], [4]]])
def test_arrived_rows_regroup_expert_major_as_a_plain_loop_orders_them(arriving):
    import torch

    from ppctl.parallel.expert_parallel import expert_major_order

    counts = torch.tensor(arriving)
    starts, start = {}, 0
    for source, row in enumerate(arriving):  # rows arrive source-major, each source's sorted by local expert
        for expert, count in enumerate(row):
            starts[source, expert], start = start, start + count
    expected = [starts[source, expert] + index for expert in range(counts.shape[1])
                for source in range(counts.shape[0]) for index in range(arriving[source][expert])]
    assert expert_major_order(counts).tolist() == expected
