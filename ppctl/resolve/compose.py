"""Composition: Hydra builds a typed ``PpctlConfig`` from ppctl's config groups, a user's tree and overrides.

``compose_config`` composes (the schema registered in Hydra's ConfigStore refuses unknown keys and
wrong types; its ``model`` section holds every installed family's keys, and the composed ``config.model`` is
the selected family's own class: ``ppctl.model.family.family_settings``); ``load_config_file`` and ``to_yaml``
read and write a resolved ``config.yaml`` (one written before the family keys had their own classes reads the
same way: another family's keys at their defaults are dropped). Hydra's
and OmegaConf's errors are folded into one ``ConfigError`` line; YAML syntax errors name the file, the
line and the column, and an override that does not parse names itself and the column.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
from typing import Any

from ppctl.config.derived import fill_unset
from ppctl.resolve.init_from import folder_preset_of, stored_folder_preset
from ppctl.config.schema import SCHEMA_GROUPS, ConfigError, PpctlConfig
from ppctl.fileio import exception_in_chain
from ppctl.model.family import family_settings, settings_schema

PACKAGE_CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # ppctl/conf: ppctl's config groups

PRIMARY_CONFIG = "config"  # the primary config's name, ppctl's and a user tree's by default
PACKAGE_PRIMARY = "ppctl_config"  # ppctl's primary config, also kept in Hydra's ConfigStore under this name


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    store.store(name="ppctl_schema", node=composition_schema())
    for group, node in {**SCHEMA_GROUPS, "model": settings_schema()}.items():
        store.store(group=group, name=f"{group}_schema", node=node)
    # A user tree without a primary config composes on ppctl's. Hydra looks the primary up before it adds
    # ppctl's folder to the search path (and remembers that it found none), but the ConfigStore is searched from
    # the start; its group defaults are still looked up in the user's tree first.
    store.store(name=PACKAGE_PRIMARY, node=OmegaConf.load(PACKAGE_CONF_DIR / f"{PRIMARY_CONFIG}.yaml"))


def compose_config(
    overrides: list[str] | None = None,
    config_dir: str | os.PathLike | None = None,
    config_name: str = "config",
) -> PpctlConfig:
    """Compose the Hydra config with ``overrides`` into a typed ``PpctlConfig``.

    ``config_dir`` is a user's own config tree; ppctl's groups stay on the search path
    behind it, so a user tree may hold only what it changes (one group file is enough:
    without a ``config.yaml`` of its own it composes on ppctl's). Raises ``ConfigError``
    with one line for unknown keys, bad types, missing files and YAML or override syntax
    errors (those name the file or the override, the line and the column).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    _register_schema()
    primary = Path(config_dir).resolve() if config_dir else PACKAGE_CONF_DIR
    if not primary.is_dir():
        raise ConfigError(f"--config-dir {config_dir}: no such directory")
    name = primary_config_name(primary, config_dir, config_name)
    extra = [f"hydra.searchpath=[file://{PACKAGE_CONF_DIR}]"] if config_dir else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(primary), version_base=None):
            composed = _compose_with_folder(name, list(overrides or []), extra)
        return _typed(_without_hydra(composed))
    except ConfigError:
        raise
    except Exception as error:  # Hydra and OmegaConf errors are many classes; report one line
        raise ConfigError(_one_line(error)) from None
    finally:
        GlobalHydra.instance().clear()


def _compose_with_folder(name: str, overrides: list[str], extra: list[str]) -> Any:
    """Hydra's composition of config ``name`` with ``overrides`` (and ``extra``, ppctl's own); where it names a
    Hugging Face folder (``model.init_from``) and keeps ppctl's default model preset, composed again with the
    folder's settings in that preset's place (``ppctl.resolve.init_from``)."""
    from hydra import compose

    composed = compose(config_name=name, overrides=overrides + extra, return_hydra_config=True)
    node = folder_preset_of(composed, overrides, PACKAGE_CONF_DIR / f"{PRIMARY_CONFIG}.yaml")
    if node is None:
        return composed
    with stored_folder_preset(node) as chosen:
        return compose(config_name=name, overrides=overrides + [chosen] + extra, return_hydra_config=True)


@functools.cache  # the installed families do not change while ppctl runs
def composition_schema() -> type:
    """``PpctlConfig`` with a ``model`` section that accepts every installed family's keys (``settings_schema``)."""
    model = settings_schema()
    return dataclasses.make_dataclass("PpctlSchema", [("model", model, dataclasses.field(default_factory=model))],
                                      bases=(PpctlConfig,))


def _typed(tree: Any) -> PpctlConfig:
    """A composed or loaded tree (OmegaConf) as a typed ``PpctlConfig`` whose ``model`` is its family's class,
    with the unset settings that follow another part filled. ``ConfigError`` for an unknown key or family, a wrong
    type, or another family's key set."""
    from omegaconf import OmegaConf

    schema_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(composition_schema()), tree))
    sections = {item.name: getattr(schema_config, item.name) for item in dataclasses.fields(PpctlConfig)}
    config = PpctlConfig(**{**sections, "model": family_settings(schema_config.model)})
    fill_unset(config)
    return config


def _without_hydra(composed: Any) -> Any:
    from omegaconf import OmegaConf, open_dict

    with open_dict(composed):
        composed.pop("hydra", None)
    return OmegaConf.create(OmegaConf.to_container(composed, resolve=True))


def primary_config_name(primary: Path, config_dir: str | os.PathLike | None, config_name: str) -> str:
    """The primary config to compose: ``config_name`` from ``primary``, or ppctl's own when a user tree has no
    ``config.yaml`` (and no other name was asked for); ``ConfigError`` when the asked-for file is missing."""
    file = primary / f"{config_name.removesuffix('.yaml')}.yaml"
    if file.is_file():
        return config_name
    if config_dir is not None and config_name.removesuffix(".yaml") == PRIMARY_CONFIG:
        return PACKAGE_PRIMARY
    where = f"--config-dir {config_dir}" if config_dir is not None else f"ppctl's configs ({primary})"
    raise ConfigError(f"--config-name {config_name}: no {file.name} in {where}")


def _one_line(error: BaseException) -> str:
    """Fold a Hydra/OmegaConf error (often several lines, often chained) into one line.

    A YAML syntax error names its file, line and column; an override that does not parse names
    itself and the column; a cause that only repeats the error is said once.
    """
    located = _yaml_problem(error) or _override_problem(error)
    if located is not None:
        return located
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    if "Available options" in str(error):
        options = [line for line in lines[1:] if not line.endswith(":") and "_schema" not in line]
        options = options[: next((i for i, line in enumerate(options) if "=" in line), len(options))]
        return f"{text.rstrip('.:')}; available: {', '.join(options)}"
    # Hydra's wrapper names OmegaConf's exception class; the cause says what is wrong in plain words.
    text = re.sub(r":?\s*\w+ raised while composing config:?", ":", text)
    cause = error.__cause__ or error.__context__
    cause_line = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    # OmegaConf chains a key error to its own copy, and Hydra repeats a parse error's message in its cause.
    if cause_line and cause_line not in text:
        text = f"{text.rstrip('.:')}: {cause_line}"
    return text.rstrip(":")


def _yaml_problem(error: BaseException) -> str | None:
    """``FILE, line L, column C: invalid YAML: ...`` for a YAML syntax error in ``error``'s chain, else None."""
    import yaml

    found = exception_in_chain(error, yaml.MarkedYAMLError)
    if found is None:
        return None
    mark = found.problem_mark or found.context_mark
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    text = f"{where}: invalid YAML: {found.problem or found.context}"
    opened = found.context_mark
    if found.problem and found.context and opened is not None and opened is not mark:
        # e.g. "while parsing a flow sequence" that began further up: say where, it is what to fix
        text += f" ({found.context} that begins at line {opened.line + 1}, column {opened.column + 1})"
    return text


OVERRIDE_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def _override_problem(error: BaseException) -> str | None:
    """``override TEXT: cannot parse it at column C: ...`` for an override Hydra's grammar refused, else None."""
    from hydra.errors import OverrideParseException

    found = exception_in_chain(error, OverrideParseException)
    if found is None:
        return None
    text = found.override
    located = override_syntax_error(text)
    if located is None:  # the grammar accepted it; Hydra refused it while reading the value
        reason = next((line.strip() for line in found.message.splitlines() if line.strip()), "")
        return f"override {text}: {reason}"
    column, reason = located
    at = f"column {column + 1}" + (" (its end)" if column >= len(text) else "")
    return f"override {text}: cannot parse it at {at}: {reason} (the override grammar: {OVERRIDE_GRAMMAR})"


def override_syntax_error(text: str) -> tuple[int, str] | None:
    """Where Hydra's override grammar first fails on ``text``: (0-based column, the parser's words), or None.

    Hydra's own error keeps the parser's words but drops the column, so the override is parsed
    again here with a listener that keeps both.
    """
    try:
        from antlr4 import CommonTokenStream, InputStream
        from antlr4.error.ErrorListener import ErrorListener
        from hydra.grammar.gen.OverrideLexer import OverrideLexer
        from hydra.grammar.gen.OverrideParser import OverrideParser
    except ImportError:  # another Hydra layout: the message goes without a column
        return None

    class SyntaxFound(Exception):
        pass

    class Listener(ErrorListener):
        def syntaxError(self, recognizer, offending_symbol, line, column, msg, e):
            raise SyntaxFound(column, msg)

    lexer = OverrideLexer(InputStream(text))
    parser = OverrideParser(CommonTokenStream(lexer))
    for stage in (lexer, parser):
        stage.removeErrorListeners()
        stage.addErrorListener(Listener())
    try:
        parser.override()
    except SyntaxFound as found:
        return found.args[0], found.args[1]
    except Exception:  # this runs while reporting another error: never let it hide that one
        return None
    return None


def to_yaml(config: PpctlConfig) -> str:
    """The resolved config as YAML (saved as ``config.yaml`` in each run directory)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(config))


def load_config_file(path: str | os.PathLike) -> PpctlConfig:
    """Read a resolved ``config.yaml`` back into a typed ``PpctlConfig``."""
    from omegaconf import OmegaConf

    return _typed(OmegaConf.load(path))
