"""Deliberate defects for the harness's broken twins: each one a bug a parallel run could really have.

``broken(name)`` patches ppctl inside a worker for the duration of one run (and restores it):
the equivalence harness must then report the run as different from one process. Each defect
is a real past or plausible bug of the kind the equivalence tests exist to catch.
"""

from __future__ import annotations

import contextlib
from unittest import mock


def _drop_first_microbatch_gradient():
    """The first microbatch of each step on each loss rank reports its loss but sends no gradient back."""
    from ppctl.model.stages import MaskedTokenLoss

    original = MaskedTokenLoss.__call__
    seen: set[int] = set()  # one loss function per step: the first call of each drops its gradient

    def dropping(self, token_losses, microbatch):
        loss, masked_sum = original(self, token_losses, microbatch)
        if id(self) not in seen:
            seen.add(id(self))
            loss = loss.detach() + 0.0 * loss  # the same value; a zero gradient flows back
        return loss, masked_sum

    return mock.patch.object(MaskedTokenLoss, "__call__", dropping)


def _loss_scaled_twice():
    """The back-propagated loss divided by the global token count twice (the reported loss unchanged)."""
    from ppctl.model.stages import MaskedTokenLoss

    original = MaskedTokenLoss.__call__

    def scaled_twice(self, token_losses, microbatch):
        loss, masked_sum = original(self, token_losses, microbatch)
        return loss / self.normalizer, masked_sum

    return mock.patch.object(MaskedTokenLoss, "__call__", scaled_twice)


def _tp_gradient_not_reduced():
    """The gradient of a column-parallel layer's replicated input is not all-reduced over TP."""
    from ppctl.parallel import tensor_parallel

    return mock.patch.object(tensor_parallel._CopyToTPRegion, "backward",
                             staticmethod(lambda ctx, grad_output: (grad_output, None)))


def _dp_gradient_not_reduced():
    """Data-parallel (and CP) replicas step on their own gradients: the replica all-reduce is skipped."""
    from ppctl.optim import grads, optimizer

    def finalize_without_replicas(chunks, context):
        grads.reduce_sequence_parallel_gradients(chunks, context)
        grads.reduce_tied_embeddings(chunks, context)

    return mock.patch.object(optimizer, "finalize_gradients", finalize_without_replicas)


def _vocab_padding_in_softmax():
    """The TP padding rows of the vocabulary enter the softmax (as they once did)."""
    from ppctl.model import chunk
    from ppctl.parallel.tensor_parallel import vocab_parallel_cross_entropy

    def padded_softmax(logits_shard, targets, tp, vocab_size=None):
        return vocab_parallel_cross_entropy(logits_shard, targets, tp, None)

    return mock.patch.object(chunk, "vocab_parallel_cross_entropy", padded_softmax)


def _parameter_not_stepped():
    """One parameter of each rank keeps its value through the optimizer's step (a shard left behind)."""
    import torch

    from ppctl.optim.optimizer import PlainOptimizer

    original = PlainOptimizer.step

    def step_all_but_one(self):
        first = self.optimizer.param_groups[0]["params"][0]
        kept = first.detach().clone()
        original(self)
        with torch.no_grad():
            first.copy_(kept)

    return mock.patch.object(PlainOptimizer, "step", step_all_but_one)


def _stream_on_the_newest_weights():
    """PipeDream-2BW's stream runs each step on the weights after the last update, not the version before it (an
    off-by-one between a microbatch's step and its weight version)."""
    from ppctl.optim.delay import WeightVersions

    original = WeightVersions.bind
    return mock.patch.object(WeightVersions, "bind", lambda self, step: original(self, step + 1))


def _router_losses_dropped_off_the_loss_stage():
    """The router losses of MoE layers on a stage without the loss head give no gradient (their scale is never set
    there): only the last stage's layers are balanced."""
    from ppctl.run import train

    original = train.set_router_loss_scale

    def only_on_the_loss_stage(chunk, scale):
        original(chunk, scale if chunk.post_process else 0.0)

    return mock.patch.object(train, "set_router_loss_scale", only_on_the_loss_stage)


def _expert_bias_from_local_load():
    """Each rank moves its expert biases by the load of its own microbatches, not the global batch's (the routing
    statistics are not summed over the ranks): data-parallel replicas drift apart."""
    from ppctl.run.train import Trainer, routing_statistics, routing_table

    def local_statistics(self):
        layer_ids = self.moe.layer_ids(self.config.model.num_layers)
        table = routing_table(self.chunks.values(), layer_ids, self.moe.num_experts, self.context.device)
        return routing_statistics(table, layer_ids)

    return mock.patch.object(Trainer, "_routing_statistics", local_statistics)


def _router_losses_dropped_on_middle_stages():
    """The router losses of MoE layers on a stage with neither the embedding nor the loss head give no gradient."""
    from ppctl.run import train

    original = train.set_router_loss_scale

    def not_in_the_middle(chunk, scale):
        original(chunk, scale if chunk.pre_process or chunk.post_process else 0.0)

    return mock.patch.object(train, "set_router_loss_scale", not_in_the_middle)


def _expert_gradient_not_reduced_over_edp():
    """Expert-parallel experts step on their own rank's gradient: the expert-data-parallel all-reduce is skipped."""
    from ppctl.optim import grads, optimizer

    def finalize_without_expert_replicas(chunks, context):
        grads.reduce_sequence_parallel_gradients(chunks, context)
        dense = [param.grad for chunk in chunks.values() for param in chunk.parameters()
                 if param.grad is not None and grads.reduction_group_name(param, context) == "replica"]
        if context.size("replica") > 1:
            grads.all_reduce_coalesced(dense, context.groups["replica"])
        grads.reduce_tied_embeddings(chunks, context)

    return mock.patch.object(optimizer, "finalize_gradients", finalize_without_expert_replicas)


def _token_sent_to_the_wrong_rank():
    """The last row for EP rank 0's last expert is sent to EP rank 1 (its first expert runs it), and comes back."""
    from ppctl.parallel.expert_parallel import ExpertExchange

    original = ExpertExchange.plan

    def off_by_one(counts, group, device):
        counts, boundary = list(counts), len(counts) // group.size
        if counts[boundary - 1]:
            counts[boundary - 1] -= 1
            counts[boundary] += 1
        return original(counts, group, device)

    return mock.patch.object(ExpertExchange, "plan", staticmethod(off_by_one))


def _balancing_load_of_own_tokens():
    """The balancing loss of a microbatch split over TP and CP ranks weighs each rank's probabilities by its own
    tokens' load, not the microbatch's (the load is not summed over the split)."""
    from ppctl.parallel.expert_parallel import TokenSplit

    return mock.patch.object(TokenSplit, "total", lambda self, tensor: tensor)


def _experts_summed_over_tp():
    """Experts are taken for TP-replicated parameters (as their rule says): under sequence parallelism their
    gradients are summed over TP, although with ep>1 the TP ranks may hold other experts."""
    from ppctl.model.rules import rule_of
    from ppctl.optim import grads

    return mock.patch.object(grads, "tp_replicated", lambda param, context: rule_of(param).tp_replicated)


def _qk_norm_gradient_not_summed_over_tp():
    """A per-head q/k norm's scale taken for a norm like the others: summed over TP under sequence parallelism only,
    although each TP rank's gradient of it is its own heads' share at every layout."""
    from ppctl.model.rules import ParameterRule

    return mock.patch.object(ParameterRule, "summed_over_tp",
                             lambda self, sequence_parallel: self.tp_replicated and sequence_parallel)


def _loss_mean_per_microbatch():
    """Each microbatch's loss is its own mean token loss, weighted 1 / (the global batch's microbatches), as gradient
    accumulation over per-microbatch means does: a microbatch of few trained tokens weighs as much as one of many
    (the reported loss alike)."""
    from ppctl.model.stages import MaskedTokenLoss
    from ppctl.run.train import Trainer

    original_batch = Trainer.batch
    per_batch = {}  # the running trainer's global batch: how many microbatches it is cut into

    def counting_batch(self, step, data):
        per_batch["microbatches"] = self.config.trainer.global_batch_size // self.config.trainer.micro_batch_size
        return original_batch(self, step, data)

    def per_microbatch_mean(self, token_losses, microbatch):
        mask = microbatch.loss_mask.to(token_losses.dtype)
        masked_sum = (token_losses * mask).sum()
        weight = self.normalizer / (mask.sum() * per_batch["microbatches"])
        return masked_sum * weight * self.scale / self.normalizer, masked_sum * weight

    @contextlib.contextmanager
    def patched():
        with mock.patch.object(Trainer, "batch", counting_batch), \
                mock.patch.object(MaskedTokenLoss, "__call__", per_microbatch_mean):
            yield

    return patched()


def _validation_mean_of_batch_means():
    """The validation loss is the mean of its batches' mean token losses, not the mean over all their trained
    tokens: a validation batch of few trained tokens weighs as much as one of many."""
    from ppctl.run.train import Trainer

    original = Trainer.validation_loss

    def mean_of_means(self):
        original(self)  # builds the validation data
        losses = [self.evaluate(batch, self._validation_data) for batch in range(self.config.trainer.eval_iters)]
        return sum(losses) / len(losses) if self.holds_loss else None

    return mock.patch.object(Trainer, "validation_loss", mean_of_means)


DEFECTS = {
    "drop_microbatch_gradient": _drop_first_microbatch_gradient,
    "loss_scaled_twice": _loss_scaled_twice,
    "tp_gradient_not_reduced": _tp_gradient_not_reduced,
    "dp_gradient_not_reduced": _dp_gradient_not_reduced,
    "vocab_padding_in_softmax": _vocab_padding_in_softmax,
    "parameter_not_stepped": _parameter_not_stepped,
    "stream_on_the_newest_weights": _stream_on_the_newest_weights,
    "router_losses_dropped_off_the_loss_stage": _router_losses_dropped_off_the_loss_stage,
    "expert_bias_from_local_load": _expert_bias_from_local_load,
    "router_losses_dropped_on_middle_stages": _router_losses_dropped_on_middle_stages,
    "expert_gradient_not_reduced_over_edp": _expert_gradient_not_reduced_over_edp,
    "token_sent_to_the_wrong_rank": _token_sent_to_the_wrong_rank,
    "balancing_load_of_own_tokens": _balancing_load_of_own_tokens,
    "experts_summed_over_tp": _experts_summed_over_tp,
    "qk_norm_gradient_not_summed_over_tp": _qk_norm_gradient_not_summed_over_tp,
    "loss_mean_per_microbatch": _loss_mean_per_microbatch,
    "validation_mean_of_batch_means": _validation_mean_of_batch_means,
}


def broken(name: str | None):
    """A context manager that installs defect ``name`` (a key of ``DEFECTS``; None: nothing)."""
    return DEFECTS[name]() if name is not None else contextlib.nullcontext()
