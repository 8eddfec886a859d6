"""A run directory as ``ppctl train`` leaves it, made in this process without workers: its ``config.yaml`` and
committed checkpoints of a tiny GPT (``model/<name>`` tensors saved whole by DCP, and the ``ppctl.json`` a save
writes), for the readers of checkpoints (``ppctl export``, ``ppctl generate``) in a fraction of a second each."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ppctl.checkpoint.files import DATA_KEYS, commit, model_record, temporary_dir
from ppctl.checkpoint.pieces import parameter_pieces
from ppctl.checkpoint.state import checkpoint_name
from ppctl.checkpoint.store import add_pieces, save_state
from ppctl.config import PpctlConfig
from ppctl.resolve import compose_config, to_yaml
from ppctl.data.tokenizer import tokenizer_record

TINY = ["model=gpt_tiny", "model.num_layers=1", "model.hidden_size=16", "model.num_heads=2",
        "model.ffn_hidden_size=32", "model.max_seq_length=16", "trainer.seq_length=16", "parallel=single"]


def tiny_run(run_dir: Path, *overrides: str) -> PpctlConfig:
    """Write ``run_dir/config.yaml`` of a tiny GPT trained on text with the byte tokenizer; return its config."""
    config = compose_config([*TINY, "data=text", f"data.path={run_dir / 'corpus.txt'}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    return config


def save_step(run_dir: Path, config: PpctlConfig, step: int, keep_last: int = 1, seed: int | None = None) -> Path:
    """Save a checkpoint of ``config``'s model (random weights drawn from ``seed``, default ``step``) after ``step``
    steps, its tensors named and cut as a run's one process saves them, and commit it as a run's rank 0 does
    (``latest``, then pruning to ``keep_last``); return it."""
    from ppctl.model.family import resolve_model
    from ppctl.run.reference import reference_model

    torch.manual_seed(step if seed is None else seed)
    rule_for, state = resolve_model(config).rules, {}
    for name, param in reference_model(config).named_parameters():
        rule = rule_for(name)
        shape, pieces = parameter_pieces(rule, param.detach(), 1, 0, config.model.vocab_size)
        add_pieces(state, f"model/{checkpoint_name(name, rule)}", shape, pieces, unique=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")  # DCP saves without a process group here
        save_state(state, temporary_dir(run_dir, step))
    index = {"reason": "end", "precision": config.trainer.precision, "model": model_record(vars(config.model)),
             "layout": {"tp": 1, "pp": 1, "vpp": 1, "dp": 1, "cp": 1, "schedule": config.schedule.name,
                        "distributed_optimizer": False},
             "data": {**{key: getattr(config.trainer, key) for key in DATA_KEYS}, "source": config.data.source,
                      "tokenizer": tokenizer_record(config.data)}}
    return commit(run_dir, step, index, keep_last)
