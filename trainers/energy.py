"""Energy an arm's budget steps drew: NVML on a GPU, RAPL on a CPU host, or null with the reason.

How to use::

    meter = open_meter(device)            # never raises: meter.source is None and meter.why says why
    meter.begin(); ...steps...; meter.end()        # once around a window (CUDA: after a sync at both ends)
    with meter.span(): step()                      # or summed over the arm's own steps (interleaved CPU arms)
    meter.record(tokens)                           # the receipt's ``energy`` section (joules, J/token, watts)

Sources, best first:

* ``nvml_energy_counter``: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded; Volta and newer),
  for the arm's own GPU (found by UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering cannot pick another board);
* ``nvml_power_samples``: where the counter is unsupported, ``nvmlDeviceGetPowerUsage`` sampled every 20 ms on a
  thread and integrated (trapezoids) - coarser, and says so;
* ``rapl``: the CPU packages' ``energy_uj`` under ``/sys/class/powercap`` (Intel, and AMD since Linux 5.8). A
  package counter is host-wide: it includes every other process on the host. It wraps at ``max_energy_range_uj``,
  which ``_Rapl`` unwraps. Reading it needs root on kernels since 5.10 (CVE-2020-8694): otherwise null, with why.

GPU joules cover the board only (not host CPU or DRAM); CPU joules the packages (and their DRAM domain where the
package zone includes it). Receipts carry the source and scope next to the number, and the report shows energy per
token beside the speed-up without any verdict on it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

POWERCAP_ENV = "ABLATE_POWERCAP_ROOT"
"""Where the powercap tree is (default ``/sys/class/powercap``): a node that mounts sysfs elsewhere, and tests."""
SAMPLE_S = 0.02


@dataclass
class EnergyMeter:
    source: Optional[str] = None
    scope: str = ""
    why: str = ""
    _read: Any = None
    _close: Any = None
    joules: float = 0.0
    seconds: float = 0.0
    _open: Optional[tuple[float, float]] = field(default=None, repr=False)

    @property
    def available(self) -> bool:
        return self._read is not None

    def begin(self) -> None:
        if self._read is not None:
            joules = self._safe_read()
            self._open = None if joules is None else (joules, time.perf_counter())

    def end(self) -> None:
        if self._read is not None and self._open is not None:
            start_j, start_t = self._open
            self._open = None
            joules = self._safe_read()
            if joules is not None:
                self.joules += max(0.0, joules - start_j)
                self.seconds += time.perf_counter() - start_t

    def _safe_read(self) -> Optional[float]:
        try:
            return float(self._read())
        except Exception as exc:  # noqa: BLE001 - a counter that fails mid-arm voids the number, never the arm
            self.why = f"{self.source} read failed mid-arm: {type(exc).__name__}: {exc}"
            self._read, self.source = None, None
            return None

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def record(self, tokens: int) -> dict[str, Any]:
        """The receipt's ``energy`` section for the spans measured so far."""
        if self._read is None:
            return {"source": None, "scope": self.scope, "why": self.why or "no energy source"}
        if self.seconds <= 0:
            return {"source": self.source, "scope": self.scope, "why": "no step was measured"}
        return {"source": self.source, "scope": self.scope, "joules": self.joules, "seconds": self.seconds,
                "tokens": tokens, "joules_per_token": self.joules / tokens if tokens > 0 else None,
                "mean_watts": self.joules / self.seconds, "why": ""}

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def open_meter(device: torch.device) -> EnergyMeter:
    try:
        return _nvml_meter(device) if device.type == "cuda" else _rapl_meter()
    except Exception as exc:  # noqa: BLE001 - an energy reading must never fail an arm
        return EnergyMeter(why=f"energy meter failed to open: {type(exc).__name__}: {exc}")


def combine_energy(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's energy from its ranks' records: every distinct scope once (ranks on one host share the package
    counter RAPL reads; each GPU is its own scope), null when any rank could not measure."""
    missing = [r for r in records if r.get("joules") is None]
    if missing:
        return {"source": None, "scope": missing[0].get("scope", ""),
                "why": f"{len(missing)} of {len(records)} ranks could not measure: {missing[0].get('why', '')}"}
    scopes = {r["scope"]: r for r in records}
    joules = sum(r["joules"] for r in scopes.values())
    seconds = max(r["seconds"] for r in records)
    tokens = records[0]["tokens"]
    return {"source": "+".join(sorted({r["source"] for r in records})),
            "scope": "; ".join(sorted(scopes)) if len(scopes) > 1 else next(iter(scopes)),
            "joules": joules, "seconds": seconds, "tokens": tokens,
            "joules_per_token": joules / tokens if tokens > 0 else None, "mean_watts": joules / seconds, "why": ""}


# --- RAPL ---


class _Rapl:
    """Sum of the package zones' counters in joules, unwrapped (each counter wraps at its own range)."""

    def __init__(self, zones: list[tuple[Path, int]]) -> None:
        self.zones = zones
        self.last = [self._raw(path) for path, _ in zones]
        self.total_uj = 0

    @staticmethod
    def _raw(path: Path) -> int:
        return int((path / "energy_uj").read_text().strip())

    def __call__(self) -> float:
        for i, (path, wrap) in enumerate(self.zones):
            now = self._raw(path)
            delta = now - self.last[i]
            self.total_uj += delta if delta >= 0 else (delta + wrap if wrap > 0 else 0)
            self.last[i] = now
        return self.total_uj / 1e6


def _rapl_meter() -> EnergyMeter:
    root = Path(os.environ.get(POWERCAP_ENV) or "/sys/class/powercap")
    if not root.is_dir():
        return EnergyMeter(why=f"no RAPL: {root} does not exist on this host (no powercap driver, or a container "
                               f"without /sys/class/powercap)")
    # Top-level zones only (intel-rapl:N, not intel-rapl:N:M): sub-zones (core, uncore, dram) are inside them.
    zones = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)
    packages = [p for p in zones if _text(p / "name").startswith("package")]
    if not packages:
        return EnergyMeter(why=f"no RAPL package zone under {root}")
    try:
        # The counter runs 0..max_energy_range_uj inclusive, so one wrap is that range + 1. No range file: the
        # wrap cannot be undone, so a wrapped delta is dropped rather than guessed (see _Rapl).
        parsed = [(p, int(_text(p / "max_energy_range_uj") or -1) + 1) for p in packages]
        reader = _Rapl(parsed)
    except PermissionError:
        return EnergyMeter(why=f"RAPL counters under {root} are readable by root only (Linux >= 5.10); run the "
                               f"workers as root or grant read access to energy_uj")
    except (OSError, ValueError) as exc:
        return EnergyMeter(why=f"RAPL counters under {root} cannot be read: {exc}")
    names = ", ".join(_text(p / "name") for p in packages)
    return EnergyMeter(source="rapl", scope=f"CPU {names} of {socket.gethostname()} (host-wide: every process on "
                                            f"the host)", _read=reader)


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# --- NVML ---


def _nvml_meter(device: torch.device) -> EnergyMeter:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver or library: null, with why
        return EnergyMeter(why=f"NVML unavailable: {exc}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid is not None
                  else pynvml.nvmlDeviceGetHandleByIndex(index))
        name = pynvml.nvmlDeviceGetName(handle)
    except pynvml.NVMLError as exc:  # e.g. a MIG instance: NVML knows its parent board by another UUID
        pynvml.nvmlShutdown()
        return EnergyMeter(why=f"NVML cannot find this GPU ({exc}): no energy reading")
    scope = f"GPU {index} of {socket.gethostname()} ({name}, board power only)"
    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return EnergyMeter(source="nvml_energy_counter", scope=scope,
                           _read=lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3,
                           _close=pynvml.nvmlShutdown)
    except pynvml.NVMLError as counter_error:
        try:
            pynvml.nvmlDeviceGetPowerUsage(handle)
        except pynvml.NVMLError as power_error:
            pynvml.nvmlShutdown()
            return EnergyMeter(why=f"NVML has neither an energy counter ({counter_error}) nor power readings "
                                   f"({power_error}) for this GPU")
        sampler = _PowerSampler(lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3)

        def close() -> None:
            sampler.stop()
            pynvml.nvmlShutdown()

        return EnergyMeter(source="nvml_power_samples", scope=scope + f", power sampled every {SAMPLE_S * 1e3:.0f} ms",
                           _read=sampler.joules, _close=close)


class _PowerSampler:
    """Integrates watts sampled on a daemon thread: the energy counter's stand-in on boards without one."""

    def __init__(self, watts: Any, clock: Any = time.perf_counter, thread: bool = True) -> None:
        self._watts, self._clock, self._lock, self._stop = watts, clock, threading.Lock(), threading.Event()
        self._joules, self._last = 0.0, (clock(), watts())
        self._thread = threading.Thread(target=self._run, name="ablate-power", daemon=True)
        if thread:
            self._thread.start()

    def _sample(self) -> None:
        now, watts = self._clock(), self._watts()
        with self._lock:
            then, before = self._last
            self._joules += (now - then) * (watts + before) / 2
            self._last = (now, watts)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(Exception):
                self._sample()

    def joules(self) -> float:
        with contextlib.suppress(Exception):
            self._sample()
        with self._lock:
            return self._joules

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
