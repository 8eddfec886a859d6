"""The equivalence harness can fail: every defect of ``tests.distributed.breakers`` is reported.

The tolerances of ``tests/harness/tolerances.py`` admit the roundoff of another summation order and
nothing more. One launch of 4 workers trains each broken twin, a real bug a parallel run could
have (a microbatch's gradient dropped, the loss scaled twice, a TP or DP gradient not reduced,
the vocabulary padding in the softmax, a parameter left out of the step, PipeDream-2BW's steps run on the
wrong weight version, a mixture's router losses dropped on the stage without the loss head or on the middle
stages, its expert bias moved by each rank's own load, its expert gradients not reduced over expert data
parallelism or summed over TP, a token sent to the wrong expert-parallel rank, a balancing loss from each rank's
share of a microbatch's load, a per-head q/k norm's gradient not summed over TP, a loss averaged per microbatch
on microbatches of very different trained-token counts, a validation loss averaged per batch), in float32 (the looser
precision) and the subtlest in float64 too. Each comparison of the harness (losses, forward-only
loss, grad norms, step-0 gradients, final parameters) runs on its own: every twin must fail the
comparisons its defect reaches, so each of them is shown able to fail.
"""

import pytest

from tests.distributed.equivalence import (BASE, DEEPSEEK, FP64, MASKED, MIXTRAL, QWEN3, SKEWED, equivalence_checks,
                                           prepare_skewed_masks, train_in_workers)

pytestmark = [pytest.mark.dist]

TP2_PP2 = ["parallel.tp=2", "parallel.pp=2", "schedule=1f1b"]
PP2_DP2 = ["parallel.pp=2", "parallel.dp=2", "schedule=1f1b"]
BEFORE_OPTIMIZER = {"grad norm", "step-0 gradient"}
TP2_CP2_EP2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2", "parallel.pp=1", "parallel.ep=2"]
STREAM = ["schedule=pipedream_2bw", "optimizer.gradient_delay=1", "optimizer.clip_grad=0"]
# (defect, overrides, the comparisons that must fail: at least these)
TWINS = [
    ("drop_microbatch_gradient", BASE + TP2_PP2, {"loss", *BEFORE_OPTIMIZER}),
    ("loss_scaled_twice", BASE + TP2_PP2, BEFORE_OPTIMIZER),
    ("tp_gradient_not_reduced", BASE + TP2_PP2, {"loss", *BEFORE_OPTIMIZER}),
    ("tp_gradient_not_reduced", BASE + TP2_PP2 + FP64, {"loss", *BEFORE_OPTIMIZER}),
    ("dp_gradient_not_reduced", BASE + PP2_DP2, {"loss", *BEFORE_OPTIMIZER}),
    ("vocab_padding_in_softmax", BASE + TP2_PP2 + MASKED, {"loss", "forward-only loss", *BEFORE_OPTIMIZER}),
    # The step-0 quantities are right: only the parameter check (and later losses) can see it.
    ("parameter_not_stepped", BASE + PP2_DP2, {"parameter"}),
    ("parameter_not_stepped", BASE + PP2_DP2 + FP64, {"parameter"}),
    # PipeDream-2BW against its delayed single-process run: step 0 is the same on either version (W(-1) = W(0))
    ("stream_on_the_newest_weights", BASE + PP2_DP2 + STREAM, {"loss", "grad norm", "parameter"}),
    # The first stage's MoE layers lose their balancing and z losses' gradient: their routers' gradients differ.
    ("router_losses_dropped_off_the_loss_stage", BASE + PP2_DP2 + MIXTRAL + FP64, BEFORE_OPTIMIZER),
    # Step 0 routes with zero biases everywhere: the replicas' biases differ from step 1 on (its gradients).
    ("expert_bias_from_local_load", BASE + PP2_DP2 + DEEPSEEK, {"grad norm", "parameter"}),
    # Stages 1 and 2 of 4 (one layer each) hold only MoE layers and no loss head.
    ("router_losses_dropped_on_middle_stages", BASE + MIXTRAL + FP64 + ["parallel.pp=4", "schedule=1f1b"],
     BEFORE_OPTIMIZER),
    # ep=2 over dp=4: two ranks hold each expert; each steps on its own half of the gradient.
    ("expert_gradient_not_reduced_over_edp", BASE + MIXTRAL + FP64 + ["parallel.pp=1", "parallel.dp=4",
                                                                     "parallel.ep=2"], BEFORE_OPTIMIZER),
    ("token_sent_to_the_wrong_rank", BASE + MIXTRAL + FP64 + ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"],
     {"loss", "forward-only loss", *BEFORE_OPTIMIZER}),
    # TP and CP split each microbatch's tokens: the balancing loss reads each rank's own share of the load.
    ("balancing_load_of_own_tokens", BASE + MIXTRAL + FP64 + TP2_CP2_EP2, BEFORE_OPTIMIZER),
    # The EP ranks are the TP ranks: summing the experts' gradients over TP adds other experts' to each.
    ("experts_summed_over_tp", BASE + MIXTRAL + FP64 + TP2_CP2_EP2, {"loss", *BEFORE_OPTIMIZER}),
    # Qwen3's per-head q/k norms at tp=2 without SP: each TP rank's scale gradient is its own heads' share.
    ("qk_norm_gradient_not_summed_over_tp", BASE + QWEN3 + FP64 + TP2_PP2, {"loss", *BEFORE_OPTIMIZER}),
    # Microbatches of very different trained-token counts: each one's own mean gives another loss and gradient.
    ("loss_mean_per_microbatch", BASE + SKEWED + PP2_DP2 + ["trainer.micro_batch_size=2"] + FP64,
     {"loss", "forward-only loss", "validation loss", *BEFORE_OPTIMIZER}),
    # Validation batches of 107 and 86 trained tokens: the mean of their two means is not the mean over all of them.
    ("validation_mean_of_batch_means", BASE + SKEWED + PP2_DP2 + FP64, {"validation loss"}),
]


def failing_checks(overrides, per_rank, index) -> set[str]:
    """The names of the harness's comparisons that run ``index`` fails."""
    failed = set()
    for name, check in equivalence_checks(overrides, per_rank, index).items():
        try:
            check()
        except AssertionError:
            failed.add(name)
    return failed


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_every_broken_twin_fails_the_comparisons_its_defect_reaches():
    prepare_skewed_masks()
    runs = [overrides for _defect, overrides, _checks in TWINS]
    per_rank = train_in_workers(runs, world_size=4, breakers=[defect for defect, _runs, _checks in TWINS])
    for index, (defect, overrides, must_fail) in enumerate(TWINS):
        failed = failing_checks(overrides, per_rank, index)
        assert must_fail <= failed, f"{defect} {overrides[-3:]}: only {sorted(failed)} failed"
