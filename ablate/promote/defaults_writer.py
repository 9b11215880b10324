"""What a promotion changes in ``search_spaces/defaults.yaml``, and the round-trip edit that writes it.

How to use: ``plan_changes(...)`` and ``find_revalidations(...)`` are pure and run inside ``promote``; the
result carries them, so the report shows exactly what ``write_defaults(result, path)`` will write. The edit
uses ruamel.yaml's round-trip mode, so comments, key order and quoting of untouched lines survive; each promoted
value gets an evidence record (report id, speedup and interval, blocks, hosts, lane key, software fingerprint,
date) and the conditions under which it must be revalidated. A value is flipped globally only when every lane
that measured the feature promoted the same value and none rejected it; otherwise the file records a lane-scoped
override and leaves the global value alone.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import SingleQuotedScalarString

from ablate.promote.analysis import PROMOTE, REJECT, FeatureVerdict
from ablate.promote.evidence import LaneState
from ablate.promote.policy import Policy

if TYPE_CHECKING:
    from ablate.promote.report import PromotionResult

REVALIDATE_WHEN = ["software_fingerprint_change", "lane_key_change"]
# Plain scalars that YAML 1.1 readers would not read back as strings: quote them like the file does ('off').
_AMBIGUOUS = re.compile(r"^(y|yes|n|no|on|off|true|false|null|~|[-+]?[0-9][0-9_.eE+-]*)$", re.IGNORECASE)


@dataclass
class DefaultsChange:
    feature: str
    old: Any
    new: Any
    scope: str
    """``global`` (the value flips) or ``lane`` (a lane override is recorded; the global value stays)."""
    lanes: list[str]
    evidence: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Revalidation:
    feature: str
    value: Any
    lane_key: str
    recorded_fingerprint: str
    current_fingerprint: str
    report: Optional[str]


def _round(x: Optional[float], digits: int = 4) -> Optional[float]:
    return None if x is None else round(float(x), digits)


def evidence_record(v: FeatureVerdict, *, report_id: str, campaign: str, date: str, policy: Policy,
                    scope: str) -> dict[str, Any]:
    return {
        "report": report_id, "campaign": campaign, "value": v.value, "previous": v.baseline_value, "scope": scope,
        "lane_key": v.lane_key, "lane_shape": v.lane_shape, "software_fingerprint": v.software_fingerprint,
        "speedup": _round(v.speedup), "ci95": [_round(x) for x in (v.ci95 or (None, None))],
        "lower_bound_holm": _round(v.lower_adj), "blocks": v.n_blocks, "hosts": v.n_hosts,
        "rounds": [r.round_id for r in v.rounds if r.counted], "bootstrap": v.bootstrap_unit,
        "policy": policy.ref, "date": date, "revalidate_when": list(REVALIDATE_WHEN),
    }


def plan_changes(verdicts: Iterable[FeatureVerdict], defaults: Mapping[str, Any], policy: Policy, *,
                 report_id: str, campaign: str, date: str) -> list[DefaultsChange]:
    by_feature: dict[str, list[FeatureVerdict]] = defaultdict(list)
    for v in verdicts:
        if v.kind == "speed":
            by_feature[v.feature].append(v)
    changes = []
    for feature, tests in sorted(by_feature.items()):
        promoted = [v for v in tests if v.verdict == PROMOTE]
        if not promoted:
            continue
        measured_lanes = {v.lane_key for v in tests}
        values = {str(v.value) for v in promoted}
        rejected_value = any(v.verdict == REJECT and str(v.value) in values for v in tests)
        every_lane = {v.lane_key for v in promoted} == measured_lanes
        flip = len(values) == 1 and not rejected_value and (every_lane or not policy.scope.global_requires_all_lanes)
        scope = "global" if flip else "lane"
        changes.append(DefaultsChange(
            feature=feature, old=defaults.get(feature, promoted[0].baseline_value),
            new=promoted[0].value if flip else None, scope=scope, lanes=sorted(v.lane_key for v in promoted),
            evidence=[evidence_record(v, report_id=report_id, campaign=campaign, date=date, policy=policy,
                                      scope=scope) for v in promoted]))
    return changes


def find_revalidations(defaults_raw: Mapping[str, Any], lanes: Mapping[str, LaneState]) -> list[Revalidation]:
    """Recorded evidence whose lane was measured again under another software fingerprint must be revalidated.

    "Its lane" is the recorded lane key, or any lane with the same shape (the lane key itself changes once
    the promoted value becomes the baseline); the most recently measured such lane gives the current software.
    """
    latest_by_shape: dict[str, LaneState] = {}
    for state in lanes.values():
        known = latest_by_shape.get(state.shape_key)
        if known is None or state.last_at > known.last_at:
            latest_by_shape[state.shape_key] = state
    found = []
    for feature, entry in (defaults_raw.get("features") or {}).items():
        if not isinstance(entry, Mapping):
            continue
        for record in entry.get("evidence") or []:
            if not isinstance(record, Mapping):
                continue
            state = lanes.get(record.get("lane_key")) or latest_by_shape.get(record.get("lane_shape"))
            if state is None or record.get("software_fingerprint") == state.current_fingerprint:
                continue
            if (record.get("revalidate") or {}).get("current_fingerprint") == state.current_fingerprint:
                continue  # already marked for this fingerprint
            found.append(Revalidation(feature=str(feature), value=record.get("value"),
                                      lane_key=str(record.get("lane_key")),
                                      recorded_fingerprint=str(record.get("software_fingerprint")),
                                      current_fingerprint=state.current_fingerprint, report=record.get("report")))
    return found


def _yaml() -> YAML:
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long comments or values
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def _node(value: Any) -> Any:
    """Plain data -> ruamel nodes: mappings in block style, short scalar lists in flow style."""
    if isinstance(value, Mapping):
        node = CommentedMap()
        for key, item in value.items():
            node[key] = _node(item)
        return node
    if isinstance(value, (list, tuple)):
        seq = CommentedSeq(_node(v) for v in value)
        if all(not isinstance(v, (Mapping, list, tuple)) for v in value):
            seq.fa.set_flow_style()
        return seq
    if isinstance(value, str) and _AMBIGUOUS.match(value):
        return SingleQuotedScalarString(value)
    return value


def _block_seq(entry: CommentedMap, key: str) -> CommentedSeq:
    # `evidence: []` is written in flow style; appending maps to it would give one unreadable line.
    existing = entry.get(key)
    seq = CommentedSeq(list(existing or []))
    seq.fa.set_block_style()
    entry[key] = seq
    return seq


def apply_to_document(doc: CommentedMap, result: "PromotionResult") -> list[str]:
    """Edit a loaded defaults document in place; returns one line per edit."""
    edits: list[str] = []
    features = doc.setdefault("features", CommentedMap())
    for change in result.changes:
        entry = features.get(change.feature)
        if entry is None:
            entry = features[change.feature] = _node({"value": change.old, "kind": "speed", "evidence": []})
        # Writing the same report twice (--write then --branch) must not duplicate anything.
        known = {(r.get("report"), r.get("lane_key")) for r in entry.get("evidence") or [] if isinstance(r, Mapping)}
        fresh = [r for r in change.evidence if (r["report"], r["lane_key"]) not in known]
        if not fresh:
            continue
        if change.scope == "global":
            if str(entry.get("value")) != str(change.new):
                entry["value"] = _node(change.new)
                edits.append(f"features.{change.feature}.value: {change.old!r} -> {change.new!r}")
        else:
            overrides = _block_seq(entry, "lane_overrides")
            for record in fresh:
                overrides.append(_node({"lane_key": record["lane_key"], "value": record["value"],
                                        "report": record["report"]}))
                edits.append(f"features.{change.feature}.lane_overrides += {record['value']!r} on "
                             f"{record['lane_key']}")
        evidence = _block_seq(entry, "evidence")
        for record in fresh:
            evidence.append(_node(record))
            edits.append(f"features.{change.feature}.evidence += {record['report']} on {record['lane_key']}")
    for reval in result.revalidations:
        for record in (features.get(reval.feature) or {}).get("evidence") or []:
            if (record.get("lane_key") == reval.lane_key and "revalidate" not in record
                    and record.get("software_fingerprint") == reval.recorded_fingerprint):
                record["revalidate"] = _node({"required": True, "reason": "software fingerprint changed",
                                              "current_fingerprint": reval.current_fingerprint,
                                              "noted_by": result.report_id, "date": result.date})
                edits.append(f"features.{reval.feature}.evidence[{reval.lane_key}]: revalidation required")
    return edits


def render_defaults(text: str, result: "PromotionResult") -> tuple[str, list[str]]:
    """The edited file content (round-trip) and the list of edits."""
    yaml = _yaml()
    doc = yaml.load(text)
    edits = apply_to_document(doc, result)
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue(), edits


def write_defaults(result: "PromotionResult", defaults_path: str | Path) -> list[str]:
    """Apply the result to ``defaults_path`` in place (atomic replace) and return the edits made."""
    from ablate.config.load import load_defaults

    path = Path(defaults_path)
    text, edits = render_defaults(path.read_text(), result)
    if not edits:
        return edits
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".defaults-", suffix=".yaml")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    try:
        load_defaults(tmp)  # never leave a defaults file the sweep loader would refuse
    except Exception:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    return edits
