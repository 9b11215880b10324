"""Expand a campaign into matched blocks: the unit of evidence.

How to run me: ``python -m ablate.sweep.plan search_spaces/smoke.yaml`` prints the blocks a sweep would run.

A block is a baseline arm and a candidate arm run back to back on one node in a random order, which is drawn
here (seeded by the campaign seed and the sweep id) and recorded in the block. A/A blocks run the baseline twice
and measure the lane's noise floor. Two designs:

- ``one_at_a_time``: every block compares the defaults lane against the defaults lane plus one change, so every
  block of the campaign shares one lane key.
- ``grid``: every combination of the *other* features' values (their baseline and candidate values) is a
  context lane; in each context, each (feature, candidate) still gets "context vs context + one change" blocks.
  Interactions show up as the same toggle winning in one lane and not in another; blocks never mix lanes, and
  a toggle that is inert in a context is skipped there (with the reason recorded).

The lane key is a stable hash of the block's baseline lane: identical for both arms of a block, across blocks of
the same context and across sweeps, so promotion can pool rounds without ever comparing across lanes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ablate.config.features import BUNDLE, FEATURES, feature
from ablate.config.load import (Defaults, already_default_reason, lane_shape_of, lane_to_dict, load_lane,
                                with_feature)
from ablate.config.schema import ConfigError, Design, LaneConfig, SweepConfig

ARM_ROLES = ("baseline", "candidate", "aa")
INERT_PREFIX = "refused, inert in this lane: "
"""Start of the reason a statically inert value is left out of the plan (reports list these as refused)."""
AA_KIND = "aa"
"""Receipt ``kind`` of A/A arms (speed and tax come from the feature registry)."""
MAX_PLANNED_BLOCKS = 10_000
"""The most blocks one campaign may plan (20,000 training runs). Counted before anything is planned, so a grid
over many features (whose contexts multiply) or a typo in ``blocks`` is refused at once, naming the count."""


def lane_key(lane: LaneConfig) -> str:
    """Stable 16-hex hash of a lane: sorted-key JSON of the typed lane, so YAML key order never matters."""
    blob = json.dumps(lane_to_dict(lane), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ArmPlan:
    """One arm of a block: its role, its index inside the block and exactly the lane it runs."""

    arm: str
    """baseline, candidate or aa."""
    arm_index: int
    """0 = the baseline (or first A/A twin), 1 = the candidate (or second twin); independent of run order."""
    lane: LaneConfig
    value: Optional[Any]
    """The tested feature's value in this arm (None in A/A blocks)."""


@dataclass
class Block:
    block_id: str
    feature: Optional[str]
    """The feature under test; None for A/A blocks."""
    candidate_value: Optional[Any]
    baseline_value: Optional[Any]
    kind: str
    """speed or tax (from the feature registry), or aa."""
    lane_key: str
    arms: tuple[ArmPlan, ArmPlan]
    order: tuple[int, int]
    """Arm indexes in the order they run: (0, 1) = baseline first, (1, 0) = candidate first."""
    context: dict[str, Any] = field(default_factory=dict)
    """Grid design: the other features' values that define this block's lane (empty for one_at_a_time)."""
    repeat: int = 0
    """Which repetition of its (feature, value, context) group this block is."""

    @property
    def is_aa(self) -> bool:
        return self.feature is None

    def run_order(self) -> list[tuple[int, ArmPlan]]:
        """(order position, arm) in the recorded run order."""
        return [(position, self.arms[index]) for position, index in enumerate(self.order)]

    def label(self) -> str:
        if self.is_aa:
            return f"{self.block_id} A/A"
        context = "".join(f" [{k}={v}]" for k, v in self.context.items())
        return f"{self.block_id} {self.feature}: {self.baseline_value} -> {self.candidate_value}{context}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (it crosses into Ray trial processes and is stored next to the sweep)."""
        return {
            "block_id": self.block_id, "feature": self.feature, "candidate_value": self.candidate_value,
            "baseline_value": self.baseline_value, "kind": self.kind, "lane_key": self.lane_key,
            "order": list(self.order), "context": self.context, "repeat": self.repeat,
            "arms": [{"arm": a.arm, "arm_index": a.arm_index, "value": a.value, "lane": lane_to_dict(a.lane)}
                     for a in self.arms],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Block":
        arms = tuple(ArmPlan(arm=a["arm"], arm_index=a["arm_index"], value=a["value"], lane=load_lane(a["lane"]))
                     for a in data["arms"])
        assert len(arms) == 2, "a block has exactly two arms"
        return cls(block_id=data["block_id"], feature=data["feature"], candidate_value=data["candidate_value"],
                   baseline_value=data["baseline_value"], kind=data["kind"], lane_key=data["lane_key"],
                   arms=(arms[0], arms[1]), order=(data["order"][0], data["order"][1]),
                   context=dict(data.get("context") or {}), repeat=int(data.get("repeat", 0)))


@dataclass
class SweepPlan:
    sweep_id: str
    campaign: str
    design: str
    seed: int
    blocks: list[Block]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """What is not run, as (description, reason): a tested value that has become the lane's default (promoted
    since the campaign was written), or a grid combination where the toggle is inert."""

    def fingerprint(self) -> str:
        """What a resumed sweep must reproduce exactly: ids, lanes and recorded orders of every block."""
        rows = [(b.block_id, b.lane_key, b.feature, str(b.candidate_value), list(b.order),
                 [lane_key(a.lane) for a in b.arms]) for b in self.blocks]
        return hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()[:16]

    def lane_keys(self) -> list[str]:
        return sorted({b.lane_key for b in self.blocks})


@dataclass
class _Group:
    """Blocks that repeat one comparison: same feature, candidate value and context lane."""

    feature: Optional[str]
    value: Optional[Any]
    baseline_lane: LaneConfig
    candidate_lane: LaneConfig
    context: dict[str, Any]
    repeats: int
    lane_key: str
    """``lane_key(baseline_lane)``, hashed once per group: every block of the group shares it (hashing a lane
    types it through OmegaConf, ~tens of ms, so per block it made a large campaign's planning take minutes)."""


def _normalised(name: str, lane: LaneConfig) -> Any:
    """The registry's view of a value (enum -> its string), so YAML 100 and 100.0 read the same."""
    return FEATURES[name].get(lane)


def _tested_values(sweep: SweepConfig, defaults: Optional[Defaults],
                   skipped: list[tuple[str, str]], device: Optional[str] = None) -> dict[str, list[Any]]:
    """Feature -> the candidate values that still differ from the lane's baseline.

    A value equal to the baseline reaches the plan only when ``load_sweep`` found it promoted into the defaults
    since the campaign was written: it is skipped with a notice (a block would compare the value with itself).
    """
    shape = lane_shape_of(sweep.lane, device)
    tested: dict[str, list[Any]] = {}
    for name, values in sweep.features.items():
        baseline = str(_normalised(name, sweep.lane))
        tested[name] = []
        for value in values:
            if str(_normalised(name, with_feature(sweep.lane, name, value))) == baseline:
                moved = defaults.moved_to(name, value, shape) if defaults is not None else None
                skipped.append((f"{name}={value}", already_default_reason(moved)))
            else:
                tested[name].append(value)
    return tested


def _contexts(sweep: SweepConfig, tested_values: dict[str, list[Any]], tested: str) -> Iterable[dict[str, Any]]:
    """Grid design: every combination of the other features' (baseline + candidate) values."""
    others = [name for name in tested_values if name != tested]
    # Skipped values are left out here too: as the baseline, they would only repeat the baseline context.
    axes = [[_normalised(name, sweep.lane)] + list(tested_values[name]) for name in others]
    for combo in itertools.product(*axes):
        yield {name: value for name, value in zip(others, combo)
               if str(value) != str(_normalised(name, sweep.lane))}


def _apply(lane: LaneConfig, values: dict[str, Any]) -> LaneConfig:
    for name, value in values.items():
        lane = with_feature(lane, name, value)
    return lane


def _check_size(sweep: SweepConfig, tested_values: dict[str, list[Any]]) -> None:
    """Refuse a campaign that would plan more than ``MAX_PLANNED_BLOCKS`` blocks, from counts alone."""
    tests = sum(len(values) for values in tested_values.values())
    if sweep.design is Design.grid:
        axes = {name: 1 + len(values) for name, values in tested_values.items() if values}
        every = math.prod(axes.values())
        # A tested feature's contexts are the combinations of the others' axes; A/A lanes at most all of them.
        num_blocks = sum(len(tested_values[name]) * (every // size) for name, size in axes.items()) * sweep.blocks
        num_blocks += every * sweep.aa_blocks + sweep.bundle_blocks
        how = f"{tests} tested value(s) over a grid of {every:,} context lane(s)"
    else:
        num_blocks = tests * sweep.blocks + sweep.aa_blocks + sweep.bundle_blocks
        how = f"{tests} tested value(s)"
    if num_blocks > MAX_PLANNED_BLOCKS:
        raise ConfigError("blocks", sweep.blocks,
                          f"a campaign of at most {MAX_PLANNED_BLOCKS:,} blocks; this one would plan {num_blocks:,} "
                          f"({how} x {sweep.blocks} blocks, plus A/A blocks): lower blocks, test fewer values, "
                          f"or use design: one_at_a_time")


def _groups(sweep: SweepConfig, skipped: list[tuple[str, str]], defaults: Optional[Defaults],
            device: Optional[str] = None) -> list[_Group]:
    groups: list[_Group] = []
    aa_lanes: dict[str, tuple[LaneConfig, dict[str, Any]]] = {}
    tested_values = _tested_values(sweep, defaults, skipped, device)
    _check_size(sweep, tested_values)
    for name, values in tested_values.items():
        if not values:
            continue  # every value skipped: its contexts would only add A/A lanes that no test uses
        spec = feature(name)
        contexts = _contexts(sweep, tested_values, name) if sweep.design is Design.grid else [{}]
        for context in contexts:
            base = _apply(sweep.lane, context)
            base_key = lane_key(base)
            aa_lanes.setdefault(base_key, (base, context))
            for value in values:
                candidate = with_feature(base, name, value)
                inert = spec.inert_reason(candidate, _normalised(name, base))
                if inert:
                    # Refused before any arm runs: an inert toggle's arms would run the baseline's code twice.
                    where = f" in {context}" if context else ""
                    skipped.append((f"{name}={value}{where}", f"{INERT_PREFIX}{inert}"))
                    continue
                groups.append(_Group(name, _normalised(name, candidate), base, candidate, context, sweep.blocks,
                                     base_key))
    if sweep.bundle_blocks:
        bundle = _bundle_group(sweep, groups, skipped)
        if bundle is not None:
            groups.append(bundle)
    if not any(tested_values.values()):
        aa_lanes.setdefault(lane_key(sweep.lane), (sweep.lane, {}))
        if sweep.features:
            # Every tested value was promoted since the campaign was written: the A/A blocks still run (they
            # keep the lane's noise floor current for the next campaign), and the notice says that is all.
            runs = (f"only its {sweep.aa_blocks} A/A block(s) per lane run" if sweep.aa_blocks else
                    "nothing runs (aa_blocks is 0)")
            skipped.append((f"every test of campaign {sweep.name!r}",
                            f"each tested value is already this lane's default: {runs}"))
    if sweep.aa_blocks:
        for key, (base, context) in aa_lanes.items():
            groups.append(_Group(None, None, base, base, context, sweep.aa_blocks, key))
    return groups


def _bundle_group(sweep: SweepConfig, groups: list[_Group], skipped: list[tuple[str, str]]) -> Optional[_Group]:
    """The defaults against every tested speed feature's candidate value at once, in the campaign's own lane.

    A feature tested with several values is left out (which of them would be promoted is not known before the
    verdicts); an inert or already-default value never reached ``groups``, so it is not in the bundle either."""
    values: dict[str, list[Any]] = {}
    for group in groups:
        if group.feature is not None and not group.context and FEATURES[group.feature].kind == "speed":
            values.setdefault(group.feature, []).append(group.value)
    several = sorted(name for name, vals in values.items() if len(vals) > 1)
    if several:
        skipped.append((f"bundle: {', '.join(several)}", "tested with several values; which one would be promoted "
                                                          "is not known before the verdicts: bundle it alone"))
    chosen = {name: vals[0] for name, vals in sorted(values.items()) if len(vals) == 1}
    if len(chosen) < 2:
        skipped.append((f"bundle_blocks: {sweep.bundle_blocks}", f"a bundle needs two or more speed features with one "
                                                                 f"candidate value each in the lane; "
                                                                 f"has {sorted(chosen) or 'none'}"))
        return None
    return _Group(BUNDLE, chosen, sweep.lane, _apply(sweep.lane, chosen), {}, sweep.bundle_blocks,
                  lane_key(sweep.lane))


ORDERS_IN_PAIRS, ORDERS_SHUFFLED = "pairs", "shuffled"
"""How a plan counterbalances arm orders (``_balanced_orders``). A sweep's metadata records its scheme, and a
resumed sweep replans with it: sweeps planned before pairs (no record) replan shuffled, or their plan fingerprint
would no longer match and the half-run round could not be resumed (found in review)."""


def _balanced_orders(rng: random.Random, count: int, scheme: str = ORDERS_IN_PAIRS) -> list[tuple[int, int]]:
    """Each consecutive pair of repeats runs one baseline-first and one candidate-first block, in random order
    (an odd last one is a coin flip): counterbalancing beats independent coin flips, which can put 7 of 8
    baselines first. Balanced in pairs rather than shuffled as a whole, so every prefix is too: a round that
    runs only its first repeats (``--until-decided`` stopping a test, an interrupted sweep) was split 3:1 or
    4:0 in 49% of plans for 4 of 8 repeats (found in review)."""
    if scheme == ORDERS_SHUFFLED:
        shuffled = [(0, 1), (1, 0)] * (count // 2)
        if count % 2:
            shuffled.append(rng.choice([(0, 1), (1, 0)]))
        rng.shuffle(shuffled)
        return shuffled
    orders: list[tuple[int, int]] = []
    for _ in range(count // 2):
        pair = [(0, 1), (1, 0)]
        rng.shuffle(pair)
        orders += pair
    if count % 2:
        orders.append(rng.choice([(0, 1), (1, 0)]))
    return orders


def plan_sweep(sweep: SweepConfig, sweep_id: str, defaults: Optional[Defaults] = None,
               orders_scheme: str = ORDERS_IN_PAIRS, device: Optional[str] = None) -> SweepPlan:
    """Every block of the campaign, in the order they are submitted.

    ``sweep`` comes from ``load_sweep``, so its lane already runs the lane's effective defaults (an override
    for its shape included): that is every baseline arm. ``defaults`` (the second value ``load_sweep``
    returns) only enriches skip notices with where a promoted value came from; ``device`` is the one ``load_sweep``
    was given (an ``auto`` lane's overrides are those won on it).

    Blocks are interleaved round-robin by repetition (round 0 of every comparison, then round 1, ...) so slow
    drift of a node (thermal, neighbours) spreads over all features instead of landing on one. Arm orders are
    seeded by ``sweep.seed`` and ``sweep_id``, so a resumed sweep (same id) replans identically while a new
    round draws fresh orders.
    """
    skipped: list[tuple[str, str]] = []
    groups = _groups(sweep, skipped, defaults, device)
    rng = random.Random(hashlib.sha256(f"{sweep.seed}/{sweep_id}".encode()).hexdigest())
    orders = [_balanced_orders(rng, group.repeats, orders_scheme) for group in groups]
    rounds = max((group.repeats for group in groups), default=0)
    scheduled: list[tuple[_Group, int, tuple[int, int]]] = [
        (group, repeat, orders[g][repeat]) for repeat in range(rounds) for g, group in enumerate(groups)
        if repeat < group.repeats
    ]
    width = max(3, len(str(max(len(scheduled) - 1, 0))))
    blocks = []
    for index, (group, repeat, order) in enumerate(scheduled):
        key = group.lane_key
        if group.feature is None:
            arms = (ArmPlan("aa", 0, group.baseline_lane, None), ArmPlan("aa", 1, group.baseline_lane, None))
            kind, baseline_value = AA_KIND, None
        elif group.feature == BUNDLE:
            baseline_value = {name: _normalised(name, group.baseline_lane) for name in group.value}
            arms = (ArmPlan("baseline", 0, group.baseline_lane, baseline_value),
                    ArmPlan("candidate", 1, group.candidate_lane, group.value))
            kind = "speed"
        else:
            baseline_value = _normalised(group.feature, group.baseline_lane)
            arms = (ArmPlan("baseline", 0, group.baseline_lane, baseline_value),
                    ArmPlan("candidate", 1, group.candidate_lane, group.value))
            kind = FEATURES[group.feature].kind
        blocks.append(Block(block_id=f"b{index:0{width}d}", feature=group.feature, candidate_value=group.value,
                            baseline_value=baseline_value, kind=kind, lane_key=key, arms=arms, order=order,
                            context=dict(group.context), repeat=repeat))
    if not blocks:
        reasons = "; ".join(f"{what}: {why}" for what, why in skipped[:3]) or "no features and aa_blocks is 0"
        raise ConfigError("features", sorted(sweep.features), f"at least one value that can act in this lane, or "
                                                               f"aa_blocks > 0 (nothing would run: {reasons})")
    return SweepPlan(sweep_id=sweep_id, campaign=sweep.name, design=sweep.design.value, seed=sweep.seed,
                     blocks=blocks, skipped=skipped)


def plan_blocks(sweep: SweepConfig, sweep_id: str, defaults: Optional[Defaults] = None) -> list[Block]:
    """The blocks of ``plan_sweep``."""
    return plan_sweep(sweep, sweep_id, defaults).blocks


def _main(argv: list[str]) -> int:
    from ablate.config.load import load_sweep

    if len(argv) != 1:
        print("usage: python -m ablate.sweep.plan <campaign.yaml>", file=sys.stderr)
        return 2
    try:
        sweep, defaults = load_sweep(argv[0])
        plan = plan_sweep(sweep, sweep_id="preview", defaults=defaults)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for block in plan.blocks:
        first = block.arms[block.order[0]]
        print(f"{block.label():60s} lane {block.lane_key}  first: "
              f"{f'twin{first.arm_index}' if block.is_aa else first.arm}")
    for what, why in plan.skipped:
        print(f"skipped {what}: {why}")
    print(f"{len(plan.blocks)} blocks, {2 * len(plan.blocks)} arms, lanes: {', '.join(plan.lane_keys())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
