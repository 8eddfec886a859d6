"""The bundle of rank groups a chunk receives (``ppctl.parallel.groups.RankGroups``), built by ``rank_groups_of``.

No process group is made: a context whose groups are named placeholders shows which communicator each member
holds, the backward lanes included, for the layout's own group memberships.
"""

import dataclasses

import pytest

from ppctl.model.gpt.model import GPTChunk, GPTConfig
from ppctl.model.moe.shape import MoEShape
from ppctl.parallel.context_parallel import CPGroup
from ppctl.parallel.expert_parallel import EPGroup, TokenSplit
from ppctl.parallel.groups import BACKWARD_LANE_GROUPS, ParallelContext, RankGroups, backward_lane, rank_groups_of
from ppctl.parallel.lanes import BACKWARD_LANE, FORWARD_LANE, Lanes
from ppctl.parallel.layout import ParallelLayout, StageLayers
from ppctl.parallel.tensor_parallel import TPGroup


def placeholder_context(layout: ParallelLayout, rank: int) -> ParallelContext:
    """``rank``'s context with each group a string naming it (its backward lane's too, as with ep > 1)."""
    group_ranks = {name: layout.group_of(name, rank) for name in layout.group_names}
    groups = {name: f"{name} of {rank}" for name in layout.group_names}
    if layout.ep > 1:
        for name in BACKWARD_LANE_GROUPS:
            group_ranks[backward_lane(name)] = group_ranks[name]
            groups[backward_lane(name)] = f"{backward_lane(name)} of {rank}"
    return ParallelContext(layout, rank, layout.coords(rank), groups, group_ranks)


def test_single_holds_one_rank_of_each_group():
    groups = RankGroups.single()
    assert groups == RankGroups()
    assert [member.size for member in (groups.tp, groups.cp, groups.ep, groups.token_split)] == [1, 1, 1, 1]
    assert groups.tp.group is groups.cp.group is groups.ep.group is groups.token_split.group is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups.tp = None


def test_each_member_is_this_ranks_group_of_the_layout():
    layout = ParallelLayout(tp=2, cp=2, dp=2, pp=2, ep=2)
    rank = 5
    groups = rank_groups_of(placeholder_context(layout, rank), sequence_parallel=True, cp_comm="ring")
    tp, cp, ep, split = groups.tp, groups.cp, groups.ep, groups.token_split
    assert (tp.group, tp.size, tp.rank, tp.sequence_parallel) == ("tp of 5", 2, layout.group_of("tp", 5).index(5), True)
    assert (cp.group, cp.ranks, cp.comm) == ("cp of 5", tuple(layout.group_of("cp", 5)), "ring")
    assert (ep.group, ep.size, ep.rank) == ("ep of 5", 2, layout.group_of("ep", 5).index(5))
    assert (split.group, split.size) == ("tp_cp of 5", 4)
    # Without the overlap only the experts' exchanges have a second communicator (their backward's), and no pacer.
    lanes = tp.lanes
    assert all(member.lanes is lanes for member in (cp, ep, split)) and lanes.pacer is None
    assert [lanes.communicator(member.group, BACKWARD_LANE) for member in (tp, cp, split, ep)] == [
        "tp of 5", "cp of 5", "tp_cp of 5", "ep_backward of 5"]


def test_the_overlap_wires_every_groups_backward_lane_in_one_place():
    pacer, on_exchange = object(), print
    groups = rank_groups_of(placeholder_context(ParallelLayout(tp=2, cp=2, pp=2, ep=2), 0), sequence_parallel=True,
                            on_exchange=on_exchange, pacer=pacer)
    members = {"tp": groups.tp, "cp": groups.cp, "tp_cp": groups.token_split, "ep": groups.ep}
    lanes = groups.tp.lanes
    assert all(member.lanes is lanes for member in members.values()) and lanes.pacer is pacer
    assert {name: lanes.communicator(member.group, BACKWARD_LANE) for name, member in members.items()} == {
        name: f"{backward_lane(name)} of 0" for name in members}
    assert {name: lanes.communicator(member.group, FORWARD_LANE) for name, member in members.items()} == {
        name: f"{name} of 0" for name in members}
    assert groups.ep.on_exchange is on_exchange


@pytest.mark.parametrize("group_class", [TPGroup, CPGroup, EPGroup, TokenSplit])
def test_the_group_classes_carry_no_field_of_the_overlap_but_the_workers_lanes(group_class):
    names = [member.name for member in dataclasses.fields(group_class)]
    assert not set(names) & {"interleave", "backward_group", "pacer"}
    assert names[-1] == "lanes" and group_class.__dataclass_fields__["lanes"].type in ("Lanes", Lanes)


def test_one_rank_dimensions_stay_single():
    groups = rank_groups_of(placeholder_context(ParallelLayout(dp=2, pp=2), 3))
    assert groups == RankGroups.single()


def test_a_chunk_hands_its_layers_the_bundles_groups():
    moe = MoEShape(num_experts=4, topk=2, expert_ffn_hidden_size=8)
    config = GPTConfig(num_layers=2, hidden_size=8, num_heads=2, ffn_hidden_size=16, vocab_size=16,
                       max_seq_length=8, moe=moe)
    groups = rank_groups_of(placeholder_context(ParallelLayout(tp=2, pp=2, ep=2), 1), sequence_parallel=True)
    chunk = GPTChunk(config, StageLayers(0, (0, 1), True, False), groups, seed=1)
    assert chunk.groups is groups and (chunk.tp, chunk.cp, chunk.ep) == (groups.tp, groups.cp, groups.ep)
    assert (chunk.layer_ids, chunk.pre_process, chunk.post_process) == ([0, 1], True, False)
    mlp = chunk.layers["1"].mlp
    assert mlp.ep is groups.ep and mlp.token_split is groups.token_split
    assert mlp.experts.fc_in.weight.shape[0] == 2  # this EP rank's half of the experts
