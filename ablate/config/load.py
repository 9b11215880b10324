"""The config boundary: YAML or dicts in, typed ``SweepConfig`` / ``LaneConfig`` out, or a ``ConfigError``.

Every error names the full key path, the offending value and what is allowed, and is raised before any trial
starts. OmegaConf does the type checking; its exceptions are translated here so users never see a stack of
OmegaConf internals.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from ablate.config.features import FEATURES, feature
from ablate.config.schema import ConfigError, LaneConfig, SweepConfig

T = TypeVar("T")


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "missing file", "a path to an existing YAML file")
    try:
        return YAML(typ="safe").load(path.read_text())
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path} ({where})", problem, "well-formed YAML") from None


def _field_type(schema: Any, full_key: str) -> Any:
    """The annotated type of a dotted key inside a dataclass schema (None when the path leaves the schema)."""
    node: Any = schema
    for part in [p for p in full_key.split(".") if p]:
        if typing.get_origin(node) is dict:
            node = typing.get_args(node)[1]
            continue
        if not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = hints[part]
    return node


def _allowed_for(schema: Any, full_key: str) -> str:
    ref_type = _field_type(schema, full_key)
    if typing.get_origin(ref_type) is typing.Union:
        ref_type = next(a for a in typing.get_args(ref_type) if a is not type(None))
    if isinstance(ref_type, type) and issubclass(ref_type, enum.Enum):
        return "one of " + ", ".join(m.value for m in ref_type)
    if ref_type is None:
        return "see the schema in ablate/config/schema.py"
    if typing.get_origin(ref_type) is list:
        return "a non-empty list of candidate values"
    name = getattr(ref_type, "__name__", None) or str(ref_type).replace("typing.", "")
    return f"a value of type {name}"


def _known_keys(schema: Any, full_key: str) -> str:
    parent_key = full_key.rpartition(".")[0]
    node = OmegaConf.select(OmegaConf.structured(schema), parent_key) if parent_key else OmegaConf.structured(schema)
    try:
        return "known keys: " + ", ".join(sorted(str(k) for k in node.keys()))
    except Exception:  # noqa: BLE001
        return "a key defined in the schema"


def structured(schema: type[T], data: Any, prefix: str = "") -> T:
    """Merge ``data`` onto the dataclass ``schema`` and return the typed object, or raise ``ConfigError``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix or "<root>", data, f"a mapping of {schema.__name__} keys")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), data)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "")
        full = f"{prefix}{key}" if key else (prefix.rstrip(".") or "<root>")
        value = _lookup(data, key)
        if isinstance(exc, ConfigKeyError):
            allowed = _known_keys(schema, key)
        else:
            allowed = _allowed_for(schema, key)
        raise ConfigError(full, value, allowed) from None
    except ValueError as exc:
        raise ConfigError(prefix.rstrip(".") or "<root>", data, str(exc)) from None


def _lookup(data: Any, dotted: str) -> Any:
    node = data
    for part in [p for p in dotted.split(".") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


# --- defaults.yaml ---


@dataclass
class Defaults:
    """The current defaults: feature name -> value, plus the path they came from."""

    values: dict[str, Any]
    path: Optional[Path] = None
    raw: dict[str, Any] = field(default_factory=dict)


def load_defaults(path: str | Path) -> Defaults:
    data = read_yaml(path) or {}
    entries = data.get("features") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ConfigError(f"{path}: features", entries, "a mapping of feature name -> {value: ..., kind: ...}")
    values: dict[str, Any] = {}
    for name, entry in entries.items():
        spec = feature(str(name), key=f"{path}: features")
        if not isinstance(entry, dict) or "value" not in entry:
            raise ConfigError(f"{path}: features.{name}", entry, "a mapping with a 'value' key")
        if entry.get("kind", spec.kind) != spec.kind:
            raise ConfigError(f"{path}: features.{name}.kind", entry.get("kind"), f"{spec.kind} (from the registry)")
        if spec.kind == "tax" and str(entry["value"]) not in ("off", "False", "false"):
            raise ConfigError(f"{path}: features.{name}.value", entry["value"], "off: taxes stay opt-in")
        values[str(name)] = entry["value"]
    return Defaults(values=values, path=Path(path), raw=data)


# --- lanes and features ---


def lane_to_dict(lane: LaneConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(lane), enum_to_str=True)  # type: ignore[return-value]


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def with_feature(lane: LaneConfig, name: str, value: Any, key: str = "features") -> LaneConfig:
    """The lane with one feature set to ``value``; an unknown feature or a disallowed value raises."""
    spec = feature(name, key=key)
    data = lane_to_dict(lane)
    node = data
    parts = spec.path.split(".")
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value
    try:
        return structured(LaneConfig, data, prefix="lane.")
    except ConfigError as exc:
        raise ConfigError(f"{key}.{name}", value, f"{exc.allowed} (for lane.{spec.path})") from None


def apply_defaults(lane: LaneConfig, defaults: Defaults, explicit: dict[str, Any]) -> LaneConfig:
    """Defaults give every feature its baseline value unless the sweep's lane sets that field explicitly."""
    flat_explicit = flatten(explicit or {})
    for name, value in defaults.values.items():
        if FEATURES[name].path not in flat_explicit:
            lane = with_feature(lane, name, value, key=f"{defaults.path}: features")
    return lane


def load_sweep(path: str | Path) -> tuple[SweepConfig, Defaults]:
    """Read a campaign file, type it, put the defaults under its lane, and validate every planned arm."""
    path = Path(path)
    data = read_yaml(path)
    sweep = structured(SweepConfig, data)
    defaults_path = Path(sweep.defaults)
    if not defaults_path.is_absolute():
        defaults_path = path.parent / defaults_path
    defaults = load_defaults(defaults_path)
    explicit_lane = (data or {}).get("lane") or {}
    sweep.lane = apply_defaults(sweep.lane, defaults, explicit_lane)
    validate_features(sweep)
    return sweep, defaults


def validate_features(sweep: SweepConfig) -> None:
    """Each tested value must be allowed, differ from the baseline, and be able to act in the lane."""
    for name, values in sweep.features.items():
        spec = feature(name)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"features.{name}", values, "a non-empty list of candidate values")
        baseline = spec.get(sweep.lane)
        for value in values:
            candidate_lane = with_feature(sweep.lane, name, value)
            if spec.get(candidate_lane) == baseline:
                raise ConfigError(f"features.{name}", value,
                                  f"a value different from the baseline {baseline!r} (defaults + lane)")
            inert = spec.inert_reason(candidate_lane)
            if inert:
                raise ConfigError(f"features.{name}", value, f"a toggle that can act in this lane; it is inert: "
                                                             f"{inert}")


def load_lane(data: dict[str, Any]) -> LaneConfig:
    return structured(LaneConfig, data, prefix="lane.")
