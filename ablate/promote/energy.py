"""Energy per token beside the speed-up: what a feature does to joules per token, measured, never decided on.

A block contributes when both of its arms measured energy with the same source (a ratio of an NVML number to a RAPL
number means nothing). The figure is the median over blocks of candidate / baseline joules per token, with the
range, the source and whether the counter was host-wide (RAPL: other processes on the host are included, so a
ratio near 1 says little).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from ablate.promote.match import Block


def energy_ratio(blocks: Iterable[Block]) -> dict[str, Any]:
    ratios, sources = [], set()
    measured_any = False
    for block in blocks:
        cand, base = block.candidate, block.baseline
        measured_any = measured_any or cand.energy_source is not None or base.energy_source is not None
        if cand.joules_per_token and base.joules_per_token and cand.energy_source == base.energy_source:
            ratios.append(cand.joules_per_token / base.joules_per_token)
            sources.add(cand.energy_source)
    if not ratios:
        why = ("no block measured energy on both arms with the same source" if measured_any else
               "no arm measured energy (no NVML energy counter or readable RAPL on these hosts)")
        return {"ratio": None, "blocks": 0, "why": why}
    return {"ratio": statistics.median(ratios), "blocks": len(ratios), "range": [min(ratios), max(ratios)],
            "source": "+".join(sorted(s for s in sources if s)),
            "host_wide": any("rapl" in (s or "") for s in sources)}


def energy_cell(energy: dict[str, Any]) -> str:
    """The report's cell: '0.82× (5 blocks, rapl host-wide)' or '–'."""
    if not energy or energy.get("ratio") is None:
        return "–"
    where = energy.get("source", "") + (" host-wide" if energy.get("host_wide") else "")
    return f"{energy['ratio']:.3f}× ({energy['blocks']} blocks, {where})"
