"""``python -m ppctl.resolve``: print the key table to paste into docs/configuration.md (between its markers)."""

from ppctl.resolve.reference import config_reference_table

print(config_reference_table(), end="")
