"""``python -m ppctl.config``: print the key table to paste into docs/configuration.md (between its markers)."""

from ppctl.config.reference import config_reference_table

print(config_reference_table(), end="")
