"""The typed configuration: its schema, its composition with Hydra, validation and what follows from it.

The package's interface is what this module re-exports; import from here::

    from ppctl.config import PpctlConfig, compose_config, validate
    from ppctl.config.resolved import ResolvedConfig, resolve

One concern per module:

- ``schema``: the dataclasses (``PpctlConfig`` and its sections), each field with its default and meaning,
  the values some fields allow, ``ConfigError``. It imports nothing of ppctl's.
- ``compose``: Hydra composition (``compose_config``), reading and writing a resolved ``config.yaml``
  (``load_config_file``, ``to_yaml``), Hydra's and OmegaConf's errors folded into one line.
- ``derived``: what follows from a config: ``schedule_spec``, ``num_microbatches``, ``padded_vocab_size``,
  ``message_seq_length``, ``nproc_per_node``, ``tokenizer_vocab_size``, ``parse_endpoint``, and ``fill_unset``
  (the settings that follow another part of ppctl when unset); its layout and schedule builders serve
  validation and ``resolved`` only.
- ``validate``: the rules that span several settings (``validate``, ``DerivedSizes``).
- ``resolved``: ``resolve(config)``, the ``ResolvedConfig`` every command and worker builds once and passes
  down (layout, schedule, split, layer map, family, sizes); the config is frozen from then on. It sits above
  the planner's balancer and memory model (``parallel.balance=auto``), so this package does not re-export it.
- ``reference``: the key table of docs/configuration.md, generated from the schema
  (``python -m ppctl.config`` prints it).

All of it is pure: no torch, no process started, no process group touched.
"""

from ppctl.config.compose import PACKAGE_CONF_DIR, compose_config, load_config_file, to_yaml
from ppctl.config.derived import (fill_unset, message_seq_length, nproc_per_node, num_microbatches, padded_vocab_size,
                                  parse_endpoint, schedule_spec, tokenizer_vocab_size)
from ppctl.config.reference import config_reference, config_reference_table, render_default
from ppctl.config.schema import (SCHEMA_GROUPS, ConfigError, DataConfig, LauncherConfig, ModelConfig, MoEConfig,
                                 OptimizerConfig, ParallelConfig, PpctlConfig, ScheduleConfig, SlurmConfig,
                                 TrainerConfig, freeze, setting)
from ppctl.config.validate import DerivedSizes, parse_fault, validate, validate_data

__all__ = [
    "ConfigError", "DataConfig", "DerivedSizes", "LauncherConfig", "ModelConfig", "MoEConfig", "OptimizerConfig",
    "PACKAGE_CONF_DIR", "ParallelConfig", "PpctlConfig", "SCHEMA_GROUPS", "ScheduleConfig", "SlurmConfig",
    "TrainerConfig", "compose_config", "fill_unset", "config_reference", "config_reference_table",
    "freeze", "load_config_file", "message_seq_length", "nproc_per_node", "num_microbatches",
    "padded_vocab_size", "parse_endpoint", "parse_fault", "render_default", "schedule_spec", "setting", "to_yaml",
    "tokenizer_vocab_size", "validate", "validate_data",
]
