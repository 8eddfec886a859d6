"""Shared by the equivalence tests: train a layout in gloo workers and compare with one process.

The reference is the single-process run as a user would launch it: the same overrides
with every ``parallel.*`` setting dropped and ``parallel=single`` added (so the default
vocabulary padding of tp=1), trained by the plain loop of ``ppctl.run.reference``. Nothing
of the parallel run's settings reaches it. Compared: every step's loss and global
gradient norm, the forward-only loss, every parameter's gradient at step 0 and every final
parameter, and for runs on ``SKEWED``'s corpus the validation loss over ``trainer.eval_iters`` batches at the
initial weights (against ``plain_validation_loss``), within the tolerances that ``tests/harness/tolerances.py``
derives for the run's precision (float64 carries the exactness claims). ``tests/distributed/test_harness_twins.py``
proves that a broken run fails this comparison.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tests.harness.pool import run_workers
from tests.harness.tolerances import Tolerance, tolerance_of

BASE = [
    "data=synthetic", "model=gpt_tiny", "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4",
    "model.ffn_hidden_size=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=1",
    "trainer.seq_length=16", "trainer.tensorboard=false", "optimizer.lr=0.01", "optimizer.clip_grad=1.0",
    # AdamW's step on an element whose true gradient is ~0 has slope 1/eps in the gradient: eps=1e-5
    # (not the default 1e-8) bounds what it amplifies roundoff into (tests/harness/tolerances.py), in both precisions.
    "optimizer.eps=1e-5",
]
FP64 = ["trainer.precision=fp64"]
# Labels equal to the end-of-document id (the last of 16 ids here) weigh zero: a loss mask with holes.
MASKED = ["model.vocab_size=16", "data.eod_mask_loss=true"]
# Documents kept apart: the last of 8 ids ends a document, so a 16-token window holds about three of them.
DOCUMENTS = ["model.vocab_size=8", "data.documents=separate"]
STEPS = 2
# Loss masks skewed on purpose (``prepare_skewed_masks``): a corpus whose documents are either long sentences (every
# label trained) or two letters followed by ten end-of-text markers (2 labels of 13 trained), cut by a character
# tokenizer with ``data.eod_mask_loss``: microbatches of one window hold from 1 to 16 trained tokens of 16. A third of
# the tokens is the validation split, so validation batches 0 and 1 hold different windows (and counts).
SKEWED_DIR = Path(__file__).resolve().parents[2] / "data" / "cache" / "tests-skewed-masks"
SKEWED = ["data=text", f"data.path={SKEWED_DIR / 'corpus.jsonl'}", f"data.tokenizer={SKEWED_DIR / 'tokenizer.json'}",
          f"data.cache_dir={SKEWED_DIR / 'cache'}", "data.validation_fraction=0.3", "data.eod_mask_loss=true",
          "model.vocab_size=40"]
# The Llama family on BASE's shape: grouped-query attention (4 query heads on 2 key/value heads), SwiGLU, RMSNorm,
# rotary positions; LLAMA_MHA for tp=4 (each TP rank owns whole key/value heads).
LLAMA = ["model.family=llama", "model.position_embedding=rope", "model.num_kv_heads=2"]
LLAMA_MHA = ["model.family=llama", "model.position_embedding=rope"]
# Mixtures of experts on LLAMA's blocks (ppctl.model.moe): Mixtral's routing (softmax, the chosen two renormalised,
# the balancing and z losses) on every layer; DeepSeek-V3's (the first layer dense, a shared expert, a sigmoid router
# balanced by the expert bias, moved fast enough to change the routing within STEPS).
MIXTRAL = LLAMA + ["model.moe.num_experts=4", "model.moe.topk=2", "model.moe.router_topk_norm=true",
                   "model.moe.aux_loss_coeff=0.02", "model.moe.z_loss_coeff=0.001"]
# Qwen3 (model.family=qwen3): Llama's blocks with per-head q/k RMSNorms, heads of 16 beside hidden 32 / 4 heads.
# Qwen2-MoE (model.family=qwen_moe): q/k/v biases, the first layer dense, a shared expert scaled by its sigmoid gate,
# the top-k weights not renormalised (tests/unit/test_hf_qwen_moe.py).
QWEN3 = LLAMA + ["model.family=qwen3", "model.head_dim=16"]
QWEN2_MOE = LLAMA + ["model.family=qwen_moe", "model.qkv_bias=true", "model.moe.num_experts=4", "model.moe.topk=2",
                     "model.moe.expert_ffn_hidden_size=32", "model.moe.first_dense_layers=1",
                     "model.moe.shared_experts=1", "model.moe.shared_expert_gate=true",
                     "model.moe.aux_loss_coeff=0.02"]
DEEPSEEK = LLAMA + ["model.moe.num_experts=4", "model.moe.topk=2", "model.moe.expert_ffn_hidden_size=32",
                    "model.moe.first_dense_layers=1", "model.moe.shared_experts=1", "model.moe.router_score=sigmoid",
                    "model.moe.router_topk_norm=true", "model.moe.expert_bias=true",
                    "model.moe.expert_bias_update_rate=0.01"]


def skewed_corpus_rows() -> list[str]:
    """The documents of ``SKEWED``'s corpus: a long sentence every third, the others two letters and ten
    end-of-text markers (which the character tokenizer reads as its end-of-document id)."""
    from tests.harness.char_tokenizer import END_OF_TEXT

    sentence = "the quick brown fox jumps over the lazy dog and keeps on running"
    return [sentence if index % 3 == 0 else "ab" + END_OF_TEXT * 10 for index in range(96)]


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it already holds it, through a temporary file (test processes running side
    by side may write the same file)."""
    if path.is_file() and path.read_text() == text:
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def prepare_skewed_masks() -> list[str]:
    """Write ``SKEWED``'s corpus and tokenizer and prepare its token cache here, before any worker reads it (the
    workers then only read the cache); return ``SKEWED``."""
    from ppctl.resolve import compose_config
    from ppctl.model.from_config import dataset_of
    from tests.harness.char_tokenizer import save_char_tokenizer

    SKEWED_DIR.mkdir(parents=True, exist_ok=True)
    staged = SKEWED_DIR / f"staged-{os.getpid()}"
    staged.mkdir(exist_ok=True)
    _write_if_changed(SKEWED_DIR / "tokenizer.json", save_char_tokenizer(staged, 40, end_of_text=True).read_text())
    (staged / "tokenizer.json").unlink()
    staged.rmdir()
    _write_if_changed(SKEWED_DIR / "corpus.jsonl", "".join(json.dumps({"text": row}) + "\n"
                                                           for row in skewed_corpus_rows()))
    dataset_of(compose_config(BASE + SKEWED))
    return SKEWED


# How a run is split over processes, nodes and pipeline ranks, not what it computes: one process
# runs no pipeline schedule (and a V schedule would refuse its single chunk).
LAYOUT_PREFIXES = ("parallel", "schedule", "launcher")


def single_process_overrides(overrides: list[str]) -> list[str]:
    """The same run as one process, as a user would ask for it: no parallel.*, schedule or launcher.*
    setting, ``parallel=single``."""
    return [item for item in overrides if not item.lstrip("+~").startswith(LAYOUT_PREFIXES)] + ["parallel=single"]


def _record_message_bytes(trainer) -> set[int]:
    """Make the trainer's transport note the bytes of every pipeline message it sends; return the record."""
    sent: set[int] = set()
    post = trainer.runtime.transport.post

    def recording_post(sends, receives):
        sent.update(tensor.numel() * tensor.element_size() for _message, tensor in sends)
        return post(sends, receives)

    trainer.runtime.transport.post = recording_post
    return sent


def composed_runs(runs: list[list[str]]) -> list:
    """Each override list composed and validated, once, in this process: the workers train these configs
    (composing them on every rank would cost each rank the same Hydra composition)."""
    from ppctl.resolve import compose_config, validate

    configs = []
    for overrides in runs:
        config = compose_config(overrides)
        validate(config)
        configs.append(config)
    return configs


def _train_runs(rank, world_size, configs, schedule_builder=None, breakers=None):
    """Worker: for each config (``composed_runs``), train STEPS steps; return losses, norms and this rank's shards.

    Runs may use different layouts of the same world size: each layout's groups are built once.
    Before training, the forward-only path evaluates batch 0 (it must give step 0's loss).
    ``schedule_builder(config)``, when given, replaces the configured schedule. ``breakers``, when
    given, names per run a defect of ``tests.distributed.breakers`` to train with (None: none). The
    bytes of every pipeline message sent are recorded too.
    """
    from ppctl.resolve.resolved import resolve
    from tests.distributed.breakers import broken

    contexts, results = {}, []
    for index, config in enumerate(configs):
        run = resolve(config, check=False)  # validated by composed_runs
        if run.layout not in contexts:
            contexts[run.layout] = _context_on_this_rank(run.layout, rank)
        schedule = schedule_builder(config) if schedule_builder is not None else None
        with broken(breakers[index] if breakers else None):
            results.append(_train_one(run, contexts[run.layout], schedule))
    return results


def _context_on_this_rank(layout, rank: int):
    """The layout's groups, computing where the suite's backend puts this rank (``tests/harness/backend.py``: the CPU on
    gloo, GPU ``rank`` on NCCL)."""
    from ppctl.parallel.groups import build_parallel_context, warm_up_communicators
    from tests.harness.backend import chosen_backend, rank_device

    device = rank_device(chosen_backend(), rank)
    context = build_parallel_context(layout, 60, device.split(":")[0])
    context.device = device
    if device != "cpu":  # as ppctl's worker does: every NCCL communicator made before step 0, in one order
        warm_up_communicators(context)
    return context


def _on_cpu(tensors: dict) -> dict:
    """Detached CPU copies (a GPU tensor cannot leave its worker through the result pickle)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}


def _train_one(run, context, schedule) -> dict:
    """STEPS steps of one run (a ``ResolvedConfig``): losses, norms, step-0 gradients, final shards, the forward-only
    loss."""
    from ppctl.run.train import Trainer

    trainer = Trainer(run, context, schedule=schedule)
    message_bytes = _record_message_bytes(trainer)
    eval_loss = trainer.evaluate(0)
    # SKEWED runs: the validation loss over trainer.eval_iters batches too (before any step: the initial weights)
    validation_loss = trainer.validation_loss() if compares_validation(run.config) else None
    losses, norms, first_gradients = [], [], None
    if trainer.stream is not None:  # PipeDream-2BW: every step in one stream, no gradients between steps
        results = trainer.train_steps(0, STEPS)
        losses, norms = [result.loss for result in results], [result.grad_norm for result in results]
    for step in range(STEPS if trainer.stream is None else 0):
        loss, grad_norm = trainer.compute_gradients(step)
        if step == 0:
            first_gradients = _on_cpu(trainer.gradients())
        trainer.apply_gradients(step, grad_norm)
        losses.append(loss)
        norms.append(grad_norm)
    shards = _on_cpu(trainer.named_parameters())
    traced = None  # with trainer.trace=true: the last step's actions as the tracer recorded them, in order
    if trainer.tracer is not None:
        traced = [(kind, stage, microbatch) for kind, stage, microbatch, _, _ in trainer.tracer.actions]
    return {"losses": losses, "norms": norms, "gradients": first_gradients, "shards": shards,
            "eval_loss": eval_loss, "validation_loss": validation_loss, "message_bytes": message_bytes,
            "optimizer_bytes": trainer.optimizer.state_bytes(),
            "tp_rank": context.coords["tp"], "tp": context.layout.tp, "pp_rank": context.pp_rank,
            "ep": context.layout.ep, "ep_rank": context.layout.expert_coords(context.rank)["ep"],
            "traced": traced}


def expected_shard(name: str, rule, dense: torch.Tensor, shard: torch.Tensor, tp_size: int, tp_rank: int,
                   vocab_size: int, ep_size: int = 1, ep_rank: int = 0) -> torch.Tensor:
    """The TP shard (an expert's: the EP rank's experts) of a single-process tensor, vocabulary padding rebuilt as
    zeros for the parallel run.

    The single process pads its vocabulary for tp=1 and the parallel run for its own tp;
    padded rows never enter the math, so they must hold exactly zero in both.
    """
    from ppctl.model.rules import dense_to_tp_shard
    from ppctl.parallel.expert_parallel import EPGroup
    from ppctl.parallel.tensor_parallel import TPGroup

    if rule.vocab_rows:
        assert not dense[vocab_size:].any(), f"{name}: the single process's padded rows are not zero"
        real = dense[:vocab_size]
        dense = torch.cat([real, real.new_zeros((shard.shape[0] * tp_size - vocab_size, *real.shape[1:]))])
    return dense_to_tp_shard(rule, dense, TPGroup(None, tp_size, tp_rank), EPGroup(None, ep_size, ep_rank))


def compares_validation(config) -> bool:
    """Whether the harness compares a run's validation loss: runs on ``SKEWED``'s corpus, whose validation batches
    hold very different numbers of trained tokens (elsewhere the validation loss takes the forward-only loss's
    path, compared already)."""
    return config.data.path == str(SKEWED_DIR / "corpus.jsonl")


def plain_validation_loss(config) -> float:
    """The single process's validation loss at its initial weights, computed plainly: the masked token losses of
    validation batches 0 .. ``trainer.eval_iters``-1 summed, over the sum of their masks."""
    from ppctl.data.dataset import build_microbatch, global_batch_sample_ids
    from ppctl.model.from_config import dataset_of
    from ppctl.run.reference import reference_model

    trainer, model, dataset = config.trainer, reference_model(config), dataset_of(config, "validation")
    total, count = 0.0, 0.0
    with torch.no_grad():
        for batch in range(trainer.eval_iters):
            ids = global_batch_sample_ids(trainer.seed, batch, trainer.global_batch_size, len(dataset))
            for first in range(0, len(ids), trainer.micro_batch_size):  # microbatches: a mixture's routing
                microbatch = build_microbatch(dataset, ids[first:first + trainer.micro_batch_size])
                losses = model(microbatch.tokens, position_ids=microbatch.position_ids, labels=microbatch.labels)
                total += float((losses * microbatch.loss_mask.to(losses.dtype)).sum())
                count += float(microbatch.loss_mask.double().sum())
    return total / count


@dataclass(frozen=True)
class Reference:
    """What a parallel run is compared with: the single process's config, its run, the tolerance and (for
    ``compares_validation`` runs) its validation loss at its initial weights."""

    config: object
    run: object
    tolerance: Tolerance
    validation_loss: float | None = None

    @property
    def vocab_size(self) -> int:
        """The real vocabulary (rows past it are TP padding)."""
        return self.config.model.vocab_size

    def parameter_bound(self, name: str, steps: int) -> float:
        """The largest element difference parameter ``name`` may show after ``steps`` steps."""
        optimizer = self.config.optimizer
        return self.tolerance.parameter_bound(self.run.parameters[name], self.run.first_gradients[name], steps,
                                              optimizer.lr, optimizer.eps)


# The session's single-process runs, by their override list and steps: many parallel runs (every schedule
# and layout of one model) share one, and the comparisons only read it.
_REFERENCES: dict[tuple[tuple[str, ...], int], Reference] = {}


def single_process_reference(overrides: list[str], steps: int = STEPS) -> Reference:
    """The single-process run of ``overrides`` as a user would launch it, trained ``steps`` steps (trained once
    per session for each override list of the single process)."""
    from ppctl.resolve import compose_config, validate
    from ppctl.run.reference import run_reference

    key = (tuple(single_process_overrides(overrides)), steps)
    if key not in _REFERENCES:
        single = compose_config(list(key[0]))
        validate(single)
        validation = plain_validation_loss(single) if compares_validation(single) else None
        _REFERENCES[key] = Reference(single, run_reference(single, steps), tolerance_of(single.trainer.precision),
                                     validation)
    return _REFERENCES[key]


def _dense_and_expected(run: dict, name: str, shard: torch.Tensor, tensors: dict, reference: "Reference"):
    from ppctl.model.family import resolve_model

    rule = resolve_model(reference.config).rules(name)
    # A tied output layer on the last stage is a copy of the single process's word embedding.
    dense_name = rule.tied_to if name not in tensors else name
    return dense_name, expected_shard(name, rule, tensors[dense_name], shard, run["tp"], run["tp_rank"],
                                      reference.vocab_size, run["ep"], run["ep_rank"])


def compare_gradients(label: str, overrides, per_rank, index, reference: Reference) -> None:
    """Every rank's shard of every step-0 gradient against the single process's; all names covered."""
    seen = set()
    for result in per_rank:
        run = result[index]
        for name, shard in run["gradients"].items():
            dense_name, expected = _dense_and_expected(run, name, shard, reference.run.first_gradients, reference)
            difference = reference.tolerance.tensor_difference(shard, expected)
            assert difference <= reference.tolerance.relative, (
                f"{overrides}: {label} of {name} differs by {difference:.2e}")
            seen.add(dense_name)
    assert seen == set(reference.run.first_gradients), f"{label}s never compared: {set(reference.run.first_gradients) - seen}"


def compare_parameters(label: str, overrides, per_rank, index, key: str, reference: Reference, steps: int) -> None:
    """Every rank's shard of every final parameter within the bound AdamW allows after ``steps`` steps."""
    seen = set()
    for result in per_rank:
        run = result[index]
        for name, shard in run[key].items():
            dense_name, expected = _dense_and_expected(run, name, shard, reference.run.parameters, reference)
            difference = (shard.double() - expected.double()).abs().max().item()
            bound = reference.parameter_bound(dense_name, steps)
            assert difference <= bound, f"{overrides}: {label} of {name} differs by {difference:.2e} > {bound:.2e}"
            seen.add(dense_name)
    assert seen == set(reference.run.parameters), f"{label}s never compared: {set(reference.run.parameters) - seen}"


def compare_scalars(label: str, overrides, actual: list[float], expected: list[float], tolerance: Tolerance) -> None:
    """Step by step, each within the tolerance (relative)."""
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert tolerance.allows_scalar(got, want), f"{overrides}: step {step} {label} {got} != {want}"


def equivalence_checks(overrides: list[str], per_rank: list, index: int) -> dict[str, Callable[[], None]]:
    """The comparisons of run ``index`` with the single process, by name; each raises AssertionError on a
    difference: losses, forward-only loss, grad norms, step-0 gradients (all before the optimizer) and the
    final parameters (within what AdamW amplifies)."""
    reference = single_process_reference(overrides)
    tolerance = reference.tolerance
    losses = [r[index]["losses"] for r in per_rank if r[index]["losses"][0] is not None]
    evaluated = [r[index]["eval_loss"] for r in per_rank if r[index]["eval_loss"] is not None]
    assert losses, "no rank reported a loss"
    assert len(evaluated) == len(losses), "the forward-only loss is not on the ranks that hold the loss"

    def check_losses():
        for rank_losses in losses:
            compare_scalars("loss", overrides, rank_losses, reference.run.losses, tolerance)

    def check_norms():  # every rank computes the same global norm
        for result in per_rank:
            compare_scalars("grad norm", overrides, result[index]["norms"], reference.run.grad_norms, tolerance)

    first_loss = [reference.run.losses[0]] * len(evaluated)
    streamed = per_rank[0][index]["gradients"] is None  # PipeDream-2BW: no gradients between its steps
    checks = {
        "loss": check_losses,
        "forward-only loss": lambda: compare_scalars("forward-only loss", overrides, evaluated, first_loss,
                                                     tolerance),
        "grad norm": check_norms,
        "step-0 gradient": lambda: compare_gradients("step-0 gradient", overrides, per_rank, index, reference),
        "parameter": lambda: compare_parameters("parameter", overrides, per_rank, index, "shards", reference,
                                                STEPS),
    }
    if streamed:
        del checks["step-0 gradient"]
    if reference.validation_loss is not None:
        validated = [r[index]["validation_loss"] for r in per_rank if r[index]["validation_loss"] is not None]
        assert len(validated) == len(losses), "the validation loss is not on the ranks that hold the loss"
        checks["validation loss"] = lambda: compare_scalars("validation loss", overrides, validated,
                                                            [reference.validation_loss] * len(validated), tolerance)
    return checks


def compare_with_single_process(overrides: list[str], per_rank: list, index: int) -> None:
    """Run ``index`` of a launch passes every comparison with the single process."""
    for check in equivalence_checks(overrides, per_rank, index).values():
        check()


def train_in_workers(runs: list[list[str]], world_size: int, timeout: float = 240, schedule_builder=None,
                     breakers: list[str | None] | None = None) -> list[list[dict]]:
    """Train every run (layouts of one world size) in one launch; every rank's results, per run."""
    return run_workers(_train_runs, world_size, composed_runs(runs), schedule_builder, breakers, timeout=timeout)


def assert_equivalent(runs: list[list[str]], world_size: int, timeout: float = 240,
                      schedule_builder=None) -> list[list[dict]]:
    """Train every run (layouts of one world size, several schedules) in one launch; compare each with one process.

    ``schedule_builder(config) -> Schedule`` (module level, picklable) replaces the configured schedule.
    Returns every rank's results (per run: losses, norms, gradients, shards, message_bytes).
    """
    per_rank = train_in_workers(runs, world_size, timeout, schedule_builder)
    for index, overrides in enumerate(runs):
        compare_with_single_process(overrides, per_rank, index)
    return per_rank
