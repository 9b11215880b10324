"""The pictures MLflow shows: one arm's goodput breakdown, a block's two arms side by side, a sweep's per-block
speed ratios at the lane's horizon, and a lane's speed-up against the horizon (the promotion report's trade-off
plot).

Two kinds, by who pays for them:
- per arm, per block and per sweep (``goodput_svg``, ``block_svg``, ``summary_svg``): logged by the sweep driver's
  MLflow writer for every arm of every block and at each sweep's close, so they are SVG text written directly
  (about a millisecond; matplotlib took 0.35 s per arm and 0.6 s per block on the 2-core host, which paced a whole
  campaign: ``benchmarks/results/orchestration.json``).
  MLflow's artifact view shows ``.svg`` like ``.png``. The same numbers are also the arm run's metrics
  (``goodput_s``, ``badput_<phase>_s``), which MLflow charts natively;
- per report (``horizon_png``), and the matplotlib twins of the SVG pictures (``goodput_png``, ``block_png``,
  ``summary_png``, rendered on demand: ``ablate.tracking.mlflow_store.log_pngs``; a 1,000-block sweep's
  ``summary_png`` took 6-8 s at its close): drawn on a bare
  ``matplotlib.figure.Figure`` (Agg canvas, no pyplot): no global backend switch, no GUI, safe on the Tune driver
  thread.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional
from xml.sax.saxutils import escape

from ablate.receipts.outline import ArmOutline, ReceiptLike, outline
from ablate.receipts.schema import BADPUT_CATEGORIES, Receipt, Status

_GOOD, _BAD, _OTHER = "#2e7d32", "#c62828", "#9e9e9e"


def phases(receipt: Receipt) -> list[tuple[str, float]]:
    """(phase, seconds) in a fixed order: goodput, then every badput category (they sum to the arm's wall)."""
    badput = receipt.time.badput_s
    rows = [("goodput", receipt.time.goodput_s)]
    rows += [(name, float(badput.get(name, 0.0))) for name in BADPUT_CATEGORIES]
    return rows


def _phase_color(name: str) -> str:
    return _GOOD if name == "goodput" else _OTHER if name in ("startup", "unattributed") else _BAD


def _svg(width: int, height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="11">'
            f'<rect width="{width}" height="{height}" fill="white"/>{"".join(body)}</svg>\n')


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 11, weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" font-weight="{weight}" '
            f'dominant-baseline="middle">{escape(text)}</text>')


def _title(receipt: Receipt) -> str:
    ident = receipt.identity
    return (f"{ident.block_id} {ident.arm.value}: goodput {receipt.time.goodput_fraction:.1%} of "
            f"{receipt.time.wall_s:.2f}s wall")


def goodput_svg(receipt: Receipt, path: Path, title: Optional[str] = None) -> Path:
    """``goodput_png`` as SVG text: one bar per phase with its seconds and share of wall time (the bars sum to the
    arm's wall time); no matplotlib, so it costs the sweep's MLflow writer about a millisecond per arm."""
    rows = phases(receipt)
    wall = receipt.time.wall_s or 1.0
    label_w, bar_w, row_h, top = 120, 420, 20, 46
    scale = bar_w / (max([v for _, v in rows] + [1e-9]) * 1.35)
    body = [_text(10, 16, title or _title(receipt), size=12, weight="bold"),
            _text(10, 32, _title(receipt) if title else "seconds per phase (share of wall time)", size=10)]
    for i, (name, value) in enumerate(rows):
        y = top + i * row_h
        width = max(0.0, value * scale)
        body.append(_text(label_w - 6, y + row_h / 2, name, anchor="end", size=10))
        body.append(f'<rect x="{label_w}" y="{y + 3}" width="{width:.1f}" height="{row_h - 6}" '
                    f'fill="{_phase_color(name)}"><title>{escape(name)}: {value:.3f}s</title></rect>')
        body.append(_text(label_w + width + 4, y + row_h / 2, f"{value:.2f}s ({value / wall:.0%})", size=9))
    bottom = top + len(rows) * row_h
    body.append(f'<line x1="{label_w}" y1="{top}" x2="{label_w}" y2="{bottom}" stroke="black"/>')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_svg(label_w + bar_w + 110, bottom + 12, body), encoding="utf-8")
    return path


def block_svg(baseline: Receipt, candidate: Receipt, path: Path, title: str) -> Path:
    """``block_png`` as SVG text: the two arms' time breakdowns as paired bars (left) and their per-step times on
    one axis (right); no matplotlib (about a millisecond per block)."""
    arms = [(baseline, "#757575"), (candidate, "#1565c0")]
    names = [name for name, _ in phases(baseline)]
    label_w, bar_w, row_h, top, gap, plot_w = 110, 300, 22, 66, 90, 380
    peak = max([v for r, _ in arms for _, v in phases(r)] + [1e-9]) * 1.3
    body = [_text(10, 16, title, size=12, weight="bold"),
            _text(label_w, 36, "where the wall time went (s)", size=10),
            _text(label_w + bar_w + gap, 36, "step time per step (s)", size=10)]
    for i, (receipt, color) in enumerate(arms):
        body.append(f'<rect x="{label_w + 200 * i}" y="46" width="10" height="10" fill="{color}"/>')
        body.append(_text(label_w + 200 * i + 14, 51, f"{_role(receipt)} ({receipt.time.wall_s:.2f}s wall)", size=9))
        for j, (name, value) in enumerate(phases(receipt)):
            y = top + j * row_h + 2 + i * (row_h - 4) / 2
            width = max(0.0, value / peak * bar_w)
            body.append(f'<rect x="{label_w}" y="{y:.1f}" width="{width:.1f}" height="{(row_h - 4) / 2:.1f}" '
                        f'fill="{color}"><title>{escape(_role(receipt))} {escape(name)}: {value:.3f}s</title></rect>')
    for j, name in enumerate(names):
        body.append(_text(label_w - 6, top + j * row_h + row_h / 2, name, anchor="end", size=10))
    bottom = top + len(names) * row_h
    body.append(f'<line x1="{label_w}" y1="{top}" x2="{label_w}" y2="{bottom}" stroke="black"/>')
    body.append(_text(label_w + bar_w, bottom + 10, f"{peak / 1.3:.2f}s", anchor="end", size=9))
    # Right panel: step times, both arms on one linear axis from 0 to the slowest step.
    x0, series = label_w + bar_w + gap, [r.steps.series for r, _ in arms]
    longest, slowest = max([len(s) for s in series] + [2]), max([v for s in series for v in s] + [1e-9]) * 1.1
    body.append(f'<polyline points="{x0},{top} {x0},{bottom} {x0 + plot_w},{bottom}" fill="none" stroke="black"/>')
    body += [_text(x0 - 4, top, f"{slowest:.3g}", anchor="end", size=9), _text(x0 - 4, bottom, "0", anchor="end",
             size=9), _text(x0 + plot_w, bottom + 10, f"step {longest - 1}", anchor="end", size=9)]
    if not any(series):
        body.append(_text(x0 + plot_w / 2, (top + bottom) / 2, "no per-step times in these receipts", "middle", 10))
    for (receipt, color), steps in zip(arms, series):
        points = " ".join(f"{x0 + k / (longest - 1) * plot_w:.1f},{bottom - v / slowest * (bottom - top):.1f}"
                          for k, v in enumerate(steps))
        if points:
            body.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_svg(x0 + plot_w + 20, bottom + 20, body), encoding="utf-8")
    return path


def goodput_png(receipt: Receipt, path: Path, title: Optional[str] = None) -> Path:
    """One horizontal bar per phase, seconds and share of wall time; the bars sum to the arm's wall time."""
    from matplotlib.figure import Figure

    rows = phases(receipt)
    wall = receipt.time.wall_s or 1.0
    fig = Figure(figsize=(7.5, 0.38 * len(rows) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    names = [name for name, _ in rows]
    values = [value for _, value in rows]
    colors = [_phase_color(name) for name in names]
    bars = ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    for bar, value in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f}s ({value / wall:.0%})",
                va="center", fontsize=8)
    ax.set_xlim(0, max(values + [1e-9]) * 1.35)
    ax.set_xlabel("seconds")
    ax.set_title(title or _title(receipt), fontsize=10)
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


def block_ratios(receipts: Iterable[ReceiptLike]) -> list[tuple[str, str, Optional[float], bool]]:
    """Per block (latest complete attempt): (block id, label, candidate/baseline projected tokens/s at the lane's
    horizon — the promotion metric, start-up excluded —, both valid).

    A/A blocks report twin 1 over twin 0, the noise floor the real ratios must clear.
    """
    arms: dict[tuple[str, int], dict[int, ArmOutline]] = defaultdict(dict)
    for arm in map(outline, receipts):
        arms[(arm.block_id, arm.attempt)][arm.arm_index] = arm
    latest: dict[str, dict[int, ArmOutline]] = {}
    for (block_id, attempt), pair in sorted(arms.items()):
        if len(pair) == 2 or block_id not in latest:
            latest[block_id] = pair
    rows = []
    for block_id, pair in sorted(latest.items()):
        first = next(iter(pair.values()))
        label = "A/A" if first.feature is None else f"{first.feature}={_value(pair)}"
        ratio, valid = None, False
        if len(pair) == 2:
            base, cand = pair[0].tokens_per_s, pair[1].tokens_per_s
            ratio = cand / base if base and cand else None
            valid = all(arm.status is Status.valid for arm in pair.values())
        rows.append((block_id, label, ratio, valid))
    return rows


def _value(pair: dict[int, ArmOutline]) -> object:
    candidate = pair.get(1)
    return candidate.feature_value if candidate else next(iter(pair.values())).feature_value


_PALETTE = ["#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4e342e", "#37474f"]


def _summary_colors(rows: list[tuple[str, str, Optional[float], bool]]) -> dict[str, str]:
    labels = sorted({label for _, label, _, _ in rows})
    return {label: ("#757575" if label == "A/A" else _PALETTE[i % len(_PALETTE)]) for i, label in enumerate(labels)}


SUMMARY_TICKS_MAX = 60
"""Blocks up to which each bar is labelled under the axis; past that every bar still names its block on hover."""


def summary_svg(receipts: Iterable[ReceiptLike], path: Path, title: str) -> Optional[Path]:
    """``summary_png`` as SVG text: one bar per block from 1.0 to its candidate / baseline projected tokens/s,
    coloured by comparison; hatched = not both arms valid, faint = no ratio. No matplotlib: a 1,000-block sweep's
    summary took 6-8 s to draw at its close, this about 20 ms."""
    rows = block_ratios(receipts)
    if not rows:
        return None
    color = _summary_colors(rows)
    ratios = [ratio for _, _, ratio, _ in rows if ratio is not None]
    reach = max([abs(r - 1.0) for r in ratios] + [0.01]) * 1.15
    left, top, plot_h, bar_w, gap = 70, 60, 240, 10, 4
    labelled = len(rows) <= SUMMARY_TICKS_MAX
    width = max(560, left + len(rows) * (bar_w + gap) + 20)
    axis_y = top + plot_h / 2  # the 1.0 line: bars go up for a faster candidate, down for a slower one
    scale = (plot_h / 2) / reach
    body = ['<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="white" fill-opacity="0.0"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="black" stroke-width="1.2"/></pattern></defs>',
            _text(10, 16, title, size=12, weight="bold"),
            _text(10, 32, "candidate / baseline tokens/s at the horizon, per block (hatched: not both arms valid; "
                          "faint: no ratio)", size=10)]
    for i, label in enumerate(sorted(color)):
        body.append(f'<rect x="{10 + 150 * i}" y="42" width="10" height="10" fill="{color[label]}"/>')
        body.append(_text(24 + 150 * i, 47, label, size=9))
    for value in (1.0 - reach / 1.15, 1.0, 1.0 + reach / 1.15):
        y = axis_y - (value - 1.0) * scale
        body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - 10}" y2="{y:.1f}" stroke="'
                    f'{"black" if value == 1.0 else "#bdbdbd"}" stroke-width="{0.8 if value == 1.0 else 0.5}"/>')
        body.append(_text(left - 6, y, f"{value:.3f}", anchor="end", size=9))
    for i, (block_id, label, ratio, valid) in enumerate(rows):
        x = left + 6 + i * (bar_w + gap)
        shown = ratio if ratio is not None else 1.0
        height = abs(shown - 1.0) * scale
        y = axis_y - height if shown >= 1.0 else axis_y
        tip = escape(f"{block_id} {label}: " + (f"{ratio:.4f}" if ratio is not None else "no ratio")
                     + ("" if valid else " (not both arms valid)"))
        opacity = "1" if ratio is not None else "0.2"
        body.append(f'<rect x="{x}" y="{y:.1f}" width="{bar_w}" height="{max(height, 1.0):.1f}" '
                    f'fill="{color[label]}" fill-opacity="{opacity}" stroke="black" stroke-width="0.4">'
                    f'<title>{tip}</title></rect>')
        if not valid:
            body.append(f'<rect x="{x}" y="{y:.1f}" width="{bar_w}" height="{max(height, 1.0):.1f}" '
                        f'fill="url(#hatch)"/>')
        if labelled:
            body.append(f'<text x="{x + bar_w / 2:.1f}" y="{top + plot_h + 8}" font-size="7" text-anchor="end" '
                        f'transform="rotate(-60 {x + bar_w / 2:.1f} {top + plot_h + 8})">{escape(block_id)}</text>')
    height = top + plot_h + (70 if labelled else 20)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_svg(width, height, body), encoding="utf-8")
    return path


def summary_png(receipts: Iterable[ReceiptLike], path: Path, title: str) -> Optional[Path]:
    """Candidate / baseline projected tokens/s per block, coloured by comparison; hatched = not both arms valid."""
    from matplotlib.figure import Figure

    rows = block_ratios(receipts)
    if not rows:
        return None
    color = _summary_colors(rows)
    labels = sorted(color)
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


def _steps_label(x: float, _position: Any = None) -> str:
    return f"{x:,.0f}" if x >= 1 else f"{x:g}"


def horizon_png(curves: list[tuple[str, list[dict[str, float]]]], horizon: int, threshold: float, path: Path,
                title: str) -> Optional[Path]:
    """Speed-up against production-run length, one line and 90% band per feature value, the lane's declared
    horizon marked: where a one-time cost is paid back (or a cheap start stops paying) is where a line crosses 1."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    curves = [(label, points) for label, points in curves if points]
    if not curves:
        return None
    # Fixed margins, not the constrained layout: every label of this plot is known in advance, and the layout pass
    # (a second draw measuring every tick label of the log axis) was half of a report's drawing time.
    fig = Figure(figsize=(7.0, 4.2))
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.12, top=0.92)
    ax = fig.add_subplot()
    for i, (label, points) in enumerate(curves):
        xs = [p["horizon"] for p in points]
        color = _PALETTE[i % len(_PALETTE)]
        ax.fill_between(xs, [p["lo"] for p in points], [p["hi"] for p in points], color=color, alpha=0.18,
                        linewidth=0)
        ax.plot(xs, [p["speedup"] for p in points], color=color, label=label, linewidth=1.6)
    ax.set_xscale("log")
    # Step counts as plain numbers (1, 10, ..., 100,000), as the legend writes the lane's horizon, and minor ticks at
    # 2 and 5 only: the default 10^k labels are mathtext and eight minor ticks a decade were a third of the drawing.
    ax.xaxis.set_major_formatter(FuncFormatter(_steps_label))
    ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(NullFormatter())
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
