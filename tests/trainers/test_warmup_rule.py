"""The seeds' warmup rule: auto skips explicit warmup only on CUDA + regional compile + E blocks."""

from __future__ import annotations

import pytest

from ablate.config.warmup import resolve_warmup


@pytest.mark.parametrize(("policy", "device", "posture", "letters", "steps", "resolved", "why"), [
    ("auto", "cuda", "regional", "AEMR", 2, "skip", "CUDA + regional compile + E blocks"),
    ("auto", "cuda", "regional", "AMR", 2, "explicit", "no E blocks"),
    ("auto", "cpu", "regional", "AEMR", 2, "explicit", "not CUDA"),
    ("auto", "cuda", "whole", "AEMR", 2, "explicit", "posture is whole"),
    ("auto", "cuda", "eager", "AEMR", 2, "explicit", "posture is eager"),
    ("auto", "cpu", "eager", "AMR", 2, "explicit", "not CUDA"),
    ("explicit", "cuda", "regional", "AEMR", 2, "explicit", "requested"),
    ("skip", "cpu", "eager", "AMR", 2, "skip", "requested"),
    ("explicit", "cpu", "eager", "AEMR", 0, "skip", "warmup_steps is 0"),
])
def test_warmup_rule_table(policy: str, device: str, posture: str, letters: str, steps: int, resolved: str,
                           why: str) -> None:
    decision = resolve_warmup(policy, device, posture, letters, steps)
    assert decision.requested == policy
    assert decision.resolved == resolved
    assert why in decision.reason
    assert decision.steps == (steps if resolved == "explicit" else 0)


def test_unknown_policy_is_a_value_error_naming_the_key() -> None:
    with pytest.raises(ValueError, match="lane.compile.warmup"):
        resolve_warmup("sometimes", "cpu", "eager", "A", 2)
