"""The real B/W split of a GPT stage's backward, without processes.

B computes the input gradient only and stashes, per microbatch, what each norm's and
linear's weight gradient needs; W computes those gradients and accumulates them through
autograd. Split and whole backwards must agree bit for bit (float64, elementwise).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ppctl.model.gpt.model import GPTChunk, GPTConfig
from ppctl.autograd.weight_grad import (
    ComputedWeightGrads,
    WeightGradStore,
    add_bias,
    attach_weight_grad_store,
    layer_norm,
    linear,
)
from ppctl.model.moe.shape import MoEShape
from ppctl.model.recompute import Recompute
from ppctl.parallel.layout import StageLayers
from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec, run_backward

SEED = 7
BATCH, SEQ = 2, 8
CONFIG = dict(num_layers=3, hidden_size=16, num_heads=2, ffn_hidden_size=32, vocab_size=24, max_seq_length=SEQ)


def chunk_forward(chunk: GPTChunk, stage_input, microbatch) -> torch.Tensor:
    """The data contract of these tests: hidden states in, per-token losses out on the last stage."""
    return chunk(stage_input, labels=microbatch.get("labels"))


def weighted_loss(losses: torch.Tensor, microbatch):
    """Per-token losses weighted unevenly, so every token's gradient differs."""
    weights = torch.linspace(0.5, 1.5, losses.numel(), dtype=losses.dtype).view_as(losses)
    loss = (losses * weights).sum()
    return loss, loss.detach()


def make_stage(last: bool, dtype=torch.float64, tie_embeddings=False, recompute=Recompute(),
               moe: MoEShape | None = None) -> PipelineStage:
    """A middle stage (layers 0-1) or a last stage (layer 2, final norm, output layer, loss); ``moe``: its layers'
    MLPs are experts."""
    config = GPTConfig(**CONFIG, tie_embeddings=tie_embeddings, moe=moe)
    chunk = GPTChunk(config, StageLayers(0, (2,) if last else (0, 1), False, last), seed=SEED, dtype=dtype,
                     recompute=recompute)
    spec = TensorSpec((BATCH, SEQ, config.hidden_size), dtype)
    io = StageIO(input=spec, output=None if last else spec, fields=())
    return PipelineStage(1, chunk, io, chunk_forward, is_last=last, split_backward=True)


def microbatch_data(stage: PipelineStage, microbatch: int):
    """The stage input, the microbatch (labels on the last stage) and the output gradient of one microbatch."""
    generator = torch.Generator().manual_seed(100 + microbatch)
    spec = stage.io.input
    stage_input = torch.randn(spec.shape, dtype=torch.float64, generator=generator).to(spec.dtype)
    labels = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=generator)
    grad_output = torch.randn(spec.shape, dtype=torch.float64, generator=generator).to(spec.dtype)
    if stage.is_last:
        return stage_input, {"labels": labels}, None
    return stage_input, {}, grad_output


def run_actions(stage: PipelineStage, actions: list[tuple[str, int]]) -> dict[int, torch.Tensor]:
    """Run ``F``, ``BW`` (whole), ``B`` and ``W`` actions of microbatches; return the input gradients by microbatch."""
    grad_inputs = {}
    for kind, microbatch in actions:
        stage_input, data, grad_output = microbatch_data(stage, microbatch)
        if kind == "F":
            stage.forward(microbatch, data, stage_input, weighted_loss)
        elif kind == "BW":
            grad_inputs[microbatch] = stage.backward(microbatch, grad_output)
        elif kind == "B":
            grad_inputs[microbatch] = stage.backward_input(microbatch, grad_output)
        else:
            stage.backward_weight(microbatch)
    return grad_inputs


def weight_grads(stage: PipelineStage) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by name (a copy; None where none)."""
    return {name: None if param.grad is None else param.grad.clone()
            for name, param in stage.module.named_parameters()}


def assert_same_grads(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(actual[name], grad), f"{name} differs from the whole backward's gradient"


WHOLE = [("F", 0), ("F", 1), ("BW", 0), ("BW", 1)]
SPLIT = [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 1), ("W", 0)]
# "last-tied": the output layer of a last stage holding no embedding is the tied copy (summed with the
# first stage's after the backward); a weight shared within one chunk is tested further down.
# With experts: the router's linear and the experts' grouped linears defer too, the router losses join the backward.
EXPERTS = MoEShape(num_experts=4, topk=2, expert_ffn_hidden_size=24, shared_experts=1, aux_loss_coeff=0.1,
                   z_loss_coeff=0.01)
STAGES = {"middle": dict(last=False), "last": dict(last=True), "last-tied": dict(last=True, tie_embeddings=True),
          "middle-bf16": dict(last=False, dtype=torch.bfloat16), "middle-moe": dict(last=False, moe=EXPERTS),
          "last-moe": dict(last=True, moe=EXPERTS)}


@pytest.mark.parametrize("kind", STAGES)
def test_split_backward_equals_whole_backward_bitwise(kind):
    whole_stage, split_stage = make_stage(**STAGES[kind]), make_stage(**STAGES[kind])
    whole_inputs = run_actions(whole_stage, WHOLE)
    split_inputs = run_actions(split_stage, SPLIT)
    for microbatch, grad in whole_inputs.items():
        assert torch.equal(split_inputs[microbatch], grad), f"input gradient of microbatch {microbatch} differs"
    whole = weight_grads(whole_stage)
    assert all(grad is not None and grad.abs().sum() > 0 for grad in whole.values())
    assert_same_grads(weight_grads(split_stage), whole)
    assert all(param.dtype == param.grad.dtype for param in split_stage.module.parameters())


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
@pytest.mark.parametrize("recompute", [Recompute("full", "uniform", 2), Recompute("full", "block", 1),
                                       Recompute("selective")], ids=["full-uniform", "full-block", "selective"])
def test_recomputing_stages_split_their_backward_bitwise(recompute, last):
    """A stage that recomputes gives the gradients of one that does not, whole or split: B recomputes and stashes
    the recomputed tensors W needs (W finds every weight, also those of the recomputed region's last op)."""
    expected = make_stage(last)
    expected_inputs = run_actions(expected, WHOLE)
    for actions in (WHOLE, SPLIT):
        stage = make_stage(last, recompute=recompute)
        grad_inputs = run_actions(stage, actions)
        assert_same_grads(weight_grads(stage), weight_grads(expected))
        assert all(torch.equal(grad_inputs[key], grad) for key, grad in expected_inputs.items() if grad is not None)


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_each_w_accumulates_its_own_microbatch(last):
    """B0 B1 W1: exactly microbatch 1's gradients, as a whole backward of microbatch 1 alone gives them."""
    alone = make_stage(last)
    run_actions(alone, [("F", 1), ("BW", 1)])
    split = make_stage(last)
    run_actions(split, [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 1)])
    assert_same_grads(weight_grads(split), weight_grads(alone))


def counted_flops(stage: PipelineStage, actions: list[tuple[str, int]]) -> int:
    """Matmul FLOPs of running ``actions`` (PyTorch's flop counter)."""
    with FlopCounterMode(display=False) as counter:
        run_actions(stage, actions)
    return counter.get_total_flops()


def test_b_computes_no_weight_gradient_frees_the_graph_and_holds_the_stash():
    whole = make_stage(last=False)
    run_actions(whole, [("F", 0)])
    whole_flops = counted_flops(whole, [("BW", 0)])
    stage = make_stage(last=False)
    run_actions(stage, [("F", 0)])
    output = stage.outputs[0]
    b_flops = counted_flops(stage, [("B", 0)])
    assert all(grad is None for grad in weight_grads(stage).values())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        run_backward(output, torch.ones_like(output))
    assert stage.holds_work() and not stage.outputs and not stage.inputs
    stashed = stage.held_tensors()
    assert stashed and all(tensor.numel() > 1 for tensor in stashed)
    w_flops = counted_flops(stage, [("W", 0)])
    # The weight-gradient matmuls moved from B to W: none done twice, none done in B.
    assert b_flops + w_flops == whole_flops and w_flops > 0
    assert not stage.holds_work() and stage.held_tensors() == []
    assert all(grad is not None for grad in weight_grads(stage).values())


def test_w_without_its_b_is_refused():
    stage = make_stage(last=False)
    run_actions(stage, [("F", 0), ("F", 1), ("B", 0)])
    with pytest.raises(RuntimeError, match=r"stage 1: W of microbatch 1 before its B"):
        stage.backward_weight(1)
    run_actions(stage, [("W", 0)])
    with pytest.raises(RuntimeError, match=r"W of microbatch 0 before its B"):
        stage.backward_weight(0)


def test_w_fires_each_post_accumulate_hook_once_per_microbatch():
    """The distributed optimizer counts microbatches in these hooks: W must go through AccumulateGrad."""
    stage = make_stage(last=True)
    fired = {name: 0 for name, _ in stage.module.named_parameters()}
    for name, param in stage.module.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _param, name=name: fired.update({name: fired[name] + 1}))
    run_actions(stage, [("F", 0), ("F", 1), ("B", 0), ("B", 1)])
    assert set(fired.values()) == {0}
    run_actions(stage, [("W", 1)])
    assert set(fired.values()) == {1}
    run_actions(stage, [("W", 0)])
    assert set(fired.values()) == {2}


def test_a_tied_output_layer_defers_and_its_weight_gets_both_uses_once():
    """One chunk with both ends: the word embedding's lookup (cannot defer) and the output layer (deferred)."""
    config = GPTConfig(**CONFIG, tie_embeddings=True)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def loss_of(chunk):
        return weighted_loss(chunk(tokens, labels=tokens.roll(-1, dims=1)), None)[0]

    whole = GPTChunk(config, StageLayers.whole(1), seed=SEED, dtype=torch.float64)
    loss_of(whole).backward()
    split = GPTChunk(config, StageLayers.whole(1), seed=SEED, dtype=torch.float64)
    store = WeightGradStore()
    attach_weight_grad_store(split, store)
    weights = tuple(split.parameters())
    fired = []
    split.embedding.word.weight.register_post_accumulate_grad_hook(fired.append)
    with store.defer("mb"):
        grads = run_backward(loss_of(split), None, inputs=weights, accumulate=False)
        # As a stage's B does: the gradients of what cannot defer, kept for W.
        store.stash(ComputedWeightGrads(weights, tuple(grads)))
    assert all(param.grad is None for param in weights)
    store.accumulate("mb")
    assert len(fired) == 1
    for (name, expected), actual in zip(whole.named_parameters(), weights):
        assert torch.equal(actual.grad, expected.grad), name


def plain_and_split_ops(rows: int, columns: int):
    """Each split op beside the plain PyTorch op it replaces: ``name: (plain, split, weight shapes)``;
    ``plain(x, weights)``, ``split(x, weights, store)``."""
    return {
        "linear": (lambda x, w: F.linear(x, *w), lambda x, w, store: linear(x, *w, store), [(rows, columns), (rows,)]),
        "bias": (lambda x, w: x + w[0], lambda x, w, store: add_bias(x, w[0], store), [(columns,)]),
        "layer_norm": (lambda x, w: F.layer_norm(x, (columns,), *w, 1e-5),
                       lambda x, w, store: layer_norm(x, (columns,), *w, 1e-5, store), [(columns,), (columns,)]),
    }


def op_gradients(function, inputs: torch.Tensor, weights: list, grad_output: torch.Tensor,
                 store: WeightGradStore | None = None) -> list[torch.Tensor]:
    """The gradients of ``function(x, params)`` for the input and each weight; with a ``store``, as a B then a W."""
    x = inputs.clone().requires_grad_()
    params = [torch.nn.Parameter(weight.clone()) for weight in weights]
    output = function(x, params)
    if store is None:
        output.backward(grad_output)
    else:
        with store.defer("mb"):
            output.backward(grad_output)
        deferred = bool(store.held_tensors())  # only a linear defers; a bias or a norm computes in B
        assert all(param.grad is None for param in params) == deferred
        store.accumulate("mb")
    return [x.grad, *(param.grad for param in params)]


@pytest.mark.parametrize("defer", [False, True], ids=["whole", "deferred"])
@pytest.mark.parametrize("name", ["linear", "bias", "layer_norm"])
def test_split_ops_give_plain_autograd_gradients(name, defer):
    """The formulas themselves (shared by the split and whole paths) against PyTorch's own backward;
    only the linear's weight gradients wait for W (a bias's and a norm's are cheap reductions done in B)."""
    plain, split, shapes = plain_and_split_ops(4, 6)[name]
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(2, 5, 6, dtype=torch.float64, generator=generator)
    weights = [torch.randn(shape, dtype=torch.float64, generator=generator) for shape in shapes]
    grad_output = torch.randn_like(plain(inputs, weights))
    store = WeightGradStore()  # attached: the split op runs (never deferring in the whole case)
    actual = op_gradients(lambda x, params: split(x, params, store), inputs, weights, grad_output,
                          store if defer else None)
    expected = op_gradients(plain, inputs, weights, grad_output)
    for got, wanted in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", ["middle", "middle-moe", "last-moe"])
def test_a_w_paused_between_layers_for_another_microbatchs_b_gives_the_whole_backwards_gradients(kind):
    """A weight fill: W1 pauses between its layers' stashed work (each pause once: n entries, n - 1 pauses), and at
    its first pause B0 runs, stashing into the same store; then W0. Bitwise the gradients of a whole backward."""
    whole = make_stage(**STAGES[kind])
    run_actions(whole, WHOLE)
    stage = make_stage(**STAGES[kind])
    run_actions(stage, [("F", 0), ("F", 1), ("B", 1)])
    entries = len(stage.weight_grads._stashes[1])
    pauses = []

    def pause():
        if not pauses:
            run_actions(stage, [("B", 0)])
        pauses.append(len(stage.weight_grads._stashes))

    stage.backward_weight(1, pause)
    assert len(pauses) == entries - 1 and pauses[0] == 1  # B0's stash while W1 ran
    run_actions(stage, [("W", 0)])
    assert not stage.holds_work()
    assert_same_grads(weight_grads(stage), weight_grads(whole))
