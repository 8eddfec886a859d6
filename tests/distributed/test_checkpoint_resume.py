"""Save at one layout, resume at another: the losses and parameters after resuming are the uninterrupted run's.

Each case trains steps 0-1 at the saving layout, saves after step 2, builds a trainer of
the loading layout (other tp, pp, dp, cp, schedule, optimizer sharding, world size),
loads the checkpoint and trains steps 2-3. Compared in float64 with the single-process
run of all four steps as a user would launch it (``parallel=single``): the losses and
grad norms of steps 2-3 and every final parameter. A mixture of experts saved at ep=2 resumes at ep=1 and ep=4. A bf16, an fp16, a delayed-gradient
(``optimizer.gradient_delay=1``) and a PipeDream-2BW run resumed at their own layout are
compared bitwise with their own uninterrupted runs (fp32 main parameters, AdamW state, the
fp16 loss scaler and the previous weight version must come back exactly); a 2BW checkpoint
(its two steps one stream) also resumes under 1F1B with the same delayed update.
"""

import functools

import pytest

from tests.harness.pool import run_workers
from tests.distributed.equivalence import (BASE, FP64, LLAMA, MIXTRAL, compare_parameters, compare_scalars,
                                          composed_runs, single_process_reference)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

SAVED_AT, STEPS = 2, 4
EXACT = BASE + FP64
TIED = ["model.tie_embeddings=true"]
DIST = ["optimizer.distributed=true"]
DELAYED = ["optimizer.gradient_delay=1", "optimizer.clip_grad=0"]  # PipeDream-2BW's update, and what 2BW allows
# (saving layout, loading layout), both in one launch of 4 workers: between them every one of tp, pp,
# vpp, dp, cp, sequence parallelism, the schedule, DualPipe's two copies and optimizer sharding changes.
PAIRS_4 = [
    (["parallel.tp=2", "parallel.pp=2"],
     ["parallel.cp=2", "parallel.cp_comm=ring", "parallel.pp=2", "schedule=interleaved_1f1b", "parallel.vpp=2"]),
    (["parallel.pp=2", "parallel.dp=2", *DIST, *TIED],
     ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "schedule=v_half", *TIED]),
    (["parallel.pp=2", "parallel.dp=2", "schedule=dualpipe", *DIST, *TIED], ["parallel.pp=4", *TIED]),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "schedule=looped_bfs", *DIST],
     ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "schedule=interleaved_zb"]),
    (["parallel.pp=2", "parallel.dp=2", "schedule=hanayo", *TIED], ["parallel.pp=4", "schedule=pipedream_flush", *TIED]),
    (["parallel.pp=2", "parallel.dp=2", "schedule=pipedream_2bw", *DELAYED, *DIST],
     ["parallel.pp=4", "schedule=1f1b", *DELAYED]),
    # Llama: separate q/k/v and gate/up weights, RMSNorm scales, resharded over tp and the optimizer's shards.
    (["parallel.tp=2", "parallel.pp=2", *LLAMA], ["parallel.pp=2", "parallel.dp=2", "schedule=zbv", *DIST, *LLAMA]),
]
# A mixture saved at ep=2 (experts and their sharded AdamW state split over two EP ranks) resumed at ep=1 (every
# rank all experts, a plain optimizer) and at ep=4.
EXPERTS_SAVED = ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", *DIST, *MIXTRAL]
EXPERTS_LOADED = [["parallel.pp=2", "parallel.dp=2", "schedule=zbv", *MIXTRAL],
                  ["parallel.pp=1", "parallel.dp=4", "parallel.ep=4", *DIST, *MIXTRAL]]
# Saved by 2 workers, loaded by 4 into DualPipe's two parameter copies (each copy reads the same tensors).
ACROSS_WORLDS = (["parallel.pp=2", "schedule=gpipe"], ["parallel.pp=2", "parallel.dp=2", "schedule=dualpipe", *DIST])
# Half precision resumed at its own layout: bitwise its uninterrupted run (fp16 also brings back its loss scaler).
SAME_LAYOUT = [BASE + [f"trainer.precision={precision}", "parallel.pp=1", "parallel.dp=2", *DIST]
               for precision in ("bf16", "fp16")]
SAME_LAYOUT.append(BASE + ["parallel.pp=2", "optimizer.gradient_delay=1"])  # both weight versions come back
SAME_LAYOUT.append(BASE + ["parallel.pp=2", "schedule=pipedream_2bw", *DELAYED])  # both of the stream's buffers


def _composed(runs) -> dict:
    """Every override list of ``runs``, composed and validated once in the test process, by its tuple."""
    return {tuple(overrides): config for overrides, config in zip(runs, composed_runs(runs))}


def _trainer(overrides, contexts, configs):
    import copy

    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    run = resolve(copy.deepcopy(configs[tuple(overrides)]), check=False)  # each trainer its own, as from compose
    if run.layout not in contexts:
        contexts[run.layout] = build_parallel_context(run.layout, 60)
    return Trainer(run, contexts[run.layout])


def _steps(trainer, steps):
    results = trainer.train_steps(steps.start, len(steps))  # PipeDream-2BW: as one stream
    return [result.loss for result in results], [result.grad_norm for result in results]


def _resumed(trainer, checkpoint):
    from ppctl.checkpoint.state import load_checkpoint

    start = load_checkpoint(trainer, checkpoint)
    losses, norms = _steps(trainer, range(start, STEPS))
    shards = {name: param.detach().clone() for name, param in trainer.named_parameters().items()}
    context = trainer.context
    return {"losses": losses, "norms": norms, "shards": shards, "start": start,
            "tp_rank": context.coords["tp"], "tp": context.layout.tp,
            "ep": context.layout.ep, "ep_rank": context.layout.expert_coords(context.rank)["ep"]}


def _save(trainer, root, name):
    from pathlib import Path

    from ppctl.checkpoint.state import save_checkpoint

    _steps(trainer, range(SAVED_AT))
    return save_checkpoint(trainer, Path(root) / name, SAVED_AT, "test", keep_last=1)


def _launch_2(rank, world_size, root, configs):
    """Save the across-worlds checkpoint; resume bf16 and fp16 at their own layout against their uninterrupted runs."""
    contexts = {}
    across = _save(_trainer(EXACT + ACROSS_WORLDS[0], contexts, configs), root, "across")
    same_layout = []
    for index, overrides in enumerate(SAME_LAYOUT):
        trainer = _trainer(overrides, contexts, configs)
        checkpoint = _save(trainer, root, f"half{index}")
        uninterrupted = _steps(trainer, range(SAVED_AT, STEPS))
        params = {name: param.detach().clone() for name, param in trainer.named_parameters().items()}
        resumed_trainer = _trainer(overrides, contexts, configs)
        resumed = _resumed(resumed_trainer, checkpoint)
        scalers = [None if t.loss_scaler is None else t.loss_scaler.state_dict() for t in (trainer, resumed_trainer)]
        same_layout.append((uninterrupted, params, resumed, scalers))
    return str(across), same_layout


def _launch_4(rank, world_size, root, across, configs):
    """Every pair saved and loaded here, the mixture at each of its expert layouts, then the checkpoint 2 workers
    saved."""
    contexts, results = {}, []
    for index, (saving, loading) in enumerate(PAIRS_4):
        checkpoint = _save(_trainer(EXACT + saving, contexts, configs), root, f"pair{index}")
        results.append(_resumed(_trainer(EXACT + loading, contexts, configs), checkpoint))
    checkpoint = _save(_trainer(EXACT + EXPERTS_SAVED, contexts, configs), root, "experts")
    results += [_resumed(_trainer(EXACT + loading, contexts, configs), checkpoint) for loading in EXPERTS_LOADED]
    results.append(_resumed(_trainer(EXACT + ACROSS_WORLDS[1], contexts, configs), across))
    return results


@functools.lru_cache(maxsize=None)
def _single_process(overrides: tuple[str, ...]):
    return single_process_reference(list(overrides), STEPS)


def _assert_matches_single_process(per_rank, index, overrides):
    reference = _single_process(tuple(overrides))
    tolerance = reference.tolerance
    assert all(result[index]["start"] == SAVED_AT for result in per_rank)
    losses = [result[index]["losses"] for result in per_rank if result[index]["losses"][0] is not None]
    assert losses, "no rank holds the loss"
    for rank_losses in losses:
        compare_scalars("resumed loss", overrides, rank_losses, reference.run.losses[SAVED_AT:], tolerance)
    for result in per_rank:
        compare_scalars("resumed grad norm", overrides, result[index]["norms"], reference.run.grad_norms[SAVED_AT:],
                        tolerance)
    compare_parameters("parameter", overrides, per_rank, index, "shards", reference, STEPS)


def test_resume_at_other_layouts_and_world_sizes_equals_one_process(tmp_path):
    import torch

    two = run_workers(_launch_2, 2, str(tmp_path), _composed([EXACT + ACROSS_WORLDS[0], *SAME_LAYOUT]), timeout=200)
    for _across, same_layout in two:
        for (uninterrupted, params, resumed, (scaler, resumed_scaler)), overrides in zip(same_layout, SAME_LAYOUT):
            assert resumed["losses"] == uninterrupted[0] and resumed["norms"] == uninterrupted[1], overrides
            assert all(torch.equal(resumed["shards"][name], value) for name, value in params.items()), overrides
            assert resumed_scaler == scaler and ((scaler is not None) == ("trainer.precision=fp16" in overrides))
    four_runs = [EXACT + layout for pair in PAIRS_4 for layout in pair] + [EXACT + ACROSS_WORLDS[1]]
    four_runs += [EXACT + layout for layout in (EXPERTS_SAVED, *EXPERTS_LOADED)]
    four = run_workers(_launch_4, 4, str(tmp_path), two[0][0], _composed(four_runs), timeout=300)
    loaded = [loading for _saving, loading in PAIRS_4] + EXPERTS_LOADED + [ACROSS_WORLDS[1]]
    for index, loading in enumerate(loaded):
        _assert_matches_single_process(four, index, EXACT + loading)
