"""The memory model (``ppctl.plan.memory``) against the modules as built, in one process.

Parameters: the count of every chunk ``GPTChunk`` builds, TP shards included (a TPGroup of
several ranks builds its shard without communicating), of chunks built from configs with and without QKV
biases, and of MoE chunks of both families. Activations: the bytes autograd keeps for one microbatch (distinct
storages seen by a saved-tensor hook), exactly, for every precision, both position embeddings, the embedding and
loss ends and each recomputation; within 10% with experts.
"""

import dataclasses
import random

import pytest
import torch

from ppctl.model.gpt.model import GPTChunk, GPTConfig
from ppctl.model.llama.model import LlamaChunk, LlamaConfig
from ppctl.model.moe.shape import MoEShape
from ppctl.model.recompute import Recompute
from ppctl.parallel.groups import RankGroups
from ppctl.parallel.layout import StageLayers
from ppctl.parallel.tensor_parallel import TPGroup
from ppctl.plan.memory import (Chunk, ModelShape, Parallelism, Tokens, chunk_activation_bytes, chunk_parameters,
                               held_bytes_change, in_flight_peak, in_flight_states, peak_in_flight_bytes,
                               schedule_states, state_parts)
from tests.harness.saved_tensors import chunk_forward_saved_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
B, S, H, F, N, V = 2, 16, 32, 64, 4, 128


def built(layers, pre, post, tp=1, rope=False, tied=False, dtype=torch.float32, recompute=Recompute()):
    config = GPTConfig(num_layers=max(layers, 1), hidden_size=H, num_heads=N, ffn_hidden_size=F, vocab_size=V,
                       max_seq_length=S, position_embedding="rope" if rope else "learned", tie_embeddings=tied)
    stage = StageLayers(0, tuple(range(layers)), pre, post)
    return GPTChunk(config, stage, RankGroups(tp=TPGroup(None, tp, 0)), seed=1, dtype=dtype, recompute=recompute)


def shape(rope=False, tied=False) -> ModelShape:
    return ModelShape(H, N, F, V, S, learned_positions=not rope, rotary=rope, tie_embeddings=tied)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pre,post,tied", [(False, False, False), (True, False, False), (False, True, False),
                                           (True, True, False), (True, True, True), (False, True, True)])
@pytest.mark.parametrize("rope", [False, True])
def test_parameter_count_is_the_built_chunks(tp, pre, post, tied, rope):
    chunk = built(3, pre, post, tp, rope, tied)
    expected = sum(param.numel() for param in chunk.parameters())
    assert chunk_parameters(shape(rope, tied), Chunk(0, 3, pre, post), tp) == expected


@pytest.mark.parametrize("family", [[], ["model=llama_tiny"]])
def test_parameter_count_of_a_config_with_qkv_biases_is_the_built_chunks(family):
    """``model.qkv_bias`` reaches the count from a config (``ResolvedModel.memory_shape``): the gpt family's fused
    bias, split with the QKV rows, and Llama's q/k/v biases."""
    from ppctl.resolve import compose_config
    from ppctl.model.from_config import build_chunk
    from ppctl.model.family import resolve_model

    tp = 2
    for qkv_bias in (False, True):
        config = compose_config([*family, "data=synthetic", f"parallel.tp={tp}", f"model.qkv_bias={qkv_bias}"])
        chunk = build_chunk(config, StageLayers.whole(2), RankGroups(tp=TPGroup(None, tp, 0)))
        expected = sum(param.numel() for param in chunk.parameters())
        assert chunk_parameters(resolve_model(config).memory_shape, Chunk(0, 2, True, True), tp) == expected, qkv_bias


CASES = {"middle": dict(), "first": dict(pre=True), "last": dict(post=True), "whole": dict(pre=True, post=True),
         "bf16 last": dict(precision="bf16", post=True), "fp64": dict(precision="fp64"), "fp64 whole": dict(precision="fp64", pre=True, post=True), "rope": dict(rope=True),
         "rope first": dict(rope=True, pre=True), "full uniform 1": dict(recompute=Recompute("full", "uniform", 1)),
         "full uniform 2 first": dict(recompute=Recompute("full", "uniform", 2), pre=True),
         "full block 1": dict(recompute=Recompute("full", "block", 1)),
         "selective last": dict(recompute=Recompute("selective"), post=True)}


@pytest.mark.parametrize("case", CASES)
def test_kept_activations_are_what_autograd_saves(case):
    settings = {"pre": False, "post": False, "precision": "fp32", "rope": False, "recompute": Recompute(),
                **CASES[case]}
    dtype, recompute = DTYPES[settings["precision"]], settings["recompute"]
    chunk = built(2, settings["pre"], settings["post"], rope=settings["rope"], dtype=dtype, recompute=recompute)
    parallel = Parallelism(precision=settings["precision"], recompute=recompute.mode,
                           recompute_method=recompute.method, recompute_num_layers=recompute.num_layers)
    kept, _ = chunk_activation_bytes(shape(settings["rope"]), Chunk(0, 2, settings["pre"], settings["post"]),
                                     Tokens(B, S), parallel)
    assert kept == chunk_forward_saved_bytes(chunk, B, S, V)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2),
                                      ("dualpipev", 2), ("dualpipe", 2)])
def test_in_flight_states_weigh_as_the_walk_of_the_actions(name, vpp):
    from ppctl.pipeline.schedules import build_schedule

    schedule = build_schedule(name, 4, vpp, 16)
    for rank_actions, states in zip(schedule.actions, [states.in_flight for states in schedule_states(schedule)]):
        actions = [(action.kind, action.stage) for action in rank_actions]
        stages = sorted({stage for _, stage in actions})
        for kept, stash in (({s: 10 for s in stages}, {s: 4 for s in stages}),  # a B frees more than it stashes
                            ({s: 3 + s for s in stages}, {s: 50 * (s + 1) for s in stages})):  # recomputation
            held = peak = 0
            for kind, stage in actions:
                held += held_bytes_change(kind, stage, kept, stash)
                peak = max(peak, held)
            assert in_flight_peak(states, kept, stash) == peak


def test_in_flight_states_keep_only_the_undominated():
    actions = [("F", 0)] * 5 + [("BW", 0)] * 5
    assert in_flight_states(actions) == {((0, 5, 0),)}
    assert in_flight_peak(in_flight_states([]), {}, {}) == 0


def walked_in_flight_states(actions):
    """``in_flight_states`` as it walked the actions one by one (before its walk ran in C loops): the reference."""
    actions = list(actions)
    stages = sorted({stage for _, stage in actions})
    slot = {stage: 2 * index for index, stage in enumerate(stages)}
    counts, seen = [0] * (2 * len(stages)), set()
    for index, (kind, stage) in enumerate(actions):
        kept_at = slot[stage]
        if kind == "F":
            counts[kept_at] += 1
        elif kind == "B":
            counts[kept_at] -= 1
            counts[kept_at + 1] += 1
        elif kind in ("BW", "W"):
            counts[kept_at + (kind == "W")] -= 1
            if index:
                continue
        seen.add(tuple(counts))
    undominated = {state for state in seen
                   if not any(other != state and all(o >= s for o, s in zip(other, state)) for other in seen)}
    return frozenset(tuple((stage, state[slot[stage]], state[slot[stage] + 1]) for stage in stages)
                     for state in undominated)


@pytest.mark.parametrize("seed", range(40))
def test_in_flight_states_are_those_of_the_walk(seed):
    """Any actions (unordered, incomplete, kinds that are none of the four), one to three stages."""
    rng = random.Random(seed)
    stages = rng.sample(range(9), rng.randint(1, 3))
    actions = [(rng.choice(["F", "F", "B", "W", "BW", "X"]), rng.choice(stages)) for _ in range(rng.randint(0, 60))]
    assert in_flight_states(actions) == walked_in_flight_states(actions)
    assert in_flight_states(iter(actions)) == walked_in_flight_states(actions)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2),
                                      ("dualpipev", 2), ("dualpipe", 2)])
def test_a_schedules_in_flight_states_are_those_of_the_walk(name, vpp):
    from ppctl.pipeline.schedules import build_schedule

    schedule = build_schedule(name, 8, vpp, 24)
    walked = [walked_in_flight_states((a.kind, a.stage) for a in rank_actions) for rank_actions in schedule.actions]
    assert [states.in_flight for states in schedule_states(schedule)] == walked


def test_in_flight_walk_and_state_parts():
    kept, stash = {0: 10, 1: 100}, {0: 4, 1: 40}
    assert peak_in_flight_bytes([("F", 0), ("F", 1), ("BW", 1), ("BW", 0)], kept, stash) == 110
    # a B swaps a microbatch's activations for the stash W needs; W frees it
    assert peak_in_flight_bytes([("F", 1), ("B", 1), ("F", 1), ("F", 1), ("W", 1)], kept, stash) == 240
    assert state_parts(1000, Parallelism()) == (4000, 4000, 8000)
    assert state_parts(1000, Parallelism(precision="bf16", bucketed_optimizer=True, optimizer_shards=4)) == (
        2000, 4000, 3 * 250 * 4)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2),
                                      ("dualpipev", 2), ("dualpipe", 2)])
def test_in_flight_states_are_the_undominated_of_every_state(name, vpp):
    """The states after BW and W are left out of the walk (each lowers a count of the state before it): the kept
    ones are still exactly the undominated states after every action."""
    from ppctl.pipeline.schedules import build_schedule

    for rank_actions in build_schedule(name, 4, vpp, 10).actions:
        stages = sorted({action.stage for action in rank_actions})
        counts, states = {(stage, part): 0 for stage in stages for part in (0, 1)}, set()
        for action in rank_actions:
            change = {"F": ((0, 1),), "BW": ((0, -1),), "B": ((0, -1), (1, 1)), "W": ((1, -1),)}[action.kind]
            for part, step in change:
                counts[action.stage, part] += step
            states.add(tuple((stage, counts[stage, 0], counts[stage, 1]) for stage in stages))
        undominated = {state for state in states if not any(
            other != state and all(o[1] >= s[1] and o[2] >= s[2] for o, s in zip(other, state)) for other in states)}
        assert in_flight_states([(action.kind, action.stage) for action in rank_actions]) == undominated
    assert in_flight_states([("W", 0)]) == {((0, 0, -1),)}  # a first action's state is kept whatever it is


MOE = {"dropless": MoEShape(4, 2, 48), "shared sigmoid": MoEShape(8, 2, 32, shared_experts=1, router_score="sigmoid"),
       "capacity": MoEShape(4, 1, 48, capacity_factor=1.0)}


def built_moe(family: str, moe: MoEShape, layers: int, pre: bool, post: bool):
    """A chunk of GPT (GELU experts with biases) or Llama (SwiGLU experts) layers, the first dense, and its shape."""
    moe = dataclasses.replace(moe, first_dense_layers=1)
    stage = StageLayers(0, tuple(range(layers)), pre, post)
    if family == "gpt":
        config = GPTConfig(num_layers=layers, hidden_size=H, num_heads=N, ffn_hidden_size=F, vocab_size=V,
                           max_seq_length=S, moe=moe)
        return GPTChunk(config, stage, seed=1), ModelShape(H, N, F, V, S, moe=moe)
    config = LlamaConfig(num_layers=layers, hidden_size=H, num_heads=N, num_kv_heads=2, head_dim=8, ffn_hidden_size=F,
                         vocab_size=V, max_seq_length=S, padded_vocab_size=V, moe=moe)
    shape = ModelShape(H, N, F, V, S, learned_positions=False, rotary=True, kv_heads=2, head_dim=8, norm_has_bias=False,
                       gated_mlp=True, linear_biases=False, fused_qkv=False, moe=moe)
    return LlamaChunk(config, stage, seed=1), shape


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("case", MOE)
def test_moe_parameters_are_exact_and_activations_near_what_autograd_saves(family, case):
    """Every expert's, the router's and the shared experts' parameters, exactly; the kept activations (an estimate
    for the routed layers, module docstring) within 10% of the saved storages, 1 dense and 2 MoE layers."""
    chunk, shape = built_moe(family, MOE[case], 3, True, True)
    planned = Chunk(0, 3, True, True, moe_layers=2)
    assert chunk_parameters(shape, planned, 1) == sum(param.numel() for param in chunk.parameters())
    kept, _ = chunk_activation_bytes(shape, planned, Tokens(B, S), Parallelism())
    assert kept == pytest.approx(chunk_forward_saved_bytes(chunk, B, S, V), rel=0.10)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("family", [["model=mixtral_tiny"], ["model=deepseek_tiny"]])
def test_expert_parallel_parameter_count_is_each_ep_ranks_built_chunk(family, ep):
    """Each EP rank builds ``num_experts / ep`` experts of every MoE layer (the router and shared experts whole):
    the count per rank exactly, and the optimizer's expert share sharded over its own replicas. Broken twin: the
    experts counted whole regardless of ep."""
    from ppctl.resolve import compose_config
    from ppctl.model.from_config import build_chunk
    from ppctl.parallel.expert_parallel import EPGroup
    from ppctl.model.family import resolve_model

    config = compose_config([*family, "data=synthetic", f"parallel.dp={ep}", f"parallel.ep={ep}"])
    shape, layers = resolve_model(config).memory_shape, config.model.num_layers
    moe_layers = sum(map(shape.moe.is_moe_layer, range(layers)))
    planned = Chunk(0, layers, True, True, moe_layers)
    for ep_rank in range(ep):
        chunk = build_chunk(config, StageLayers.whole(layers), RankGroups(ep=EPGroup(None, ep, ep_rank)))
        assert chunk_parameters(shape, planned, 1, ep) == sum(param.numel() for param in chunk.parameters())
    whole = sum(param.numel() for param in build_chunk(config, StageLayers.whole(layers)).parameters())
    assert chunk_parameters(shape, planned, 1) == whole != chunk_parameters(shape, planned, 1, ep)  # the twin
    sharded = Parallelism(precision="bf16", bucketed_optimizer=True, optimizer_shards=4, ep=2, expert_optimizer_shards=2)
    assert state_parts(1000, sharded, 600) == (2000, 4000, 3 * (100 + 300) * 4)
