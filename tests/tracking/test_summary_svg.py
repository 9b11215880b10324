"""The sweep summary written at a sweep's close (``plots.summary_svg``): one bar per block with its ratio, the
same rows ``summary_png`` draws, hatching where not both arms are valid, well-formed SVG at any size."""

from __future__ import annotations

import sys
from pathlib import Path
from xml.etree import ElementTree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "promote"))

from promote_sim import Sim, moe, simulate  # noqa: E402

from ablate.receipts.schema import Status  # noqa: E402
from ablate.tracking import plots  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def _bars(path: Path) -> list[ElementTree.Element]:
    root = ElementTree.fromstring(path.read_text(encoding="utf-8"))
    return [rect for rect in root.iter(f"{SVG}rect") if rect.find(f"{SVG}title") is not None]


def test_every_block_is_one_bar_with_its_ratio_and_the_invalid_ones_are_hatched(tmp_path: Path) -> None:
    receipts = simulate(Sim(features=[moe(1.05)], hosts=3, blocks_per_host=3, rounds=1), seed=2)
    spoiled = receipts[0].model_copy(update={"identity": receipts[0].identity.model_copy(
        update={"status": Status.disqualified})})
    receipts = [spoiled, *receipts[1:-1]]  # one pair not both valid, one block left with a single arm
    rows = plots.block_ratios(receipts)
    path = plots.summary_svg(receipts, tmp_path / "summary.svg", "sweep: candidate / baseline per block")
    assert path is not None
    bars = _bars(path)
    assert len(bars) == len(rows) >= 6
    for bar, (block_id, label, ratio, valid) in zip(bars, rows):
        tip = bar.find(f"{SVG}title").text
        assert tip.startswith(f"{block_id} {label}: ")
        assert (f"{ratio:.4f}" in tip) if ratio is not None else ("no ratio" in tip)
        assert ("not both arms valid" in tip) == (not valid)
    hatched = [r for r in ElementTree.fromstring(path.read_text()).iter(f"{SVG}rect") if r.get("fill") == "url(#hatch)"]
    assert len(hatched) == sum(not valid for *_, valid in rows) >= 2
    assert sum(ratio is None for _, _, ratio, _ in rows) == 1


def test_a_thousand_blocks_stay_one_readable_file_without_per_bar_labels(tmp_path: Path) -> None:
    receipts = simulate(Sim(features=[moe(1.02)], hosts=4, blocks_per_host=130, rounds=1), seed=4)
    rows = plots.block_ratios(receipts)
    assert len(rows) > plots.SUMMARY_TICKS_MAX
    path = plots.summary_svg(receipts, tmp_path / "summary.svg", "big sweep")
    assert len(_bars(path)) == len(rows)
    root = ElementTree.fromstring(path.read_text())
    assert not [t for t in root.iter(f"{SVG}text") if t.get("transform")], "no rotated per-bar labels past the cap"
    assert plots.summary_svg([], tmp_path / "none.svg", "empty") is None
