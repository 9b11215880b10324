"""The progress display of a running sweep: blocks done / total, arms failed, elapsed and ETA.

It is a Ray Tune ``Callback`` on the driver. In a terminal it is a live ``rich`` line redrawn at most twice a
second; elsewhere (``ray job logs``, CI) it prints one plain line whenever a block finishes or fails, so logs stay
readable. Block counts come from Tune's own trial states, so a resumed sweep starts from what already finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from ray.tune import Callback
from rich.console import Console
from rich.live import Live
from rich.text import Text


def _clock(seconds: Optional[float]) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:d}:{rest % 60:02d}"


@dataclass
class Counts:
    total: int
    done: int = 0
    errored: int = 0
    running: int = 0
    arms: int = 0
    arms_failed: int = 0
    arms_disqualified: int = 0
    done_at_start: int = -1
    """Blocks already finished when this session started (resume); -1 until Tune reports its trials."""


class SweepProgress(Callback):
    """Live sweep status; ``eta()`` extrapolates from the blocks this session finished."""

    def __init__(self, total_blocks: int, title: str, console: Optional[Console] = None, live: Optional[bool] = None
                 ) -> None:
        self.counts = Counts(total=total_blocks)
        self.title = title
        self.console = console or Console(stderr=True)
        self.live_enabled = self.console.is_terminal if live is None else live
        self.started = time.monotonic()
        self._live: Optional[Live] = None
        self._last_draw = 0.0
        self._last_line = ""

    # --- figures ---

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def eta(self) -> Optional[float]:
        c = self.counts
        finished_here = c.done + c.errored - max(c.done_at_start, 0)
        remaining = c.total - c.done - c.errored
        if remaining <= 0:
            return 0.0
        if finished_here <= 0:
            return None
        return self.elapsed() / finished_here * remaining

    def line(self) -> str:
        c = self.counts
        return (f"{self.title}: blocks {c.done}/{c.total} done, {c.running} running, {c.errored} errored | "
                f"arms {c.arms} ({c.arms_failed} failed, {c.arms_disqualified} disqualified) | "
                f"elapsed {_clock(self.elapsed())} | ETA {_clock(self.eta())}")

    # --- Tune hooks ---

    def _recount(self, trials: list[Any]) -> None:
        states = [trial.status for trial in trials]
        self.counts.done = states.count("TERMINATED")
        self.counts.errored = states.count("ERROR")
        self.counts.running = states.count("RUNNING")
        if self.counts.done_at_start < 0:
            self.counts.done_at_start = self.counts.done + self.counts.errored

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < 0.5:
            return
        self._last_draw = now
        text = self.line()
        if self.live_enabled:
            if self._live is None:
                self._live = Live(Text(text), console=self.console, auto_refresh=False, transient=False)
                self._live.start()
            self._live.update(Text(text), refresh=True)
        else:
            # Plain logs: one line per change of the block/arm counts, never a line per redraw.
            key = text.split(" | elapsed")[0]
            if key != self._last_line:
                self._last_line = key
                self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        self._recount(trials)
        self._draw()

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        if result.get("event") != "arm":
            return
        self.counts.arms += 1
        status = result.get("status")
        self.counts.arms_failed += status == "failed"
        self.counts.arms_disqualified += status == "disqualified"

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._recount(trials)
        self._draw(force=True)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._recount(trials)
        self._draw(force=True)

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self._recount(trials)
        self.counts.running = 0
        self._draw(force=True)
        self.close()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
