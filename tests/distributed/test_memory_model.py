"""The memory model against measured memory (gloo workers): per rank and part, for several layouts and schedules.

Each worker trains two steps (so AdamW's state exists), then measures the third: the bytes its
trainer holds between steps by part (parameters, gradient buffers, optimizer state) and, with
``ppctl.run.memory.StoragePeak``, the most its step's operations hold at once on top (saved
activations, messages, gradients in flight). ``ppctl.plan.memory.config_memory`` predicts the
same from the config alone. Each worker also runs one forward of each of its chunks under a
saved-tensor hook: what autograd keeps per microbatch, which the model's ``chunk_activation_bytes``
must match exactly (with TP, SP, split backwards and recomputation, in this process's layers). Mixtures of
experts at ep=2: the routed rows each EP rank receives differ, and the model predicts their mean (each pp rank's
measured mean over its EP ranks).
"""

from dataclasses import replace

import pytest

from ppctl.run.memory import StoragePeak, reachable_tensors, storage_key
from tests.distributed.equivalence import BASE, LLAMA, MIXTRAL, composed_runs
from tests.harness.pool import run_workers
from tests.harness.saved_tensors import chunk_forward_saved_bytes

CASES = {
    "1f1b pp4": ["parallel.pp=4", "parallel.dp=1", "schedule=1f1b"],
    "gpipe pp2 dp2": ["parallel.pp=2", "parallel.dp=2", "schedule=gpipe"],
    "interleaved pp2 vpp2 dp2": ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "schedule=interleaved_1f1b",
                                 "model.num_layers=8"],
    "zbv pp2 dp2": ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "schedule=zbv"],
    "zb_h1 pp4 recompute full": ["parallel.pp=4", "parallel.dp=1", "schedule=zb_h1", "model.num_layers=8",
                                 "model.recompute=full"],
    "1f1b tp2 pp2 sp bf16": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b",
                                         "parallel.sequence_parallel=true", "trainer.precision=bf16"],
    "1f1b pp2 dp2 distributed uneven": ["parallel.pp=2", "parallel.dp=2", "schedule=1f1b",
                                        "optimizer.distributed=true", "parallel.pipeline_layout=Ettt|tL"],
    # Llama: RMSNorm, SwiGLU, grouped-query attention (2 key/value heads for 4 query heads), rotary.
    "llama 1f1b pp4": ["parallel.pp=4", "parallel.dp=1", "schedule=1f1b", *LLAMA],
    "llama 1f1b tp2 pp2 sp": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b",
                              "parallel.sequence_parallel=true", *LLAMA],
    "llama zb_h1 tp2 pp2 sp": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=zb_h1",
                               "parallel.sequence_parallel=true", *LLAMA],
    "llama zbv pp2 dp2 distributed": ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "schedule=zbv",
                                      "optimizer.distributed=true", *LLAMA],
    # Mixtral's experts split over ep=2 (edp=1: the distributed optimizer shards the dense part over dp=2 alone)
    "mixtral 1f1b pp2 dp2 ep2": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "schedule=1f1b", *MIXTRAL],
    "mixtral zbv pp2 dp2 ep2 distributed": ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "parallel.ep=2",
                                            "schedule=zbv", "optimizer.distributed=true", *MIXTRAL],
    # each TP rank routes its seq / tp tokens (sequence parallelism), and the EP ranks are the TP ranks
    "mixtral 1f1b tp2 pp2 sp ep2": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "parallel.ep=2",
                                    "parallel.sequence_parallel=true", "schedule=1f1b", *MIXTRAL],
}
SIZES = ["model.hidden_size=64", "model.ffn_hidden_size=256", "trainer.seq_length=64", "trainer.micro_batch_size=2",
         "trainer.global_batch_size=16"]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (parameters that are views of one flat buffer count it once)."""
    return sum({tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in tensors if tensor is not None}.values())


class SendsCompleteAtOnce(StoragePeak):
    """``StoragePeak`` that stops counting a payload once its send is posted (``sent``): gloo's send works say
    they completed only once waited (measured: False a second after the peer received), so its transport holds every
    payload of a step until the step's end; NCCL's complete as the peer receives, which the memory model assumes
    (one message being sent at a time), as ``ppctl.run.fake_rank.InstantSends`` does."""

    def sent(self, payloads) -> None:
        """Release the storages of ``payloads`` (counted once, as a free would)."""
        for payload in payloads:
            storage = payload.untyped_storage()
            self._release(storage_key(storage), storage.nbytes())


def sends_complete_at_once_peak(trainer, step: int) -> int:
    """The most bytes step ``step`` of ``trainer`` allocates at once on top of what it holds, its sends' payloads
    uncounted once posted (``SendsCompleteAtOnce``)."""
    transport = trainer.runtime.transport
    post = transport.post
    with SendsCompleteAtOnce(reachable_tensors(trainer)) as tracker:
        def post_and_release(sends, receives):
            post(sends, receives)
            tracker.sent([payload for _, payload, _ in transport.pending_sends])
        transport.post = post_and_release
        trainer.train_step(step)
    transport.post = post
    return tracker.peak_bytes


def _measure(rank, world_size, configs):
    """Per run (a config composed in the test process): this rank's pp rank and measured bytes by part."""
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.memory import held_bytes
    from ppctl.run.train import Trainer

    contexts, results = {}, []
    for config in configs:
        run = resolve(config, check=False)  # validated in the test process
        layout = run.layout
        if layout not in contexts:
            contexts[layout] = build_parallel_context(layout, 60)
        trainer = Trainer(run, contexts[layout])
        trainer.train_steps(0, 2)
        optimizer, params = trainer.optimizer, trainer.parameters()
        parameters = storage_bytes(params)
        bucketed = hasattr(optimizer, "grad_data")
        gradients = storage_bytes([optimizer.grad_data] if bucketed else [param.grad for param in params])
        optimizer_state = optimizer.state_bytes() - (0 if bucketed else parameters)  # plain: the main copy is the model
        held = held_bytes(trainer)
        total = held + sends_complete_at_once_peak(trainer, 2)
        batch, seq = config.trainer.micro_batch_size, config.trainer.seq_length
        received_seq = seq // config.parallel.tp if config.parallel.sequence_parallel else seq
        saved = {stage: chunk_forward_saved_bytes(chunk, batch, seq, config.model.vocab_size, received_seq)
                 for stage, chunk in trainer.chunks.items()}
        results.append({"pp_rank": contexts[layout].pp_rank, "tp_rank": contexts[layout].coords["tp"],
                        "parameters": parameters, "gradients": gradients, "optimizer": optimizer_state,
                        "held": held, "total": total, "saved": saved})
    return results


# The whole per rank (parameters, gradients and optimizer state must be exact): measured within 5.5% on every dense
# rank since the backward's working memory is its largest moment (2026-12-07; 15% before, when it was every
# gradient of a layer at once); an EP rank's experts run the rows routed to it, which the model takes as the mean
EXPERT_RANK_TOLERANCE = 0.15
TOTAL_TOLERANCE = 0.07
# Issue 44's bound for the Llama family's layouts, sequence parallelism included, and issue 45's for the mixtures
# under expert parallelism (per pp rank: the mean of its EP ranks)
LLAMA_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def measured():
    """The configs of ``CASES`` (composed and validated) and, per worker, its measurements of each."""
    configs = composed_runs([BASE + SIZES + layout for layout in CASES.values()])
    return configs, run_workers(_measure, 4, configs, timeout=240)


def stage_mean(per_rank: list, index: int, pp_rank: int, key) -> float:
    """The mean of ``key(measurements)`` over the ranks of one pp rank in run ``index`` (with expert parallelism the
    received rows, and so the experts' activations, differ between EP ranks: the model predicts their mean)."""
    values = [key(rank_results[index]) for rank_results in per_rank if rank_results[index]["pp_rank"] == pp_rank]
    return sum(values) / len(values)


@pytest.mark.timeout(300)
def test_predicted_memory_per_rank_and_part_against_measured(measured):
    """Parameters, gradients and optimizer state exactly; the total within ``TOTAL_TOLERANCE`` (a mixture's per pp
    rank as the mean of its EP ranks within 10%, each within ``EXPERT_RANK_TOLERANCE``).
    Broken twins, at ep=2: the experts counted whole (as at ep=1), and their optimizer state sharded over the dense
    replicas (dp) rather than their edp ranks."""
    from ppctl.resolve.resolved import resolve
    from ppctl.plan.memory import config_memory, config_memory_inputs, rank_memory, schedule_states

    configs, per_rank = measured
    rows = []
    for index, (name, config) in enumerate(zip(CASES, configs)):
        predicted = config_memory(resolve(config, check=False))
        rows += [(index, name, rank_results[index], predicted[rank_results[index]["pp_rank"]])
                 for rank_results in per_rank]
    table = "\n".join(f"{name}: pp rank {measured['pp_rank']}: predicted {model.to_json()}, measured {measured}"
                      for _, name, measured, model in rows)
    for index, name, measured, model in rows:
        assert (model.parameters, model.gradients, model.optimizer) == (
            measured["parameters"], measured["gradients"], measured["optimizer"]), table
        tolerance = EXPERT_RANK_TOLERANCE if configs[index].parallel.ep > 1 else TOTAL_TOLERANCE
        assert abs(model.total / measured["total"] - 1) <= tolerance, table
        if name.startswith(("llama", "mixtral")):
            mean = stage_mean(per_rank, index, measured["pp_rank"], lambda results: results["total"])
            assert abs(model.total / mean - 1) <= LLAMA_TOLERANCE, table
    for index, (name, config) in enumerate(zip(CASES, configs)):
        if config.parallel.ep == 1:
            continue
        run = resolve(config, check=False)
        inputs, states = config_memory_inputs(run), schedule_states(run.schedule)
        for twin in (replace(inputs.parallel, ep=1),
                     replace(inputs.parallel, expert_optimizer_shards=inputs.parallel.optimizer_shards)):
            for results in (rank_results[index] for rank_results in per_rank):
                broken = rank_memory(inputs.shape, inputs.chunks[results["pp_rank"]], states[results["pp_rank"]],
                                     inputs.tokens, twin)
                if twin.ep == 1 or config.optimizer.distributed:
                    assert (broken.parameters, broken.optimizer) != (results["parameters"], results["optimizer"]), name


@pytest.mark.timeout(300)
def test_kept_activations_per_chunk_are_what_autograd_saves(measured):
    """Exactly, on TP rank 0 (the model counts every TP rank as the one holding the most: the loss's real classes
    of a padded vocabulary are all on TP rank 0). Broken twin: for a Llama with sequence parallelism, counting the
    layers as the other kind of backward keeps them (split into B and W or not) misses, so the check sees how its
    separate q, k, v, gate and up projections keep their gathered inputs (a GPT's fused QKV and single MLP input
    projection keep one each either way)."""
    from ppctl.resolve.resolved import resolve
    from ppctl.plan.memory import chunk_activation_bytes, config_memory_inputs

    configs, per_rank = measured
    for index, (name, config) in enumerate(zip(CASES, configs)):
        inputs = config_memory_inputs(resolve(config, check=False))
        other_backward = replace(inputs.parallel, split_backward=not inputs.parallel.split_backward)
        for measurements in (rank_results[index] for rank_results in per_rank):
            if measurements["tp_rank"]:
                continue
            for chunk in inputs.chunks[measurements["pp_rank"]]:
                saved = measurements["saved"][chunk.stage]
                kept, _ = chunk_activation_bytes(inputs.shape, chunk, inputs.tokens, inputs.parallel)
                if chunk.moe_layers:  # an estimate, of the mean of the EP ranks (measured: within 0.2%)
                    mean = stage_mean(per_rank, index, measurements["pp_rank"],
                                      lambda results: results["saved"][chunk.stage])
                    assert kept == pytest.approx(mean, rel=0.02), (name, measurements["pp_rank"], chunk)
                    continue
                assert kept == saved, (name, measurements["pp_rank"], chunk)
                if name.startswith("llama") and config.parallel.sequence_parallel and chunk.layers:
                    twin, _ = chunk_activation_bytes(inputs.shape, chunk, inputs.tokens, other_backward)
                    assert twin != saved, (name, measurements["pp_rank"], chunk)
