"""Real process groups and the DeviceMesh agree with the pure layout, for several orders.

Also: the communicators' warm-up before step 0 completes on each of these layouts, check-cluster proves
every group kind of each, and its point-to-point check reports a link that delivers the wrong data.
"""

import pytest

from tests.harness.pool import run_workers

LAYOUTS = [dict(tp=2, pp=2, dp=2), dict(tp=2, pp=2, dp=2, order="dp-tp-cp-pp"), dict(cp=2, dp=2, pp=2)]


def _group_ranks(rank, world_size):
    import torch.distributed as dist

    from ppctl.parallel.groups import build_parallel_context, warm_up_communicators
    from ppctl.parallel.layout import GROUP_NAMES, ParallelLayout
    from ppctl.run.cluster import prove_groups

    results = []
    for sizes in LAYOUTS:
        context = build_parallel_context(ParallelLayout(**sizes), 30)
        warm_up_communicators(context)  # every group and pipeline neighbour once, in one order: no rank waits forever
        real = {name: (dist.get_process_group_ranks(group) if group is not None else [])
                for name, group in context.groups.items()}
        mesh = {dim: dist.get_process_group_ranks(context.mesh.get_group(dim)) for dim in ("tp", "cp", "dp", "pp")}
        results.append({"real": real, "mesh": mesh, "names": list(GROUP_NAMES), "proofs": prove_groups(context)})
    return results


@pytest.mark.timeout(180)
def test_groups_and_mesh_match_layout():
    from ppctl.parallel.layout import ParallelLayout

    per_rank = run_workers(_group_ranks, 8, timeout=150)
    for index, sizes in enumerate(LAYOUTS):
        layout = ParallelLayout(**sizes)
        for rank, results in enumerate(per_rank):
            result = results[index]
            for name in result["names"]:
                assert result["real"][name] == layout.group_of(name, rank), (sizes, rank, name)
            for dim, ranks in result["mesh"].items():
                assert ranks == layout.group_of(dim, rank), (sizes, rank, dim)
            # check-cluster's proof of every group kind (an all-reduce and an all-gather against the layout)
            assert result["proofs"] == {name: "ok" for name in result["names"]}, (sizes, rank)


def _links_with_liar(rank, world_size):
    """check-cluster's link measurement on pp=2, honest and then with each rank sending another rank's pattern."""
    import ppctl.run.cluster as cluster
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.parallel.layout import ParallelLayout

    context = build_parallel_context(ParallelLayout(pp=2), 30)
    honest = cluster.payload_pattern
    reports = {}
    for liar in (None, 0, 1):
        if rank == liar:  # this rank sends rank 4's pattern but still expects its peer's true one
            cluster.payload_pattern = lambda sender, numel, device="cpu": honest(
                sender + 4 * (sender == liar), numel, device)
        reports[liar] = cluster.measure_pipeline_links(context)
        cluster.payload_pattern = honest
    return reports


@pytest.mark.timeout(120)
def test_check_cluster_link_check_catches_a_wrong_payload():
    """A link whose receiver gets other bytes than its sender's pattern is reported, whichever end received them."""
    from ppctl.run.cluster import BANDWIDTH_BYTES, BANDWIDTH_ROUND_TRIPS, LATENCY_ROUND_TRIPS

    first, second = run_workers(_links_with_liar, 2, timeout=100)
    assert second == {None: [], 0: [], 1: []}  # the second pp rank reports no link of its own
    total = LATENCY_ROUND_TRIPS + BANDWIDTH_ROUND_TRIPS * BANDWIDTH_BYTES // 4
    assert [(link["src"], link["dst"]) for link in first[None]] == [(0, 1)]
    assert first[None][0]["payload"] == "ok"
    assert first[1][0]["payload"] == f"rank 0 received {total} of {total} values wrong from rank 1"
    assert first[0][0]["payload"] == f"rank 1 received {total} of {total} values wrong from rank 0"
