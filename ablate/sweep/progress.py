"""The progress display of a running sweep: blocks done / total, arms failed, per feature the running speed-up
(geometric mean of the finished blocks' ratios at the lane's horizon: a glance, not a verdict), elapsed and ETA.

It is a Ray Tune ``Callback`` on the driver. In a terminal it is a live ``rich`` line redrawn at most twice a
second; elsewhere (``ray job logs``, CI) it prints one plain line whenever a block finishes or fails, so logs stay
readable. A resumed sweep starts from the blocks Tune restored as finished.

A block counts as done only when Tune completed its trial (``on_trial_complete``) *and* both arms of its latest
attempt reported a receipt (or the trial skipped it: its receipts are from an earlier session). Tune's state alone
cannot say this: on SIGINT, Tune saves its experiment, then stops every running trial by setting it TERMINATED,
the same status a finished trial has, without calling ``on_trial_complete``, and then calls
``on_experiment_end``. Those blocks are shown as interrupted, and ``--resume`` reruns them.
"""

from __future__ import annotations

import json
import math
import statistics
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
    interrupted: int = 0
    """Trials Tune stopped (SIGINT) before the block finished: TERMINATED, yet not done."""
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
        self._finished_before: Optional[set[str]] = None
        """Blocks Tune restored as finished (resume): their receipts are from an earlier session."""
        self._completed: set[str] = set()
        """Blocks whose trial Tune completed in this session (``on_trial_complete``; never called on SIGINT)."""
        self._skipped: set[str] = set()
        """Blocks the trial skipped because their receipts exist (a driver killed before Tune saved them)."""
        self._latest_attempt: dict[str, int] = {}
        self._arms: dict[tuple[str, int], set[int]] = {}
        """(block, attempt) -> arm indices that reported a receipt."""
        self._metric: dict[tuple[str, int], dict[str, tuple[str, float]]] = {}
        """(block, attempt) -> role -> (feature=value, horizon tokens/s) of its valid arms."""
        self._ratios: dict[str, list[float]] = {}
        """feature=value -> per-block log ratios at the horizon so far (the running speed-up; no verdict)."""

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
        stopped = f", {c.interrupted} interrupted" if c.interrupted else ""
        running = "".join(f" | {name} {math.exp(statistics.fmean(logs)):.2f}x ({len(logs)})"
                          for name, logs in sorted(self._ratios.items()))
        return (f"{self.title}: blocks {c.done}/{c.total} done, {c.running} running, {c.errored} errored{stopped} | "
                f"arms {c.arms} ({c.arms_failed} failed, {c.arms_disqualified} disqualified){running} | "
                f"elapsed {_clock(self.elapsed())} | ETA {_clock(self.eta())}")

    def _note_metric(self, block: str, attempt: int, result: dict[str, Any]) -> None:
        """Per-feature running speed-up: the geometric mean of finished blocks' horizon ratios, valid arms only."""
        try:
            receipt = json.loads(result.get("receipt") or "{}")
            ident, projection = receipt["identity"], receipt.get("projection") or {}
            tps = projection.get("tokens_per_s")
            if receipt["identity"]["status"] != "valid" or not tps or ident.get("feature") in (None, "bundle") \
                    or ident.get("kind") == "aa":
                return
            name = f"{ident['feature']}={ident['feature_value']}"
        except (KeyError, TypeError, ValueError):
            return
        arms = self._metric.setdefault((block, attempt), {})
        complete = {"baseline", "candidate"} <= set(arms)
        arms[ident["arm"]] = (name, float(tps))
        if not complete and {"baseline", "candidate"} <= set(arms):  # a repeated event adds no second ratio
            self._ratios.setdefault(arms["candidate"][0], []).append(
                math.log(arms["candidate"][1] / arms["baseline"][1]))

    # --- Tune hooks ---

    @staticmethod
    def _block(trial: Any) -> str:
        config = getattr(trial, "config", None) or {}
        return str(config.get("block_id", getattr(trial, "trial_id", id(trial))))

    def _block_done(self, block: str) -> bool:
        if block in self._skipped or block in (self._finished_before or ()):
            return True
        if block not in self._completed:
            return False
        latest = self._latest_attempt.get(block)
        return latest is not None and len(self._arms.get((block, latest), ())) >= 2

    def _recount(self, trials: list[Any]) -> None:
        if self._finished_before is None:
            self._finished_before = {self._block(t) for t in trials if t.status == "TERMINATED"}
        done = interrupted = running = errored = 0
        for trial in trials:
            block = self._block(trial)
            # on_trial_complete runs while the trial is still RUNNING; Tune marks it TERMINATED just after.
            ended = trial.status == "TERMINATED" or block in self._completed
            if ended and self._block_done(block):
                done += 1
            elif ended:
                interrupted += 1
            elif trial.status == "ERROR":
                errored += 1
            elif trial.status == "RUNNING":
                running += 1
        self.counts.done, self.counts.interrupted = done, interrupted
        self.counts.errored, self.counts.running = errored, running
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
        # Tune calls this on every turn of its event loop; a recount reads every trial of the campaign. Only when
        # a redraw is due (the first call always: it notes what a resumed sweep had finished).
        if self._finished_before is not None and time.monotonic() - self._last_draw < 0.5:
            return
        self._recount(trials)
        self._draw()

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        event = result.get("event")
        block = str(result.get("block_id", self._block(trial)))
        if event == "block_skipped":
            self._skipped.add(block)
            return
        if event in ("block_started", "arm") and result.get("attempt") is not None:
            attempt = int(result["attempt"])
            self._latest_attempt[block] = max(attempt, self._latest_attempt.get(block, attempt))
            if event == "arm":
                self._arms.setdefault((block, attempt), set()).add(int(result.get("arm_index", -1)))
                self._note_metric(block, attempt, result)
        if event != "arm":
            return
        self.counts.arms += 1
        status = result.get("status")
        self.counts.arms_failed += status == "failed"
        self.counts.arms_disqualified += status == "disqualified"

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._completed.add(self._block(trial))
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
