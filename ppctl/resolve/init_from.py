"""A Hugging Face folder as the model preset: ``model.init_from=DIR`` alone gives the folder's model.

Where the model group holds ppctl's default preset (``gpt_tiny``: no ``model=...`` on the command line, and a
config tree that chooses no other), composition puts in that preset's place the ``model.*`` settings the folder's
``config.json`` gives (read as ``ppctl generate`` reads them: ``ppctl.model.hf_format.folder_model``), with
``model.name`` the folder's name and, when the folder holds a readable ``tokenizer.json``, ``data.tokenizer`` naming
it (a folder without one keeps the schema's default, ``byte``). What
is composed after a group's preset (a config file's own keys, the command line's overrides) stays as it was set, and
validation checks it against the folder (``init_from_problem``, ``init_from_tokenizer_problem``): a key that agrees
is accepted, one that does not is refused in one line naming both values. A preset chosen explicitly
(``model=llama_tiny``) gives every model key itself and is checked the same way; so is a config that chooses no
preset at all (a run directory's ``config.yaml``, which holds the resolved shape: resuming from it reads no folder).
A run that resumes from a checkpoint reads no folder either: one that is gone gives nothing, and the checkpoint's
recorded settings are checked against the config as composed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from ppctl.config.schema import ConfigError

MODEL_GROUP = "model"
FOLDER_PRESET = "init_from_folder"  # the model group's option that holds a folder's settings while composing


def folder_preset_of(composed: Any, overrides: list[str], primary_config: Path) -> dict | None:
    """The config node that stands for the folder ``model.init_from`` names in a first composition ``composed`` (a
    Hydra config with its ``hydra`` node), in the model preset's place; None where no folder is named, or the model
    group's choice is not the one ppctl's ``primary_config`` makes, or the command line names the group
    (``model=...``)."""
    from omegaconf import OmegaConf

    folder = OmegaConf.select(composed, "model.init_from")
    if not folder or _names_model_group(overrides):
        return None
    choice = composed.hydra.runtime.choices.get(MODEL_GROUP)
    if choice is None or choice != default_model_preset(primary_config):
        return None
    folder = Path(folder).expanduser().resolve()
    resumes = starts_from_a_checkpoint(*(OmegaConf.select(composed, f"trainer.{key}")
                                         for key in ("resume_from", "auto_resume", "out_dir")))
    if resumes and not folder.is_dir():
        return None  # a resume reads its checkpoint, whose recorded settings are checked against the config
    return folder_preset(folder)


def _names_model_group(overrides: list[str]) -> bool:
    """Whether one of the command line's ``overrides`` chooses the model group's option (``model=llama_tiny``,
    ``+model=...``, ``~model``), rather than setting one of its keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return any(override.key_or_group == MODEL_GROUP for override in OverridesParser.create().parse_overrides(overrides))


def folder_preset(folder: Path) -> dict:
    """The settings of HF ``folder`` as a config node at the root: ``model.*`` (a dotted key such as ``moe.topk`` in
    its section), ``model.name`` the folder's name, and ``data.tokenizer`` its ``tokenizer.json`` where it has a
    readable one (none: the schema's default stays); ``ConfigError`` naming ``model.init_from`` for a folder that
    cannot be read."""
    from ppctl.model.hf_format import HFError, folder_model

    try:
        _family, _hf_config, settings = folder_model(folder)
    except HFError as error:
        raise ConfigError(f"model.init_from={folder}: {error}") from None
    model: dict[str, Any] = {"name": folder.name}
    for key, value in settings.items():
        section, _, name = key.rpartition(".")
        (model.setdefault(section, {}) if section else model)[name] = value
    node: dict[str, Any] = {MODEL_GROUP: model}
    tokenizer = readable_folder_tokenizer(folder)
    if tokenizer is not None:
        node["data"] = {"tokenizer": tokenizer}
    return node


def readable_folder_tokenizer(folder: Path) -> str | None:
    """The path of ``folder``'s ``tokenizer.json`` when it is a readable ``tokenizers`` file; None when it has none,
    or one validation refuses naming the folder (``init_from_tokenizer_problem``: not a regular file, no tokenizer)."""
    from ppctl.data.tokenizer import FOLDER_TOKENIZER, folder_tokenizer

    try:
        found = folder_tokenizer(folder)
    except ValueError:
        return None
    return None if found is None else str(folder / FOLDER_TOKENIZER)


@contextlib.contextmanager
def stored_folder_preset(node: dict) -> Iterator[str]:
    """Within the block, ``node`` is the model group's option ``FOLDER_PRESET`` in Hydra's ConfigStore (its keys at
    the root: the model's and the tokenizer); yields the override that chooses it. It is removed after, so no other
    composition can choose it."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group=MODEL_GROUP, name=FOLDER_PRESET, node=node, package="_global_")
    try:
        yield f"{MODEL_GROUP}={FOLDER_PRESET}"
    finally:
        store.repo.get(MODEL_GROUP, {}).pop(f"{FOLDER_PRESET}.yaml", None)


def starts_from_a_checkpoint(resume_from: str | None, auto_resume: bool | None, out_dir: str | None) -> bool:
    """Whether a run of these ``trainer.*`` settings reads a checkpoint rather than ``model.init_from``:
    ``trainer.resume_from``, or ``trainer.auto_resume`` with a ``latest`` checkpoint in its run directory
    ``trainer.out_dir`` (a requeued job, whose ``config.yaml`` holds the folder's shape). The resume point verifies
    that checkpoint."""
    if resume_from:
        return True
    if not auto_resume or not out_dir:
        return False
    from ppctl.checkpoint.files import CheckpointError, latest_checkpoint

    try:
        return latest_checkpoint(Path(out_dir)) is not None
    except (CheckpointError, OSError):  # the resume point says what is wrong with it
        return False


def default_model_preset(primary_config: Path) -> str | None:
    """The model group's option that ppctl's primary config (``primary_config``) chooses by default."""
    from omegaconf import OmegaConf

    for entry in OmegaConf.load(primary_config).get("defaults", []):
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            if MODEL_GROUP in entry:
                return entry[MODEL_GROUP]
    return None
