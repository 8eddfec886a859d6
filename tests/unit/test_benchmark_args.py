"""The benchmarks refuse a bad argument with argparse's error (exit 2) before they build a model or start a worker.

Each script's ``parse_args(argv)`` is what its ``main`` calls first; it is run here in-process on the
script imported from its file. Counts must be at least 1 (``benchmarks/args.py``); arguments that become
ppctl overrides are validated as ``ppctl train`` validates them, with ppctl's own line.
"""

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py") if path.stem != "args")


def script(name: str):
    """``benchmarks/<name>.py`` imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, argv, says", [
    ("generate", ["--heads", "0"], "argument --heads: 0 is not at least 1"),
    ("generate", ["--new", "0"], "argument --new: 0 is not at least 1"),
    ("generate", ["--threads", "-2"], "argument --threads: -2 is not at least 1"),
    ("generate", ["--models", "bert"], "argument --models: 'bert' not among gpt2, llama (comma-separated)"),
    ("generate", ["--models", "gpt2,gpt2"], "argument --models: 'gpt2,gpt2' names one twice"),
    ("generate", ["--hidden", "100", "--heads", "8"], "--hidden 100 is not a multiple of --heads 8"),
    ("generate", ["--heads", "8", "--kv-heads", "3"], "--heads 8 is not a multiple of --kv-heads 3"),
    ("generate", ["--hidden", "24", "--heads", "8"], "--hidden 24 / --heads 8 is 3: llama's rotary embedding needs "
                                                     "an even head width"),
    ("hf_load", ["--heads", "0"], "argument --heads: 0 is not at least 1"),
    ("hf_load", ["--shard-mb", "-1"], "argument --shard-mb: -1 is not at least 1"),
    ("hf_load", ["--interval-ms", "nan"], "argument --interval-ms: nan is not a finite number above 0"),
    ("hf_load", ["--heads", "6"], "model.num_heads=6 must be a multiple of model.num_kv_heads=4"),
    ("cp_attention", ["--cp", "0"], "argument --cp: 0 is not at least 1"),
    ("cp_attention", ["--warmup", "-1"], "argument --warmup: -1 is negative; 0 or more"),
    ("cp_attention", ["--seq", "7"], "--seq 7 is not a multiple of 2 x any --cp size (1 2 3 4): nothing to measure"),
    ("stream_steps", ["--pp", "0"], "argument --pp: 0 is not at least 1"),
    ("stream_steps", ["--microbatches", "1"], "num_microbatches=1 must be at least pp=2"),
    ("bw_split", ["--heads", "0"], "argument --heads: 0 is not at least 1"),
    ("bw_split", ["--seq", "1.5"], "argument --seq: '1.5' is not a whole number"),
    ("bw_split", ["--heads", "5"], "--hidden 768 is not a multiple of --heads 5"),
    ("check_speed", ["--repeats", "0"], "argument --repeats: 0 is not at least 1"),
    ("prepare_data", ["--gib", "0.25", "0"], "argument --gib: 0 is not a finite number above 0"),
    ("prepare_data", ["--num-proc", "0"], "argument --num-proc: 0 is not at least 1"),
    ("prepare_data", ["--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer /nonexistent/tokenizer.json: "
                                                                     "no such file"),
    ("document_mask", ["--documents", "65"], "--documents 65 exceeds --seq 64: a document holds at least one token"),
    ("moe_overlap", ["--steps", "1"], "argument --steps: 1 is less than 2: the first step warms up and is left out"),
    ("moe_overlap", ["--hidden", "100"], "model.head_dim=25 must be even"),
    ("optimizer_memory", ["--dp", "2", "0"], "argument --dp: 0 is not at least 1"),
    ("optimizer_memory", ["--warmup", "0"], "argument --warmup: 0 is less than 1: AdamW creates its state at the "
                                            "first step"),
    ("optimizer_memory", ["model.num_heads=3"], "model.hidden_size=256 must be divisible by model.num_heads=3"),
    ("memory_check", ["--models", "bert"], "argument --models: 'bert' not among llama3_8b, mixtral_8x7b, gpt_small"),
    ("memory_check", ["--layouts", "3"], "argument --layouts: '3' not among 0, 1, 2 (comma-separated)"),
    ("plan_check", ["--workers", "3"], "argument --workers: invalid choice: 3 (choose from 2, 4)"),
    ("plan_check", ["--steps", "-1"], "argument --steps: -1 is not at least 1"),
])
def test_a_bad_argument_is_one_argparse_error_before_anything_runs(capsys, name, argv, says):
    with pytest.raises(SystemExit) as ended:
        script(name).parse_args(argv)
    error = capsys.readouterr().err.splitlines()[-1]  # argparse's usage, then its one error line
    assert ended.value.code == 2 and ": error: " in error and says in error


# moe_overlap and optimizer_memory validate 5 and 6 composed configs with their defaults, a second each: the cases
# above take them through the same check
@pytest.mark.parametrize("name", [name for name in SCRIPTS if name not in ("moe_overlap", "optimizer_memory")])
def test_every_benchmark_takes_its_defaults(name):
    assert vars(script(name).parse_args([]))
