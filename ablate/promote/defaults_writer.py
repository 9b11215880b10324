"""What a promotion changes in ``search_spaces/defaults.yaml``, and the round-trip edit that writes it.

How to use: ``plan_changes(...)`` and ``find_revalidations(...)`` are pure and run inside ``promote``; the
result carries them, so the report shows exactly what ``write_defaults(result, path)`` will write. The edit
uses ruamel.yaml's round-trip mode, so comments, key order and quoting of untouched lines survive; each promoted
value gets an evidence record (report id, speedup and interval, blocks, hosts, lane key, software fingerprint,
date) and the conditions under which it must be revalidated.

Scope (promotion-rule §5.5 "Global promotion", policy ``scope``): a value is flipped globally only when every
lane that measured the feature promoted the same value, none rejected it, and a promoting lane exists for every
device class in ``scope.global_device_classes`` (evidence from CPU lanes alone never changes what GPU lanes run).
Otherwise each promoting lane *shape* gets a lane override (``lane_overrides`` under the feature, keyed by
``ablate.config.lane_shape.lane_shape``), which ``load_defaults`` turns into that lane's baseline, when every lane
of that shape that measured the feature promoted that same value; a second promotion on the same shape updates
its entry instead of adding one.

Revalidation (``ablate.promote.revalidate``): a ``RevalidationOutcome`` in ``result.revalidations`` writes a
re-test into the marked record (``revalidate.retests``, ``status``, ``required``) and, when the win is gone,
puts the value the promotion replaced back (``apply_outcome``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark
from ruamel.yaml.scalarstring import SingleQuotedScalarString
from ruamel.yaml.tokens import CommentToken

from ablate.config.features import FEATURES
from ablate.config.load import Defaults, reference_value
from ablate.config.schema import ConfigError
from ablate.promote.analysis import PROMOTE, REJECT, FeatureVerdict
from ablate.promote.bundle import BundleCheck, unmeasured_together
from ablate.promote.evidence import LaneState, epoch_s
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
    overrides: dict[str, Any] = field(default_factory=dict)
    """Lane scope: lane shape -> the value its override takes (one per shape). Empty for a global flip."""
    not_global: list[str] = field(default_factory=list)
    """Lane scope: why the value did not flip globally (each failing condition), for the report."""
    held: str = ""
    """Why nothing is written for this promoted value though its own evidence earned it (a set of new values
    that would run together on some lane and was never measured together, ``bundle.unmeasured_together``)."""
    override_edits: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Demotions (``ablate revalidate``): lane shape -> (its override's value before, after; None after: removed,
    the lane runs the global value again), as ``apply_outcome`` edits the file."""


class Edit(str):
    """One line of ``apply_to_document``'s edit list; ``kind`` says what it is, so callers count without parsing.

    kinds: ``value`` (a global value flipped), ``override`` (a lane override added or updated), ``evidence``,
    ``revalidate`` (a mark set, or a re-test's outcome written), ``demote`` (a value or override put back).
    """

    kind: str

    def __new__(cls, text: str, kind: str) -> "Edit":
        edit = super().__new__(cls, text)
        edit.kind = kind
        return edit


def num_promoted(edits: Iterable[str]) -> int:
    """Promoted values among ``edits``: flipped global values plus added or updated lane overrides."""
    return sum(1 for e in edits if getattr(e, "kind", None) in ("value", "override"))


@dataclass
class Revalidation:
    feature: str
    value: Any
    lane_key: str
    recorded_fingerprint: str
    current_fingerprint: str
    report: Optional[str]


CONFIRMED, DEMOTED, UNCONFIRMED = "confirmed", "demoted", "still unconfirmed"
"""Outcomes of a re-test (``ablate revalidate``): the rule PROMOTEd the value again (the mark is resolved and the
re-test becomes fresh evidence), REJECTed it (the win is gone: the value goes back to the one it replaced), or
neither (HOLD, or no usable block: the value stays and so does the mark)."""


@dataclass
class RevalidationOutcome(Revalidation):
    """A re-test of a marked value and what it does to the defaults file (``ablate.promote.revalidate``)."""

    outcome: str = UNCONFIRMED
    verdict: Optional[str] = None
    """The rule's verdict on the re-test (None: the re-test produced no verdict for this value and lane)."""
    reason: str = ""
    previous: Any = None
    """The lane's baseline when the value was promoted (the re-test's baseline)."""
    replaced: Any = None
    """Global scope: the global value the promotion replaced, what a demotion restores (None: not recorded)."""
    scope: str = "global"
    lane_shape: Optional[str] = None
    retest: dict[str, Any] = field(default_factory=dict)
    """What is appended to the mark's ``retests`` list: report, date, sweeps, verdict, speed-up, fingerprint."""
    evidence: Optional[dict[str, Any]] = None
    """Confirmed: the fresh evidence record (under the new fingerprint) appended to the feature's evidence."""
    still_supported_by: tuple[str, ...] = ()
    """Demoted global value that other lanes' records still support (lane keys): only this lane's shape goes back to
    ``previous``, as a lane override; the global value stays and those records are marked for a re-test."""


def _round(x: Optional[float], digits: int = 4) -> Optional[float]:
    return None if x is None else round(float(x), digits)


def evidence_record(v: FeatureVerdict, *, report_id: str, campaign: str, date: str, policy: Policy,
                    scope: str, replaced: Any = None) -> dict[str, Any]:
    """``previous`` is the lane's baseline value; ``replaced`` (global scope only) the global value the promotion
    replaced, which differs from it where the lane ran an override: a demotion must restore the global one."""
    extra = {"replaced": replaced} if scope == "global" else {}
    return {**extra,
        "report": report_id, "campaign": campaign, "value": v.value, "previous": v.baseline_value, "scope": scope,
        "lane_key": v.lane_key, "lane_shape": v.lane_shape, "device_class": v.device_class,
        "software_fingerprint": v.software_fingerprint,
        "speedup": _round(v.speedup), "ci95": [_round(x) for x in (v.ci95 or (None, None))],
        "lower_bound_holm": _round(v.lower_adj), "blocks": v.n_blocks, "hosts": v.n_hosts,
        "rounds": [r.round_id for r in v.rounds if r.counted], "bootstrap": v.bootstrap_unit,
        "policy": policy.ref, "date": date, "revalidate_when": list(REVALIDATE_WHEN),
    }


def _global_values(defaults: Defaults | Mapping[str, Any]) -> Mapping[str, Any]:
    return defaults.values if isinstance(defaults, Defaults) else defaults


def _global_value(feature: str, globals_: Mapping[str, Any]) -> Any:
    """The value every lane without an override runs: the file's entry, else the registry's reference (the typed
    lane field's default). Never a measured lane's baseline: that may be a value the campaign pinned, and a new
    entry written with it would move every other lane off the reference."""
    return globals_[feature] if feature in globals_ else reference_value(feature)


@dataclass(frozen=True)
class UnjudgedLane:
    """A lane with arms of a feature that no test here judged: left out by a ``--sweep`` selection, unreadable, or in
    blocks that were all refused."""

    why: str
    left_out: bool
    shape: Optional[str] = None
    """Its lane shape, when a readable receipt says it (a damaged or deleted arm does not)."""


def _shape_overrides(tests: list[FeatureVerdict], promoted: list[FeatureVerdict],
                     held: frozenset[str] | set[str] = frozenset(),
                     unjudged: Mapping[str, UnjudgedLane] = {}) -> tuple[dict[str, Any], list[str]]:
    """Lane shape -> override value, for shapes where every measured lane promoted the same value and no
    bundle check held it (failed or unmeasured).

    A shape ignores feature values, so the lanes of one grid campaign (contexts) share it: one override covers
    them all, so it is written only when each of them promoted that value. A sibling lane that held (a tie, a
    failure rate, an unread arm) or rejected it, or measured another value, would otherwise run the value
    through the override while its own verdict says it did not earn it (found in review: a context lane's
    PROMOTE overrode the defaults lane's HOLD); a lane whose bundle check held the value likewise, and a lane of
    the shape with arms of the feature that were not judged here (``unjudged``: left out by ``--sweep``, refused,
    unreadable), or one whose shape is unknown (only damaged or deleted arms of it: it may be of this shape).
    """
    overrides: dict[str, Any] = {}
    conflicts: list[str] = []
    for shape in sorted({v.lane_shape for v in promoted}):
        values = {str(v.value): v.value for v in promoted if v.lane_shape == shape}
        siblings = [v for v in tests if v.lane_shape == shape]
        rejected = any(v.verdict == REJECT and str(v.value) in values for v in siblings)
        # A lane that promoted the value has earned it, whatever its rival values' verdicts (they lost to it).
        earned = {v.lane_key for v in siblings if v.verdict == PROMOTE and str(v.value) in values}
        unearned = [v for v in siblings if v.lane_key not in earned]
        withheld = any(v.test_key in held for v in siblings)
        # A lane whose shape no readable receipt names (a damaged or deleted arm) may be of this shape too.
        unseen = sorted(key for key, lane in unjudged.items() if lane.shape in (shape, None))
        if len(values) > 1 or rejected or unearned or withheld or unseen:
            conflicts.append(f"no override for {shape}: its lanes " + (
                "promoted different values" if len(values) > 1 else "also rejected it" if rejected else
                f"include {unearned[0].lane_key[:12]}, which measured {unearned[0].value!r} with verdict "
                f"{unearned[0].verdict}" if unearned else "include one whose bundle check held it" if withheld else
                f"include {unseen[0][:12]}, which was not judged here ({unjudged[unseen[0]].why})"
                if unjudged[unseen[0]].shape is not None else
                f"may include {unseen[0][:12]}, which was not judged here ({unjudged[unseen[0]].why}) and whose "
                f"shape no readable receipt names"))
            continue
        overrides[shape] = next(iter(values.values()))
    return overrides, conflicts


def measured_before(verdicts: Iterable[FeatureVerdict], defaults: Defaults | Mapping[str, Any],
                    measured_lanes: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Test key -> why its lane no longer runs: it ran another feature at a value the defaults file once held for
    that lane and has replaced since (a promotion, a demotion, a chain of them, written after the campaign was
    planned: the file's evidence records and the lane's overrides of that feature name the value, as a value, the
    one it replaced or the lane's baseline, while the file now says another). Promoted, such a value would run with
    the other feature's new value, a pair no block measured; one run over both campaigns holds it under the bundle
    rule (found in review: two ``promote --write`` runs, one campaign each, wrote both values). A value the file
    never held is the lane's own setting, not a replaced default, and holds nothing; a hand edit of the file leaves
    no record and is not seen."""
    if not isinstance(defaults, Defaults):
        return {}
    entries = (defaults.raw or {}).get("features") or {}
    reasons: dict[str, str] = {}
    for v in verdicts:
        lane = measured_lanes.get(v.lane_key)
        if lane is None:
            continue
        now = defaults.for_shape(v.lane_shape)
        for other, entry in sorted(entries.items()):
            spec = FEATURES.get(str(other))
            if other == v.feature or spec is None or spec.path not in lane or not isinstance(entry, Mapping):
                continue
            ran, current = str(lane[spec.path]), str(now.get(str(other)))
            if ran != current and ran in _held_values(entry, v.lane_shape):
                reasons[v.test_key] = (
                    f"measured on lane {v.lane_key[:17]} with {other}={ran}, which the defaults have since replaced "
                    f"with {other}={current}: {v.feature}={v.value} was never measured with {other}={current}; "
                    f"re-measure it on the lane as the defaults make it now")
                break
    return reasons


def _held_values(entry: Mapping[str, Any], shape: str) -> set[str]:
    """Every value the file's records say this feature held for lanes of ``shape``: global evidence and the
    shape's own evidence and overrides (value, the value it replaced, the lane's baseline)."""
    held: set[str] = set()
    for record in entry.get("evidence") or []:
        if not isinstance(record, Mapping):
            continue
        # ``previous`` is the promoting lane's own baseline (its shape may have run an override): a global record
        # says it for that shape only, its value and the global value it replaced for every shape (found in review).
        own = record.get("lane_shape") == shape
        keys = ("value", "previous", "replaced") if own else ("value", "replaced") if record.get("scope") == "global" \
            else ()
        held.update(str(record[k]) for k in keys if record.get(k) is not None)
    for override in entry.get("lane_overrides") or []:
        if isinstance(override, Mapping) and override.get("lane_shape") == shape:
            held.update(str(override[k]) for k in ("value", "previous") if override.get(k) is not None)
    return held


def plan_changes(verdicts: Iterable[FeatureVerdict], defaults: Defaults | Mapping[str, Any], policy: Policy, *,
                 report_id: str, campaign: str, date: str, held: frozenset[str] | set[str] = frozenset(),
                 bundles: Iterable[BundleCheck] = (),
                 measured_lanes: Mapping[str, Mapping[str, Any]] = {},
                 unjudged_lanes: Mapping[str, Mapping[str, UnjudgedLane]] = {}) -> list[DefaultsChange]:
    """One change per promoted feature: a global flip, or lane overrides (see the module docstring). Tests in
    ``held`` (their lane's bundle check did not pass, ``ablate.promote.bundle``) are measured lanes that do not
    promote, so they are neither written nor counted towards a global flip. A change whose value would run
    together with another new value on some lane, a set no passed bundle check (of ``bundles``) measured, is held
    (``DefaultsChange.held``) under ``bundle.required``. ``measured_lanes`` (lane key -> the lane as its receipts
    record it) finds promoting lanes the file has since moved on from (``measured_before``). ``unjudged_lanes``
    (feature -> lane key -> ``UnjudgedLane``): lanes with arms of the feature that a ``--sweep`` selection left out,
    that could not be read, or whose blocks were all refused; one that has no test here blocks the global flip (it
    may have rejected the value: "no REJECT anywhere" holds whatever ``scope.global_requires_all_lanes`` says) and
    the override of its shape (of every shape, when its own is unknown)."""
    globals_ = _global_values(defaults)
    by_feature: dict[str, list[FeatureVerdict]] = defaultdict(list)
    for v in verdicts:
        if v.kind == "speed":
            by_feature[v.feature].append(v)
    # A lane that no longer runs (``measured_before``) promotes nothing. Where its shape was measured again on the
    # lane as it runs now, its test is history and leaves the planning; elsewhere it stays a measured lane that
    # did not promote, and says why.
    stale = measured_before([v for tests in by_feature.values() for v in tests if v.verdict == PROMOTE],
                            defaults, measured_lanes)
    held = set(held) | set(stale)
    changes = []
    for feature, tests in sorted(by_feature.items()):
        judged = {v.lane_key for v in tests}  # a stale lane's test was judged too: it is history, not unseen
        unjudged = {key: lane for key, lane in unjudged_lanes.get(feature, {}).items() if key not in judged}
        current_shapes = {v.lane_shape for v in tests if v.test_key not in stale}
        tests = [v for v in tests if v.test_key not in stale or v.lane_shape not in current_shapes]
        promoted = [v for v in tests if v.verdict == PROMOTE and v.test_key not in held]
        outdated = sorted({stale[v.test_key] for v in tests if v.test_key in stale})
        if not promoted:
            if outdated:
                changes.append(DefaultsChange(feature=feature, old=_global_value(feature, globals_), new=None,
                                              scope="lane", lanes=[], held=outdated[0] + "; the value is held from "
                                                                                         "--write"))
            continue
        values = {str(v.value) for v in promoted}
        not_global = list(outdated)
        if len(values) > 1:
            not_global.append(f"lanes promoted different values ({', '.join(sorted(values))})")
        if any(v.verdict == REJECT and str(v.value) in values for v in tests):
            not_global.append("rejected in another lane")
        if policy.scope.global_requires_all_lanes and {v.lane_key for v in promoted} != {v.lane_key for v in tests}:
            not_global.append("not every measured lane promoted it")
        # A lane judged nowhere may have rejected it: a --sweep of one lane's rounds, a lane whose arms could not be
        # read or whose blocks were all refused, flipped the global default that lane rejects (found in review).
        if unjudged:
            shown = "; ".join(f"lane {key[:12]} ({lane.why})" for key, lane in sorted(unjudged.items())[:3])
            not_global.append(f"{len(unjudged)} lane(s) with arms of it were not judged here, and a global default is "
                              f"decided on every lane's evidence: {shown}{'; ...' if len(unjudged) > 3 else ''}"
                              + (". Promote without --sweep to judge the lanes it left out"
                                 if any(lane.left_out for lane in unjudged.values()) else ""))
        # A win that holds only below some run length (cheaper to start, slower per step) is the measured lanes'
        # at their horizon: a global default also runs the longer jobs it loses on (found by review helper 2: a
        # lane measured at 200 steps flipped the global default to a value 2% slower per step).
        short = [v for v in promoted if (v.break_even or {}).get("kind") == "until"]
        if short:
            worst = min(short, key=lambda v: v.break_even["steps"])
            not_global.append(f"it wins only for runs shorter than {worst.break_even['steps']:,.0f} steps (cheaper "
                              f"to start, slower per step; measured at a horizon of {worst.horizon_steps:,} steps)")
        if policy.single_node:
            # One host says nothing about the others (promotion-rule.md §5.9): the value is the measured lanes'.
            not_global.append(f"policy {policy.name!r} is single-node: a promotion is scoped to the lanes measured "
                              f"on its host")
        # With one lane measured "every lane" holds trivially: the device classes are what stop a 1-thread CPU
        # lane from deciding what GPU campaigns run.
        classes = {v.device_class for v in promoted}
        missing = [c for c in policy.scope.global_device_classes if c not in classes]
        if missing:
            not_global.append(f"no promoting lane on {', '.join(missing)} (policy scope.global_device_classes; "
                              f"promoted on: {', '.join(sorted(c or 'unknown' for c in classes))})")
        flip = not not_global
        scope = "global" if flip else "lane"
        overrides: dict[str, Any] = {}
        if not flip:
            overrides, conflicts = _shape_overrides(tests, promoted, held, unjudged)
            not_global += conflicts
        old = _global_value(feature, globals_)
        changes.append(DefaultsChange(
            feature=feature, old=old, new=promoted[0].value if flip else None, scope=scope,
            lanes=sorted(v.lane_key for v in promoted),
            evidence=[evidence_record(v, report_id=report_id, campaign=campaign, date=date, policy=policy,
                                      scope=scope, replaced=old) for v in promoted],
            overrides=overrides, not_global=not_global))
    # Held: no value, no override, no evidence record is written; the reason goes into the report.
    standing: dict[str, dict[str, tuple[str, Optional[str]]]] = defaultdict(dict)
    for name, by_shape in (defaults.overrides if isinstance(defaults, Defaults) else {}).items():
        for shape, override in by_shape.items():
            if str(override.value) != str(_global_value(name, globals_)):  # else its lanes run what every lane runs
                standing[shape][name] = (str(override.value), override.report)
    measured_shapes = {feature: {v.lane_shape for v in tests if v.verdict == PROMOTE and v.test_key not in held}
                       for feature, tests in by_feature.items()}
    held_together = unmeasured_together(changes, bundles, policy, standing, measured_shapes)
    return [_held(c, why) if (why := held_together.get(c.feature)) and not c.held else c for c in changes]


def _held(change: DefaultsChange, why: str) -> DefaultsChange:
    return DefaultsChange(feature=change.feature, old=change.old, new=None, scope="lane", lanes=change.lanes,
                          held=why)


def find_revalidations(defaults_raw: Mapping[str, Any], lanes: Mapping[str, LaneState]) -> list[Revalidation]:
    """Recorded evidence whose lane was measured again under another software fingerprint must be revalidated.

    "Its lane" is the recorded lane key, or any lane with the same shape (the lane key itself changes once
    the promoted value becomes the baseline); the most recently measured such lane gives the current software.
    """
    by_shape: dict[str, list[LaneState]] = defaultdict(list)
    for state in lanes.values():
        for shape in {state.shape_key, *(runs.shape_key for runs in state.devices.values())}:
            by_shape[shape].append(state)
    found = []
    for feature, entry in (defaults_raw.get("features") or {}).items():
        if not isinstance(entry, Mapping):
            continue
        for record in entry.get("evidence") or []:
            if not isinstance(record, Mapping):
                continue
            state = _current_state(record, lanes, by_shape)
            if state is None or record.get("software_fingerprint") == state.current_fingerprint:
                continue
            mark = record.get("revalidate") or {}
            if mark.get("current_fingerprint") == state.current_fingerprint:
                continue  # already marked for this fingerprint
            if mark.get("required") is False:
                continue  # resolved by a re-test: confirmed (its fresh record carries on) or demoted (history)
            found.append(Revalidation(feature=str(feature), value=record.get("value"),
                                      lane_key=str(record.get("lane_key")),
                                      recorded_fingerprint=str(record.get("software_fingerprint")),
                                      current_fingerprint=state.current_fingerprint, report=record.get("report")))
    return found


def _current_state(record: Mapping[str, Any], lanes: Mapping[str, LaneState],
                   by_shape: Mapping[str, list[LaneState]]) -> Optional[LaneState]:
    """The lane that says which software a record's lane runs now: the most recently measured of its recorded
    lane and the lanes of its shape. The recorded lane key stays measured in the old receipts that a promotion over
    the whole experiment reads, so taken first it hid its shape's newer lane under new software (found in review:
    sw-2 measured after a promotion under sw-1 left the evidence unmarked). Lanes last measured at the same moment
    under other software than the record's: that one, since the record is not known to describe the current one."""
    pool = list(by_shape.get(str(record.get("lane_shape")), ()))
    exact = lanes.get(str(record.get("lane_key")))
    if exact is not None and all(state is not exact for state in pool):
        pool.append(exact)
    # A lane key hashes hardware.device: auto as written: its runs on another device (a GPU cluster's, of a lane
    # whose value was won on CPU) say nothing of the software the record's device runs. Each lane is seen as it
    # ran on the record's device, and a lane that never ran there is not the record's.
    device = record.get("device_class")
    if device:
        pool = [replace(state, shape_key=runs.shape_key, last_at=runs.last_at,
                        current_fingerprint=runs.current_fingerprint)
                if (runs := state.devices.get(device)) is not None else state
                for state in pool if not state.devices or device in state.devices]
    if not pool:
        return None
    latest = max(epoch_s(state.last_at) for state in pool)
    newest = [state for state in pool if epoch_s(state.last_at) == latest]
    return next((state for state in newest if state.current_fingerprint != record.get("software_fingerprint")),
                newest[0])


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


def _replace_value_comment(entry: CommentedMap, text: str) -> Optional[str]:
    """Put ``text`` as the comment of the entry's ``value:`` line; returns the comment it replaces.

    The old comment described the old value (``# reference SSD recurrence``): left on the line it would now
    mislabel the promoted one. Its column is kept so the file stays aligned, and any full-line comments that
    ruamel stores in the same token (the lines right below) are kept too.
    """
    text = re.sub(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+", " ", text)  # a comment is one line, or YAML
    slot = entry.ca.items.get("value")
    token = slot[2] if slot and len(slot) > 2 else None
    old, rest, column = None, "", 25
    if token is not None:
        first, _, rest = token.value.partition("\n")
        old = first.lstrip("#").strip() or None
        column = token.column
    entry.ca.items["value"] = [None, None, CommentToken(f"# {text}\n{rest}", CommentMark(column), None), None]
    return old


def _override_entry(change: DefaultsChange, shape: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    first = records[0]
    return {"lane_shape": shape, "value": change.overrides[shape], "previous": first["previous"],
            "report": first["report"], "date": first["date"]}


def _overrides_by_shape(entry: CommentedMap) -> dict[str, CommentedMap]:
    return {str(o.get("lane_shape")): o for o in entry.get("lane_overrides") or [] if isinstance(o, Mapping)}


def apply_to_document(doc: CommentedMap, result: "PromotionResult") -> list[str]:
    """Edit a loaded defaults document in place; returns one ``Edit`` line per edit."""
    edits: list[str] = []
    features = doc.setdefault("features", CommentedMap())
    for change in result.changes:
        entry = features.get(change.feature)
        if entry is None:
            entry = features[change.feature] = _node({"value": change.old, "kind": "speed", "evidence": []})
        # Writing the same report twice (--write then --branch) must not duplicate anything.
        known = {(r.get("report"), r.get("lane_key")) for r in entry.get("evidence") or [] if isinstance(r, Mapping)}
        fresh = [dict(r) for r in change.evidence if (r["report"], r["lane_key"]) not in known]
        if not fresh:
            continue
        shapes = sorted({str(r["lane_shape"]) for r in fresh})
        if change.scope == "global":
            if str(entry.get("value")) != str(change.new):
                entry["value"] = _node(change.new)
                previous_comment = _replace_value_comment(
                    entry, f"promoted by {result.report_id} on {result.date} (was {change.old}); evidence below")
                if previous_comment:
                    fresh[0]["previous_comment"] = previous_comment
                edits.append(Edit(f"features.{change.feature}.value: {change.old!r} -> {change.new!r}", "value"))
            # A promoting lane that had an override keeps it, and the override would beat the new global value
            # that lane just promoted: bring it along.
            existing = _overrides_by_shape(entry)
            for shape in shapes:
                override = existing.get(shape)
                if override is not None and str(override.get("value")) != str(change.new):
                    old = override.get("value")
                    override.update({"value": _node(change.new), "previous": _node(old),
                                     "report": result.report_id, "date": result.date})
                    override.pop("revalidate", None)
                    edits.append(Edit(f"features.{change.feature}.lane_overrides[{shape}]: {old!r} -> "
                                      f"{change.new!r}", "override"))
        else:
            existing = _overrides_by_shape(entry)
            for shape in shapes:
                if shape not in change.overrides:
                    continue  # its lanes disagreed (see change.not_global): evidence only
                records = [r for r in fresh if r["lane_shape"] == shape]
                new = _override_entry(change, shape, records)
                override = existing.get(shape)
                if override is None:
                    overrides = _block_seq(entry, "lane_overrides")
                    overrides.append(_node(new))
                    existing = _overrides_by_shape(entry)
                    edits.append(Edit(f"features.{change.feature}.lane_overrides += {new['value']!r} on {shape}",
                                      "override"))
                else:
                    # A second promotion on the same lane shape replaces the value the lane runs: one entry per
                    # shape, or load_defaults would refuse the file.
                    old = override.get("value")
                    override.update({"value": _node(new["value"]), "previous": _node(old),
                                     "report": new["report"], "date": new["date"]})
                    override.pop("revalidate", None)  # fresh evidence answers an earlier revalidation mark
                    edits.append(Edit(f"features.{change.feature}.lane_overrides[{shape}]: {old!r} -> "
                                      f"{new['value']!r}", "override"))
        evidence = _block_seq(entry, "evidence")
        for record in fresh:
            evidence.append(_node(record))
            edits.append(Edit(f"features.{change.feature}.evidence += {record['report']} on {record['lane_key']}",
                              "evidence"))
    for reval in result.revalidations:
        if isinstance(reval, RevalidationOutcome):
            edits += apply_outcome(features, reval, result.report_id, result.date)
            continue
        entry = features.get(reval.feature) or {}
        for record in entry.get("evidence") or []:
            if (record.get("lane_key") == reval.lane_key and "revalidate" not in record
                    and record.get("software_fingerprint") == reval.recorded_fingerprint):
                mark = {"required": True, "reason": "software fingerprint changed",
                        "current_fingerprint": reval.current_fingerprint, "noted_by": result.report_id,
                        "date": result.date}
                record["revalidate"] = _node(mark)
                edits.append(Edit(f"features.{reval.feature}.evidence[{reval.lane_key}]: revalidation required",
                                  "revalidate"))
                # The override this evidence created is what the lane runs: it carries the mark too.
                override = _overrides_by_shape(entry).get(str(record.get("lane_shape")))
                if (override is not None and "revalidate" not in override
                        and override.get("report") == record.get("report")):
                    override["revalidate"] = _node(mark)
                    edits.append(Edit(f"features.{reval.feature}.lane_overrides[{record.get('lane_shape')}]: "
                                      f"revalidation required", "revalidate"))
    return edits


def marked_record(entry: Mapping[str, Any], lane_key: str, report: Optional[str]) -> Optional[CommentedMap]:
    """The evidence record of ``report`` on ``lane_key`` that carries a revalidation mark, if any."""
    for record in entry.get("evidence") or []:
        if (isinstance(record, Mapping) and isinstance(record.get("revalidate"), Mapping)
                and record.get("lane_key") == lane_key and record.get("report") == report):
            return record  # type: ignore[return-value]
    return None


def _demote(entry: CommentedMap, o: RevalidationOutcome, report_id: str, date: str) -> list[str]:
    """Put the value the promotion replaced back: the global value, or the lane's override (dropped when the
    lane would then run the global value anyway, so the file keeps one way of saying it)."""
    where = f"features.{o.feature}"
    if o.scope == "global" and o.still_supported_by:
        return _demote_on_lane_only(entry, o, report_id, date)
    if o.scope == "global":
        if str(entry.get("value")) != str(o.value) or o.replaced is None:
            return []  # something else has been promoted since, or nothing says what to restore (outcome_of)
        edits = []
        # A promotion that found the global value already in place only moved the promoting lane's override: then
        # only the override goes back (found in review: the file said "jagged -> jagged (demoted)").
        if str(o.replaced) != str(o.value):
            entry["value"] = _node(o.replaced)
            _replace_value_comment(entry, f"demoted by {report_id} on {date} (was {o.value}: its win is gone on "
                                          f"re-test); evidence below")
            edits.append(Edit(f"{where}.value: {o.value!r} -> {o.replaced!r} (demoted)", "demote"))
        # Overrides the global promotion moved onto the value go back to what they held before it.
        for override in list(entry.get("lane_overrides") or []):
            if (str(override.get("value")) == str(o.replaced) and str(override.get("previous")) == str(o.value)
                    and str(o.replaced) != str(o.value)):
                # A lane that lost the win earlier, while other lanes held the value up (``_demote_on_lane_only``):
                # the global value says it now, and a later global promotion must not find this lane pinned.
                entry["lane_overrides"].remove(override)
                edits.append(Edit(f"{where}.lane_overrides[{override.get('lane_shape')}]: removed with the "
                                  f"demotion (the lane runs the global {o.replaced!r} again)", "demote"))
                continue
            if override.get("report") == o.report and str(override.get("value")) == str(o.value):
                back = override.get("previous")
                if back is None or str(back) == str(o.replaced):
                    entry["lane_overrides"].remove(override)
                    edits.append(Edit(f"{where}.lane_overrides[{override.get('lane_shape')}]: removed with the "
                                      f"demotion (the lane runs the global {o.replaced!r} again)", "demote"))
                else:
                    override.update({"value": _node(back), "previous": _node(o.value), "report": report_id,
                                     "date": date})
                    override.pop("revalidate", None)
                    edits.append(Edit(f"{where}.lane_overrides[{override.get('lane_shape')}]: {o.value!r} -> "
                                      f"{back!r} (demoted with the global value)", "demote"))
        if not entry.get("lane_overrides", True):
            del entry["lane_overrides"]
        return edits
    overrides = entry.get("lane_overrides") or []
    override = _overrides_by_shape(entry).get(str(o.lane_shape))
    if override is None or str(override.get("value")) != str(o.value):
        return []
    if str(o.previous) == str(entry.get("value")):
        overrides.remove(override)
        if not overrides:
            del entry["lane_overrides"]
        return [Edit(f"{where}.lane_overrides[{o.lane_shape}]: {o.value!r} removed, the lane runs the global "
                     f"{o.previous!r} again (demoted)", "demote")]
    override.update({"value": _node(o.previous), "previous": _node(o.value), "report": report_id, "date": date})
    override.pop("revalidate", None)
    return [Edit(f"{where}.lane_overrides[{o.lane_shape}]: {o.value!r} -> {o.previous!r} (demoted)", "demote")]


def _demote_on_lane_only(entry: CommentedMap, o: RevalidationOutcome, report_id: str, date: str) -> list[str]:
    """A global value whose win is gone on one re-tested lane while other lanes' records still support it: that
    lane's shape goes back to ``previous`` (what its re-test measured against), the global value stays, and the
    supporting records are marked for a re-test under the re-test's software. Restoring the global value for every
    lane on one lane's evidence would take away wins no one re-measured (from a CPU lane, on GPU lanes too)."""
    where = f"features.{o.feature}"
    if str(entry.get("value")) != str(o.value) or o.lane_shape is None:
        return []
    override = _overrides_by_shape(entry).get(str(o.lane_shape))
    if override is not None and str(override.get("value")) != str(o.value):
        return []  # the lane runs another value since: this record no longer says what it runs
    fields = {"value": _node(o.previous), "previous": _node(o.value), "report": report_id, "date": date}
    if override is None:
        _block_seq(entry, "lane_overrides").append(_node({"lane_shape": o.lane_shape, **fields}))
    else:
        override.update(fields)
        override.pop("revalidate", None)
    edits = [Edit(f"{where}.lane_overrides[{o.lane_shape}]: {o.previous!r} (demoted on this lane; the global "
                  f"{o.value!r} stays for lane(s) {', '.join(k[:12] for k in o.still_supported_by)})", "demote")]
    fingerprint = o.retest.get("software_fingerprint") or o.current_fingerprint
    for record in entry.get("evidence") or []:
        # A record measured under the re-test's software already answers for it (a mark would ask it again, and
        # its sticky "still unconfirmed" would then block the re-test a later software needs: found in review).
        if (isinstance(record, Mapping) and record.get("lane_key") in o.still_supported_by
                and str(record.get("scope") or "global") == "global" and str(record.get("value")) == str(o.value)
                and record.get("software_fingerprint") != fingerprint and "revalidate" not in record):
            record["revalidate"] = _node({
                "required": True, "current_fingerprint": fingerprint, "noted_by": report_id, "date": date,
                "reason": f"the win of {o.value!r} is gone on lane {o.lane_key[:12]} under {fingerprint} (report "
                          f"{report_id}); this lane's record still holds the global value up"})
            edits.append(Edit(f"{where}.evidence[{record.get('lane_key')}]: revalidation required (the win is gone "
                              f"on lane {o.lane_key[:12]})", "revalidate"))
    return edits


def apply_outcome(features: CommentedMap, o: RevalidationOutcome, report_id: str, date: str) -> list[str]:
    """Write one re-test's outcome: the marked record gets the re-test appended to ``revalidate.retests``, its
    ``status`` and ``required`` (false once confirmed or demoted); a confirmation appends the fresh evidence and
    moves the lane override onto it; a demotion puts the previous value back. Writing it twice changes nothing."""
    entry = features.get(o.feature)
    record = marked_record(entry, o.lane_key, o.report) if isinstance(entry, Mapping) else None
    if record is None:
        return []
    mark = record["revalidate"]
    if mark.get("required") is not True:
        return []  # already resolved (by another re-test's report): an older result must not overwrite it
    retests = _block_seq(mark, "retests")
    if any(isinstance(t, Mapping) and t.get("report") == report_id for t in retests):
        return []
    retests.append(_node(o.retest))
    mark["status"] = o.outcome
    mark["required"] = o.outcome == UNCONFIRMED  # an inconclusive re-test answers nothing: still required
    edits: list[str] = [Edit(f"features.{o.feature}.evidence[{o.lane_key}]: revalidation {o.outcome} "
                             f"({o.verdict or 'no verdict'})", "revalidate")]
    if o.outcome == DEMOTED:
        edits += _demote(entry, o, report_id, date)
    elif o.outcome == CONFIRMED and o.evidence is not None:
        _block_seq(entry, "evidence").append(_node(o.evidence))
        edits.append(Edit(f"features.{o.feature}.evidence += {report_id} on {o.lane_key} (revalidation)",
                          "evidence"))
        override = _overrides_by_shape(entry).get(str(o.lane_shape))
        if override is not None and override.get("report") == o.report:
            # The override now rests on the fresh record: a later fingerprint change marks both together again.
            override.update({"report": report_id, "date": date})
            override.pop("revalidate", None)
    return edits


def render_defaults(text: str, result: "PromotionResult") -> tuple[str, list[str]]:
    """The edited file content (round-trip) and the list of edits."""
    yaml = _yaml()
    doc = yaml.load(text)
    edits = apply_to_document(doc, result)
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue(), edits


def check_unchanged(result: "PromotionResult", current: str, path: Path) -> None:
    """Refuse (``ConfigError``) to write ``result`` over a defaults file other than the one ``promote`` decided it
    against, or than what writing it made of that one (``--write --branch`` writes twice). Its plan says what each
    value was (``change.old``) and holds what another promoted value would have to be measured with: over a file
    changed since (another ``promote --write``, a result kept and written later), a value measured only against
    the old default replaced one promoted meanwhile, and its record named the wrong value to roll back to (found in
    review)."""
    decided = getattr(result, "defaults_text", None)
    if decided is None or current == decided or current == render_defaults(decided, result)[0]:
        return
    raise ConfigError(str(path), "a file changed since this promotion read it",
                      "the defaults file `ablate promote` decided against; run `ablate promote` again on the file as "
                      "it is now (another promotion may have written it)")


def write_defaults(result: "PromotionResult", defaults_path: str | Path) -> list[str]:
    """Apply the result to ``defaults_path`` in place (atomic replace) and return the edits made.

    ``num_promoted(edits)`` counts the promoted values among them (one flip also adds an evidence line).
    """
    from ablate.config.load import load_defaults

    # The link's target is the file to edit: replacing a symlinked defaults file would cut the link instead.
    path = Path(defaults_path).resolve()
    current = path.read_text()
    check_unchanged(result, current, path)
    text, edits = render_defaults(current, result)
    if not edits:
        return edits
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".defaults-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            # mkstemp makes the file 0600: the replaced file keeps the mode it had (group-readable, say).
            os.fchmod(handle.fileno(), stat.S_IMODE(path.stat().st_mode))
            os.fsync(handle.fileno())
        load_defaults(tmp)  # never leave a defaults file the sweep loader would refuse
        os.replace(tmp, path)
    except BaseException:
        # Whatever failed (a full disk, the loader's refusal, an interrupt), no temporary file is left beside it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return edits
