"""The promotion report's trade-off plot (``plots.horizon_png``): a real PNG, its production-run lengths labelled as
plain step counts (as the legend writes the lane's horizon) and its minor ticks only at 2 and 5 of each decade."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ablate.tracking import plots


def _curve(scale: float) -> list[dict[str, float]]:
    return [{"horizon": float(h), "speedup": scale, "lo": scale - 0.01, "hi": scale + 0.01}
            for h in (1, 3, 10, 40, 100, 1_000, 10_000, 100_000)]


def test_the_horizon_axis_reads_as_step_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: dict[str, Any] = {}
    save = plots.save_figure

    def keep_axes(fig: Any, ax: Any, *args: Any) -> Path:
        drawn["ax"] = ax
        return save(fig, ax, *args)

    monkeypatch.setattr(plots, "save_figure", keep_axes)
    path = plots.horizon_png([("moe_dispatch=jagged (PROMOTE)", _curve(1.05)), ("stp=on (HOLD)", _curve(0.99))],
                             10_000, 0.01, tmp_path / "lane.png", "lane abc: test")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = drawn["ax"]
    low, high = ax.get_xlim()
    majors = {t.get_text() for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if low <= x <= high}
    assert {"1", "10", "100", "1,000", "10,000", "100,000"} <= majors
    assert not any("$" in text or "^" in text for text in majors)  # no mathtext
    minors = [x for x in ax.xaxis.get_minorticklocs() if low <= x <= high]
    leading = {round(x / 10 ** int(f"{x:e}".split("e")[1]), 6) for x in minors}
    assert leading == {2.0, 5.0}
    assert not any(t.get_text() for t in ax.xaxis.get_ticklabels(minor=True))


def test_fractions_of_a_step_keep_their_value() -> None:
    assert plots._steps_label(0.5) == "0.5"
    assert plots._steps_label(12_500.0) == "12,500"
