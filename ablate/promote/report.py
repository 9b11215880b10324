"""The promotion result and its two renderings: a Markdown pull-request body and the same content as JSON.

How to use: ``result.markdown`` (PR body: header, defaults diff, one row per feature, taxes, revalidations,
refusals, collapsible per-lane detail) and ``result.to_json()``. GitHub caps a PR body at 65,536 characters,
so the per-lane detail is cut first when the body would be longer; the JSON always has everything.
"""

from __future__ import annotations

import json
import math
import re
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ablate.promote.analysis import PROMOTE, TAX_REPORTED, FeatureVerdict
from ablate.promote.bundle import BundleCheck
from ablate.promote.defaults_writer import DEMOTED, DefaultsChange, Revalidation, RevalidationOutcome
from ablate.promote.energy import energy_cell
from ablate.promote.evidence import Calibration
from ablate.promote.match import Refusal
from ablate.promote.policy import Policy
from ablate.redact import redact_text, text_redactor

MAX_MARKDOWN_CHARS = 60_000
MAX_LINKS_PER_TEST = 12


STARTUP_DOMINATES = 0.5
"""When executor start-up is more than this share of an arm's wall time, the report says so and what to change."""


@dataclass
class LaneSummary:
    lane_key: str
    software_fingerprint: str
    fingerprints: list[str]
    hosts: list[str]
    calibration: Calibration
    lane: dict[str, Any]
    device_class: str = "unknown"
    threads: list[int] = field(default_factory=list)
    world_size: int = 1
    horizon_steps: int = 0
    startup_share: Optional[float] = None
    """Median share of executor start-up in an arm's wall time (recorded, excluded from the comparison)."""
    startup_s: Optional[float] = None
    wall_s: Optional[float] = None

    def label(self) -> str:
        """Device, precision, threads and world size: what a reader recognises a lane by, besides its hash."""
        threads = "/".join(str(t) for t in self.threads) or "?"
        return (f"{self.device_class} · {self.lane.get('precision', '?')} · {threads} thread(s) · world "
                f"{self.world_size} · {self.lane.get('model.pattern', '?')}")


@dataclass
class PromotionResult:
    report_id: str
    date: str
    campaigns: list[str]
    rounds: list[dict[str, Any]]
    policy: Policy
    git: dict[str, Any]
    num_receipts: int
    verdicts: list[FeatureVerdict]
    holm_family: int
    lanes: list[LaneSummary]
    changes: list[DefaultsChange]
    revalidations: list[Revalidation]
    refusals: list[Refusal]
    rejected: list[tuple[str, str]]
    defaults_path: str
    run_links: dict[str, str] = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)
    """Lane key -> the speed-up-vs-horizon PNG, as the report refers to it (relative to the report file)."""
    sprt_plots: dict[str, str] = field(default_factory=dict)
    """Lane key -> the SPRT trace PNG (``write_plots``), when the policy's sequential test is on."""
    plot_locations: dict[str, str] = field(default_factory=dict)
    """Lane key -> where the same PNG was logged in MLflow (the sweep's parent run)."""
    not_run: list[dict[str, str]] = field(default_factory=list)
    """What the sweeps' plans refused before any arm ran (inert toggles, values already default), with why."""
    bundles: list[BundleCheck] = field(default_factory=list)
    """One bundle check per lane where two or more features promoted; a held set is not written."""
    run_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    """Receipt id -> its arm run's name and its block run's name and link (``load_receipts_from_mlflow``)."""
    ui_url: Optional[str] = None
    """Base of the run links (the MLflow UI); None when the receipts did not come from MLflow."""
    ui_command: Optional[str] = None
    """The ``mlflow ui`` command that serves ``ui_url`` when the store is not a server (a local SQLite file)."""
    defaults_text: Optional[str] = None
    """The defaults file as ``promote`` read it: the plan is decided against it, and is only ever written over it
    (``defaults_writer.check_unchanged``)."""

    def write_plots(self, directory: Path, relative_to: Optional[Path] = None) -> dict[str, Path]:
        """One speed-up-against-horizon plot per lane with a measured speed test; records their paths."""
        from ablate.parallel import fork_map
        from ablate.tracking.plots import horizon_png

        specs = []
        for lane in self.lanes:
            verdicts = [v for v in self.verdicts if v.lane_key == lane.lane_key and v.curve]
            if not verdicts:
                continue
            curves = [(f"{v.feature}={v.value} ({v.verdict})", v.curve) for v in verdicts]
            specs.append((lane.lane_key, curves, lane.horizon_steps or verdicts[0].horizon_steps,
                          lane.calibration.delta(self.policy),
                          directory / f"lane-{re.sub(r'[^0-9A-Za-z_-]', '_', lane.lane_key[:12])}.png",
                          f"lane {lane.lane_key[:12]}: {lane.label()}"))
        # Drawing is most of a large report's writing time (~0.4 s a lane): the lanes are drawn over the CPUs,
        # with matplotlib imported once, before the processes part.
        if len(specs) > 1:
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.figure  # noqa: F401
        paths = fork_map(lambda spec: horizon_png(*spec[1:]), specs, min_share=2)
        written: dict[str, Path] = {}
        for spec, path in zip(specs, paths):
            if path is not None:
                written[spec[0]] = path
                self.plots[spec[0]] = str(path.relative_to(relative_to) if relative_to else path)
        written.update(self._write_sprt_plots(directory, relative_to))
        return written

    def _write_sprt_plots(self, directory: Path, relative_to: Optional[Path]) -> dict[str, Path]:
        from ablate.promote.sequential_plot import llr_png

        written: dict[str, Path] = {}
        for lane in self.lanes:
            tests = [(f"{v.feature}={v.value}", v.sequential) for v in self.speed_verdicts
                     if v.lane_key == lane.lane_key and v.sequential]
            slug = re.sub(r"[^0-9A-Za-z_-]", "_", lane.lane_key[:12])
            path = llr_png(tests, directory / f"sprt-{slug}.png", f"SPRT, lane {lane.lane_key[:12]}: {lane.label()}")
            if path is not None:
                written[f"sprt-{lane.lane_key}"] = path
                self.sprt_plots[lane.lane_key] = str(path.relative_to(relative_to) if relative_to else path)
        return written

    @property
    def campaign(self) -> str:
        return "+".join(self.campaigns) or "none"

    @property
    def speed_verdicts(self) -> list[FeatureVerdict]:
        return [v for v in self.verdicts if v.verdict != TAX_REPORTED]

    @property
    def tax_verdicts(self) -> list[FeatureVerdict]:
        return [v for v in self.verdicts if v.verdict == TAX_REPORTED]

    @property
    def promoted(self) -> list[FeatureVerdict]:
        return [v for v in self.verdicts if v.verdict == PROMOTE]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON data (``_json_ready``: inf and NaN as null)."""
        return _json_ready({
            "report_id": self.report_id, "date": self.date, "campaigns": self.campaigns, "rounds": self.rounds,
            "policy": {**_fields(self.policy), "ref": self.policy.ref}, "git": self.git,
            "num_receipts": self.num_receipts, "holm_family": self.holm_family,
            "bootstrap_note": _bootstrap_note(self),
            "defaults_path": self.defaults_path,
            # Reasons quote receipts (a refused block's reason, a host): redacted like the refusals' own.
            "changes": [{**_fields(c), "not_global": [redact_text(why) for why in c.not_global],
                         "held": None if c.held is None else redact_text(c.held)} for c in self.changes],
            # A verdict's work arrays served the decision and are not report content.
            "verdicts": [_fields(v, leave_out="work") for v in self.speed_verdicts],
            "taxes": [_fields(v, leave_out="work") for v in self.tax_verdicts],
            "lanes": [{**_fields(lane), "label": lane.label(), "calibration": {
                **_fields(lane.calibration), "noise_floor": lane.calibration.noise_floor,
                "bias_bound": lane.calibration.bias_bound, "contains_one": lane.calibration.contains_one,
                "aa_interval": ([math.exp(x) for x in lane.calibration.aa_interval_log]
                                if lane.calibration.aa_interval_log else None),
                "delta": lane.calibration.delta(self.policy)}} for lane in self.lanes],
            "revalidations": self.revalidations,
            "refusals": [{**_fields(r), "reason": redact_text(r.reason)} for r in self.refusals],
            "rejected_receipts": [{"origin": redact_text(str(rj[0])), "reason": redact_text(str(rj[1]))}
                                  | ({"unread_arm": rj.unread} if getattr(rj, "unread", None) else {})
                                  for rj in self.rejected],
            "run_links": self.run_links, "plots": self.plots, "sprt_plots": self.sprt_plots, "plot_locations": self.plot_locations,
            "not_run": self.not_run, "bundles": self.bundles,
            "links": links_json(self),
        })

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default, allow_nan=False)

    @property
    def markdown(self) -> str:
        return render_markdown(self)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


_FIELD_NAMES: dict[type, Optional[tuple[str, ...]]] = {}


def _field_names(cls: type) -> Optional[tuple[str, ...]]:
    if cls not in _FIELD_NAMES:
        _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls)) if is_dataclass(cls) else None
    return _FIELD_NAMES[cls]


def _fields(obj: Any, leave_out: str = "") -> dict[str, Any]:
    """A dataclass's fields by name, as they are (``_json_ready`` converts them)."""
    return {name: getattr(obj, name) for name in _field_names(type(obj)) or () if name != leave_out}


def _json_ready(value: Any) -> Any:
    """``value`` as JSON data, in one pass: a dataclass as the dict of its fields (what ``asdict`` gives, without
    its deep copy of every leaf: a 10,000-receipt report's JSON took 0.4 s), a tuple as a list, a key as a string,
    and inf or NaN, which JSON has not, as null (an unbounded Amdahl bound, an undefined quantile). Anything else is
    left to ``json.dumps``' default."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    names = _field_names(type(value))
    if names is not None:
        return {name: _json_ready(getattr(value, name)) for name in names}
    return value


def _x(ratio: Optional[float], digits: int = 3) -> str:
    return "–" if ratio is None or not math.isfinite(ratio) else f"{ratio:.{digits}f}×"


def _interval(ci: Optional[tuple[float, float]]) -> str:
    return "–" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _short(text: Any, width: int = 12) -> str:
    text = str(text)
    return text if len(text) <= width else text[:width] + "…"


_BREAKS = re.compile(r"[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")
"""Every character Markdown (or Python's splitlines) may read as a line break."""

_REDACT: ContextVar[Optional[Callable[[str], str]]] = ContextVar("_REDACT", default=None)
"""Set by ``render_markdown`` for its duration: the environment is read once per report, not once per cell."""


def _redacted(value: Any) -> str:
    # A second line of defence: reasons quote exception text (a tracking URI with its password) and the report
    # is a PR body; whatever produced the text should have redacted it already.
    redact = _REDACT.get()
    return redact(str(value)) if redact is not None else redact_text(str(value))


def _t(value: Any) -> str:
    """Text from receipts, sweeps or files, made inert in a Markdown line: no line break (so no heading, list
    item or table row can start inside it), no HTML tag, no link or image, no code span it could close; no
    credentials (``ablate.redact``)."""
    text = _BREAKS.sub(" ", _redacted(value))
    return (text.replace("\\", "\\\\").replace("`", "\\`").replace("<", "&lt;").replace(">", "&gt;")
            .replace("[", "\\[").replace("]", "\\]"))


def _c(value: Any) -> str:
    """``value`` as a code span: one line, no backtick of its own (it would end the span)."""
    return "`" + _BREAKS.sub(" ", _redacted(value)).replace("`", "'") + "`"


_PLAIN_URL = re.compile(r"[A-Za-z0-9._~:/?#@!$&'*+,;=%-]+")


def _url(value: Any) -> str:
    """A link destination with its parentheses: plain when nothing in it can end it early, else in ``<...>``
    (no line break, no angle bracket) so a space or a parenthesis from a path cannot break out of the link."""
    text = _redacted(value)
    if _PLAIN_URL.fullmatch(text):
        return f"({text})"
    return "(<" + _BREAKS.sub("", text).replace("<", "%3C").replace(">", "%3E") + ">)"


def links_json(result: PromotionResult) -> dict[str, Any]:
    """Every block run and every arm run the report read, as labelled UI links, with the UI they open in and
    the command that serves it (a local store); blocks are their runs in MLflow (one per block attempt)."""
    blocks: dict[str, dict[str, Any]] = {}
    loose: list[dict[str, str]] = []
    for rid, url in sorted(result.run_links.items()):
        labels = result.run_labels.get(rid, {})
        arm = {"receipt_id": rid, "label": labels.get("arm", rid), "url": url}
        if "block_url" not in labels:
            loose.append(arm)  # logged before block runs existed: the arm's own link still stands
            continue
        block = blocks.setdefault(labels["block_url"], {"label": labels.get("block", ""), "url": labels["block_url"],
                                                       "arms": []})
        block["arms"].append(arm)
    return {"ui": result.ui_url, "mlflow_ui_command": result.ui_command,
            "blocks": sorted(blocks.values(), key=lambda b: b["label"]), "arms_without_block_run": loose}


def _links_note(result: PromotionResult) -> list[str]:
    """Where the per-block MLflow links open, and for a local store the command that makes them work."""
    if not result.run_links or result.ui_url is None:
        return []
    note = f"MLflow links open the UI at {_t(result.ui_url)}"
    if result.ui_command:
        note += f"; serve this store there first: {_c(result.ui_command)}"
    return ["", note + "."]


def _block_lines(result: PromotionResult, v: FeatureVerdict) -> list[str]:
    """One line per block of the test: its block run, the speed-up it measured and its two arm runs, linked."""
    lines = []
    for row in v.block_links[:MAX_LINKS_PER_TEST]:
        arms = [(role, row[role]) for role in ("baseline", "candidate") if row[role] in result.run_links]
        if not arms:
            continue
        labels = result.run_labels.get(row["candidate"], {})
        head = (f"[{_t(labels['block'])}]{_url(labels['block_url'])}" if "block_url" in labels
                else _c(row["block"]))
        ratio = row.get("log_ratio")
        measured = "" if ratio is None else f" {_x(math.exp(ratio))} ({_t(row.get('winner', ''))})"
        arm_links = " · ".join(f"[{_t(result.run_labels.get(rid, {}).get('arm', role))}]{_url(result.run_links[rid])}"
                               for role, rid in arms)
        lines.append(f"- block {head}{measured}: {arm_links}")
    if not lines:
        return []
    more = len(v.block_links) - MAX_LINKS_PER_TEST
    if more > 0:
        lines.append(f"- … and {more} more block(s) in the JSON (`links`)")
    return ["", "MLflow runs:", ""] + lines


def _cell(text: Any) -> str:
    """A table cell: ``text`` is already-rendered Markdown; a line break or a bare pipe would end the row."""
    return _BREAKS.sub(" ", str(text)).replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _bootstrap_note(result: PromotionResult) -> str:
    units = {v.bootstrap_unit for v in result.verdicts if v.n_blocks}
    if result.policy.single_node or units == {"block"}:
        return ("single-node profile: the interval is a block bootstrap within one host; it does not protect "
                "against host-correlated noise, and promoted values are scoped to the lanes measured")
    if "block" in units:
        return "host-clustered bootstrap, except tests measured on one host (block bootstrap, flagged per row)"
    return "host-clustered bootstrap (hosts resampled with replacement, all blocks of a picked host kept)"


def _disq(counts: dict[str, dict[str, int]]) -> str:
    # Name the codes: a count alone reads as "disqualified" even when every flag is a warning that gates nothing.
    cand = sum(counts.get("candidate", {}).values())
    base = sum(counts.get("baseline", {}).values())
    codes = sorted({code for role in counts.values() for code in role})
    return f"{cand}/{base}" + (f" ({', '.join(codes)})" if codes else "")


def _loss(v: FeatureVerdict) -> str:
    if v.loss_delta is None:
        return "–"
    return f"{v.loss_delta:+.4f} (ε {v.epsilon:.4f})"


def _header(result: PromotionResult) -> list[str]:
    p = result.policy
    git = result.git
    lines = [f"## ablate promotion report {_c(result.report_id)}", "",
             f"- **Campaign:** {_t(result.campaign)} · **date:** {_t(result.date)} · **receipts:** "
             f"{result.num_receipts} ({len(result.refusals)} block(s) refused, {len(result.rejected)} invalid "
             f"receipt(s))",
             "- **Rounds:** " + (", ".join(f"{_c(r['round_id'])} ({_t(str(r['first_at'])[:10])}, {r['blocks']} "
                                           f"blocks)" for r in result.rounds) or "none"),
             f"- **Git SHAs:** baseline {', '.join(_c(s) for s in git['baseline']) or 'unknown'} · candidate "
             f"{', '.join(_c(s) for s in git['candidate']) or 'unknown'}" + (" · **dirty tree**" if git["dirty"]
                                                                             else ""),
             f"- **Policy:** {_c(p.ref)} ({_t(p.profile)}) from {_c(p.path)} · family α {p.family_alpha} with Holm "
             f"over {result.holm_family} feature × lane test(s) · {p.bootstrap.resamples} bootstrap resamples",
             f"- **Interval:** {_bootstrap_note(result)}"]
    merged = sorted({f"{r.round_id}: {r.note}" for v in result.verdicts for r in v.rounds if r.note})
    if merged:
        lines.append("- **Sweeps counted as one round** (a round is a separate run in time, policy "
                     f"`evidence.min_round_gap_s` = {p.evidence.min_round_gap_s:g} s): "
                     + "; ".join(_t(m) for m in merged))
    if p.single_node:
        lines += ["", "> **Single-node profile.** One host is allowed, so the interval is a block bootstrap within "
                      "that host: it cannot tell a host-specific effect from a real one. Scope: the lanes below."]
    return lines


def _defaults_diff(result: PromotionResult) -> list[str]:
    lines = ["", "### Defaults diff", ""]
    if not result.changes:
        return lines + [f"No change to {_c(result.defaults_path)}: nothing was promoted. Ties keep the incumbent."]
    rows = []
    for c in result.changes:
        lanes = ", ".join(_t(_short(x)) for x in c.lanes)
        if c.held:
            rows.append([_c(c.feature), _c(c.old), f"no change (held): {_t(c.held)}", "held", lanes])
        elif c.scope == "global":
            rows.append([_c(c.feature), _c(c.old), _c(c.new), "global", lanes])
        elif c.override_edits:
            pass  # a demotion of a lane override: its rows follow
        else:
            # From the overrides the writer writes, not the evidence: where a shape's lanes disagree the
            # promoting lane's value is recorded as evidence and runs nowhere.
            values = ", ".join(sorted({str(v) for v in c.overrides.values()}))
            why_not_global = "; ".join(_t(why) for why in c.not_global)
            # The reviewer's first question about a lane override: why it is not the global default.
            new = (f"{_c(c.old)} (lane override: {_c(values)})" + (f"; not global: {why_not_global}"
                                                                    if why_not_global else "")
                   if c.overrides else "no change (evidence only): " + why_not_global)
            rows.append([_c(c.feature), _c(c.old), new, "lane", lanes])
        runs = c.old if c.new is None else c.new
        for shape, (before, after) in c.override_edits.items():
            rows.append([_c(c.feature),
                         "–" if before is None else f"{_c(before)} (lane override on {_c(_short(shape))})",
                         f"{_c(after)} (lane override)" if after is not None else
                         f"{_c(runs)} (override removed: the lane runs the global value)", "lane", lanes])
    lines += _table(["feature", "old", "new", "scope", "lanes validated"], rows)
    rollback = "; ".join(_c(f"features.{c.feature}.value: {c.old}") for c in result.changes if c.scope == "global")
    if rollback:
        lines += ["", f"Rollback: set {rollback} in {_c(result.defaults_path)} (or revert this PR)."]
    return lines


def _lane_label(result: PromotionResult, lane_key: str) -> str:
    lane = next((lane for lane in result.lanes if lane.lane_key == lane_key), None)
    return f"{_t(lane.label())} {_c(_short(lane_key, 8))}" if lane else _c(_short(lane_key))


def _summary(result: PromotionResult) -> list[str]:
    rows = []
    for v in result.speed_verdicts:
        unit = "" if v.bootstrap_unit == "host" else " (block bootstrap)"
        rows.append([f"{_c(v.feature)}→{_c(v.value)}", f"**{v.verdict}**", _lane_label(result, v.lane_key),
                     f"{_x(v.speedup)} {_interval(v.ci95)}{unit}", _x(v.lower_adj),
                     f"{v.delta * 100:.2f}%", f"{v.n_blocks}/{v.n_hosts}/{v.n_seeds}/{v.n_rounds}",
                     "–" if v.win_fraction is None else f"{v.win_fraction:.0%}", _loss(v),
                     _t(_disq(v.disqualifiers)), _t(_amdahl(v)), _t(v.reason) if v.verdict != PROMOTE else "–"])
    header = ["feature", "verdict", "lane", "speed-up at horizon [95% CI]", "Holm lower", "δ",
              "blocks/hosts/seeds/rounds", "win", "LM loss Δ", "flags cand/base", "Amdahl bound",
              "first failing clause"]
    return ["", "### Verdicts", ""] + (_table(header, rows) if rows else ["No speed feature was measured."])


def sprt_line(seq: dict[str, Any], width: int = 12) -> str:
    """One line: each LLR trace (last ``width`` looks) against its own bound, and the stop reason. The promotion
    test's trace alone, against both bounds, showed an undecided test far below the lower bound (review)."""
    def shown(key: str) -> str:
        trace = [x for x in seq.get(key) or [] if x is not None]
        return ("…, " if len(trace) > width else "") + (", ".join(f"{x:.2f}" for x in trace[-width:]) or "none yet")

    return (f"LLR promotion test [{shown('llr_trace')}] against {seq['upper']:.2f}, rejection test "
            f"[{shown('llr_lower_trace')}] against {seq['lower']:.2f}, over {seq['blocks']} of "
            f"{seq['blocks_seen']} block(s); {seq['decision']}: {seq['stop_reason']}")


def _sequential(result: PromotionResult) -> list[str]:
    tests = [v for v in result.speed_verdicts if v.sequential]
    if not tests:
        return []
    seq = result.policy.sequential
    lines = ["", "### Sequential test (SPRT)", "",
             f"H0 speed-up <= (1 + {seq.delta0:.1%}) vs H1 >= (1 + {seq.delta1:.1%}), each moved by the lane's A/A "
             f"bias bound; α {seq.alpha:g} (÷ {result.holm_family} speed tests), β {seq.beta:g}; no crossing before "
             f"{seq.min_blocks} blocks; cap {seq.max_blocks} blocks / {seq.max_rounds} rounds. PROMOTE also needs "
             f"every other clause.", ""]
    for v in tests:
        lines.append(f"- {_c(v.feature)}→{_c(v.value)} {_lane_label(result, v.lane_key)}: **{v.verdict}**; "
                     f"{_t(sprt_line(v.sequential))}")
    for lane in result.lanes:
        if lane.lane_key in result.sprt_plots:
            lines += ["", f"![SPRT log-likelihood ratio against its bounds, lane {_t(lane.lane_key[:12])}]"
                          f"{_url(result.sprt_plots[lane.lane_key])}"]
    return lines


def _bundles(result: PromotionResult) -> list[str]:
    if not result.bundles:
        return []
    lines = ["", "### Bundle check", "", "Two or more values promoted in one lane are written only if old defaults vs "
             "all new values together win at least the best single value, within delta. Interaction = log(bundle) − "
             "Σ log(single): 0 when the wins add up.", ""]
    rows = []
    for b in result.bundles:
        written = "written" if not b.held else ("**held from --write**" if b.status == "failed" or
                                               result.policy.bundle.required else "written (bundle not required)")
        rows.append([_lane_label(result, b.lane_key), _t(", ".join(f"{f}={v}" for f, v in sorted(b.values.items()))),
                     f"{b.status} ({written})", b.num_blocks,
                     f"{_x(b.bundle_speedup)} {_interval(b.bundle_ci95)}" if b.bundle_speedup else "–",
                     _t(", ".join(f"{f} {s:.3f}×" for f, s in sorted(b.singles.items()))),
                     "–" if b.interaction is None else f"{b.interaction:+.4f}", _t(b.reason)])
    return lines + _table(["lane", "set", "status", "bundle blocks", "bundle speed-up [95% CI]", "singles",
                           "interaction", "why"], rows)


def _seconds(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:+.2f} s"


def _tradeoff(result: PromotionResult) -> list[str]:
    """Per feature: what it costs once, what it saves per step, when it pays for itself, the verdict at H."""
    rows = []
    for v in result.verdicts:
        if v.steady_speedup is None and v.one_time_delta_s is None:
            continue
        one = _seconds(v.one_time_delta_s)
        if v.one_time_ci95 is not None:
            one += f" [{v.one_time_ci95[0]:+.2f}, {v.one_time_ci95[1]:+.2f}]"
        rows.append([f"{_c(v.feature)}→{_c(v.value)}", f"{_x(v.steady_speedup)} {_interval(v.steady_ci95)}", one,
                     _t(v.break_even.get("text", "–")), f"{v.horizon_steps:,}",
                     f"{_x(v.speedup)} {_interval(v.ci95)}", _t(energy_cell(v.energy)), f"**{v.verdict}**"])
    if not rows:
        return []
    header = ["feature", "steady speed-up [95% CI]", "one-time cost Δ [95% CI]", "pays for itself",
              "lane horizon (steps)", "speed-up at horizon", "energy/token cand÷base (no verdict)", "verdict"]
    lines = ["", "### Trade-off: one-time cost against per-step speed", "",
             "Each arm's time splits into executor start-up (recorded, never compared: no feature can change it), "
             "one-time feature cost (model build, kernel resolution, compile warmup) and a recurring step time. "
             "The verdict compares the projected time of the lane's production run: one-time cost + horizon × "
             "step time.", ""]
    lines += _table(header, rows)
    plotted = [(lane, result.plots[lane.lane_key]) for lane in result.lanes if lane.lane_key in result.plots]
    for lane, path in plotted:
        where = result.plot_locations.get(lane.lane_key)
        lines += ["", f"![speed-up against horizon, lane {_t(lane.lane_key[:12])}]{_url(path)}"
                      + (f" (also on MLflow: {_t(where)})" if where else "")]
    return lines


def _startup_notes(result: PromotionResult) -> list[str]:
    notes = []
    for lane in result.lanes:
        if lane.startup_share is None or lane.startup_share < STARTUP_DOMINATES:
            continue
        notes.append(f"- Lane {_c(_short(lane.lane_key, 8))} ({_t(lane.label())}): executor start-up is "
                     f"{lane.startup_share:.0%} of each arm's wall time (median {lane.startup_s or 0:.2f} s of "
                     f"{lane.wall_s or 0:.2f} s). It is excluded from the verdict, but it is most of what every arm "
                     f"costs: raise `lane.budget.steps` so the recurring step time is estimated from more steady "
                     f"steps per arm, and run more blocks per round rather than more rounds.")
    return (["", "### Where the arms' time went", ""] + notes) if notes else []


def _amdahl(v: FeatureVerdict) -> str:
    a = v.amdahl
    if a.get("bound") is None:
        if a.get("family") is None:
            return "–"
        return f"{a['family']}: share under-measured" if a.get("share") is not None else f"{a['family']}: no share"
    return f"≤ {_x(a['bound'], 2)} ({a['family']} {a['share']:.0%})"


def _taxes(result: PromotionResult) -> list[str]:
    if not result.tax_verdicts:
        return []
    rows = [[f"{_c(v.feature)}→{_c(v.value)}", _c(_short(v.lane_key)),
             f"{_x(v.speedup)} {_interval(v.ci95)}", f"≥ {1 - (v.budget or 0):.3f}×",
             {True: "within budget", False: "**over budget**", None: "–"}[v.within_budget],
             "–" if v.loss_delta is None else f"{v.loss_delta:+.4f}",
             "–" if v.memory_ratio is None else _x(v.memory_ratio), f"{v.n_blocks}/{v.n_hosts}",
             _t(_disq(v.disqualifiers))] for v in result.tax_verdicts]
    header = ["tax", "lane", f"throughput ratio [{result.policy.taxes.confidence:.0%} CI, two-sided]", "budget",
              "status", "loss Δ", "memory ratio", "blocks/hosts", "flags cand/base"]
    return (["", "### Taxes (never promoted; opt-in only)", ""] + _table(header, rows) +
            ["", "Taxes stay off in the defaults; turn one on per campaign under `features:` in the sweep file."])


def _revalidations(result: PromotionResult) -> list[str]:
    """Marks (``promote``: evidence whose software changed) and re-test outcomes (``ablate revalidate``): values
    demoted because their win is gone, and values confirmed or still unconfirmed."""
    marks = [r for r in result.revalidations if not isinstance(r, RevalidationOutcome)]
    outcomes = [r for r in result.revalidations if isinstance(r, RevalidationOutcome)]
    lines: list[str] = []
    if marks:
        rows = [[f"{_c(r.feature)}={_c(r.value)}", _c(_short(r.lane_key)), _c(_short(r.recorded_fingerprint)),
                 _c(_short(r.current_fingerprint)), _t(r.report or "–")] for r in marks]
        lines += (["", "### Needs revalidation (software fingerprint changed)", ""] +
                  _table(["default", "lane", "recorded fingerprint", "current fingerprint", "report"], rows))

    def retested(o: RevalidationOutcome) -> list[Any]:
        t = o.retest
        ci = t.get("ci95") or [None, None]
        shown = _interval(None if None in ci else (ci[0], ci[1]))
        return [f"**{_t(o.verdict or 'no verdict')}**", f"{_x(t.get('speedup'))} {shown}",
                _c(_short(t.get("software_fingerprint") or "–")), _t(o.report or "–"), _t(o.reason)]

    demoted = [o for o in outcomes if o.outcome == DEMOTED]
    if demoted:
        # A global demotion restores the global value the promotion replaced, not the lane's baseline.
        rows = [[_c(o.feature), f"{_c(o.value)} → {_c(o.previous)} (this lane's override; the global value stays)"
                 if o.scope == "global" and (o.still_supported_by or str(o.replaced) == str(o.value)) else
                 f"{_c(o.value)} → {_c(o.replaced if o.scope == 'global' else o.previous)}",
                 _t(o.scope), _c(_short(o.lane_key)),
                 *retested(o)] for o in demoted]
        lines += (["", "### Demoted (the win is gone on re-test)", ""] +
                  _table(["feature", "value", "scope", "lane", "verdict", "speed-up [95% CI]", "re-tested under",
                          "promoted by", "why"], rows) +
                  ["", "Each demoted value goes back to the value it replaced; its evidence record keeps the "
                       "re-test under `revalidate.retests`."])
    kept = [o for o in outcomes if o.outcome != DEMOTED]
    if kept:
        rows = [[f"{_c(o.feature)}={_c(o.value)}", _t(o.outcome), _t(o.scope), _c(_short(o.lane_key)),
                 *retested(o)] for o in kept]
        lines += (["", "### Revalidated (the value stays)", ""] +
                  _table(["default", "outcome", "scope", "lane", "verdict", "speed-up [95% CI]",
                          "re-tested under", "promoted by", "why"], rows) +
                  ["", "Confirmed: the mark is resolved and the re-test is the value's new evidence. Still "
                       "unconfirmed: the re-test did not decide, so the value stays and stays marked."])
    return lines


def _not_run(result: PromotionResult) -> list[str]:
    if not result.not_run:
        return []
    rows = [[_c(n['what']), _t(n["why"]), _t(n.get("rounds", ""))] for n in result.not_run[:30]]
    return (["", "### Refused before any arm ran", ""] + _table(["toggle", "why", "rounds"], rows) +
            ([f"… and {len(result.not_run) - 30} more in the JSON report."] if len(result.not_run) > 30 else []))


def _refusals(result: PromotionResult) -> list[str]:
    if not result.refusals and not result.rejected:
        return []
    lines = ["", "### Refused (never paired, never counted)", ""]
    rows = [[_c(r.block_id), _t(r.feature or "A/A"), _c(_short(r.lane_key)), _t(r.round_id or "–"), _t(r.reason)]
            for r in result.refusals[:50]]
    lines += _table(["block", "feature", "lane", "round", "reason"], rows) if rows else []
    if len(result.refusals) > 50:
        lines.append(f"… and {len(result.refusals) - 50} more in the JSON report.")
    if result.rejected:
        lines += ["", "Invalid receipts:", ""] + [f"- {_c(o)}: {_t(r)}" for o, r in result.rejected[:20]]
    return lines


def _lane_detail(result: PromotionResult, lane: LaneSummary) -> list[str]:
    cal = lane.calibration
    shown = {k: lane.lane[k] for k in ("model.pattern", "batch.micro_batch", "batch.seq_len", "precision",
                                       "compile.posture", "engine.name", "engine.workers") if k in lane.lane}
    spread = _x(None if cal.noise_floor is None else 1 + cal.noise_floor, 4)
    bias = _x(None if cal.bias_bound is None else 1 + cal.bias_bound, 4)
    interval = ("–" if cal.aa_interval_log is None else
                f"[{math.exp(cal.aa_interval_log[0]):.4f}, {math.exp(cal.aa_interval_log[1]):.4f}]")
    calibrated = {True: "contains 1 (no systematic bias detected)", False: "excludes 1: systematic bias, added "
                  "to delta", None: "not enough A/A blocks"}[cal.contains_one]
    lines = ["", f"<details><summary>Lane <code>{_t(lane.lane_key)}</code>: {_t(lane.label())}</summary>", "",
             f"- software fingerprint {_c(lane.software_fingerprint)}" +
             (f" (earlier: {', '.join(_c(f) for f in lane.fingerprints[:-1])}; their evidence no longer counts)"
              if len(lane.fingerprints) > 1 else ""),
             f"- lane: {_t(', '.join(f'{k}={v}' for k, v in shown.items()))}; horizon {lane.horizon_steps:,} steps; "
             f"hosts: {_t(', '.join(lane.hosts))}",
             f"- A/A, every block of the lane under this software (each test is judged on those beside its own "
             f"rounds, in its clauses): {cal.num_blocks} block(s); bias HL interval {interval} {calibrated}; "
             f"bias bound {bias}; "
             f"delta {cal.delta(result.policy):.2%}; single-block spread {spread}"
             f", loss spread {'–' if cal.loss_spread is None else f'{cal.loss_spread:.4g}'}"
             f" (measured {_t((cal.first_at or '–')[:10])} to {_t((cal.last_at or '–')[:10])})"]
    for v in [v for v in result.verdicts if v.lane_key == lane.lane_key]:
        lines += ["", f"**{_c(v.feature)} → {_c(v.value)} (baseline {_c(v.baseline_value)}): {v.verdict}**", ""]
        tp = v.throughput
        for role in ("baseline", "candidate"):
            if role in tp:
                lines.append(f"- {role} wall tokens/s: median {tp[role]['median']:.1f}, IQR "
                             f"[{tp[role]['iqr'][0]:.1f}, {tp[role]['iqr'][1]:.1f}]")
        if v.order:
            effect = v.order.get("effect")
            lines.append(f"- order: {v.order['candidate_first']} candidate-first, {v.order['baseline_first']} "
                         f"baseline-first" + ("" if effect is None else f", effect {effect * 100:+.2f}%"))
        lines.append(f"- failures: candidate {v.failures['candidate']['failed']}/{v.failures['candidate']['arms']}, "
                     f"baseline {v.failures['baseline']['failed']}/{v.failures['baseline']['arms']}"
                     + (f" (and in {len(v.refused_failure_blocks)} refused block(s): candidate "
                        f"{v.refused_failures['candidate']['failed']}/{v.refused_failures['candidate']['arms']}, "
                        f"baseline {v.refused_failures['baseline']['failed']}/{v.refused_failures['baseline']['arms']}"
                        f"; they hold the test, never reject it)" if v.refused_failure_blocks else "")
                     + f"; disqualifiers: {_t(v.disqualifiers)}")
        if v.suspicious:
            lines.append("- **suspicious win**: needs a confirming round and a look at the kernel traces")
        if v.amdahl.get("note"):
            lines.append(f"- Amdahl: {_t(v.amdahl['note'])}")
        for what, items in (("arms that could not be read (the test holds until they are)", v.unread_arms),
                            ("arms in sweeps the --sweep selection left out (the test holds)", v.left_out_arms),
                            ("arms of newer software in refused blocks (the test holds until that software is "
                             "measured)", v.refused_arms),
                            ("gated candidate arms", v.gated_arms),
                            ("blocks whose arms' start-up differ beyond the lane's usual spread", v.startup_flags),
                            ("blocks measured under foreign CPU load (HOST_CONTENDED)", v.contended_blocks)):
            if items:
                lines.append(f"- {what}: " + "; ".join(_t(i) for i in items[:6])
                             + (f"; and {len(items) - 6} more" if len(items) > 6 else ""))
        if v.superseded.get("blocks"):
            lines.append(f"- {v.superseded['blocks']} block(s) from rounds {_t(v.superseded['rounds'])} ignored: "
                         f"software fingerprint {_t(v.superseded['fingerprints'])} changed, count restarted")
        if v.hosts:
            lines += [""] + _table(["host", "blocks", "median speedup", "candidate failures"],
                                   [[_t(h.host), h.blocks, _x(h.median_speedup), h.candidate_failures]
                                    for h in v.hosts])
        if v.rounds:
            lines += [""] + _table(["round", "started", "blocks", "hosts", "HL speedup", "counted"],
                                   [[_t(r.round_id), _t(r.first_at[:19]), r.blocks, r.hosts, _x(r.speedup),
                                     ("yes" if r.counted else "no") + (f" (one round: {_t(r.note)})" if r.note else "")]
                                    for r in v.rounds])
        if v.clauses:
            lines += [""] + [f"- {'✅' if c.passed else '❌'} {_c(c.name)}: {_t(c.detail)}" for c in v.clauses]
        lines += _block_lines(result, v)
    return lines + ["", "</details>"]


def render_markdown(result: PromotionResult) -> str:
    token = _REDACT.set(text_redactor())
    try:
        return _render_markdown(result)
    finally:
        _REDACT.reset(token)


def _render_markdown(result: PromotionResult) -> str:
    head = (_header(result) + _defaults_diff(result) + _bundles(result) + _summary(result) + _sequential(result)
            + _tradeoff(result)
            + _taxes(result)
            + _startup_notes(result) + _not_run(result) + _revalidations(result) + _refusals(result))
    footer = ["", f"<sub>Decided under policy {_c(result.policy.ref)}; full numbers in "
                  f"{_c(result.report_id + '.json')}. "
                  "Verdicts: PROMOTE (every clause holds), HOLD (inconclusive: the incumbent stays), REJECT.</sub>"]
    used = sum(len(line) + 1 for line in head + footer) + 400
    detail = ["", "### Per-lane detail"] + _links_note(result)
    omitted = 0
    promoted_lanes = {v.lane_key for v in result.promoted}
    # Lanes with a promotion come first, so a long campaign cuts the least important detail.
    for lane in sorted(result.lanes, key=lambda lane: lane.lane_key not in promoted_lanes):
        part = _lane_detail(result, lane)
        size = sum(len(line) + 1 for line in part)
        if used + size > MAX_MARKDOWN_CHARS:
            omitted += 1
            continue
        detail += part
        used += size
    if omitted:
        detail += ["", f"{omitted} lane(s) omitted to stay under GitHub's PR body limit; see "
                       f"{_c(result.report_id + '.json')}."]
    return "\n".join(head + detail + footer) + "\n"
