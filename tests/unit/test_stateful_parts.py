"""Each stateful part of a trainer is a ``Stateful``: its ``state_dict`` holds what moves, ``load_state_dict`` resumes it."""

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ppctl.checkpoint.state import DataPosition, TorchRng
from ppctl.resolve import compose_config
from ppctl.model.rules import REPLICATED, ParameterRule, attach_rules
from ppctl.optim.loss_scale import DynamicLossScaler
from ppctl.optim.optimizer import PlainOptimizer


def test_loss_scaler_resumes_its_scale_and_run_of_good_steps():
    scaler = DynamicLossScaler(scale=1024.0, growth_interval=3)
    scaler.update(False)
    scaler.update(True)
    resumed = DynamicLossScaler(growth_interval=3)
    resumed.load_state_dict(scaler.state_dict())
    assert isinstance(scaler, Stateful) and (resumed.scale, resumed.good_steps) == (512.0, 1)
    for part in (scaler, resumed):
        part.update(True)
        part.update(True)
    assert resumed.scale == scaler.scale == 1024.0


def test_data_position_and_generator_resume():
    position = DataPosition()
    position.load_state_dict(DataPosition(7).state_dict())
    assert isinstance(position, Stateful) and position.step == 7
    rng = TorchRng()
    saved = rng.state_dict()
    expected = torch.rand(3)
    torch.rand(5)
    rng.load_state_dict(saved)
    assert isinstance(rng, Stateful) and torch.equal(torch.rand(3), expected)


def _optimizer(seed: int) -> PlainOptimizer:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(3, 2)
    attach_rules(layer, lambda name: ParameterRule(REPLICATED, "normal"))  # what a model chunk attaches
    return PlainOptimizer({0: layer}, None, compose_config([]).optimizer)


def _step(optimizer: PlainOptimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad()
    optimizer.chunks[0](inputs).square().sum().backward()
    optimizer.step()


def test_optimizer_state_loaded_in_place_continues_exactly():
    """Save after two steps, load into a fresh optimizer the way a checkpoint does (copy into the views its
    ``state_dict`` gives, then ``load_state_dict``): the third step is the uninterrupted one's, bit for bit."""
    inputs = torch.randn(4, 3)
    saved = _optimizer(0)
    before = saved.state_dict()
    assert before["steps"] == 0 and [held.name for held in before["tensors"]] == ["weight", "bias"]
    _step(saved, inputs)
    _step(saved, inputs)
    resumed = _optimizer(1)
    destination = resumed.state_dict()
    for chunk_from, chunk_to in zip(saved.chunks.values(), resumed.chunks.values()):
        chunk_to.load_state_dict(chunk_from.state_dict())
    for held_from, held_to in zip(saved.state_dict()["tensors"], destination["tensors"]):
        for kind, tensor in held_from.tensors.items():
            held_to.tensors[kind].copy_(tensor)
    resumed.load_state_dict({**destination, "steps": saved.state_dict()["steps"]})
    assert isinstance(resumed, Stateful) and resumed.state_dict()["steps"] == 2
    _step(saved, inputs)
    _step(resumed, inputs)
    for expected, got in zip(saved.chunks[0].parameters(), resumed.chunks[0].parameters()):
        assert torch.equal(expected, got)
