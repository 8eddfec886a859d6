"""``ppctl check-cluster``: prove every process group and measure the links training will use.

Runs inside the workers, started exactly as training starts them. Each group kind is
proved with an all-reduce and an all-gather whose results must equal what the pure
layout predicts; then point-to-point latency and bandwidth between pipeline neighbours
and all-reduce time in each TP and DP group are measured. Every point-to-point message
carries a pattern that depends on its sender; the receiver checks it element by element,
so a link that delivers the wrong bytes fails the check instead of reporting a speed.
Rank 0 prints one table and writes ``cluster.json`` into the run directory.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ppctl.config import PpctlConfig
from ppctl.parallel.groups import ParallelContext

LATENCY_ROUND_TRIPS = 20
BANDWIDTH_BYTES = 4 * 1024 * 1024
BANDWIDTH_ROUND_TRIPS = 4
ALLREDUCE_BYTES = 1024 * 1024
ALLREDUCE_REPEATS = 5


def prove_groups(context: ParallelContext) -> dict[str, str]:
    """For every group kind: 'ok', or what the collectives returned instead of the layout's answer."""
    results = {}
    for name in context.layout.group_names:
        group, expected = context.groups[name], context.group_ranks[name]
        if not expected:
            results[name] = "ok"  # this rank belongs to no group of this kind (embedding, middle stage)
            continue
        total = torch.tensor([float(context.rank)], device=context.device)
        dist.all_reduce(total, group=group)
        gathered = [torch.zeros(1, device=context.device) for _ in expected]
        dist.all_gather(gathered, torch.tensor([float(context.rank)], device=context.device), group=group)
        members = [int(value.item()) for value in gathered]
        if members != expected or int(total.item()) != sum(expected):
            results[name] = f"expected {expected}, all_gather gave {members}, all_reduce gave {int(total.item())}"
        else:
            results[name] = "ok"
    return results


def payload_pattern(sender: int, numel: int, device: str = "cpu") -> torch.Tensor:
    """What ``sender`` sends: element i is ``(i + 7919 * sender) mod 65521``, exact in float32.

    7919 and 65521 are prime, so senders below 65521 never share a pattern and each
    position holds its own value: a message from the wrong rank, shifted, truncated or stale is caught.
    """
    return ((torch.arange(numel, dtype=torch.int64) + 7919 * sender) % 65521).to(torch.float32).to(device)


def _ping_pong(context: ParallelContext, peer: int, initiator: bool, numel: int,
               round_trips: int) -> tuple[float, int]:
    """Seconds per one-way transfer of ``numel`` float32 values to/from ``peer``, and wrong values received.

    Each trip receives into its own buffer (filled with -1, which no pattern holds); the
    buffers are checked against the peer's pattern after the clock stops, so checking
    costs no measured time.
    """
    outgoing = payload_pattern(context.rank, numel, context.device)
    incoming = [torch.full((numel,), -1.0, device=context.device) for _ in range(round_trips)]
    dist.barrier(group=context.groups["pp"])
    start = time.perf_counter()
    for buffer in incoming:
        if initiator:
            dist.send(outgoing, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(outgoing, peer)
    _synchronize(context)
    seconds = (time.perf_counter() - start) / (2 * round_trips)
    expected = payload_pattern(peer, numel, context.device)
    wrong = sum(int((buffer != expected).sum().item()) for buffer in incoming)
    return seconds, wrong


def _synchronize(context: ParallelContext) -> None:
    if context.device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_pipeline_links(context: ParallelContext) -> list[dict]:
    """Latency, bandwidth and payload check from this rank to its next pipeline neighbour, one pair at a time.

    The first rank of each pair reports the link: ``bytes`` moved one way per transfer,
    ``transfer_s`` seconds per transfer (so ``bandwidth_MBps`` is ``bytes / transfer_s / 1e6``),
    and ``payload``: "ok" when both ends received exactly the other's pattern, else what was wrong.
    """
    pp = context.layout.pp
    links = []
    for first in range(pp - 1):
        # All pipeline groups measure pair (first, first+1) at once; other ranks only join the barriers.
        pair = (first, first + 1)
        if context.pp_rank in pair:
            peer = context.pp_peer(pair[1] if context.pp_rank == first else first)
            initiator = context.pp_rank == first
            latency, wrong_small = _ping_pong(context, peer, initiator, 1, LATENCY_ROUND_TRIPS)
            seconds, wrong_large = _ping_pong(context, peer, initiator, BANDWIDTH_BYTES // 4, BANDWIDTH_ROUND_TRIPS)
            payload = _payload_verdict(context, peer, initiator, wrong_small + wrong_large)
            if initiator:
                links.append({"src": context.rank, "dst": peer, "latency_us": latency * 1e6,
                              "bandwidth_MBps": BANDWIDTH_BYTES / seconds / 1e6, "bytes": BANDWIDTH_BYTES,
                              "transfer_s": seconds, "payload": payload})
        else:
            dist.barrier(group=context.groups["pp"])
            dist.barrier(group=context.groups["pp"])
    return links


def _payload_verdict(context: ParallelContext, peer: int, initiator: bool, wrong: int) -> str:
    """The responder tells the initiator how many values it got wrong; the initiator words both counts."""
    count = torch.tensor([float(wrong)], device=context.device)
    if not initiator:
        dist.send(count, peer)
        return "ok" if wrong == 0 else f"{wrong} wrong values"
    dist.recv(count, peer)
    total = LATENCY_ROUND_TRIPS + BANDWIDTH_ROUND_TRIPS * BANDWIDTH_BYTES // 4
    problems = [f"rank {receiver} received {int(bad)} of {total} values wrong from rank {sender}"
                for receiver, sender, bad in ((context.rank, peer, wrong), (peer, context.rank, count.item()))
                if bad]
    return "; ".join(problems) or "ok"


def measure_allreduce(context: ParallelContext, name: str) -> dict | None:
    """Median all-reduce time of a 1 MiB tensor in this rank's ``name`` group (reported by its first rank)."""
    group = context.groups[name]
    tensor = torch.ones(ALLREDUCE_BYTES // 4, device=context.device)
    durations = []
    for _ in range(ALLREDUCE_REPEATS):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        _synchronize(context)
        durations.append(time.perf_counter() - start)
    if context.index(name) != 0:
        return None
    return {"group": name, "ranks": context.group_ranks[name], "ms": statistics.median(durations) * 1e3}


def run_cluster_check(config: PpctlConfig, context: ParallelContext, run_dir: Path) -> None:
    """Prove the groups, measure links, gather to rank 0, print the table; fail on a wrong group or payload."""
    report = {
        "rank": context.rank,
        "proofs": prove_groups(context),
        "links": measure_pipeline_links(context),
        "allreduce": [m for m in (measure_allreduce(context, name) for name in ("tp", "dp")) if m],
    }
    gathered = [None] * context.layout.world_size if context.rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    if context.rank == 0:
        (run_dir / "cluster.json").write_text(json.dumps(gathered, indent=1))
        print_cluster_table(gathered, config)
        failures = [f"group {name} on rank {r['rank']} is wrong: {text}"
                    for r in gathered for name, text in r["proofs"].items() if text != "ok"]
        failures += [f"link {link['src']} <-> {link['dst']} delivered wrong data: {link['payload']}"
                     for r in gathered for link in r["links"] if link["payload"] != "ok"]
        if failures:
            raise RuntimeError(failures[0])


def print_cluster_table(reports: list[dict], config: PpctlConfig) -> None:
    """One rich table: group proofs, pipeline links, all-reduce times."""
    from rich.console import Console
    from rich.table import Table

    parallel = config.parallel
    table = Table(title=f"check-cluster: {len(reports)} ranks, tp={parallel.tp} cp={parallel.cp} "
                        f"dp={parallel.dp} pp={parallel.pp}")
    for column in ("check", "where", "result"):
        table.add_column(column)
    for name in reports[0]["proofs"]:
        bad = [r["rank"] for r in reports if r["proofs"][name] != "ok"]
        table.add_row(f"group {name}", "all ranks", "[green]ok[/]" if not bad else f"[red]wrong on ranks {bad}[/]")
    for link in (link for r in reports for link in r["links"]):
        payload = "payload ok" if link["payload"] == "ok" else f"[red]{link['payload']}[/]"
        table.add_row("p2p pipeline", f"{link['src']} <-> {link['dst']}",
                      f"{link['latency_us']:.0f} us, {link['bandwidth_MBps']:.0f} MB/s, {payload}")
    for measure in (m for r in reports for m in r["allreduce"]):
        table.add_row(f"all-reduce {measure['group']} 1 MiB", str(measure["ranks"]), f"{measure['ms']:.2f} ms")
    Console().print(table)
