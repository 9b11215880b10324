"""The PR body and the JSON carry the fields promotion-rule.md §6 asks for."""

from __future__ import annotations

import json

import pytest
from conftest import DEFAULTS
from promote_sim import FeatureTruth, Sim, moe, simulate

from ablate.promote import Policy, PromotionResult, promote
from ablate.promote import report as report_module

QUIET = {"noise": 0.003, "aa_per_host": 2}


@pytest.fixture(scope="module")
def result(policy: Policy) -> PromotionResult:
    features = [moe(1.05), FeatureTruth("mamba_scan", "chunked", "sequential", 1.0),
                FeatureTruth("stp", "on", "off", 0.96)]
    receipts = simulate(Sim(features=features, **QUIET), 0)
    links = {r.identity.receipt_id: f"http://mlflow.local/#/runs/{r.identity.receipt_id}" for r in receipts}
    bad = receipts[0].model_dump(mode="json")
    bad["schema_version"] = "9.0.0"
    return promote([*receipts, bad], policy_path=policy, defaults_path=DEFAULTS, run_links=links)


def test_markdown_has_header_diff_rows_taxes_and_links(result: PromotionResult) -> None:
    md = result.markdown
    moe_v = next(v for v in result.verdicts if v.feature == "moe_dispatch")
    assert md.startswith(f"## ablate promotion report `{result.report_id}`")
    assert "**Campaign:** sim" in md and "`sim-r1`" in md and "`sim-r2`" in md
    assert "**Git SHAs:** baseline `abc1234` · candidate `abc1234`" in md
    assert "**Policy:** `default@5` (multi_host)" in md and "Holm over 2 feature × lane test(s)" in md
    assert "| `moe_dispatch` | `padded` | `jagged` | global |" in md
    assert "Rollback: set `features.moe_dispatch.value: padded`" in md
    row = next(line for line in md.splitlines() if line.startswith("| `moe_dispatch`→`jagged`"))
    assert "**PROMOTE**" in row and f"{moe_v.speedup:.3f}× [{moe_v.ci95[0]:.3f}, {moe_v.ci95[1]:.3f}]" in row
    assert "12/3/1/2" in row and "100%" in row and "≤ 1.67× (E 40%)" in row  # Amdahl: 1 / (1 - 0.4)
    held = next(line for line in md.splitlines() if line.startswith("| `mamba_scan`→`chunked`"))
    assert "**REJECT**" in held and "no meaningful win" in held
    assert "### Taxes (never promoted; opt-in only)" in md and "| `stp`→`on` |" in md and "within budget" in md
    assert "](http://mlflow.local/#/runs/" in md  # MLflow links in the per-lane detail
    assert "unknown major 9" in md  # invalid receipts are listed, not dropped silently


def test_json_has_the_same_content(result: PromotionResult) -> None:
    data = json.loads(result.to_json())
    assert data["report_id"] == result.report_id and data["policy"]["ref"] == "default@5"
    assert [(v["feature"], v["verdict"]) for v in data["verdicts"]] == [
        (v.feature, v.verdict) for v in result.speed_verdicts]
    moe_json = next(v for v in data["verdicts"] if v["feature"] == "moe_dispatch")
    moe_v = next(v for v in result.verdicts if v.feature == "moe_dispatch")
    assert moe_json["speedup"] == moe_v.speedup and moe_json["ci95"] == list(moe_v.ci95)
    assert moe_json["amdahl"]["bound"] == pytest.approx(1 / 0.6) and "work" not in moe_json
    assert data["taxes"][0]["feature"] == "stp" and data["taxes"][0]["within_budget"] is True
    assert data["changes"][0]["evidence"][0]["report"] == result.report_id
    assert data["lanes"][0]["calibration"]["num_blocks"] == 12  # 2 A/A per host x 3 hosts x 2 rounds
    assert data["rejected_receipts"][0]["reason"].startswith("schema_version '9.0.0'")
    assert len(data["run_links"]) == result.num_receipts


def test_an_oversized_body_drops_lane_detail_first(result: PromotionResult, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report_module, "MAX_MARKDOWN_CHARS", 4000)
    md = result.markdown
    assert "1 lane(s) omitted to stay under GitHub's PR body limit" in md and "<details>" not in md
    assert "| `moe_dispatch`→`jagged`" in md  # the summary is never cut


def test_report_id_is_stable_for_the_same_receipts(policy: Policy) -> None:
    receipts = simulate(Sim(features=[moe(1.05)], **QUIET), 0)
    a = promote(receipts, policy_path=policy, defaults_path=DEFAULTS)
    b = promote(list(reversed(receipts)), policy_path=policy, defaults_path=DEFAULTS)
    assert a.report_id == b.report_id and a.verdicts[0].speedup == b.verdicts[0].speedup


def test_every_block_and_arm_is_a_labelled_link_in_json_and_per_block_in_markdown(policy: Policy) -> None:
    receipts = simulate(Sim(features=[moe(1.05)], **QUIET), 0)
    ui = "http://127.0.0.1:5000"

    def block_url(ident: object) -> str:
        return f"{ui}/#/experiments/1/runs/block-{ident.sweep_id}-{ident.block_id}-{ident.attempt}"

    links = {r.identity.receipt_id: f"{ui}/#/experiments/1/runs/arm-{r.identity.receipt_id}" for r in receipts}
    labels = {r.identity.receipt_id: {"arm": f"{r.identity.block_id}·{r.identity.arm.value}",
                                      "block": f"{r.identity.sweep_id}·{r.identity.block_id}",
                                      "block_url": block_url(r.identity)} for r in receipts}
    result = promote(receipts, policy_path=policy, defaults_path=DEFAULTS, run_links=links)
    result.run_labels, result.ui_url = labels, ui
    result.ui_command = "mlflow ui --backend-store-uri sqlite:////tmp/mlflow.db"
    data = json.loads(result.to_json())["links"]
    assert data["ui"] == ui and data["mlflow_ui_command"] == result.ui_command
    # None left out: one entry per block run, every arm under its block, each with its run's name and link.
    assert {b["url"] for b in data["blocks"]} == {block_url(r.identity) for r in receipts}
    arms = [arm for block in data["blocks"] for arm in block["arms"]]
    assert sorted(a["receipt_id"] for a in arms) == sorted(links) and data["arms_without_block_run"] == []
    assert all(a["url"] == links[a["receipt_id"]] and a["label"] == labels[a["receipt_id"]]["arm"] for a in arms)
    assert all(link["url"].startswith(ui + "/#/experiments/") for link in data["blocks"] + arms)
    md = result.markdown
    assert "runs:/" not in md and f"serve this store there first: `{result.ui_command}`" in md
    detail = md[md.index("### Per-lane detail"):]
    verdict = next(v for v in result.verdicts if v.feature == "moe_dispatch")
    row = verdict.block_links[0]
    block = next(line for line in detail.splitlines() if f"]({labels[row['candidate']]['block_url']})" in line)
    assert block.startswith(f"- block [{labels[row['candidate']]['block']}]")
    assert f"[{labels[row['baseline']]['arm']}]({links[row['baseline']]})" in block
    assert f"[{labels[row['candidate']]['arm']}]({links[row['candidate']]})" in block
    assert f"({row['winner']})" in block


def test_diff_and_title_claim_only_the_overrides_that_are_written(policy: Policy, tmp_path) -> None:
    from promote_sim import base_lane

    from ablate.config.load import load_defaults
    from ablate.promote import write_defaults
    from ablate.promote.git_pr import _title

    loud = {"noise": 0.007, "aa_per_host": 2}
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(DEFAULTS.read_text())
    promoting = simulate(Sim(features=[moe(1.05)], lane=base_lane(), block_prefix="A-", **loud), 0)

    def diff_row(result: PromotionResult) -> str:
        return next(line for line in result.markdown.split("### Defaults diff")[1].splitlines()
                    if line.startswith("| `moe_dispatch`"))

    # Two lanes of one shape (feature values are not part of it): one promotes, its sibling holds. No override
    # can be written (it would make the sibling run a value it did not earn), so nothing may claim one.
    sibling = simulate(Sim(features=[moe(1.0)], lane=base_lane(**{"features.mamba_scan": "chunked"}),
                           block_prefix="B-", **loud), 1)
    held = promote(promoting + sibling, policy_path=policy, defaults_path=defaults)
    assert sorted(v.verdict for v in held.verdicts) == ["HOLD", "PROMOTE"]
    [change] = held.changes
    assert change.scope == "lane" and change.overrides == {}
    row = diff_row(held)
    assert "lane override" not in row and "| `padded` | no change (evidence only): " in row
    assert all(why.replace("'", "") in row.replace("'", "") for why in change.not_global)
    assert _title(held) == f"promotion report {held.report_id} (no change)"
    write_defaults(held, defaults)
    assert "lane_overrides" not in load_defaults(defaults).raw["features"]["moe_dispatch"]
    # The control: with the holding lane of another shape, the promoting lane's shape gets its override, and
    # the report and title say so.
    other_shape = simulate(Sim(features=[moe(1.0)], lane=base_lane(**{"batch.seq_len": 128}), block_prefix="B-",
                               **loud), 1)
    alone = promote(promoting + other_shape, policy_path=policy, defaults_path=DEFAULTS)
    row = diff_row(alone)
    assert "| `padded` | `padded` (lane override: `jagged`); not global: " in row and "| lane |" in row
    [change] = alone.changes
    assert change.not_global and all(why.replace("'", "") in row.replace("'", "") for why in change.not_global)
    assert _title(alone) == "promote: moe_dispatch=jagged (lane) (sim)"
