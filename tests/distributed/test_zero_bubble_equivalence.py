"""ZB-H1, ZB-V, V-Half, V-Min, the looped schedules torch defines (interleaved zero bubble, breadth-first),
Hanayo's waves, PipeDream-2BW and schedules read from files train exactly like one process (gloo workers).

Each run is compared with the single-process run by ``assert_equivalent``: per-step loss
and grad norm, step-0 gradients and final parameters. ZB-V puts both the embedding
and the output layer on pp rank 0, so the tied-embedding runs sum the two local copies
there (plain and distributed optimizer).
"""

import pytest

from tests.distributed.equivalence import BASE, FP64, LLAMA, STEPS, assert_equivalent

TIED = ["model.tie_embeddings=true"]
# PipeDream-2BW: its delayed update asked for, and no global-norm clipping (which would need a barrier)
TWO_BW = ["schedule=pipedream_2bw", "optimizer.gradient_delay=1", "optimizer.clip_grad=0"]


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_zb_h1_and_zbv_at_world_size_4_match_single_process():
    """One launch of four workers: ZB-H1 at tp=2 pp=2 (tied; and float64 with sequence parallelism) and at
    pp=4 (float64), ZB-V at pp=4 (tied), interleaved zero bubble at pp=4 (tied, 4 and 8 microbatches: one
    round and two), breadth-first at pp=2 dp=2, Hanayo at pp=4 with one wave (tied) and two, and V-Half (tied)
    and V-Min at pp=4 (traced), whose orders differ from ZB-V's from pp=3 on. B defers the linears' and norms'
    weight gradients to W, so the SP run checks that the split keeps the TP regions' collectives right."""
    from ppctl.pipeline.program import lower
    from ppctl.pipeline.schedules import build_schedule

    zb_h1 = ["parallel.dp=1", "schedule=zb_h1"]
    zbv = ["parallel.pp=4", "parallel.vpp=2", "parallel.dp=1", "schedule=zbv", "model.num_layers=8"]
    interleaved_zb = ["parallel.pp=4", "parallel.vpp=2", "parallel.dp=1", "schedule=interleaved_zb",
                      "model.num_layers=8"]
    runs = [BASE + zb_h1 + ["parallel.tp=2", "parallel.pp=2"] + TIED,
            BASE + zb_h1 + ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"] + FP64,
            BASE + zb_h1 + ["parallel.pp=4"] + FP64,
            BASE + zbv + TIED,
            BASE + interleaved_zb + TIED + ["trainer.global_batch_size=4"],
            BASE + interleaved_zb + FP64,
            BASE + ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "schedule=looped_bfs"] + FP64,
            BASE + ["parallel.pp=4", "parallel.dp=1", "schedule=hanayo", "model.num_layers=8"] + TIED,
            BASE + ["parallel.pp=4", "parallel.dp=1", "schedule=hanayo", "parallel.waves=2", "model.num_layers=16"],
            BASE + [item.replace("zbv", "v_half") for item in zbv] + TIED,
            # Llama: B defers the RMSNorm scales' and SwiGLU's weight gradients to W, with and without SP.
            BASE + zb_h1 + ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"] + LLAMA + FP64,
            BASE + zbv + LLAMA + TIED,
            BASE + [item.replace("zbv", "v_min") for item in zbv] + FP64 + ["trainer.trace=true"]]
    per_rank = assert_equivalent(runs, world_size=4)
    program = lower(build_schedule("v_min", 4, 2, 8))
    for rank_results in per_rank:  # traced: each rank ran its steps of V-Min's program, in order
        result = rank_results[-1]
        assert result["traced"] == [(step.action.kind, step.action.stage, step.action.microbatch)
                                    for step in program.steps[result["pp_rank"]]]


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_world_size_2_zbv_looped_and_schedule_files_match_single_process(tmp_path):
    """One launch of two workers. ZB-V with both ends of the V on rank 0: the two tied copies summed there, plain
    and distributed optimizer; breadth-first at vpp=3, interleaved zero bubble; Hanayo with one wave and two (tied:
    the first and last stage both on rank 0). ``schedule=custom``: interleaved
    1F1B written to torch's CSV trains bit for bit as the built-in, and DualPipe written to ppctl's JSON (its two
    copies in the file's placement) equal to one process. ``optimizer.gradient_delay=1`` (PipeDream-2BW's update)
    at pp=2 and with the distributed optimizer at dp=2, against the delayed single-process run, and PipeDream-2BW
    itself (its three steps one stream, two weight versions; float64, and tied with the distributed optimizer).
    Three runs are traced: each rank's recorded actions are its steps of the lowered program, in order (2BW's:
    of the three steps' stream, step 1 starting before step 0 ends)."""
    import json

    import torch

    from ppctl.pipeline.program import lower
    from ppctl.pipeline.schedules import build_schedule, schedule_csv
    from ppctl.pipeline.simulate import simulate

    interleaved, dualpipe = tmp_path / "interleaved.csv", tmp_path / "dualpipe.json"
    interleaved.write_text(schedule_csv(build_schedule("interleaved_1f1b", 2, 2, 8)))
    dualpipe.write_text(json.dumps(simulate(build_schedule("dualpipe", 2, 2, 8)).to_json()))
    layout = ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=1", "schedule=zbv"]
    runs = [BASE + layout + TIED, BASE + layout + TIED + ["optimizer.distributed=true"],
            BASE + ["parallel.pp=2", "parallel.vpp=3", "parallel.dp=1", "schedule=looped_bfs", "model.num_layers=6"]
            + TIED,
            BASE + ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=1", "schedule=interleaved_zb"]
            + ["optimizer.distributed=true", "trainer.trace=true"],
            BASE + ["parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_1f1b"] + FP64,
            BASE + ["parallel.pp=2", "schedule=custom", f"schedule.file={interleaved}"] + FP64,
            BASE + ["parallel.pp=2", "schedule=custom", f"schedule.file={dualpipe}"] + TIED,
            BASE + ["parallel.pp=2", "schedule=hanayo"] + TIED,
            BASE + ["parallel.pp=2", "schedule=hanayo", "parallel.waves=2", "model.num_layers=8", "trainer.trace=true"]
            + TIED,
            BASE + ["parallel.pp=2", "optimizer.gradient_delay=1"] + FP64,
            BASE + ["parallel.pp=1", "parallel.dp=2", "optimizer.distributed=true", "optimizer.gradient_delay=1"]
            + FP64,
            BASE + ["parallel.pp=2"] + TWO_BW + FP64 + ["trainer.trace=true"],
            BASE + ["parallel.pp=2", "optimizer.distributed=true"] + TWO_BW + TIED]
    per_rank = assert_equivalent(runs, world_size=2)
    stream = build_schedule("pipedream_2bw", 2, 1, 8 * STEPS)  # the STEPS steps as one stream
    traced_runs = {3: build_schedule("interleaved_zb", 2, 2, 8), 8: build_schedule("hanayo", 2, 4, 8), 11: stream}
    for index, schedule in traced_runs.items():  # traced: each rank ran its steps of the program, in order
        program = lower(schedule)
        for rank_results in per_rank:
            result = rank_results[index]
            assert result["traced"] == [(step.action.kind, step.action.stage, step.action.microbatch)
                                        for step in program.steps[result["pp_rank"]]]
    rank_0 = next(result[11]["traced"] for result in per_rank if result[11]["pp_rank"] == 0)
    # no flush: rank 0 starts step 1 (microbatch 8) before it has finished step 0 (its backward of microbatch 7)
    assert rank_0.index(("F", 0, 8)) < rank_0.index(("BW", 0, 7))
    for rank_results in per_rank:
        built_in, from_file = rank_results[4], rank_results[5]
        assert from_file["losses"] == built_in["losses"] and from_file["norms"] == built_in["norms"]
        assert all(torch.equal(from_file["shards"][name], shard) for name, shard in built_in["shards"].items())
