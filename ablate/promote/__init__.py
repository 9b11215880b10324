"""Promotion: a feature value enters the defaults only after repeated matched wins, with a PR-ready report.

How to use (the CLI's ``ablate promote`` does exactly this)::

    from ablate.promote import promote, write_defaults, make_branch
    result = promote(receipts, policy_path="search_spaces/policies/default.yaml",
                     defaults_path="search_spaces/defaults.yaml", rejected=rejected, run_links=links)
    print(result.markdown)            # the PR body; result.to_json() has the same content
    write_defaults(result, "search_spaces/defaults.yaml")             # --write
    make_branch(result, "promote/x", repo_root=".", open_pr=False)    # --branch / --open-pr
    sequential_state(log_ratios, hosts, rounds, bounds=SprtBounds.of(policy, bias), policy=policy)  # decided yet?

The rule, its statistics and the report fields follow shared/notes/promotion-rule.md §5-6; every threshold is in
``search_spaces/policies/*.yaml``.
"""

from ablate.promote.analysis import HOLD, PROMOTE, REJECT, TAX_REPORTED, FeatureVerdict
from ablate.promote.defaults_writer import DefaultsChange, Revalidation, render_defaults, write_defaults
from ablate.promote.engine import promote
from ablate.promote.git_pr import BranchOutcome, make_branch
from ablate.promote.match import Refusal
from ablate.promote.policy import Policy, load_policy, with_overrides
from ablate.promote.report import PromotionResult
from ablate.promote.sequential import SequentialState, SprtBounds, sequential_state

__all__ = [
    "BranchOutcome", "DefaultsChange", "FeatureVerdict", "HOLD", "PROMOTE", "Policy", "PromotionResult", "REJECT",
    "Refusal", "Revalidation", "SequentialState", "SprtBounds", "TAX_REPORTED", "load_policy", "make_branch",
    "promote", "render_defaults", "sequential_state", "with_overrides", "write_defaults",
]
