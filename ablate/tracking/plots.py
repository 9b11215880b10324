"""The pictures MLflow shows: one arm's goodput breakdown, a block's two arms side by side, a sweep's per-block
speed ratios at the lane's horizon, and a lane's speed-up against the horizon (the promotion report's trade-off
plot).

Both draw on a bare ``matplotlib.figure.Figure`` (Agg canvas, no pyplot): no global backend switch, no GUI, safe
on the Tune driver thread.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

from ablate.receipts.schema import BADPUT_CATEGORIES, Receipt, Status

_GOOD, _BAD, _OTHER = "#2e7d32", "#c62828", "#9e9e9e"


def phases(receipt: Receipt) -> list[tuple[str, float]]:
    """(phase, seconds) in a fixed order: goodput, then every badput category (they sum to the arm's wall)."""
    badput = receipt.time.badput_s
    rows = [("goodput", receipt.time.goodput_s)]
    rows += [(name, float(badput.get(name, 0.0))) for name in BADPUT_CATEGORIES]
    return rows


def goodput_png(receipt: Receipt, path: Path, title: Optional[str] = None) -> Path:
    """One horizontal bar per phase, seconds and share of wall time; the bars sum to the arm's wall time."""
    from matplotlib.figure import Figure

    rows = phases(receipt)
    wall = receipt.time.wall_s or 1.0
    fig = Figure(figsize=(7.5, 0.38 * len(rows) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    names = [name for name, _ in rows]
    values = [value for _, value in rows]
    colors = [_GOOD if name == "goodput" else _OTHER if name in ("startup", "unattributed") else _BAD
              for name in names]
    bars = ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    for bar, value in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f}s ({value / wall:.0%})",
                va="center", fontsize=8)
    ax.set_xlim(0, max(values + [1e-9]) * 1.35)
    ax.set_xlabel("seconds")
    ident = receipt.identity
    ax.set_title(title or f"{ident.block_id} {ident.arm.value}: goodput {receipt.time.goodput_fraction:.1%} "
                          f"of {wall:.2f}s wall", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def block_png(baseline: Receipt, candidate: Receipt, path: Path, title: str) -> Path:
    """A block's two arms on one figure: their time breakdowns as paired bars (left) and their per-step times on
    one axis (right), so where the candidate gains or loses time is visible without opening two runs."""
    from matplotlib.figure import Figure

    arms = [(baseline, "#757575"), (candidate, "#1565c0")]
    fig = Figure(figsize=(11.0, 4.2), layout="constrained")
    bars, steps = fig.subplots(1, 2, width_ratios=[1.1, 1.0])
    names = [name for name, _ in phases(baseline)]
    height = 0.38
    for i, (receipt, color) in enumerate(arms):
        values = [value for _, value in phases(receipt)]
        label = f"{_role(receipt)} ({receipt.time.wall_s:.2f}s wall)"
        bars.barh([y + (i - 0.5) * height for y in range(len(names))], values, height=height, color=color,
                  label=label)
        series = receipt.steps.series
        steps.plot(range(len(series)), series, color=color, marker="o", markersize=3, linewidth=1.2,
                   label=_role(receipt))
    bars.set_yticks(range(len(names)), names, fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel("seconds")
    bars.set_title("where the wall time went", fontsize=9)
    bars.legend(fontsize=7, loc="lower right")
    steps.set_xlabel("step")
    steps.set_ylabel("step time (s)")
    steps.set_title("step time per step", fontsize=9)
    steps.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _role(receipt: Receipt) -> str:
    ident = receipt.identity
    return f"twin{ident.arm_index}" if ident.feature is None else f"{ident.arm.value} {ident.feature_value}"


def block_ratios(receipts: Iterable[Receipt]) -> list[tuple[str, str, Optional[float], bool]]:
    """Per block (latest complete attempt): (block id, label, candidate/baseline projected tokens/s at the lane's
    horizon — the promotion metric, start-up excluded —, both valid).

    A/A blocks report twin 1 over twin 0, the noise floor the real ratios must clear.
    """
    arms: dict[tuple[str, int], dict[int, Receipt]] = defaultdict(dict)
    for receipt in receipts:
        arms[(receipt.identity.block_id, receipt.identity.attempt)][receipt.identity.arm_index] = receipt
    latest: dict[str, dict[int, Receipt]] = {}
    for (block_id, attempt), pair in sorted(arms.items()):
        if len(pair) == 2 or block_id not in latest:
            latest[block_id] = pair
    rows = []
    for block_id, pair in sorted(latest.items()):
        first = next(iter(pair.values())).identity
        label = "A/A" if first.feature is None else f"{first.feature}={_value(pair)}"
        ratio, valid = None, False
        if len(pair) == 2:
            base, cand = (r.projection.tokens_per_s if r.projection else None for r in (pair[0], pair[1]))
            ratio = cand / base if base and cand else None
            valid = all(r.identity.status is Status.valid for r in pair.values())
        rows.append((block_id, label, ratio, valid))
    return rows


def _value(pair: dict[int, Receipt]) -> object:
    candidate = pair.get(1)
    return candidate.identity.feature_value if candidate else next(iter(pair.values())).identity.feature_value


def summary_png(receipts: Iterable[Receipt], path: Path, title: str) -> Optional[Path]:
    """Candidate / baseline projected tokens/s per block, coloured by comparison; hatched = not both arms valid."""
    from matplotlib.figure import Figure

    rows = block_ratios(receipts)
    if not rows:
        return None
    labels = sorted({label for _, label, _, _ in rows})
    palette = ["#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4e342e", "#37474f"]
    color = {label: ("#757575" if label == "A/A" else palette[i % len(palette)]) for i, label in enumerate(labels)}
    fig = Figure(figsize=(max(6.0, 0.45 * len(rows) + 2.5), 4.2), layout="constrained")
    ax = fig.add_subplot()
    for x, (block_id, label, ratio, valid) in enumerate(rows):
        ax.bar(x, (ratio or 1.0) - 1.0, bottom=1.0, color=color[label], hatch=None if valid else "//",
               alpha=1.0 if ratio is not None else 0.2, edgecolor="black", linewidth=0.4)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [row[0] for row in rows], rotation=60, fontsize=7)
    ax.set_ylabel("candidate / baseline tokens/s at the horizon")
    ax.set_title(title, fontsize=10)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=color[label], label=label) for label in labels], fontsize=7, loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def horizon_png(curves: list[tuple[str, list[dict[str, float]]]], horizon: int, threshold: float, path: Path,
                title: str) -> Optional[Path]:
    """Speed-up against production-run length, one line and 90% band per feature value, the lane's declared
    horizon marked: where a one-time cost is paid back (or a cheap start stops paying) is where a line crosses 1."""
    from matplotlib.figure import Figure

    curves = [(label, points) for label, points in curves if points]
    if not curves:
        return None
    palette = ["#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4e342e", "#37474f"]
    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for i, (label, points) in enumerate(curves):
        xs = [p["horizon"] for p in points]
        color = palette[i % len(palette)]
        ax.fill_between(xs, [p["lo"] for p in points], [p["hi"] for p in points], color=color, alpha=0.18,
                        linewidth=0)
        ax.plot(xs, [p["speedup"] for p in points], color=color, label=label, linewidth=1.6)
    ax.set_xscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.0 + threshold, color="#2e7d32", linewidth=0.8, linestyle=":", label=f"1 + delta ({threshold:.1%})")
    ax.axvline(horizon, color="#c62828", linewidth=1.0, linestyle="--", label=f"lane horizon ({horizon:,} steps)")
    return save_figure(fig, ax, "production run length (optimizer steps)", "speed-up (baseline time / candidate time)",
                       title, path)


def save_figure(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    """Labels, title and legend the way every report plot has them, then the PNG at ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
