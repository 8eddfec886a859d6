"""The typed configuration's foundation: its schema and the pure arithmetic that follows from a config.

The package's interface is what this module re-exports; import from here::

    from ppctl.config import ConfigError, PpctlConfig, num_microbatches

One concern per module:

- ``schema``: the dataclasses (``PpctlConfig`` and its sections), each field with its default and meaning,
  the values some fields allow, ``ConfigError``. It imports nothing of ppctl's.
- ``derived``: what follows from a config: ``schedule_spec``, ``num_microbatches``, ``padded_vocab_size``,
  ``message_seq_length``, ``nproc_per_node``, ``tokenizer_vocab_size``, ``parse_endpoint``, and ``fill_unset``
  (the settings that follow another part of ppctl when unset); its layout and schedule builders serve
  validation and ``ppctl.resolve.resolved`` only.

Composing, validating and resolving a config sit above the model, the planner and the optimizer they read, in
``ppctl.resolve``; this package sits below them (a model family's settings subclass the schema's
``ModelConfig``). All of it is pure: no torch, no process started, no process group touched.
"""

from ppctl.config.derived import (fill_unset, message_seq_length, nproc_per_node, num_microbatches, padded_vocab_size,
                                  parse_endpoint, schedule_spec, tokenizer_vocab_size)
from ppctl.config.schema import (SCHEMA_GROUPS, ConfigError, DataConfig, LauncherConfig, ModelConfig, MoEConfig,
                                 OptimizerConfig, ParallelConfig, PpctlConfig, ScheduleConfig, SlurmConfig,
                                 TrainerConfig, freeze, setting)

__all__ = [
    "ConfigError", "DataConfig", "LauncherConfig", "ModelConfig", "MoEConfig", "OptimizerConfig", "ParallelConfig",
    "PpctlConfig", "SCHEMA_GROUPS", "ScheduleConfig", "SlurmConfig", "TrainerConfig", "fill_unset", "freeze",
    "message_seq_length", "nproc_per_node", "num_microbatches", "padded_vocab_size", "parse_endpoint",
    "schedule_spec", "setting", "tokenizer_vocab_size",
]
