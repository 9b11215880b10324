"""Energy in receipts: RAPL counters unwrapped and summed over the arm's own steps, ranks combined once per scope,
power samples integrated, and an honest null (with the reason) where the host has no counter.

This CPU host has no /sys/class/powercap, so the RAPL tests build the kernel's powercap layout (the files and
semantics of Documentation/power/powercap) in a temporary directory and move its counters themselves.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ablate.receipts.schema import Energy, validate_receipt
from trainers.energy import POWERCAP_ENV, _PowerSampler, combine_energy, open_meter
from trainers.run import run_arm
from trainer_helpers import make_spec, tiny_lane


def _zone(root: Path, name: str, zone: str, energy_uj: int, wrap: int = 2 ** 32) -> Path:
    path = root / zone
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{wrap - 1}\n")  # the counter's largest value; it wraps after it
    return path


def _set(path: Path, energy_uj: int) -> None:
    tmp = path / "energy_uj.tmp"
    tmp.write_text(f"{energy_uj}\n")
    os.replace(tmp, path / "energy_uj")  # the kernel's file never shows a half-written number


def test_rapl_sums_packages_skips_subzones_and_unwraps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg0 = _zone(tmp_path, "package-0", "intel-rapl:0", 900_000, wrap=1_000_000)
    pkg1 = _zone(tmp_path, "package-1", "intel-rapl:1", 5_000_000)
    core = _zone(tmp_path, "core", "intel-rapl:0:0", 0)  # inside package-0: counting it would count twice
    _zone(tmp_path, "psys", "intel-rapl:2", 0)          # platform zone, not a package
    monkeypatch.setenv(POWERCAP_ENV, str(tmp_path))
    meter = open_meter(torch.device("cpu"))
    assert meter.source == "rapl" and "package-0, package-1" in meter.scope and "host-wide" in meter.scope
    with meter.span():
        _set(pkg0, 150_000)              # wrapped: 900,000 -> 1,000,000 -> 150,000 is 250,000 uJ
        _set(pkg1, 5_500_000)            # 500,000 uJ
        _set(core, 999_999)
    meter.begin()                        # a partner's turn in between is not this arm's
    _set(pkg1, 9_000_000)
    meter._open = None                   # (the partner's energy: the arm's next span starts after it)
    with meter.span():
        _set(pkg1, 9_250_000)            # 250,000 uJ
    record = meter.record(tokens=1000)
    assert record["joules"] == pytest.approx(1.0) and record["joules_per_token"] == pytest.approx(1e-3)
    assert record["source"] == "rapl" and record["seconds"] > 0 and record["mean_watts"] > 0
    Energy(**record)


def test_no_powercap_or_root_only_counters_give_null_with_the_reason(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POWERCAP_ENV, str(tmp_path / "absent"))
    meter = open_meter(torch.device("cpu"))
    record = meter.record(tokens=10)
    assert record["source"] is None and "does not exist" in record["why"] and "joules" not in record
    if os.geteuid() != 0:  # root reads a 0400 file anyway: the refusal can only be provoked as another user
        zone = _zone(tmp_path, "package-0", "intel-rapl:0", 1)
        (zone / "energy_uj").chmod(0o000)
        monkeypatch.setenv(POWERCAP_ENV, str(tmp_path))
        assert "root only" in open_meter(torch.device("cpu")).why


def test_a_counter_that_breaks_mid_arm_voids_the_number_not_the_arm(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    zone = _zone(tmp_path, "package-0", "intel-rapl:0", 10)
    monkeypatch.setenv(POWERCAP_ENV, str(tmp_path))
    meter = open_meter(torch.device("cpu"))
    with meter.span():
        _set(zone, 20)
    (zone / "energy_uj").write_text("garbage\n")
    with meter.span():
        pass
    record = meter.record(tokens=5)
    assert record["source"] is None and "read failed mid-arm" in record["why"]


def test_ranks_are_combined_once_per_scope_and_null_when_one_could_not_measure() -> None:
    host = {"source": "rapl", "scope": "CPU package-0 of h1", "joules": 10.0, "seconds": 2.0, "tokens": 100}
    gpu0 = {"source": "nvml_energy_counter", "scope": "GPU 0 of h1", "joules": 30.0, "seconds": 2.0, "tokens": 100}
    gpu1 = {**gpu0, "scope": "GPU 1 of h1", "joules": 34.0, "seconds": 2.5}
    same_host = combine_energy([host, {**host, "joules": 10.5}])
    assert same_host["joules"] in (10.0, 10.5), "one package read by two ranks counts once"
    two_gpus = combine_energy([gpu0, gpu1])
    assert two_gpus["joules"] == 64.0 and two_gpus["joules_per_token"] == pytest.approx(0.64)
    assert two_gpus["seconds"] == 2.5 and two_gpus["mean_watts"] == pytest.approx(64.0 / 2.5)
    missing = combine_energy([gpu0, {"source": None, "scope": "GPU 1 of h1", "why": "NVML unavailable: x"}])
    assert missing["source"] is None and "1 of 2 ranks" in missing["why"] and "NVML unavailable" in missing["why"]


def test_power_samples_integrate_to_joules() -> None:
    # A hand-driven clock: the thread's timing on a loaded host must not decide the test.
    now, watts = {"t": 0.0}, {"w": 100.0}
    sampler = _PowerSampler(lambda: watts["w"], clock=lambda: now["t"], thread=False)
    for _ in range(10):                  # 0.2 s at 100 W
        now["t"] += 0.02
        sampler._sample()
    watts["w"] = 300.0
    for _ in range(10):                  # 0.2 s at 300 W; the first interval is a trapezoid from 100 W
        now["t"] += 0.02
        sampler._sample()
    assert sampler.joules() == pytest.approx(20.0 + 60.0 - 0.02 * 200.0 / 2)
    sampler.stop()

    live = _PowerSampler(lambda: 50.0)  # the real thread integrates too
    try:
        time.sleep(0.1)
        assert 0.0 < live.joules() < 50.0 * 5.0
    finally:
        live.stop()


def test_an_arm_records_its_energy_and_the_receipt_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zone = _zone(tmp_path / "powercap", "package-0", "intel-rapl:0", 0)
    monkeypatch.setenv(POWERCAP_ENV, str(tmp_path / "powercap"))
    stop = threading.Event()

    def draw() -> None:  # a package drawing 50 W: 250,000 uJ every 5 ms
        value = 0
        while not stop.wait(0.005):
            value += 250_000
            _set(zone, value)

    writer = threading.Thread(target=draw, daemon=True)
    writer.start()
    try:
        receipt = run_arm(make_spec(tiny_lane(model={"pattern": "AE"}), tmp_path / "receipts"))
    finally:
        stop.set()
        writer.join()
    validate_receipt(receipt)
    energy = receipt.energy
    assert energy is not None and energy.source == "rapl", energy
    assert energy.tokens == receipt.throughput.tokens > 0
    assert energy.joules > 0 and energy.joules_per_token == pytest.approx(energy.joules / energy.tokens)
    # Summed over the budget steps only: never more time than the arm's measured steps took.
    assert energy.seconds <= sum(receipt.steps.step_s) + sum(receipt.steps.data_s) + 0.05
    assert 10.0 < energy.mean_watts < 200.0, energy

    from ablate.receipts.schema import InvalidReceipt
    for bad in ({"joules_per_token": energy.joules_per_token * 2}, {"joules": -1.0, "joules_per_token": None}):
        forged = receipt.model_copy(update={"energy": energy.model_copy(update=bad)})
        with pytest.raises(InvalidReceipt, match="energy.joules"):
            validate_receipt(forged)
