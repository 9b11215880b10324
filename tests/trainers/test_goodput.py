"""Tracker arithmetic: step statistics, step labelling, and the time sum that must close against wall time."""

from __future__ import annotations

import time

import pytest

from ablate.receipts.schema import BADPUT_CATEGORIES
from trainers.goodput import StepRecord, StepTracker, account_time, classify, percentile, step_statistics, summarize


def _steps(spec: list[tuple[str, float, int, bool]]) -> list[StepRecord]:
    return [StepRecord(index=i, phase=phase, step_s=dt, data_s=0.01, sampled=sampled, tokens=128,
                       compile_events=events) for i, (phase, dt, events, sampled) in enumerate(spec)]


def test_step_statistics_ideal_from_median_plus_3_mad_without_a_one_second_floor() -> None:
    stats = step_statistics([0.10, 0.11, 0.09, 0.10, 0.50])
    # median 0.10, MAD 0.01 -> threshold 0.13: 0.50 is anomalous, ideal = mean of the other four.
    assert stats["p50_s"] == pytest.approx(0.10)
    assert stats["ideal_s"] == pytest.approx(0.10)
    assert stats["anomalous"] == 1
    assert stats["anomalous_extra_s"] == pytest.approx(0.40)
    assert stats["p90_s"] == pytest.approx(percentile([0.09, 0.10, 0.10, 0.11, 0.50], 90))
    assert stats["p90_s"] == pytest.approx(0.11 + 0.6 * 0.39)


def test_step_statistics_empty_is_null_not_zero() -> None:
    stats = step_statistics([])
    assert stats["ideal_s"] is None and stats["p50_s"] is None and stats["anomalous"] == 0


def test_classify_explicit_warmup_makes_later_compiles_recompiles() -> None:
    steps = _steps([("warmup", 2.0, 3, False), ("budget", 0.1, 0, False), ("budget", 0.4, 1, False),
                    ("budget", 0.1, 0, False), ("budget", 0.2, 0, True)])
    classify(steps, "explicit")
    assert [s.label for s in steps] == ["compile_warmup", "steady", "recompile", "steady", "sampled"]


def test_classify_skip_bills_first_step_and_leading_compiles_as_warmup() -> None:
    steps = _steps([("budget", 3.0, 2, False), ("budget", 1.0, 1, False), ("budget", 0.1, 0, False),
                    ("budget", 0.5, 1, False), ("budget", 0.1, 0, False)])
    classify(steps, "skip")
    assert [s.label for s in steps] == ["compile_warmup", "compile_warmup", "steady", "recompile", "steady"]
    eager = _steps([("budget", 0.3, 0, False), ("budget", 0.1, 0, False)])
    classify(eager, "skip")
    assert [s.label for s in eager] == ["compile_warmup", "steady"]


def _cadenced(steps: list[StepRecord], gap: float = 0.005) -> list[StepRecord]:
    # The step clock: each step ends data + compute + a host gap after the previous one.
    for step in steps:
        step.cadence_s = step.data_s + step.step_s + gap
    return steps


def test_summary_and_accounting_measure_every_part_and_bill_sampling_at_ideal() -> None:
    steps = _cadenced(_steps([("warmup", 1.0, 2, False), ("budget", 0.10, 0, False), ("budget", 0.10, 0, False),
                              ("budget", 0.10, 0, False), ("budget", 0.30, 1, False), ("budget", 0.25, 0, True)]))
    classify(steps, "explicit")
    loop = summarize(steps, loop_s=2.2, checkpoint_s=0.05, eval_s=0.0, data_is_badput=True)
    assert loop.goodput_s == pytest.approx(0.30 + 0.10)          # 3 steady + sampled billed at the 0.10 ideal
    assert loop.sampling_overhead_s == pytest.approx(0.15)
    assert loop.compile_warmup_s == pytest.approx(1.0)
    assert loop.recompile_s == pytest.approx(0.30)
    assert loop.data_wait_s == pytest.approx(0.06)
    assert loop.idle_s == pytest.approx(6 * 0.005)               # measured gaps, not the loop's remainder
    acc = account_time(wall_s=5.0, queue_wait_s=0.5, startup_s=1.5, setup_s=0.2, loop=loop, teardown_s=0.3)
    assert set(acc.badput_s) == set(BADPUT_CATEGORIES)
    assert acc.goodput_s + sum(acc.badput_s.values()) == pytest.approx(5.0)
    measured = 0.40 + 0.5 + 1.5 + 0.2 + 1.0 + 0.30 + 0.06 + 0.05 + 0.03 + 0.15 + 0.3
    assert acc.badput_s["unattributed"] == pytest.approx(5.0 - measured)  # what nothing measured, stated
    assert acc.badput_s["sampling"] == pytest.approx(0.15) and acc.badput_s["teardown"] == pytest.approx(0.3)
    assert acc.violation is None
    assert acc.goodput_fraction == pytest.approx(0.40 / 5.0)


def test_accounting_violation_when_parts_exceed_wall_or_clocks_disagree() -> None:
    steps = _cadenced(_steps([("budget", 0.5, 0, False), ("budget", 0.5, 0, False)]))
    classify(steps, "explicit")
    loop = summarize(steps, loop_s=1.1, checkpoint_s=0.0, eval_s=0.0, data_is_badput=True)
    over = account_time(wall_s=1.5, queue_wait_s=0.2, startup_s=0.8, setup_s=0.0, loop=loop)
    assert over.violation is not None and "exceed wall" in over.violation
    assert over.badput_s["unattributed"] < 0  # stated as it is: the receipt will not validate
    skew = account_time(wall_s=3.0, queue_wait_s=-2.0, startup_s=0.5, setup_s=0.0, loop=loop)
    assert skew.violation is not None and "queue_wait" in skew.violation
    assert all(v >= 0 for k, v in skew.badput_s.items() if k != "unattributed")


def test_step_tracker_measures_real_time_phases() -> None:
    tracker = StepTracker(cuda=False)
    tracker.start()
    for index in range(4):
        tracker.begin("budget", sampled=index == 3)
        time.sleep(0.01)                       # data fetch
        tracker.data_done()
        time.sleep(0.03)                       # the step
        tracker.end(tokens=64)
        time.sleep(0.005)                      # host gap -> idle
    with tracker.phase("checkpoint"):
        time.sleep(0.02)
    loop = tracker.finish("explicit")
    assert tracker.first_step_end is not None
    assert [s.label for s in loop.steps] == ["steady", "steady", "steady", "sampled"]
    assert all(0.029 <= s.step_s < 0.2 for s in loop.steps)
    assert loop.data_wait_s == pytest.approx(sum(s.data_s for s in loop.steps))
    assert 0.039 <= loop.data_wait_s < 0.3
    assert 0.019 <= loop.checkpoint_s < 0.2
    # Cadence: end to end of consecutive steps, so data, compute and the host gap are all in it.
    assert all(s.cadence_s >= s.step_s + s.data_s for s in loop.steps)
    assert all(s.cadence_s >= s.step_s + s.data_s + 0.004 for s in loop.steps[1:])
    assert 3 * 0.004 <= loop.idle_s < 0.2
    parts = (loop.goodput_s + loop.sampling_overhead_s + loop.compile_warmup_s + loop.recompile_s
             + loop.data_wait_s + loop.idle_s)
    assert parts == pytest.approx(sum(s.cadence_s for s in loop.steps), rel=1e-6)
    assert loop.loop_s - parts >= 0.019  # the checkpoint after the last step is its own badput, not a step's


def test_waiting_for_a_partner_turn_stays_out_of_the_cadence() -> None:
    tracker = StepTracker(cuda=False)
    tracker.start()
    for _ in range(3):
        time.sleep(0.05)                       # the partner arm's turn (the gate measured it from our release)
        tracker.begin("budget")
        tracker.data_done()
        time.sleep(0.02)
        tracker.end(tokens=64, wait_s=0.05)
    loop = tracker.finish("explicit")
    assert all(0.019 < s.cadence_s < 0.045 for s in loop.steps) and loop.paired_wait_s == pytest.approx(0.15)
    assert loop.idle_s < 0.03
