"""bf16 and fp16 training track the fp32 run within their precision, with fp32 main parameters and gradients.

One launch of 2 workers trains 20 steps of the same model and data in fp32, bf16 and
fp16 (with dynamic loss scaling): pipelined (pp=2, the plain optimizer with fp32 main
copies; a GPT and a Llama) and data parallel (dp=2, the distributed optimizer). Every step's loss must stay
within the half precision of the fp32 run's; parameters, activations and pipeline
messages are half precision (half the bytes per message), main parameters, main
gradients and the loss are fp32. An fp16 run started at a loss scale that overflows
skips steps, halving the scale each time, until it fits, then trains.
"""

import pytest
import torch

from tests.harness.pool import run_workers
from tests.distributed.equivalence import BASE, LLAMA, _record_message_bytes, composed_runs
from tests.harness.tolerances import HALF_PRECISION_LOSS

STEPS = 20
# Real text, so the loss falls and a broken bf16 path shows; a learning rate low enough that no loss
# spike amplifies the rounding differences into another trajectory.
DATA = ["data=python_stdlib", "optimizer.lr=0.003"]
LAYOUTS = {"pp2": ["parallel.pp=2", "parallel.dp=1"], "dp2-distributed": ["parallel.pp=1", "parallel.dp=2",
                                                                           "optimizer.distributed=true"],
           "llama pp2": ["parallel.pp=2", "parallel.dp=1", *LLAMA]}  # RMSNorm upcasts half precision itself
OVERFLOWING_SCALE = 2.0 ** 20  # overflows fp16 (max 65504) in the backward of this model; 2^16 does not


def _configs() -> dict:
    """(layout name, precision) -> its config, and "overflow" -> the fp16 run that starts at an overflowing scale:
    composed and validated once, in the test process."""
    runs = {(name, precision): BASE + DATA + layout + [f"trainer.precision={precision}", f"trainer.max_steps={STEPS}"]
            for name, layout in LAYOUTS.items() for precision in ("fp32", "bf16", "fp16")}
    runs["overflow"] = BASE + DATA + LAYOUTS["dp2-distributed"] + [
        "trainer.precision=fp16", f"optimizer.loss_scale={OVERFLOWING_SCALE}"]
    return dict(zip(runs, composed_runs(list(runs.values()))))


def _train(rank, world_size, configs):
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    contexts, report = {}, {}
    for name in LAYOUTS:
        for precision in ("fp32", "bf16", "fp16"):
            run = resolve(configs[name, precision], check=False)  # validated in the test process
            if run.layout not in contexts:
                contexts[run.layout] = build_parallel_context(run.layout, 60)
            trainer = Trainer(run, contexts[run.layout])
            sent = _record_message_bytes(trainer)
            losses = [trainer.train_step(step).loss for step in range(STEPS)]
            mains = [group["params"] for group in trainer.optimizer.param_groups]
            report[name, precision] = {
                "losses": losses, "message_bytes": sent,
                "param_dtypes": {str(param.dtype) for param in trainer.parameters()},
                "main_dtypes": {str(param.dtype) for group in mains for param in group},
            }
    report["overflow"] = _overflowing_fp16(configs["overflow"], contexts)
    return report


def _overflowing_fp16(config, contexts) -> list[tuple[bool, float]]:
    """(skipped, loss scale after the step) of 12 fp16 steps started at a scale that overflows."""
    from ppctl.resolve.resolved import resolve
    from ppctl.run.train import Trainer

    run = resolve(config, check=False)
    trainer = Trainer(run, contexts[run.layout])
    return [(trainer.train_step(step).skipped, trainer.loss_scaler.scale) for step in range(12)]


@pytest.mark.timeout(300)
def test_half_precision_tracks_fp32_with_fp32_main_parameters_and_fp16_backs_off_overflows():
    per_rank = run_workers(_train, 2, _configs(), timeout=280)
    for name in LAYOUTS:
        for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            _check_half_precision_run(name, precision, dtype, per_rank)
    for report in per_rank:
        skipped = [was_skipped for was_skipped, _scale in report["overflow"]]
        assert skipped[0] and skipped.count(False) >= 6, skipped  # overflows first, then mostly trains
        scale = OVERFLOWING_SCALE
        for step, (was_skipped, scale_after) in enumerate(report["overflow"]):
            scale = scale / 2 if was_skipped else scale  # halved on each overflow, no growth within 1000 steps
            assert scale_after == scale, (step, report["overflow"])


def _check_half_precision_run(name: str, precision: str, dtype: torch.dtype, per_rank: list) -> None:
    for report in per_rank:
        fp32, half = report[name, "fp32"], report[name, precision]
        assert half["param_dtypes"] == {str(dtype)} and half["main_dtypes"] == {"torch.float32"}, name
        if fp32["losses"][0] is None:
            continue  # not a rank that holds the loss
        for step, (want, got) in enumerate(zip(fp32["losses"], half["losses"], strict=True)):
            assert abs(got - want) <= HALF_PRECISION_LOSS[precision] * want, (
                f"{name} step {step}: {precision} loss {got} vs fp32 {want}")
        assert fp32["losses"][-1] < fp32["losses"][0] - 1.0  # the runs really learn
    sent32 = set().union(*(report[name, "fp32"]["message_bytes"] for report in per_rank))
    sent16 = set().union(*(report[name, precision]["message_bytes"] for report in per_rank))
    assert {size // 2 for size in sent32} == sent16, (name, precision, sent32, sent16)
