"""Sequential test of one feature x lane: is it decided yet, and why (Wald's SPRT on block log ratios).

How to use (the rule does this when ``policy.sequential.enabled``; a searcher deciding whether to plan more
blocks calls the same pure function)::

    state = sequential_state(log_ratios, hosts, rounds, bounds=SprtBounds.of(policy, bias_bound_log),
                             policy=policy)
    state.decision    # "upper" (H1: a win of at least delta1), "lower" (H0: no win beyond delta0),
                      # "continue" (look again after the next block), "cap" (inconclusive, sticky)
    state.stop_reason, state.llr_trace, state.upper, state.lower

Form. Block log ratios d_i (candidate vs its own baseline, at the lane's horizon: the numbers the fixed rule
bootstraps) are modelled as normal with mean theta and unknown variance. H0: theta = theta0 = log(1 + delta0),
H1: theta = theta1 = log(1 + delta1), each moved by the lane's A/A bias bound b the way the fixed rule uses it:
against the candidate for the upper decision (H0 + b vs H1 + b: a slot bias in the candidate's favour cannot
promote) and in its favour for the lower one (H0 - b vs H1 - b: a bias against the candidate slot cannot
reject a real win). Two SPRTs on one stream, each with its own guarantee; b widens the region between them
(in doubt, HOLD). Neither test stops at its other bound: a win between delta0 and delta1 keeps sampling
up to the cap (the close calls get the blocks; stopping them as "close" cost 2 points of power on true 5% wins
in the simulations, whose bias-moved H1 sits near 5%), and continuing past a bound keeps each test's error
bound (Ville). The log-likelihood ratio of the normal model is

    LLR_n = (theta1 - theta0) (mean_n - (theta0 + theta1) / 2) / V_n,    V_n = variance of mean_n,

which is Wald's exact LLR when V_n = sigma^2 / n; fishtest's "normalized" GSPRT uses the same form with the
variance of the mean estimated from the data. Bounds: upper A = log((1 - beta) / alpha), lower B = log(beta /
(1 - alpha)). Under the true likelihood, P(ever reaching A | H0) <= alpha / (1 - beta) whatever the stopping
rule (Ville's inequality on the likelihood-ratio martingale), which is why "the upper bound is crossed" can gate
promotion even when other clauses make the searcher continue past it.

Why the variance is not the plug-in block variance alone (each of these was needed in the simulations,
benchmarks/bench_sequential.py):
1. Host clustering. Candidate noise shared by all blocks of a host (promotion-rule.md §7: host x arm sd 1%)
   makes blocks of one host correlated; s^2 / n then understates V_n and the plug-in SPRT promotes nulls,
   as the block-level Wilcoxon did (12%). V_n is the larger of s^2 / n and the cluster-robust (CR1) variance
   of the mean over hosts.
2. Early peeks. With few blocks s^2 is often far below sigma^2, and an SPRT looking after every block uses
   its luckiest estimate; no crossing counts before ``min_blocks``, and s^2 is floored by the lane's A/A
   block variance (pure noise, the least a feature's blocks can vary).
3. Failed candidate arms carry the rule's fixed ``failed_log_ratio`` (a loss of e^-2): it would dominate
   both mean and variance, so those blocks stay out of the LLR and are judged by the failure clauses.

Caps: a test still undecided after ``max_blocks`` blocks or ``max_rounds`` rounds is inconclusive, and blocks
beyond the cap are not looked at, so rerunning until significant cannot turn it into a promotion (sticky until
the software fingerprint changes, which restarts the lane's evidence). The upper bound only decides once
``evidence.min_rounds`` counted rounds are in (a round is a separate sweep in time); before that the test
continues.

A decision stands. The looks are replayed from the receipts on every ``promote``, so what a look sees must not
change after it: each look is also judged with every calibration an earlier ``promote`` could have used for it,
from the A/A blocks of the sweeps up to the look's own to those up to each later sweep (``then``; a rejection
any of them reaches counts, the upper bound needs all; a calibration with fewer than ``threshold.min_aa_blocks``
A/A blocks is none), and the lower bound keeps the undivided alpha (Bonferroni guards false promotions; a bound
that moved with the number of tests would reopen a rejection when a later round adds one).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np

from ablate.promote.policy import Policy

UPPER, LOWER, CONTINUE, CAP = "upper", "lower", "continue", "cap"
LLR_CLIP = 1e6
"""Zero-variance data (deterministic twins) give an infinite LLR; reports and JSON carry a finite stand-in."""


@dataclass(frozen=True)
class SprtBounds:
    theta0: float
    """log speed-up under H0, before the bias bound."""
    theta1: float
    alpha: float
    beta: float
    bias: float = 0.0
    """The lane's A/A bias bound (log): added to both hypotheses for the upper decision, taken off for the lower."""
    family_alpha: Optional[float] = None
    """The policy's alpha before Bonferroni: the lower bound's. Splitting alpha guards false promotions only, and a
    lower bound that moved with the family size would reopen a rejection once a later round adds a test."""

    @property
    def upper(self) -> float:
        return math.log((1.0 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        return math.log(self.beta / (1.0 - (self.alpha if self.family_alpha is None else self.family_alpha)))

    @classmethod
    def of(cls, policy: Policy, bias_bound_log: Optional[float] = None, num_tests: int = 1) -> "SprtBounds":
        seq = policy.sequential
        return cls(theta0=math.log1p(seq.delta0), theta1=math.log1p(seq.delta1),
                   alpha=seq.alpha / max(1, num_tests), beta=seq.beta, bias=abs(bias_bound_log or 0.0),
                   family_alpha=seq.alpha)


@dataclass
class SequentialState:
    decision: str
    stop_reason: str
    llr_trace: list[Optional[float]]
    """LLR of the upper (promotion) test after each block in time order (None before ``min_blocks``), up to the
    stop or the cap; compared with ``upper``."""
    llr_lower_trace: list[Optional[float]]
    """LLR of the lower (rejection) test, hypotheses moved by -bias; compared with ``lower``."""
    upper: float
    lower: float
    theta0: float
    theta1: float
    alpha: float
    beta: float
    bias: float
    blocks: int
    """Blocks looked at: up to the stop, or the cap."""
    blocks_seen: int
    """Blocks in the evidence (later ones than the stop or the cap are not looked at)."""
    rounds: int
    """Distinct rounds among the blocks looked at."""
    last_looked: Optional[int] = None
    """Position, in the time order given, of the last block looked at: a decided test is judged on the blocks up
    to it, as it stopped (``ablate.promote.engine``), not on blocks that came in after."""
    llr: Optional[float] = None
    llr_lower: Optional[float] = None
    excluded_failed: int = 0
    variance: dict[str, Optional[float]] = field(default_factory=dict)
    """At the last look: block sd, the sd of the mean (iid and host-clustered), the A/A floor sd."""

    @property
    def decided(self) -> bool:
        return self.decision in (UPPER, LOWER, CAP)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _variance_of_mean(d: np.ndarray, hosts: np.ndarray, var_floor: float) -> tuple[float, float, float]:
    """(V used, iid V, host-clustered V) for the mean of ``d``."""
    n = d.size
    s2 = max(float(np.var(d, ddof=1)), var_floor)
    v_iid = s2 / n
    labels = list(dict.fromkeys(hosts.tolist()))
    if len(labels) < 2:
        return v_iid, v_iid, math.nan
    resid = d - d.mean()
    sums = np.asarray([resid[hosts == h].sum() for h in labels])
    g = len(labels)
    v_cluster = g / (g - 1) * float(np.sum(sums ** 2)) / n ** 2
    return max(v_iid, v_cluster), v_iid, v_cluster


def _clip(x: float) -> float:
    return float(min(LLR_CLIP, max(-LLR_CLIP, x)))


def llr(d: np.ndarray, hosts: np.ndarray, bounds: SprtBounds, var_floor: float = 0.0
        ) -> tuple[float, float, dict[str, Any]]:
    """(upper test's LLR, lower test's LLR, variance facts) for blocks ``d`` on ``hosts``."""
    v, v_iid, v_cluster = _variance_of_mean(d, hosts, var_floor)
    gap = bounds.theta1 - bounds.theta0
    values = []
    for shift in (bounds.bias, -bounds.bias):
        centre = float(d.mean()) - shift - (bounds.theta0 + bounds.theta1) / 2.0
        values.append(_clip(gap * centre / v) if v > 0 else math.copysign(LLR_CLIP, centre))
    facts = {"mean": float(d.mean()), "bias": bounds.bias, "block_sd": float(np.std(d, ddof=1)),
             "mean_sd": math.sqrt(v), "mean_sd_iid": math.sqrt(v_iid),
             "mean_sd_host": None if math.isnan(v_cluster) else math.sqrt(v_cluster),
             "aa_floor_sd": math.sqrt(var_floor) if var_floor > 0 else None}
    return values[0], values[1], facts


def sequential_state(log_ratios: Sequence[float], hosts: Sequence[Any], rounds: Sequence[Any], *,
                     bounds: SprtBounds, policy: Policy, var_floor: float = 0.0,
                     failed: Optional[Sequence[bool]] = None,
                     then: Optional[Sequence[Sequence[tuple[float, float]]]] = None,
                     seeds: Optional[Sequence[Any]] = None) -> SequentialState:
    """Where the SPRT stands on these blocks, given in time order (pure: same input, same state).

    ``rounds`` labels each block's round (counted rounds: a label reaches ``evidence.min_blocks_per_round``
    blocks over ``evidence.min_hosts_per_round`` hosts); ``failed`` marks blocks whose candidate arm failed (left out
    of the LLR, counted towards the cap);
    ``seeds`` labels each block's seed. Neither bound counts before the blocks looked at span
    ``evidence.min_hosts`` hosts and ``evidence.min_seeds`` seeds: the test is judged on those blocks alone, and
    a decision on fewer would hold for good (found in review: a rejection on two hosts under a three-host policy
    became a REJECT once blocks of a third host came in, which said the opposite and were never looked at).

    ``then``: per block, the (bias bound log, A/A variance floor) of every calibration an earlier ``promote`` may
    have judged that block's look with: the A/A blocks of the sweeps up to it, up to each later sweep (each was
    "today" once). ``bounds.bias`` and ``var_floor`` are today's. A look decides on all of them: a rejection any
    of them reaches stands, and the upper bound needs every one. Today's alone would let A/A blocks of a later
    round move a rejection back into play, and the test could then cross the upper bound (found in review): a
    test that stopped is judged as it stopped, whatever is added after it.
    """
    seq, ev = policy.sequential, policy.evidence
    d_all = np.asarray(log_ratios, dtype=float)
    h_all = np.asarray(list(hosts), dtype=object)
    r_all = list(rounds)
    bad = np.zeros(d_all.size, dtype=bool) if failed is None else np.asarray(failed, dtype=bool)
    order_of_round = list(dict.fromkeys(r_all))
    # The cap: blocks past max_blocks, or in rounds past max_rounds, are never looked at.
    allowed_rounds = set(order_of_round[:seq.max_rounds])
    keep = [i for i, r in enumerate(r_all) if r in allowed_rounds][:seq.max_blocks]
    state = SequentialState(decision=CONTINUE, stop_reason="", llr_trace=[], llr_lower_trace=[],
                            upper=bounds.upper, lower=bounds.lower, theta0=bounds.theta0, theta1=bounds.theta1,
                            alpha=bounds.alpha, beta=bounds.beta, bias=bounds.bias, blocks=0,
                            blocks_seen=int(d_all.size), rounds=0)
    s_all = list(seeds) if seeds is not None else [None] * d_all.size
    per_round: dict[Any, int] = {}
    round_hosts: dict[Any, set[Any]] = {}
    waited_at: Optional[int] = None
    spread: Optional[str] = None
    for look, i in enumerate(keep, start=1):
        per_round[r_all[i]] = per_round.get(r_all[i], 0) + 1
        round_hosts.setdefault(r_all[i], set()).add(h_all[i])
        state.blocks, state.rounds, state.last_looked = look, len(per_round), i
        use = [j for j in keep[:look] if not bad[j]]
        state.excluded_failed = look - len(use)
        if len(use) < seq.min_blocks:
            state.llr_trace.append(None)
            state.llr_lower_trace.append(None)
            continue
        value, low, state.variance = llr(d_all[use], h_all[use], bounds, var_floor)
        low_bounds, low_when = bounds, ""
        for bias_then, floor_then in (then[i] if then is not None else ()):
            if (abs(bias_then), floor_then) == (bounds.bias, var_floor):
                continue
            then_bounds = replace(bounds, bias=abs(bias_then))
            value_then, low_then, facts_then = llr(d_all[use], h_all[use], then_bounds, floor_then)
            value = min(value, value_then)
            if low_then < low:  # its variance facts go with it: the rule's close-call check reads them
                low, low_bounds, low_when = low_then, then_bounds, " as an earlier round calibrated it"
                state.variance = facts_then
        state.llr, state.llr_lower = value, low
        state.llr_trace.append(value)
        state.llr_lower_trace.append(low)
        if not np.isfinite(d_all[use]).all():
            continue  # a non-finite ratio (none from validated receipts) reads as a clipped +LLR: it decides nothing
        looked = keep[:look]
        n_hosts, n_seeds = len({h_all[j] for j in looked}), len({str(s_all[j]) for j in looked})
        if (low <= bounds.lower or value >= bounds.upper) and (n_hosts < ev.min_hosts or
                                                               (seeds is not None and n_seeds < ev.min_seeds)):
            spread = (f"{'lower' if low <= bounds.lower else 'upper'} bound crossed at block {look} on "
                      f"{n_hosts} host(s) and {n_seeds} seed(s) (need {ev.min_hosts} and {ev.min_seeds}): run blocks "
                      f"on more hosts and seeds")
            continue
        if low <= bounds.lower:
            state.decision = LOWER
            state.stop_reason = (f"lower bound crossed at block {look}: LLR {low:.2f} <= {bounds.lower:.2f}, the "
                                 f"blocks favour a speed-up of at most "
                                 f"{math.expm1(low_bounds.theta0 - low_bounds.bias):+.2%} over one of "
                                 f"{math.expm1(low_bounds.theta1 - low_bounds.bias):+.2%} (both lowered by the A/A bias "
                                 f"bound {math.expm1(low_bounds.bias):.2%}{low_when}, so a slot bias cannot reject a "
                                 f"real win)")
            return state
        counted = sum(1 for r, n in per_round.items() if ev.round_counts(n, len(round_hosts[r])))
        if value >= bounds.upper:
            if counted >= ev.min_rounds:
                state.decision = UPPER
                state.stop_reason = (f"upper bound crossed at block {look}: LLR {value:.2f} >= {bounds.upper:.2f}, "
                                     f"the blocks favour a speed-up of {math.expm1(bounds.theta1 + bounds.bias):+.2%}"
                                     f" over one of at most {math.expm1(bounds.theta0 + bounds.bias):+.2%} "
                                     f"(both raised by the A/A bias bound {math.expm1(bounds.bias):.2%}), "
                                     f"{counted} rounds")
                return state
            waited_at, spread = waited_at or look, None  # the latest reason to go on is the one to tell
    if state.blocks >= seq.max_blocks or len(order_of_round) > seq.max_rounds:
        state.decision = CAP
    if state.llr is None or state.llr_lower is None:
        where = f"LLR n/a (fewer than {seq.min_blocks} usable blocks), bounds ({bounds.lower:.2f}, {bounds.upper:.2f})"
    elif abs(state.llr - state.llr_lower) < 0.005:
        where = f"LLR {state.llr:.2f} in ({bounds.lower:.2f}, {bounds.upper:.2f})"
    else:
        where = (f"LLR {state.llr:.2f} (promotion test) and {state.llr_lower:.2f} (rejection test), bounds "
                 f"({bounds.lower:.2f}, {bounds.upper:.2f})")
    if state.decision == CAP:
        state.stop_reason = (f"inconclusive at cap: {state.blocks} blocks over {state.rounds} round(s), {where}; "
                             f"sticky: later blocks are not looked at until the software fingerprint changes")
    elif spread is not None and state.llr is not None and state.llr_lower is not None and (
            state.llr >= bounds.upper or state.llr_lower <= bounds.lower):
        state.stop_reason = spread
    elif waited_at is not None and state.llr is not None and state.llr >= bounds.upper:
        state.stop_reason = (f"upper bound crossed at block {waited_at} but only {state.rounds} round(s) "
                             f"({ev.round_needs} each count; need {ev.min_rounds}): run another "
                             f"round")
    else:
        state.stop_reason = f"undecided: {state.blocks} blocks, {where}"
    return state
