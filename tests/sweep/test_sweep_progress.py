"""The progress line: blocks done / total, arms failed, elapsed and an ETA from this session's pace."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console

from ablate.sweep.progress import SweepProgress


@dataclass
class _Trial:
    status: str


def test_counts_eta_and_plain_log_lines() -> None:
    console = Console(record=True, width=200, force_terminal=False)
    display = SweepProgress(4, title="s1", console=console, live=False)
    display.on_step_end(iteration=1, trials=[_Trial("TERMINATED"), _Trial("RUNNING"), _Trial("PENDING"),
                                             _Trial("PENDING")])
    assert display.counts.done_at_start == 1, "a resumed sweep starts from what already finished"
    assert display.eta() is None, "no pace yet in this session"
    display.on_trial_result(iteration=2, trials=[], trial=None, result={"event": "arm", "status": "failed"})
    display.on_trial_result(iteration=2, trials=[], trial=None, result={"event": "arm", "status": "valid"})
    display.on_trial_result(iteration=2, trials=[], trial=None, result={"event": "block_started"})
    display.started -= 10.0  # ten seconds into the session
    states = [_Trial("TERMINATED"), _Trial("TERMINATED"), _Trial("ERROR"), _Trial("PENDING")]
    display.on_trial_complete(iteration=3, trials=states, trial=None)
    eta = display.eta()
    assert eta is not None and 4.0 < eta < 6.0, "2 blocks finished in 10 s here, 1 left: about 5 s"
    line = display.line()
    assert "blocks 2/4 done" in line and "1 errored" in line and "arms 2 (1 failed" in line and "ETA 0:0" in line
    display.on_experiment_end(trials=states)
    printed = console.export_text()
    assert printed.count("blocks 2/4 done") == 1, "plain logs print a line per change, not per redraw"
    assert "blocks 1/4 done" in printed
