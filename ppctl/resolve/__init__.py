"""A config composed, validated and resolved: the layer above the model, the planner and the optimizer it reads.

The package's interface is what this module re-exports; import from here::

    from ppctl.resolve import compose_config, load_config_file, validate
    from ppctl.resolve.resolved import ResolvedConfig, resolve

One concern per module:

- ``compose``: Hydra composition (``compose_config``), reading and writing a resolved ``config.yaml``
  (``load_config_file``, ``to_yaml``), Hydra's and OmegaConf's errors folded into one line; the ``model``
  section as the selected family's settings class (``ppctl.model.family``).
- ``init_from``: a Hugging Face folder as the model preset (``model.init_from=DIR`` alone).
- ``validate``: the rules that span several settings (``validate``, ``DerivedSizes``), each family's own
  asked through its ``ModelFamily``.
- ``resolved``: ``resolve(config)``, the ``ResolvedConfig`` every command and worker builds once and passes
  down (layout, schedule, split, layer map, model, sizes); the config is frozen from then on. It asks the
  planner's balancer and memory model (``parallel.balance=auto``), so this package does not re-export it.
- ``reference``: the key table of docs/configuration.md, generated from the schema and every family's settings
  (``python -m ppctl.resolve`` prints it).

The schema it builds on is ``ppctl.config``, below the model. All of it is pure: no torch, no process started,
no process group touched.
"""

from ppctl.resolve.compose import PACKAGE_CONF_DIR, compose_config, load_config_file, to_yaml
from ppctl.resolve.reference import config_reference, config_reference_table, render_default
from ppctl.resolve.validate import DerivedSizes, parse_fault, validate, validate_data

__all__ = [
    "DerivedSizes", "PACKAGE_CONF_DIR", "compose_config", "config_reference", "config_reference_table",
    "load_config_file", "parse_fault", "render_default", "to_yaml", "validate", "validate_data",
]
