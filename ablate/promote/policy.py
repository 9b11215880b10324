"""Promotion policy: every threshold of the rule, read from a versioned YAML file.

How to use: ``policy = load_policy("search_spaces/policies/default.yaml")``; tests and notebooks may pass
``overrides={"bootstrap.resamples": 1000}``. Every key is required and unknown keys are refused, so a policy file
cannot silently fall back to a number hidden in code; reports quote ``policy.ref`` (``name@version``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from ablate.config.load import read_yaml

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


@dataclass(frozen=True)
class ConsistencyPolicy:
    min_win_fraction: float
    every_host_median_wins: bool
    leave_one_host_out: bool
    every_round_wins: bool


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
    path: Optional[str] = None

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def single_node(self) -> bool:
        return self.profile == "single_node"


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Type one section: every field required (except ``path``), no unknown keys, scalars coerced and checked."""
    if not isinstance(data, Mapping):
        raise ValueError(f"policy {prefix or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)} - {"path"}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"policy {prefix}{unknown[0]}: unknown key; known keys: {', '.join(sorted(names))}")
    missing = sorted(n for n in names if n not in data and n != "budgets")
    if missing:
        raise ValueError(f"policy {prefix}{missing[0]}: missing; every threshold must be in the policy file")
    values: dict[str, Any] = {}
    for name in names & set(data):
        values[name] = _coerce(hints[name], data[name], f"{prefix}{name}")
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"policy {key}: expected a list, got {value!r}")
        return tuple(str(v) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"policy {key}: expected a mapping, got {value!r}")
        return {str(k): float(v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"policy {key}: expected true or false, got {value!r}")
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"policy {key}: expected a number, got {value!r}")
        if hint is int and float(value) != int(value):
            raise ValueError(f"policy {key}: expected an integer, got {value!r}")
        return hint(value)
    return str(value)


def _check(policy: Policy) -> None:
    """Cross-field sanity: values that would make the rule meaningless are refused with the key named."""
    if policy.profile not in PROFILES:
        raise ValueError(f"policy profile: got {policy.profile!r}; allowed: one of {', '.join(PROFILES)}")
    if policy.profile == "multi_host" and policy.evidence.min_hosts < 2:
        raise ValueError("policy evidence.min_hosts: a multi_host profile needs >= 2 hosts; use single_node")
    fractions = {"family_alpha": policy.family_alpha, "quality.alpha": policy.quality.alpha,
                 "threshold.noise_quantile": policy.threshold.noise_quantile,
                 "threshold.bias_confidence": policy.threshold.bias_confidence, "order.alpha": policy.order.alpha,
                 "quality.spread_quantile": policy.quality.spread_quantile,
                 "consistency.min_win_fraction": policy.consistency.min_win_fraction,
                 "taxes.confidence": policy.taxes.confidence}
    for key, value in fractions.items():
        if not 0.0 < value < 1.0 and not (key == "consistency.min_win_fraction" and value == 1.0):
            raise ValueError(f"policy {key}: got {value!r}; allowed: a fraction in (0, 1)")
    if policy.bootstrap.resamples < 100 or policy.bootstrap.loss_resamples < 100:
        raise ValueError("policy bootstrap.resamples: at least 100 resamples")
    if policy.evidence.min_blocks < 1 or policy.evidence.min_rounds < 1:
        raise ValueError("policy evidence: min_blocks and min_rounds must be >= 1")
    if not 0.0 <= policy.threshold.min_effect < 1.0:
        raise ValueError(f"policy threshold.min_effect: got {policy.threshold.min_effect!r}; allowed: a fraction in "
                         f"[0, 1) (0.01 = a 1% speed-up)")
    if policy.threshold.min_aa_blocks < 2:
        raise ValueError(f"policy threshold.min_aa_blocks: got {policy.threshold.min_aa_blocks!r}; allowed: an "
                         f"integer >= 2 (one A/A block bounds nothing)")
    if policy.failures.failed_log_ratio >= 0:
        raise ValueError("policy failures.failed_log_ratio: must be negative (a failed candidate is a loss)")


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
            raise ValueError(f"policy override {dotted}: {part} is not a section")
        node = node[part]
    if parts[-1] not in node:
        raise ValueError(f"policy override {dotted}: unknown key")
    node[parts[-1]] = value


def load_policy(path: str | Path, overrides: Optional[Mapping[str, Any]] = None) -> Policy:
    """Read and check a policy file; ``overrides`` maps dotted keys to values (for tests and what-ifs)."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ValueError(f"policy {path}: expected a mapping at the top level")
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
