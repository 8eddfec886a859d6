"""``ppctl plan``'s search (``ppctl.plan.search``), pure: every candidate it prints passes ``train``'s validation
and fits the memory it was given, the pruning changes nothing against the exhaustive search, the overrides it
prints compose to the config it judged, and calibration turns measured times into the device's figures."""

from dataclasses import replace

import pytest

from ppctl.cli.calibrate import Calibration
from ppctl.resolve import compose_config, validate
from ppctl.resolve.resolved import resolve
from ppctl.pipeline.simulate import Costs
from ppctl.plan import search
from ppctl.plan.memory import config_memory
from ppctl.plan.search import (DEVICES, NOT_EXAMINED, calibrated_device, candidates, compute_bound_s, plan, predict,
                               schedule_bound_s, search_space)

BASE = ["model=gpt_small", "data=synthetic", "trainer.global_batch_size=32", "trainer.seq_length=256",
        "model.num_layers=8"]
H100 = DEVICES["h100"]
GIB = 2 ** 30


@pytest.fixture(scope="module")
def base():
    return compose_config(BASE)


def exhaustive(config, devices, memory_bytes, device):
    """Every candidate predicted, no pruning: the first fitting variant of each layout, fastest first."""
    kept = []
    for variants in candidates(config, devices):
        for candidate in variants:
            try:
                prediction = predict(config, candidate, device)
            except Exception:  # refused by validation
                continue
            if prediction.peak_memory_bytes <= memory_bytes:
                kept.append(prediction)
                break
    return sorted(kept, key=lambda p: (p.step_time_s, p.peak_memory_bytes))


@pytest.mark.parametrize("devices,memory_gb", [(8, 80), (16, 80), (8, 1.0)])
def test_pruned_search_finds_what_the_exhaustive_one_finds(base, devices, memory_gb):
    found = plan(base, devices, memory_gb * GIB, 5, H100)
    expected = exhaustive(base, devices, memory_gb * GIB, H100)[:5]
    assert [p.step_time_s for p in found.candidates] == pytest.approx([p.step_time_s for p in expected])
    assert [p.candidate.layout_key for p in found.candidates] == [p.candidate.layout_key for p in expected]
    layouts, left_out = search_space(base, devices)  # refused counts those left out before validation too
    assert sum(found.refused.values()) + len(found.candidates) <= sum(map(len, layouts)) + sum(left_out.values())


@pytest.mark.parametrize("devices,memory_gb", [(8, 80), (8, 1.0), (32, 40)])
def test_every_candidate_passes_validation_and_fits(base, devices, memory_gb):
    found = plan(base, devices, memory_gb * GIB, 8, H100)
    assert found.candidates
    for prediction in found.candidates:
        pasted = compose_config(BASE + prediction.candidate.overrides())  # the line a user pastes
        run = resolve(pasted)
        assert run.sizes.world_size == devices
        assert max(parts.total for parts in config_memory(run)) == prediction.peak_memory_bytes
        assert prediction.peak_memory_bytes <= memory_gb * GIB
    times = [prediction.step_time_s for prediction in found.candidates]
    assert times == sorted(times)


def test_a_tight_memory_limit_chooses_memory_savers_and_refuses_what_cannot_fit(base):
    roomy = plan(base, 8, 80 * GIB, 3, H100)
    tight_limit = min(p.peak_memory_bytes for p in roomy.candidates) * 0.6
    tight = plan(base, 8, tight_limit, 3, H100)
    assert tight.refused[search.TOO_LARGE] > 0
    assert all(p.peak_memory_bytes <= tight_limit for p in tight.candidates)
    nothing = plan(base, 8, 1024, 3, H100)  # 1 KiB: nothing fits
    assert nothing.candidates == [] and nothing.refused[search.TOO_LARGE] > 0


def test_bounds_never_exceed_the_prediction(base):
    for variants in candidates(base, 16):
        candidate = variants[0]
        try:
            prediction = predict(base, candidate, H100)
        except Exception:
            continue
        built = resolve(candidate.apply(base), check=False)
        assert compute_bound_s(built, H100) <= prediction.step_time_s * (1 + 1e-9)
        assert schedule_bound_s(built, H100) <= prediction.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("devices,device", [(8, H100), (16, H100), (8, replace(H100, cores=2))])
def test_the_step_lower_bound_never_exceeds_the_prediction(base, devices, device):
    """The bound that spares a candidate's simulation, for every variant (recomputation makes B the largest cost),
    also where the devices share two cores."""
    for variants in candidates(base, devices):
        for candidate in variants:
            try:
                prediction = predict(base, candidate, device, prove_schedule=False)
            except Exception:
                continue
            built = resolve(candidate.apply(base), check=False)
            bound = search.step_lower_bound_s(built, search.step_costs(built, device))
            assert bound <= prediction.step_time_s * (1 + search.ROUNDING_MARGIN)


def test_the_search_stops_early_and_counts_what_it_left(base):
    found = plan(base, 16, 80 * GIB, 1, H100)
    assert found.refused[NOT_EXAMINED] > 0
    json = found.to_json()
    assert set(json) == {"candidates", "refused"}
    assert set(json["candidates"][0]) >= {"overrides", "step_time_s", "bubble_ratio", "peak_memory_bytes"}


def test_a_schedule_the_checker_refuses_leaves_the_list_as_in_the_exhaustive_search(base, monkeypatch):
    """The checker proves only the list's schedules at the end; one it refuses is searched again as refused: the
    list is the exhaustive search's (which proves every candidate), and the refusal is counted under its rule."""
    import importlib

    validation = importlib.import_module("ppctl.resolve.validate")  # the module: the package exports the function

    roomy = plan(base, 8, 80 * GIB, 3, H100)
    winner = roomy.candidates[0].candidate.apply(base)
    refused_key = search._schedule_key(winner)
    proved, checked = validation._built_schedule_problem, []

    def checker(name, pp, vpp, microbatches, fills=False):
        checked.append((name, pp, vpp, microbatches))
        refused = (name, pp, vpp, microbatches) == refused_key
        return "refused here" if refused else proved(name, pp, vpp, microbatches, fills)

    monkeypatch.setattr(validation, "_built_schedule_problem", checker)
    found = plan(base, 8, 80 * GIB, 3, H100)
    proved_by_the_search = set(checked)
    expected = exhaustive(base, 8, 80 * GIB, H100)[:3]
    assert [p.candidate.layout_key for p in found.candidates] == [p.candidate.layout_key for p in expected]
    assert refused_key not in {search._schedule_key(p.candidate.apply(base)) for p in found.candidates}
    assert found.refused["refused by validation: schedule " + refused_key[0]] >= 1
    # the search proved the schedules of its two lists only: the first, with the refused one, and the second
    assert refused_key in proved_by_the_search and len(proved_by_the_search) <= 2 * 3


def test_the_search_pauses_the_collector_and_leaves_it_as_it_was(base, monkeypatch):
    """The collector is paused while the search runs (its kept schedules hold millions of tuples), resumed after,
    and left off where it was off; the search leaves no cycle for it to collect."""
    import gc

    seen, original = [], search._first_fitting

    def first_fitting(*args):
        seen.append(gc.isenabled())
        return original(*args)

    monkeypatch.setattr(search, "_first_fitting", first_fitting)
    gc.collect()
    assert plan(base, 8, 80 * GIB, 3, H100).candidates and seen and not any(seen)
    assert gc.isenabled() and gc.collect() == 0
    gc.disable()
    try:
        plan(base, 8, 80 * GIB, 3, H100)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_layers_that_do_not_divide_get_balance_auto(base):
    config = replace(base, model=replace(base.model, num_layers=7))
    found = plan(config, 4, 80 * GIB, 10, H100)
    uneven = [p for p in found.candidates if p.candidate.pp > 1]
    assert uneven and all("parallel.balance=auto" in p.candidate.overrides() for p in uneven)


def test_calibration_gives_the_measured_throughput_back(base):
    measured = resolve(compose_config(BASE + ["parallel.pp=2", "trainer.micro_batch_size=1"]))
    forward_s = search.forward_flops_per_microbatch(measured) / 1e12  # a device of 1 TFLOP/s
    overhead_ms = 0.5
    costs = Costs(F=forward_s * 1e3 + overhead_ms, B=forward_s * 1e3 + overhead_ms, W=forward_s * 1e3 + overhead_ms,
                  comm=0.25)
    calibration = Calibration("bench.json", costs, overhead_ms, "1f1b", 2, 10.0, 0.1, True)
    device = calibrated_device(H100, calibration, measured)
    assert device.flops == pytest.approx(1e12)
    assert device.overhead_s == pytest.approx(5e-4) and device.latency_s == pytest.approx(2.5e-4)
    # the measured run's own layout predicted back: the same F, B, W and message time
    step = search.step_costs(measured, device)
    assert (step.F * 1e3, step.B * 1e3, step.W * 1e3, step.comm * 1e3) == pytest.approx(
        (costs.F, costs.B, costs.W, costs.comm))
    broken = Calibration("bench.json", Costs(F=0.1, B=0.1, W=0.1, comm=0), 1.0, "1f1b", 2, 10.0, 0.1, True)
    with pytest.raises(ValueError, match="no compute time"):
        calibrated_device(H100, broken, measured)


def test_a_bench_calibration_predicts_its_update_and_collectives_back(base):
    """The update's time per parameter comes back on the measured layout, is shared by the distributed optimizer's
    replicas, and TP's all-reduces cost their ring steps."""
    measured = resolve(compose_config(BASE + ["parallel.pp=2", "trainer.micro_batch_size=1"]))
    costs = Costs(F=10.0, B=10.0, W=0.0, comm=0.25)
    calibration = replace(Calibration("bench.json", costs, 0.0, "1f1b", 2, 10.0, 0.1, True),
                          update_s_per_parameter=1e-8, ring_step_s=1e-4, bus_bandwidth=1e9)
    device = calibrated_device(H100, calibration, measured)
    busiest = max(parts.parameters for parts in config_memory(measured))
    parameters = busiest / search.DTYPE_BYTES["fp32"]
    assert search.update_s(measured, device) == pytest.approx(parameters * 1e-8)
    replicated = resolve(compose_config(BASE + ["parallel.pp=1", "parallel.dp=2"]))
    sharded = resolve(compose_config(BASE + ["parallel.pp=1", "parallel.dp=2", "optimizer.distributed=true"]))
    assert search.update_s(sharded, device) == pytest.approx(search.update_s(replicated, device) / 2)
    tp2 = resolve(compose_config(BASE + ["parallel.pp=1", "parallel.tp=2", "trainer.micro_batch_size=1"]))
    free = replace(device, collective_latency_s=0.0, intra_node_bandwidth=float("inf"))
    layers = tp2.config.model.num_layers
    extra = search.step_costs(tp2, device).F - search.step_costs(tp2, free).F
    tokens, hidden = tp2.config.trainer.seq_length, tp2.config.model.hidden_size
    assert extra == pytest.approx(layers * 2 * (2 * 1e-4 + 4 * tokens * hidden / 1e9))  # 2 all-reduces per layer
    waiting = calibrated_device(H100, replace(calibration, collective_wait_s=3e-4), measured)
    assert waiting.collective_wait_s == pytest.approx(3e-4) and device.collective_wait_s == 0.0
    waited = search.step_costs(tp2, waiting).F - search.step_costs(tp2, device).F
    assert waited == pytest.approx(layers * 2 * 3e-4)  # each all-reduce waits once for its slowest member
    assert search.step_costs(measured, waiting).F == pytest.approx(search.step_costs(measured, device).F)  # no TP


def test_recomputation_costs_what_it_runs_again():
    """Full recomputation runs each layer's forward again, its TP all-reduces included; selective only the
    attention core, which holds no collective."""
    tp2 = BASE + ["parallel.pp=1", "parallel.tp=2", "trainer.micro_batch_size=1"]
    plain, full, selective = (search.step_costs(resolve(compose_config(tp2 + [f"model.recompute={mode}"])), H100)
                              for mode in ("none", "full", "selective"))
    assert full.B - plain.B == pytest.approx(plain.F)  # a whole forward, collectives and all
    free = replace(H100, collective_latency_s=0.0, intra_node_bandwidth=float("inf"))
    no_links = search.step_costs(resolve(compose_config(tp2 + ["model.recompute=selective"])), free)
    assert selective.B - plain.B == pytest.approx(no_links.B - search.step_costs(resolve(compose_config(tp2)), free).B)
    assert 0 < selective.B - plain.B < plain.F


def test_devices_sharing_cores_compute_at_the_measured_share_and_wait_for_a_core():
    """A calibration from four workers on two cores: the FLOP/s of the actions' time on a core, and predictions that
    share the two cores where the processes outnumber them: never below the same costs on a core each, equal where
    they do not outnumber them, and a pipeline of pp=1 with dp=4 at half speed."""
    measured = resolve(compose_config(BASE + ["parallel.pp=2", "trainer.micro_batch_size=1"]))
    calibration = Calibration("bench.json", Costs(F=10.0, B=20.0, W=0.0, comm=0.1), 0.0, "1f1b", 2, 10.0, 0.1,
                              True)
    alone = calibrated_device(H100, calibration, measured)
    shared = calibrated_device(H100, replace(calibration, cores=2, on_core_share=0.5), measured)
    assert shared.cores == 2 and shared.flops == pytest.approx(2 * alone.flops)
    a_core_each = replace(shared, cores=None)
    for overrides in (["parallel.pp=4"], ["parallel.pp=2", "parallel.dp=2"], ["parallel.pp=1", "parallel.dp=4"],
                      ["parallel.pp=4", "schedule=zbv", "parallel.vpp=2"], ["parallel.tp=2", "parallel.pp=2"]):
        config = resolve(compose_config(BASE + overrides))
        costs = search.step_costs(config, shared)
        assert costs.sharing == (2, config.layout.tp * config.layout.dp)
        assert search.simulated_step(config, costs)[0] >= \
            search.simulated_step(config, search.step_costs(config, a_core_each))[0] * (1 - 1e-12)
    two = resolve(compose_config(BASE + ["parallel.pp=2"]))
    assert search.step_costs(two, shared).sharing is None  # two processes, two cores
    replicas = resolve(compose_config(BASE + ["parallel.pp=1", "parallel.dp=4"]))
    costs = search.step_costs(replicas, shared)
    makespan = search.simulated_step(replicas, costs)[0] - costs.reduction
    microbatches = costs.microbatches
    assert makespan == pytest.approx(2 * microbatches * (costs.F + costs.B + costs.W))  # four processes, two cores


def test_the_pruned_search_on_shared_cores_finds_what_the_exhaustive_one_finds(base):
    device = replace(H100, cores=2)
    found = plan(base, 8, 80 * GIB, 5, device)
    expected = exhaustive(base, 8, 80 * GIB, device)[:5]
    assert [p.candidate.layout_key for p in found.candidates] == [p.candidate.layout_key for p in expected]
