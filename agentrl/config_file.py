"""`--config FILE`: a YAML or JSON file of `section.field` values, read and checked as `--set`
checks them (one line naming the file, the key, the value and the fix)."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, RunConfig, set_field


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """`--config FILE`: its values by `section.field` key, set as `--set` sets them."""

    path: str
    values: dict[str, Any]

    def apply(self, cfg: RunConfig) -> None:
        for key, value in self.values.items():
            try:
                set_field(cfg, key, value)
            except ConfigError as e:
                raise ConfigError(f"--config {self.path}: {e}") from None


def read_config_file(path: str) -> ConfigFile:
    """A YAML (.yaml, .yml) or JSON file holding a mapping of `section.field: value` keys, or of
    sections of fields (`train: {lr: 1e-6}`), or both; a run's run_config.json is one."""
    values: dict[str, Any] = {}
    for key, value in _read_mapping(path).items():
        if "." in str(key):
            values[str(key)] = value
        elif isinstance(value, dict):
            values.update({f"{key}.{name}": v for name, v in value.items()})
        else:
            raise ConfigError(f"--config {path}: {key}: {value!r} {_needs_section(str(key))}")
    return ConfigFile(path, values)


def _needs_section(name: str) -> str:
    """How a bare field name in a config file is fixed: the section(s) that have it."""
    sections = typing.get_type_hints(RunConfig).items()
    owners = [f"{s}.{name}" for s, hint in sections if name in hint.__dataclass_fields__]
    where = f"write {' or '.join(owners)}" if owners else "write section.field, e.g. train.lr"
    return f"has no section: {where}, or nest it under its section"


def _read_mapping(path: str) -> dict[Any, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError(f"--config {path}: {why}; pass a YAML or JSON file") from None
    is_yaml = Path(path).suffix.lower() in (".yaml", ".yml")
    data = _parse_yaml(path, text) if is_yaml else _parse_json(path, text)
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: holds a {type(data).__name__}, not a mapping; write "
            "section.field: value lines, e.g. train.lr: 1e-6"
        )
    return data


def _parse_json(path: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--config {path}: not JSON ({e.msg} at line {e.lineno}); fix it, or write YAML in "
            "a file named .yaml"
        ) from None


def _parse_yaml(path: str, text: str) -> Any:
    try:
        import yaml  # transformers installs PyYAML, but agentrl does not depend on it itself
    except ImportError:
        raise ConfigError(
            f"--config {path}: reading YAML needs PyYAML; pip install pyyaml, or write the "
            "file as JSON"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"--config {path}: not YAML ({problem}{where}); fix it") from None
