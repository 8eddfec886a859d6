"""The NCCL path on GPUs (``make gpu-check``): skipped where torch sees no CUDA device.

Each check launches ``ppctl train`` as a user would, under ``launcher.backend=nccl`` (one
GPU per worker), and compares its TensorBoard scalars with a gloo run on the CPU of the
same overrides:

- one GPU, world size 1: fp32, bf16 and fp16, each with the plain and the distributed
  optimizer; losses and gradient norms within the precision's tolerance of the gloo run
  (fp32: the kernels differ between devices, so a few float32 roundoffs, not bit equality);
- a checkpoint written under NCCL on the GPU, resumed under gloo on the CPU, ends where an
  uninterrupted gloo run ends;
- ``gpt_small`` in bf16: its tokens per second and model FLOPs utilisation, printed;
- with N GPUs, layouts of up to N workers (pp, tp, dp, and all three) against the single
  process run, as the CPU suite checks them on gloo; a layout that needs more GPUs skips.
"""

from __future__ import annotations

import statistics

import pytest

torch = pytest.importorskip("torch")

from tests.cli.conftest import run_ppctl  # noqa: E402
from tests.cli.runs import assert_same_series, series  # noqa: E402
from tests.harness.tolerances import HALF_PRECISION_LOSS  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA device: the NCCL checks need a GPU (make gpu-check)")

SMALL = ["data=synthetic", "model=gpt_tiny", "trainer.seq_length=64", "trainer.global_batch_size=8",
         "trainer.micro_batch_size=2", "trainer.log_every=1", "trainer.eval_every=0", "trainer.max_steps=6"]
FP32_ACROSS_DEVICES = 1e-4  # float32 kernels of two devices, six steps of AdamW: a few hundred roundoffs


def train(run_dir, *overrides: str, timeout: float = 600) -> None:
    """``ppctl train OVERRIDES trainer.out_dir=run_dir``; fails the test with the run's last lines on an error."""
    result = run_ppctl("train", *overrides, f"trainer.out_dir={run_dir}", timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_gpu_trains_like_gloo_on_the_cpu(tmp_path, precision, distributed):
    settings = [*SMALL, "parallel=single", f"trainer.precision={precision}", f"optimizer.distributed={distributed}"]
    train(tmp_path / "nccl", *settings, "launcher.backend=nccl")
    train(tmp_path / "gloo", *settings, "launcher.backend=gloo")
    tolerance = FP32_ACROSS_DEVICES if precision == "fp32" else HALF_PRECISION_LOSS[precision]
    assert_same_series(tmp_path / "nccl", tmp_path / "gloo", rtol=tolerance)


def test_a_checkpoint_from_the_gpu_resumes_on_the_cpu(tmp_path):
    first = [*SMALL, "parallel=single", "trainer.max_steps=3"]
    train(tmp_path / "run", *first, "launcher.backend=nccl")
    train(tmp_path / "resumed", *SMALL, "parallel=single", "launcher.backend=gloo",
          f"trainer.resume_from={tmp_path / 'run'}")
    train(tmp_path / "whole", *SMALL, "parallel=single", "launcher.backend=gloo")
    resumed, whole = series(tmp_path / "resumed", "train/loss"), series(tmp_path / "whole", "train/loss")
    assert sorted(resumed) == [3, 4, 5]
    for step, loss in resumed.items():
        assert loss == pytest.approx(whole[step], rel=FP32_ACROSS_DEVICES), step


def test_gpt_small_in_bf16_reports_its_mfu(tmp_path, capsys):
    from ppctl.resolve import compose_config
    from ppctl.config.derived import padded_vocab_size
    from ppctl.model.flops import model_flops_utilisation, peak_flops, training_flops_per_token

    overrides = ["data=synthetic", "model=gpt_small", "parallel=single", "trainer.precision=bf16",
                 "trainer.seq_length=1024", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
                 "trainer.max_steps=30", "trainer.log_every=10", "trainer.eval_every=0", "launcher.backend=nccl"]
    train(tmp_path, *overrides)
    losses = series(tmp_path, "train/loss")
    assert losses[29] < losses[0]
    tokens_per_s = statistics.median(value for step, value in series(tmp_path, "train/tokens_per_s").items()
                                     if step >= 5)
    model = compose_config(overrides).model
    flops = training_flops_per_token(model.num_layers, model.hidden_size, model.ffn_hidden_size, 1024,
                                     padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, 1))
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    mfu = f"{model_flops_utilisation(tokens_per_s, flops, 1, peak):.1%}" if peak else "unknown peak"
    with capsys.disabled():
        print(f"\ngpt_small bf16 on {name}: {tokens_per_s:,.0f} tokens/s, {tokens_per_s * flops / 1e12:.1f} "
              f"TFLOP/s, MFU {mfu}")


LAYOUTS = {
    "pp2-1f1b": ["parallel.pp=2", "schedule=1f1b"],
    "pp2-zbv": ["parallel.pp=2", "schedule=zbv"],
    "tp2": ["parallel.tp=2", "parallel.pp=1"],
    "dp2-distributed": ["parallel.dp=2", "parallel.pp=1", "optimizer.distributed=true"],
    "tp2-pp2-dp2": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_under_nccl_train_like_one_process(tmp_path, single_run, name):
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve

    settings = [*SMALL, *LAYOUTS[name]]
    workers = resolve(compose_config(settings), check=False).layout.world_size
    if workers > GPUS:
        pytest.skip(f"{name} needs {workers} GPUs, this machine has {GPUS}")
    train(tmp_path, *settings, "launcher.backend=nccl")
    assert_same_series(tmp_path, single_run(settings), rtol=FP32_ACROSS_DEVICES)
