"""Promotion policy: every threshold of the rule, read from a versioned YAML file.

How to use: ``policy = load_policy("search_spaces/policies/default.yaml")``; tests and notebooks may pass
``overrides={"bootstrap.resamples": 1000}``. Every key is required and unknown keys are refused, so a policy file
cannot silently fall back to a number hidden in code; reports quote ``policy.ref`` (``name@version``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from ablate.config.features import FEATURES
from ablate.config.lane_shape import DEVICE_CLASSES, REPLICATION_KEYS
from ablate.config.load import read_yaml
from ablate.config.schema import ConfigError
from ablate.receipts.schema import CompileRecord, Quality, Severity

PROFILES = ("multi_host", "single_node")


@dataclass(frozen=True)
class ThresholdPolicy:
    """What a win must clear. Departs from promotion-rule.md §5.3-5.5 (delta = max(1%, 95% quantile of single A/A
    block |log ratio|)): that compared the spread of *one* block with the interval of an estimate over *many*, so
    more blocks never helped, and it let feature-independent noise set the bar. The interval already carries the
    spread; the A/A blocks bound the *systematic* bias that pairing cannot cancel, and that bias is added to the
    smallest effect worth a default: 1 + delta = (1 + min_effect) x exp(bias bound)."""

    min_effect: float
    """The smallest speed-up at the lane's horizon worth changing a default for (0.01 = 1%)."""
    bias_confidence: float
    """The A/A bias bound is max(|lo|, |hi|) of this two-sided bootstrap interval of the A/A Hodges-Lehmann."""
    noise_quantile: float
    """The lane's A/A spread (reported, and the suspicious-win trigger) = this quantile of single A/A |log ratio|."""
    min_aa_blocks: int
    """A lane with fewer A/A blocks is uncalibrated: nothing in it promotes, and nothing is rejected for lack of a
    win (a threshold estimated from a handful of A/A blocks must never reject)."""


@dataclass(frozen=True)
class EvidencePolicy:
    min_blocks: int
    min_hosts: int
    min_seeds: int
    min_rounds: int
    """Rounds are sweeps (sweep_id) under one software fingerprint; a fingerprint change restarts the count."""
    min_blocks_per_round: int
    min_hosts_per_round: int
    """A round with its blocks on fewer hosts does not count towards ``min_rounds`` (promotion-rule.md §5.3: "Round:
    >=4 blocks over >=2 hosts"): a confirmation in time that one machine gave is that machine's. 1 in the
    single-node profile."""
    min_round_gap_s: float
    """Sweeps starting closer than this (or overlapping in time) are one round: a round is a separate run in time."""

    def round_counts(self, blocks: int, hosts: int) -> bool:
        """Whether a round of ``blocks`` blocks over ``hosts`` hosts counts towards ``min_rounds``."""
        return blocks >= self.min_blocks_per_round and hosts >= self.min_hosts_per_round

    @property
    def round_needs(self) -> str:
        """What a round needs to count, in words."""
        return f"{self.min_blocks_per_round}+ blocks" + (
            f" over {self.min_hosts_per_round}+ hosts" if self.min_hosts_per_round > 1 else "")


@dataclass(frozen=True)
class ConsistencyPolicy:
    min_win_fraction: float
    every_host_median_wins: bool
    leave_one_host_out: bool
    every_round_wins: bool
    hosts_agree: bool
    """Student's t on the hosts' mean log ratios must clear 1 + delta at alpha / tests (``stats.host_level_t``)."""


@dataclass(frozen=True)
class OrderPolicy:
    require_both_orders: bool
    max_effect_in_thresholds: float
    """The candidate-first vs baseline-first median difference must stay below this many deltas ..."""
    alpha: float
    """... or, when it does not, not be significant (two-sided Mann-Whitney U between the two order groups at this
    level): a difference of medians of a few blocks each is mostly noise, and only a real one means drift leaked."""


@dataclass(frozen=True)
class QualityPolicy:
    metric: str
    """Field of ``Receipt.quality`` compared between the arms of a block."""
    alpha: float
    spread_quantile: float
    min_epsilon: float
    require_loss: bool


@dataclass(frozen=True)
class FailurePolicy:
    max_candidate_rate: float
    fisher_alpha: float
    failed_log_ratio: float
    """Log ratio a block gets when its candidate arm failed: a failed run counts as a loss, never dropped."""


@dataclass(frozen=True)
class GatePolicy:
    severities: tuple[str, ...]
    """Disqualifier severities that gate, exactly, on every candidate arm, failed or not (ARM_FAILED itself is the
    failure, counted in the failure rates as a loss; every other code it carries still gates)."""
    exact_counters: tuple[str, ...]
    """``observed.compile`` counters the candidate may not exceed relative to its own baseline arm."""


@dataclass(frozen=True)
class SuspiciousPolicy:
    """"Too good to be true" (promotion-rule.md §5.5 item 7), judged by physics where the receipts allow it: a
    feature that touches one block family cannot speed a step up beyond Amdahl's bound from that family's
    measured time share. Departs from the note's "1 + 5 x noise floor" trigger, which on a quiet lane flags
    nearly every real win (a 0.5% A/A spread made every win above 2.5% suspicious)."""

    max_speedup: float
    """A feature that touches the whole step (no family, or no measured share) above this needs confirming."""
    amdahl_slack: float
    """A family feature whose steady speed-up exceeds 1/(1 - share) by more than this fraction is suspicious."""
    confirming_rounds: int


@dataclass(frozen=True)
class BootstrapPolicy:
    resamples: int
    loss_resamples: int
    seed: int


@dataclass(frozen=True)
class MatchingPolicy:
    replication_keys: tuple[str, ...]
    """Flattened lane keys that may differ between blocks of one lane (never between the arms of a block)."""


@dataclass(frozen=True)
class ScopePolicy:
    global_requires_all_lanes: bool
    global_device_classes: tuple[str, ...]
    """A global flip needs a promoting lane of every one of these device classes (observed: cpu, cuda)."""


@dataclass(frozen=True)
class TaxPolicy:
    confidence: float
    default_budget: float
    budgets: dict[str, float] = field(default_factory=dict)

    def budget(self, feature: str) -> float:
        return float(self.budgets.get(feature, self.default_budget))


@dataclass(frozen=True)
class SequentialPolicy:
    """Wald's SPRT on the block log ratios (fishtest's design; ``ablate.promote.sequential`` says why this form).
    When enabled, crossing the upper bound replaces the fixed design's block count and Holm interval for PROMOTE;
    every gate, the quality guard, the rounds requirement and the per-host checks still apply."""

    enabled: bool
    alpha: float
    """Chance of crossing the upper bound when the speed-up is 1 + delta0 (Bonferroni-divided by the campaign's
    number of speed tests, the first step of the fixed rule's Holm)."""
    beta: float
    """Chance of crossing the lower bound when the speed-up is 1 + delta1."""
    delta0: float
    """H0: speed-up <= (1 + delta0) x exp(A/A bias bound), like the fixed rule's 1 + delta."""
    delta1: float
    """H1: speed-up >= (1 + delta1) x exp(A/A bias bound); a win between the two is an indifference zone."""
    min_blocks: int
    """No crossing counts before this many blocks: the variance is estimated from the data."""
    max_blocks: int
    """Cap: undecided here is a sticky HOLD (later blocks are not looked at: no rerunning until significant)."""
    max_rounds: int
    """Cap on rounds (separate sweeps in time); blocks of later rounds are not looked at."""


@dataclass(frozen=True)
class BundlePolicy:
    """Two or more values promoted in one lane are written together only if they win together (promotion-rule.md
    §5.5 "Bundle check"): effects need not add up, and a pair can even lose to either alone."""

    required: bool
    """True: without enough bundle blocks the set is held from ``--write`` (reported, never written silently)."""
    min_blocks: int
    """Bundle blocks (old defaults vs every new value together) needed in the lane."""


@dataclass(frozen=True)
class Policy:
    name: str
    version: int
    profile: str
    description: str
    family_alpha: float
    threshold: ThresholdPolicy
    evidence: EvidencePolicy
    consistency: ConsistencyPolicy
    order: OrderPolicy
    quality: QualityPolicy
    failures: FailurePolicy
    gates: GatePolicy
    suspicious: SuspiciousPolicy
    bootstrap: BootstrapPolicy
    matching: MatchingPolicy
    scope: ScopePolicy
    taxes: TaxPolicy
    sequential: SequentialPolicy
    bundle: BundlePolicy
    path: Optional[str] = None

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def single_node(self) -> bool:
        return self.profile == "single_node"


def _error(key: str, value: Any, allowed: str) -> ConfigError:
    # A ConfigError (a ValueError) like the campaign's: key, value and what is allowed, one line at the CLI.
    return ConfigError(f"policy {key}", value, allowed)


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Type one section: every field required (except ``path``), no unknown keys, scalars coerced and checked."""
    if not isinstance(data, Mapping):
        raise _error(prefix.rstrip(".") or "<root>", data, f"a mapping of {cls.__name__} keys")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)} - {"path"}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise _error(f"{prefix}{unknown[0]}", data[unknown[0]],
                     f"known keys: {', '.join(sorted(names))} (unknown key)")
    missing = sorted(n for n in names if n not in data and n != "budgets")
    if missing:
        raise _error(f"{prefix}{missing[0]}", None, "a value: every threshold must be in the policy file (missing)")
    values: dict[str, Any] = {}
    for name in names & set(data):
        values[name] = _coerce(hints[name], data[name], f"{prefix}{name}")
    return cls(**values)


def _number(hint: Any, value: Any, key: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _error(key, value, "an integer" if hint is int else "a number")
    if not math.isfinite(value):
        raise _error(key, value, "a finite number")
    if hint is int and float(value) != int(value):
        raise _error(key, value, "an integer")
    return hint(value)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _error(key, value, "a list of names")
        return tuple(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _error(key, value, "a mapping of name -> number")
        return {str(k): _number(float, v, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        if not isinstance(value, bool):
            raise _error(key, value, "true or false")
        return value
    if hint in (int, float):
        return _number(hint, value, key)
    if not isinstance(value, str):
        raise _error(key, value, "a string")
    return value


_OPEN_FRACTION = (0.0, False, 1.0, False, "a fraction in (0, 1)")
_RANGES: dict[str, tuple[float, bool, float, bool, str]] = {
    # dotted key: (low, low included, high, high included, what is allowed)
    "version": (1, True, math.inf, False, "an integer >= 1"),
    "family_alpha": _OPEN_FRACTION,
    "threshold.min_effect": (0.0, True, 1.0, False, "a fraction in [0, 1) (0.01 = a 1% speed-up)"),
    "threshold.bias_confidence": _OPEN_FRACTION,
    "threshold.noise_quantile": _OPEN_FRACTION,
    "threshold.min_aa_blocks": (2, True, math.inf, False, "an integer >= 2 (one A/A block bounds nothing)"),
    "evidence.min_blocks": (1, True, math.inf, False, "an integer >= 1"),
    "evidence.min_hosts": (1, True, math.inf, False, "an integer >= 1 (a block runs on a host)"),
    "evidence.min_seeds": (1, True, math.inf, False, "an integer >= 1"),
    "evidence.min_rounds": (1, True, math.inf, False, "an integer >= 1"),
    "evidence.min_blocks_per_round": (1, True, math.inf, False, "an integer >= 1"),
    "evidence.min_hosts_per_round": (1, True, math.inf, False, "an integer >= 1"),
    "evidence.min_round_gap_s": (0.0, True, math.inf, False, "a number of seconds >= 0"),
    "consistency.min_win_fraction": (0.0, False, 1.0, True, "a fraction in (0, 1]"),
    "order.max_effect_in_thresholds": (0.0, False, math.inf, False, "a positive multiple of the threshold"),
    "order.alpha": _OPEN_FRACTION,
    "quality.alpha": (0.0, False, 0.5, False, "a probability in (0, 0.5): the loss bounds are its quantile and "
                                              "1 minus it, which cross at 0.5"),
    "quality.spread_quantile": _OPEN_FRACTION,
    "quality.min_epsilon": (0.0, True, math.inf, False, "a loss difference >= 0"),
    "failures.max_candidate_rate": (0.0, True, 1.0, True, "a fraction in [0, 1]"),
    "failures.fisher_alpha": _OPEN_FRACTION,
    "failures.failed_log_ratio": (-10.0, True, 0.0, False,
                                  "a negative log ratio >= -10 (a failed candidate is a loss, so it must be negative; "
                                  "-10 is already a 22,000x slow-down)"),
    "suspicious.max_speedup": (1.0, False, math.inf, False, "a speed-up ratio > 1"),
    "suspicious.amdahl_slack": (0.0, True, math.inf, False, "a fraction >= 0"),
    "suspicious.confirming_rounds": (0, True, math.inf, False, "an integer >= 0"),
    "bootstrap.resamples": (100, True, math.inf, False, "at least 100 resamples"),
    "bootstrap.loss_resamples": (100, True, math.inf, False, "at least 100 resamples"),
    "bootstrap.seed": (0, True, math.inf, False, "an integer >= 0 (a numpy seed)"),
    "taxes.confidence": _OPEN_FRACTION,
    "taxes.default_budget": _OPEN_FRACTION,
    "sequential.alpha": (0.0, False, 0.5, False, "a probability in (0, 0.5)"),
    "sequential.beta": (0.0, False, 0.5, False, "a probability in (0, 0.5)"),
    "sequential.delta0": (0.0, True, 1.0, False, "a fraction in [0, 1) (0.01 = a 1% speed-up)"),
    "sequential.delta1": (0.0, False, 1.0, False, "a fraction in (0, 1) above sequential.delta0"),
    "sequential.min_blocks": (2, True, math.inf, False, "an integer >= 2 (a variance needs two blocks)"),
    "sequential.max_blocks": (2, True, math.inf, False, "a positive integer >= sequential.min_blocks"),
    "sequential.max_rounds": (1, True, math.inf, False, "a positive integer >= evidence.min_rounds"),
    "bundle.min_blocks": (2, True, math.inf, False, "an integer >= 2 (one bundle block measures nothing)"),
}
"""Every numeric threshold's range. Keys a policy class does not have (yet) are skipped."""

SEVERITIES: tuple[str, ...] = tuple(s.value for s in Severity)
EXACT_COUNTERS: tuple[str, ...] = tuple(
    name for name, info in CompileRecord.model_fields.items() if info.annotation in (Optional[int], int))
"""The integer counters of a receipt's ``observed.compile`` record; a misspelled one would read as None on every
receipt and silently turn the exact-counter gate off."""
QUALITY_METRICS: tuple[str, ...] = tuple(Quality.model_fields)
REPLICATION_KEYS_ALLOWED: tuple[str, ...] = REPLICATION_KEYS
"""Replication keys may only be the lane's seeds (``seed``, ``data.seed``): the keys ``lane_shape`` leaves out.
Every other lane field (model, batch, precision, compile, engine, data path, budget, hardware) defines the lane or
is a feature toggle; letting one differ between the blocks of a lane would pool measurements of different lanes
into one verdict, which rule 1 (report the lane you measured) forbids."""


def _dotted(policy: Policy, key: str) -> Any:
    node: Any = policy
    for part in key.split("."):
        if not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node


def _names(key: str, values: tuple[str, ...], allowed: tuple[str, ...], what: str) -> None:
    for value in values:
        if value not in allowed:
            raise _error(key, value, f"{what}: {', '.join(allowed)}")
    if len(set(values)) != len(values):
        raise _error(key, list(values), "each name once")


def _check(policy: Policy) -> None:
    """Ranges and names: values that would make the rule meaningless are refused with the key named."""
    if policy.profile not in PROFILES:
        raise _error("profile", policy.profile, f"one of {', '.join(PROFILES)}")
    for key, (low, low_in, high, high_in, allowed) in _RANGES.items():
        value = _dotted(policy, key)
        if value is None:
            continue
        above = value >= low if low_in else value > low
        below = value <= high if high_in else value < high
        if not (above and below):
            raise _error(key, value, allowed)
    if policy.profile == "multi_host" and policy.evidence.min_hosts < 2:
        raise _error("evidence.min_hosts", policy.evidence.min_hosts,
                     ">= 2: a multi_host profile needs >= 2 hosts; use profile single_node for one")
    if policy.profile == "multi_host" and policy.evidence.min_hosts_per_round < 2:
        raise _error("evidence.min_hosts_per_round", policy.evidence.min_hosts_per_round,
                     ">= 2: a multi_host profile confirms a win in time on >= 2 hosts (promotion-rule.md §5.3); use "
                     "profile single_node for one")
    if not policy.name.strip():
        raise _error("name", policy.name, "a non-empty name (reports quote name@version)")
    _names("gates.severities", policy.gates.severities, SEVERITIES, "disqualifier severities")
    _names("gates.exact_counters", policy.gates.exact_counters, EXACT_COUNTERS,
           "counters of a receipt's observed.compile record")
    if policy.quality.metric not in QUALITY_METRICS:
        raise _error("quality.metric", policy.quality.metric, f"a Receipt.quality field: {', '.join(QUALITY_METRICS)}")
    _names("matching.replication_keys", policy.matching.replication_keys, REPLICATION_KEYS_ALLOWED,
           "seed-like lane keys that do not define the lane")
    _names("scope.global_device_classes", policy.scope.global_device_classes, DEVICE_CLASSES, "device classes")
    seq = policy.sequential
    if seq.delta1 <= seq.delta0:
        raise _error("sequential.delta1", seq.delta1, f"a fraction above sequential.delta0 = {seq.delta0:g} (H1 "
                                                      f"must be a larger speed-up than H0)")
    if seq.delta0 < policy.threshold.min_effect:
        # The upper crossing replaces the fixed rule's min_effect clause: H0 below it would promote wins the
        # policy calls too small to matter (delta0 0, delta1 1% promotes a true 0.8%).
        raise _error("sequential.delta0", seq.delta0, f"a fraction >= threshold.min_effect = "
                                                      f"{policy.threshold.min_effect:g} (H0 is 'no win worth having')")
    if seq.max_blocks < seq.min_blocks:
        raise _error("sequential.max_blocks", seq.max_blocks,
                     f"an integer >= sequential.min_blocks = {seq.min_blocks}")
    if seq.max_blocks < policy.evidence.min_rounds * policy.evidence.min_blocks_per_round:
        raise _error("sequential.max_blocks", seq.max_blocks,
                     f"an integer >= evidence.min_rounds x evidence.min_blocks_per_round = "
                     f"{policy.evidence.min_rounds * policy.evidence.min_blocks_per_round} (else nothing promotes)")
    if seq.max_rounds < policy.evidence.min_rounds:
        raise _error("sequential.max_rounds", seq.max_rounds, f"an integer >= evidence.min_rounds = "
                                                              f"{policy.evidence.min_rounds} (else nothing promotes)")
    taxes = tuple(sorted(name for name, spec in FEATURES.items() if spec.kind == "tax"))
    for name, budget in policy.taxes.budgets.items():
        if name not in taxes:
            raise _error(f"taxes.budgets.{name}", name, f"a tax feature: {', '.join(taxes)}")
        if not 0.0 < budget < 1.0:
            raise _error(f"taxes.budgets.{name}", budget, "a fraction in (0, 1) (0.05 = 5% throughput)")


def policy_from_mapping(data: Mapping[str, Any], path: Optional[str] = None) -> Policy:
    policy = _build(Policy, data, "")
    policy = dataclasses.replace(policy, path=path)
    _check(policy)
    return policy


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            raise _error(dotted, value, f"an override of a key inside a section ({part} is not a section)")
        node = node[part]
    if parts[-1] not in node:
        raise _error(dotted, value, f"an override of a known key: {', '.join(sorted(map(str, node)))} "
                                    f"(unknown key)")
    node[parts[-1]] = value


def load_policy(path: str | Path, overrides: Optional[Mapping[str, Any]] = None) -> Policy:
    """Read and check a policy file; ``overrides`` maps dotted keys to values (for tests and what-ifs)."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"policy {path}", data, "a mapping of policy sections at the top level")
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    return policy_from_mapping(data, path=str(path))


def with_overrides(policy: Policy, overrides: Mapping[str, Any]) -> Policy:
    """A copy of ``policy`` with dotted keys replaced (re-checked like a file)."""
    data = dataclasses.asdict(policy)
    data.pop("path", None)
    data = _lists(data)
    for dotted, value in overrides.items():
        _set_dotted(data, dotted, value)
    return policy_from_mapping(data, path=policy.path)


def _lists(node: Any) -> Any:
    # asdict keeps tuples; the loader expects YAML-shaped data (lists), so convert back before re-validating.
    if isinstance(node, dict):
        return {k: _lists(v) for k, v in node.items()}
    if isinstance(node, tuple):
        return list(node)
    return node
