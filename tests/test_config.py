"""The config boundary: typed once, and every bad input names the key, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ablate.config.load import load_sweep, structured, with_feature
from ablate.config.schema import ConfigError, LaneConfig, MoEDispatch, SweepConfig


def _write(tmp_path: Path, text: str, defaults: str | None = None) -> Path:
    (tmp_path / "defaults.yaml").write_text(defaults or Path("search_spaces/defaults.yaml").read_text())
    path = tmp_path / "campaign.yaml"
    path.write_text(text)
    return path


def test_structured_types_the_whole_tree() -> None:
    sweep = structured(SweepConfig, {"lane": {"features": {"moe_dispatch": "jagged"}, "batch": {"seq_len": 32}}})
    assert isinstance(sweep.lane, LaneConfig)
    assert sweep.lane.features.moe_dispatch is MoEDispatch.jagged
    assert sweep.lane.batch.seq_len == 32


@pytest.mark.parametrize(
    ("data", "key", "value", "allowed"),
    [
        ({"lane": {"model": {"dmodel": 3}}}, "lane.model.dmodel", "3", "known keys: aux_loss_weight"),
        ({"lane": {"features": {"moe_dispatch": "fast"}}}, "lane.features.moe_dispatch", "'fast'",
         "one of padded, jagged, grouped_mm"),
        ({"lane": {"batch": {"seq_len": "long"}}}, "lane.batch.seq_len", "'long'", "type int"),
        ({"lane": {"model": {"top_k": 9}}}, "lane.model.top_k", "9", "between 1 and lane.model.n_experts (4)"),
        ({"lane": {"batch": {"seq_len": 50}}}, "lane.batch.seq_len", "50", "multiple of lane.model.ssm_chunk"),
        ({"lane": {"engine": {"zero_stage": 4}}}, "lane.engine.zero_stage", "4", "one of 0, 1, 2, 3"),
        ({"lane": {"budget": {"steps": 0}}}, "lane.budget.steps", "0", "positive"),
        ({"lane": {"engine": {"workers": -1}}}, "lane.engine.workers", "-1", "positive"),
        ({"blocks": 0}, "blocks", "0", "positive"),
        ({"surprise": 1}, "surprise", "1", "known keys: aa_blocks"),
    ],
)
def test_bad_values_name_key_value_and_allowed(data: dict, key: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        structured(SweepConfig, data)
    message = str(info.value)
    assert message.startswith(f"{key}: got {value}"), message
    assert allowed in message


def test_defaults_become_the_baseline(tmp_path: Path) -> None:
    defaults = Path("search_spaces/defaults.yaml").read_text().replace("value: padded ", "value: jagged ")
    path = _write(tmp_path, "features: {mamba_scan: [chunked]}\n", defaults)
    sweep, loaded = load_sweep(path)
    assert loaded.values["moe_dispatch"] == "jagged"
    assert sweep.lane.features.moe_dispatch is MoEDispatch.jagged


def test_explicit_lane_value_wins_over_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, "lane: {features: {moe_dispatch: jagged}}\nfeatures: {mamba_scan: [chunked]}\n")
    sweep, _ = load_sweep(path)
    assert sweep.lane.features.moe_dispatch is MoEDispatch.jagged


@pytest.mark.parametrize(
    ("features", "fragment"),
    [
        ("{moe_dispatch: [padded]}", "different from the baseline 'padded'"),
        ("{teleport: [on]}", "features.teleport: got 'teleport'; allowed: one of "),
        ("{moe_dispatch: [warp]}", "features.moe_dispatch: got 'warp'; allowed: one of padded, jagged"),
        ("{moe_dispatch: jagged}", "a non-empty list of candidate values"),
        ("{bucket_cap_mb: [100]}", "inert: communication buckets cannot act with one worker"),
    ],
)
def test_bad_campaign_features(tmp_path: Path, features: str, fragment: str) -> None:
    path = _write(tmp_path, f"features: {features}\n")
    with pytest.raises(ConfigError, match=None) as info:
        load_sweep(path)
    assert fragment in str(info.value)


def test_inert_moe_toggle_without_e_blocks(tmp_path: Path) -> None:
    path = _write(tmp_path, "lane: {model: {pattern: AM}}\nfeatures: {moe_dispatch: [jagged]}\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(path)
    assert "no E (MoE) blocks" in str(info.value)


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "lane:\n  model: {pattern: AEMR\nblocks: 2\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(path)
    assert str(path) in str(info.value) and "line" in str(info.value) and "well-formed YAML" in str(info.value)


def test_with_feature_rejects_bad_value_naming_the_feature() -> None:
    with pytest.raises(ConfigError) as info:
        with_feature(LaneConfig(), "mamba_scan", "quantum")
    assert str(info.value).startswith("features.mamba_scan: got 'quantum'")
    assert "sequential, chunked" in str(info.value)


def test_tax_cannot_default_on(tmp_path: Path) -> None:
    defaults = Path("search_spaces/defaults.yaml").read_text().replace("value: 'off'         # tax",
                                                                        "value: 'on'         # tax")
    path = _write(tmp_path, "features: {mamba_scan: [chunked]}\n", defaults)
    with pytest.raises(ConfigError) as info:
        load_sweep(path)
    assert "features.stp.value" in str(info.value) and "taxes stay opt-in" in str(info.value)
