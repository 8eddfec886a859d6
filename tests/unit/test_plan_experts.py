"""``ppctl plan`` for a mixture of experts: ep enumerated (etp=1), every candidate valid, the experts' all-to-alls in
the step time, and expert parallelism chosen where only its memory fits (with a broken twin that counts the experts
whole at every ep)."""

from dataclasses import replace

import pytest

from ppctl.resolve import compose_config
from ppctl.resolve.resolved import resolve
from ppctl.plan import memory, search
from ppctl.plan.memory import config_memory
from ppctl.plan.search import DEVICES, candidates, compute_bound_s, plan, predict, schedule_bound_s, search_space

H100 = DEVICES["h100"]
GIB = 2 ** 30
MIXTRAL = ["model=mixtral_8x7b", "data=synthetic"]
SHALLOW = [*MIXTRAL, "model.num_layers=4"]  # pp at most 4: on 8 devices the experts split by ep or by nothing


def test_mixtral_on_64_devices_lists_expert_parallel_layouts_that_validate():
    config = compose_config(MIXTRAL)
    found = plan(config, 64, 80 * GIB, 10, H100)
    assert any(prediction.candidate.ep > 1 for prediction in found.candidates)
    for prediction in found.candidates:
        pasted = compose_config(MIXTRAL + prediction.candidate.overrides())  # the line a user pastes
        run = resolve(pasted)
        assert run.sizes.world_size == 64 and f"parallel.ep={run.layout.ep}" in prediction.candidate.overrides()
        assert max(parts.total for parts in config_memory(run)) == prediction.peak_memory_bytes


def test_ep_is_each_divisor_of_a_stages_ranks_that_divides_the_experts():
    config = compose_config(SHALLOW)
    layouts, _ = search_space(config, 16)
    seen = {}
    for variants in layouts:
        first = variants[0]
        assert {variant.ep for variant in variants} == {first.ep}  # ep is the layout's, not a memory saver's
        seen.setdefault((first.tp, first.cp, first.dp), set()).add(first.ep)
    for (tp, cp, dp), eps in seen.items():
        assert eps == {ep for ep in (1, 2, 4, 8, 16) if (tp * cp * dp) % ep == 0 and 8 % ep == 0}
    dense, _ = search_space(compose_config(["model=gpt_small", "data=synthetic"]), 16)
    assert all(variant.ep is None for variants in dense for variant in variants)
    assert not any("parallel.ep" in item for variants in dense for item in variants[0].overrides())
    unfolded = compose_config([*SHALLOW, "parallel.order=tp-cp-pp-dp"])  # no fold: ep=1 alone
    assert {variants[0].ep for variants in search_space(unfolded, 16)[0]} == {1}


def least_memory(config, devices: int) -> dict[int, int]:
    """The least peak memory of any candidate at each ep."""
    least = {}
    for candidate in (variant for variants in candidates(config, devices) for variant in variants):
        try:
            peak = max(parts.total for parts in config_memory(resolve(candidate.apply(config), data=False,
                                                                       prove_schedule=False)))
        except Exception:  # refused by validation
            continue
        least[candidate.ep] = min(least.get(candidate.ep, peak), peak)
    return least


def test_a_limit_that_only_expert_parallelism_fits_chooses_it(monkeypatch):
    """Under the least memory any ep=1 layout needs, the plan still finds layouts: all at ep > 1. Broken twin: the
    experts counted whole at every ep (as at ep=1) changes the answer: nothing fits."""
    config = compose_config(SHALLOW)
    least = least_memory(config, 8)
    assert min(least[ep] for ep in least if ep > 1) < least[1]
    limit = least[1] - 1
    found = plan(config, 8, limit, 5, H100)
    assert found.candidates and all(p.candidate.ep > 1 and p.peak_memory_bytes <= limit for p in found.candidates)
    whole = memory.expert_layer_parameters
    monkeypatch.setattr(memory, "expert_layer_parameters", lambda shape, ep=1: whole(shape, 1))
    twin = plan(config, 8, limit, 5, H100)
    assert [p.candidate for p in twin.candidates] != [p.candidate for p in found.candidates]
    assert twin.candidates == [] and twin.refused[search.TOO_LARGE] > 0


def test_the_experts_all_to_alls_cost_two_each_way_per_moe_layer():
    """F and B each carry two all-to-alls per MoE layer of the rank: the routed rows (tokens x topk) that leave
    it, (ep - 1) / ep of them, at the link's bandwidth, and a latency per peer; none at ep=1."""
    overrides = [*SHALLOW, "parallel.pp=2", "parallel.dp=4", "trainer.micro_batch_size=1"]
    free = replace(H100, collective_latency_s=0.0, intra_node_bandwidth=float("inf"))
    for ep in (1, 2, 4):
        run = resolve(compose_config(overrides + [f"parallel.ep={ep}"]))
        costs, unlinked = search.step_costs(run, H100), search.step_costs(run, free)
        model, trainer = run.config.model, run.config.trainer
        rows = trainer.seq_length * model.moe.topk
        one = (ep - 1) / ep * rows * model.hidden_size * 4 / H100.intra_node_bandwidth + (ep - 1) * H100.ring_step_s
        moe_layers = 2  # 4 layers, every one MoE, over pp=2
        assert costs.F - unlinked.F == pytest.approx(moe_layers * 2 * one, abs=1e-15)
        assert costs.B - unlinked.B == pytest.approx(moe_layers * 2 * one, abs=1e-15)
        assert costs.W == unlinked.W


@pytest.mark.parametrize("devices", [8, 16])
def test_bounds_never_exceed_the_prediction_with_experts(devices):
    """The search's pruning bounds stay below the prediction with the all-to-alls in the costs."""
    config = compose_config(SHALLOW)
    checked = set()
    for variants in candidates(config, devices):
        for candidate in (variants[0], variants[-1]):
            try:
                prediction = predict(config, candidate, H100, prove_schedule=False)
            except Exception:
                continue
            checked.add(candidate.ep)
            built = resolve(candidate.apply(config), check=False)
            assert compute_bound_s(built, H100) <= prediction.step_time_s * (1 + 1e-9)
            assert schedule_bound_s(built, H100) <= prediction.step_time_s * (1 + 1e-9)
            bound = search.step_lower_bound_s(built, search.step_costs(built, H100))
            assert bound <= prediction.step_time_s * (1 + search.ROUNDING_MARGIN)
    assert checked == {1, 2, 4, 8}


def test_the_pruned_search_with_experts_finds_what_the_exhaustive_one_finds():
    from tests.unit.test_plan import exhaustive

    config = compose_config(SHALLOW)
    found = plan(config, 8, 80 * GIB, 5, H100)
    expected = exhaustive(config, 8, 80 * GIB, H100)[:5]
    assert [p.candidate.layout_key for p in found.candidates] == [p.candidate.layout_key for p in expected]
