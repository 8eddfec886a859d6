"""bf16 training tracks the fp32 run within bf16 precision, with fp32 main parameters and gradients.

One launch of 2 workers trains 30 steps of the same model and data in fp32 and in bf16:
pipelined (pp=2, the plain optimizer with fp32 main copies) and data parallel (dp=2, the
distributed optimizer). Every step's loss must stay within bf16 precision of the fp32
run's; parameters, activations and pipeline messages are bf16 (half the bytes per
message), main parameters, main gradients and the loss are fp32.
"""

import pytest
import torch

from ppctl.testing import run_workers
from tests.distributed.equivalence import BASE, _record_message_bytes

STEPS = 30
# Real text, so the loss falls and a broken bf16 path shows; a learning rate low enough that no loss
# spike amplifies the rounding differences into another trajectory.
DATA = ["data=python_stdlib", "optimizer.lr=0.003"]
LAYOUTS = {"pp2": ["parallel.pp=2", "parallel.dp=1"], "dp2-distributed": ["parallel.pp=1", "parallel.dp=2",
                                                                           "optimizer.distributed=true"]}
# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3); 30 steps of AdamW on a tiny model
# drift a little further apart, but a wrong cast, a bf16 loss or bf16 accumulation shows far above this.
LOSS_RTOL = 1e-2


def _train(rank, world_size):
    from ppctl.config import compose_config, layout_of, validate
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.train import Trainer

    contexts, report = {}, {}
    for name, layout in LAYOUTS.items():
        for precision in ("fp32", "bf16"):
            config = compose_config(BASE + DATA + layout + [f"trainer.precision={precision}", f"trainer.max_steps={STEPS}"])
            validate(config)
            context = contexts.setdefault(layout_of(config), build_parallel_context(layout_of(config), 60)) \
                if layout_of(config) not in contexts else contexts[layout_of(config)]
            trainer = Trainer(config, context)
            sent = _record_message_bytes(trainer)
            losses = [trainer.train_step(step).loss for step in range(STEPS)]
            mains = [group["params"] for group in trainer.optimizer.param_groups]
            report[name, precision] = {
                "losses": losses, "message_bytes": sent,
                "param_dtypes": {str(param.dtype) for param in trainer.parameters()},
                "main_dtypes": {str(param.dtype) for group in mains for param in group},
            }
    return report


@pytest.mark.timeout(300)
def test_bf16_tracks_fp32_with_fp32_main_parameters():
    per_rank = run_workers(_train, 2, timeout=280)
    for name in LAYOUTS:
        for report in per_rank:
            fp32, bf16 = report[name, "fp32"], report[name, "bf16"]
            assert bf16["param_dtypes"] == {"torch.bfloat16"} and bf16["main_dtypes"] == {"torch.float32"}, name
            if fp32["losses"][0] is None:
                continue  # not a rank that holds the loss
            for step, (want, got) in enumerate(zip(fp32["losses"], bf16["losses"], strict=True)):
                assert abs(got - want) <= LOSS_RTOL * want, f"{name} step {step}: bf16 loss {got} vs fp32 {want}"
            assert fp32["losses"][-1] < fp32["losses"][0] - 1.0  # the runs really learn
        sent32 = set().union(*(report[name, "fp32"]["message_bytes"] for report in per_rank))
        sent16 = set().union(*(report[name, "bf16"]["message_bytes"] for report in per_rank))
        assert {size // 2 for size in sent32} == sent16, (name, sent32, sent16)
    assert torch.bfloat16.itemsize == 2
