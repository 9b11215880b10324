"""The MLflow UI as a reader sees it, in a real headless browser: the experiment opens on its training runs, a
block run shows its speed-up and winner, and the promotion report's first link opens that block's run page.

Needs Debian's ``chromium`` and ``chromium-driver`` (``scripts/setup.sh`` installs them where apt can) and the
``selenium`` test dependency; it fails, never skips, when they are missing: a UI check that silently does not
run is the gap this test exists to close. Nothing is downloaded at run time (the driver's path is given).
Screenshots land in the test's tmp_path; their paths are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from sweeps_common import SMOKE_ROUND, fresh_mlflow_uri, smoke_round, start_mlflow_server, stop_mlflow_server

from ablate.receipts.store import load_receipts
from ablate.tracking.blocks import SPEEDUP_METRIC
from ablate.tracking.mapping import ARM_PROMOTION_METRIC, ROLE_BLOCK, TAG, sweep_run_name
from ablate.tracking.mlflow_store import MlflowStore, TrackingClient

CHROMIUM, CHROMEDRIVER = "chromium", "chromedriver"
PAGE_TIMEOUT_S = 60


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: run scripts/setup.sh as root on Debian (it apt-installs chromium "
                    f"and chromium-driver), or install them by hand; this test never skips", pytrace=False)
    return path


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    chromium, driver_path = _require(CHROMIUM), _require(CHROMEDRIVER)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        pytest.fail(f"selenium is missing ({exc}): install the test extras (scripts/setup.sh)", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1600,1000", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def _wait_for(driver: Any, condition: Callable[[str], bool], what: str, shot: Path, show: str = "") -> str:
    """The page's visible text once ``condition`` holds for it, screenshot taken with the element whose text is
    ``show`` scrolled into view; on timeout, a screenshot and the text so far."""
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    text = ""
    while time.monotonic() < deadline:
        text = driver.find_element("tag name", "body").text
        if condition(text):
            if show:
                element = driver.find_element("xpath", f"//*[normalize-space(text())='{show}']")
                driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
            driver.save_screenshot(str(shot))
            print(f"screenshot: {shot}")
            return text
        time.sleep(0.5)
    driver.save_screenshot(str(shot))
    raise AssertionError(f"{what} not shown within {PAGE_TIMEOUT_S}s at {driver.current_url} (screenshot {shot}); "
                         f"page text: {text[:1500]}")


def _log_round(uri: str, tmp_path: Path) -> None:
    """One recorded smoke round's moe_dispatch arms (four blocks), logged through the sweep's MlflowStore."""
    sweep_dir = smoke_round(tmp_path / "sweep")
    store = MlflowStore(uri, "ablate", sweep_dir)
    store.open_sweep(SMOKE_ROUND, "smoke", {}, {}, system_metrics=False)
    receipts, _ = load_receipts(sweep_dir / "receipts")
    for receipt in receipts:
        assert store.log_receipt(receipt) is not None, store.offline_reason
    store.close_sweep(SMOKE_ROUND, receipts, failed=False)


def _serve_logged_store(tmp_path: Path) -> tuple[Any, str, str]:
    """(server process, UI URL, tracking URI): ``mlflow server`` over a SQLite store holding a logged round.
    The server boots (a separate process, ~30 s on 2 busy cores) while this process logs the round."""
    uri = fresh_mlflow_uri(tmp_path / "store")
    failures: list[BaseException] = []

    def log() -> None:
        try:
            _log_round(uri, tmp_path)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failures.append(exc)

    worker = threading.Thread(target=log)
    worker.start()
    try:
        server, ui = start_mlflow_server(tmp_path / "store" / "mlflow.db", tmp_path / "served-artifacts",
                                         tmp_path / "mlflow-server.log")
    finally:
        worker.join()
    if failures:
        if "server" in locals():
            stop_mlflow_server(server)
        raise failures[0]
    return server, ui, uri


def _report(uri: str, ui: str, out: Path) -> dict[str, Any]:
    from typer.testing import CliRunner

    from ablate.cli import app

    result = CliRunner().invoke(app, ["promote", "--tracking-uri", uri, "--ui-url", ui, "--out", str(out),
                                      "--policy", "search_spaces/policies/single_node.yaml"])
    assert result.exit_code == 0, result.output[-3000:]
    (report,) = out.glob("*.json")
    markdown = report.with_suffix(".md").read_text()
    return {"json": json.loads(report.read_text()), "markdown": markdown}


def test_the_ui_opens_on_training_runs_and_the_report_links_to_block_pages(browser: Any, tmp_path: Path) -> None:
    server, ui, uri = _serve_logged_store(tmp_path)
    try:
        client = TrackingClient(uri, "ablate")
        report = _report(uri, ui, tmp_path / "reports")

        # 1. The experiment opens on its runs (training view), not on the GenAI overview.
        browser.get(f"{ui}/#/experiments/{client.experiment_id}?workflowType=machine_learning")
        text = _wait_for(browser, lambda t: sweep_run_name(SMOKE_ROUND) in t, "the sweep run in the runs table",
                         tmp_path / "experiment.png")
        url = browser.current_url
        assert "/runs" in url and "/overview" not in url and "workflowType=machine_learning" in url, url
        assert "Run Name" in text and "matching runs" in text, text[:2000]

        # 2. The report's first link is a block run, and it opens that block's page with its answer.
        first = re.search(r"\]\((http[^)\s]+)\)", report["markdown"])
        assert first is not None, "no http link in the report"
        blocks = {b["url"]: b for b in report["json"]["links"]["blocks"]}
        assert first.group(1) in blocks, (first.group(1), list(blocks))
        run_id = first.group(1).split("/runs/")[1].split("?")[0]
        block = client.client.get_run(run_id)
        assert block.data.tags[TAG + "role"] == ROLE_BLOCK and block.info.run_name == blocks[first.group(1)]["label"]
        speedup = block.data.metrics[SPEEDUP_METRIC]
        winner = block.data.params["winner"]
        browser.get(first.group(1))
        text = _wait_for(browser, lambda t: SPEEDUP_METRIC in t and block.info.run_name in t,
                         "the block run's metrics", tmp_path / "block-run.png", show=SPEEDUP_METRIC)
        assert re.search(rf"{SPEEDUP_METRIC}\s+{str(speedup)[:5]}", text), text[:3000]
        assert re.search(rf"winner\s+{winner}", text) and winner in ("candidate", "baseline", "tie"), text[:3000]
        assert f"winner **{winner}**".replace("**", "") in text.replace("**", "")  # the run description
        # The answer is the first metric listed.
        metrics = text.split("Metrics (")[1].split("Parameters (")[0]
        assert metrics.split("Value", 1)[1].split()[0].startswith("0_"), metrics

        # 3. MLflow's own compare view of that block's two arms: both runs side by side, the toggle among params.
        arms = blocks[first.group(1)]["arms"]
        arm_ids = [a["url"].split("/runs/")[1].split("?")[0] for a in arms]
        names = [client.client.get_run(i).info.run_name for i in arm_ids]
        assert len(arm_ids) == 2 and all(block.info.run_name.split("·")[1] in n for n in names), names
        browser.get(f"{ui}/#/compare-runs?runs={json.dumps(arm_ids)}&experiments={json.dumps([client.experiment_id])}"
                    f"&workflowType=machine_learning")
        text = _wait_for(browser, lambda t: all(n in t for n in names) and "features.moe_dispatch" in t
                         and ARM_PROMOTION_METRIC in t, "both arms in the compare view", tmp_path / "compare.png")
        assert "Comparing 2 Runs" in text, text[:2000]
    finally:
        stop_mlflow_server(server)
