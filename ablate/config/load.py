"""The config boundary: YAML or dicts in, typed ``SweepConfig`` / ``LaneConfig`` out, or a ``ConfigError``.

Every error names the full key path, the offending value and what is allowed, and is raised before any trial
starts. OmegaConf does the type checking; its exceptions are translated here so users never see a stack of
OmegaConf internals.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import glob
import json
import logging
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import MappingNode, SequenceNode

from ablate.config import auto_device
from ablate.config.features import FEATURES, feature
from ablate.config.lane_shape import AUTO, lane_shape
from ablate.config.schema import ConfigError, LaneConfig, SweepConfig

log = logging.getLogger(__name__)

T = TypeVar("T")


MAX_ALIAS_NODES = 10_000
"""How many nodes the aliases (``*name``) of one YAML document may add when expanded. A campaign or policy that
reuses a lane block a few times stays far below; a 300-byte "billion laughs" document expands to ~10^9 nodes,
which the typing below would walk one by one (it stalled ``validate`` for 17 s and more)."""


def _children(node: Any) -> list[Any]:
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def _check_aliases(root: Any, where: str) -> None:
    """Refuse a composed document whose aliases expand beyond ``MAX_ALIAS_NODES`` extra nodes, or into themselves.

    The composer already shares one node object per anchor, so the expanded size is counted on the small graph
    (memoised by node identity, iteratively so deep nesting cannot overflow the stack): nothing is expanded.
    Aliases are bounded rather than banned: anchors are the YAML way to reuse a lane block in a campaign.
    """
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            size[key] = 1 + sum(size[id(child)] for child in _children(node))
            open_nodes.discard(key)
            continue
        if key in size:
            continue
        if key in open_nodes:  # reached again from inside itself: `&a [*a]`
            raise ConfigError(where, f"alias *{getattr(node, 'anchor', None) or '?'} refers to itself",
                              "YAML without recursive aliases")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))
    added = size[id(root)] - len(size)
    if added > MAX_ALIAS_NODES:
        raise ConfigError(where, f"aliases that expand to {added:,} extra nodes",
                          f"YAML whose aliases (*name) add at most {MAX_ALIAS_NODES:,} nodes when expanded "
                          f"(an alias bomb is refused before it is typed)")


def read_yaml(path: str | Path) -> Any:
    """The parsed YAML document at ``path``; every problem (missing file, not UTF-8, malformed YAML, an alias
    bomb) is a ``ConfigError`` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "missing file", "a path to an existing YAML file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), f"unreadable ({exc.strerror or exc})", "a readable YAML file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"byte {data[exc.start:exc.start + 1]!r} at offset {exc.start}",
                          "UTF-8 text (YAML files are UTF-8)") from None
    try:
        root = YAML(typ="safe").compose(text)
        if root is None:
            return None
        _check_aliases(root, str(path))
        return YAML(typ="safe").load(text)
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path} ({where})", problem, "well-formed YAML") from None
    except RecursionError:
        raise ConfigError(str(path), "nesting too deep to read", "YAML nested a few levels deep") from None


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


@functools.lru_cache(maxsize=None)
def _schema_node(schema: type) -> Any:
    # Building the node from the dataclass is half of a lane's load (~10 ms; checking one feature value builds a
    # whole lane); merge copies its first argument, so the cached node is never changed.
    return OmegaConf.structured(schema)


def structured(schema: type[T], data: Any, prefix: str = "") -> T:
    """Merge ``data`` onto the dataclass ``schema`` and return the typed object, or raise ``ConfigError``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix or "<root>", data, f"a mapping of {schema.__name__} keys")
    try:
        merged = OmegaConf.merge(_schema_node(schema), data)
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

_SHAPE = re.compile(r"^shape-[0-9a-f]{12}$")


def reference_value(name: str) -> Any:
    """The registry's reference for feature ``name``: its typed lane field's default, what a lane runs when neither
    defaults.yaml nor its campaign sets it (None for a name the registry does not know)."""
    spec = FEATURES.get(name)
    return None if spec is None else spec.get(LaneConfig())


@dataclass(frozen=True)
class LaneOverride:
    """A value promoted for one lane shape only: that lane's baseline runs it instead of the global value."""

    lane_shape: str
    value: Any
    report: Optional[str] = None


@dataclass
class Defaults:
    """The current defaults: global values, per-lane overrides, and the path they came from.

    ``values`` holds the global value of every feature in the file; ``effective(flat_lane)`` is what one lane
    runs (its override where ``lane_overrides`` has one for the lane's shape, else the global value).
    """

    values: dict[str, Any]
    path: Optional[Path] = None
    raw: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, dict[str, LaneOverride]] = field(default_factory=dict)
    """Feature -> lane shape -> override."""

    def for_shape(self, shape: str) -> dict[str, Any]:
        """Feature -> value for the lane whose ``lane_shape`` is ``shape``."""
        effective = dict(self.values)
        for name, by_shape in self.overrides.items():
            if shape in by_shape:
                effective[name] = by_shape[shape].value
        return effective

    def lane_default(self, name: str, shape: str) -> Any:
        """What a lane of ``shape`` runs for feature ``name`` when its campaign pins nothing: its override, else the
        file's global value, else the registry's reference (the typed lane field's default; None for a name the
        registry does not know)."""
        effective = self.for_shape(shape)
        if name in effective:
            return effective[name]
        return reference_value(name)

    def effective(self, flat_lane: Mapping[str, Any], device: Optional[str] = None) -> dict[str, Any]:
        """Feature -> value for this lane (``flatten(lane_to_dict(lane))`` form, as receipts record it) on ``device``
        (what ``hardware.device: auto`` resolves to; ``ablate.config.lane_shape``)."""
        return self.for_shape(lane_shape(flat_lane, device))

    def moved_to(self, name: str, value: Any, shape: str) -> Optional[str]:
        """Why ``value`` is the lane's default because defaults.yaml moved it there, or None when it is not.

        "Moved" means a lane override, a global value other than the registry's reference, or a global value
        with a promotion recorded in its evidence. A campaign still listing such a value (it was promoted since
        the campaign was written) is skipped; testing the untouched reference against itself stays an error.
        """
        override = self.overrides.get(name, {}).get(shape)
        if override is not None:
            if str(override.value) != str(value):
                return None
            return f"lane override for {shape}" + (f" (report {override.report})" if override.report else "")
        if name not in self.values or str(self.values[name]) != str(value):
            return None
        entry = (self.raw.get("features") or {}).get(name) or {}
        reports = [str(r.get("report")) for r in entry.get("evidence") or []
                   if isinstance(r, Mapping) and str(r.get("value")) == str(value) and r.get("scope") == "global"]
        if reports:
            return f"global default since report {reports[-1]}"
        reference = reference_value(name)
        if str(reference) != str(value):
            return f"global default in {self.path or 'defaults.yaml'} (the reference is {reference!r})"
        return None


def _checked_value(name: str, value: Any, key: str) -> Any:
    """A defaults value must be one the lane field accepts: the loader refuses it here, not at sweep time."""
    allowed = _refusal(name, type(value), value) if type(value) in _SCALARS else _refusal_of(name, value)
    if allowed is not None:
        raise ConfigError(key, value, allowed)
    return value


_SCALARS = (str, int, float, bool, type(None))


@functools.lru_cache(maxsize=1024)
def _refusal(name: str, kind: type, value: Any) -> Optional[str]:
    # Whether a value fits its lane field depends on nothing else, and every promotion reads the defaults: typing the
    # reference lane through OmegaConf once per value was half of a small campaign's promotion (0.12 of 0.24 s).
    # Keyed on the type too: True == 1 == 1.0.
    return _refusal_of(name, value)


def _refusal_of(name: str, value: Any) -> Optional[str]:
    """What the lane field of feature ``name`` allows, when ``value`` is not one of those; else None."""
    try:
        default_lane_with(name, value)
    except ConfigError as exc:
        return exc.allowed
    return None


def _lane_overrides(name: str, entry: Mapping[str, Any], key: str, kind: str) -> dict[str, LaneOverride]:
    items = entry.get("lane_overrides")
    if items is None:
        return {}
    shape_form = "a list of {lane_shape: shape-<12 hex>, value: ..., report: ...} mappings"
    if not isinstance(items, list):
        raise ConfigError(f"{key}.lane_overrides", items, shape_form)
    found: dict[str, LaneOverride] = {}
    for index, item in enumerate(items):
        where = f"{key}.lane_overrides[{index}]"
        if not isinstance(item, Mapping) or "value" not in item:
            raise ConfigError(where, item, "a mapping with lane_shape and value keys")
        shape = item.get("lane_shape")
        if not isinstance(shape, str) or not _SHAPE.match(shape):
            # Overrides keyed by lane_key (written before lane shapes) never applied: the key changes as soon as
            # the override takes effect. Refuse them so nobody believes they do.
            raise ConfigError(f"{where}.lane_shape", shape, "a lane shape 'shape-<12 hex>' "
                                                            "(ablate.config.lane_shape.lane_shape of the lane)")
        if shape in found:
            raise ConfigError(f"{where}.lane_shape", shape, "one override per lane shape (this one is repeated)")
        value = _checked_value(name, item["value"], f"{where}.value")
        if kind == "tax" and str(value) not in ("off", "False", "false"):
            raise ConfigError(f"{where}.value", value, "off: taxes stay opt-in, in every lane")
        report = item.get("report")
        found[shape] = LaneOverride(lane_shape=shape, value=value, report=None if report is None else str(report))
    return found


def load_defaults(path: str | Path) -> Defaults:
    data = read_yaml(path) or {}
    entries = data.get("features") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise ConfigError(f"{path}: features", entries, "a mapping of feature name -> {value: ..., kind: ...}")
    values: dict[str, Any] = {}
    overrides: dict[str, dict[str, LaneOverride]] = {}
    for name, entry in entries.items():
        spec = feature(str(name), key=f"{path}: features")
        key = f"{path}: features.{name}"
        if not isinstance(entry, dict) or "value" not in entry:
            raise ConfigError(key, entry, "a mapping with a 'value' key")
        if entry.get("kind", spec.kind) != spec.kind:
            raise ConfigError(f"{key}.kind", entry.get("kind"), f"{spec.kind} (from the registry)")
        if spec.kind == "tax" and str(entry["value"]) not in ("off", "False", "false"):
            raise ConfigError(f"{key}.value", entry["value"], "off: taxes stay opt-in")
        values[str(name)] = _checked_value(str(name), entry["value"], f"{key}.value")
        lane_overrides = _lane_overrides(str(name), entry, key, spec.kind)
        if lane_overrides:
            overrides[str(name)] = lane_overrides
    return Defaults(values=values, path=Path(path), raw=data, overrides=overrides)


# --- lanes and features ---


_LANE_DICTS: dict[str, dict[str, Any]] = {}
_LANE_DICTS_MAX = 512


def lane_to_dict(lane: LaneConfig) -> dict[str, Any]:
    """The lane as plain data (enums as strings). Memoized by the lane's repr, which names every field and
    value, so a lane changed in place gets a new entry: planning and dispatching a 1,000-block campaign
    serialized its few distinct lanes through OmegaConf about four times per block (0.085 s a block)."""
    key = repr(lane)
    cached = _LANE_DICTS.get(key)
    if cached is None:
        if len(_LANE_DICTS) >= _LANE_DICTS_MAX:
            _LANE_DICTS.clear()
        cached = _LANE_DICTS[key] = OmegaConf.to_container(OmegaConf.structured(lane),  # type: ignore[assignment]
                                                           enum_to_str=True)
    return copy.deepcopy(cached)  # callers edit the dict they get


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
    return _lane_with(lane_to_dict(lane), name, value, key)


def default_lane_with(name: str, value: Any, key: str = "features") -> LaneConfig:
    """``with_feature(LaneConfig(), name, value, key)``, the same lane or the same error, from that one field merged
    onto the schema's defaults: merging a whole lane's dict took 3x as long (15 ms against 4 on the 2-core host),
    and checking a receipt's feature values builds one lane per distinct value."""
    return _lane_with({}, name, value, key)


def _lane_with(data: dict[str, Any], name: str, value: Any, key: str) -> LaneConfig:
    spec = feature(name, key=key)
    node = data
    parts = spec.path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    try:
        return structured(LaneConfig, data, prefix="lane.")
    except ConfigError as exc:
        raise ConfigError(f"{key}.{name}", value, f"{exc.allowed} (for lane.{spec.path})") from None


def flat_lane(lane: LaneConfig) -> dict[str, Any]:
    """The lane as dotted key -> value: the form receipts record and ``lane_shape`` hashes."""
    return flatten(lane_to_dict(lane))


def lane_shape_of(lane: LaneConfig, device: Optional[str] = None) -> str:
    """The shape a sweep of ``lane`` runs as: ``auto`` resolved to ``device``, by default the device the sweep plans
    for (``ablate.config.auto_device.planned_device``)."""
    return lane_shape(flat_lane(lane), device or auto_device.planned_device(lane))


def apply_defaults(lane: LaneConfig, defaults: Defaults, explicit: dict[str, Any],
                   device: Optional[str] = None) -> LaneConfig:
    """Defaults give every feature its baseline value unless the sweep's lane sets that field explicitly.

    The baseline is the lane's *effective* default: a lane override recorded for this lane's shape (``auto``
    resolved to ``device``, by default the planned one: ``lane_shape_of``) beats the global value, so a
    lane-scoped promotion is what the next campaign on that lane measures against.
    """
    flat_explicit = flatten(explicit or {})
    for name, value in defaults.for_shape(lane_shape_of(lane, device)).items():
        if FEATURES[name].path not in flat_explicit:
            lane = with_feature(lane, name, value, key=f"{defaults.path}: features")
    return lane


# The same resolution as trainers.data.resolve_text_files (which imports torch, so it cannot be used here); the
# relative path resolves against the working directory, as trainers.run resolves it for the arms.
_TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


def check_data_path(lane: LaneConfig) -> None:
    """A text lane's ``data.path`` must name at least one file now, on the machine that plans the sweep: an empty
    glob would otherwise fail every arm (each after its own start-up) instead of the campaign, once."""
    if lane.data.source.value != "text" or not lane.data.path:
        return
    candidate = Path(lane.data.path).expanduser()
    if candidate.is_file():
        return
    if candidate.is_dir():
        found = any(p.is_file() and p.suffix in _TEXT_SUFFIXES for p in candidate.rglob("*"))
    else:
        found = any(Path(p).is_file() for p in glob.iglob(str(candidate), recursive=True))
    if not found:
        raise ConfigError("lane.data.path", lane.data.path,
                          f"a file, a directory with {', '.join(_TEXT_SUFFIXES)} files, or a glob matching at least "
                          f"one file (relative paths start at {Path.cwd()})")


_WARNED: set[str] = set()
"""Lines already logged by this process: a sweep reads its campaign again to plan for the cluster's device, and an
``--until-decided`` invocation once per round; the same stale override is said once."""


def load_sweep(path: str | Path, device: Optional[str] = None) -> tuple[SweepConfig, Defaults]:
    """Read a campaign file, type it, put the defaults under its lane, and validate every planned arm. ``device``:
    the device class an ``auto`` lane runs on, whose lane overrides it gets (default: this machine's,
    ``ablate.config.auto_device.planned_device``)."""
    path = Path(path)
    data = read_yaml(path)
    if data is None or data == {}:
        # Typing an empty document would give a nameless A/A-only campaign called "sweep": surely a mistake.
        raise ConfigError(str(path), data, "a campaign mapping with at least a name (and the features to test); "
                                           "the file is empty")
    sweep = structured(SweepConfig, data)
    check_data_path(sweep.lane)
    defaults_path = Path(sweep.defaults)
    if not defaults_path.is_absolute():
        defaults_path = path.parent / defaults_path
    defaults = load_defaults(defaults_path)
    explicit_lane = (data or {}).get("lane") or {}
    sweep.lane = apply_defaults(sweep.lane, defaults, explicit_lane, device=device)
    for line in unresolved_overrides(sweep.lane, defaults):
        if line not in _WARNED:
            _WARNED.add(line)
            log.warning("%s", line)
    validate_features(sweep, defaults, explicit_lane, device)
    return sweep, defaults


def unresolved_overrides(lane: LaneConfig, defaults: Defaults) -> list[str]:
    """One line per lane override keyed by the shape of this ``auto`` lane as written (``device: auto``), as
    overrides were before they were keyed by the device they were won on: not applied, since nothing says on which
    device it was won (its evidence record in the file does: ``device_class``)."""
    if lane.hardware.device.value != AUTO:
        return []
    written = lane_shape(flat_lane(lane))
    where = defaults.path or "defaults.yaml"
    keys = ", ".join(f"{device}: {lane_shape_of(lane, device)}" for device in ("cpu", "cuda"))
    return [f"{where}: features.{name}.lane_overrides[{written}] ({by_shape[written].value!r}) is keyed by this "
            f"lane with hardware.device: auto and is not applied; key it by the lane on the device its evidence ran "
            f"on ({keys})" for name, by_shape in sorted(defaults.overrides.items()) if written in by_shape]


def already_default_reason(moved: Optional[str] = None) -> str:
    """The notice for a tested value that has become the lane's default (``Defaults.moved_to`` says how)."""
    how = f" ({moved})" if moved else ""
    return (f"already this lane's default{how}: nothing to compare it against; drop it from the campaign or "
            f"test another value")


def validate_features(sweep: SweepConfig, defaults: Optional[Defaults] = None,
                      explicit: Optional[dict[str, Any]] = None, device: Optional[str] = None
                      ) -> list[tuple[str, str]]:
    """Each tested value must be allowed and differ from the baseline.

    A value that is the baseline only because defaults.yaml moved it there (it was promoted after the campaign
    was written) is skipped, not refused; otherwise a promotion would break every campaign that tested it. A
    value that is inert in the lane (it provably runs the baseline's code here) is refused *before any arm runs*:
    ``plan_sweep`` leaves it out and records why, so the sweep, ``ablate validate`` and the promotion report show
    it instead of spending arms on it. Returns the default-collision skips as (what, why). ``device``: as for
    ``apply_defaults``.
    """
    pinned = set(flatten(explicit or {}))
    shape = lane_shape_of(sweep.lane, device)
    skipped: list[tuple[str, str]] = []
    for name, values in sweep.features.items():
        spec = feature(name)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"features.{name}", values, "a non-empty list of candidate values")
        baseline = spec.get(sweep.lane)
        seen: dict[str, Any] = {}
        for value in values:
            candidate_lane = with_feature(sweep.lane, name, value)
            typed = str(spec.get(candidate_lane))  # as the lane reads it: 100 and 100.0 are one value
            if typed in seen:
                same = "" if str(seen[typed]) == str(value) else f" (as {seen[typed]!r})"
                raise ConfigError(f"features.{name}", value, f"each candidate value once: it is already listed"
                                                             f"{same}, and a repeat would double its blocks")
            seen[typed] = value
            if spec.get(candidate_lane) == baseline:
                moved = None if defaults is None or spec.path in pinned else defaults.moved_to(name, value, shape)
                if moved is None:
                    raise ConfigError(f"features.{name}", value,
                                      f"a value different from the baseline {baseline!r} (defaults + lane)")
                skipped.append((f"{name}={value}", already_default_reason(moved)))
                continue
    return skipped


def load_lane(data: dict[str, Any]) -> LaneConfig:
    """The typed lane of ``data`` (a fresh object the caller may change). A mapping already read in this process
    is not merged again: every block of a campaign carries one of a few lane mappings, and a Tune trial process
    reads two per block (~18-26 ms each on 2 CPUs, ~0.2 ms as a copy of the one read before)."""
    try:
        key = json.dumps(data, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not plain JSON (a Path, an enum, NaN): merged as given, never memoized
        return structured(LaneConfig, data, prefix="lane.")
    return copy.deepcopy(_lane_of_json(key))


@functools.lru_cache(maxsize=64)
def _lane_of_json(key: str) -> LaneConfig:
    # Only lanes that loaded are kept: a ConfigError is raised again for the same mapping the next time.
    return structured(LaneConfig, json.loads(key), prefix="lane.")
