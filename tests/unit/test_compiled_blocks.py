"""``trainer.compile``: transformer blocks compiled with ``torch.compile`` compute what eager blocks compute.

A middle stage of two gpt_tiny-shaped layers (``ppctl.model.compiled.compile_blocks``) against the same stage eager,
whole backward and the B/W split (B, then W, the split ops eager between compiled regions), with recomputation,
for GPT and Llama's blocks and a mixture's (its MLP eager). Inductor's kernels sum in other orders than ATen's (a
fused norm, softmax or GELU), which is what the equivalence tolerance already allows for two CPUs' kernels
(``ppctl.verify.tolerance``): compiled and eager are compared by the float32 rule itself, not a widened one; a
compiled block whose output is perturbed fails it.
"""

from __future__ import annotations

import pytest
import torch

from ppctl.model.compiled import compile_blocks
from ppctl.model.from_config import build_chunk
from ppctl.model.recompute import Recompute
from ppctl.parallel.layout import StageLayers
from ppctl.pipeline.stage import PipelineStage, StageIO, TensorSpec
from ppctl.resolve import compose_config
from ppctl.verify.tolerance import tolerance_of

TINY = ["model=gpt_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
        "model.ffn_hidden_size=64", "trainer.seq_length=16"]
BATCH, SEQ, HIDDEN = 1, 16, 32  # the equivalence runs' microbatch (BASE): the suite compiles it once
# Llama's blocks, the first dense (SwiGLU), the second Mixtral's mixture
LLAMA_MIXTURE = ["model.family=llama", "model.position_embedding=rope", "model.num_kv_heads=2",
                 "model.moe.num_experts=4", "model.moe.topk=2", "model.moe.aux_loss_coeff=0.02",
                 "model.moe.first_dense_layers=1"]
WHOLE = [("F", 0), ("F", 1), ("BW", 0), ("BW", 1)]
SPLIT = [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 1), ("W", 0)]
TOLERANCE = tolerance_of("fp32")


def middle_stage(overrides: list[str], compiled: bool, split: bool, recompute: Recompute = Recompute()):
    """Layers 0 and 1 of the configured model as a stage between two others (hidden states in and out)."""
    chunk = build_chunk(compose_config(TINY + overrides), StageLayers(1, (0, 1), False, False), recompute=recompute)
    if compiled:
        compile_blocks(chunk)
    spec = TensorSpec((BATCH, SEQ, HIDDEN), torch.float32)
    return PipelineStage(1, chunk, StageIO(input=spec, output=spec, fields=()),
                         lambda module, stage_input, _microbatch: module(stage_input), is_last=False,
                         split_backward=split)


def run_actions(stage: PipelineStage, actions) -> dict[str, torch.Tensor]:
    """``F``, ``BW``, ``B`` and ``W`` of microbatches; every output, input gradient and weight gradient by name."""
    results = {}
    for kind, microbatch in actions:
        generator = torch.Generator().manual_seed(100 + microbatch)
        stage_input, grad_output = torch.randn((2, BATCH, SEQ, HIDDEN), generator=generator)
        if kind == "F":
            results[f"output {microbatch}"] = stage.forward(microbatch, None, stage_input, None)[0].detach().clone()
        elif kind == "BW":
            results[f"input grad {microbatch}"] = stage.backward(microbatch, grad_output)
        elif kind == "B":
            results[f"input grad {microbatch}"] = stage.backward_input(microbatch, grad_output)
        else:
            stage.backward_weight(microbatch)
    results.update({name: param.grad for name, param in stage.module.named_parameters()})
    return results


def assert_within_rounding(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``actual`` within float32's equivalence tolerance of ``expected``'s."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        difference = TOLERANCE.tensor_difference(actual[name], tensor)
        assert difference <= TOLERANCE.relative, f"{name} differs by {difference:.2e} (> {TOLERANCE.relative})"


def autograd_nodes(output: torch.Tensor) -> set[str]:
    """The names of every node of ``output``'s backward graph."""
    names, seen, pending = set(), set(), [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        pending.extend(next_node for next_node, _index in node.next_functions)
    return names


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_compiled_blocks_run_inductor_graphs_and_the_split_ops_stay_outside(split):
    """The forward runs compiled graphs (AOTAutograd's ``CompiledFunction`` nodes in its backward graph); with a
    weight-gradient store the split ops stay their own autograd Functions between them, whose backward asks the store
    at run time (traced into a graph, that question would be answered once, at compile time)."""
    stage = middle_stage([], compiled=True, split=split)
    nodes = autograd_nodes(stage.forward(0, None, torch.randn(BATCH, SEQ, HIDDEN), None)[0])
    assert "CompiledFunctionBackward" in nodes
    assert ("_SplitWeightGradBackward" in nodes) == split


@pytest.mark.parametrize("actions", [WHOLE, SPLIT], ids=["whole", "split"])
def test_compiled_gpt_blocks_match_eager(actions):
    split = actions is SPLIT
    eager = run_actions(middle_stage([], compiled=False, split=split), actions)
    compiled = run_actions(middle_stage([], compiled=True, split=split), actions)
    assert_within_rounding(compiled, eager)


def test_a_perturbed_compiled_block_fails_the_comparison():
    """The broken twin: layer 1's compiled output scaled by 1 + 1e-4, ten times the tolerance."""
    eager = run_actions(middle_stage([], compiled=False, split=True), SPLIT)
    stage = middle_stage([], compiled=True, split=True)
    stage.module.layers["1"].register_forward_hook(lambda _module, _inputs, output: output * (1 + 1e-4))
    with pytest.raises(AssertionError, match="differs by"):
        assert_within_rounding(run_actions(stage, SPLIT), eager)


@pytest.mark.parametrize("recompute", [Recompute("full", "uniform", 1), Recompute("selective")],
                         ids=["full", "selective"])
def test_compiled_blocks_recompute_as_eager_ones_keep(recompute):
    """Full recomputation runs the compiled blocks again in B; selective checkpoints the attention core inside the
    compiled graph: both give the gradients of eager blocks that recompute nothing."""
    eager = run_actions(middle_stage([], compiled=False, split=True), SPLIT)
    compiled = run_actions(middle_stage([], compiled=True, split=True, recompute=recompute), SPLIT)
    assert_within_rounding(compiled, eager)


def test_compiled_llama_and_mixture_blocks_match_eager():
    """Llama's blocks (RMSNorm, rotary, grouped-query attention, SwiGLU) compiled; a mixture's MLP stays eager
    (its routing counts are data) between the compiled attention and residuals, its router losses in the backward."""
    eager = run_actions(middle_stage(LLAMA_MIXTURE, compiled=False, split=True), SPLIT)
    compiled = run_actions(middle_stage(LLAMA_MIXTURE, compiled=True, split=True), SPLIT)
    assert_within_rounding(compiled, eager)


def test_the_workers_share_the_run_directory_s_inductor_cache_unless_the_user_set_one(tmp_path, monkeypatch):
    """The launcher puts a compiled run's workers' inductor cache in ``<run dir>/.cache/inductor`` (where a resumed
    run finds it); a folder set in ppctl's environment is kept; an eager run is given none."""
    from ppctl.run.launch import LaunchRequest, build_launch_plan

    def plan_env(*overrides: str) -> dict[str, str]:
        return build_launch_plan(compose_config(list(overrides)), LaunchRequest("train", tmp_path), "gloo").env

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert plan_env("trainer.compile=true")["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path.resolve() / ".cache/inductor")
    assert "TORCHINDUCTOR_CACHE_DIR" not in plan_env()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's: inherited as it is
    assert "TORCHINDUCTOR_CACHE_DIR" not in plan_env("trainer.compile=true")
    # inductor's default, which importing Dynamo sets in the launcher (a checkpoint's shape check does): replaced
    import torch._dynamo  # noqa: F401  (what the launcher's shape check imports)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    cache_dir()  # what importing Dynamo does when it is first imported
    assert plan_env("trainer.compile=true")["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path.resolve() / ".cache/inductor")


def test_the_log_says_when_compilation_ended_and_the_eta_leaves_that_step_out(tmp_path, capsys):
    """The first step of a compiled run (its compilation) is named in one line; the ETA is the later steps' pace."""
    from ppctl.run.logging import TrainingLogger
    from ppctl.run.train import StepResult
    from tests.unit.test_loss_counts import fake_trainer

    def step(index: int, seconds: float) -> StepResult:
        return StepResult(step=index, loss=2.5, grad_norm=0.75, lr=1e-3, step_time_s=seconds, tokens_per_s=1.0)

    for compiled in (True, False):
        config = compose_config(["data=synthetic", "trainer.max_steps=4", "trainer.log_every=1",
                                 "trainer.tensorboard=false", f"trainer.compile={str(compiled).lower()}"])
        (tmp_path / str(compiled)).mkdir()
        logger = TrainingLogger(config, tmp_path / str(compiled), fake_trainer())
        logger.log(step(0, 60.0))
        logger.log(step(1, 0.5))
        logger.close()
        printed = capsys.readouterr().out
        said = [line for line in printed.splitlines() if "compilation" in line]
        assert said == (["step 1: compilation of the blocks ended with this step (60.0 s, its tokens/s included; "
                         "the ETA leaves it out)"] if compiled else [])
        assert ("compiled blocks (torch.compile, inductor" in printed) == compiled
        assert logger.eta.remaining_s() == 2 * 0.5  # steps 3 and 4 at step 2's pace: step 1's 60 s left out


def test_eager_code_never_imports_dynamo():
    """The marks of what stays out of the graphs cost an eager process nothing: importing the model and running a
    split op (a B/W split's linear) leaves Dynamo unimported (its import costs about a second per process)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "import ppctl.run.train, ppctl.model.moe.layer, ppctl.parallel.context_parallel\n"
            "from ppctl.autograd.weight_grad import WeightGradStore, linear\n"
            "inputs, weight = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)\n"
            "linear(inputs, weight, None, WeightGradStore()).sum().backward()\n"
            "print('torch._dynamo' in sys.modules)\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False"
