"""Hugging Face in and out at parallel layouts: ``model.init_from`` read in slices by 4 gloo workers, the loss on a
batch against transformers', and ``ppctl export`` of checkpoints saved at two layouts.

For a tiny GPT-2 (untied, with GPT-2's own tanh GELU ``gelu_new``: ``model.activation=gelu_tanh``; named by its folder
alone, ``model.init_from`` and the layout, the folder giving every model key) and a tiny
StarCoder2 (rotary, tied, the exact GELU; ``tests/harness/hf_models.py``), both with random QKV biases, each in float64
at two layouts of 4 workers (tp=2 pp=2 and pp=2 dp=2; tp=2 pp=2 and tp=4: the vocabulary padded to 128 and 256
rows, a tied output layer on its own stage): the forward-only loss of global batch 0 equals transformers'
cross-entropy of its float64 logits on the same batch (measured: ~1e-16 relative, asserted 1e-10); each layout's
checkpoint, saved before any step, exports (``ppctl.checkpoint.hf_export``, one process) to the same bytes, and
those are the folder's tensors (transposes, the QKV order and the unpadded vocabulary undone exactly).

A StarCoder2 with grouped key/value heads (4 on 2; model.family=gpt) and a GPT-NeoX (parallel residual, rotary over
half of each head; model.family=gpt_neox) join the same launch at tp=2 pp=2 and pp=2 dp=2, and both train from
their folders in one more case of the same 4 workers equal to one process (``tests/distributed/equivalence.py``: each
step's loss and gradient norm, the step-0 gradients and the final parameters, float64): StarCoder2 at tp=2 pp=2
with sequence parallelism and at tp=2 cp=2 (its key/value heads repeated inside the CP group's attention),
GPT-NeoX at tp=2 pp=2 (each TP rank's rows of its per-head QKV being whole heads).

A Gemma (tied, heads 16 wide beside hidden / heads = 8; model.family=gemma) and an OLMo 2 (untied; model.family=olmo2),
each named by its folder alone, join the same launch at tp=2 pp=2 and pp=2 dp=2 (read with transformers' loss, each
layout's checkpoint exported to the folder's bytes), and train from their folders as one process in a case of the same
4 workers at tp=2 pp=2 (OLMo 2 with sequence parallelism: its post-norms on each rank's tokens, its whole-width q/k
norms' sums of squares added over TP).
"""

import json
from pathlib import Path

import pytest

from tests.distributed.equivalence import assert_equivalent, composed_runs
from tests.harness.hf_models import (GEMMA, GPT2, GPT_NEOX, OLMO2, STARCODER2, STARCODER2_GQA, batch_loss,
                                     folder_overrides, hf_model, overrides, save_tiny, step_batch)
from tests.harness.pool import run_workers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LAYOUTS = {
    GPT2: (["parallel.tp=2", "parallel.pp=2"], ["parallel.pp=2", "parallel.dp=2"]),
    STARCODER2: (["parallel.tp=2", "parallel.pp=2"], ["parallel.tp=4", "parallel.pp=1"]),
    STARCODER2_GQA: (["parallel.tp=2", "parallel.pp=2"], ["parallel.pp=2", "parallel.dp=2"]),
    GPT_NEOX: (["parallel.tp=2", "parallel.pp=2"], ["parallel.pp=2", "parallel.dp=2"]),
    GEMMA: (["parallel.tp=2", "parallel.pp=2"], ["parallel.pp=2", "parallel.dp=2"]),
    OLMO2: (["parallel.tp=2", "parallel.pp=2"], ["parallel.pp=2", "parallel.dp=2"]),
}
FROM_FOLDER_ALONE = (GPT2, GEMMA, OLMO2)  # named by the folder alone: it gives every model key
TIED = {GPT2: False, STARCODER2: True, STARCODER2_GQA: True, GPT_NEOX: False, GEMMA: True, OLMO2: False}
# transformers' activation name, and the run's model.activation
ACTIVATION = {GPT2: ("gelu_new", "gelu_tanh"), STARCODER2: ("gelu", "gelu"), STARCODER2_GQA: ("gelu", "gelu"),
              GPT_NEOX: ("gelu", "gelu"), GEMMA: ("gelu_pytorch_tanh", None), OLMO2: ("silu", None)}


def _save_and_evaluate(rank, world_size, root, configs):
    """Worker: for each config, a trainer from its HF folder saves a checkpoint at step 0 and evaluates batch 0."""
    from ppctl.checkpoint.state import save_checkpoint
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import Trainer

    contexts, results = {}, []
    for index, config in enumerate(configs):
        run = resolve(config, check=False)  # validated in the test process
        if run.layout not in contexts:
            contexts[run.layout] = build_parallel_context(run.layout, 60)
        trainer = Trainer(run, contexts[run.layout])
        checkpoint = save_checkpoint(trainer, Path(root) / f"run{index}", 0, "test", keep_last=1)
        results.append((str(checkpoint), trainer.evaluate(0)))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{(architecture, layout index): (config, checkpoint, the step-0 losses the ranks report)}``."""
    root = tmp_path_factory.mktemp("hf_runs")
    keys, items = [], []
    for architecture, layouts in LAYOUTS.items():
        hf_activation, activation = ACTIVATION[architecture]
        # GPT-2 from its folder alone (the folder gives every model key); StarCoder2 with every key written out.
        folder = save_tiny(root / architecture, architecture, TIED[architecture], activation=hf_activation)
        for index, layout in enumerate(layouts):
            keys.append((architecture, index))
            start = (folder_overrides(folder) if architecture in FROM_FOLDER_ALONE
                     else [*overrides(folder, architecture, TIED[architecture]), f"model.activation={activation}"])
            items.append([*start, "trainer.precision=fp64", *layout])
    configs = composed_runs(items)
    per_rank = run_workers(_save_and_evaluate, 4, str(root / "runs"), configs, timeout=240)
    return {key: (config, Path(per_rank[0][index][0]), [ranks[index][1] for ranks in per_rank])
            for index, (key, config) in enumerate(zip(keys, configs))}


@pytest.mark.parametrize("architecture", list(LAYOUTS))
def test_the_loss_at_a_parallel_layout_is_transformers_cross_entropy(runs, architecture):
    for index in range(2):
        config, _checkpoint, losses = runs[(architecture, index)]
        expected = batch_loss(hf_model(Path(config.model.init_from)), step_batch(config, 0))
        held = [loss for loss in losses if loss is not None]
        assert held and all(loss == pytest.approx(expected, rel=1e-10) for loss in held), (architecture, index, held)


@pytest.mark.parametrize("architecture", list(LAYOUTS))
def test_checkpoints_of_two_layouts_export_the_same_bytes_and_the_folders_tensors(runs, tmp_path, architecture):
    import torch
    from safetensors.torch import load_file

    from ppctl.checkpoint.hf_export import export_checkpoint

    exported = []
    for index in range(2):
        config, checkpoint, _losses = runs[(architecture, index)]
        out = tmp_path / f"export{index}"
        export_checkpoint(checkpoint, config, out)
        exported.append(out)
    assert {path.name for path in exported[0].iterdir()} == {"config.json", "generation_config.json",
                                                              "model.safetensors"}
    for name in ("config.json", "model.safetensors"):
        assert (exported[0] / name).read_bytes() == (exported[1] / name).read_bytes(), name
    written_config = json.loads((exported[0] / "config.json").read_text())
    assert written_config.get("activation_function", written_config.get("hidden_act")) == ACTIVATION[architecture][0]
    loss = batch_loss(hf_model(exported[0]), step_batch(config, 0))  # transformers reads the export's config
    assert loss == pytest.approx(batch_loss(hf_model(Path(config.model.init_from)), step_batch(config, 0)), rel=1e-12)
    original = load_file(str(Path(config.model.init_from) / "model.safetensors"))
    written = load_file(str(exported[0] / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == torch.float64 and torch.equal(written[name], tensor.double()), name


# What training from a folder adds to the equivalence tests' BASE: their optimizer settings, float64, 1F1B.
TRAINING = ["optimizer.lr=0.01", "optimizer.clip_grad=1.0", "optimizer.eps=1e-5", "trainer.precision=fp64",
            "schedule=1f1b"]


def test_grouped_starcoder2_and_gpt_neox_train_from_their_folders_as_one_process(tmp_path):
    """Grouped key/value heads under TP with sequence parallelism and under CP, GPT-NeoX's parallel residual and
    per-head QKV under TP and PP: every step as one process computes it."""
    starcoder2 = overrides(save_tiny(tmp_path / "starcoder2", STARCODER2_GQA, True), STARCODER2_GQA, True)
    neox = overrides(save_tiny(tmp_path / "neox", GPT_NEOX), GPT_NEOX)
    runs = [[*starcoder2, *TRAINING, "parallel.tp=2", "parallel.pp=2", "parallel.dp=1",
             "parallel.sequence_parallel=true"],
            [*starcoder2, *TRAINING, "parallel.tp=2", "parallel.cp=2", "parallel.pp=1", "parallel.dp=1"],
            [*neox, *TRAINING, "parallel.tp=2", "parallel.pp=2", "parallel.dp=1"]]
    assert_equivalent(runs, world_size=4)


def test_gemma_and_olmo2_train_from_their_folders_as_one_process(tmp_path):
    """Gemma's scaled embeddings, 1 + w norms and GeGLU, and OLMo 2's post-norms and whole-width q/k norms (their sums
    of squares added over TP, with sequence parallelism) under TP and PP: every step as one process computes it."""
    gemma = folder_overrides(save_tiny(tmp_path / "gemma", GEMMA, tie=True, seed=1))
    olmo2 = folder_overrides(save_tiny(tmp_path / "olmo2", OLMO2, seed=2))
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1"]
    assert_equivalent([[*gemma, *TRAINING, *layout], [*olmo2, *TRAINING, *layout, "parallel.sequence_parallel=true"]],
                      world_size=4)
