"""Hostile and broken input (issue 17): refused before any trial, as one line naming the key, the value and what
is allowed; never a traceback, never minutes of work first.

Grouped by theme: lane values, campaign structure, planning bounds, YAML itself, policy files, and the CLI
boundary (in-process through ``ablate.cli.main``, what the ``ablate`` script runs before it ends the process).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ablate.config import load
from ablate.config.load import MAX_ALIAS_NODES, flatten, lane_to_dict, load_sweep, read_yaml, structured
from ablate.config.pattern import MAX_LAYERS, parse_pattern
from ablate.config.schema import MAX_BLOCKS, ConfigError, LaneConfig, SweepConfig
from ablate.promote.policy import EXACT_COUNTERS, QUALITY_METRICS, Policy, load_policy, with_overrides
from ablate.sweep import plan as plan_module
from ablate.sweep.plan import MAX_PLANNED_BLOCKS, plan_sweep

REPO = Path(__file__).resolve().parents[1]
POLICIES = REPO / "search_spaces" / "policies"
SMOKE_RECEIPTS = REPO / "tests" / "promote" / "assets" / "smoke_run" / "receipts"
CORPUS = REPO / "tests" / "assets" / "corpus"
JAGGED = "features: {moe_dispatch: [jagged]}\n"


def _campaign(tmp_path: Path, text: str | bytes, name: str = "campaign.yaml") -> Path:
    shutil.copy(REPO / "search_spaces" / "defaults.yaml", tmp_path / "defaults.yaml")
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _refused(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        sweep, defaults = load_sweep(path)
        plan_sweep(sweep, "t", defaults)
    return info.value


# --- lane values: non-finite and out-of-range numbers ---

FLOAT_LEAVES = sorted(key for key, hint in (
    (key, load._field_type(LaneConfig, key)) for key in flatten(lane_to_dict(LaneConfig()))) if hint is float)


def _nest(dotted: str, value: object) -> dict:
    root: dict = {}
    node = root
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return root


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FLOAT_LEAVES), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_non_finite_float_anywhere_in_the_lane_is_refused_by_key(dotted: str, value: float) -> None:
    # YAML writes these as .nan / .inf; every comparison with NaN is False, so `lr > 0` alone let it through.
    assert {"budget.lr", "model.capacity_factor", "model.norm_eps", "model.rope_theta"} <= set(FLOAT_LEAVES)
    with pytest.raises(ConfigError) as info:
        structured(SweepConfig, {"lane": _nest(dotted, value)})
    assert info.value.key == f"lane.{dotted}", str(info.value)
    assert "finite" in info.value.allowed


@pytest.mark.parametrize(("lane", "key", "value", "allowed"), [
    ("{budget: {lr: .nan}}", "lane.budget.lr", "nan", "a finite positive number"),
    ("{model: {capacity_factor: .inf}}", "lane.model.capacity_factor", "inf", "a finite positive number"),
    ("{model: {norm_eps: -1}}", "lane.model.norm_eps", "-1.0", "a finite positive number"),
    ("{hardware: {threads: -4}}", "lane.hardware.threads", "-4", ">= 0"),
    ("{budget: {steps: 4, min_steady_steps: 10}}", "lane.budget.min_steady_steps", "10",
     "at most lane.budget.steps (4)"),
])
def test_bad_lane_values_are_refused_with_key_value_and_allowed(tmp_path: Path, lane: str, key: str, value: str,
                                                                 allowed: str) -> None:
    error = _refused(_campaign(tmp_path, f"name: bad\nlane: {lane}\n{JAGGED}"))
    assert str(error).startswith(f"{key}: got {value}; allowed: "), str(error)
    assert allowed in error.allowed


# --- the layer pattern ---

def test_a_pattern_of_400m_layers_is_refused_before_it_is_expanded() -> None:
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        parse_pattern("AEMR*100000000")
    assert time.perf_counter() - started < 0.5  # counted, not built: the old code allocated 400 M letters
    assert info.value.key == "lane.model.pattern" and f"at most {MAX_LAYERS} layers" in info.value.allowed


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="AEMR", min_size=1, max_size=4), st.integers(1, 10**30))
def test_a_pattern_is_built_only_within_the_layer_bound(letters: str, count: int) -> None:
    try:
        expanded = parse_pattern(f"{letters}*{count}")
    except ConfigError as exc:
        assert exc.key == "lane.model.pattern" and len(letters) * count > MAX_LAYERS
        return
    assert len(expanded) == len(letters) * count <= MAX_LAYERS


def test_a_repeat_count_of_thousands_of_digits_is_read_without_int_overflow() -> None:
    # int() refuses strings over 4300 digits with a ValueError, which surfaced as `<root>`.
    assert parse_pattern("AEMR*" + "0" * 5000 + "2") == "AEMR" * 2
    for count in ("0" * 5000, "9" * 5000):
        with pytest.raises(ConfigError) as info:
            parse_pattern("AEMR*" + count)
        assert info.value.key == "lane.model.pattern"


@settings(max_examples=60, deadline=None)
@given(st.characters(categories=("Nd", "No")).filter(lambda c: c not in "0123456789"))
def test_a_non_ascii_digit_in_a_repeat_blames_the_pattern_key(digit: str) -> None:
    # '²'.isdigit() is True but int('²') raises: the ValueError used to surface as `<root>: got {...whole file}`.
    with pytest.raises(ConfigError) as info:
        structured(SweepConfig, {"lane": {"model": {"pattern": f"AEMR*{digit}"}}})
    assert info.value.key == "lane.model.pattern" and repr(digit) in str(info.value)


def test_superscript_repeat_in_a_campaign_names_the_pattern_key(tmp_path: Path) -> None:
    error = _refused(_campaign(tmp_path, f"name: sup\nlane: {{model: {{pattern: 'AEMR*²'}}}}\n{JAGGED}"))
    assert str(error).startswith("lane.model.pattern: got 'AEMR*²'; allowed: "), str(error)


# --- campaign structure ---

@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "{}\n"])
def test_an_empty_campaign_is_refused(tmp_path: Path, text: str) -> None:
    path = _campaign(tmp_path, text)
    error = _refused(path)
    assert error.key == str(path) and "at least a name" in error.allowed


@pytest.mark.parametrize(("values", "repeated"), [("[jagged, jagged]", "'jagged'"),
                                                  ("[jagged, grouped_mm, jagged]", "'jagged'")])
def test_a_candidate_value_listed_twice_is_refused(tmp_path: Path, values: str, repeated: str) -> None:
    error = _refused(_campaign(tmp_path, f"name: dup\nfeatures: {{moe_dispatch: {values}}}\n"))
    assert str(error).startswith(f"features.moe_dispatch: got {repeated}; allowed: each candidate value once")


def test_the_same_number_written_twice_is_one_value(tmp_path: Path) -> None:
    body = "name: dup\nlane: {engine: {workers: 2}}\nfeatures: {bucket_cap_mb: [100, 100.0]}\n"
    error = _refused(_campaign(tmp_path, body))
    assert error.key == "features.bucket_cap_mb" and "already listed (as 100)" in error.allowed


@pytest.mark.parametrize("name", ["..", ".", "../escape", "a/b", "/abs", "", "-flag", "x..y", "sp ace", "é",
                                  "a" * 101])
def test_a_campaign_name_that_is_not_one_safe_path_component_is_refused(tmp_path: Path, name: str) -> None:
    error = _refused(_campaign(tmp_path, f"name: {json.dumps(name)}\n{JAGGED}"))
    assert error.key == "name" and error.value == name and "no '..'" in error.allowed


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=12))
def test_any_accepted_campaign_name_stays_inside_its_parent_directory(name: str) -> None:
    try:
        sweep = structured(SweepConfig, {"name": name})
    except ConfigError as exc:
        assert exc.key == "name"
        return
    parent = Path("/runs")
    assert (parent / sweep.name).parent == parent and (parent / sweep.name).name == sweep.name
    assert ".." not in sweep.name and sweep.name.isascii()


def test_a_data_glob_matching_nothing_is_refused_at_load_time(tmp_path: Path) -> None:
    empty = tmp_path / "corpus"
    empty.mkdir()
    for path in (f"{empty}/*.txt", str(empty), str(tmp_path / "missing.txt")):
        body = f"name: data\nlane: {{data: {{source: text, path: {json.dumps(path)}}}}}\n{JAGGED}"
        error = _refused(_campaign(tmp_path, body))
        assert error.key == "lane.data.path" and error.value == path and "at least one file" in error.allowed
    good = f"name: data\nlane: {{data: {{source: text, path: {json.dumps(str(CORPUS) + '/*.md')}}}}}\n{JAGGED}"
    assert load_sweep(_campaign(tmp_path, good))[0].lane.data.path.endswith("*.md")


# --- planning: bounded and linear ---

def test_blocks_5000_is_refused_at_once(tmp_path: Path) -> None:
    started = time.perf_counter()
    error = _refused(_campaign(tmp_path, f"name: many\nblocks: 5000\n{JAGGED}"))
    assert time.perf_counter() - started < 5  # the old code planned it for 104 s
    assert str(error).startswith(f"blocks: got 5000; allowed: at most {MAX_BLOCKS:,}")
    error = _refused(_campaign(tmp_path, f"name: many\naa_blocks: 5000\n{JAGGED}"))
    assert error.key == "aa_blocks"


def test_a_grid_whose_contexts_multiply_past_the_bound_is_refused_before_planning(tmp_path: Path,
                                                                                monkeypatch) -> None:
    body = ("name: grid\ndesign: grid\nblocks: 8\n"
            "features: {moe_dispatch: [jagged, grouped_mm], mamba_scan: [chunked, mamba_ssm], "
            "recurrent_scan: [parallel], mla_ingress: [fused], fused_residual: ['on'], compile: [regional, whole], "
            "warmup: [skip, explicit]}\n")
    sweep, defaults = load_sweep(_campaign(tmp_path, body))
    monkeypatch.setattr(plan_module, "_apply", lambda *a: pytest.fail("planned before the size check"))
    with pytest.raises(ConfigError) as info:
        plan_sweep(sweep, "t", defaults)
    assert info.value.key == "blocks" and f"at most {MAX_PLANNED_BLOCKS:,} blocks" in info.value.allowed
    assert "context lane(s)" in info.value.allowed


def test_planning_hashes_each_lane_once_not_once_per_block(tmp_path: Path, monkeypatch) -> None:
    # Hashing a lane types it through OmegaConf (tens of ms): once per block, `blocks: 5000` took minutes.
    body = f"name: linear\nblocks: {MAX_BLOCKS}\naa_blocks: 50\nfeatures: {{moe_dispatch: [jagged, grouped_mm]}}\n"
    sweep, defaults = load_sweep(_campaign(tmp_path, body))
    calls: list[int] = []
    real = plan_module.lane_key
    monkeypatch.setattr(plan_module, "lane_key", lambda lane: calls.append(1) or real(lane))
    plan = plan_sweep(sweep, "t", defaults)
    assert len(plan.blocks) == 2 * MAX_BLOCKS + 50
    assert len(calls) <= 3, len(calls)
    assert {b.lane_key for b in plan.blocks} == {real(sweep.lane)}


# --- YAML itself: encoding and alias bombs ---

BOMB = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                 + [f"{n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]) + "\n"


@pytest.mark.parametrize("kind", ["campaign", "policy"])
def test_an_alias_bomb_is_refused_in_well_under_a_second(tmp_path: Path, kind: str) -> None:
    assert len(BOMB.encode()) < 400  # 9^9 ~ 387 M leaves when expanded
    path = _campaign(tmp_path, BOMB)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_sweep(path) if kind == "campaign" else load_policy(path)
    assert time.perf_counter() - started < 1.0
    assert info.value.key == str(path) and f"at most {MAX_ALIAS_NODES:,} nodes" in info.value.allowed


def _expanded(node: object) -> int:
    if isinstance(node, dict):
        return 1 + sum(1 + _expanded(v) for v in node.values())
    if isinstance(node, list):
        return 1 + sum(_expanded(v) for v in node)
    return 1


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(1, 9))
def test_alias_expansion_is_bounded_whatever_the_shape(width: int, depth: int) -> None:
    lines = ["l0: &l0 [x]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth + 1)]
    text = "\n".join(lines) + "\n"
    sizes = [2]
    for _ in range(depth):
        sizes.append(1 + width * sizes[-1])
    total = 1 + sum(1 + size for size in sizes)  # the whole document with every alias expanded
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.yaml"
        path.write_text(text)
        try:
            data = read_yaml(path)
        except ConfigError as exc:
            assert "aliases that expand" in str(exc.value) and total > MAX_ALIAS_NODES
            return
    assert _expanded(data) == total <= MAX_ALIAS_NODES + len(text)


def test_reusing_a_block_with_an_anchor_still_works(tmp_path: Path) -> None:
    body = ("name: anchors\nlane:\n  model: &m {pattern: AEMR, d_model: 64}\n  budget: {steps: 8}\n"
            "features: {moe_dispatch: &v [jagged]}\n")
    sweep, _ = load_sweep(_campaign(tmp_path, body))
    assert sweep.lane.model.pattern == "AEMR"
    recursive = _campaign(tmp_path, "name: r\nlane: &l {model: *l}\n")
    assert "itself" in str(_refused(recursive)) or "recursive" in str(_refused(recursive))


@pytest.mark.parametrize("kind", ["campaign", "policy", "defaults"])
def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path, kind: str) -> None:
    path = _campaign(tmp_path, b"name: caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        {"campaign": load_sweep, "policy": load_policy, "defaults": load.load_defaults}[kind](path)
    assert info.value.key == str(path) and "UTF-8" in info.value.allowed and "offset 9" in str(info.value.value)


# --- policy files ---

@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("evidence.min_hosts", 0, ">= 1"),
    ("failures.fisher_alpha", 3, "a fraction in (0, 1)"),
    ("threshold.min_effect", -0.5, "[0, 1)"),
    ("gates.exact_counters", ["graph_brakes"], "graph_breaks, recompiles, recompiles_in_steady_state"),
    ("gates.severities", ["fatl"], "fatal, warn"),
    ("quality.metric", "no_such_metric", "lm_loss_final"),
    ("matching.replication_keys", ["seed", "model.pattern"], "seed, data.seed"),
    ("matching.replication_keys", ["budget.horizon_steps"], "do not define the lane"),
    ("scope.global_device_classes", ["tpu"], "cpu, cuda"),
    ("taxes.budgets", {"moe_dispatch": 0.1}, "a tax feature: stp"),
    ("taxes.default_budget", 1.5, "(0, 1)"),
    ("suspicious.max_speedup", 0.9, "> 1"),
    ("bootstrap.seed", -1, ">= 0"),
    ("order.max_effect_in_thresholds", 0, "positive"),
    ("failures.max_candidate_rate", 2, "[0, 1]"),
    ("evidence.min_round_gap_s", -60, ">= 0"),
    ("evidence.min_hosts_per_round", 0, "an integer >= 1"),
    ("version", 0, ">= 1"),
])
def test_a_policy_value_out_of_range_or_misspelled_is_refused(key: str, value: object, allowed: str) -> None:
    single = load_policy(POLICIES / "single_node.yaml")
    with pytest.raises(ConfigError) as info:
        with_overrides(single, {key: value})
    shown = value[-1] if isinstance(value, list) else next(iter(value)) if isinstance(value, dict) else value
    assert info.value.key.startswith(f"policy {key}"), str(info.value)
    assert repr(shown) in str(info.value) or repr(float(shown)) in str(info.value), str(info.value)  # type: ignore
    assert allowed in info.value.allowed


def test_policy_names_come_from_the_receipt_schema() -> None:
    assert {"graph_breaks", "recompiles_in_steady_state"} <= set(EXACT_COUNTERS) and "lm_loss_final" in QUALITY_METRICS
    single = load_policy(POLICIES / "single_node.yaml")
    assert with_overrides(single, {"gates.exact_counters": ["unique_graphs"]}).gates.exact_counters == (
        "unique_graphs",)
    # A field of the compile record that is not a counter (a list of reasons) would never compare as one.
    with pytest.raises(ConfigError, match="policy gates.exact_counters: got 'graph_break_reasons'"):
        with_overrides(single, {"gates.exact_counters": ["graph_break_reasons"]})
    with pytest.raises(ConfigError, match="policy quality.metric: got 'loss'"):
        with_overrides(single, {"quality.metric": "loss"})


def _numeric_policy_keys() -> list[str]:
    keys = []
    for name, hint in typing.get_type_hints(Policy).items():
        if hint in (int, float) and name != "version":
            keys.append(name)
        elif dataclasses.is_dataclass(hint):
            keys += [f"{name}.{inner}" for inner, kind in typing.get_type_hints(hint).items() if kind in (int, float)]
    return sorted(keys)


NUMERIC_POLICY_KEYS = _numeric_policy_keys()


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(NUMERIC_POLICY_KEYS), st.sampled_from([math.nan, math.inf, -math.inf, -1e9]))
def test_every_numeric_policy_threshold_has_a_range(key: str, value: float) -> None:
    # Seeds may be any non-negative integer; every other threshold is bounded on both sides or at zero.
    assert {"family_alpha", "evidence.min_hosts", "failures.fisher_alpha", "bootstrap.seed"} <= set(
        NUMERIC_POLICY_KEYS)
    if key == "bootstrap.seed" and value == -1e9:
        value = -1
    with pytest.raises(ConfigError) as info:
        with_overrides(load_policy(POLICIES / "default.yaml"), {key: value})
    assert info.value.key == f"policy {key}", str(info.value)


def test_a_misspelled_policy_key_is_refused_by_name(tmp_path: Path) -> None:
    text = (POLICIES / "default.yaml").read_text().replace("  min_effect: 0.01", "  min_speedup: -0.5")
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_policy(path)
    assert str(info.value).startswith("policy threshold.min_speedup: got -0.5; allowed: known keys: ")


# --- the CLI boundary: one `error:` / FAIL line, a non-zero exit, no traceback ---

def _cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    from ablate.cli import main

    monkeypatch.setattr(sys, "argv", ["ablate", *args])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as info:
        main()  # an uncaught exception here (the old tracebacks) fails the test
    captured = capsys.readouterr()
    return int(info.value.code or 0), captured.out + captured.err


def _policy_file(tmp_path: Path, old: str, new: str, raw: bytes | None = None, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    text = (POLICIES / "single_node.yaml").read_text()
    assert old in text
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(text.replace(old, new, 1))
    return path


def test_validate_checks_policy_files(tmp_path: Path, capsys, monkeypatch) -> None:
    bad = _policy_file(tmp_path, "fisher_alpha: 0.05", "fisher_alpha: 3")
    code, out = _cli(capsys, monkeypatch, "validate", "--policy", str(bad))
    assert code == 1 and f"FAIL {bad}: policy failures.fisher_alpha: got 3.0; allowed: a fraction in (0, 1)" in out
    # Given as a plain argument, a policy file is recognised as one (not typed as a campaign).
    code, out = _cli(capsys, monkeypatch, "validate", str(bad), str(POLICIES / "default.yaml"))
    assert code == 1 and "policy failures.fisher_alpha" in out and "default.yaml (policy)" in out


@pytest.mark.parametrize("command", ["validate", "promote"])
def test_bad_policies_are_one_line_at_the_cli(tmp_path: Path, capsys, monkeypatch, command: str) -> None:
    cases = [(_policy_file(tmp_path, "min_hosts: 1 ", "min_hosts: 0 "), "policy evidence.min_hosts: got 0"),
             (_policy_file(tmp_path, "", "", raw=b"name: \xff\n", name="latin1.yaml"), "UTF-8")]
    for path, message in cases:
        args = (["validate", "--policy", str(path)] if command == "validate" else
                ["promote", "--source", str(SMOKE_RECEIPTS), "--policy", str(path), "--out", str(tmp_path / "r")])
        code, out = _cli(capsys, monkeypatch, *args)
        assert code != 0 and message in out and "Traceback" not in out, out
        assert not (tmp_path / "r").exists()  # refused before any report is written


def test_validate_refuses_bad_campaigns_with_one_line_each(tmp_path: Path, capsys, monkeypatch) -> None:
    files = {
        "nonutf8.yaml": b"name: \xff\n",
        "superscript.yaml": f"name: sup\nlane: {{model: {{pattern: 'AEMR*²'}}}}\n{JAGGED}".encode(),
        "bomb.yaml": BOMB.encode(),
        "empty.yaml": b"",
    }
    paths = [_campaign(tmp_path, text, name) for name, text in files.items()]
    started = time.perf_counter()
    code, out = _cli(capsys, monkeypatch, "validate", *map(str, paths))
    assert time.perf_counter() - started < 10
    assert code == 1 and out.count("FAIL") == 4 and "Traceback" not in out, out
    assert "lane.model.pattern: got 'AEMR*²'" in out and "<root>" not in out
    assert "UTF-8" in out and "alias bomb" in out and "at least a name" in out


def test_receipts_that_are_not_receipts_are_rejected_by_name(tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "latin1.json").write_bytes(b"{\"identity\": \"caf\xe9\"}")
    (tmp_path / "number.json").write_text("42\n")
    (tmp_path / "spool.jsonl").write_text("7\n")
    code, out = _cli(capsys, monkeypatch, "receipts", "list", "--source", str(tmp_path))
    assert "Traceback" not in out
    assert f"rejected {tmp_path / 'latin1.json'}: not UTF-8" in out
    assert f"rejected {tmp_path / 'number.json'}: a receipt must be a JSON object, got int" in out
    assert f"rejected {tmp_path / 'spool.jsonl'}:1: a receipt must be a JSON object, got int" in out


@pytest.mark.parametrize("args", [["receipts", "list", "--source"], ["receipts", "show", "abc", "--source"],
                                  ["promote", "--source"], ["receipts", "sync"]])
def test_a_missing_source_path_is_an_error_line(tmp_path: Path, capsys, monkeypatch, args: list[str]) -> None:
    missing = tmp_path / "no_such_dir"
    code, out = _cli(capsys, monkeypatch, *args, str(missing), *(["--out", str(tmp_path / "r")]
                                                                   if args[0] == "promote" else []))
    assert code == 2 and "error:" in out and str(missing) in out and "no such" in out, out


def test_out_pointing_at_a_file_is_an_error_line(tmp_path: Path, capsys, monkeypatch) -> None:
    target = tmp_path / "report.md"
    target.write_text("keep me\n")
    code, out = _cli(capsys, monkeypatch, "promote", "--source", str(SMOKE_RECEIPTS), "--policy",
                     str(POLICIES / "single_node.yaml"), "--out", str(target))
    assert code == 2 and f"--out {target}: got an existing file" in out and "Traceback" not in out
    assert target.read_text() == "keep me\n"


def test_any_other_value_or_os_error_is_one_line_naming_its_type(capsys, monkeypatch) -> None:
    import ablate.cli as cli

    def broken() -> None:
        raise FileExistsError(17, "File exists", "/some/where")

    monkeypatch.setattr(cli, "app", broken)
    code, out = _cli(capsys, monkeypatch, "anything")
    assert code == 1 and "error: FileExistsError: /some/where: File exists" in out
