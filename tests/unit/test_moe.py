"""The mixture-of-experts part (``ppctl.model.moe``) against plain loops over tokens, in float64, in one process.

The reference here routes one token at a time with Python's own sorting: scores, its top-k experts (the expert
bias moving only the choice), the capacity rule of each policy over the assignments in microbatch order, each
expert's MLP on one token, the weighted sum, the shared experts; the balancing and z losses from their formulas.
The layer must give its outputs and, with the router losses' gradient scaled as the trainer scales it, every
parameter's gradient; its B/W split must give the whole backward's gradients bit for bit, also recomputed.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from ppctl.autograd.checkpoint import recomputed
from ppctl.model.layers import MLP
from ppctl.model.llama.layers import SwiGLUMLP
from ppctl.model.moe.dispatch import permute, plan_dispatch, unpermute_and_combine
from ppctl.model.moe.experts import GeluExperts, SwiGLUExperts
from ppctl.model.moe.layer import MoEMLP
from ppctl.model.moe.router import balancing_loss, route, z_loss
from ppctl.model.moe.shape import MoEShape
from ppctl.model.moe.statistics import routing_statistics, routing_table, update_expert_biases
from ppctl.parallel.tensor_parallel import TPGroup
from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec
from ppctl.run.logging import routing_scalars

HIDDEN, FFN, EXPERTS, TOPK = 8, 6, 4, 2
BATCH, SEQ = 2, 6
TIGHT = dict(rtol=1e-12, atol=1e-13)


def shape_of(**settings) -> MoEShape:
    return MoEShape(**{"num_experts": EXPERTS, "topk": TOPK, "expert_ffn_hidden_size": FFN, **settings})


def draw(*size, seed=0, scale=1.0) -> torch.Tensor:
    return scale * torch.randn(*size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# --- the loop reference ------------------------------------------------------------------------

def loop_route(logits_row: list[float], shape: MoEShape, bias: list[float]) -> tuple[list[int], list[float]]:
    """One token: its top-k experts by score + bias (Python's sort) and their weights (unbiased scores)."""
    if shape.router_score == "softmax":
        top = max(logits_row)
        exps = [math.exp(value - top) for value in logits_row]
        scores = [value / sum(exps) for value in exps]
    else:
        scores = [1 / (1 + math.exp(-value)) for value in logits_row]
    chosen = sorted(range(len(scores)), key=lambda expert: -(scores[expert] + bias[expert]))[:shape.topk]
    weights = [scores[expert] for expert in chosen]
    if shape.router_topk_norm:
        weights = [weight / sum(weights) for weight in weights]
    return chosen, weights


def loop_kept(choices: list[list[int]], weights: list[list[float]], shape: MoEShape) -> set[tuple[int, int]]:
    """The (token, slot) assignments each expert keeps under the capacity rule (all of them when dropless)."""
    assignments = [(token, slot) for token in range(len(choices)) for slot in range(shape.topk)]
    capacity = shape.capacity(len(choices))
    if capacity is None:
        return set(assignments)
    if shape.drop_policy == "probs":  # highest weight first, the earlier assignment first among equals
        assignments.sort(key=lambda pair: -weights[pair[0]][pair[1]])
    kept, taken = set(), [0] * shape.num_experts
    for token, slot in assignments:
        expert = choices[token][slot]
        if taken[expert] < capacity:
            kept.add((token, slot))
            taken[expert] += 1
    return kept


def loop_expert(layer: MoEMLP, expert: int, token: torch.Tensor) -> torch.Tensor:
    """One expert's MLP on one token, from the stacked weights."""
    experts = layer.experts
    if isinstance(experts, GeluExperts):
        inner = F.gelu(experts.fc_in.weight[expert] @ token + experts.fc_in.bias[expert])
        return experts.fc_out.weight[expert] @ inner + experts.fc_out.bias[expert]
    gate = experts.gate_proj.weight[expert] @ token
    return experts.down_proj.weight[expert] @ (F.silu(gate) * (experts.up_proj.weight[expert] @ token))


def loop_layer(layer: MoEMLP, hidden: torch.Tensor):
    """The layer's output ``[batch, seq, hidden]``, its balancing loss and z-loss, token by token."""
    shape, tokens = layer.shape, hidden.reshape(-1, HIDDEN)
    bias = [0.0] * EXPERTS if layer.router.expert_bias is None else layer.router.expert_bias.tolist()
    logits = [layer.router.weight @ token for token in tokens]
    routed = [loop_route(row.tolist(), shape, bias) for row in logits]
    choices, weights = [chosen for chosen, _ in routed], [weight for _, weight in routed]
    kept = loop_kept(choices, weights, shape)
    scores = [torch.softmax(row, 0) if shape.router_score == "softmax" else torch.sigmoid(row) for row in logits]
    outputs = []
    for token, vector in enumerate(tokens):
        chosen = torch.stack([scores[token][expert] for expert in choices[token]])
        chosen = chosen / chosen.sum() if shape.router_topk_norm else chosen
        output = sum(chosen[slot] * loop_expert(layer, expert, vector)
                     for slot, expert in enumerate(choices[token]) if (token, slot) in kept)
        output = output + torch.zeros(HIDDEN, dtype=vector.dtype)  # a token all of whose experts dropped it
        if layer.shared_experts is not None:
            output = output + layer.shared_experts(vector.view(1, 1, HIDDEN)).view(HIDDEN)
        outputs.append(output)
    probs = [score / score.sum() for score in scores]  # a softmax's already sum to 1
    fractions = [sum(row.count(expert) for row in choices) / (len(tokens) * TOPK) for expert in range(EXPERTS)]
    balancing = EXPERTS * sum(fractions[expert] * sum(p[expert] for p in probs) / len(tokens)
                              for expert in range(EXPERTS))
    z = sum(torch.logsumexp(row, 0) ** 2 for row in logits) / len(tokens)
    return torch.stack(outputs).view_as(hidden), balancing, z


# --- the layer as built ------------------------------------------------------------------------

def built_layer(kind: str, shape: MoEShape, seed: int = 1) -> MoEMLP:
    """An MoE MLP with GELU (GPT) or SwiGLU (Llama) experts, every parameter drawn; the bias drawn when it has one."""
    tp = TPGroup.single()
    if kind == "gelu":
        experts = GeluExperts(EXPERTS, HIDDEN, FFN, torch.float64)
        shared = MLP(HIDDEN, shape.shared_ffn_hidden_size, tp, torch.float64) if shape.shared_experts else None
    else:
        experts = SwiGLUExperts(EXPERTS, HIDDEN, FFN, torch.float64)
        shared = SwiGLUMLP(HIDDEN, shape.shared_ffn_hidden_size, tp, torch.float64) if shape.shared_experts else None
    layer = MoEMLP(HIDDEN, shape, experts, shared, torch.float64)
    with torch.no_grad():
        for index, param in enumerate(layer.parameters()):
            param.copy_(draw(*param.shape, seed=seed * 100 + index, scale=0.5))
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(draw(EXPERTS, seed=seed, scale=0.3))
    return layer


SHAPES = {
    "softmax": dict(),
    "softmax-norm-capacity-probs": dict(router_topk_norm=True, capacity_factor=0.75, drop_policy="probs"),
    "sigmoid-norm-bias-shared": dict(router_score="sigmoid", router_topk_norm=True, expert_bias=True,
                                     shared_experts=1),
    "sigmoid-capacity-position": dict(router_score="sigmoid", capacity_factor=0.5, drop_policy="position"),
}
LOSSES = dict(aux_loss_coeff=0.3, z_loss_coeff=0.05)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
@pytest.mark.parametrize("case", SHAPES)
def test_layer_output_and_gradients_equal_the_token_loop(kind, case):
    """Output, and every gradient of ``sum(output * g) + scale * (router losses)``: the router losses' gradient reaches
    the backward through the layer's output, scaled by ``router_loss_scale``."""
    shape = shape_of(**SHAPES[case], **LOSSES)
    layer, twin = built_layer(kind, shape), built_layer(kind, shape)
    hidden, grad = draw(BATCH, SEQ, HIDDEN, seed=5), draw(BATCH, SEQ, HIDDEN, seed=6)
    layer.router_loss_scale = 0.125
    output = layer(hidden)
    (output * grad).sum().backward()
    expected, balancing, z = loop_layer(twin, hidden)
    torch.testing.assert_close(output, expected, **TIGHT)
    objective = (expected * grad).sum() + 0.125 * (shape.aux_loss_coeff * balancing + shape.z_loss_coeff * z)
    objective.backward()
    for (name, param), (_, twin_param) in zip(layer.named_parameters(), twin.named_parameters(), strict=True):
        torch.testing.assert_close(param.grad, twin_param.grad, **TIGHT, msg=name)
    record = layer.take_record()
    assert record.microbatches == 1
    torch.testing.assert_close(record.balancing, balancing.detach(), **TIGHT)
    torch.testing.assert_close(record.z, z.detach(), **TIGHT)


def test_capacity_drops_assignments_and_a_token_may_lose_every_expert():
    """At capacity factor 0.5 an expert keeps 3 of the 24 assignments of 12 tokens: most are dropped."""
    shape = shape_of(capacity_factor=0.5, drop_policy="position")
    layer = built_layer("gelu", shape)
    routing = layer.router(draw(BATCH * SEQ, HIDDEN, seed=5))
    dispatch = plan_dispatch(routing.experts, routing.weights, EXPERTS, shape.capacity(BATCH * SEQ), "position")
    assert shape.capacity(BATCH * SEQ) == 3 and max(dispatch.counts) <= 3
    assert int(dispatch.kept.sum()) == sum(dispatch.counts) < BATCH * SEQ * TOPK


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity", [None, 1, 4, 7])
def test_dispatch_keeps_and_sorts_as_the_loop(policy, capacity):
    """The kept assignments, their order by expert (microbatch order within one) and the combine, against loops."""
    generator = torch.Generator().manual_seed(3)
    tokens, topk = 10, 3
    experts = torch.stack([torch.randperm(EXPERTS, generator=generator)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, dtype=torch.float64, generator=generator)
    dispatch = plan_dispatch(experts, weights, EXPERTS, capacity, policy)
    shape = MoEShape(EXPERTS, topk, FFN, drop_policy=policy)
    if capacity is not None:  # the loop's capacity rule, at this capacity
        shape = MoEShape(EXPERTS, topk, FFN, capacity_factor=capacity * EXPERTS / (tokens * topk), drop_policy=policy)
        assert shape.capacity(tokens) == capacity
    kept = loop_kept(experts.tolist(), weights.tolist(), shape)
    assert {(int(a) // topk, int(a) % topk) for a in dispatch.order} == kept
    expected_order = [token * topk + slot for expert in range(EXPERTS) for token in range(tokens)
                      for slot in range(topk) if experts[token, slot] == expert and (token, slot) in kept]
    assert dispatch.order.tolist() == expected_order
    assert dispatch.counts == tuple(sum(1 for a in expected_order if experts.flatten()[a] == e) for e in range(EXPERTS))
    rows = draw(tokens, HIDDEN, seed=9)
    permuted = permute(rows, dispatch, topk)
    assert torch.equal(permuted, torch.stack([rows[a // topk] for a in expected_order]) if expected_order
                       else rows.new_zeros(0, HIDDEN))
    combined = unpermute_and_combine(2 * permuted, dispatch, weights)
    loop = [sum((2 * weights[t, s] * rows[t] for s in range(topk) if (t, s) in kept), torch.zeros(HIDDEN,
                dtype=torch.float64)) for t in range(tokens)]
    torch.testing.assert_close(combined, torch.stack(loop), **TIGHT)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [False, True])
def test_router_scores_choice_and_weights_equal_the_loop(score, norm):
    shape = shape_of(router_score=score, router_topk_norm=norm)
    logits = draw(12, EXPERTS, seed=2)
    bias = draw(EXPERTS, seed=4, scale=0.5)
    routing = route(logits, shape, bias)
    for row, chosen, weights in zip(logits.tolist(), routing.experts.tolist(), routing.weights.tolist()):
        expected_chosen, expected_weights = loop_route(row, shape, bias.tolist())
        assert chosen == expected_chosen
        assert weights == pytest.approx(expected_weights, rel=1e-13)


def test_the_expert_bias_moves_the_choice_only():
    """A bias that lifts an expert makes every token choose it, and its weight stays the unbiased score."""
    shape = shape_of(router_score="sigmoid", expert_bias=True)
    logits = draw(12, EXPERTS, seed=2)
    plain = route(logits, shape, torch.zeros(EXPERTS, dtype=torch.float64))
    lifted = route(logits, shape, torch.tensor([0.0, 0.0, 5.0, 0.0], dtype=torch.float64))
    assert (plain.experts != 2).any() and (lifted.experts == 2).any(dim=1).all()
    scores = torch.sigmoid(logits)
    torch.testing.assert_close(lifted.weights, scores.gather(1, lifted.experts), **TIGHT)
    torch.testing.assert_close(lifted.probs, plain.probs, **TIGHT)


def test_balancing_and_z_losses_equal_their_formulas():
    """``E * sum_i f_i P_i`` (1 for an even router) and the mean of ``logsumexp^2``."""
    shape = shape_of()
    logits = draw(12, EXPERTS, seed=2)
    routing = route(logits, shape)
    load = routing.load(EXPERTS)
    fractions = [sum(row.count(e) for row in routing.experts.tolist()) / (12 * TOPK) for e in range(EXPERTS)]
    probs = torch.softmax(logits, -1).mean(0)
    expected = EXPERTS * sum(f * p for f, p in zip(fractions, probs.tolist()))
    assert balancing_loss(routing, load).item() == pytest.approx(expected, rel=1e-14)
    expected_z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 12
    assert z_loss(routing).item() == pytest.approx(expected_z, rel=1e-14)
    even = route(torch.zeros(8, EXPERTS, dtype=torch.float64), shape_of(topk=1))
    even.experts = torch.arange(8).remainder(EXPERTS).view(8, 1)  # two tokens per expert, uniform probabilities
    assert balancing_loss(even, even.load(EXPERTS)).item() == pytest.approx(1.0, rel=1e-15)


@pytest.mark.parametrize("router_score", ["softmax", "sigmoid"])
def test_router_losses_of_a_split_microbatch_are_shares_that_sum_to_the_whole(router_score):
    """A microbatch's tokens split over ranks (TP under SP, CP): each share's balancing and z losses, from the whole's
    load and token count, sum to the whole's losses, and each share's gradient is the whole's with respect to its
    tokens. Broken twin: each share weighed by its own load misses the whole's balancing loss."""
    shape = shape_of(router_score=router_score)
    logits = draw(12, EXPERTS, seed=5).requires_grad_()
    whole = route(logits, shape)
    whole_losses = balancing_loss(whole, whole.load(EXPERTS)) + z_loss(whole)
    (whole_grad,) = torch.autograd.grad(whole_losses, logits)
    shares = [route(part, shape) for part in logits.split(4)]  # three ranks of 4 tokens each
    load = sum(share.load(EXPERTS) for share in shares)
    share_losses = [balancing_loss(share, load, 12) + z_loss(share, 12) for share in shares]
    assert sum(loss.item() for loss in share_losses) == pytest.approx(whole_losses.item(), rel=1e-14)
    (share_grad,) = torch.autograd.grad(sum(share_losses), logits)
    torch.testing.assert_close(share_grad, whole_grad, **TIGHT)
    own_load = sum(balancing_loss(share, share.load(EXPERTS), 12).item() for share in shares)
    assert own_load != pytest.approx(balancing_loss(whole, whole.load(EXPERTS)).item(), rel=1e-6)


def test_expert_bias_update_is_the_sign_rule():
    layer = built_layer("gelu", shape_of(router_score="sigmoid", expert_bias=True, expert_bias_update_rate=0.01))
    before = layer.router.expert_bias.clone()
    layer.router.update_expert_bias(torch.tensor([5, 1, 3, 3]))  # mean 3: under, over, even, even
    torch.testing.assert_close(layer.router.expert_bias - before,
                               torch.tensor([-0.01, 0.01, 0.0, 0.0], dtype=torch.float64), **TIGHT)


def test_statistics_are_recorded_once_per_trained_microbatch():
    """Not by an evaluation (no graph), once by a recomputed forward's backward (the first forward's identity)."""
    layer = built_layer("swiglu", shape_of(**LOSSES))
    hidden = draw(BATCH, SEQ, HIDDEN, seed=5).requires_grad_()
    with torch.no_grad():
        layer(hidden)
    assert layer.take_record().microbatches == 0
    recomputed(layer, hidden).sum().backward()
    record = layer.take_record()
    assert record.microbatches == 1 and int(record.load.sum()) == BATCH * SEQ * TOPK


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_split_backward_equals_whole_backward_bitwise(kind, recompute):
    """As a pipeline stage runs it: B computes the input gradient and stashes the router's and the experts' weight
    work, W computes it; the same bits as a whole backward (the store attached in both, as a stage attaches it)."""
    shape = shape_of(router_score="sigmoid", router_topk_norm=True, shared_experts=1, capacity_factor=1.0, **LOSSES)
    spec = TensorSpec((BATCH, SEQ, HIDDEN), torch.float64)
    results = []
    for actions in (["F", "BW"], ["F", "B", "W"]):
        layer = built_layer(kind, shape)
        forward = (lambda module, x, _: recomputed(module, x)) if recompute else (lambda module, x, _: module(x))
        stage = PipelineStage(1, layer, StageIO(spec, spec, ()), forward, is_last=False, split_backward=True)
        grad_input = None
        for action in actions:
            if action == "F":
                stage.forward(0, None, draw(BATCH, SEQ, HIDDEN, seed=5), None)
            elif action == "BW":
                grad_input = stage.backward(0, draw(BATCH, SEQ, HIDDEN, seed=6))
            elif action == "B":
                grad_input = stage.backward_input(0, draw(BATCH, SEQ, HIDDEN, seed=6))
                assert all(param.grad is None for param in layer.parameters()) and stage.held_tensors()
            else:
                stage.backward_weight(0)
        results.append((grad_input, {name: param.grad for name, param in layer.named_parameters()}))
    (whole_input, whole), (split_input, split) = results
    assert torch.equal(split_input, whole_input)
    for name, grad in whole.items():
        assert grad is not None and torch.equal(split[name], grad), name


def test_summed_tables_give_the_steps_statistics_and_move_every_copy_alike():
    """Two ranks' tables (each one microbatch of the layer) summed: the global load, the mean losses, the imbalance
    the logger writes; every copy of the layer then moves its bias by the global load."""
    shape = shape_of(router_score="sigmoid", expert_bias=True, expert_bias_update_rate=0.01, **LOSSES)
    copies = [built_layer("gelu", shape), built_layer("gelu", shape)]
    chunks = []
    for seed, layer in enumerate(copies):
        chunk = torch.nn.Module()
        chunk.layers = torch.nn.ModuleDict({"3": torch.nn.Module()})
        chunk.layers["3"].mlp = layer
        layer(draw(BATCH, SEQ, HIDDEN, seed=seed).requires_grad_()).sum().backward()
        chunks.append(chunk)
    loads = [copy.record.load.clone() for copy in copies]
    balancing = [float(copy.record.balancing) for copy in copies]
    table = sum(routing_table([chunk], [1, 3], EXPERTS, "cpu") for chunk in chunks)
    statistics = routing_statistics(table, [1, 3])
    total = (loads[0] + loads[1]).tolist()
    assert statistics.load_of(3) == tuple(total) and statistics.load_of(1) == (0,) * EXPERTS
    assert statistics.layers[1].balancing == pytest.approx(sum(balancing) / 2, rel=1e-14)
    assert statistics.imbalance == pytest.approx(max(total) / (sum(total) / EXPERTS))
    scalars = routing_scalars(statistics)
    assert scalars["moe/load_imbalance/layer_3"] == statistics.imbalance and "moe/balancing_loss" in scalars
    before = [copy.router.expert_bias.clone() for copy in copies]
    update_expert_biases(chunks, statistics)
    mean = sum(total) / EXPERTS
    step = torch.tensor([0.01 * math.copysign(1, mean - load) if load != mean else 0.0 for load in total],
                        dtype=torch.float64)
    for copy, old in zip(copies, before):
        torch.testing.assert_close(copy.router.expert_bias - old, step, **TIGHT)
        assert copy.take_record().microbatches == 0  # the table took the records
