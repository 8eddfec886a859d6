"""What ``ppctl bench`` compares, what it refuses, and how it sums up its blocks (pure: no torch).

``ppctl bench`` times ppctl's training step against another implementation of the same
work, in one launch, the two taking turns block by block:

- ``torch``: ``torch.distributed.pipelining`` with the schedule class that runs the same
  schedule (``TORCH_SCHEDULE_CLASSES``), on the same stage modules (built by the same
  builder, so equal weights), microbatches, data, loss and optimizer;
- ``plain``: at pp=1, a plain PyTorch loop (forward, backward per microbatch, clip, AdamW);
- ``none``: ppctl alone (its step time, bubble and memory).

Both sides must compute the same losses step for step; a comparison of different work is
refused (``LOSS_TOLERANCE``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

AGAINST = ("auto", "torch", "plain", "eager", "none")

# ppctl schedule -> the torch.distributed.pipelining class that runs the same order of actions on the same placement.
TORCH_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}

# Largest relative difference between the two sides' step losses still called "the same work", by precision: the
# two sum the same terms in different orders (gradients, norms), which moves the losses by a few ulps per step.
LOSS_TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4}
# torch.distributed.pipelining's classes whose backward-input action keeps the graph for a later weight action, which
# a compiled block's backward refuses ("compiled with non-empty donated buffers"; benchmarks/RESULTS.md, measured).
TORCH_CLASSES_NOT_COMPILED = ("interleaved_zb", "zbv")


@dataclass(frozen=True)
class BenchRequest:
    """What the workers run: ``against`` one of torch, plain, none; ``steps`` per block; ``repeats`` timed blocks
    after one untimed warm-up block; ``configs``: the resolved config file of each schedule, in order."""

    against: str
    steps: int
    repeats: int
    configs: tuple[str, ...]

    def to_json(self) -> dict:
        """Plain data for ``bench_request.json``."""
        return {"against": self.against, "steps": self.steps, "repeats": self.repeats, "configs": list(self.configs)}

    @classmethod
    def from_json(cls, data: dict) -> BenchRequest:
        """Read ``to_json``'s data back."""
        return cls(data["against"], int(data["steps"]), int(data["repeats"]), tuple(data["configs"]))


def resolve_against(against: str, pp: int) -> str:
    """``auto`` is ``plain`` at pp=1 and ``torch`` otherwise; the others stand."""
    if against == "auto":
        return "plain" if pp == 1 else "torch"
    return against


def bench_problem(config, against: str, steps: int, repeats: int) -> str | None:
    """One line saying why ``ppctl bench`` cannot run this comparison, or None.

    ``against`` is resolved (no ``auto``). The torch side is built as a user of
    torch.distributed.pipelining would build it: one pipeline group, one model copy per
    rank, plain optimizer; what that cannot express the same way is refused rather than
    compared unequally.
    """
    parallel, model = config.parallel, config.model
    if steps < 1 or repeats < 1:
        return f"--steps {steps} and --repeats {repeats} must both be at least 1"
    if against not in AGAINST[1:]:
        return f"--against {against!r}: choose one of {', '.join(AGAINST)}"
    if against == "plain" and parallel.pp != 1:
        return f"--against plain compares a pp=1 run with a plain PyTorch loop; this config has parallel.pp={parallel.pp}"
    if against == "eager" and not config.trainer.compile:
        return "--against eager compares trainer.compile=true with the same run eager; set trainer.compile=true"
    if against in ("none", "eager"):
        return None
    name = config.schedule.name
    if against == "torch" and name not in TORCH_SCHEDULE_CLASSES:
        return (f"--against torch: torch.distributed.pipelining has no schedule class for schedule={name}; "
                f"it has {', '.join(TORCH_SCHEDULE_CLASSES)}")
    if against == "torch" and config.trainer.compile and name in TORCH_CLASSES_NOT_COMPILED:
        return (f"--against torch: {TORCH_SCHEDULE_CLASSES[name]} fails on compiled blocks (its split backward keeps "
                f"the graph, which compiled backward functions refuse); use --against eager, or trainer.compile=false")
    others = {"parallel.tp": parallel.tp, "parallel.cp": parallel.cp, "parallel.dp": parallel.dp}
    wider = [f"{key}={value}" for key, value in others.items() if value != 1]
    if wider:
        return f"--against {against} compares pipelines alone: set {', '.join(wider)} to 1"
    if config.trainer.precision not in LOSS_TOLERANCE:
        return (f"--against {against}: trainer.precision={config.trainer.precision} keeps fp32 main parameters in "
                f"ppctl only; compare in fp32 or fp64")
    if model.tie_embeddings and parallel.pp > 1:
        return (f"--against {against}: model.tie_embeddings=true needs the embedding's gradient summed across the "
                f"first and last stage, which torch.distributed.pipelining leaves to the user; set it to false")
    if config.optimizer.gradient_delay:
        return f"--against {against}: optimizer.gradient_delay={config.optimizer.gradient_delay} is ppctl's own"
    return None


def median_ratio(ours: list[float], others: list[float]) -> tuple[float, list[float]]:
    """(median of the per-block ratios ours / others, those ratios): blocks taken in turn pair up."""
    ratios = [a / b for a, b in zip(ours, others, strict=True)]
    return statistics.median(ratios), ratios


def max_relative_difference(ours: list[float], others: list[float]) -> float:
    """The largest ``|a - b| / max(|a|, |b|)`` over paired losses (0 for equal ones)."""
    worst = 0.0
    for a, b in zip(ours, others, strict=True):
        scale = max(abs(a), abs(b))
        worst = max(worst, abs(a - b) / scale if scale else 0.0)
    return worst

