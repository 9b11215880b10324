"""The promotion rule's shortcuts give exactly what the paths they skip give.

- ``match._unregistered_scalar`` (a memo keyed on type and value) answers as ``match._unregistered`` on the
  value's JSON, for every plain scalar a receipt can state, including the coercions OmegaConf would accept;
- ``engine._validated`` dumps receipts only when an id has several copies, and still keeps identical copies
  once and refuses differing ones;
- ``schema._all_finite`` and ``schema._none_negative`` (C-speed checks of whole lists) answer as the number by
  number walk they replace, on any tree of numbers, NaN, infinities, huge integers, bools, strings and None;
- ``schema.validate_decoded`` (the figure checks read a payload that is the receipt's own JSON instead of a dump of
  the model, and skip the walk for NaN there) accepts and refuses exactly as ``validate_receipt``, with the same
  reason, whatever number is edited in, as a model value or as text;
- ``bulk_read._parsed`` (a payload that is its model's own JSON decoded by orjson) accepts, refuses and says
  "own JSON" exactly as ``json.loads`` and the checks did, on own JSON, other spellings and odd JSON text;
- ``report._json_ready`` (the report's JSON data in one pass) gives what ``dataclasses.asdict`` followed by the
  walk that made inf and NaN null gave, on any tree of dataclasses, dicts, lists, tuples and scalars.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from promote_sim import Sim, moe, simulate

from ablate.promote import engine, match, report
from ablate.receipts import schema
from ablate.receipts.store import seal

VALUES: list[tuple[str, Any]] = [
    ("moe_dispatch", "jagged"), ("moe_dispatch", "MoEDispatch.jagged"), ("moe_dispatch", "padded\n## x"),
    ("moe_dispatch", None), ("moe_dispatch", 1), ("moe_dispatch", True),
    ("fused_residual", True), ("fused_residual", False), ("fused_residual", "true"), ("fused_residual", 1),
    ("fused_residual", 0), ("fused_residual", "on"), ("fused_residual", None),
    ("bucket_cap_mb", 25), ("bucket_cap_mb", "25"), ("bucket_cap_mb", True), ("bucket_cap_mb", -3),
    ("overlap_comm", True), ("overlap_comm", 1), ("overlap_comm", "True"),
    ("compile", "off"), ("compile", ""), ("warmup", 0), ("warmup", False),
]


@pytest.mark.parametrize(("name", "value"), VALUES, ids=[f"{n}={v!r}" for n, v in VALUES])
def test_scalar_memo_answers_as_the_json_path(name: str, value: Any) -> None:
    expected = match._unregistered(name, json.dumps(value, sort_keys=True, allow_nan=False))
    assert match._unregistered_scalar(name, type(value), value) == expected


def test_true_and_one_are_never_one_memo_entry() -> None:
    # True == 1 and hash(True) == hash(1): only the type in the key keeps their answers apart.
    answers = {v: match._unregistered_scalar("fused_residual", type(v), v) for v in (True, 1)}
    assert answers[True] == match._unregistered("fused_residual", "true")
    assert answers[1] == match._unregistered("fused_residual", "1")


def _receipts() -> list[Any]:
    return [seal(r) for r in simulate(Sim(features=[moe(1.05)], hosts=2, blocks_per_host=2), seed=11)]


def test_unregistered_values_unchanged_for_lanes_with_coerced_values() -> None:
    receipt = _receipts()[0]
    for value in (True, 1, "1", None, "jagged", 2.5, float("nan"), [1, 2], {"a": 1}):
        lane = {**receipt.requested.lane, "features.moe_dispatch": value}
        changed = receipt.model_copy(update={"requested": receipt.requested.model_copy(update={"lane": lane})})
        problems = match.unregistered_values(changed)
        want = []
        try:
            encoded = json.dumps(value, sort_keys=True, allow_nan=False)
            allowed = match._unregistered("moe_dispatch", encoded)
            if allowed is not None:
                want.append(f"requested.lane['features.moe_dispatch'] = {value!r} is not a registered value of "
                            f"moe_dispatch (allowed: {allowed})")
        except ValueError:
            want.append(f"requested.lane['features.moe_dispatch'] = {value!r} is not a registered value of "
                        f"moe_dispatch")
        assert [p for p in problems if "features.moe_dispatch" in p] == want


def test_validated_keeps_identical_copies_once_and_refuses_differing_ones() -> None:
    receipts = _receipts()
    first, second = receipts[0], receipts[1]
    twin = first.model_copy(deep=True)
    other = second.model_copy(update={"quality": second.quality.model_copy(update={"loss_final": 0.123})})
    valid, rejected = engine._validated(receipts + [twin, other])
    ids = [r.identity.receipt_id for r in valid]
    assert ids.count(first.identity.receipt_id) == 1 and second.identity.receipt_id not in ids
    assert len(valid) == len(receipts) - 1
    assert [rid for rid, _ in rejected] == [second.identity.receipt_id] * 2
    assert all("conflicting copies" in why for _, why in rejected)


def _reference_numbers(node: Any) -> list[float]:
    # The walk figure_errors made before its shortcuts: every number, bools, strings and None excluded.
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return []
    if isinstance(node, (int, float)):
        return [node]
    if isinstance(node, dict):
        return [x for v in node.values() for x in _reference_numbers(v)]
    return [x for v in node for x in _reference_numbers(v)]


_SCALARS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-10**400, max_value=10**400),
                     st.booleans(), st.none(), st.text(max_size=3),
                     st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324, float("inf"), float("-inf"), float("nan")]))
_TREES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                         st.dictionaries(st.text(max_size=2), inner, max_size=4)),
                      max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(_TREES)
def test_number_shortcuts_answer_as_the_number_by_number_walk(tree: Any) -> None:
    numbers = _reference_numbers(tree)
    # An int is finite however large (math.isfinite would raise converting 10**400 to a float).
    finite = all(isinstance(v, int) or math.isfinite(v) for v in numbers)
    assert schema._all_finite(tree) == finite
    if finite:  # figure_errors asks about signs only once every number is known to be finite
        assert schema._none_negative(tree) == all(v >= 0 for v in numbers)


@pytest.mark.parametrize(("series", "finite", "non_negative"), [
    ([1.0, 2.0, float("nan")], False, None), ([float("inf"), float("-inf")], False, None),
    ([1e308, 1e308, 1e308], True, True), ([0.5, None, -1.0], True, False), ([[0.5], [-0.5]], True, False),
    ([3, True, 0.0], True, True), ([10**400, -1], True, False), ([], True, True),
])
def test_number_shortcuts_on_per_step_series(series: list[Any], finite: bool, non_negative: Any) -> None:
    assert schema._all_finite({"steps": {"series": series}}) is finite
    if non_negative is not None:
        assert schema._none_negative({"series": series}) is non_negative


@pytest.mark.parametrize("hosts", [1, 3])
def test_leaving_the_curves_out_changes_nothing_but_the_curves(hosts: int) -> None:
    """``promote(curves=False)`` (the until-decided judge's looks) decides exactly as the full report: the curve
    draws from a stream of its own, so skipping it moves no other bootstrap (loss bounds included)."""
    from datetime import datetime, timezone
    from pathlib import Path

    from ablate.promote.policy import load_policy

    # Paths spelled here: another directory's conftest may own the name `conftest` in a whole-suite run.
    repo = Path(__file__).resolve().parents[2]
    DEFAULTS = repo / "search_spaces" / "defaults.yaml"
    SINGLE_NODE_POLICY = repo / "search_spaces" / "policies" / "single_node.yaml"

    receipts = [seal(r) for r in simulate(Sim(features=[moe(1.06)], hosts=hosts, blocks_per_host=4, rounds=2),
                                          seed=3)]
    policy = load_policy(SINGLE_NODE_POLICY, overrides={"bootstrap.resamples": 400, "bootstrap.loss_resamples": 200})
    now = datetime(2026, 11, 23, tzinfo=timezone.utc)
    full = engine.promote(receipts, policy_path=policy, defaults_path=DEFAULTS, now=now)
    light = engine.promote(receipts, policy_path=policy, defaults_path=DEFAULTS, now=now, curves=False)
    assert full.speed_verdicts and all(v.curve for v in full.verdicts if v.n_blocks)
    assert all(v.curve == [] for v in light.verdicts)
    assert any(v.loss_bounds is not None for v in full.verdicts), "the loss bootstrap ran after the curve's place"
    without_curves = json.loads(full.to_json())
    for section in ("verdicts", "taxes"):
        for verdict in without_curves[section]:
            verdict["curve"] = []
    assert without_curves == json.loads(light.to_json())


def _reference_curve(rows: list, horizon: int, policy: Any, clusters: Any, rng: Any) -> list[dict[str, float]]:
    """The curve point by point, as ``analysis._curve`` computed it before its projections were taken at once:
    ``Block.log_ratio`` per block and horizon, ``hodges_lehmann`` and ``bootstrap_hl`` each on their own."""
    import numpy as np

    from ablate.promote.analysis import CURVE_POINTS, CURVE_RESAMPLES
    from ablate.promote.stats import bootstrap_hl, hodges_lehmann, quantile

    if not rows or horizon <= 0:
        return []
    grid = sorted({int(round(h)) for h in np.geomspace(1, 10 * horizon, CURVE_POINTS)} | {horizon})
    out = []
    for h in grid:
        d = np.asarray([b.log_ratio(policy.failures.failed_log_ratio, h) for b, _ in rows], dtype=float)
        if not np.all(np.isfinite(d)):
            continue
        theta = bootstrap_hl(d, clusters, CURVE_RESAMPLES, rng)
        out.append({"horizon": float(h), "speedup": math.exp(hodges_lehmann(d)),
                    "lo": math.exp(quantile(theta, 0.05)), "hi": math.exp(quantile(theta, 0.95))})
    return out


@pytest.mark.parametrize("hosts", [1, 3])
def test_the_curve_is_its_point_by_point_twin(hosts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same projections (the same float operations), same ``math.log``, same Walsh averages and bootstrap draws:
    every curve of a campaign equals the one the per-block path draws, number for number."""
    from datetime import datetime, timezone
    from pathlib import Path

    from ablate.promote import analysis
    from ablate.promote.policy import load_policy
    from promote_sim import FeatureTruth

    repo = Path(__file__).resolve().parents[2]
    policy = load_policy(repo / "search_spaces" / "policies" / "single_node.yaml",
                         overrides={"bootstrap.resamples": 200, "bootstrap.loss_resamples": 100})
    # A compile-like one-time cost makes the curve cross 1 within the grid (small horizons lose, large ones win).
    truth = FeatureTruth("moe_dispatch", "jagged", "padded", ratio=1.05, one_time_s=4.0)
    receipts = [seal(r) for r in simulate(Sim(features=[truth], hosts=hosts, blocks_per_host=4, rounds=2,
                                              horizon=2_000), seed=5)]
    now = datetime(2026, 11, 25, tzinfo=timezone.utc)

    def curves() -> list[Any]:
        result = engine.promote(receipts, policy_path=policy, defaults_path=repo / "search_spaces" / "defaults.yaml",
                                now=now)
        return [v.curve for v in result.verdicts]

    fast = curves()
    monkeypatch.setattr(analysis, "_curve", _reference_curve)
    reference = curves()
    assert any(len(c) > 10 for c in fast)
    assert any(min(p["speedup"] for p in c) < 1.0 < max(p["speedup"] for p in c) for c in fast if c)
    assert fast == reference


def test_log_ratios_at_answers_as_log_ratio_for_every_kind_of_arm() -> None:
    """Failed arms (either side), projections that are None (no one-time or recurring figure, a non-positive
    step), warm budgets past the horizon, NaN figures: ``log_ratios_at`` holds ``Block.log_ratio`` of each block at
    each horizon, NaN where that is None or NaN."""
    import dataclasses

    import numpy as np

    from ablate.promote.analysis import log_ratios_at
    from ablate.promote.policy import load_policy
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    policy = load_policy(repo / "search_spaces" / "policies" / "default.yaml")
    blocks, _ = match.match_blocks(_receipts(), policy)
    assert blocks
    block = blocks[0]
    edits: list[dict[str, Any]] = [
        {}, {"status": "failed"}, {"one_time_s": None}, {"recurring_step_s": None}, {"recurring_step_s": 0.0},
        {"recurring_step_s": -0.1}, {"warm_budget_steps": 5_000}, {"one_time_s": float("nan")},
        {"recurring_step_s": float("nan")}, {"one_time_s": 0.0, "warm_budget_steps": 10**6},
    ]
    variants = []
    for side in ("baseline", "candidate"):
        for edit in edits:
            arm = dataclasses.replace(getattr(block, side), **edit)
            variants.append(dataclasses.replace(block, **{side: arm}))
    horizons = [1, 2, 7, 100, 4_999, 5_000, 5_001, 10**6, 10**7]
    failed = -0.7
    got = log_ratios_at(variants, failed, horizons)
    for row, h in zip(got, horizons):
        for value, variant in zip(row, variants):
            want = variant.log_ratio(failed, h)
            if want is None or math.isnan(want):
                assert math.isnan(value), (h, variant.baseline, variant.candidate)
            else:
                assert value == want, (h, variant.baseline, variant.candidate)
    assert np.isnan(got).any() and (got == failed).any() and np.isfinite(got).sum() > len(horizons)


def test_a_measurement_key_is_its_four_series_exactly() -> None:
    """``match._measurement_key`` (digest of the series' float bytes, after their lengths): equal for a receipt filed
    again under another id, different when one step differs by one ulp or a value moves from one series to the
    next (the lengths keep the series apart); None below two positive steps."""
    receipt = _receipts()[0]
    steps = receipt.steps

    def with_steps(**series: list[float]) -> Any:
        return receipt.model_copy(update={"steps": steps.model_copy(update=series)})

    key = match._measurement_key(receipt)
    assert key is not None
    refiled = receipt.model_copy(update={"identity": receipt.identity.model_copy(update={"receipt_id": "copy"})})
    assert match._measurement_key(refiled) == key
    nudged = list(steps.step_s)
    nudged[1] = math.nextafter(nudged[1], math.inf)
    assert match._measurement_key(with_steps(step_s=nudged)) != key
    joined = with_steps(step_s=list(steps.step_s) + [1.0], cadence_s=[], data_s=[], phase_s=[])
    moved = with_steps(step_s=list(steps.step_s), cadence_s=[1.0], data_s=[], phase_s=[])
    assert match._measurement_key(joined) != match._measurement_key(moved)
    assert match._measurement_key(with_steps(step_s=[0.5, 0.0, 0.0])) is None


@dataclasses.dataclass
class _Leafy:
    number: Any
    pair: tuple[Any, ...] = ()


@dataclasses.dataclass
class _Nested:
    items: list[Any]
    table: dict[Any, Any]
    leafy: _Leafy


def _finite_walk(value: Any) -> Any:
    """The report's former pass over ``asdict``'s result: inf and NaN as null, keys as strings, tuples as lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite_walk(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_walk(v) for v in value]
    return value


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                     st.text(max_size=4))
_leafy = st.builds(_Leafy, _scalars, st.tuples(_scalars, _scalars))
_values = st.recursive(st.one_of(_scalars, _leafy), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner, inner),
    st.dictionaries(st.one_of(st.text(max_size=3), st.integers(), st.booleans()), inner, max_size=3)), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.builds(_Nested, st.lists(_values, max_size=4), st.dictionaries(st.text(max_size=3), _values, max_size=3),
                 _leafy))
def test_json_ready_gives_what_asdict_and_the_finite_walk_gave(tree: _Nested) -> None:
    expected = _finite_walk(dataclasses.asdict(tree))
    got = report._json_ready(tree)
    assert json.dumps(got, allow_nan=False) == json.dumps(expected, allow_nan=False)
    assert report._json_ready({"list": [tree, (tree.leafy,)]}) == _finite_walk(
        {"list": [dataclasses.asdict(tree), [dataclasses.asdict(tree.leafy)]]})


def _number_paths(node: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(node, bool) or node is None or isinstance(node, str):
        return []
    if isinstance(node, (int, float)):
        return [path]
    items = node.items() if isinstance(node, dict) else enumerate(node)
    return [p for key, value in items for p in _number_paths(value, (*path, key))]


def _set(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _outcome(check: Any) -> tuple[str, Any]:
    try:
        return "ok", check().model_dump_json()
    except schema.InvalidReceipt as exc:
        return "refused", str(exc)


_EDITS = st.sampled_from([-1, -0.5, -1e-9, 0, -0.0, 2.5, 10**30, 2**63, 2**64, 10**22, True, False, float("nan"),
                          float("inf"), float("-inf"), 1e308, 1e-05, 5e-324])


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_own_json_shortcut_refuses_and_accepts_as_validate_receipt(data: Any) -> None:
    receipt = _receipts()[data.draw(st.integers(0, 3))]
    own = json.loads(receipt.model_dump_json())
    paths = _number_paths(own)
    path = data.draw(st.sampled_from(paths), label="path")
    value = data.draw(_EDITS, label="value")
    as_text = data.draw(st.booleans(), label="as_text")
    edited = json.loads(json.dumps(own))
    _set(edited, path, value)
    if as_text:  # a writer's text that is not the model's own JSON (NaN and Infinity tokens included)
        source = json.dumps(edited, separators=(",", ":")).encode()
    else:  # a model holding the number, sealed: its own JSON is what a writer logs
        try:
            model = schema.Receipt.model_validate(edited)
        except Exception:  # noqa: BLE001 - a type the schema refuses: nothing a model can hold
            return
        source = seal(model.model_copy(update={"digest": None})).model_dump_json().encode()
    decoded = json.loads(source)
    reference = _outcome(lambda: schema.validate_receipt(json.loads(source)))
    got = _outcome(lambda: schema.validate_decoded(decoded, source)[0])
    assert got == reference
    if reference[0] == "ok":
        model = schema.validate_receipt(json.loads(source))
        assert schema.validate_decoded(json.loads(source), source)[1] is (model.model_dump_json().encode() == source)


def test_real_payloads_take_the_shortcut_and_one_utf8_cannot_hold_does_not() -> None:
    """What every writer logs is the model's own JSON, so the shortcut is what the tests above exercise; a string
    JSON can escape but UTF-8 cannot encode (a lone surrogate) is checked as before, not refused as unserializable."""
    for receipt in _receipts():
        source = receipt.model_dump_json().encode()
        assert schema.validate_decoded(json.loads(source), source)[1] is True
    raw = json.loads(_receipts()[0].model_dump_json())
    raw["identity"]["host"] = "h\ud800"
    source = json.dumps(raw).encode()  # the surrogate escaped: valid JSON, ASCII bytes
    got, own = schema.validate_decoded(json.loads(source), source)
    assert own is False
    assert got.model_dump() == schema.validate_receipt(json.loads(source)).model_dump()


def test_own_json_holds_no_token_that_decodes_to_nan_or_infinity() -> None:
    """What the shortcut rests on: a model holding NaN or infinities writes null, so a payload with such a number
    is never the model's own JSON and goes through the walk that names it."""
    receipt = _receipts()[0]
    key = next(iter(receipt.family_share))
    for bad in (float("nan"), float("inf"), float("-inf")):
        model = receipt.model_copy(update={"family_share": {**receipt.family_share, key: bad}})
        text = model.model_dump_json()
        assert f'"{key}":null' in text and all(map(math.isfinite, (x for x in _floats(json.loads(text)))))
        source = text.replace(f'"{key}":null', f'"{key}":{json.dumps(bad)}').encode()
        with pytest.raises(schema.InvalidReceipt, match=f"family_share.{key} is {bad!r}: a receipt holds finite"):
            schema.validate_decoded(json.loads(source), source)


def _floats(node: Any) -> list[float]:
    return [v for v in _reference_numbers(node) if isinstance(v, float)]


def _reference_parsed(source: bytes) -> tuple[str, Any, Any]:
    """What ``bulk_read._parsed`` gave before orjson: ``json.loads``, the checks, the digest."""
    from ablate.receipts.store import digest_problem

    try:
        raw = json.loads(source)
        receipt, own = schema.validate_decoded(raw, source)
        problem = digest_problem(raw)
        if problem:
            raise schema.InvalidReceipt(problem)
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return "refused", type(exc).__name__, str(exc)
    return "ok", receipt.model_dump_json(), own


def _parsed_outcome(source: bytes) -> tuple[str, Any, Any]:
    from ablate.tracking import bulk_read

    try:
        receipt, own = bulk_read._parsed(source)
    except Exception as exc:  # noqa: BLE001
        return "refused", type(exc).__name__, str(exc)
    return "ok", receipt.model_dump_json(), own


def _odd(source: bytes, how: str) -> bytes:
    """``source`` (a model's own JSON) made into text where orjson and json.loads may read differently."""
    text = source.decode()
    if how == "duplicate key":  # json.loads keeps the last
        return (text[:-1] + ',"schema_version":"9.0.0"}').encode()
    if how == "duplicate key, same value":
        return ('{"schema_version":' + json.dumps(json.loads(text)["schema_version"]) + "," + text[1:]).encode()
    if how == "byte-order mark":
        return b"\xef\xbb\xbf" + source
    if how == "lone surrogate":
        return text.replace('"host":"', '"host":"\\ud800', 1).encode()
    if how == "escaped ascii":  # the host's first character spelled as an escape
        host = json.loads(text)["identity"]["host"]
        if not host:
            return source
        return text.replace('"host":' + json.dumps(host), '"host":"\\u%04x' % ord(host[0]) + json.dumps(host)[2:],
                            1).encode()
    if how == "raw non-ascii":
        return text.replace('"host":"', '"host":"h\u00e9\u2603', 1).encode()
    if how == "control character":
        return text.replace('"host":"', '"host":"\x01', 1).encode()
    if how in ("huge exponent", "huge integer", "2**64 in the lane", "1e22 in a float"):
        raw = json.loads(text)
        if how == "1e22 in a float":
            raw["time"]["wall_s"] = 10**22
        else:
            raw["requested"]["lane"]["odd"] = {"huge exponent": "1e400", "huge integer": "9" * 40}.get(how, 2**64)
        digest = raw.pop("digest", None)
        from ablate.receipts.store import content_digest

        raw["digest"] = content_digest(raw) if digest is not None else None  # re-sealed: only the reading differs
        body = json.dumps(raw, separators=(",", ":"), ensure_ascii=False)
        return body.replace('"1e400"', "1e400").replace('"' + "9" * 40 + '"', "9" * 40).encode()
    if how == "spaces":
        return json.dumps(json.loads(text)).encode()
    if how == "edited, digest kept":
        return text.replace('"loss_final":', '"loss_final":0.001,"z":', 1).encode()
    raise AssertionError(how)


_ODD = ["duplicate key", "duplicate key, same value", "byte-order mark", "lone surrogate", "escaped ascii",
        "raw non-ascii", "control character", "huge exponent", "huge integer", "2**64 in the lane", "1e22 in a float",
        "spaces", "edited, digest kept"]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_orjson_reading_of_own_json_changes_no_verdict_and_no_reason(data: Any) -> None:
    receipt = _receipts()[data.draw(st.integers(0, 3))]
    own = json.loads(receipt.model_dump_json())
    edited = json.loads(json.dumps(own))
    if data.draw(st.booleans(), label="edit a number"):
        _set(edited, data.draw(st.sampled_from(_number_paths(own)), label="path"), data.draw(_EDITS, label="value"))
    host = data.draw(st.text(max_size=6), label="host")  # any code point, control characters included
    edited["identity"]["host"] = host
    try:
        sealed = seal(schema.Receipt.model_validate(edited).model_copy(update={"digest": None}))
        if data.draw(st.booleans(), label="edited after sealing"):  # its own JSON, and a digest that fails
            sealed = sealed.model_copy(update={"identity": sealed.identity.model_copy(update={"host": host + "x"})})
        source = sealed.model_dump_json().encode()
    except Exception:  # noqa: BLE001 - a value no model holds, or a string UTF-8 cannot encode: as a writer's text
        source = json.dumps(edited, separators=(",", ":")).encode()
    how = data.draw(st.sampled_from([None, *_ODD]), label="odd")
    if how is not None:
        source = _odd(source, how)
    assert _parsed_outcome(source) == _reference_parsed(source)


def test_real_payloads_are_read_by_orjson_and_odd_text_by_json_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.tracking import bulk_read

    read: list[bytes] = []
    real = bulk_read.orjson.loads
    monkeypatch.setattr(bulk_read.orjson, "loads", lambda source: read.append(source) or real(source))
    source = _receipts()[0].model_dump_json().encode()
    assert _parsed_outcome(source) == _reference_parsed(source) and _parsed_outcome(source)[2] is True
    assert read == [source, source], "the model's own JSON took the orjson path, once per call"
    assert bulk_read._own_json_receipt(source) is not None, "and its reading was the one used"
    for how in _ODD:
        odd = _odd(source, how)
        assert _parsed_outcome(odd) == _reference_parsed(odd), how
        assert _parsed_outcome(odd)[2] is not True, f"{how}: never the model's own JSON"
