"""``ablate revalidate``: re-test promoted values whose evidence went stale, and keep or demote them.

How to use (the CLI does exactly this)::

    plans, refused = plan_retests("search_spaces/defaults.yaml", policy, campaigns=[Path("search_spaces/smoke.yaml")])
    for plan in plans:
        print(plan.describe())                      # dry plan: the campaign files are written, nothing runs
    sweeps = run_retests(plans, policy)             # --run: every campaign through run_sweep, policy rounds
    result = judge(plans, receipts_of(sweeps), policy, "search_spaces/defaults.yaml")
    print(result.markdown)                          # the promotion report, with Demoted / Revalidated sections
    write_defaults(result, "search_spaces/defaults.yaml")   # --write: outcomes into the evidence records

What is re-tested: every evidence record carrying a ``revalidate`` mark with ``required: true`` (``promote
--write`` sets it when the record's lane was measured again under another software fingerprint) whose value is
still what runs: the global value (``scope: global``) or the lane override of its shape (``scope: lane``). The
re-test is an ordinary campaign on the recorded lane: baseline = the value the promotion replaced (the record's
``previous``), candidate = the promoted value. A record does not store the lane's full config, only its key, so
the lane comes from a campaign file (``--campaign``, else a file next to the defaults whose ``name`` is the
record's campaign); it is used only when the campaign's lane, with the feature set back to ``previous``, hashes
to the recorded lane key. A record without ``previous`` is refused: guessing the baseline would re-test against
the wrong value.

How an outcome is decided: the promotion rule, unchanged, on the re-test's receipts, judged against the defaults
as they were before the promotion (so "measured against the current default" holds). PROMOTE confirms (the mark
is resolved, the re-test becomes a fresh evidence record under the new fingerprint); REJECT means the win is gone
(no meaningful win with a calibrated lane and enough blocks, a gated disqualifier, flakiness or worse quality):
the value is demoted to ``previous``; a global value that other lanes' records still hold up (they measured its win
and were not re-tested, or it held on their re-test) is demoted on the re-tested lane's shape only, as a lane
override, and those records are marked for a re-test (``limit_global_demotions``): it goes back for every lane once
every lane that held it up lost its win. Except: a global value whose re-test found the toggle inert on the lane
(inert here says nothing about the lanes where it acts); a REJECT by a gate too thin to demote on, unless a later
clause shows the win gone (``_why_a_reject_keeps``); a re-test under the software the value was promoted on;
re-tests of one value that disagree (``settle_conflicts``); a demotion that would put nothing back
(``_nothing_to_put_back``). Those, and anything else (HOLD, too few blocks, no verdict), keep the value and the
mark, with the re-test recorded as "still unconfirmed": a wrong demotion is as bad as a wrong promotion.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from omegaconf import OmegaConf

from ablate.config.load import load_defaults, load_sweep, read_yaml, with_feature
from ablate.config.schema import ConfigError, LaneConfig, SweepConfig
from ablate.promote.analysis import PROMOTE, REJECT, FeatureVerdict
from ablate.promote.defaults_writer import (CONFIRMED, DEMOTED, UNCONFIRMED, DefaultsChange, RevalidationOutcome,
                                            _node, _overrides_by_shape, _yaml, apply_outcome, evidence_record)
from ablate.promote.policy import Policy
from ablate.promote.report import PromotionResult
from ablate.receipts.schema import Receipt

CAMPAIGN_PREFIX = "revalidate"


@dataclass
class Target:
    """One promoted value marked for revalidation, as its evidence record describes it."""

    feature: str
    value: Any
    previous: Any
    scope: str
    lane_key: str
    lane_shape: Optional[str]
    report: Optional[str]
    campaign: str
    recorded_fingerprint: str
    current_fingerprint: str
    policy: Optional[str]
    replaced: Any = None
    """Global scope: the global value the promotion replaced (records written before it was kept: None)."""
    device_class: Optional[str] = None
    """The device type the value was won on (``cpu``, ``cuda``): a re-test on another one is another lane."""

    @property
    def where(self) -> str:
        return f"features.{self.feature}.evidence[{self.lane_key}]"


@dataclass
class RetestPlan:
    target: Target
    campaign_path: Path
    """The generated campaign: baseline = ``target.previous``, candidate = ``target.value``, on the recorded lane."""
    source: Path
    """The campaign file the lane was taken from."""
    name: str
    blocks: int
    aa_blocks: int
    rounds: int
    thin: list[str] = field(default_factory=list)
    """Why the policy cannot decide on this many blocks (then the re-test can only end "still unconfirmed")."""

    def describe(self) -> str:
        t = self.target
        lines = [f"{t.feature}: {t.previous!r} (baseline) vs {t.value!r} (candidate) on lane {t.lane_key} "
                 f"[{t.scope}], promoted by {t.report}, fingerprint {t.recorded_fingerprint} -> "
                 f"{t.current_fingerprint}",
                 f"  campaign {self.campaign_path} (lane from {self.source}): {self.blocks} block(s) + "
                 f"{self.aa_blocks} A/A block(s) per round, {self.rounds} round(s)"]
        lines += [f"  note: {why}" for why in self.thin]
        return "\n".join(lines)


# --- 1. what is marked ---


def find_targets(defaults_path: str | Path, repeat: bool = False) -> tuple[list[Target], list[ConfigError],
                                                                           list[str]]:
    """Marked records whose value still runs (targets), records refused (no ``previous``), and notes on marked
    records left alone: their value no longer runs (something else was promoted since), or a re-test already
    ended inconclusive and ``repeat`` is not set (inconclusive is sticky, promotion-rule.md §5.6: re-testing
    until a verdict comes is multiple testing, and would demote true wins by chance)."""
    defaults = load_defaults(defaults_path)
    targets: list[Target] = []
    refused: list[ConfigError] = []
    notes: list[str] = []
    for feature, entry in (defaults.raw.get("features") or {}).items():
        if not isinstance(entry, Mapping):
            continue
        overrides = {str(o.get("lane_shape")): o for o in entry.get("lane_overrides") or [] if isinstance(o, Mapping)}
        for record in entry.get("evidence") or []:
            mark = record.get("revalidate") if isinstance(record, Mapping) else None
            if not isinstance(mark, Mapping) or mark.get("required") is not True:
                continue
            target = _target(str(feature), record, mark)
            if record.get("previous") is None:
                refused.append(ConfigError(f"{defaults_path}: {target.where}.previous", None,
                                           f"the value {target.value!r} replaced, as `promote --write` records it; "
                                           f"without it the baseline of the re-test would be a guess, so "
                                           f"{feature} is not re-tested (add `previous:` by hand from report "
                                           f"{target.report}, or re-promote it)"))
                continue
            # What the record's lane runs: its shape's override, else the global value. A global record whose lane
            # has an override of another value since is about a value that lane no longer runs: re-testing it there
            # would decide the global value on a lane it does not reach (found in review).
            shape_override = overrides.get(str(target.lane_shape))
            if shape_override is not None:
                running = shape_override.get("value")
            else:
                running = None if target.scope == "lane" else entry.get("value")
            if str(running) != str(target.value):
                notes.append(f"{target.where}: {target.value!r} is no longer what the lane runs ({running!r}); "
                             f"not re-tested")
                continue
            # A re-test that measured another lane (another device than the value was won on, or a record keyed by
            # an auto lane as written, re-keyed since) settled nothing.
            earlier = [t for t in mark.get("retests") or [] if isinstance(t, Mapping)
                       and t.get("another_lane") is not True]
            if earlier and not repeat:
                last = earlier[-1]
                notes.append(f"{target.where}: re-tested already ({last.get('verdict')} under "
                             f"{last.get('software_fingerprint')}, report {last.get('report')}), still unconfirmed "
                             f"({str(last.get('reason') or '')[:200]}); a re-test that did not decide is not "
                             f"planned again unasked: pass --repeat once the software or the lane has changed again")
                continue
            targets.append(target)
    return targets, refused, notes


def _target(feature: str, record: Mapping[str, Any], mark: Mapping[str, Any]) -> Target:
    return Target(feature=feature, value=record.get("value"), previous=record.get("previous"),
                  scope=str(record.get("scope") or "global"), lane_key=str(record.get("lane_key")),
                  lane_shape=record.get("lane_shape"), report=record.get("report"),
                  campaign=str(record.get("campaign") or ""),
                  recorded_fingerprint=str(record.get("software_fingerprint")),
                  current_fingerprint=str(mark.get("current_fingerprint")), policy=record.get("policy"),
                  replaced=record.get("replaced"), device_class=record.get("device_class") or None)


# --- 2. the campaign that re-tests it ---


def _named_campaigns(directory: Path, campaign: str) -> list[Path]:
    """Campaign files in ``directory`` whose ``name`` is one of the record's campaigns (``a+b`` for several)."""
    names = set(campaign.split("+"))
    found = []
    for path in sorted(directory.glob("*.yaml")):
        try:
            data = read_yaml(path)
        except ConfigError:
            continue
        if isinstance(data, dict) and data.get("name") in names and "lane" in data:
            found.append(path)
    return found


def campaign_lane(target: Target, campaigns: list[Path], defaults_path: Path) -> tuple[Path, SweepConfig,
                                                                                       LaneConfig]:
    """The campaign whose lane, with the feature set back to ``previous``, has the recorded lane key; that lane."""
    from ablate.sweep.plan import lane_key

    candidates = campaigns or _named_campaigns(defaults_path.parent, target.campaign)
    if not candidates:
        raise ConfigError("--campaign", None, f"a campaign file for {target.where} (report {target.report}, "
                                              f"campaign {target.campaign!r}): the record stores the lane's key, "
                                              f"not its config, and no file named {target.campaign!r} is in "
                                              f"{defaults_path.parent}")
    seen = []
    for path in candidates:
        sweep, _ = load_sweep(path)
        baseline = with_feature(sweep.lane, target.feature, target.previous)
        key = lane_key(baseline)
        if key == target.lane_key:
            return path, sweep, baseline
        seen.append((path, key))
    path, key = seen[0]
    raise ConfigError(f"{path}: lane key (with {target.feature}={target.previous})", key,
                      f"the recorded lane key {target.lane_key} of {target.where} (report {target.report}): a "
                      f"campaign whose lane, with {target.feature} set back to {target.previous!r}, is the lane "
                      f"that was measured" + (f" (also tried: {', '.join(f'{p} -> {k}' for p, k in seen[1:])})"
                                              if len(seen) > 1 else ""))


def retest_size(sweep: SweepConfig, policy: Policy, blocks: Optional[int], rounds: Optional[int],
                aa_blocks: Optional[int] = None) -> tuple[int, int, int, list[str]]:
    """(blocks, A/A blocks) per round, rounds, and why that is too little for the policy to decide.

    By default enough for the rule to decide either way: ``min_rounds`` rounds, each with at least
    ``min_blocks_per_round`` blocks, ``min_blocks`` in all, and ``min_aa_blocks`` A/A blocks in all (an
    uncalibrated lane can neither promote nor reject). ``--blocks`` / ``--aa-blocks`` / ``--rounds`` override it.
    """
    ev = policy.evidence
    rounds = rounds or ev.min_rounds
    blocks = blocks or max(sweep.blocks, ev.min_blocks_per_round, math.ceil(ev.min_blocks / rounds))
    aa_blocks = aa_blocks or max(sweep.aa_blocks, math.ceil(policy.threshold.min_aa_blocks / rounds))
    thin = []
    if blocks * rounds < ev.min_blocks or blocks < ev.min_blocks_per_round or rounds < ev.min_rounds:
        thin.append(f"{blocks} block(s) x {rounds} round(s) is below the policy's {ev.min_blocks} blocks, "
                    f"{ev.min_blocks_per_round} per round, {ev.min_rounds} rounds: the rule cannot confirm the "
                    f"value nor reject it as no win, so unless a gate rejects it, it stays, still unconfirmed")
    if aa_blocks * rounds < policy.threshold.min_aa_blocks:
        thin.append(f"{aa_blocks * rounds} A/A block(s) in all < the policy's {policy.threshold.min_aa_blocks}: "
                    f"the lane is uncalibrated, so nothing can be confirmed or rejected as no win")
    return blocks, aa_blocks, rounds, thin


def campaign_name(target: Target) -> str:
    raw = f"{CAMPAIGN_PREFIX}-{target.feature}-{target.value}-{target.lane_key[:8]}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw).replace("..", "_")[:100]


def campaign_document(target: Target, sweep: SweepConfig, baseline: LaneConfig, defaults_path: Path, *,
                      name: str, blocks: int, aa_blocks: int) -> dict[str, Any]:
    """The re-test campaign as YAML data. The whole baseline lane is written out, every feature pinned, so the
    sweep runs exactly the recorded lane whatever the defaults say now; only ``features`` adds the candidate."""
    from ablate.config.load import lane_to_dict

    keep = OmegaConf.to_container(OmegaConf.structured(sweep), enum_to_str=True)
    assert isinstance(keep, dict)
    return {"name": name, "defaults": str(defaults_path.resolve()), "lane": lane_to_dict(baseline),
            "features": {target.feature: [target.value]}, "blocks": blocks, "aa_blocks": aa_blocks,
            "bundle_blocks": 0, "design": "one_at_a_time", "block_mode": keep["block_mode"],
            "resources": keep["resources"], "tracking": keep["tracking"], "node_check": keep["node_check"],
            "max_failures": keep["max_failures"], "seed": keep["seed"]}


def write_campaign(plan_path: Path, document: dict[str, Any], target: Target) -> None:
    """Write the campaign and check that it plans exactly the re-test: one lane, the recorded one."""
    from ablate.sweep.plan import plan_sweep

    plan_path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Generated by `ablate revalidate`: re-tests {target.feature}={target.value} (promoted by "
              f"{target.report}) against {target.previous}, the value it replaced,\n# on lane {target.lane_key}: "
              f"its evidence was recorded under software {target.recorded_fingerprint}, the lane now runs "
              f"{target.current_fingerprint}.\n")
    with plan_path.open("w") as handle:
        handle.write(header)
        _yaml().dump(_node(document), handle)
    sweep, defaults = load_sweep(plan_path)
    plan = plan_sweep(sweep, "revalidate-check", defaults)
    tested = {(b.feature, str(b.candidate_value)) for b in plan.blocks if b.feature}
    if plan.lane_keys() != [target.lane_key] or tested != {(target.feature, str(target.value))}:
        raise ConfigError(f"{plan_path}", f"lanes {plan.lane_keys()}, tests {sorted(tested)}",
                          f"one lane {target.lane_key} testing {target.feature}={target.value}")


def plan_retests(defaults_path: str | Path, policy: Policy, *, campaigns: Iterable[Path] = (),
                 out_dir: Optional[Path] = None, storage: Optional[str] = None, blocks: Optional[int] = None,
                 rounds: Optional[int] = None, aa_blocks: Optional[int] = None, repeat: bool = False
                 ) -> tuple[list[RetestPlan], list[ConfigError], list[str]]:
    """A written campaign per marked value, the values refused (with why), and notes.

    Campaign files go to ``out_dir``, else into the re-test campaign's own directory under the storage
    (``<storage>/<name>/<name>.yaml``, beside the receipts its sweep will write).
    """
    from ablate.sweep.layout import Layout

    defaults_path = Path(defaults_path)
    targets, refused, notes = find_targets(defaults_path, repeat)
    plans = []
    for target in targets:
        try:
            source, sweep, baseline = campaign_lane(target, list(campaigns), defaults_path)
            name = campaign_name(target)
            n_blocks, n_aa, n_rounds, thin = retest_size(sweep, policy, blocks, rounds, aa_blocks)
            if target.policy and target.policy != policy.ref:
                thin.append(f"promoted under policy {target.policy}, re-tested under {policy.ref}")
            directory = out_dir or Layout.for_campaign(name, storage or sweep.tracking.storage).local_dir
            path = Path(directory) / f"{name}.yaml"
            write_campaign(path, campaign_document(target, sweep, baseline, defaults_path, name=name,
                                                   blocks=n_blocks, aa_blocks=n_aa), target)
        except ConfigError as exc:
            refused.append(exc)
            continue
        plans.append(RetestPlan(target=target, campaign_path=path, source=source, name=name, blocks=n_blocks,
                                aa_blocks=n_aa, rounds=n_rounds, thin=thin))
    return plans, refused, notes


# --- 3. running it ---


def runnable(plans: list[RetestPlan]) -> tuple[list[RetestPlan], list[str]]:
    """The plans the Ray cluster (started here when none is) runs on the device their value was won on, and a line
    for each other one: its re-test would measure another lane, so it is left marked for a cluster that runs the
    lane there, and the others still run and are judged."""
    import ray

    from ablate.config.auto_device import cluster_device
    from ablate.sweep.run import ensure_ray

    ensure_ray()
    gpus = ray.cluster_resources().get("GPU", 0.0)
    kept, skipped = [], []
    for plan in plans:
        runs_on = cluster_device(load_sweep(plan.campaign_path)[0].lane, gpus)
        if plan.target.device_class and runs_on != plan.target.device_class:
            skipped.append(f"{plan.name}: not run: {plan.target.feature}={plan.target.value!r} was won on "
                           f"{plan.target.device_class} and this cluster runs its lane on {runs_on}; it stays marked "
                           f"for a cluster that runs it on {plan.target.device_class}")
        else:
            kept.append(plan)
    return kept, skipped


def run_retests(plans: list[RetestPlan], policy: Policy, *, tracking_uri: Optional[str] = None,
                storage: Optional[str] = None, progress: bool = False,
                say: Callable[[str], None] = print) -> list[Any]:
    """Every round of every plan through ``run_sweep``; returns the sweep summaries.

    Rounds of one campaign start at least ``evidence.min_round_gap_s`` apart, or the rule would count them as
    one round. A sweep that stopped (interrupted, Tune failed) ends the run here: nothing is judged on it.
    """
    from ablate.sweep.run import run_sweep

    summaries = []
    for plan in plans:
        started: Optional[float] = None
        for index in range(plan.rounds):
            if started is not None:
                wait = policy.evidence.min_round_gap_s - (time.monotonic() - started)
                if wait > 0:
                    say(f"waiting {wait:.0f} s: rounds start at least {policy.evidence.min_round_gap_s:g} s apart")
                    time.sleep(wait)
            started = time.monotonic()
            say(f"{plan.name}: round {index + 1} of {plan.rounds}")
            summary = run_sweep(plan.campaign_path, tracking_uri=tracking_uri, storage=storage, progress=progress,
                                device=plan.target.device_class)
            summaries.append(summary)
            if summary.interrupted or summary.fatal:
                raise RuntimeError(f"sweep {summary.sweep_id} of {plan.campaign_path} stopped "
                                   f"({summary.fatal or 'interrupted'}); nothing was judged or written")
    return summaries


def receipts_of(summaries: list[Any]) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """The receipts these sweeps wrote (files are the source of truth; MLflow has the same ones)."""
    from ablate.receipts.store import load_receipts_from

    sweeps = {s.sweep_id for s in summaries}
    receipts, rejected = load_receipts_from(sorted({s.sweep_dir for s in summaries}))
    return [r for r in receipts if r.identity.sweep_id in sweeps], rejected


# --- 4. the verdict and what it does ---


def defaults_before(defaults_path: Path, targets: list[Target], directory: Path) -> Path:
    """A copy of the defaults with each target's value set back to ``previous``: the defaults the promotion was
    decided against, so the rule's "measured against the current default" clause judges the re-test the same
    way. Written next to the re-test campaigns; the real file is untouched."""
    yaml = _yaml()
    doc = yaml.load(defaults_path.read_text())
    for t in targets:
        entry = doc["features"][t.feature]
        if t.scope == "global":
            entry["value"] = _node(t.previous if t.replaced is None else t.replaced)
            # The lane's own override, when the global promotion moved it onto the value, held ``previous``.
            for override in entry.get("lane_overrides") or []:
                if override.get("report") == t.report and str(override.get("lane_shape")) == str(t.lane_shape):
                    override["value"] = _node(t.previous)
            continue
        override = _overrides_by_shape(entry).get(str(t.lane_shape))
        if override is not None:
            override["value"] = _node(t.previous)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "defaults.before-revalidation.yaml"
    with path.open("w") as handle:
        yaml.dump(doc, handle)
    load_defaults(path)
    return path


LOST_WIN = ("not_flaky", "quality_not_worse", "win_possible")
"""REJECT clauses that measure the win gone (a flaky candidate, a worse loss, no meaningful win)."""


def _why_a_reject_keeps(target: Target, v: FeatureVerdict, policy: Policy) -> tuple[Optional[str], str]:
    """(why this re-test's REJECT does not show the win gone, None when it does; the reason a demotion gives).

    The rule REJECTs on one gated candidate arm (a code about what the feature did; a node's facts leave the arm out
    and reject nothing, ``rule.NODE_FACTS``): right for a promotion (nothing is written), too little to take a
    default away from every run (found in review: one gated arm of twelve demoted a 5% win). A gate demotes
    when its arms are on evidence.min_hosts hosts and gated more often than the baseline's (Fisher, as the flaky
    clause), counting only codes about what the feature did; behind a thinner gate a measured lost win still
    demotes."""
    deciding = v.clauses[-1].name if v.clauses else ""
    lane = f"lane {target.lane_key[:12]}"
    if deciding == "not_inert" and target.scope == "global":
        # A global value was flipped because every measured lane promoted it; on this lane it now does nothing
        # (say the new software falls back to the reference path here), which says nothing about the lanes where
        # it acts: demoting it would take their win away on no evidence from them.
        return (f"the toggle is inert on {lane} under the new software, which says nothing about the lanes where "
                f"it acts; once it has been measured on one of those, set features.{target.feature}.value back or "
                f"clear the mark by hand"), ""
    thin: list[str] = []
    if deciding == "no_disqualifier":
        thin = [why for short, why in (
            (v.gated_hosts < policy.evidence.min_hosts,
             f"on {v.gated_hosts} host(s) < {policy.evidence.min_hosts} (evidence.min_hosts)"),
            (v.gate_fisher_p >= policy.failures.fisher_alpha,
             f"{v.gated_own_arms} gated candidate arm(s), not more often than the baseline's (Fisher "
             f"p={v.gate_fisher_p:.3g})")) if short]
    elif deciding == "exact_counters" and v.counter_hosts < policy.evidence.min_hosts:
        thin = [f"on {v.counter_hosts} host(s) < {policy.evidence.min_hosts} (evidence.min_hosts)"]
    if not thin:
        return None, v.reason
    lost = next((c for c in v.also_rejected if c.name in LOST_WIN or (
        c.name == "exact_counters" and v.counter_hosts >= policy.evidence.min_hosts)), None)
    if lost is not None:
        return None, f"{lost.detail} (behind a gate too thin to demote on alone: {v.reason})"
    return (f"the gate is too thin to demote on ({'; '.join(thin)}; a node's priority, hardware or failed node "
            f"check and INERT_TOGGLE count as none), and no other clause shows the win gone"), ""


def outcome_of(target: Target, v: Optional[FeatureVerdict], policy: Policy, *, report_id: str, campaign: str,
               date: str, sweeps: list[str]) -> RevalidationOutcome:
    """PROMOTE confirms, REJECT demotes, anything else keeps the value with the mark (see the module docstring)."""
    keep, demoted_because = (_why_a_reject_keeps(target, v, policy) if v is not None and v.verdict == REJECT
                             else (None, ""))
    other_device = bool(v and target.device_class and v.device_class and v.device_class != target.device_class)
    other_shape = bool(v and target.lane_shape and v.lane_shape and v.lane_shape != target.lane_shape)
    another_lane = other_device or other_shape  # measured another lane: it settles nothing (find_targets)
    if v is None:
        outcome, reason = UNCONFIRMED, "the re-test gave no verdict for this value on this lane (no usable block)"
    elif other_device:
        # A lane with hardware.device: auto runs where its cluster puts it: a CUDA re-test of a value won on CPU
        # measures another lane, and must neither confirm it nor demote it.
        outcome, reason = UNCONFIRMED, (f"re-tested on {v.device_class} ({v.verdict}), but the value was won on "
                                        f"{target.device_class}: re-test it where its arms ran (a machine whose "
                                        f"cluster runs the lane on {target.device_class}); the value stays, still "
                                        f"marked")
    elif other_shape:
        # One lane key, two shapes: the record hashed the lane's hardware.device: auto as written, as records did
        # before a shape named the device its arms ran on; an override or demotion keyed by it is applied nowhere.
        outcome, reason = UNCONFIRMED, (f"the record names lane shape {target.lane_shape} and the re-test measured "
                                        f"the lane as {v.lane_shape} on {v.device_class or 'an unknown device'} (a "
                                        f"record keyed by hardware.device: auto as written): set its lane_shape, "
                                        f"and its lane override's, to the lane's on the device its evidence ran on "
                                        f"({v.lane_shape} if that is {v.device_class or 'it'}), then re-test; the "
                                        f"value stays, still marked")
    elif v.software_fingerprint == target.recorded_fingerprint:
        outcome, reason = UNCONFIRMED, (f"re-tested under the software it was promoted on ({v.software_fingerprint}), "
                                        f"which says nothing about the new software ({v.verdict}: {v.reason}); the "
                                        f"value stays, still marked")
    elif v.verdict == PROMOTE:
        outcome, reason = CONFIRMED, "the win holds under the new software"
    elif v.verdict == REJECT and target.scope == "global" and target.replaced is None:
        # The record's ``previous`` is this lane's baseline, not necessarily the global value the promotion
        # replaced (a lane running an override): restoring it could install a value that was never the default.
        outcome, reason = UNCONFIRMED, (f"the win is gone on lane {target.lane_key[:12]} ({v.reason}), but the record "
                                        f"does not say which global value the promotion replaced: set "
                                        f"features.{target.feature}.value back by hand; the value stays marked")
    elif v.verdict == REJECT and keep is not None:
        outcome, reason = UNCONFIRMED, f"REJECT ({v.reason}), but {keep}; the value stays, still marked"
    elif v.verdict == REJECT:
        outcome, reason = DEMOTED, demoted_because
    else:
        outcome, reason = UNCONFIRMED, f"inconclusive ({v.verdict}): {v.reason}; the value stays, still marked"
    retest = {"report": report_id, "date": date, "sweeps": sweeps, "verdict": v.verdict if v else None,
              "outcome": outcome, "reason": reason, "policy": policy.ref,
              "software_fingerprint": v.software_fingerprint if v else None,
              "device_class": (v.device_class or None) if v else None, **({"another_lane": True} if another_lane
                                                                          else {})}
    evidence = None
    if v is not None:
        retest.update(speedup=None if v.speedup is None else round(float(v.speedup), 4),
                      ci95=[None if x is None else round(float(x), 4) for x in (v.ci95 or (None, None))],
                      blocks=v.n_blocks, hosts=v.n_hosts)
        if outcome == CONFIRMED:
            # The confirmed value still replaced what the first promotion replaced: the fresh record says so, or a
            # later re-test that finds the win gone could not demote it (a global record without ``replaced``).
            evidence = {**evidence_record(v, report_id=report_id, campaign=campaign, date=date, policy=policy,
                                          scope=target.scope, replaced=target.replaced), "revalidates": target.report}
    return RevalidationOutcome(
        feature=target.feature, value=target.value, lane_key=target.lane_key,
        recorded_fingerprint=target.recorded_fingerprint, current_fingerprint=target.current_fingerprint,
        report=target.report, outcome=outcome, verdict=v.verdict if v else None, reason=reason,
        previous=target.previous, replaced=target.replaced, scope=target.scope, lane_shape=target.lane_shape,
        retest=retest,
        evidence=evidence)


def demotion_changes(defaults_path: Path, outcomes: list[RevalidationOutcome], report_id: str,
                     date: str) -> list[DefaultsChange]:
    """The defaults-diff rows, read off what ``apply_outcome`` does to a copy of the file (nothing is written):
    the outcome alone does not say it (a lane demotion removes an override or sets it back, a global one restores
    ``replaced``, not the lane's ``previous``, and moves overrides the promotion carried along)."""
    doc = _yaml().load(defaults_path.read_text())
    features = doc.get("features") or {}
    changes = []
    for o in outcomes:  # in order and all of them, as write_defaults applies them
        entry = features.get(o.feature)
        if not isinstance(entry, Mapping):
            continue
        value = entry.get("value")
        overrides = {shape: override.get("value") for shape, override in _overrides_by_shape(entry).items()}
        if not any(e.kind == "demote" for e in apply_outcome(features, o, report_id, date)):
            continue
        after = {shape: override.get("value") for shape, override in _overrides_by_shape(entry).items()}
        moved = {shape: (overrides.get(shape), after.get(shape)) for shape in sorted({*overrides, *after})
                 if shape not in overrides or shape not in after or str(overrides[shape]) != str(after[shape])}
        flipped = str(entry.get("value")) != str(value)
        changes.append(DefaultsChange(feature=o.feature, old=value, new=entry.get("value") if flipped else None,
                                      scope="global" if flipped else "lane", lanes=[o.lane_key],
                                      override_edits=moved))
    return changes


def _place(o: RevalidationOutcome) -> tuple[str, str, str]:
    """Which value in the file an outcome is about: the global value, or one lane shape's override."""
    return o.feature, str(o.value), "global" if o.scope == "global" else f"lane {o.lane_shape}"


def _nothing_to_put_back(defaults_path: Path, outcomes: list[RevalidationOutcome], report_id: str,
                         date: str) -> list[RevalidationOutcome]:
    """A demotion that would edit nothing (what the promotion replaced runs already, or the override it moved was
    edited since) stays unconfirmed: resolving the mark "demoted" left the lane on the losing value for good and the
    report claimed a move that was never written (found in review). Applied to a copy, in order, as written."""
    features = _yaml().load(defaults_path.read_text()).get("features") or {}
    kept, demoted = [], {}
    for o in outcomes:
        edits = apply_outcome(features, o, report_id, date)
        place = _place(o)
        if o.outcome == DEMOTED and any(e.kind == "demote" for e in edits):
            demoted[place] = o.lane_key[:12]
        elif o.outcome == DEMOTED and place in demoted:
            # Another lane's re-test of the same value, earlier in this report, already put it back.
            reason = f"{o.reason} (put back with lane {demoted[place]}'s re-test)"
            o = dataclasses.replace(o, reason=reason, retest={**o.retest, "reason": reason})
        elif o.outcome == DEMOTED:
            reason = (f"{o.reason}; but nothing in the file puts back what the promotion replaced (it runs already, or "
                      f"the override the promotion moved was edited since): set features.{o.feature} back by hand; "
                      f"the value stays, still marked")
            o = dataclasses.replace(o, outcome=UNCONFIRMED, reason=reason,
                                    retest={**o.retest, "outcome": UNCONFIRMED, "reason": reason})
        kept.append(o)
    return kept


def settle_conflicts(outcomes: list[RevalidationOutcome]) -> list[RevalidationOutcome]:
    """Re-tests of one value in one place (the global value, or one lane shape's override) that disagree, one
    confirming and one demoting, both stay unconfirmed: applied one by one, the order of the evidence records chose
    what the file ends with, and a confirmed lane's win ran nowhere while its mark was resolved (found in review).
    The promotion rule itself keeps a value promoted in one lane and rejected in another off the global default."""
    places: dict[tuple[str, str, str], list[int]] = {}
    for i, o in enumerate(outcomes):
        places.setdefault(_place(o), []).append(i)
    settled = list(outcomes)
    for (feature, value, where), indices in places.items():
        lanes = {kind: sorted(outcomes[i].lane_key[:12] for i in indices if outcomes[i].outcome == kind)
                 for kind in (CONFIRMED, DEMOTED)}
        if not (lanes[CONFIRMED] and lanes[DEMOTED]):
            continue
        for i in indices:
            o = outcomes[i]
            if o.outcome not in (CONFIRMED, DEMOTED):
                continue
            reason = (f"conflicting re-tests of {feature}={value} ({where}): the win holds on lane(s) "
                      f"{', '.join(lanes[CONFIRMED])} and is gone on lane(s) {', '.join(lanes[DEMOTED])}; decide by "
                      f"hand (the promotion rule would keep it only as the confirming lanes' overrides); the value "
                      f"stays, still marked (this lane: {o.verdict}, {o.reason})")
            settled[i] = dataclasses.replace(o, outcome=UNCONFIRMED, reason=reason, evidence=None,
                                             retest={**o.retest, "outcome": UNCONFIRMED, "reason": reason})
    return settled


def _supporting(entry: Mapping[str, Any], value: Any, leaving: set[str], leaving_shapes: set[str]) -> list[str]:
    """Lane keys of the global records that still hold ``value`` up: not resolved by a re-test (history), not among
    ``leaving`` (this report demotes them), not on a shape this report demotes (its lane gets the same override:
    a record there would keep the global value up with no lane left to re-test it on, found in review), and on a
    lane that runs the global value (no override of another)."""
    overrides = {str(o.get("lane_shape")): o.get("value") for o in entry.get("lane_overrides") or []
                 if isinstance(o, Mapping)}
    keys = []
    for record in entry.get("evidence") or []:
        if not isinstance(record, Mapping) or str(record.get("scope") or "global") != "global":
            continue
        mark = record.get("revalidate")
        if str(record.get("value")) != str(value) or (isinstance(mark, Mapping) and mark.get("required") is False):
            continue
        key, shape = str(record.get("lane_key")), str(record.get("lane_shape"))
        if key in leaving or shape in leaving_shapes or (shape in overrides and str(overrides[shape]) != str(value)):
            continue
        keys.append(key)
    return sorted(set(keys))


def limit_global_demotions(defaults_path: Path, outcomes: list[RevalidationOutcome]) -> list[RevalidationOutcome]:
    """A global value is demoted for every lane only when every lane whose record holds it up lost its win on
    re-test. While other lanes' records still support it, a lane that lost the win gets its own override back to
    the value its re-test measured against, and those lanes are marked for a re-test (found in review: one CPU
    lane's re-test restored the old value on every lane, GPU lanes that measured the win and were never re-tested
    included, and which value ended global depended on how the re-tests were batched)."""
    features = _yaml().load(defaults_path.read_text()).get("features") or {}
    leaving: dict[tuple[str, str], set[str]] = {}
    shapes: dict[tuple[str, str], set[str]] = {}
    for o in outcomes:
        if o.outcome == DEMOTED and o.scope == "global":
            leaving.setdefault((o.feature, str(o.value)), set()).add(o.lane_key)
            shapes.setdefault((o.feature, str(o.value)), set()).update([str(o.lane_shape)] if o.lane_shape else [])
    limited = []
    for o in outcomes:
        entry = features.get(o.feature)
        place = (o.feature, str(o.value))
        others = (_supporting(entry, o.value, leaving[place], shapes[place])
                  if o.outcome == DEMOTED and o.scope == "global" and isinstance(entry, Mapping) else [])
        if others and o.lane_shape is None:
            reason = (f"{o.reason}; lane(s) {', '.join(k[:12] for k in others)} still hold the global value up and "
                      f"the record does not name its lane shape, so the demotion cannot be limited to this lane: "
                      f"the value stays, still marked")
            o = dataclasses.replace(o, outcome=UNCONFIRMED, reason=reason,
                                    retest={**o.retest, "outcome": UNCONFIRMED, "reason": reason})
        elif others:
            reason = (f"{o.reason}; this lane goes back to {o.previous!r} (a lane override), the global {o.value!r} "
                      f"stays: lane(s) {', '.join(k[:12] for k in others)} still hold it up (a record not measured "
                      f"under this re-test's software is marked for a re-test)")
            o = dataclasses.replace(o, reason=reason, still_supported_by=tuple(others),
                                    retest={**o.retest, "reason": reason})
        limited.append(o)
    return limited


def _verdict_for(target: Target, verdicts: list[FeatureVerdict]) -> Optional[FeatureVerdict]:
    return next((v for v in verdicts if v.feature == target.feature and str(v.value) == str(target.value)
                 and v.lane_key == target.lane_key and str(v.baseline_value) == str(target.previous)), None)


def judge(targets: list[Target], receipts: list[Receipt], policy: Policy, defaults_path: str | Path, *,
          workdir: Path, rejected: Iterable[tuple[str, str]] = (), now: Optional[datetime] = None
          ) -> PromotionResult:
    """The promotion rule on the re-test receipts; the result carries one ``RevalidationOutcome`` per target
    (``write_defaults`` writes them) and, for each demoted global value, a defaults-diff row."""
    from ablate.promote.engine import promote

    defaults_path = Path(defaults_path)
    decided_on = defaults_path.read_text()  # the outcomes are planned against this file, not against ``before``
    before = defaults_before(defaults_path, targets, workdir)
    result = promote(receipts, policy_path=policy, defaults_path=before, rejected=rejected,
                     now=now or datetime.now(timezone.utc))
    outcomes = []
    for target in targets:
        sweeps = sorted({r.identity.sweep_id for r in receipts if r.identity.lane_key == target.lane_key})
        outcomes.append(outcome_of(target, _verdict_for(target, result.verdicts), policy,
                                   report_id=result.report_id, campaign=result.campaign, date=result.date,
                                   sweeps=sweeps))
    outcomes = _nothing_to_put_back(defaults_path, limit_global_demotions(defaults_path, settle_conflicts(outcomes)),
                                    result.report_id, result.date)
    # What this report changes is the outcomes, not the promotions the rule would plan against the old defaults.
    result.changes = demotion_changes(defaults_path, outcomes, result.report_id, result.date)
    result.revalidations = list(outcomes)
    result.defaults_path = str(defaults_path)
    result.defaults_text = decided_on
    return result
