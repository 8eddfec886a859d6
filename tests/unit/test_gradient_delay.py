"""``optimizer.gradient_delay=1``: PipeDream-2BW's W(t+1) = W(t) - lr * g_t(W(t-1)), in the single-process reference.

Checked against the rule worked by hand: a copy of the model holding the previous version
computes each step's gradients, which the optimizer then applies to the current version.
"""

import copy

import pytest
import torch

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from ppctl.data.dataset import build_microbatch, global_batch_sample_ids
from ppctl.model.from_config import dataset_of
from ppctl.optim.delay import DelayedWeights
from ppctl.optim.grads import build_optimizer
from ppctl.optim.lr import learning_rate, lr_schedule_of, set_learning_rate
from ppctl.run.reference import reference_model, run_reference

BASE = ["data=synthetic", "model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
        "model.ffn_hidden_size=64", "trainer.global_batch_size=4", "trainer.micro_batch_size=1",
        "trainer.seq_length=16", "parallel=single", "trainer.precision=fp64", "optimizer.clip_grad=0.5"]
STEPS = 3


def by_hand(config):
    """Losses and final parameters of the delayed update, each step's gradients taken on a copy holding W(t-1)."""
    model = reference_model(config)
    optimizer = build_optimizer([model], config.optimizer)
    schedule, dataset, trainer = lr_schedule_of(config), dataset_of(config), config.trainer
    previous, losses = copy.deepcopy(model), []  # W(-1) = W(0)
    for step in range(STEPS):
        batch = build_microbatch(dataset, global_batch_sample_ids(trainer.seed, step, trainer.global_batch_size,
                                                                  len(dataset)))
        token_losses = previous(batch.tokens, position_ids=batch.position_ids, labels=batch.labels)
        mask = batch.loss_mask.to(token_losses.dtype)
        loss = (token_losses * mask).sum() / mask.sum()
        loss.backward()
        losses.append(float(loss.detach()))
        gradients = {name: param.grad for name, param in previous.named_parameters()}
        previous = copy.deepcopy(model)  # W(t) is the next step's previous version
        for name, param in model.named_parameters():
            param.grad = gradients[name].clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_grad, foreach=False)
        set_learning_rate(optimizer, learning_rate(step, schedule))
        optimizer.step()
    return losses, {name: param.detach() for name, param in model.named_parameters()}


def test_the_reference_updates_the_current_weights_with_gradients_of_the_previous_ones():
    config = compose_config(BASE + ["optimizer.gradient_delay=1"])
    validate(config)
    run = run_reference(config, STEPS)
    losses, parameters = by_hand(config)
    assert run.losses == pytest.approx(losses, rel=1e-12, abs=0)
    for name, value in parameters.items():
        torch.testing.assert_close(run.parameters[name], value, rtol=1e-12, atol=0)
    plain = run_reference(compose_config(BASE), STEPS)
    assert plain.losses[0] == run.losses[0] and plain.losses[1] != run.losses[1]  # step 0 alike, then one late


def test_the_previous_version_swaps_in_and_out():
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    delayed = DelayedWeights({"w": weight})
    with torch.no_grad():
        weight.add_(10.0)  # W(1)
    with delayed.on_previous():
        assert weight.tolist() == [1.0, 2.0]  # W(0)
    assert weight.tolist() == [11.0, 12.0] and delayed.state_dict()["previous"]["w"].tolist() == [11.0, 12.0]


def test_only_zero_or_one_step_of_delay():
    with pytest.raises(ConfigError, match="optimizer.gradient_delay=2 must be 0 .* or 1"):
        validate(compose_config(BASE + ["optimizer.gradient_delay=2"]))
