"""Real process groups and the DeviceMesh agree with the pure layout, for several orders."""

import pytest

from ppctl.testing import run_workers

LAYOUTS = [dict(tp=2, pp=2, dp=2), dict(tp=2, pp=2, dp=2, order="dp-tp-cp-pp"), dict(cp=2, dp=2, pp=2)]


def _group_ranks(rank, world_size):
    import torch.distributed as dist

    from ppctl.parallel.groups import build_parallel_context
    from ppctl.parallel.layout import GROUP_NAMES, ParallelLayout

    results = []
    for sizes in LAYOUTS:
        context = build_parallel_context(ParallelLayout(**sizes), 30)
        real = {name: (dist.get_process_group_ranks(group) if group is not None else [])
                for name, group in context.groups.items()}
        mesh = {dim: dist.get_process_group_ranks(context.mesh.get_group(dim)) for dim in ("tp", "cp", "dp", "pp")}
        results.append({"real": real, "mesh": mesh, "names": list(GROUP_NAMES)})
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
