"""The `ablate` CLI as a user runs it: `python -m ablate ...` in a real process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOKE_RECEIPTS = REPO / "tests" / "promote" / "assets" / "smoke_run" / "receipts"


def ablate(*args: str, cwd: Path = REPO, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ablate", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                                "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"})


def test_help_lists_every_command() -> None:
    out = ablate("--help")
    assert out.returncode == 0, out.stderr
    for command in ("validate", "sweep", "receipts", "promote", "revalidate", "doctor"):
        assert command in out.stdout


def test_every_search_space_validates() -> None:
    out = ablate("validate")
    assert out.returncode == 0, out.stdout + out.stderr
    campaigns = sorted(p.name for p in (REPO / "search_spaces").glob("*.yaml") if p.name != "defaults.yaml")
    for name in campaigns + ["defaults.yaml", "default.yaml", "single_node.yaml"]:
        assert name in out.stdout, f"{name} not validated"
    assert "nam56r_gpu.yaml" in out.stdout and "FAIL" not in out.stdout + out.stderr


def test_validate_plan_shows_what_a_campaign_will_run() -> None:
    from ablate.config.load import load_sweep
    from ablate.sweep.plan import plan_sweep

    out = ablate("validate", "search_spaces/smoke.yaml", "--plan")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    sweep, defaults = load_sweep(REPO / "search_spaces" / "smoke.yaml")
    plan = plan_sweep(sweep, "validate", defaults)
    (lane_key,) = plan.lane_keys()
    assert f"lane {lane_key[:12]}: device auto" in text and "pattern AMEE (A1 M1 E2)" in text
    assert f"{sweep.lane.budget.steps} steps per arm" in text and "horizon 10,000 steps" in text
    rows = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]
    table = {cells[1].strip(): [c.strip() for c in cells] for cells in rows if len(cells) == 6}
    assert table["mamba_scan"][2:] == ["sequential", "chunked", "speed", str(sweep.blocks)]
    assert table["moe_dispatch"][2:] == ["padded", "jagged", "speed", str(sweep.blocks)]
    assert table["stp"][2:] == ["off", "on", "tax", str(sweep.blocks)]
    assert table["A/A (noise floor)"][5] == str(sweep.aa_blocks)
    assert "recurrent_scan=parallel" in text and "no R (recurrent) blocks" in text
    assert f"{len(plan.blocks)} blocks, {2 * len(plan.blocks)} arms per round" in text and "block(s) at once" in text
    assert "Host memory an arm frees: retain (resources.host_allocator)" in " ".join(text.split())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("lane: {model: {pattern: AEXM}}\nfeatures: {moe_dispatch: [jagged]}\n", "lane.model.pattern"),
        ("lane: {model: {n_experts: 2, top_k: 3}}\nfeatures: {moe_dispatch: [jagged]}\n", "lane.model.top_k: got 3"),
        ("lane: {batch: {seq_len: 40}}\nfeatures: {moe_dispatch: [jagged]}\n", "lane.batch.seq_len: got 40"),
        ("lane: {engine: {name: deepspeed, zero_stage: 7}}\nfeatures: {moe_dispatch: [jagged]}\n",
         "lane.engine.zero_stage: got 7"),
        ("lane: {budget: {steps: -3}}\nfeatures: {moe_dispatch: [jagged]}\n", "lane.budget.steps: got -3"),
        ("features: {moe_dispatch: [padded]}\n", "different from the baseline"),
        ("features: {moe_dispatch: [jagged]}\nresources: {cpus_per_worker: 0}\n", "resources.cpus_per_worker: got 0"),
        ("features: {moe_dispatch: [jagged]}\nresources: {host_allocator: jemalloc}\n",
         "resources.host_allocator: got 'jemalloc'; allowed: one of retain, system"),
        ("lane: {model: {pattern: AEMR}\n", "well-formed YAML"),
    ],
)
def test_bad_campaigns_fail_validation_with_key_and_value(tmp_path: Path, body: str, message: str) -> None:
    shutil.copy(REPO / "search_spaces" / "defaults.yaml", tmp_path / "defaults.yaml")
    (tmp_path / "bad.yaml").write_text(body)
    out = ablate("validate", str(tmp_path / "bad.yaml"))
    assert out.returncode == 1
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_bad_pattern_names_character_and_position(tmp_path: Path) -> None:
    shutil.copy(REPO / "search_spaces" / "defaults.yaml", tmp_path / "defaults.yaml")
    (tmp_path / "bad.yaml").write_text("lane: {model: {pattern: AEXM}}\nfeatures: {moe_dispatch: [jagged]}\n")
    out = ablate("validate", str(tmp_path / "bad.yaml"))
    assert "'X'" in out.stderr and "position 2" in out.stderr, out.stderr


def test_sweep_refuses_bad_input_before_any_trial(tmp_path: Path) -> None:
    shutil.copy(REPO / "search_spaces" / "defaults.yaml", tmp_path / "defaults.yaml")
    (tmp_path / "bad.yaml").write_text("lane: {model: {n_experts: 2, top_k: 3}}\nfeatures: {moe_dispatch: [jagged]}\n")
    out = ablate("sweep", str(tmp_path / "bad.yaml"), cwd=tmp_path)
    assert out.returncode == 2 and "lane.model.top_k: got 3" in out.stderr
    assert not (tmp_path / "ablate_runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_receipts_list_and_show_read_receipts_on_disk() -> None:
    listed = ablate("receipts", "list", "--source", str(SMOKE_RECEIPTS))
    assert listed.returncode == 0, listed.stderr
    first = sorted(SMOKE_RECEIPTS.glob("*.json"))[0]
    receipt = json.loads(first.read_text())
    assert receipt["identity"]["receipt_id"][:8] in listed.stdout
    shown = ablate("receipts", "show", receipt["identity"]["receipt_id"][:12], "--source", str(SMOKE_RECEIPTS))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["identity"]["receipt_id"] == receipt["identity"]["receipt_id"]


def test_promote_refuses_bad_receipts_by_name(tmp_path: Path) -> None:
    source = tmp_path / "receipts"
    shutil.copytree(SMOKE_RECEIPTS, source)
    good = json.loads(sorted(source.glob("*.json"))[0].read_text())
    future = dict(good, schema_version="9.0.0")
    future["identity"] = dict(good["identity"], receipt_id="future-major")
    (source / "future.json").write_text(json.dumps(future))
    incomplete = {k: v for k, v in good.items() if k != "time"}
    incomplete["identity"] = dict(good["identity"], receipt_id="incomplete")
    (source / "incomplete.json").write_text(json.dumps(incomplete))
    out = ablate("promote", "--source", str(source), "--policy", "search_spaces/policies/single_node.yaml",
                 "--out", str(tmp_path / "reports"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unknown major 9" in out.stdout + out.stderr
    assert "time" in out.stdout + out.stderr and "incomplete.json" in out.stdout + out.stderr
    reports = list((tmp_path / "reports").glob("*.json"))
    assert len(reports) == 1 and isinstance(json.loads(reports[0].read_text()), dict)


def test_promote_links_every_block_and_arm_into_the_mlflow_ui(tmp_path: Path) -> None:
    from sweeps_common import fresh_mlflow_uri, smoke_round

    sweep_dir = smoke_round(tmp_path / "sweep")
    uri = fresh_mlflow_uri(tmp_path)  # the migrated empty schema, copied: sync does not migrate a new store first
    synced = ablate("receipts", "sync", str(sweep_dir), "--tracking-uri", uri, timeout=300)
    assert synced.returncode == 0 and "8 receipt(s) logged" in synced.stdout, synced.stdout + synced.stderr
    out = ablate("promote", "--tracking-uri", uri, "--out", str(tmp_path / "local"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (report,) = (tmp_path / "local").glob("*.json")
    links = json.loads(report.read_text())["links"]
    # A SQLite store has no UI: links point where `mlflow ui` serves it, and the command is printed with them.
    command = f"mlflow ui --backend-store-uri {uri}"
    assert links["ui"] == "http://127.0.0.1:5000" and links["mlflow_ui_command"] == command
    assert command in out.stdout and f"serve this store there first: `{command}`" in out.stdout
    assert len(links["blocks"]) == 4 and links["arms_without_block_run"] == []
    assert all(len(block["arms"]) == 2 for block in links["blocks"])
    urls = [block["url"] for block in links["blocks"]] + [a["url"] for b in links["blocks"] for a in b["arms"]]
    assert len(set(urls)) == 12 and all(u.startswith("http://127.0.0.1:5000/#/experiments/") for u in urls)
    assert [b["label"] for b in links["blocks"]] == [f"r0b9e·{b}·moe_dispatch=padded→jagged"
                                                    for b in ("b001", "b005", "b009", "b013")]
    assert "runs:/" not in out.stdout
    served = ablate("promote", "--tracking-uri", uri, "--ui-url", "https://mlflow.example.org/", "--out",
                    str(tmp_path / "served"), timeout=300)
    assert served.returncode == 0, served.stdout + served.stderr
    (report,) = (tmp_path / "served").glob("*.json")
    links = json.loads(report.read_text())["links"]
    assert links["ui"] == "https://mlflow.example.org" and links["mlflow_ui_command"] is None
    assert all(b["url"].startswith("https://mlflow.example.org/#/experiments/") for b in links["blocks"])
    assert "mlflow ui --backend-store-uri" not in served.stdout


def test_promote_with_only_bad_receipts_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"schema_version": "3.0.0", "identity": {}}))
    out = ablate("promote", "--source", str(tmp_path), "--out", str(tmp_path / "reports"))
    assert out.returncode == 2 and "no valid receipts" in out.stderr and "unknown major 3" in out.stderr


def test_doctor_reports_hardware_and_versions(tmp_path: Path) -> None:
    out = ablate("doctor", "--tracking-uri", f"sqlite:///{tmp_path / 'doctor.db'}", cwd=tmp_path)
    assert "hardware" in out.stdout and "torch=2.13" in out.stdout and "ray=2.60" in out.stdout
    assert "mlflow" in out.stdout and out.returncode == 0, out.stdout + out.stderr


def test_cuda_lane_without_gpus_per_worker_is_refused(tmp_path: Path) -> None:
    shutil.copy(REPO / "search_spaces" / "defaults.yaml", tmp_path / "defaults.yaml")
    (tmp_path / "gpu.yaml").write_text("lane: {hardware: {device: cuda}}\nfeatures: {moe_dispatch: [jagged]}\n")
    out = ablate("validate", str(tmp_path / "gpu.yaml"))
    assert out.returncode == 1 and "resources.gpus_per_worker: got 0" in out.stderr, out.stderr


def test_gpu_campaign_on_a_gpu_less_cluster_fails_before_any_trial(tmp_path: Path) -> None:
    shutil.copy(REPO / "search_spaces" / "defaults.yaml", tmp_path / "defaults.yaml")
    (tmp_path / "gpu.yaml").write_text("lane: {hardware: {device: cuda}}\nfeatures: {moe_dispatch: [jagged]}\n"
                                       "resources: {gpus_per_worker: 1}\n")
    out = ablate("sweep", str(tmp_path / "gpu.yaml"), "--no-progress", cwd=tmp_path, timeout=240)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "lane.hardware.device: got 'cuda'" in out.stderr and "no GPUs" in out.stderr
    assert not list((tmp_path / "ablate_runs").rglob("*.json")), "no trial ran, no receipt was written"


def test_validate_passes_on_the_promotion_branch_and_names_what_it_skips(tmp_path: Path) -> None:
    # The repository as `promote --write --branch` leaves it after mamba_scan=chunked was promoted globally:
    # every campaign still testing chunked must validate (skipped with a notice), or the PR fails its own CI.
    from types import SimpleNamespace

    from ablate.config.lane_shape import lane_shape
    from ablate.config.load import flatten, lane_to_dict, load_defaults, load_sweep
    from ablate.promote.analysis import PROMOTE, FeatureVerdict
    from ablate.promote.defaults_writer import plan_changes, render_defaults
    from ablate.promote.policy import load_policy

    spaces = tmp_path / "search_spaces"
    shutil.copytree(REPO / "search_spaces", spaces)
    verdicts = [FeatureVerdict(feature="mamba_scan", value="chunked", baseline_value="sequential", kind="speed",
                               lane_key=f"lane-{device}", software_fingerprint="sw-1", verdict=PROMOTE,
                               lane_shape=lane_shape(flatten(lane_to_dict(load_sweep(spaces / name)[0].lane)), device),
                               device_class=device, speedup=1.2, ci95=(1.1, 1.3), n_blocks=12, n_hosts=3)
                for device, name in (("cpu", "smoke.yaml"), ("cuda", "nam56r_gpu.yaml"))]
    defaults = spaces / "defaults.yaml"
    changes = plan_changes(verdicts, load_defaults(defaults), load_policy(spaces / "policies" / "default.yaml"),
                           report_id="promote-cli-1", campaign="c", date="2026-03-09")
    assert [(c.feature, c.scope) for c in changes] == [("mamba_scan", "global")]
    text, _ = render_defaults(defaults.read_text(), SimpleNamespace(changes=changes, revalidations=[],
                                                                    report_id="promote-cli-1", date="2026-03-09"))
    defaults.write_text(text)
    out = ablate("validate", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout + out.stderr
    for name in ("smoke.yaml", "nam56r_gpu.yaml"):
        assert f"ok   search_spaces/{name}" in out.stdout
    testing = [p for p in spaces.glob("*.yaml") if "mamba_scan: [chunked]" in p.read_text()]
    assert len(testing) >= 2  # smoke.yaml and nam56r_gpu.yaml at least
    assert out.stdout.count("skip mamba_scan=chunked: already this lane's default (global default since report "
                            "promote-cli-1)") == len(testing), out.stdout


@pytest.mark.parametrize("command", [["promote"], ["receipts", "list"], ["receipts", "show", "abc"]])
def test_a_bad_process_count_is_refused_before_any_receipt_is_read(tmp_path: Path, command: list[str]) -> None:
    from typer.testing import CliRunner

    from ablate.cli import app

    missing = tmp_path / "no-such-dir"  # never reached: the variable is checked first
    out = CliRunner().invoke(app, [*command, "--source", str(missing)], env={"ABLATE_PROCESSES": "two"})
    assert out.exit_code == 2, out.output
    assert "ABLATE_PROCESSES='two'" in out.output and "allowed: a whole number >= 1" in out.output
    assert "no such file" not in out.output


def test_what_a_command_loads_is_frozen_and_the_collector_is_left_as_it_was(tmp_path: Path) -> None:
    """Loaded receipts live until the command exits: frozen before the collector comes back on, its first pass does
    not walk them (1.2 million objects, 0.7 s of a 10,000-receipt promote). On every way out, even a refused
    source, the collector is on again if it was."""
    import gc

    import typer

    from ablate import cli

    gc.unfreeze()
    try:
        receipts, rejected, _ = cli._load_source(SMOKE_RECEIPTS, None, "ablate", None)
        assert receipts and rejected == [] and gc.isenabled()
        frozen = gc.get_freeze_count()
        assert frozen > 0 and all(gc.is_tracked(r) for r in receipts[:3])
        gc.unfreeze()
        with pytest.raises(typer.Exit):
            cli._load_source(tmp_path / "missing", None, "ablate", None)
        assert gc.isenabled()
        gc.disable()
        cli._load_source(SMOKE_RECEIPTS, None, "ablate", None)
        assert not gc.isenabled(), "a caller that had it off keeps it off"
    finally:
        gc.enable()
        gc.unfreeze()


EXIT_PROBE = """
import atexit, os, sys, threading, time
from pathlib import Path

out = Path(sys.argv[1])
def late() -> None:  # a thread still at work when the command returns: the exit waits for it, as Python's does
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
atexit.register(lambda: (out / "atexit").write_text("ran"))
atexit.register(print, "printed at exit", flush=False)
import gc
gc.disable()  # only the exit collects: the cycle below is garbage it must still finalize
class Cycle:
    def __del__(self) -> None:
        (out / "cycle").write_text("collected")
cycle = Cycle()
cycle.me = cycle
del cycle
atexit.register(lambda: (out / "frozen").write_text(str(gc.get_freeze_count())))
hard_exit = os._exit
def recorded(code: int) -> None:
    (out / "hard_exit").write_text(str(code))
    hard_exit(code)
os._exit = recorded
sys.argv = ["ablate", *sys.argv[2:]]
from ablate.cli import entry
entry()
"""


@pytest.mark.parametrize("args, code, hard", [
    (["receipts", "list", "--source", str(SMOKE_RECEIPTS)], 0, True),  # it keeps what it read until the exit
    (["validate", "search_spaces/smoke.yaml"], 0, False), (["validate", "search_spaces/no-such.yaml"], 1, False)])
def test_the_exit_does_what_a_normal_exit_does_before_it_skips_the_teardown(tmp_path: Path, args: list[str],
                                                                           code: int, hard: bool) -> None:
    """After a command that read receipts, ``entry`` ends the process without freeing every object
    (``cli._exit_now``); first it joins other threads, runs the atexit callbacks and flushes what was printed, and
    exits with the command's code. Every other command exits as Python does, its garbage collected and the rest
    frozen first (``cli._collected_and_frozen``)."""
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(tmp_path), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                                       "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    assert done.returncode == code, done.stderr
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
    assert done.stdout.endswith("printed at exit\n"), done.stdout
    assert (tmp_path / "hard_exit").exists() is hard
    if not hard:
        # The normal exit collected the garbage, finalizers run, and froze what lives for the interpreter's exit,
        # whose collections then skip it.
        assert (tmp_path / "cycle").read_text() == "collected" and int((tmp_path / "frozen").read_text()) > 0
    expected = {"receipts": "mamba_scan=chunked", "validate": "ok   search_spaces/smoke.yaml"}[args[0]] if code == 0 else "no-such"
    assert expected in (done.stdout if code == 0 else done.stderr), done.stdout + done.stderr


def test_ctrl_c_while_the_exit_waits_for_a_thread_ends_it_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl+C while the short exit waits for a thread (an MLflow upload) gives up on the thread, as the interpreter's
    own exit does, and still runs the atexit callbacks and keeps the command's code; one line says so."""
    import signal

    probe = EXIT_PROBE.replace("time.sleep(0.3)", "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", probe, str(tmp_path), "receipts", "list", "--source",
                             str(SMOKE_RECEIPTS)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(REPO),
                                 "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None and proc.stderr is not None
        seen = b""
        while b"mamba_scan=chunked" not in seen:  # the command's table: it returned, the exit waits for the thread
            line = proc.stdout.readline()
            assert line, proc.stderr.read().decode(errors="replace")
            seen += line
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, raw_err = proc.communicate(timeout=30)
        err = raw_err.decode(errors="replace")
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "interrupted while waiting for background threads" in err, err
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "hard_exit").read_text() == "0"
    assert not (tmp_path / "thread").exists()


def test_only_the_installed_command_keeps_what_a_command_read_until_the_exit(tmp_path: Path) -> None:
    """A command run in process (a test's runner, a library call, ``main``) frees what it read on return and exits
    by ``SystemExit``: only ``entry``, which ends the process right after, keeps it; and an exit code that is not
    a number is left to Python's exit."""
    from typer.testing import CliRunner

    from ablate import cli

    out = CliRunner().invoke(cli.app, ["receipts", "list", "--source", str(SMOKE_RECEIPTS)])
    assert out.exit_code == 0, out.output
    assert cli._exit_keeps is None
    argv = sys.argv
    sys.argv = ["ablate", "receipts", "list", "--source", str(SMOKE_RECEIPTS)]
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main()  # the process goes on: this test's code after it runs
    finally:
        sys.argv = argv
    assert exited.value.code == 0 and cli._exit_keeps is None
    cli._exit_now("not a number")  # returns: SystemExit prints the text and exits 1


def test_promote_leaves_the_collector_off_to_the_exit_only_in_the_installed_command(tmp_path: Path) -> None:
    """The rule's and the report's objects live until exit: the installed command skips the collector's passes
    over them (it exits without a collection); a promotion run in process gives the collector back on return."""
    import gc

    from typer.testing import CliRunner

    from ablate import cli, parallel

    args = ["promote", "--source", str(SMOKE_RECEIPTS), "--policy", "search_spaces/policies/single_node.yaml",
            "--out", str(tmp_path / "in-process")]
    assert gc.isenabled()
    try:
        out = CliRunner().invoke(cli.app, args)
        assert out.exit_code == 0, out.output
        assert gc.isenabled(), "back on for the code that ran the command"
        assert not parallel._meanwhile, "what the command left for its children's time ended with it"
    finally:
        gc.enable()
    probe = ("import atexit, gc, sys\nfrom ablate import cli\n"
             "atexit.register(lambda: print('collector on at exit:', gc.isenabled()))\n"
             f"sys.argv = ['ablate', *{args[:-1] + [str(tmp_path / 'installed')]!r}]\ncli.entry()\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "collector on at exit: False" in done.stdout
