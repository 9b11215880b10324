"""Policy files hold every threshold; a typo or a missing key is refused, never defaulted in code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import DEFAULT_POLICY, SINGLE_NODE_POLICY

from ablate.promote import load_policy, with_overrides


def test_shipped_policies_load_and_differ_only_where_documented() -> None:
    default, single = load_policy(DEFAULT_POLICY), load_policy(SINGLE_NODE_POLICY)
    assert default.ref == "default@5" and single.ref == "single_node@4"
    assert (default.evidence.min_blocks, default.evidence.min_hosts, default.evidence.min_rounds) == (8, 3, 2)
    assert default.threshold.min_effect == 0.01 and default.consistency.min_win_fraction == 0.8
    assert default.threshold.min_aa_blocks == 4 and default.quality.metric == "lm_loss_final"
    assert single.single_node and single.evidence.min_hosts == 1 and not single.consistency.leave_one_host_out
    assert default.consistency.hosts_agree and not single.consistency.hosts_agree  # a t over one host is nothing
    same = {f.name for f in dataclasses.fields(default)
            if getattr(default, f.name) == getattr(single, f.name)}
    # default@4 added the host-level t-test, which single_node (one host) does not have: its version stayed.
    # default@5 / single_node@4 added evidence.min_hosts_per_round (2 / 1): a round on one host confirms nothing.
    assert {f.name for f in dataclasses.fields(default)} - same == {"name", "version", "profile", "description",
                                                                   "evidence", "consistency", "path"}


def test_unknown_and_missing_keys_are_refused(tmp_path: Path) -> None:
    text = DEFAULT_POLICY.read_text()
    typo = tmp_path / "typo.yaml"
    typo.write_text(text.replace("  min_blocks: 8", "  min_block: 8"))
    with pytest.raises(ValueError, match=r"policy evidence.min_block: got 8; allowed: known keys: .*\(unknown key\)"):
        load_policy(typo)
    missing = tmp_path / "missing.yaml"
    missing.write_text(text.replace("  min_hosts: 3", ""))
    with pytest.raises(ValueError, match=r"policy evidence.min_hosts: got None; allowed: .*\(missing\)"):
        load_policy(missing)


def test_nonsense_values_are_refused() -> None:
    policy = load_policy(DEFAULT_POLICY)
    with pytest.raises(ValueError, match="multi_host profile needs >= 2 hosts"):
        with_overrides(policy, {"evidence.min_hosts": 1})
    with pytest.raises(ValueError, match=r"policy evidence.min_hosts_per_round: got 1; allowed: >= 2: a multi_host "
                                         r"profile confirms a win in time on >= 2 hosts"):
        with_overrides(policy, {"evidence.min_hosts_per_round": 1})
    with pytest.raises(ValueError, match="family_alpha"):
        with_overrides(policy, {"family_alpha": 5})
    with pytest.raises(ValueError, match=r"policy evidence.min_blocks: got 7.5; allowed: an integer"):
        with_overrides(policy, {"evidence.min_blocks": 7.5})
    assert with_overrides(policy, {"bootstrap.resamples": 500}).bootstrap.resamples == 500
    # The loss bounds are the alpha and 1 - alpha quantiles: from 0.5 on they cross, and the clause read the wrong one.
    for alpha in (0.5, 0.9):
        with pytest.raises(ValueError, match=rf"policy quality.alpha: got {alpha}; allowed: a probability in \(0, 0.5\)"):
            with_overrides(policy, {"quality.alpha": alpha})
    assert with_overrides(policy, {"quality.alpha": 0.1}).quality.alpha == 0.1
