"""The validator recomputes every derived figure from a receipt's raw per-step fields: an edited number never
validates, time that nothing measured is caught, and pre-horizon receipts are refused with the reason."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "promote"))

from promote_sim import T0, base_lane, make_receipt  # noqa: E402

from ablate.receipts.schema import InvalidReceipt, validate_receipt  # noqa: E402


@pytest.fixture(scope="module")
def good() -> dict[str, Any]:
    receipt = make_receipt(receipt_id="r1", sweep_id="s1", block_id="b1", arm="candidate", arm_index=1, order=0,
                           feature="moe_dispatch", feature_value="jagged", baseline_value="padded",
                           lane=base_lane(**{"features.moe_dispatch": "jagged"}), host="node-0", tps=5000.0,
                           loss=5.0, created_at=T0, step_jitter=0.05, seed=3)
    return receipt.model_dump(mode="json")


def _scale(path: str, factor: float) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        *parents, last = path.split(".")
        for part in parents:
            node = node[part]
        node[last] = node[last] * factor
    return edit


def _move_time(data: dict[str, Any]) -> None:
    # Claim 40 ms more goodput, taken out of unattributed: the parts still sum to wall within tolerance.
    data["time"]["goodput_s"] += 0.04
    data["time"]["badput_s"]["unattributed"] -= 0.04
    data["time"]["goodput_fraction"] = data["time"]["goodput_s"] / data["time"]["wall_s"]


def _faster_steps(data: dict[str, Any]) -> None:
    data["steps"]["cadence_s"] = [c * 0.9 for c in data["steps"]["cadence_s"]]


def _cadence_below_compute(data: dict[str, Any]) -> None:
    # Halve the steady cadences and make every figure validation re-derives agree: idle re-derived, the time it
    # lost put into teardown (not re-derived), the projection recomputed. Only the cadence's own parts betray it.
    from ablate.receipts import derive

    st = data["steps"]
    st["cadence_s"] = [c * 0.5 if label == "steady" else c for c, label in zip(st["cadence_s"], st["labels"])]
    steps = [derive.Step(phase=p, label=lb, step_s=s, data_s=d, cadence_s=c, tokens=t, phase_s=ph)
             for p, lb, s, d, c, t, ph in zip(st["phases"], st["labels"], st["step_s"], st["data_s"],
                                              st["cadence_s"], st["tokens"], st["phase_s"])]
    idle = derive.loop_parts(steps, st["data_is_badput"]).idle_s
    badput = data["time"]["badput_s"]
    badput["teardown"] += badput["idle"] - idle
    badput["idle"] = idle
    data["projection"] = derive.project(badput["setup"], steps, int(data["requested"]["lane"]["budget.horizon_steps"]),
                                        data["requested"]["tokens_per_step"]).to_dict()


def _relabel(data: dict[str, Any]) -> None:
    data["steps"]["labels"][0] = "steady"  # the explicit warmup step passed off as a steady one


def _unexplained(data: dict[str, Any]) -> None:
    # 10% of wall that no measured part explains on an arm that finished.
    extra = 0.1 * data["time"]["wall_s"]
    data["time"]["wall_s"] += extra
    data["time"]["badput_s"]["unattributed"] += extra
    data["time"]["goodput_fraction"] = data["time"]["goodput_s"] / data["time"]["wall_s"]
    data["throughput"]["wall_tokens_per_s"] = data["throughput"]["tokens"] / data["time"]["wall_s"]


def _no_tokens(data: dict[str, Any]) -> None:
    # A run that trained nothing, with every figure made consistent with that: still not a valid arm.
    data["steps"]["tokens"] = [0 for _ in data["steps"]["tokens"]]
    data["throughput"].update(tokens=0, wall_tokens_per_s=0.0, steady_tokens_per_s=0.0)
    data["projection"]["tokens_per_s"] = 0.0


FORGERIES = {
    "wall tokens/s raised 4%": (_scale("throughput.wall_tokens_per_s", 1.04), "throughput.wall_tokens_per_s"),
    "projected tokens/s raised 4%": (_scale("projection.tokens_per_s", 1.04), "projection.tokens_per_s"),
    "projected time cut": (_scale("projection.projected_s", 0.9), "projection.projected_s"),
    "steady tokens/s raised": (_scale("throughput.steady_tokens_per_s", 1.1), "throughput.steady_tokens_per_s"),
    "goodput moved out of unattributed": (_move_time, "goodput"),
    "step cadences shortened": (_faster_steps, "projection"),
    "steady cadences below their own compute, every derived figure agreeing": (_cadence_below_compute,
                                                                                "steps.cadence_s is shorter"),
    "warmup step relabelled steady": (_relabel, "steps.labels"),
    "unexplained wall time": (_unexplained, "unattributed"),
    "no tokens": (_no_tokens, "tokens_per_step"),
    "created_at not a date": (lambda d: d["identity"].__setitem__("created_at", "not-a-date"), "created_at"),
    "non-finite step time": (lambda d: d["steps"]["step_s"].__setitem__(3, float("nan")), "finite"),
    "pre-horizon schema": (lambda d: d.__setitem__("schema_version", "1.1.0"), "re-run the campaign"),
    # Issue 17: figures no measurement produces are refused by name, before any arithmetic could crash on them.
    "tokens: 0": (lambda d: d["throughput"].__setitem__("tokens", 0), "throughput.tokens is 0"),
    "Infinity wall tokens/s": (lambda d: d["throughput"].__setitem__("wall_tokens_per_s", float("inf")),
                               "throughput.wall_tokens_per_s is inf"),
    "NaN projected tokens/s": (lambda d: d["projection"].__setitem__("tokens_per_s", float("nan")),
                               "projection.tokens_per_s is nan"),
    "NaN in a diagnostic figure": (lambda d: d["throughput"].__setitem__("mfu", float("nan")), "throughput.mfu"),
    # An int beyond float range beside the NaN: named like any other NaN, never an OverflowError while naming it.
    "NaN beside a huge int": (lambda d: (d["throughput"].__setitem__("mfu", float("nan")),
                                         d["observed"]["compile"].__setitem__("graph_breaks", 10**400)),
                              "throughput.mfu is nan"),
    "negative projected tokens/s": (_scale("projection.tokens_per_s", -1.0), "never negative"),
    "negative step time": (lambda d: d["steps"]["step_s"].__setitem__(1, -0.1), "steps.step_s[1]"),
    "negative graph breaks": (lambda d: d["observed"]["compile"].__setitem__("graph_breaks", -1),
                              "observed.compile.graph_breaks"),
    "family share above 1": (lambda d: d["family_share"].__setitem__("E", 1.5), "at most 1"),
    "created_at without UTC offset": (lambda d: d["identity"].__setitem__("created_at", "2026-03-02T09:00:00"),
                                      "UTC offset"),
    "created_at a bare date": (lambda d: d["identity"].__setitem__("created_at", "2026-03-02"), "UTC offset"),
    "created_at in another zone": (lambda d: d["identity"].__setitem__("created_at", "2026-03-02T11:00:00+02:00"),
                                   "UTC offset"),
    "created_at in the future": (lambda d: d["identity"].__setitem__("created_at", "2999-01-01T00:00:00+00:00"),
                                 "in the future"),
}


def test_the_honest_receipt_validates(good: dict[str, Any]) -> None:
    receipt = validate_receipt(copy.deepcopy(good))
    assert receipt.projection is not None and receipt.projection.tokens_per_s > 0


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_a_forged_or_incoherent_figure_is_refused_by_name(good: dict[str, Any], case: str) -> None:
    edit, fragment = FORGERIES[case]
    data = copy.deepcopy(good)
    edit(data)
    with pytest.raises(InvalidReceipt, match=None) as info:
        validate_receipt(data)
    assert fragment in str(info.value), str(info.value)


def _disqualified(data: dict[str, Any], code: str) -> None:
    data["identity"]["status"] = "disqualified"
    data["disqualifiers"].append({"code": code, "severity": "fatal", "detail": "as the trainer words it",
                                  "step": None})


def test_an_arm_that_declares_its_unattributed_time_is_kept_as_a_disqualified_arm(good: dict[str, Any]) -> None:
    # The trainer disqualifies an arm whose wall time it cannot explain; refusing that receipt too dropped the arm
    # from the evidence and left its block without an answer (seen on 8 of 1,000 simulated blocks under load).
    data = copy.deepcopy(good)
    _unexplained(data)
    _disqualified(data, "TIME_ACCOUNTING_VIOLATION")
    receipt = validate_receipt(data)
    assert receipt.identity.status.value == "disqualified" and "TIME_ACCOUNTING_VIOLATION" in receipt.fatal_codes()


@pytest.mark.parametrize(("status", "code", "edit", "fragment"), [
    ("valid", None, _unexplained, "unattributed"),                                     # no declaration
    ("disqualified", "INERT_TOGGLE", _unexplained, "unattributed"),                    # another reason
    ("disqualified", "TIME_ACCOUNTING_VIOLATION", _move_time, "goodput"),              # parts still must add up
])
def test_only_the_declared_violation_waives_only_the_unattributed_limit(
        good: dict[str, Any], status: str, code: Any, edit: Callable[[dict[str, Any]], None], fragment: str) -> None:
    data = copy.deepcopy(good)
    edit(data)
    if code is not None:
        _disqualified(data, code)
    data["identity"]["status"] = status
    with pytest.raises(InvalidReceipt) as info:
        validate_receipt(data)
    assert fragment in str(info.value), str(info.value)


def _recompile_in_steady_state(data: dict[str, Any]) -> None:
    """Budget step 3 compiled again after warmup: its label becomes ``recompile`` and every figure is re-derived
    from the records, as an honest trainer would write them, except the disqualifier and its counter."""
    from ablate.receipts import derive

    st, badput = data["steps"], data["time"]["badput_s"]
    st["compile_events"][4] = 1
    st["labels"] = derive.classify(st["phases"], st["compile_events"], st["sampled"],
                                   data["observed"]["compile"]["warmup_resolved"])
    steps = [derive.Step(phase=p, label=lb, step_s=s, data_s=x, cadence_s=c, tokens=t, phase_s=ph)
             for p, lb, s, x, c, t, ph in zip(st["phases"], st["labels"], st["step_s"], st["data_s"],
                                              st["cadence_s"], st["tokens"], st["phase_s"])]
    parts = derive.loop_parts(steps, st["data_is_badput"])
    moved = (data["time"]["goodput_s"] - parts.goodput_s) + (badput["sampling"] - parts.sampling_s)
    data["time"]["goodput_s"] = parts.goodput_s
    badput.update(recompile=parts.recompile_s, sampling=parts.sampling_s, compile_warmup=parts.compile_warmup_s,
                  idle=parts.idle_s)
    badput["unattributed"] += moved - parts.recompile_s
    data["time"]["goodput_fraction"] = parts.goodput_s / data["time"]["wall_s"]
    steady = [s for s in steps if s.label == "steady"]
    st["steady"] = len(steady)
    st.update(derive.step_statistics([s.step_s for s in steady]))
    data["throughput"]["steady_tokens_per_s"] = sum(s.tokens for s in steady) / sum(s.step_s for s in steady)
    data["projection"] = derive.project(badput["setup"], steps, data["projection"]["horizon_steps"],
                                        data["requested"]["tokens_per_step"]).to_dict()


def test_a_valid_receipt_whose_records_show_a_disqualifier_is_refused(good: dict[str, Any]) -> None:
    """The codes and counters are the trainer's word, the per-step records the measurement (measurement review):
    a 'valid' arm with a steady-state recompile in its records, or a steady window below the lane's
    min_steady_steps, paired into blocks as evidence."""
    recompiled = copy.deepcopy(good)
    _recompile_in_steady_state(recompiled)
    with pytest.raises(InvalidReceipt, match="recompiles_in_steady_state is 0"):
        validate_receipt(recompiled)
    recompiled["observed"]["compile"]["recompiles_in_steady_state"] = None  # no compile counters on this host
    with pytest.raises(InvalidReceipt, match="a valid arm's steps carry 1 compile event"):
        validate_receipt(recompiled)
    # The same records with the trainer's own disqualifier and counter validate, as a disqualified arm.
    honest = copy.deepcopy(recompiled)
    honest["observed"]["compile"]["recompiles_in_steady_state"] = 1
    honest["identity"]["status"] = "disqualified"
    honest["disqualifiers"] = [{"code": "RECOMPILE_IN_STEADY_STATE", "severity": "fatal", "detail": "1 event"}]
    assert validate_receipt(honest).identity.status.value == "disqualified"
    counted_wrong = copy.deepcopy(honest)
    counted_wrong["observed"]["compile"]["recompiles_in_steady_state"] = 0
    with pytest.raises(InvalidReceipt, match="recompiles_in_steady_state is 0"):
        validate_receipt(counted_wrong)
    with pytest.raises(InvalidReceipt, match="steady step"):
        make_receipt(receipt_id="r2", sweep_id="s1", block_id="b1", arm="candidate", arm_index=1, order=0,
                     feature="moe_dispatch", feature_value="jagged", baseline_value="padded",
                     lane=base_lane(**{"features.moe_dispatch": "jagged"}), host="node-0", tps=5000.0, loss=5.0,
                     created_at=T0, steps=2)
