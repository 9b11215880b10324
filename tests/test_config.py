"""The config boundary: typed once, and every bad input names the key, the value and what is allowed."""

from __future__ import annotations

import enum
import re

from pathlib import Path

import pytest

from ablate.config import load
from ablate.config.auto_device import local_device_class
from ablate.config.features import FEATURES
from ablate.config.load import default_lane_with, load_sweep, structured, with_feature
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


def test_a_lane_mapping_read_again_is_not_merged_again_and_each_read_is_an_object_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    merges: list[type] = []
    real = load.structured
    monkeypatch.setattr(load, "structured", lambda schema, data, prefix="": merges.append(schema) or
                        real(schema, data, prefix))
    load._lane_of_json.cache_clear()
    data = {"features": {"moe_dispatch": "jagged"}, "batch": {"seq_len": 48}, "model": {"pattern": "AMEE"}}
    first = load.load_lane(data)
    second = load.load_lane({"model": {"pattern": "AMEE"}, "batch": {"seq_len": 48},  # other key order
                             "features": {"moe_dispatch": "jagged"}})
    assert merges == [LaneConfig] and first == second and first is not second
    second.batch.seq_len = 64  # what a caller changes stays its own
    assert load.load_lane(data).batch.seq_len == 48 and first.batch.seq_len == 48
    assert load.load_lane({**data, "batch": {"seq_len": 64}}).batch.seq_len == 64 and len(merges) == 2
    for _ in range(2):  # a refused mapping is refused again, never remembered as a lane
        with pytest.raises(ConfigError, match="lane.batch.seq_len"):
            load.load_lane({"batch": {"seq_len": "long"}})
    assert len(merges) == 4


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
    ],
)
def test_bad_campaign_features(tmp_path: Path, features: str, fragment: str) -> None:
    path = _write(tmp_path, f"features: {features}\n")
    with pytest.raises(ConfigError, match=None) as info:
        load_sweep(path)
    assert fragment in str(info.value)


@pytest.mark.parametrize(("features", "fragment"), [
    ("{moe_dispatch: [jagged]}", "no E (MoE) blocks"),
    ("{bucket_cap_mb: [100]}", "communication buckets cannot act with one worker"),
])
def test_an_inert_toggle_is_refused_before_any_arm_runs(tmp_path: Path, features: str, fragment: str) -> None:
    from ablate.sweep.plan import plan_sweep

    # Refused by the plan (with the reason, shown by validate, the sweep and the promotion report), not typed away:
    # the campaign still runs its other blocks; with nothing else to run it fails before any trial.
    path = _write(tmp_path, f"lane: {{model: {{pattern: AM}}}}\nfeatures: {features}\n")
    sweep, _ = load_sweep(path)
    plan = plan_sweep(sweep, "t")
    assert [b.feature for b in plan.blocks] == [None]  # only the A/A block
    assert len(plan.skipped) == 1 and "refused, inert" in plan.skipped[0][1] and fragment in plan.skipped[0][1]
    bare = _write(tmp_path, f"lane: {{model: {{pattern: AM}}}}\nfeatures: {features}\naa_blocks: 0\n")
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        plan_sweep(load_sweep(bare)[0], "t")


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


ODD_VALUES = ["quantum", "\x00", "", None, True, False, 0, 1, -3, 25, 2.5, "25", "true", "on", "off", "jagged",
              "MoEDispatch.jagged", [1, 2], {"a": 1}]


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_the_default_lane_with_one_feature_is_with_feature_on_the_default_lane(name: str) -> None:
    """``default_lane_with`` (one field merged onto the schema) gives what ``with_feature(LaneConfig(), ...)`` gives
    (a whole lane merged): the same lane for every value the field takes, the same error, word for word, for the
    rest; the feature's own registered values included."""
    node: object = LaneConfig()
    for part in FEATURES[name].path.split("."):
        node = getattr(node, part)
    registered = [m.value for m in type(node)] if isinstance(node, enum.Enum) else [node]
    for value in ODD_VALUES + registered:
        try:
            want: object = with_feature(LaneConfig(), name, value)
        except ConfigError as exc:
            want = ("error", exc.key, repr(exc.value), exc.allowed, str(exc))
        try:
            got: object = default_lane_with(name, value)
        except ConfigError as exc:
            got = ("error", exc.key, repr(exc.value), exc.allowed, str(exc))
        assert got == want, (name, value)


def test_tax_cannot_default_on(tmp_path: Path) -> None:
    defaults = Path("search_spaces/defaults.yaml").read_text().replace("value: 'off'         # tax",
                                                                        "value: 'on'         # tax")
    path = _write(tmp_path, "features: {mamba_scan: [chunked]}\n", defaults)
    with pytest.raises(ConfigError) as info:
        load_sweep(path)
    assert "features.stp.value" in str(info.value) and "taxes stay opt-in" in str(info.value)


# --- lane shapes and lane overrides (defaults.yaml `lane_overrides`) ---


def _flat(**changes: object) -> dict:
    flat = load.flatten(load.lane_to_dict(LaneConfig()))
    flat.update(changes)
    return flat


def test_lane_shape_ignores_features_and_seeds_but_not_the_horizon() -> None:
    from ablate.config.lane_shape import REPLICATION_KEYS, lane_shape  # new module: a missing one fails here

    base = lane_shape(_flat())
    assert base.startswith("shape-") and len(base) == len("shape-") + 12
    assert set(REPLICATION_KEYS) == {"seed", "data.seed"}
    # A promoted value changes the lane key but must not move the lane to another shape, nor must a seed.
    assert lane_shape(_flat(**{"features.moe_dispatch": "jagged", "compile.posture": "regional",
                               "engine.bucket_cap_mb": 100.0, "seed": 7, "data.seed": 9})) == base
    # The horizon decides which value wins (one-time vs recurring cost): another horizon is another lane.
    assert lane_shape(_flat(**{"budget.horizon_steps": 500})) != base
    assert lane_shape(_flat(**{"batch.seq_len": 128})) != base
    assert load.lane_shape_of(LaneConfig(), "cpu") == lane_shape(_flat(), "cpu")


def test_lane_shape_resolves_device_auto_to_the_device_the_arms_ran_on() -> None:
    from ablate.config.lane_shape import lane_shape

    auto = _flat()
    assert auto["hardware.device"] == "auto"
    on_cpu, on_cuda = lane_shape(auto, "cpu"), lane_shape(auto, "cuda")
    # A value won on CPU says nothing of the GPU runs of an auto lane: two devices, two shapes ...
    assert on_cpu != on_cuda and lane_shape(auto) not in (on_cpu, on_cuda)
    # ... and an auto lane that ran on CPU is the lane with device: cpu written out.
    assert on_cpu == lane_shape(_flat(**{"hardware.device": "cpu"}))
    assert lane_shape(_flat(**{"hardware.device": "cpu"}), "cuda") == on_cpu  # a written-out device stays
    assert lane_shape(auto, "unknown") == lane_shape(auto)  # a receipt that observed no device class
    # A sweep plans an auto lane for this machine's device (CPU here: CI has no GPU).
    assert load.lane_shape_of(LaneConfig()) == lane_shape(auto, local_device_class())


def _defaults_with_override(shape: str, value: str = "jagged") -> str:
    text = Path("search_spaces/defaults.yaml").read_text()
    override = (f"    lane_overrides:\n      - lane_shape: {shape}\n        value: {value}\n"
                f"        report: promote-sim-1\n")
    return text.replace("  moe_dispatch:\n", "  moe_dispatch:\n" + override, 1)


def test_a_lane_override_won_on_one_device_is_not_the_baseline_of_an_auto_lane_on_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ablate.config import auto_device

    lane = "lane: {batch: {seq_len: 32}}\nfeatures: {mamba_scan: [chunked]}\n"  # hardware.device: auto
    won_on_cpu = load.lane_shape_of(load_sweep(_write(tmp_path, lane))[0].lane, "cpu")
    defaults_text = _defaults_with_override(won_on_cpu)
    for machine, baseline in (("cpu", MoEDispatch.jagged), ("cuda", MoEDispatch.padded)):
        monkeypatch.setattr(auto_device, "local_device_class", lambda machine=machine: machine)
        sweep, _ = load_sweep(_write(tmp_path, lane, defaults_text))
        assert sweep.lane.features.moe_dispatch is baseline, machine
    # The lane with its device written out runs the override wherever it is planned.
    written_out = "lane: {batch: {seq_len: 32}, hardware: {device: cpu}}\nfeatures: {mamba_scan: [chunked]}\n"
    assert load_sweep(_write(tmp_path, written_out, defaults_text))[0].lane.features.moe_dispatch is \
        MoEDispatch.jagged


def test_an_override_keyed_by_an_auto_lane_as_written_is_not_applied_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ablate.config.lane_shape import lane_shape

    lane = "lane: {batch: {seq_len: 32}}\nfeatures: {mamba_scan: [chunked]}\n"
    sweep = load_sweep(_write(tmp_path, lane))[0]
    written = lane_shape(load.flat_lane(sweep.lane))  # how overrides were keyed before the device was resolved
    campaign = _write(tmp_path, lane, _defaults_with_override(written))
    with caplog.at_level("WARNING", logger="ablate.config.load"):
        again, _ = load_sweep(campaign)
        load_sweep(campaign, device="cuda")  # read again (a re-plan for the cluster's device): said once
    assert again.lane.features.moe_dispatch is MoEDispatch.padded  # won on some device: nothing says which
    [line] = [r.getMessage() for r in caplog.records]
    assert f"features.moe_dispatch.lane_overrides[{written}] ('jagged')" in line
    assert f"cpu: {load.lane_shape_of(sweep.lane, 'cpu')}" in line and "is not applied" in line


def test_a_lane_override_is_the_baseline_of_its_lane_only(tmp_path: Path) -> None:
    lane_a = "lane: {batch: {seq_len: 32}}\nfeatures: {mamba_scan: [chunked]}\n"
    shape_a = load.lane_shape_of(load_sweep(_write(tmp_path, lane_a))[0].lane)
    defaults_text = _defaults_with_override(shape_a)
    sweep_a, defaults = load_sweep(_write(tmp_path, lane_a, defaults_text))
    assert sweep_a.lane.features.moe_dispatch is MoEDispatch.jagged  # the lane's baseline runs its override
    assert defaults.values["moe_dispatch"] == "padded"  # the global value stays
    assert defaults.effective(load.flatten(load.lane_to_dict(sweep_a.lane)),
                              local_device_class())["moe_dispatch"] == "jagged"
    other = tmp_path / "other"
    other.mkdir()
    sweep_b, _ = load_sweep(_write(other, "lane: {batch: {seq_len: 128}}\nfeatures: {mamba_scan: [chunked]}\n",
                                   defaults_text))
    assert sweep_b.lane.features.moe_dispatch is MoEDispatch.padded  # another shape keeps the global value
    # The campaign's own lane still beats an override, as it beats a global value.
    pinned, _ = load_sweep(_write(tmp_path, "lane: {batch: {seq_len: 32}, features: {moe_dispatch: grouped_mm}}\n"
                                            "features: {mamba_scan: [chunked]}\n", defaults_text))
    assert pinned.lane.features.moe_dispatch is MoEDispatch.grouped_mm


SHAPE = "shape-0123456789ab"


@pytest.mark.parametrize(
    ("old", "new", "key", "value", "allowed"),
    [
        ("value: padded ", "value: fast ", "features.moe_dispatch.value", "'fast'",
         "one of padded, jagged, grouped_mm"),
        ("  moe_dispatch:\n", f"  moe_dispatch:\n    lane_overrides:\n      - {{lane_shape: {SHAPE}, value: warp}}\n",
         "features.moe_dispatch.lane_overrides[0].value", "'warp'", "one of padded, jagged, grouped_mm"),
        ("  moe_dispatch:\n", "  moe_dispatch:\n    lane_overrides:\n      - {lane_key: 51a8222a1d14e51a, value: "
                              "jagged}\n",
         "features.moe_dispatch.lane_overrides[0].lane_shape", "None", "a lane shape 'shape-<12 hex>'"),
        ("  moe_dispatch:\n", f"  moe_dispatch:\n    lane_overrides:\n      - {{lane_shape: {SHAPE}, value: jagged}}"
                              f"\n      - {{lane_shape: {SHAPE}, value: grouped_mm}}\n",
         "features.moe_dispatch.lane_overrides[1].lane_shape", repr(SHAPE), "one override per lane shape"),
        ("  moe_dispatch:\n", "  moe_dispatch:\n    lane_overrides: jagged\n",
         "features.moe_dispatch.lane_overrides", "'jagged'", "a list of {lane_shape"),
        ("    kind: tax\n", f"    kind: tax\n    lane_overrides:\n      - {{lane_shape: {SHAPE}, value: 'on'}}\n",
         "features.stp.lane_overrides[0].value", "'on'", "taxes stay opt-in, in every lane"),
    ],
)
def test_bad_defaults_are_refused_naming_key_value_and_allowed(tmp_path: Path, old: str, new: str, key: str,
                                                                value: str, allowed: str) -> None:
    text = Path("search_spaces/defaults.yaml").read_text()
    assert old in text
    path = tmp_path / "defaults.yaml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load.load_defaults(path)  # refused when read, not when a sweep first needs the value
    assert str(info.value).startswith(f"{path}: {key}: got {value}; allowed: "), str(info.value)
    assert allowed in str(info.value)


def test_a_value_moved_into_the_defaults_is_skipped_but_a_pinned_or_reference_one_is_refused(
        tmp_path: Path) -> None:
    from ablate.sweep.plan import plan_sweep

    # defaults.yaml moved mamba_scan off its reference (here by hand, so without an evidence record).
    defaults = Path("search_spaces/defaults.yaml").read_text().replace("value: sequential    #",
                                                                        "value: chunked    #")
    sweep, loaded = load_sweep(_write(tmp_path, "features: {mamba_scan: [chunked], moe_dispatch: [jagged]}\n",
                                      defaults))
    skipped = plan_sweep(sweep, "v", loaded).skipped
    assert skipped == [("mamba_scan=chunked", "already this lane's default (global default in "
                        f"{tmp_path / 'defaults.yaml'} (the reference is 'sequential')): nothing to compare it "
                        "against; drop it from the campaign or test another value")]
    # Only what defaults.yaml moved is skipped: the campaign's own pinned value, or the untouched reference
    # tested against itself, is still a mistake in the campaign.
    for body in ("lane: {features: {mamba_scan: chunked}}\nfeatures: {mamba_scan: [chunked]}\n",
                 "features: {moe_dispatch: [padded]}\n"):
        with pytest.raises(ConfigError) as info:
            load_sweep(_write(tmp_path, body, defaults))
        assert "allowed: a value different from the baseline" in str(info.value)
