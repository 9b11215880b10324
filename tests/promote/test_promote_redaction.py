"""No credential reaches the promotion report (PR body, JSON) or the CLI's stderr, whatever text a rejected
receipt's reason or a refused block's reason quotes (an MLflow error quotes the tracking URI it called)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import DEFAULTS
from promote_sim import Sim, moe, simulate

from ablate import cli
from ablate.promote import Policy, PromotionResult, promote
from ablate.promote.match import Refusal

PASSWORD = "s3cr3tPW"
TOKEN = "tok-9f8e7d6c5b"
LEAKY = (f"receipt.json unavailable: API request to http://alice:{PASSWORD}@mlflow.internal:5000/api/2.0/"
         f"mlflow-artifacts/artifacts failed; header Authorization: Bearer {TOKEN}")


@pytest.fixture(scope="module")
def result(policy: Policy) -> PromotionResult:
    receipts = simulate(Sim(features=[moe(1.05)], noise=0.003, aa_per_host=2), 0)
    found = promote(receipts, policy_path=policy, defaults_path=DEFAULTS,
                    rejected=[(f"run r1 (http://bob:{PASSWORD}@mlflow.internal:5000)", LEAKY)])
    refusal = Refusal(reason=LEAKY, receipt_ids=("r1",), block_id="b1", feature="moe_dispatch", lane_key="lane-x",
                      round_id="sim-r1")
    return dataclasses.replace(found, refusals=[*found.refusals, refusal])


@pytest.fixture(autouse=True)
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ABLATE_MLFLOW_TOKEN", TOKEN)


def test_the_pr_body_names_the_rejection_without_its_credentials(result: PromotionResult) -> None:
    md = result.markdown
    assert "Invalid receipts:" in md and "mlflow.internal:5000" in md  # the reason is still shown ...
    assert PASSWORD not in md and TOKEN not in md  # ... without the password in the URI or the secret env value
    assert "&lt;redacted&gt;@mlflow.internal" in md


def test_the_json_report_carries_no_credential_in_rejections_or_refusals(result: PromotionResult) -> None:
    text = result.to_json()
    assert PASSWORD not in text and TOKEN not in text
    data = json.loads(text)
    assert data["rejected_receipts"][0]["reason"].startswith("receipt.json unavailable: API request to http://"
                                                             "<redacted>@mlflow.internal:5000/")
    assert data["rejected_receipts"][0]["origin"] == "run r1 (http://<redacted>@mlflow.internal:5000)"
    assert "<redacted>@mlflow.internal" in data["refusals"][-1]["reason"]


def test_the_cli_prints_rejections_without_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    cli._print_rejected([("run r1", LEAKY)])
    printed = capsys.readouterr().err
    assert printed.startswith("rejected run r1: receipt.json unavailable") and "mlflow.internal" in printed
    assert PASSWORD not in printed and TOKEN not in printed


def test_paths_under_the_working_directory_are_not_taken_for_secrets(
        result: PromotionResult, monkeypatch: pytest.MonkeyPatch) -> None:
    # PWD matches the secret word list, and the report names files under it: they must stay readable.
    monkeypatch.setenv("PWD", str(DEFAULTS.parent.parent))
    assert f"`{DEFAULTS}`" in result.markdown and "<redacted>/" not in result.to_json()
