"""The key reference: every schema field with its default and meaning, as the markdown table of
docs/configuration.md (between its markers; ``tests/unit/test_config_defaults.py`` checks that the two
agree). ``python -m ppctl.resolve`` prints the table to paste there. A family's own ``model.*`` keys
(``ppctl.model.family``) follow the shared ones, each meaning led by the families that read it.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from ppctl.config.schema import PpctlConfig
from ppctl.model.family import family_own_keys


def render_default(value: Any) -> str:
    """A default as docs/configuration.md shows it: ``null``, ``true``/``false``, numbers as written, strings in
    backticks."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value))  # 1e-05 -> 1e-5
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def config_reference() -> list[tuple[str, Any, str]]:
    """``(section.key, default, meaning)`` for every schema field, in schema order (a nested section's keys,
    such as ``launcher.slurm.*``, where that section stands)."""
    rows = []
    for section in fields(PpctlConfig):
        rows += _section_rows(section.name, section.default_factory)
        if section.name == "model":
            rows += [(f"model.{item.name}", item.default, f"{', '.join(f'`{name}`' for name in readers)}: "
                      f"{item.metadata['doc']}") for item, readers in family_own_keys()]
    return rows


def _section_rows(prefix: str, section: type) -> list[tuple[str, Any, str]]:
    rows = []
    for item in fields(section):
        if is_dataclass(item.default_factory):
            rows += _section_rows(f"{prefix}.{item.name}", item.default_factory)
            continue
        default = item.default if item.default is not MISSING else item.default_factory()
        rows.append((f"{prefix}.{item.name}", default, item.metadata["doc"]))
    return rows


def config_reference_table() -> str:
    """The markdown table ``| key | default | meaning |`` of every field (docs/configuration.md's, between its
    markers)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in config_reference():
        meaning = doc.replace("|", r"\|")  # a pipe inside a cell would split it
        lines.append(f"| `{key}` | {render_default(default)} | {meaning} |")
    return "\n".join(lines) + "\n"
