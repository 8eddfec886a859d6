"""The typed configuration: its schema, its composition with Hydra, validation and what follows from it.

The package's interface is what this module re-exports; import from here::

    from ppctl.config import PpctlConfig, compose_config, validate, layout_of

One concern per module:

- ``schema``: the dataclasses (``PpctlConfig`` and its sections), each field with its default and meaning,
  the values some fields allow, ``ConfigError``. It imports nothing of ppctl's.
- ``compose``: Hydra composition (``compose_config``), reading and writing a resolved ``config.yaml``
  (``load_config_file``, ``to_yaml``), Hydra's and OmegaConf's errors folded into one line.
- ``derived``: what follows from a config: ``layout_of``, ``config_layer_map``, ``schedule_spec``,
  ``num_microbatches``, ``padded_vocab_size``, ``message_seq_length``, ``nproc_per_node``,
  ``tokenizer_vocab_size``, ``parse_endpoint``, and ``fill_unset`` (the settings that follow another part
  of ppctl when unset).
- ``validate``: the rules that span several settings (``validate``, ``DerivedSizes``).
- ``reference``: the key table of docs/configuration.md, generated from the schema
  (``python -m ppctl.config`` prints it).

All of it is pure: no torch, no process started, no process group touched.
"""

from ppctl.config.compose import PACKAGE_CONF_DIR, compose_config, load_config_file, to_yaml
from ppctl.config.derived import (config_layer_map, configured_schedule, fill_unset, layout_of, message_seq_length,
                                  nproc_per_node, num_microbatches, padded_vocab_size, parse_endpoint,
                                  pipeline_layout_of, schedule_spec, tokenizer_vocab_size)
from ppctl.config.reference import config_reference, config_reference_table, render_default
from ppctl.config.schema import (SCHEMA_GROUPS, ConfigError, DataConfig, LauncherConfig, ModelConfig,
                                 OptimizerConfig, ParallelConfig, PpctlConfig, ScheduleConfig, SlurmConfig,
                                 TrainerConfig, setting)
from ppctl.config.validate import DerivedSizes, parse_fault, validate, validate_data

__all__ = [
    "ConfigError", "DataConfig", "DerivedSizes", "LauncherConfig", "ModelConfig", "OptimizerConfig",
    "PACKAGE_CONF_DIR", "ParallelConfig", "PpctlConfig", "SCHEMA_GROUPS", "ScheduleConfig", "SlurmConfig",
    "TrainerConfig", "compose_config", "config_layer_map", "configured_schedule", "fill_unset", "config_reference", "config_reference_table",
    "layout_of", "load_config_file", "message_seq_length", "nproc_per_node", "num_microbatches",
    "padded_vocab_size", "parse_endpoint", "parse_fault", "pipeline_layout_of", "render_default", "schedule_spec", "setting", "to_yaml",
    "tokenizer_vocab_size", "validate", "validate_data",
]
