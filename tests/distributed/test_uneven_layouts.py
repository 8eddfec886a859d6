"""Uneven stage layouts train exactly like one process (gloo workers): ``parallel.pipeline_layout`` strings with
uneven, embedding-only, loss-only and empty stages, and the even split that counts the embedding and the loss as
layers, under 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV (float64, compared by ``assert_equivalent``)."""

import pytest

from tests.distributed.equivalence import BASE, FP64, assert_equivalent

UNEVEN = {
    "1f1b pp4, an empty middle stage": ["parallel.pp=4", "parallel.dp=1", "schedule=1f1b",
                                        "parallel.pipeline_layout=Et|t||ttL"],
    "interleaved pp2 vpp2 dp2, embedding-only and loss-only stages": [
        "parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "schedule=interleaved_1f1b",
        "parallel.pipeline_layout=E|ttt|t|L"],
    "zb_h1 pp4, a group repeated": ["parallel.pp=4", "parallel.dp=1", "schedule=zb_h1",
                                    "parallel.pipeline_layout='E(t|)*3tL'", "model.num_layers=4"],
    "zbv pp2 dp2, an empty stage on the V's turn": ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2",
                                                    "schedule=zbv", "parallel.pipeline_layout=Ett||t|tL"],
    "dualpipev pp2 dp2, an empty stage beside a local hand-over": [
        "parallel.pp=2", "parallel.dp=2", "schedule=dualpipev", "parallel.pipeline_layout=E|ttt||tL"],
    "gpipe tp2 pp2, embedding and loss counted as layers": [
        "parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=gpipe", "model.num_layers=6",
        "parallel.account_for_embedding_in_split=true", "parallel.account_for_loss_in_split=true"],
}


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_uneven_layouts_match_single_process():
    assert_equivalent([BASE + layout + FP64 for layout in UNEVEN.values()], world_size=4)


def test_layer_maps_of_uneven_layouts():
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve

    def layers(*overrides):
        layer_map = resolve(compose_config(["data=synthetic", *overrides])).layer_map
        return [(stage.stage, stage.layers, stage.pre_process, stage.post_process)
                for _, stage in sorted(layer_map.items(), key=lambda item: item[1].stage)]

    assert layers(*UNEVEN["gpipe tp2 pp2, embedding and loss counted as layers"]) == [
        (0, (0, 1, 2), True, False), (1, (3, 4, 5), False, True)]
    assert layers(*UNEVEN["zbv pp2 dp2, an empty stage on the V's turn"]) == [
        (0, (0, 1), True, False), (1, (), False, False), (2, (2,), False, False), (3, (3,), False, True)]
