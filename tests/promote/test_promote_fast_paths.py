"""The promotion rule's shortcuts give exactly what the paths they skip give.

- ``match._unregistered_scalar`` (a memo keyed on type and value) answers as ``match._unregistered`` on the
  value's JSON, for every plain scalar a receipt can state, including the coercions OmegaConf would accept;
- ``engine._validated`` dumps receipts only when an id has several copies, and still keeps identical copies
  once and refuses differing ones.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from promote_sim import Sim, moe, simulate

from ablate.promote import engine, match
from ablate.receipts.store import seal

VALUES: list[tuple[str, Any]] = [
    ("moe_dispatch", "jagged"), ("moe_dispatch", "MoEDispatch.jagged"), ("moe_dispatch", "padded\n## x"),
    ("moe_dispatch", None), ("moe_dispatch", 1), ("moe_dispatch", True),
    ("fused_residual", True), ("fused_residual", False), ("fused_residual", "true"), ("fused_residual", 1),
    ("fused_residual", 0), ("fused_residual", "on"), ("fused_residual", None),
    ("bucket_cap_mb", 25), ("bucket_cap_mb", "25"), ("bucket_cap_mb", True), ("bucket_cap_mb", -3),
    ("overlap_comm", True), ("overlap_comm", 1), ("overlap_comm", "True"),
    ("compile", "off"), ("compile", ""), ("warmup", 0), ("warmup", False),
]


@pytest.mark.parametrize(("name", "value"), VALUES, ids=[f"{n}={v!r}" for n, v in VALUES])
def test_scalar_memo_answers_as_the_json_path(name: str, value: Any) -> None:
    expected = match._unregistered(name, json.dumps(value, sort_keys=True, allow_nan=False))
    assert match._unregistered_scalar(name, type(value), value) == expected


def test_true_and_one_are_never_one_memo_entry() -> None:
    # True == 1 and hash(True) == hash(1): only the type in the key keeps their answers apart.
    answers = {v: match._unregistered_scalar("fused_residual", type(v), v) for v in (True, 1)}
    assert answers[True] == match._unregistered("fused_residual", "true")
    assert answers[1] == match._unregistered("fused_residual", "1")


def _receipts() -> list[Any]:
    return [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=2, blocks_per_host=2), seed=11)]


def test_unregistered_values_unchanged_for_lanes_with_coerced_values() -> None:
    receipt = _receipts()[0]
    for value in (True, 1, "1", None, "jagged", 2.5, float("nan"), [1, 2], {"a": 1}):
        lane = {**receipt.requested.lane, "features.moe_dispatch": value}
        changed = receipt.model_copy(update={"requested": receipt.requested.model_copy(update={"lane": lane})})
        problems = match.unregistered_values(changed)
        want = []
        try:
            encoded = json.dumps(value, sort_keys=True, allow_nan=False)
            allowed = match._unregistered("moe_dispatch", encoded)
            if allowed is not None:
                want.append(f"requested.lane['features.moe_dispatch'] = {value!r} is not a registered value of "
                            f"moe_dispatch (allowed: {allowed})")
        except ValueError:
            want.append(f"requested.lane['features.moe_dispatch'] = {value!r} is not a registered value of "
                        f"moe_dispatch")
        assert [p for p in problems if "features.moe_dispatch" in p] == want


def test_validated_keeps_identical_copies_once_and_refuses_differing_ones() -> None:
    receipts = _receipts()
    first, second = receipts[0], receipts[1]
    twin = first.model_copy(deep=True)
    other = second.model_copy(update={"quality": second.quality.model_copy(update={"loss_final": 0.123})})
    valid, rejected = engine._validated(receipts + [twin, other])
    ids = [r.identity.receipt_id for r in valid]
    assert ids.count(first.identity.receipt_id) == 1 and second.identity.receipt_id not in ids
    assert len(valid) == len(receipts) - 1
    assert [rid for rid, _ in rejected] == [second.identity.receipt_id] * 2
    assert all("conflicting copies" in why for _, why in rejected)
