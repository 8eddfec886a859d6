"""``ppctl verify --shrink``: the same layout, schedule and features on the smallest model the layout allows.

What a layout splits keeps its count: layers (the pipeline split and its layout string), attention and
key/value heads (TP and CP split them), the schedule and its placement, experts and their routing. What
only makes the model large shrinks: each head to ``HEAD_DIM`` channels (hidden = heads x that), the MLP to twice
the hidden width (an expert's to the hidden width), the vocabulary to ``VOCAB`` ids of synthetic data (a real tokenizer's ids need its vocabulary), each
microbatch to one sequence of the shortest length CP and sequence parallelism split evenly, the microbatches
per step to twice the pipeline ranks (each schedule's fill, steady state and drain, DualPipe's least; a schedule
file's count is kept: the file runs that many). Each change is returned with the line that says it, so the proof
says what it proved. A model read from ``model.init_from`` has the folder's widths: ``shrink_refusal`` says why it
cannot shrink.
"""

from __future__ import annotations

import math

from ppctl.config import PpctlConfig
from ppctl.model.family import resolve_model
from ppctl.pipeline.schedules import CUSTOM

HEAD_DIM = 8  # even, for rotary
VOCAB = 64
SHORTEST_SEQUENCE = 16


def shrink_refusal(config: PpctlConfig) -> str | None:
    """Why ``--shrink`` cannot shrink ``config``'s model (its weights come from ``model.init_from``), else None."""
    if not config.model.init_from:
        return None
    return (f"--shrink with model.init_from={config.model.init_from}: the folder's weights fix the model's widths "
            f"and vocabulary, which --shrink would change; verify the folder's model as it is (drop --shrink), or "
            f"this layout on random weights of the smallest model (drop model.init_from)")


def shrink_overrides(config: PpctlConfig) -> tuple[list[str], list[str]]:
    """The overrides that shrink ``config``'s model (resolved at the user's layout), and one line per change."""
    model, parallel, trainer = config.model, config.parallel, config.trainer
    hidden = model.num_heads * HEAD_DIM
    sequence = _shortest_sequence(parallel.cp, parallel.tp if parallel.sequence_parallel else 1)
    before = trainer.global_batch_size // (trainer.micro_batch_size * parallel.dp)
    from_file = config.schedule.name == CUSTOM and bool(config.schedule.file)
    # what every schedule's steady state needs (DualPipe: 2 pp); a schedule file runs the count it was written for
    microbatches = before if from_file else min(before, max(2 * parallel.pp, 2))
    why = (f"schedule.file {config.schedule.file} runs {before}" if from_file else
           "twice the pipeline ranks, what every schedule needs for its steady state")
    batch = microbatches * parallel.dp
    overrides = [f"model.hidden_size={hidden}", f"model.ffn_hidden_size={2 * hidden}", "data=synthetic",
                 f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=1", f"trainer.seq_length={sequence}",
                 f"model.max_seq_length={sequence}", "trainer.micro_batch_size=1",
                 f"trainer.global_batch_size={batch}"]
    if resolve_model(config).memory_shape.head_dim is not None:  # a family's own head width, set
        overrides.append(f"model.head_dim={HEAD_DIM}")
    if model.moe.num_experts and model.moe.expert_ffn_hidden_size is not None:
        overrides.append(f"model.moe.expert_ffn_hidden_size={hidden}")  # experts keep their count and routing
    said = [f"hidden {model.hidden_size} -> {hidden} ({model.num_heads} heads of {HEAD_DIM}), MLP "
            f"{model.ffn_hidden_size} -> {2 * hidden}",
            f"vocabulary {model.vocab_size} -> {VOCAB} ids of synthetic data",
            f"sequence {trainer.seq_length} -> {sequence} tokens, microbatch {trainer.micro_batch_size} -> 1 "
            f"sequence, global batch {trainer.global_batch_size} -> {batch} ({before} -> {microbatches} microbatches per "
            f"DP rank: {why})",
            f"kept: {model.num_layers} layers, the layout, schedule and every other setting"]
    return overrides, said


def _shortest_sequence(cp: int, sp_tp: int) -> int:
    """The shortest sequence that CP's 2 * cp chunks and sequence parallelism's tp shares split evenly."""
    multiple = math.lcm(2 * cp if cp > 1 else 1, cp * sp_tp)
    return multiple * math.ceil(SHORTEST_SEQUENCE / multiple)
