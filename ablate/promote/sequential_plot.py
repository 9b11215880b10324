"""The SPRT's log-likelihood-ratio traces of one lane against Wald's bounds, as a PNG for the promotion report.

How to use: ``PromotionResult.write_plots`` calls ``llr_png`` for every lane with a sequential speed test; the
report's "Sequential test" section embeds it. One colour per test: the promotion test's LLR (solid, compared with
the upper bound) and the rejection test's (dashed, compared with the lower bound), block by block in time order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

PALETTE = ["#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4e342e", "#37474f"]


def llr_png(tests: list[tuple[str, dict[str, Any]]], path: Path, title: str) -> Optional[Path]:
    """``tests``: (label, ``SequentialState.to_dict()``); None when no test has an LLR yet."""
    from matplotlib.figure import Figure

    from ablate.tracking.plots import save_figure

    tests = [(label, seq) for label, seq in tests if any(x is not None for x in seq["llr_trace"])]
    if not tests:
        return None
    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.add_subplot()
    upper, lower = tests[0][1]["upper"], tests[0][1]["lower"]
    for i, (label, seq) in enumerate(tests):
        color = PALETTE[i % len(PALETTE)]
        for key, style, suffix in (("llr_trace", "-", ""), ("llr_lower_trace", "--", " (rejection test)")):
            points = [(n, x) for n, x in enumerate(seq[key], start=1) if x is not None]
            if points:
                ax.plot(*zip(*points), style, color=color, marker="o", markersize=3, linewidth=1.4,
                        label=f"{label}: {seq['decision']}{suffix}" if not suffix else None)
    ax.axhline(upper, color="#2e7d32", linewidth=1.0, linestyle=":", label=f"upper bound {upper:.2f} (H1: a win)")
    ax.axhline(lower, color="#c62828", linewidth=1.0, linestyle=":", label=f"lower bound {lower:.2f} (H0: no win)")
    ax.axhline(0.0, color="black", linewidth=0.6)
    return save_figure(fig, ax, "block (time order)", "log-likelihood ratio", title, path)
