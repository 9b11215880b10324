"""``ablate sweep --until-decided``: rounds of blocks only for the tests still undecided, until each is decided.

How to run me: ``ablate sweep search_spaces/smoke.yaml --until-decided --policy
search_spaces/policies/single_node_sequential.yaml`` (under ``ray job submit`` exactly as a fixed campaign;
``--resume`` continues the round a killed driver left, then the rounds after it).

A round is one ordinary sweep of the campaign (its own sweep id, Tune experiment and MLflow parent run), so
"repeated" keeps the meaning the promotion rule gives it. Inside a round, ``UntilDecidedSearcher`` (a Ray Tune
``Searcher``) hands Tune the plan's blocks in plan order, leaving out every block whose test is decided: before
the round from the receipts of earlier rounds, and within it after each finished block. Between rounds the
driver waits out ``evidence.min_round_gap_s`` (closer sweeps are one round to the rule), then starts the next.

"Decided" is read from the promotion rule itself run over every receipt of the campaign (``promote``, the code
``ablate promote --sweep <campaign>`` runs, under the same policy), and only from what sequential looks allow:
- the SPRT crossed a bound (the upper one only once ``evidence.min_rounds`` rounds count) or reached its cap: its
  error bounds hold however often it is looked at (Ville), and its decision is taken at the first crossing;
- an exact REJECT clause failed (an inert toggle, a gated disqualifier, an exact counter): no statistic involved.
The other clauses (quality, order, per-host and per-round wins, flakiness) are fixed-sample tests: they are never
used to stop (stopping at their first pass after every block would promote a worse candidate several times as
often), only to judge the blocks the SPRT stopped at, so an upper crossing they hold ends as HOLD, said why.
A/A blocks, bundle blocks and taxes run in every round (they calibrate and qualify the speed tests, and taxes are
never decided). The campaign ends when no speed test is open (judged before each round, the first included; a test
that crossed a bound but holds for want of A/A blocks beside its own, too few or none on a host its blocks ran on,
stays open: the rule calibrates a test with its own sweeps' A/A blocks only), when ``sequential.max_rounds`` rounds
have run in this invocation, on an interruption or a fatal error (``--resume`` continues), or when a round finishes
no block (said, never looped). A round with errored blocks (an arm that kept crashing) does not end the campaign:
failed candidate arms are evidence the rule judges.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from ray.tune.search import Searcher

from ablate.config.auto_device import cluster_device, planned_device
from ablate.config.lane_shape import AUTO
from ablate.config.schema import ConfigError, LaneConfig
from ablate.promote.analysis import HOLD, PROMOTE, REJECT
from ablate.promote.match import moment_text
from ablate.promote.policy import Policy, load_policy
from ablate.promote.sequential import CAP, LOWER, UPPER
from ablate.receipts.schema import Receipt
from ablate.sweep.plan import SweepPlan, plan_sweep

log = logging.getLogger(__name__)

SpeedKey = tuple[str, str, str]
"""(feature, candidate value as text, lane key): one speed test, in the plan and in the rule alike."""
OPEN, DECIDED = "open", "decided"
EXACT_REJECTIONS = ("not_inert", "no_disqualifier", "exact_counters")
"""REJECT clauses that are exact (no statistic): more blocks cannot undo them, so they end a test at once. The
statistical clauses (flakiness, quality, order, per-host wins) are fixed-sample tests: looked at after every block
and stopped at the first pass or failure, they would be peeked into false answers, so they are left to the verdict
taken on the blocks the SPRT stopped at."""


def speed_key(feature: str, value: Any, lane_key: str) -> SpeedKey:
    # The plan and the rule both hold the registry's view of a value (enum -> str), so str() matches them.
    return (feature, str(value), lane_key)


@dataclass
class Standing:
    """Where one speed test stands after the receipts so far."""

    feature: str
    value: str
    lane_key: str
    state: str
    """open or decided."""
    verdict: str
    why: str
    blocks: int = 0
    rounds: int = 0
    decision: Optional[str] = None
    """The SPRT's: upper, lower, cap, continue (None: no sequential state yet)."""
    llr: Optional[float] = None
    lower: Optional[float] = None
    upper: Optional[float] = None
    trace: list[Optional[float]] = field(default_factory=list)
    """The promotion test's LLR after each block (against ``upper``)."""
    lower_trace: list[Optional[float]] = field(default_factory=list)
    """The rejection test's LLR (hypotheses lowered by the A/A bias bound; against ``lower``)."""
    awaits_aa: bool = False
    """A bound crossed, but the verdict holds for want of A/A blocks beside its own (too few, or none on a host its
    blocks ran on): it stays open, since only a round that runs its blocks and A/A blocks (sent to every node first)
    calibrates it; the rule reads A/A blocks of the test's own sweeps only. Its decision stays the stop's."""

    @property
    def key(self) -> SpeedKey:
        return (self.feature, self.value, self.lane_key)

    @property
    def decided(self) -> bool:
        return self.state == DECIDED

    def line(self) -> str:
        def shown(trace: list[Optional[float]]) -> str:
            return ", ".join(f"{x:+.2f}" for x in [x for x in trace if x is not None][-6:])

        # Each trace beside the bound it is compared with: the promotion test's alone, against both bounds, showed
        # an undecided test far below the lower one (found in review).
        llr = ("LLR n/a" if self.llr is None else
               f"LLR promotion test [{shown(self.trace)}] against {self.upper:.2f}, rejection test "
               f"[{shown(self.lower_trace)}] against {self.lower:.2f}")
        return (f"{self.feature}={self.value} lane {self.lane_key[:12]}: {self.state} ({self.verdict}), "
                f"{self.blocks} block(s) over {self.rounds} round(s), {llr}: {self.why}")


def judge_states(receipts: Iterable[Receipt], policy: Policy, defaults_path: str | Path) -> dict[SpeedKey, Standing]:
    """Every speed test in ``receipts`` judged by the promotion rule under ``policy`` (sequential enabled)."""
    from ablate.promote.engine import promote

    # Verdicts only: no curve (the report's plot), which was most of each look at a small campaign's tests.
    result = promote(list(receipts), policy_path=policy, defaults_path=defaults_path, curves=False)
    states: dict[SpeedKey, Standing] = {}
    for v in result.speed_verdicts:
        seq = v.sequential or {}
        decision = seq.get("decision")
        state = Standing(feature=v.feature, value=str(v.value), lane_key=v.lane_key, state=OPEN, verdict=v.verdict,
                          why=v.reason, blocks=v.n_blocks, rounds=v.n_rounds, decision=decision,
                          llr=seq.get("llr"), lower=seq.get("lower"), upper=seq.get("upper"),
                          trace=list(seq.get("llr_trace") or []), lower_trace=list(seq.get("llr_lower_trace") or []))
        exact = next((c for c in v.clauses if not c.passed and c.name in EXACT_REJECTIONS), None)
        if decision == UPPER and _awaits_confirmation(v, policy):
            # A suspicious win's confirming round comes after the decision (promotion-rule.md §5.5.8): closed, the
            # campaign ended "every test decided" and that round never ran (found in review).
            state.why = f"{seq.get('stop_reason')}; the verdict is {v.verdict}: {v.reason}: a later round confirms it"
        elif decision in (UPPER, LOWER, CAP):
            state.state = DECIDED
            state.why = seq.get("stop_reason") or v.reason
            if (decision, v.verdict) not in ((UPPER, PROMOTE), (LOWER, REJECT)):
                state.why += f"; the verdict is {v.verdict}: {v.reason}"
            # A bound crossed, the verdict held on its calibration: closed, the campaign ended on a HOLD that only a
            # round with A/A blocks beside the test's own could settle, a round nobody would run. Not at the cap:
            # that HOLD is "inconclusive" however well calibrated.
            state.awaits_aa = decision in (UPPER, LOWER) and v.verdict == HOLD and (
                bool(v.uncalibrated_hosts) or v.aa_blocks < policy.threshold.min_aa_blocks)
            if state.awaits_aa:
                state.state = OPEN
                missing = (f"none on host(s) {', '.join(v.uncalibrated_hosts)}" if v.uncalibrated_hosts else
                           f"{v.aa_blocks} of the {policy.threshold.min_aa_blocks} it needs")
                state.why += (f"; waits for A/A blocks beside its own ({missing}): it runs again, its decision "
                              f"stays the stop's")
        elif exact is not None:
            state.state = DECIDED
            state.why = f"{exact.name}: {exact.detail}"
        elif seq.get("stop_reason"):
            state.why = seq["stop_reason"]
        states[state.key] = state
    return states


def _awaits_confirmation(v: Any, policy: Policy) -> bool:
    """Held only for the confirming round a suspicious win needs, and fewer counted rounds than that are in."""
    failing = [c.name for c in v.clauses if not c.passed]
    counted = [r for r in v.rounds + v.rounds_after_stop if r.counted]
    return v.verdict == HOLD and failing == ["not_suspicious"] and \
        len(counted) < policy.evidence.min_rounds + policy.suspicious.confirming_rounds


@dataclass
class CampaignJudge:
    """Reads the campaign's receipts on disk and judges them: picklable (Tune keeps its searcher in the
    experiment state, so ``--resume`` brings it back) and holding no live object of the driver."""

    campaign_dir: str
    policy: Policy
    defaults_path: str
    _parsed: dict[str, tuple[tuple[int, int], Optional[Receipt]]] = field(default_factory=dict, repr=False,
                                                                          compare=False)
    """receipt file -> ((mtime ns, size), receipt): validating a receipt re-derives every figure, so a judge that
    looks after every block parses each file once, not once per look (a campaign's looks would go quadratic)."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_parsed": {}}  # a cache, not state: Tune's experiment snapshot stays small

    def receipts(self) -> list[Receipt]:
        """The campaign's receipt files (``receipts/*.json``; a file that does not validate is left out: the
        final ``promote`` reports it)."""
        from ablate.receipts.store import RECEIPTS_DIR, load_receipts

        found = []
        for path in sorted((Path(self.campaign_dir) / RECEIPTS_DIR).glob("*.json")):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue  # renamed or removed between listing and reading
            key = (stat.st_mtime_ns, stat.st_size)
            hit = self._parsed.get(path.name)
            if hit is None or hit[0] != key:
                loaded = load_receipts(path)[0]
                hit = self._parsed[path.name] = (key, loaded[0] if loaded else None)
            if hit[1] is not None:
                found.append(hit[1])
        return found

    def states(self) -> dict[SpeedKey, Standing]:
        return judge_states(settled_blocks(self.receipts()), self.policy, self.defaults_path)


def settled_blocks(receipts: Iterable[Receipt]) -> list[Receipt]:
    """The receipts, less the blocks of the running (newest) sweep whose latest attempt has one arm written.
    Mid-round the judge sees a block whose first arm finished while its partner still runs: promote refuses it
    but lets a lone candidate's codes gate the test, and a host-level code the baseline will share (LOW_PRIORITY,
    a node check) is not cancelled yet, so ``no_disqualifier`` closed the test for the rest of the round (found
    in review). A lone arm of an earlier sweep will get no partner: it is read as promote reads it."""
    receipts = list(receipts)
    if not receipts:
        return receipts
    running = max(receipts, key=lambda r: moment_text(r.identity.created_at)).identity.sweep_id
    arms = Counter((r.identity.sweep_id, r.identity.block_id, r.identity.attempt) for r in receipts)
    latest: dict[tuple[str, str], int] = {}
    for sweep, block, attempt in arms:
        latest[(sweep, block)] = max(latest.get((sweep, block), attempt), attempt)
    settled = {block for block, attempt in latest.items() if block[0] != running or arms[(*block, attempt)] >= 2}
    return [r for r in receipts if (r.identity.sweep_id, r.identity.block_id) in settled]


def block_keys(plan: SweepPlan) -> list[tuple[str, Optional[SpeedKey]]]:
    """(block id, its speed test) in plan order; None for blocks that run every round (A/A, bundle, taxes)."""
    from ablate.config.features import BUNDLE

    keys: list[tuple[str, Optional[SpeedKey]]] = []
    for block in plan.blocks:
        speed = block.feature is not None and block.feature != BUNDLE and block.kind == "speed"
        keys.append((block.block_id, speed_key(block.feature, block.candidate_value, block.lane_key)
                     if speed else None))
    return keys


class UntilDecidedSearcher(Searcher):
    """Suggests the round's planned blocks in plan order, skipping those whose test is decided.

    The decision is refreshed after every finished block, so a test that crosses a bound mid-round stops getting
    blocks at once (the plan interleaves repetitions, so its later repeats are the ones left out). Within a round a
    closed test stays closed; between rounds the loop judges afresh (new A/A blocks move the bias bound), so the
    last judgement matches ``ablate promote --sweep <campaign>`` on the same receipts."""

    def __init__(self, blocks: list[tuple[str, Optional[SpeedKey]]], judge: Any) -> None:
        super().__init__(metric=None, mode=None)
        self._blocks = list(blocks)
        self._judge = judge
        self.suggested: list[str] = []
        self.closed: dict[SpeedKey, str] = {}
        """Decided test -> why (the stop reason), as the searcher last saw it."""
        self.skipped: dict[str, str] = {}
        """Block id -> why it was not run in this round."""
        self.judge_s = 0.0
        """Driver time spent judging (Tune waits for it before the next block starts)."""
        self._refresh()

    def _refresh(self) -> None:
        begun = time.perf_counter()
        for key, state in self._judge.states().items():
            if state.decided:
                self.closed[key] = state.why
        self.judge_s += time.perf_counter() - begun

    def expected_blocks(self) -> int:
        """Blocks the round runs if no test is decided during it (the progress display's total)."""
        return sum(1 for block_id, key in self._blocks if block_id not in self.skipped and
                   (key is None or key not in self.closed))

    def suggest(self, trial_id: str) -> Optional[dict[str, Any]]:
        done = set(self.suggested)
        for block_id, key in self._blocks:
            if block_id in done or block_id in self.skipped:
                continue
            if key is not None and key in self.closed:
                self.skipped[block_id] = f"{key[0]}={key[1]} decided: {self.closed[key]}"
                continue
            self.suggested.append(block_id)
            return {"block_id": block_id}
        return Searcher.FINISHED

    def on_trial_complete(self, trial_id: str, result: Optional[dict[str, Any]] = None, error: bool = False) -> None:
        self._refresh()

    def get_state(self) -> dict[str, Any]:
        return {"suggested": list(self.suggested), "closed": [[list(k), why] for k, why in self.closed.items()],
                "skipped": dict(self.skipped), "judge_s": self.judge_s}

    def set_state(self, state: dict[str, Any]) -> None:
        self.suggested = list(state["suggested"])
        self.closed = {(k[0], k[1], k[2]): why for k, why in state["closed"]}
        self.skipped = dict(state["skipped"])
        self.judge_s = float(state.get("judge_s", 0.0))

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text(json.dumps(self.get_state()))

    def restore(self, checkpoint_path: str) -> None:
        self.set_state(json.loads(Path(checkpoint_path).read_text()))


def sequential_policy(path: str | Path) -> Policy:
    """The policy the rounds are judged by; refused unless its sequential test is enabled."""
    policy = load_policy(path)
    if not policy.sequential.enabled:
        raise ConfigError("sequential.enabled", False,
                          f"true in the policy given to --until-decided ({path}): the campaign stops on the sequential "
                          f"test, so the verdict must be taken under it too (shipped: "
                          f"search_spaces/policies/default_sequential.yaml, single_node_sequential.yaml)")
    return policy


def defaults_path_of(campaign_file: Path, defaults: str) -> Path:
    path = Path(defaults)
    return path if path.is_absolute() else campaign_file.parent / path


@dataclass
class RoundRecord:
    sweep_id: str
    blocks_run: int
    blocks_skipped: int
    started_at: float
    elapsed_s: float
    exit_code: int
    judge_s: float = 0.0


@dataclass
class UntilDecidedSummary:
    campaign: str
    campaign_file: str
    policy_path: str
    policy_ref: str
    tracking_uri: str
    experiment: str
    rounds: list[RoundRecord]
    states: list[Standing]
    stop_reason: str
    sweep_summaries: list[Any] = field(default_factory=list)
    defaults_path: str = ""
    """The campaign's defaults file, the judge's: the printed ``promote`` command names it so its verdicts and
    changes are read against the same defaults (the CLI's default is search_spaces/defaults.yaml)."""

    @property
    def exit_code(self) -> int:
        return max([r.exit_code for r in self.rounds], default=0)

    def render(self) -> str:
        lines = [f"until decided: campaign {self.campaign}, {len(self.rounds)} round(s) this run under "
                 f"{self.policy_ref}; stopped: {self.stop_reason}"]
        lines += [f"  round {r.sweep_id}: {r.blocks_run} block(s) run, {r.blocks_skipped} left out as decided, "
                  f"{r.elapsed_s:.0f}s ({r.judge_s:.1f}s of it judging)" for r in self.rounds]
        lines += ["  " + s.line() for s in self.states]
        experiment = f" --experiment {self.experiment}" if self.experiment != "ablate" else ""
        defaults = f" --defaults {self.defaults_path}" if self.defaults_path else ""
        lines.append(f"next:     ablate promote --tracking-uri {self.tracking_uri}{experiment} --sweep {self.campaign} "
                     f"--policy {self.policy_path}{defaults}   (the verdicts, under the policy and defaults the "
                     f"rounds stopped on)")
        return "\n".join(lines)


GAP_MARGIN_S = 5.0
"""Slack on ``evidence.min_round_gap_s``: clocks of different processes, and receipts written a little late."""


def _latest_start(receipts: Iterable[Receipt]) -> Optional[float]:
    """Start (epoch s) of the campaign's latest sweep as the rule measures it: its earliest arm start, an arm
    starting ``wall_s`` before its receipt's ``created_at`` (``ablate.promote.evidence.sweep_windows``)."""
    from ablate.promote.evidence import epoch_s

    starts: dict[str, float] = {}
    for r in receipts:
        start = epoch_s(r.identity.created_at) - (r.time.wall_s or 0.0)
        starts[r.identity.sweep_id] = min(start, starts.get(r.identity.sweep_id, start))
    return max(starts.values(), default=None)


def run_until_decided(path: str | Path, *, policy_path: str | Path, resume: bool = False,
                      tracking_uri: Optional[str] = None, storage: Optional[str] = None, progress: bool = True,
                      lock_wait_s: float = 0.0, echo: Callable[[str], None] = print,
                      sleep: Callable[[float], None] = time.sleep, simulate_arms: bool = False) -> UntilDecidedSummary:
    """Rounds of ``run_sweep`` with ``UntilDecidedSearcher`` until every speed test is decided (module docstring).
    ``simulate_arms``: tests only, as for ``run_sweep`` (no-op arms, which the rule refuses: no test is decided).

    A lane with ``hardware.device: auto`` has every round planned for the device its arms run on (``arms_device``),
    the first check included, so the tests the loop waits for are those the rounds run: a head node without a GPU in
    front of GPU workers plans the GPU's baselines, so its lane keys. Each round checks that its cluster still runs
    the arms there, before it writes anything: one invocation measures one device."""
    from ablate.config.load import load_sweep
    from ablate.sweep.layout import Layout
    from ablate.sweep.run import run_sweep
    from ablate.tracking.uri import resolve_tracking_uri, shown

    path = Path(path)
    policy = sequential_policy(policy_path)
    sweep, defaults = load_sweep(path)
    device = arms_device(sweep.lane) if sweep.lane.hardware.device.value == AUTO else None
    if device is not None and device != planned_device(sweep.lane):
        log.warning("this machine would plan the lane (hardware.device: auto) for %s, but the cluster runs its arms "
                    "on %s: every round is planned for %s", planned_device(sweep.lane), device, device)
        sweep, defaults = load_sweep(path, device=device)
    layout = Layout.for_campaign(sweep.name, storage or sweep.tracking.storage)
    judge = CampaignJudge(str(layout.local_dir), policy, str(defaults_path_of(path, sweep.defaults)))
    rounds: list[RoundRecord] = []
    summaries: list[Any] = []
    # The plan's speed tests (every round plans the same ones; ids and orders differ), known before any round so
    # a campaign already decided runs nothing.
    planned = {k for _, k in block_keys(plan_sweep(sweep, "until-decided-preview", defaults, device=device))
               if k is not None}
    if not planned:
        raise ConfigError("features", sorted(sweep.features), "at least one speed feature that can act in this lane: "
                                                              "--until-decided decides speed tests")

    def factory(plan: SweepPlan) -> UntilDecidedSearcher:
        return UntilDecidedSearcher(block_keys(plan), judge)

    stop = ""
    while True:
        states = judge.states()
        resuming = resume and not rounds
        stop, note = next_round(planned, states, aa_blocks=sweep.aa_blocks, rounds=rounds,
                                max_rounds=policy.sequential.max_rounds, resuming=resuming)
        if stop:
            break
        if note:
            echo(note)
        wait = _gap_wait(judge.receipts(), policy, resuming)
        if wait > 0:
            echo(f"waiting {wait:.0f}s before the next round: sweeps starting less than "
                 f"{policy.evidence.min_round_gap_s:.0f}s apart are one round to the rule (evidence.min_round_gap_s)")
            sleep(wait)
        begun = time.time()
        summary = run_sweep(path, resume=resuming, tracking_uri=tracking_uri, storage=storage,
                            progress=progress, lock_wait_s=lock_wait_s, searcher_factory=factory,
                            resume_flags=("--until-decided", "--policy", str(policy_path)), device=device,
                            simulate_arms=simulate_arms,
                            device_why="where this --until-decided invocation found its arms and planned every round")
        summaries.append(summary)
        rounds.append(RoundRecord(sweep_id=summary.sweep_id, blocks_run=summary.blocks_total,
                                  blocks_skipped=len(summary.left_out), started_at=begun,
                                  elapsed_s=summary.elapsed_s, exit_code=summary.exit_code,
                                  judge_s=summary.judge_s))
        echo(summary.render())
        for state in sorted(judge.states().values(), key=lambda s: s.key):
            if state.key in planned:
                echo("  " + state.line())
        if summary.interrupted or summary.fatal:
            stop = (f"{'interrupted' if summary.interrupted else 'stopped by a fatal error'}: `ablate sweep {path} "
                    f"--until-decided --policy {policy_path} --resume` continues")
            break
    final = judge.states()
    return UntilDecidedSummary(
        campaign=sweep.name, campaign_file=str(path), policy_path=str(policy_path), policy_ref=policy.ref,
        tracking_uri=shown(resolve_tracking_uri(tracking_uri or sweep.tracking.uri)), experiment=sweep.tracking.experiment,
        rounds=rounds, states=sorted((final[k] for k in planned if k in final), key=lambda s: s.key),
        stop_reason=stop, sweep_summaries=summaries, defaults_path=judge.defaults_path)


def next_round(planned: Iterable[SpeedKey], states: dict[SpeedKey, Standing], *, aa_blocks: int,
               rounds: list[RoundRecord], max_rounds: int, resuming: bool) -> tuple[str, str]:
    """(why the campaign stops, "" to run another round; a line saying when a round runs for tests that crossed a
    bound and wait for A/A blocks beside their own)."""
    planned = list(planned)
    # Only A/A blocks beside their own can settle these, and only a campaign that plans some runs them.
    uncalibrated = [k for k in planned if k in states and states[k].awaits_aa]
    open_tests = [k for k in planned if not (k in states and states[k].decided)
                  and not (k in uncalibrated and not aa_blocks)]
    if not open_tests and not resuming:
        return ("every speed test of the campaign is decided" + (
            f" ({len(uncalibrated)} hold for want of A/A blocks, and the campaign plans none: aa_blocks is 0)"
            if uncalibrated else ""), "")
    if len(rounds) >= max_rounds:
        return f"{len(rounds)} rounds run, the policy's sequential.max_rounds", ""
    if rounds and rounds[-1].blocks_run == 0:
        return "the last round ran no block (every block's test was decided before it started)", ""
    if uncalibrated and not resuming:
        return "", (f"{len(uncalibrated)} test(s) crossed a bound but hold for want of A/A blocks beside their own: "
                    f"they run again, beside A/A blocks sent to every node first")
    return "", ""


def _gap_wait(receipts: Iterable[Receipt], policy: Policy, resuming: bool) -> float:
    """Seconds to wait so the next sweep's first arm starts ``min_round_gap_s`` after the latest sweep's first
    arm (the rule's round start), plus a margin; 0 when resuming that sweep."""
    if resuming:
        return 0.0
    start = _latest_start(receipts)
    if start is None:
        return 0.0
    return max(0.0, start + policy.evidence.min_round_gap_s + GAP_MARGIN_S - time.time())


def states_json(states: Iterable[Standing]) -> list[dict[str, Any]]:
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(s).items()}
            for s in states]


def arms_device(lane: LaneConfig) -> str:
    """The device class ``lane``'s arms run on, as ``ablate.sweep.run`` will find it (``cluster_device``): asked of
    the Ray runtime this process is attached to, or of the cluster ``RAY_ADDRESS`` names (attached to and let go:
    each round attaches itself), else what the local runtime a round starts would offer (``detect_local``)."""
    import ray

    from ablate.sweep.resources import detect_local
    from ablate.sweep.run import ensure_ray, shutdown_ray

    if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
        return cluster_device(lane, float(detect_local()[1]))
    attached = ensure_ray()
    try:
        return cluster_device(lane, ray.cluster_resources().get("GPU", 0.0))
    finally:
        if attached:
            shutdown_ray()
