"""The pipeline stage without processes: whole and split backward agree, evaluation keeps nothing."""

import pytest
import torch

from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec, release_output

SPEC = TensorSpec((2, 3, 4), torch.float64)


def linear_forward(module, stage_input, microbatch):
    """A toy data contract: the input (or the microbatch itself on a first stage) through the module."""
    return module(microbatch if stage_input is None else stage_input)


def make_stage(first: bool, last: bool) -> PipelineStage:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 4, dtype=torch.float64))
    io = StageIO(input=None if first else SPEC, output=None if last else SPEC, fields=())
    return PipelineStage(0, module, io, linear_forward, is_last=last)


def sum_loss(output, microbatch):
    loss = output.pow(2).sum()
    return loss, loss


def run(stage: PipelineStage, split: bool, release: bool):
    """Two microbatches forward, then backward (whole, or B then W later); returns the input and weight grads."""
    inputs = [torch.randn(SPEC.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
              for i in range(2)]
    grad_output = torch.ones(SPEC.shape, dtype=torch.float64)
    outputs = [stage.forward(mb, None, inputs[mb], sum_loss)[0] for mb in range(2)]
    if release and not stage.is_last:
        for output in outputs:
            release_output(output)
    grad_inputs = []
    for mb in range(2):
        grad = None if stage.is_last else grad_output
        grad_inputs.append(stage.backward_input(mb, grad) if split else stage.backward(mb, grad))
    if split:
        assert stage.holds_work()  # the Ws are still due
        for mb in range(2):
            stage.backward_weight(mb)
    assert not stage.holds_work()
    return grad_inputs, [param.grad.clone() for param in stage.module.parameters()]


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_split_backward_equals_whole_backward(last, release):
    whole_inputs, whole_weights = run(make_stage(False, last), split=False, release=release)
    split_inputs, split_weights = run(make_stage(False, last), split=True, release=release)
    for whole, split in zip(whole_inputs + whole_weights, split_inputs + split_weights):
        assert torch.equal(whole, split)
    assert all(grad.abs().sum() > 0 for grad in whole_weights)


def test_b_on_the_first_stage_sends_nothing_and_w_does_the_weights():
    stage = make_stage(first=True, last=False)
    microbatch = torch.randn(SPEC.shape, dtype=torch.float64)
    stage.forward(0, microbatch, None, None)
    assert stage.backward_input(0, torch.ones(SPEC.shape, dtype=torch.float64)) is None
    assert all(param.grad is None for param in stage.module.parameters())
    stage.backward_weight(0)
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in stage.module.parameters())


def test_forward_only_keeps_nothing_and_builds_no_graph():
    stage = make_stage(first=False, last=True)
    output, logged = stage.forward_only(None, torch.randn(SPEC.shape, dtype=torch.float64), sum_loss)
    assert not stage.holds_work() and stage.held_tensors() == []
    assert output.grad_fn is None and torch.equal(output, logged)


def test_receive_specs_follow_the_io_spec():
    middle, first = make_stage(False, False), make_stage(True, False)
    assert middle.receive_spec("act") == SPEC and middle.receive_spec("grad") == SPEC
    assert SPEC.nbytes == 2 * 3 * 4 * 8
    with pytest.raises(ValueError, match="receives no act message"):
        first.receive_spec("act")
