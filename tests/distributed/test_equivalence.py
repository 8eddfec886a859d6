"""Every layout and schedule trains exactly like one process on the same global batch.

One launch per layout trains several runs (schedules, position embeddings, tied
embeddings, a loss mask with holes, documents kept apart, float64, the tanh GELU at tp=2, compiled blocks at tp=2 and
through ZB-H1 and DualPipeV at pp=2; at pp=4's world size of 4,
loss masks skewed across microbatches at other layouts and microbatch counts); each is compared with
the single-process run as a user would launch it (the same overrides with ``parallel=single``): per-step
losses and grad norms, step-0 gradients and final parameters, within the tolerances of
``tests/harness/tolerances.py`` (float64 every element within 1e-10).
"""

import pytest

from tests.distributed.equivalence import (BASE, DEEPSEEK, DOCUMENTS, FP64, LLAMA, LLAMA_MHA, MASKED, MIXTRAL,
                                           QWEN2_MOE, QWEN3, assert_equivalent, prepare_skewed_masks)

ROPE_TIED = ["model.position_embedding=rope", "model.tie_embeddings=true"]
# Llama's attention_bias (q, k, v and o_proj biases) with YaRN's rotary scaling; the Mistral and Phi-3 families
# (Llama's chunk, their own Hugging Face formats: tests/unit/test_hf_mistral_phi3.py), Mistral's with linear scaling.
BIASED_YARN = LLAMA + ["model.qkv_bias=true", "model.attention_output_bias=true", "model.rope_scaling_factor=4.0",
                       "model.rope_scaling_type=yarn", "model.rope_original_max_position=2048"]
MISTRAL_LINEAR = LLAMA + ["model.family=mistral", "model.rope_scaling_factor=4.0", "model.rope_scaling_type=linear"]
PHI3 = LLAMA + ["model.family=phi3"]
STREAM = ["schedule=pipedream_2bw", "optimizer.gradient_delay=1", "optimizer.clip_grad=0"]


def skewed_mask_runs() -> list[list[str]]:
    """World-size-4 runs on microbatches of very different trained-token counts (``SKEWED``: 1 to 16 of 16), each
    equal to one process's mean over the global batch's trained tokens (its loss, grad norm, parameters and
    validation loss): 8 microbatches of 1 sequence (pp=4) and 2 of 2 per DP rank (pp2 dp2), ZB-V's split backward
    with CP's halves of each mask, PipeDream-2BW's stream with its delayed gradients, and Mixtral's router losses
    beside the masked token loss."""
    skewed = BASE + prepare_skewed_masks() + FP64
    pp2_dp2 = ["parallel.pp=2", "parallel.dp=2"]
    return [skewed + ["parallel.pp=4", "parallel.dp=1", "schedule=1f1b"],
            skewed + pp2_dp2 + ["trainer.micro_batch_size=2", "schedule=1f1b"],
            skewed + ["parallel.pp=2", "parallel.dp=1", "parallel.cp=2", "schedule=zbv"],
            skewed + pp2_dp2 + STREAM,
            skewed + MIXTRAL + pp2_dp2 + ["schedule=1f1b"]]


LAYOUTS = [  # (tp, pp, dp)
    (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 1), (4, 1, 1),
]


@pytest.mark.nccl
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp, dp", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_gpipe_and_1f1b_match_single_process(tp, pp, dp):
    layout = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}"]
    runs = [BASE + layout + [f"schedule={name}"] for name in ("gpipe", "1f1b")]
    runs.append(BASE + layout + ["schedule=1f1b"] + FP64)
    if (tp, pp, dp) == (2, 1, 1):  # GPT-2's tanh GELU on TP-split MLP columns
        runs.append(BASE + layout + ["schedule=1f1b", "model.activation=gelu_tanh"] + FP64)
    if tp * pp * dp >= 4:  # the bigger layouts also carry rotary, tied embeddings and a masked loss
        runs.append(BASE + layout + ["schedule=1f1b"] + ROPE_TIED + MASKED)
        runs.append(BASE + layout + ["schedule=gpipe"] + (LLAMA_MHA if tp == 4 else LLAMA) + MASKED)
    if (tp, pp, dp) == (2, 2, 2):  # the output bias added once after the sum, its gradient summed over SP's tokens
        runs += [BASE + layout + ["schedule=1f1b", "parallel.sequence_parallel=true"] + BIASED_YARN + FP64,
                 BASE + layout + ["schedule=1f1b"] + MISTRAL_LINEAR + FP64, BASE + layout + ["schedule=gpipe"] + PHI3]
        # Documents kept apart: every stage masks each microbatch's documents (learned positions restarting on
        # the first stage, rotary ones on every stage), through SP, ZB-V's split backward and full recomputation.
        sp = ["parallel.sequence_parallel=true"]
        runs += [BASE + layout + ["schedule=1f1b"] + sp + DOCUMENTS + FP64,
                 BASE + layout + ["schedule=zbv", "model.recompute=full"] + sp + LLAMA + DOCUMENTS + FP64]
    if (tp, pp, dp) == (1, 4, 1):  # the loss is the mean over the global batch's trained tokens, whatever the split
        runs += skewed_mask_runs()
    # Compiled blocks (trainer.compile), against one process compiled the same way: ZB-H1's B/W split and DualPipeV's
    # pairs at pp=2 (the split ops eager between compiled regions), TP's collectives between them at tp=2.
    if (tp, pp, dp) == (1, 2, 1):
        runs += [BASE + layout + [f"schedule={name}", "trainer.compile=true"] for name in ("zb_h1", "dualpipev")]
    if (tp, pp, dp) == (2, 1, 1):
        runs.append(BASE + layout + ["schedule=1f1b", "trainer.compile=true"])
    assert_equivalent(runs, world_size=tp * pp * dp)


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_tp4_with_pipeline_rotary_tied_and_masked_loss():
    # tp=4 pads the vocabulary to 256 rows where one process pads to 64: padding must not change the model.
    layout = ["parallel.tp=4", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b"]
    runs = [BASE + layout + ROPE_TIED + MASKED, BASE + layout + ROPE_TIED + MASKED + FP64,
            BASE + layout + LLAMA_MHA + ["model.tie_embeddings=true"] + FP64]
    assert_equivalent(runs, world_size=8)


PP2 = ["parallel.pp=2", "parallel.dp=1"]


# GPT's GELU experts with biases, a capacity that drops tokens (in microbatch order), every layer recomputed.
GPT_EXPERTS = ["model.moe.num_experts=4", "model.moe.topk=2", "model.moe.capacity_factor=1.0",
               "model.moe.drop_policy=position", "model.moe.aux_loss_coeff=0.01"]


# Three single-process references serve every mixture run (and the twins'): Mixtral's routing in float64,
# DeepSeek's in float32, GPT's experts in float64.
@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_mixtures_of_experts_at_pp2_match_single_process():
    """Router losses added on whichever stage holds the layer, and the expert bias moved alike, under 1F1B,
    interleaved 1F1B, DualPipeV, ZB-V (a split backward) and full recomputation."""
    runs = [BASE + MIXTRAL + PP2 + ["schedule=1f1b"] + FP64,
            BASE + MIXTRAL + PP2 + ["schedule=dualpipev"] + FP64,
            BASE + DEEPSEEK + PP2 + ["parallel.vpp=2", "schedule=interleaved_1f1b"],
            BASE + DEEPSEEK + PP2 + ["schedule=zbv"],
            BASE + GPT_EXPERTS + PP2 + ["schedule=1f1b", "model.recompute=full"] + FP64]
    assert_equivalent(runs, world_size=2)


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_mixtures_of_experts_with_expert_parallelism_match_single_process():
    """Data-parallel replicas route their own microbatches and keep one expert bias (the global load's); with
    expert parallelism each rank holds ep's share of the experts, the tokens travel to them by all-to-all and back
    (through every schedule's split backwards; with parallel.overlap_ep_comm, DualPipeV's pairs interleaved and
    ZB's W's filling their neighbouring backward's exchange waits), and the experts' gradients reduce over their edp
    ranks, plain or sharded by the distributed optimizer (its buckets then reduced from the W's thread)."""
    pp2_dp2 = ["parallel.pp=2", "parallel.dp=2"]  # ep=1 with data parallelism: the twins' and the fuzzer's
    sharded = ["optimizer.distributed=true"]
    ep2 = pp2_dp2 + ["parallel.ep=2"]
    runs = [BASE + MIXTRAL + ep2 + ["schedule=dualpipev", "parallel.overlap_ep_comm=true"] + FP64,
            BASE + MIXTRAL + ep2 + sharded + ["schedule=zbv", "parallel.overlap_ep_comm=true"] + FP64,
            BASE + DEEPSEEK + ep2 + ["parallel.vpp=2", "schedule=interleaved_1f1b"],
            # DualPipeV's pairs overlapped (two threads, one communicator each) and a recomputed forward's exchange
            BASE + GPT_EXPERTS + ep2 + ["schedule=dualpipev", "model.recompute=full",
                                        "parallel.overlap_ep_comm=true"] + FP64,
            BASE + MIXTRAL + ["parallel.pp=1", "parallel.dp=4", "parallel.ep=4"] + FP64,
            BASE + DEEPSEEK + ["parallel.pp=1", "parallel.dp=4", "parallel.ep=2"] + sharded,  # edp=2
            # pp rank 0 holds DeepSeek's first layer alone: dense, no router, yet in the routing statistics' sum
            BASE + DEEPSEEK + ["parallel.pp=4", "schedule=1f1b"]]
    assert_equivalent(runs, world_size=4)


@pytest.mark.nccl
@pytest.mark.timeout(300)
def test_mixtures_of_experts_with_tensor_and_context_parallelism_match_single_process():
    """TP (with sequence parallelism) and CP split each microbatch's tokens: every rank routes its share, the load
    and token count of the balancing and z losses are the microbatch's (summed over tp x cp), and the EP ranks may be
    TP or CP ranks, each holding other experts (never summed over TP); at ep=1 every TP rank holds every expert.
    DualPipeV's pairs and weight fills run interleaved beside TP and beside CP's ring, whose collectives and
    exchanges keep one order on each of two lanes (``ppctl.parallel.lanes``). Beside them: Qwen2-MoE's gated shared
    expert under SP and EP, and Qwen3's per-head q/k norms at tp=2 without SP (each TP rank's norm gradient its own
    heads' share, summed over TP) through ZB-V's split backward."""
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    runs = [BASE + MIXTRAL + sp + ["parallel.cp=2", "parallel.pp=1", "parallel.dp=1", "parallel.ep=2"] + FP64,
            BASE + MIXTRAL + sp + ["parallel.pp=2", "parallel.dp=1", "parallel.ep=2", "schedule=dualpipev",
                                   "parallel.overlap_ep_comm=true"] + FP64,
            BASE + DEEPSEEK + ["parallel.cp=2", "parallel.pp=1", "parallel.dp=2", "parallel.ep=4",
                               "optimizer.distributed=true"],
            BASE + DEEPSEEK + sp + ["parallel.pp=2", "parallel.dp=1", "schedule=zbv"],  # ep=1
            BASE + MIXTRAL + ["parallel.cp=2", "parallel.cp_comm=ring", "parallel.pp=2", "parallel.dp=1",
                              "parallel.ep=2", "schedule=dualpipev", "parallel.overlap_ep_comm=true"] + FP64,
            BASE + QWEN2_MOE + sp + ["parallel.pp=2", "parallel.dp=1", "parallel.ep=2", "schedule=1f1b"] + FP64,
            BASE + QWEN3 + ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=zbv"] + FP64]
    assert_equivalent(runs, world_size=4)
