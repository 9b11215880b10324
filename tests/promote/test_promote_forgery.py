"""Evidence that must never promote: forged, replayed, mislabelled or impossible receipts (issue 17).

Every set here is a hand-made edit of the real receipts in ``assets/smoke_run`` (two rounds of smoke.yaml that
PROMOTE ``mamba_scan=chunked`` and ``moe_dispatch=jagged``). The untouched set promotes both; each edited set
must not promote what was forged, must say why by name, and must never crash ``promote``. Edits touch the
``moe_dispatch`` blocks unless the case is about rounds, so ``mamba_scan`` still promoting shows the rest of the
campaign was not thrown away with them.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pytest
from conftest import DEFAULTS, HERE
from ruamel.yaml import YAML

from ablate.promote import PROMOTE, Policy, PromotionResult, promote, with_overrides, write_defaults
from ablate.promote.git_pr import _title
from ablate.receipts import store
from ablate.receipts.store import load_receipts

RUN = HERE / "assets" / "smoke_run"
INJECTED = "turbo: true\n# injected"
Raw = dict[str, Any]


@pytest.fixture(scope="module")
def raw() -> list[Raw]:
    return [json.loads(p.read_text()) for p in sorted((RUN / "receipts").glob("*.json"))]


def fresh(raw: list[Raw]) -> list[Raw]:
    return copy.deepcopy(raw)


def reseal(data: Raw) -> Raw:
    """A forger recomputes the content digest (it is a checksum, not a signature): forged sets carry valid ones,
    so every refusal below comes from the check under test, never from the digest."""
    if data.get("digest") is not None and hasattr(store, "content_digest"):
        data["digest"] = store.content_digest({k: v for k, v in data.items() if k != "digest"})
    return data


def is_moe(data: Raw, arm: Optional[str] = None) -> bool:
    ident = data["identity"]
    return ident["feature"] == "moe_dispatch" and (arm is None or ident["arm"] == arm)


def run(receipts: Iterable[Any], policy: Policy, tmp_path: Path, **kwargs: Any) -> PromotionResult:
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(DEFAULTS.read_text())
    return promote([reseal(r) if isinstance(r, dict) else r for r in receipts], policy_path=policy,
                   defaults_path=defaults, **kwargs)


def verdict(result: PromotionResult, feature: str) -> Any:
    return next((v for v in result.verdicts if v.feature == feature), None)


def promoted(result: PromotionResult) -> set[str]:
    return {v.feature for v in result.promoted}


def reasons(result: PromotionResult) -> str:
    return "\n".join([r.reason for r in result.refusals] + [why for _, why in result.rejected])


def stamp(text: str, seconds: float) -> str:
    return (datetime.fromisoformat(text) + timedelta(seconds=seconds)).isoformat()


# --- the untouched campaign: the yardstick every forged set is compared with ---


def test_the_untouched_smoke_receipts_promote_with_two_separate_rounds(raw: list[Raw], single_node_policy: Policy,
                                                                      tmp_path: Path) -> None:
    result = run(fresh(raw), single_node_policy, tmp_path)
    assert promoted(result) == {"mamba_scan", "moe_dispatch"} and result.refusals == [] and result.rejected == []
    moe = verdict(result, "moe_dispatch")
    # smoke.sh's rounds run back to back (~2 min each): they still start ~130 s apart, more than the 60 s gap.
    assert [r.note for r in moe.rounds] == ["", ""] and moe.n_rounds == 2
    starts = [datetime.fromisoformat(r.first_at) for r in moe.rounds]
    assert (starts[1] - starts[0]).total_seconds() > 2 * single_node_policy.evidence.min_round_gap_s


# --- a value that does not exist ---


def _set_moe_value(data: Raw, value: Any) -> None:
    if is_moe(data, "candidate"):
        data["identity"]["feature_value"] = value
        data["requested"]["lane"]["features.moe_dispatch"] = value


@pytest.mark.parametrize("value", [INJECTED, "MoEDispatch.jagged"], ids=["injected-yaml", "coerced-spelling"])
def test_a_value_the_registry_does_not_know_is_refused_by_name(raw: list[Raw], single_node_policy: Policy,
                                                               tmp_path: Path, value: str) -> None:
    """Old code: PROMOTE, written into defaults.yaml, and the newline became a Markdown heading in the PR body.
    ``MoEDispatch.jagged`` is what OmegaConf would coerce to jagged: only the registry's own spelling counts."""
    receipts = fresh(raw)
    for data in receipts:
        _set_moe_value(data, value)
    result = run(receipts, single_node_policy, tmp_path)
    assert promoted(result) == {"mamba_scan"}
    refused = [r for r in result.refusals if r.feature == "moe_dispatch"]
    assert len(refused) == 8 and all("is not a registered value of moe_dispatch" in r.reason for r in refused)
    assert "one of padded, jagged, grouped_mm" in refused[0].reason
    assert not any(line.startswith("# injected") for line in result.markdown.splitlines())
    write_defaults(result, tmp_path / "defaults.yaml")
    written = (tmp_path / "defaults.yaml").read_text()
    assert value not in written and "injected" not in written and "MoEDispatch" not in written


def test_an_unregistered_baseline_value_is_refused_too(raw: list[Raw], single_node_policy: Policy,
                                                       tmp_path: Path) -> None:
    receipts = fresh(raw)
    for data in receipts:
        if is_moe(data):
            data["identity"]["baseline_value"] = "padded\n## injected"
            if data["identity"]["arm"] == "baseline":
                data["identity"]["feature_value"] = "padded\n## injected"
    result = run(receipts, single_node_policy, tmp_path)
    assert "moe_dispatch" not in promoted(result) and verdict(result, "moe_dispatch") is None
    assert "identity.baseline_value = 'padded\\n## injected' is not a registered value" in reasons(result)


# --- text that could inject Markdown or YAML ---

HEADINGS = re.compile(r"^(## ablate promotion report|### )")


def _pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_receipt_text_cannot_inject_markdown_yaml_or_a_path(raw: list[Raw], single_node_policy: Policy,
                                                            tmp_path: Path) -> None:
    """Campaign, host, sweep and lane strings are free text a receipt carries: the report, the defaults writer
    and the PR title must print them inert (no heading, row, HTML, link, YAML key or path separator)."""
    receipts = fresh(raw)
    campaign = "smoke\n# injected | cell\nfeatures: {mamba_scan: {value: sequential}}"
    for data in receipts:
        ident = data["identity"]
        ident["campaign"] = campaign
        ident["host"] = "vm\n## host <script>alert(1)</script> [x](http://evil) ` |"
        ident["sweep_id"] = ident["sweep_id"] + "\n### round | x"
    # The smoke lane promotes two features and has no bundle blocks: the bundle check would hold both from the
    # write this test inspects, so it is switched off here (tests/promote/test_promote_bundle.py covers it).
    policy = with_overrides(single_node_policy, {"bundle.required": False})
    result = run(receipts, policy, tmp_path)
    assert promoted(result) == {"mamba_scan", "moe_dispatch"}  # escaping changes no verdict
    md = result.markdown
    assert "<script>" not in md and not re.search(r"(?<!\\)\]\(http://evil\)", md)
    for line in md.splitlines():
        assert not line.startswith("#") or HEADINGS.match(line), line
        assert not line.startswith(("features:", "# injected")), line
    for table in re.findall(r"((?:^\|.*\|$\n?)+)", md, flags=re.M):
        widths = {_pipes(row) for row in table.strip().splitlines()}
        assert len(widths) == 1, table  # no cell break smuggled into a row
    assert "/" not in result.report_id and "\n" not in result.report_id
    assert "\n" not in _title(result)
    defaults = tmp_path / "defaults.yaml"
    write_defaults(result, defaults)
    data = YAML(typ="safe").load(defaults.read_text())
    assert set(data) == set(YAML(typ="safe").load(DEFAULTS.read_text()))
    records = [r for entry in data["features"].values() for r in entry.get("evidence") or []]
    assert records and {r["campaign"] for r in records if r["report"] == result.report_id} == {campaign}
    assert data["features"]["mamba_scan"]["value"] == YAML(typ="safe").load(DEFAULTS.read_text())["features"][
        "mamba_scan"]["value"]


# --- rounds: a separate run in time, never a replay ---


def _relabel(data: Raw, sweep: str, suffix: str) -> Raw:
    data = copy.deepcopy(data)
    ident = data["identity"]
    ident["receipt_id"] = ident["receipt_id"][:-4] + suffix
    ident["sweep_id"] = sweep
    return data


def _rounds(raw: list[Raw]) -> tuple[list[Raw], list[Raw]]:
    first = min(r["identity"]["sweep_id"] for r in raw)
    return ([r for r in raw if r["identity"]["sweep_id"] == first],
            [r for r in raw if r["identity"]["sweep_id"] != first])


@pytest.mark.parametrize("shift_s", [0.0, -86_400.0], ids=["same-timestamps", "a-day-earlier"])
def test_a_round_copied_as_a_second_round_is_refused_as_a_replay(raw: list[Raw], single_node_policy: Policy,
                                                                 tmp_path: Path, shift_s: float) -> None:
    """Old code: round 1 plus a copy of it under new receipt and sweep ids was two rounds and PROMOTEd."""
    first, _ = _rounds(fresh(raw))
    copies = []
    for data in first:
        twin = _relabel(data, "smoke-20261123-000000-copy", "copy")
        twin["identity"]["created_at"] = stamp(twin["identity"]["created_at"], shift_s)
        copies.append(twin)
    result = run(first + copies, single_node_policy, tmp_path)
    assert promoted(result) == set()
    replays = [r for r in result.refusals if r.reason.startswith("replayed measurements")]
    assert len(replays) == 36  # every block of both copies, named: nothing says which one is the original
    original = first[0]["identity"]["receipt_id"]
    assert any(original in r.receipt_ids and "has the per-step timings of" in r.reason for r in replays)


def test_one_round_relabelled_as_two_counts_as_one(raw: list[Raw], single_node_policy: Policy,
                                                   tmp_path: Path) -> None:
    """Round 2's later blocks relabelled as a third sweep: under a policy asking for three rounds of two blocks,
    old code counted three rounds and PROMOTEd; they ran within one run, so they are one round."""
    policy = with_overrides(single_node_policy, {"evidence.min_rounds": 3, "evidence.min_blocks_per_round": 2})
    first, second = _rounds(fresh(raw))
    relabelled = [_relabel(d, "smoke-20261122-180940-feed", "feed") if d["identity"]["block_id"] >= "b008" else d
                  for d in second]
    result = run(first + relabelled, policy, tmp_path)
    assert promoted(result) == set()
    moe = verdict(result, "moe_dispatch")
    assert moe.n_rounds == 2 and "3" in moe.reason
    merged = [r for r in moe.rounds if r.note]
    assert len(merged) == 1 and "smoke-20261122-180940-feed" in merged[0].round_id
    assert "less than evidence.min_round_gap_s = 60 s" in merged[0].note or "at the same time" in merged[0].note
    assert "Sweeps counted as one round" in result.markdown


def test_two_sweeps_started_in_the_same_second_are_one_round(raw: list[Raw], single_node_policy: Policy,
                                                             tmp_path: Path) -> None:
    """Round 2 moved to start the second round 1 started (two sweeps of one campaign side by side)."""
    first, second = _rounds(fresh(raw))
    start = lambda rows: min(datetime.fromisoformat(r["identity"]["created_at"]).timestamp() - r["time"]["wall_s"]
                             for r in rows)  # noqa: E731
    shift = start(first) - start(second)
    for data in second:
        data["identity"]["created_at"] = stamp(data["identity"]["created_at"], shift)
    result = run(first + second, single_node_policy, tmp_path)
    assert promoted(result) == set()
    for feature in ("mamba_scan", "moe_dispatch"):
        v = verdict(result, feature)
        assert v.n_rounds == 1 and len(v.rounds) == 1 and "started 0 s after" in v.rounds[0].note


# --- forged figures: refused by the validator, never a crash ---

def _scale(section: str, name: str, factor: float) -> Callable[[Raw], None]:
    return lambda d: d[section].__setitem__(name, d[section][name] * factor)


FIGURES: dict[str, tuple[Callable[[Raw], None], str]] = {
    "wall tokens/s raised 4%": (_scale("throughput", "wall_tokens_per_s", 1.04), "throughput.wall_tokens_per_s"),
    "projected tokens/s raised 4%": (_scale("projection", "tokens_per_s", 1.04), "projection.tokens_per_s"),
    "tokens: 0": (lambda d: d["throughput"].__setitem__("tokens", 0), "throughput.tokens is 0"),
    "Infinity throughput": (lambda d: d["throughput"].__setitem__("wall_tokens_per_s", float("inf")), "inf"),
    "NaN projection": (lambda d: d["projection"].__setitem__("tokens_per_s", float("nan")), "nan"),
    "negative throughput": (_scale("projection", "tokens_per_s", -1.0), "never negative"),
    "created_at not a date": (lambda d: d["identity"].__setitem__("created_at", "not-a-date"), "created_at"),
    "created_at without offset": (lambda d: d["identity"].__setitem__("created_at", "2026-11-22T18:07:17"),
                                  "UTC offset"),
}


def test_forged_figures_are_refused_and_never_crash_promote(raw: list[Raw], single_node_policy: Policy,
                                                            tmp_path: Path) -> None:
    """One forgery per moe candidate, written as JSON text (``Infinity``/``NaN`` literals as a hand edit leaves
    them) and read back by ``load_receipts``. Old code: the raised figure PROMOTEd at 1.040x, NaN crashed promote,
    a negative figure raised ``math domain error``, "not-a-date" picked the current fingerprint."""
    receipts = fresh(raw)
    candidates = [d for d in receipts if is_moe(d, "candidate")]
    assert len(candidates) == len(FIGURES)
    folder = tmp_path / "receipts"
    folder.mkdir()
    for data, (edit, _) in zip(candidates, FIGURES.values()):
        edit(data)
    for data in receipts:
        (folder / f"{data['identity']['receipt_id']}.json").write_text(json.dumps(reseal(data)))  # allow_nan
    loaded, rejected = load_receipts(folder)
    why = dict(rejected)
    for data, (name, (_, fragment)) in zip(candidates, FIGURES.items()):
        origin = str(folder / f"{data['identity']['receipt_id']}.json")
        assert fragment in why.get(origin, ""), (name, why.get(origin))
    result = run(loaded, single_node_policy, tmp_path, rejected=rejected)
    assert promoted(result) == {"mamba_scan"} and verdict(result, "moe_dispatch") is None
    assert len(result.rejected) == len(FIGURES) and "partner arm is missing" in reasons(result)
    json.loads(result.to_json())  # the report renders, NaN and all
    # The same dicts handed to promote directly: refused there too.
    direct = run(receipts, single_node_policy, tmp_path)
    assert {rid for rid, _ in direct.rejected} == {d["identity"]["receipt_id"] for d in candidates}


# --- duplicate receipt ids ---


def _conflicting(raw: list[Raw]) -> tuple[list[Raw], Raw]:
    receipts = fresh(raw)
    original = next(d for d in receipts if is_moe(d, "candidate"))
    other = copy.deepcopy(original)
    other["host_load"]["detail"] = "a second copy with other contents"
    return receipts, other


def test_duplicate_ids_with_different_contents_are_all_refused(raw: list[Raw], single_node_policy: Policy,
                                                                tmp_path: Path) -> None:
    """Old code: the first copy in sort order (files) or in the list (promote) won silently."""
    receipts, other = _conflicting(raw)
    rid = other["identity"]["receipt_id"]
    direct = run([*receipts, other], single_node_policy, tmp_path)
    conflicts = [why for r, why in direct.rejected if r == rid]
    assert len(conflicts) == 2 and all("conflicting copies" in why for why in conflicts)
    assert all(rid not in r.receipt_ids or "partner arm is missing" in r.reason for r in direct.refusals)
    assert rid not in {x for v in direct.verdicts for x in v.receipt_ids}
    folder = tmp_path / "dup"
    folder.mkdir()
    for index, data in enumerate([*receipts, other]):
        (folder / f"{index:03d}.json").write_text(json.dumps(reseal(data)))
    loaded, rejected = load_receipts(folder)
    assert rid not in {r.identity.receipt_id for r in loaded}
    assert sum("conflicting copies" in why for _, why in rejected) == 2
    # Identical copies are one receipt, not a conflict.
    same = run([*receipts, copy.deepcopy(receipts[0])], single_node_policy, tmp_path)
    assert same.rejected == [] and promoted(same) == {"mamba_scan", "moe_dispatch"}


# --- kernels that did not run ---


def _observed_padded(data: Raw) -> None:
    for backend in data["observed"]["backends"]:
        if backend["op"] == "moe":
            backend["observed"] = "padded"


def _fallback_at_warn(data: Raw) -> None:
    data["disqualifiers"].append({"code": "BACKEND_FALLBACK", "severity": "warn",
                                  "detail": "moe: requested jagged, ran jagged_loop", "step": None})


@pytest.mark.parametrize("edit", [_observed_padded, _fallback_at_warn], ids=["observed-padded", "fallback-at-warn"])
def test_a_candidate_whose_kernel_did_not_run_never_promotes(raw: list[Raw], single_node_policy: Policy,
                                                            tmp_path: Path, edit: Callable[[Raw], None]) -> None:
    """Old code: both PROMOTEd (no disqualifier; or BACKEND_FALLBACK at ``warn``, which the policy does not gate)."""
    receipts = fresh(raw)
    for data in receipts:
        if is_moe(data, "candidate"):
            edit(data)
    result = run(receipts, single_node_policy, tmp_path)
    moe = verdict(result, "moe_dispatch")
    assert moe.verdict != PROMOTE and "mamba_scan" in promoted(result)
    assert moe.gated_disqualifiers.get("BACKEND_FALLBACK") == 8, moe.gated_disqualifiers


# --- null counters ---


@pytest.mark.parametrize("arm", ["baseline", "candidate"])
def test_a_null_counter_never_skips_the_exact_counter_gate(raw: list[Raw], single_node_policy: Policy,
                                                          tmp_path: Path, arm: str) -> None:
    """Old code: ``graph_breaks: null`` on the baseline skipped the comparison and the feature PROMOTEd."""
    receipts = fresh(raw)
    for data in receipts:
        if is_moe(data, arm):
            data["observed"]["compile"]["graph_breaks"] = None
    result = run(receipts, single_node_policy, tmp_path)
    assert "moe_dispatch" not in promoted(result) and "mamba_scan" in promoted(result)
    assert "COUNTER_MISSING" in reasons(result) + "\n".join(
        a for v in result.verdicts for a in v.gated_arms)
