"""The workers' part of ``ppctl bench``: time both sides in turns, measure memory and the bubble, write the result.

For each schedule of the request, every rank builds ppctl's ``Trainer`` and the other
side, then runs ``repeats + 1`` rounds; in each round each side trains one block of
``steps`` steps (the same step numbers, so the same data), after a barrier, and the
block's time is the slowest rank's. Round 0 warms up (AdamW state, buffers, torch's
shape inference) and is not timed. Then, untimed: one step per side under the memory
measurement (``ppctl.run.memory``), one traced ppctl step (its measured timeline), and a
ping-pong of one activation message between the first two pipeline ranks (the
communication cost the simulator is given). Rank 0 writes ``bench.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ppctl.resolve import load_config_file
from ppctl.resolve.resolved import ResolvedConfig, resolve
from ppctl.parallel.groups import ParallelContext, build_parallel_context
from ppctl.pipeline.simulate import simulate
from ppctl.pipeline.trace import (costs_from_measurement, exchange_costs, exposed_exchange_seconds,
                                  measured_makespan_and_bubble, measured_timelines, on_core_shares,
                                  overhead_per_action, posting_fit, simulate_with_posting)
from ppctl.run.memory import step_peak_bytes
from ppctl.run.train import Trainer

from .rules import BenchRequest, LOSS_TOLERANCE, max_relative_difference, median_ratio
from .sides import PpctlSide, other_side

PING_PONGS = 10
UPDATE_STEPS = 3  # steps whose update (clipping and AdamW) is timed on its own
ALL_REDUCE_SIZES = (1024, 1 << 20)  # float32 elements: a latency-bound and a bandwidth-bound all-reduce
ALL_REDUCES = 10
# After a compute burst of about a transformer sublayer on this CPU (a 256 x 256 x 256 matmul), as TP's and CP's
# collectives follow each rank's own layer work: the wait for the slowest member that a lockstep all-reduce hides.
BURST_SIZE = 256
BURSTS = 30


def run_bench(context: ParallelContext, run_dir: Path) -> None:
    """Run every schedule of ``run_dir/bench_request.json``; rank 0 writes ``run_dir/bench.json``."""
    request = BenchRequest.from_json(json.loads((run_dir / "bench_request.json").read_text()))
    results = []
    for config_file in request.configs:
        resolved = resolve(load_config_file(run_dir / config_file), check=False)  # validated by the launcher
        results.append(bench_schedule(resolved, context_for(resolved, context), request))
    if context.rank == 0:
        temporary = run_dir / "bench.json.tmp"
        temporary.write_text(json.dumps(results, indent=1))
        temporary.replace(run_dir / "bench.json")


def context_for(resolved: ResolvedConfig, context: ParallelContext) -> ParallelContext:
    """``context`` when the config's layout is its layout, else a new one (another schedule places other chunks)."""
    layout = resolved.layout
    if layout == context.layout:
        return context
    fresh = build_parallel_context(layout, resolved.config.launcher.timeout_s, context.device.split(":")[0])
    fresh.device = context.device
    return fresh


def bench_schedule(resolved: ResolvedConfig, context: ParallelContext, request: BenchRequest) -> dict | None:
    """One schedule's figures (on rank 0; None elsewhere)."""
    config = resolved.config
    sides = [PpctlSide(Trainer(resolved, context))]
    other = other_side(request.against, resolved, context)
    sides += [other] if other is not None else []
    seconds = {side.name: [] for side in sides}
    losses = {side.name: [] for side in sides}
    for round_index in range(request.repeats + 1):
        for side in sides:
            first = round_index * request.steps
            elapsed, block_losses = timed_block(side, first, request.steps, context)
            losses[side.name] += block_losses
            if round_index:
                seconds[side.name].append(elapsed / request.steps)
    next_step = (request.repeats + 1) * request.steps
    memory = {side.name: step_peak_bytes(lambda side=side: side.run_steps(next_step, 1), side.holder, context.device)
              for side in sides}
    trainer = sides[0].trainer
    snapshot = traced_snapshot(trainer, next_step + 1, request.steps)
    comm = one_way_seconds(trainer, context)
    all_reduce_s = {numel: all_reduce_seconds(numel, context) for numel in ALL_REDUCE_SIZES}
    mine = {"losses": losses, "memory": memory, "snapshot": snapshot, "rank": context.rank,
            "update_s": update_seconds(trainer, next_step + 1 + request.steps),
            "parameters": sum(param.numel() for param in trainer.named_parameters().values()),
            "all_reduce_s": {str(numel): seconds for numel, seconds in all_reduce_s.items()},
            "collective_wait_s": collective_wait_seconds(context, all_reduce_s[ALL_REDUCE_SIZES[0]])}
    gathered = [None] * dist.get_world_size() if context.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if context.rank != 0:
        return None
    return summarise(config, trainer, request, seconds, gathered, comm)


def timed_block(side, first: int, count: int, context: ParallelContext) -> tuple[float, list[float | None]]:
    """(the slowest rank's seconds for ``count`` steps of ``side`` from ``first``, this rank's losses)."""
    dist.barrier()
    started = time.perf_counter()
    block_losses = side.run_steps(first, count)
    _synchronize(context.device)
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=context.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()), block_losses


def traced_snapshot(trainer: Trainer, step: int, steps: int) -> dict:
    """This rank's measured actions and waits in one traced run (a block of ``steps`` steps when the schedule
    streams them, else one step) of ``trainer.last_program``."""
    trainer.set_tracing(True)
    try:
        trainer.train_steps(step, steps if trainer.stream is not None else 1)
        return trainer.tracer.snapshot()
    finally:
        trainer.set_tracing(False)


def update_seconds(trainer: Trainer, first_step: int) -> float:
    """This rank's median time of the step's update (``apply_gradients``: clipping and the optimizer) over
    ``UPDATE_STEPS`` steps from ``first_step``; 0 for a schedule that streams steps (its updates run inside)."""
    if trainer.stream is not None:
        return 0.0
    times = []
    for step in range(first_step, first_step + UPDATE_STEPS):
        _, grad_norm = trainer.compute_gradients(step)
        started = time.perf_counter()
        trainer.apply_gradients(step, grad_norm)
        _synchronize(trainer.context.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def all_reduce_seconds(numel: int, context: ParallelContext) -> float:
    """The median time of an all-reduce of ``numel`` float32 elements over every worker (after a barrier each)."""
    tensor = torch.ones(numel, device=context.device)
    times = []
    for _ in range(ALL_REDUCES + 1):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        _synchronize(context.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def collective_wait_seconds(context: ParallelContext, lockstep_s: float) -> float:
    """What a small all-reduce over every worker costs beyond its lockstep time ``lockstep_s``
    (``all_reduce_seconds`` of ``ALL_REDUCE_SIZES[0]`` elements) when each worker computes first (``BURSTS``
    rounds of a matmul then the all-reduce, no barrier between): the median round less the median matmul alone
    and ``lockstep_s``, at least 0. The workers' compute drifts apart by a little every round and each
    collective waits for the last of them; TP's and CP's collectives, which follow every rank's own layer work,
    pay it each time."""
    left = torch.randn(BURST_SIZE, BURST_SIZE, device=context.device)
    right, tensor = torch.randn_like(left), torch.ones(ALL_REDUCE_SIZES[0], device=context.device)
    alone = _median_seconds(lambda: torch.mm(left, right), context.device, BURSTS)
    dist.barrier()
    rounds = _median_seconds(lambda: (torch.mm(left, right), dist.all_reduce(tensor)), context.device, BURSTS)
    return max(rounds - alone - lockstep_s, 0.0)


def _median_seconds(work, device: str, times: int) -> float:
    """The median seconds of ``work()`` over ``times`` calls after one untimed call, back to back."""
    work()
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        work()
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _synchronize(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that a host clock times it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def one_way_seconds(trainer: Trainer, context: ParallelContext) -> float:
    """Median one-way time of one activation message between pipeline ranks 0 and 1 (half a round trip), the same
    on every rank; 0 without a pipeline."""
    timing = torch.zeros(1, dtype=torch.float64, device=context.device)
    if context.layout.pp > 1 and context.pp_rank in (0, 1):
        spec = next(stage.io.output or stage.io.input for stage in trainer.stages.values()
                    if stage.io.output or stage.io.input)
        message = torch.zeros(spec.shape, dtype=spec.dtype, device=context.device)
        peer = context.pp_peer(1 - context.pp_rank)
        trips = []
        for _ in range(PING_PONGS + 1):
            started = time.perf_counter()
            for sender in (0, 1):
                (dist.send if context.pp_rank == sender else dist.recv)(message, peer)
            _synchronize(context.device)
            trips.append(time.perf_counter() - started)
        timing[0] = statistics.median(trips[1:]) / 2
    dist.all_reduce(timing, op=dist.ReduceOp.MAX)
    return float(timing.item())


def summarise(config: PpctlConfig, trainer: Trainer, request: BenchRequest, seconds: dict, gathered: list[dict],
              comm: float) -> dict:
    """The JSON object of one schedule (docs/bench.md lists the keys)."""
    losses = {name: _loss_rank_losses(gathered, name) for name in seconds}
    ours = statistics.median(seconds["ppctl"])
    other_name = next((name for name in seconds if name != "ppctl"), None)
    result = {"schedule": config.schedule.name, "pp": config.parallel.pp, "vpp": config.parallel.vpp,
              "microbatches": trainer.data.num_microbatches, "against": request.against,
              "steps_per_block": request.steps, "repeats": request.repeats,
              "ppctl_step_s": ours, "other_step_s": None, "ratio": None, "ratios_per_block": None,
              "ppctl_blocks_s": seconds["ppctl"], "other_blocks_s": None, "loss_max_rel_diff": None,
              "loss_tolerance": LOSS_TOLERANCE.get(config.trainer.precision)}
    if other_name is not None:
        ratio, per_block = median_ratio(seconds["ppctl"], seconds[other_name])
        result.update(other_step_s=statistics.median(seconds[other_name]), ratio=ratio, ratios_per_block=per_block,
                      other_blocks_s=seconds[other_name],
                      loss_max_rel_diff=max_relative_difference(losses["ppctl"], losses[other_name]))
    result["peak_memory_bytes"] = {name: [entry["memory"][name] for entry in sorted(gathered, key=_rank)]
                                   for name in seconds}
    result["losses"] = losses
    result.update(step_outside_figures(gathered))
    result.update(bubble_figures(trainer, gathered, comm))
    return result


def step_outside_figures(gathered: list[dict]) -> dict:
    """What the step costs beyond the pipeline, for ``ppctl plan --calibrate``: the slowest rank's update time and
    its parameter count, each all-reduce size's slowest time over the world (``world_size`` workers), and the
    slowest rank's wait of a collective after compute (``collective_wait_seconds``); and the cores the workers had
    (the machine's that this process may run on: a CPU run with more workers than these shared them)."""
    slowest = max(gathered, key=lambda entry: entry["update_s"])
    sizes = gathered[0]["all_reduce_s"]
    return {"update_s": slowest["update_s"], "update_parameters": slowest["parameters"],
            "all_reduce_s": {size: max(entry["all_reduce_s"][size] for entry in gathered) for size in sizes},
            "collective_wait_s": max(entry["collective_wait_s"] for entry in gathered),
            "world_size": len(gathered), "cores": len(os.sched_getaffinity(0))}


def _rank(entry: dict) -> int:
    return entry["rank"]


def _loss_rank_losses(gathered: list[dict], name: str) -> list[float]:
    """The step losses of ``name`` on the first rank that holds them."""
    for entry in sorted(gathered, key=_rank):
        values = entry["losses"][name]
        if values and values[0] is not None:
            return values
    return []


def bubble_figures(trainer: Trainer, gathered: list[dict], comm: float) -> dict:
    """The traced run's measured makespan and bubble, and the simulator's for the same program with F, B, W fitted
    to the measured mean action times and ``comm`` to the measured message time."""
    context, program = trainer.context, trainer.last_program
    schedule = program.schedule
    pipeline_ranks = context.layout.group_of("pp", context.layout.rank(**{**context.coords, "pp": 0}))
    rows = measured_timelines([entry["snapshot"] for entry in gathered], pipeline_ranks, program)
    makespan, bubble = measured_makespan_and_bubble(rows)
    fitted = dataclasses.replace(costs_from_measurement(rows, schedule.chunks_per_copy), comm=comm * 1e3)
    predicted = simulate(program, fitted)
    with_overhead = dataclasses.replace(costs_from_measurement(rows, schedule.chunks_per_copy, True), comm=comm * 1e3)
    charged = simulate(program, with_overhead)
    posting = posting_fit(rows, program)
    posted_makespan, posted_bubble = simulate_with_posting(program, fitted, posting)
    return {"bubble_measured": bubble, "bubble_simulated": predicted.bubble_ratio,
            "makespan_measured_s": makespan / 1e3, "makespan_simulated_s": predicted.makespan / 1e3,
            "fitted_costs_ms": fitted.to_json(), "overhead_per_action_ms": overhead_per_action(rows),
            "makespan_simulated_with_overhead_s": charged.makespan / 1e3,
            "posting_ms": dataclasses.asdict(posting), "makespan_simulated_with_posting_s": posted_makespan / 1e3,
            "bubble_simulated_with_posting": posted_bubble,
            "on_core_share": _on_core_by_pipeline_rank(gathered, pipeline_ranks),
            "all_to_all": _all_to_all_figures(trainer, gathered, pipeline_ranks, comm)}


def _all_to_all_figures(trainer: Trainer, gathered: list[dict], pipeline_ranks: list[int], comm: float) -> dict | None:
    """With expert parallelism, the traced pipeline's ranks' mean all-to-all time per step, its exposed part
    (``exposed_exchange_seconds``) and the simulator's exposed part at the costs fitted with ``A2A``, in ms;
    None without exchanges."""
    by_rank = {entry["rank"]: entry["snapshot"] for entry in gathered}
    ranks = [([(kind, start, end) for kind, _stage, _mb, start, end in by_rank[rank]["actions"]],
              by_rank[rank].get("exchanges", []), by_rank[rank].get("pieces", [])) for rank in pipeline_ranks]
    if not any(exchanges for _actions, exchanges, _pieces in ranks):
        return None
    program = trainer.last_program
    costs = dataclasses.replace(exchange_costs(ranks, program.schedule.chunks_per_copy, trainer.runtime.overlap_pairs),
                                comm=comm * 1e3)
    simulated = simulate(program, costs).exposed_exchanges()
    return {"total_ms": statistics.mean(sum(end - start for start, end, _ in exchanges) * 1e3
                                        for _actions, exchanges, _pieces in ranks),
            "exposed_measured_ms": statistics.mean(exposed_exchange_seconds(*rank) * 1e3 for rank in ranks),
            "exposed_simulated_ms": statistics.mean(simulated), "fitted_costs_ms": costs.to_json()}


def _on_core_by_pipeline_rank(gathered: list[dict], pipeline_ranks: list[int]) -> dict[str, list[float]] | None:
    """``on_core_shares`` of the traced pipeline's ranks in order: {"actions": [...], "between": [...]}."""
    by_rank = {entry["rank"]: on_core_shares(entry["snapshot"]) for entry in gathered}
    shares = [by_rank[rank] for rank in pipeline_ranks]
    if any(share is None for share in shares):
        return None
    return {part: [share[part] for share in shares] for part in ("actions", "between")}
