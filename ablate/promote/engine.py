"""``promote``: receipts in, a ``PromotionResult`` (verdicts, defaults diff, report) out. Nothing is written.

How to use::

    receipts, rejected = load_receipts("ablate_runs/smoke")
    result = promote(receipts, policy_path="search_spaces/policies/default.yaml",
                     defaults_path="search_spaces/defaults.yaml", rejected=rejected)
    print(result.markdown)                 # PR body
    write_defaults(result, "search_spaces/defaults.yaml")   # --write

Steps: 1. validate (dicts are parsed, invalid ones join ``rejected``); 2. pair receipts into blocks, refusing
anything unmatched; 3. organise blocks into feature x value x lane tests under each lane's current software
fingerprint, with A/A calibration; 4. measure each test (clustered bootstrap); 5. Holm + clauses -> verdicts;
6. bundle check: two or more values promoted in one lane are written only if bundle blocks show they win
together; 7. plan the defaults edit and find recorded evidence that needs revalidation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import statistics
import textwrap
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from ablate.config.lane_shape import AUTO, DEVICE_CLASSES, DEVICE_KEY
from ablate.config.load import load_defaults
from ablate.config.schema import ConfigError
from ablate.parallel import fork_map
from ablate.promote.analysis import FeatureVerdict, analyse
from ablate.promote.bundle import check_bundles, held_keys
from ablate.promote.defaults_writer import UnjudgedLane, find_revalidations, plan_changes
from ablate.promote.evidence import (Calibration, SweepWindow, TestEvidence, epoch_s, organise, rounds_of_test,
                                     shape_key, startup_outliers, sweep_windows)
from ablate.promote.match import BUNDLE, Block, Refusal, device_class, match_blocks, software_key
from ablate.promote.policy import Policy, load_policy
from ablate.promote.report import LaneSummary, PromotionResult
from ablate.promote.rule import apply_holm, decide_all, sprt_of
from ablate.promote.sequential import LOWER, UPPER
from ablate.receipts.rejection import UnreadArm, from_identity, from_left_out, unread_arms
from ablate.receipts.schema import InvalidReceipt, Receipt, utc_moment, validate_receipt
from ablate.redact import redact_text

ANALYSE_MIN_SHARE = 4
"""Fewer tests per process than this are measured in this process (a fork costs more than a few tests)."""


def _validated(receipts: Iterable[Receipt | Mapping[str, Any]]) -> tuple[list[Receipt], list[tuple[str, str]]]:
    """Parsed receipts, each id once, and (id, why) for the rest.

    Identical copies of one receipt id count once; copies whose contents differ are a conflict and every copy
    is refused (nothing says which one is the true record; ``load_receipts`` does the same for files).
    """
    copies: dict[str, list[tuple[int, Receipt]]] = defaultdict(list)
    rejected: list[tuple[str, str]] = []
    for index, item in enumerate(receipts):
        if isinstance(item, Receipt):
            receipt = item  # made by validate_receipt (load_receipts, the MLflow reader): checked once there
        else:
            try:
                receipt = validate_receipt(dict(item))
            except (InvalidReceipt, ValueError, TypeError) as exc:  # pydantic's errors are ValueErrors
                rid = (item.get("identity") or {}).get("receipt_id") if isinstance(item, Mapping) else None
                rejected.append(from_identity(str(rid or f"receipts[{index}]"), str(exc), item))
                continue
        copies[receipt.identity.receipt_id].append((index, receipt))
    valid: list[Receipt] = []
    for rid, found in copies.items():
        # Dumped only when an id has several copies: dumping every receipt to compare nothing was 2 s of 10k.
        first = found[0][1].model_dump(mode="json") if len(found) > 1 else None
        if all(other.model_dump(mode="json") == first for _, other in found[1:]):
            valid.append(found[0][1])
            continue
        where = ", ".join(f"receipts[{i}]" for i, _ in found)
        rejected += [from_identity(rid, f"conflicting copies of receipt {rid} ({where}) differ in content: every copy "
                                        f"is refused until the wrong one is removed", copy.model_dump(mode="json"))
                     for _, copy in found]
    return valid, rejected


def _report_id(campaigns: list[str], receipts: list[Receipt], policy: Policy) -> str:
    # Same receipts under the same policy -> same id, so re-running promote reproduces the report name.
    digest = hashlib.sha256()
    for rid in sorted(r.identity.receipt_id for r in receipts):
        digest.update(rid.encode())
    digest.update(policy.ref.encode())
    name = campaigns[0] if len(campaigns) == 1 else f"{len(campaigns)}-campaigns"
    # The id names files (reports/promotions/<id>.md) and a YAML comment: a campaign name from a receipt must
    # not bring a path separator, a line break or anything a shell or Markdown would read.
    name = re.sub(r"[^0-9A-Za-z_.-]+", "_", name).strip("._")[:64] or "campaign"
    return f"promote-{name}-{digest.hexdigest()[:10]}"


def _rounds(blocks: list[Block]) -> list[dict[str, Any]]:
    info: dict[str, dict[str, Any]] = {}
    for block in blocks:
        entry = info.setdefault(block.round_id, {"round_id": block.round_id, "first_at": block.created_at,
                                                 "last_at": block.created_at, "blocks": 0})
        entry["blocks"] += 1
        entry["first_at"] = min(entry["first_at"], block.created_at)
        entry["last_at"] = max(entry["last_at"], block.created_at)
    return sorted(info.values(), key=lambda r: (r["first_at"], r["round_id"]))


def _unique_not_run(rows: Iterable[Mapping[str, str]]) -> list[dict[str, str]]:
    """Each (what, why) once, with the rounds that refused it (every round of a campaign repeats its plan)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        entry = merged.setdefault((row["what"], row["why"]), {"what": row["what"], "why": row["why"],
                                                              "campaign": row.get("campaign", ""), "rounds": []})
        entry["rounds"].append(row.get("sweep_id", ""))
    return [{**e, "rounds": ", ".join(sorted(set(e["rounds"])))} for e in merged.values()]


def _lane_facts(blocks: list[Block]) -> dict[str, Any]:
    """What a reader needs to recognise a lane beyond its hash, and how much of each arm start-up ate."""
    arms = [arm for b in blocks for arm in (b.baseline, b.candidate)]
    shares = [a.startup_s / a.wall_s for a in arms if a.startup_s is not None and a.wall_s]
    threads = sorted({a.threads for a in arms if a.threads is not None})
    devices = Counter(b.device_class for b in blocks if b.device_class)
    lane = blocks[-1].lane if blocks else {}
    return {"device_class": devices.most_common(1)[0][0] if devices else "unknown",
            "threads": threads, "world_size": int(lane.get("engine.workers") or 1),
            "horizon_steps": blocks[-1].horizon_steps if blocks else 0,
            "startup_share": statistics.median(shares) if shares else None,
            "startup_s": _median_or_none([a.startup_s for a in arms if a.startup_s is not None]),
            "wall_s": _median_or_none([a.wall_s for a in arms if a.wall_s])}


def _median_or_none(values: list[float]) -> Optional[float]:
    # A lane of failed arms only may record neither (the validator waives a failed arm's time accounting).
    return statistics.median(values) if values else None


def _git(blocks: list[Block]) -> dict[str, Any]:
    base = sorted({b.baseline.git_sha for b in blocks if b.baseline.git_sha})
    cand = sorted({b.candidate.git_sha for b in blocks if b.candidate.git_sha and not b.is_aa})
    dirty = any(arm.git_dirty for b in blocks for arm in (b.baseline, b.candidate))
    return {"baseline": base, "candidate": cand, "dirty": dirty}


def _with_partner_fingerprints(unread: list[UnreadArm], valid: list[Receipt]) -> list[UnreadArm]:
    """An unread arm that died unobserved takes its block partner's fingerprint when the partner was read and
    observed its hardware: the two ran the same code on the same node. Otherwise it stays unknown (None: it
    concerns the lane's current fingerprint, the conservative side)."""
    partners: dict[tuple[str, str, int], str] = {}
    for receipt in valid:
        ident = receipt.identity
        if ident.hardware_fingerprint:  # the same attempt: a resumed sweep's retry may run other code
            partners[(ident.sweep_id, ident.block_id, ident.attempt)] = ident.software_fingerprint
    return [dataclasses.replace(arm, software_fingerprint=partners[arm.block])
            if arm.software_fingerprint is None and arm.block in partners else arm for arm in unread]


def _unseen_as_unknown(unread: list[UnreadArm], blocks: list[Block]) -> list[UnreadArm]:
    """An unread arm under a fingerprint no matched block of its lane has may be newer software than any read: it
    concerns the lane's current test (fingerprint unknown), so unreadable newest sweeps cannot make older software's
    evidence the current one (found in review: the newest round's runs deleted, or only its baselines readable and
    so refused unpaired, and the older rounds promoted). An unread arm of a fingerprint among the matched blocks'
    keeps it: superseded evidence holds nothing; so does one written before the lane's newest matched block (the
    block whose software is current), whatever its fingerprint. One that cannot be placed in time (an arm run
    logged before runs carried ``ablate.created_at``) holds the current test: restore it, or purge it."""
    seen: dict[str, set[str]] = defaultdict(set)
    for block in blocks:
        seen[block.lane_key].add(block.software_fingerprint)
    newest = _newest_block_s(blocks)
    return [dataclasses.replace(arm, software_fingerprint=None)
            if arm.software_fingerprint is not None and arm.software_fingerprint not in seen[arm.lane_key]
            and not _written_before(arm.created_at, newest.get(arm.lane_key)) else arm
            for arm in unread]


def _refused_newer(refusals: list[Refusal], valid: list[Receipt], blocks: list[Block]) -> list[UnreadArm]:
    """The candidate arms of refused blocks that ran software no matched block of their lane ran (neither its
    fingerprint nor its packages and code: another node's driver, or no hardware observed, is the same software),
    after the lane's newest matched block: as an unread arm of unseen software does (``_unseen_as_unknown``), each
    holds the lane's current test, so a newest round whose every block was refused (both arms at low priority, say)
    cannot leave older software's evidence current (found in review: lane B's older rounds promoted, its newest round
    was all refused, and the flip went global). A crashed candidate is left to the failure counts
    (``evidence.placed_failures``); bundle blocks to the bundle check. Refused blocks of software already matched
    hold nothing: they are only blocks that measured nothing."""
    prints: dict[str, set[str]] = defaultdict(set)
    keys: dict[str, set[str]] = defaultdict(set)
    for block in blocks:
        prints[block.lane_key].add(block.software_fingerprint)
        keys[block.lane_key].add(block.software_key)
    newest = _newest_block_s(blocks)
    by_id = {r.identity.receipt_id: r for r in valid}
    arms = []
    for refusal in refusals:
        if not (refusal.feature and refusal.feature != BUNDLE and refusal.lane_key and refusal.ran_a_registered_value):
            continue
        why = _quoted(refusal.reason)
        for receipt in (by_id[rid] for rid in refusal.receipt_ids if rid in by_id):
            ident = receipt.identity
            if ident.arm.value != "candidate" or ident.status.value == "failed" \
                    or ident.software_fingerprint in prints[ident.lane_key] \
                    or software_key(ident) in keys[ident.lane_key] \
                    or _written_before(ident.created_at, newest.get(ident.lane_key)):
                continue
            arms.append(UnreadArm(origin=f"block {ident.block_id} of sweep {ident.sweep_id}, refused: {why}",
                                  lane_key=ident.lane_key, feature=ident.feature, software_fingerprint=None,
                                  receipt_id=ident.receipt_id, created_at=ident.created_at, refused=True))
    return arms


def _written_before(stamp: Optional[str], moment: Optional[float]) -> bool:
    # Only a stamp the validator would accept places an arm (found in review: a receipt refused for a local time
    # without its offset was read as UTC, hours early, and its newer software held nothing).
    written = utc_moment(stamp)
    return written is not None and moment is not None and written.timestamp() < moment


def _newest_block_s(blocks: list[Block]) -> dict[str, float]:
    """Lane key -> when its newest block was made (epoch seconds): the block whose software is the lane's current."""
    newest: dict[str, float] = {}
    for block in blocks:
        newest[block.lane_key] = max(newest.get(block.lane_key, -math.inf), epoch_s(block.created_at))
    return newest


def _left_out_arms(left_out: Iterable[Receipt], blocks: list[Block]) -> list[UnreadArm]:
    """The speed arms a ``--sweep`` selection left out, each marked newer when it ran after the selection's last
    block of its lane (``from_left_out``)."""
    last_at = _newest_block_s(blocks)
    arms = []
    for receipt in left_out:
        lane = receipt.identity.lane_key
        arm = from_left_out(receipt, newer=lane in last_at and epoch_s(receipt.identity.created_at) > last_at[lane])
        if arm is not None:
            arms.append(arm)
    return arms


def _unjudged_lanes(unread: list[UnreadArm], left_out: list[Receipt], refusals: list[Refusal],
                    valid: list[Receipt], policy: Policy) -> dict[str, dict[str, UnjudgedLane]]:
    """Feature -> lane key -> why the lane's arms of that feature were not judged here: left out by ``--sweep``,
    unreadable, or in blocks that were all refused (a lane with a test of the feature is dropped by
    ``plan_changes``, which keeps the others from a global flip and, by shape, from an override). Simulated arms
    and unregistered values ran no value the registry can promote: they say nothing of the lane."""
    readable = {r.identity.receipt_id: r for r in [*left_out, *valid]}
    causes: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    lane_shapes: dict[tuple[str, str], str] = {}

    def note(feature: str, lane_key: str, kind: str, cause: str, receipt_ids: Iterable[str]) -> None:
        causes[feature, lane_key].setdefault(kind, cause)  # the first refusal of a lane, in block order
        if (feature, lane_key) not in lane_shapes:  # one shape per lane, hashed only for the lanes noted
            # A receipt of an auto lane that names no device (its arm died unobserved) cannot say which shape the
            # lane ran as: with none that can, the shape stays unknown and blocks every override of the feature.
            known = next((readable[rid] for rid in receipt_ids if rid in readable and _placed(readable[rid])), None)
            if known is not None:
                lane_shapes[feature, lane_key] = shape_key(known.requested.lane, policy, device_class(known))

    for arm in unread:
        if arm.feature:
            kind = LEFT_OUT if arm.left_out else UNREADABLE
            note(arm.feature, arm.lane_key, kind, kind, [arm.receipt_id])
    for refusal in sorted(refusals, key=lambda r: (r.round_id or "", r.block_id)):
        if refusal.feature and refusal.lane_key and refusal.ran_a_registered_value:
            # Whatever refused them (a disqualified baseline, a missing partner, a replayed copy): nothing measured
            # the feature there, so nothing says it does not lose there.
            note(refusal.feature, refusal.lane_key, REFUSED, f"{REFUSED}, e.g. '{_quoted(refusal.reason)}'",
                 refusal.receipt_ids)
    lanes: dict[str, dict[str, UnjudgedLane]] = defaultdict(dict)
    for (feature, lane_key), by_kind in causes.items():
        lanes[feature][lane_key] = UnjudgedLane(
            why=" and ".join(by_kind[kind] for kind in (LEFT_OUT, UNREADABLE, REFUSED) if kind in by_kind),
            left_out=LEFT_OUT in by_kind, shape=lane_shapes.get((feature, lane_key)))
    return lanes


def _placed(receipt: Receipt) -> bool:
    """Whether the receipt says which lane shape it ran as: its lane names its device, or its arm observed it."""
    return receipt.requested.lane.get(DEVICE_KEY) != AUTO or device_class(receipt) in DEVICE_CLASSES


def _quoted(reason: str) -> str:
    """A refusal's reason as a verdict or change quotes it: redacted before it is cut (a URL's password must not
    survive because its "@" fell past the cut), cut at a word."""
    return textwrap.shorten(redact_text(reason), width=100, placeholder=" ...")


LEFT_OUT = "left out by the --sweep selection"
UNREADABLE = "unreadable"
REFUSED = "its blocks were refused"


_SAFETY_FACTS = ("failures", "fisher_p", "failure_hosts", "refused_failures", "refused_failure_blocks",
                 "gated_disqualifiers", "gated_arms", "counter_violations")
"""What a verdict judged as it stopped still takes from every block: bad news about the feature (a crash, a gated
code on any attempt, a counter above its baseline) is never ignored (found in review: six candidate crashes in a
later round, and a retried block's gated first attempt, were dropped with the blocks and the test promoted)."""


def _as_stopped(test: TestEvidence, v: FeatureVerdict, policy: Policy, windows: dict[str, SweepWindow],
                calibration: Calibration, flags: dict[str, str], curves: bool, family: int) -> FeatureVerdict:
    """``v`` measured again on the blocks its sequential test looked at, when it crossed a bound before blocks that
    came in later: a decided test is judged as it stopped. Measured on every block, the fixed-sample clauses
    (hosts, rounds, win fraction, loss bounds) were judged again with each later block until they passed (found in
    review: a HOLD for "2 hosts < 3" at a rejection became a REJECT once blocks of a third host came in, blocks
    that showed a 10% win and that the test never looked at).

    Only the blocks change: the calibrations are the ones the SPRT itself judged the stop with (today's and every
    earlier one), or the clauses would read another lane than the stop did (a lane calibrated only by later A/A
    blocks held a rejection for good). A cap is not measured again: it holds whatever the blocks, and cut at its
    last round the test would no longer be capped. The failure and gate facts stay those of every block
    (``_SAFETY_FACTS``). If the SPRT on the blocks kept does not stop where it stopped on all of them, the test
    holds and says so (``stop_unmatched``)."""
    if v.kind != "speed" or v.work is None or not v.n_blocks:
        return v
    state = sprt_of(v, policy, family)
    if state.decision not in (UPPER, LOWER) or state.last_looked is None:
        return v
    until = str(np.sort(v.work.created_at.astype(str), kind="stable")[state.last_looked])
    looked = [b for b in test.blocks if str(b.created_at) <= until]
    if len(looked) == len(test.blocks):
        return v
    stopped = dataclasses.replace(test, blocks=looked, rounds=rounds_of_test(looked, policy, windows))
    judged = analyse(stopped, calibration, policy, flags, curve=curves)
    for name in _SAFETY_FACTS:
        setattr(judged, name, getattr(v, name))
    kept = {id(b) for b in looked}
    judged.not_looked_at = [b.block_id for b in test.blocks if id(b) not in kept]
    # A host the stop never saw is bad news the stop could not weigh: its losing median holds a PROMOTE, as the
    # fixed rule's every-host clause would (found by review helper 2: a third round adding a host 6% slower, and
    # the sequential policy promoted globally in 20 of 20 seeds where the fixed one held).
    looked_hosts = {row.host for row in judged.hosts}
    judged.later_losing_hosts = sorted(row.host for row in v.hosts if row.host not in looked_hosts and (
        row.median_speedup is None or row.median_speedup <= 1.0))
    # By member sweeps, not by round id: cut at the stop, a round that merged a looked-at sweep with a later one is
    # the looked-at sweep alone, and its merged id then passed for a round after the stop, confirming a suspicious
    # win with the very round it was judged on (found in review).
    looked_sweeps = {sweep for j in judged.rounds for sweep in (j.members or (j.round_id,))}
    judged.rounds_after_stop = [r for r in v.rounds if not looked_sweeps & set(r.members or (r.round_id,))]
    again = sprt_of(judged, policy, family) if judged.work is not None and judged.n_blocks else None
    if again is None or (again.decision, again.blocks) != (state.decision, state.blocks):
        judged.stop_unmatched = (f"the sequential test stopped ({state.decision}) at block {state.blocks} on every "
                                 f"block, but {again.decision if again else 'nowhere'} at block "
                                 f"{again.blocks if again else 0} on the {len(looked)} block(s) up to that stop")
    return judged


def promote(receipts: Iterable[Receipt | Mapping[str, Any]], *, policy_path: str | Path | Policy,
            defaults_path: str | Path, rejected: Iterable[tuple[str, str]] = (),
            run_links: Optional[Mapping[str, str]] = None, now: Optional[datetime] = None,
            not_run: Iterable[Mapping[str, str]] = (), curves: bool = True,
            left_out: Iterable[Receipt] = ()) -> PromotionResult:
    """Decide every feature x lane test in ``receipts`` under the policy; see the module docstring. ``curves=False``
    skips each test's speed-up-vs-horizon curve, which only the report plots: every verdict, clause and number
    the decision reads is the same (a reader of verdicts alone, the until-decided judge, sets it). ``left_out``:
    readable receipts a ``--sweep`` selection did not keep; a test with arms among them holds."""
    policy = policy_path if isinstance(policy_path, Policy) else load_policy(policy_path)
    now = now or datetime.now(timezone.utc)
    left_out = list(left_out)  # read twice: its unread arms, and its lanes (plan_changes)
    valid, invalid = _validated(receipts)
    # Read before it is parsed: a file changed in between is then one that write_defaults refuses to write over. A
    # file that cannot be read is load_defaults' to refuse, naming it (a ConfigError, not a raw OSError).
    try:
        defaults_text: Optional[str] = Path(defaults_path).read_text()
    except (OSError, UnicodeDecodeError):
        defaults_text = None
    defaults = load_defaults(defaults_path)
    if defaults_text is None:
        raise ConfigError(str(defaults_path), "a file that could not be read as text", "a readable UTF-8 YAML file")
    blocks, refusals = match_blocks(valid, policy)
    bundle_blocks = [b for b in blocks if b.feature == BUNDLE]  # judged by the bundle check, not as a test
    blocks = [b for b in blocks if b.feature != BUNDLE]
    rejected = list(rejected) + invalid
    # A damaged copy of a receipt that was read in another copy leaves no arm unread.
    read = {r.identity.receipt_id for r in valid}
    unread = _unseen_as_unknown(_with_partner_fingerprints(
        [arm for arm in unread_arms(rejected) if arm.receipt_id not in read], valid), blocks)
    unread += [arm for arm in _left_out_arms(left_out, blocks + bundle_blocks) if arm.receipt_id not in read]
    judged_unread = list(unread)  # what _unjudged_lanes reads: a refused block is its own cause there
    unread += _refused_newer(refusals, valid, blocks + bundle_blocks)
    # A sweep's span in time covers its bundle blocks too: two sweeps that overlapped are one round for the single
    # tests and the bundle check alike (found in review: windows over the bundle blocks alone made two
    # concurrent sweeps two rounds, and the set was written).
    windows = sweep_windows(blocks + bundle_blocks)
    tests, calibrations, lanes = organise(blocks, policy, refusals, unread, windows)
    flags = startup_outliers(blocks)
    # Each test is measured on its own (its bootstrap draws from a generator seeded by its key), so the tests are
    # split over the CPUs with results identical to one process's.
    measured = fork_map(lambda test: analyse(test, test.calibration or calibrations[test.lane_key], policy, flags,
                                             curve=curves), tests,
                        min_share=ANALYSE_MIN_SHARE)
    if policy.sequential.enabled:
        family = apply_holm(measured, policy)  # the family the SPRT's upper bound is split over, as decide_all's
        measured = [_as_stopped(test, v, policy, windows, test.calibration or calibrations[test.lane_key], flags,
                                curves, family) for test, v in zip(tests, measured)]
    family = decide_all(measured, policy, defaults)  # the Defaults: rule reads each lane's own default
    for v in measured:
        if v.not_looked_at and not v.stop_unmatched:  # that HOLD says it was not judged on them
            v.reason += (f" (judged on the {v.n_blocks} block(s) up to the sequential test's stop; "
                         f"{len(v.not_looked_at)} later block(s) not looked at)")
    campaigns = sorted({r.identity.campaign for r in valid})
    report_id = _report_id(campaigns, valid, policy)
    date = now.date().isoformat()
    bundles = check_bundles(measured, bundle_blocks, policy, unread, refusals, windows, blocks + bundle_blocks)
    changes = plan_changes(measured, defaults, policy, report_id=report_id,
                           campaign="+".join(campaigns), date=date, held=held_keys(bundles, policy), bundles=bundles,
                           measured_lanes={key: state.lane for key, state in lanes.items()},
                           unjudged_lanes=_unjudged_lanes(judged_unread, left_out, refusals, valid, policy))
    lane_summaries = [LaneSummary(lane_key=k, software_fingerprint=s.current_fingerprint,
                                  fingerprints=s.fingerprints, hosts=s.hosts, calibration=calibrations[k],
                                  lane=s.lane, **_lane_facts([b for b in blocks if b.lane_key == k]))
                      for k, s in sorted(lanes.items())]
    for verdict in measured:
        verdict.work = None  # the arrays served the decision; keep the result light
    return PromotionResult(
        report_id=report_id, date=date, campaigns=campaigns, rounds=_rounds(blocks), policy=policy,
        git=_git(blocks), num_receipts=len(valid), verdicts=measured, holm_family=family, lanes=lane_summaries,
        changes=changes, revalidations=find_revalidations(defaults.raw, lanes), refusals=refusals,
        rejected=rejected, defaults_path=str(defaults_path), run_links=dict(run_links or {}),
        not_run=_unique_not_run(not_run), bundles=bundles, defaults_text=defaults_text)
