"""Property-based tests for the config loader: any input either types cleanly or fails with a ConfigError
that names a key from the input; no other exception ever escapes the boundary."""

from __future__ import annotations

import dataclasses
import typing

from hypothesis import given, settings
from hypothesis import strategies as st

from ablate.config.load import flatten, lane_to_dict, structured
from ablate.config.schema import ConfigError, LaneConfig, SweepConfig

LEAF_PATHS = sorted(flatten(lane_to_dict(LaneConfig())).keys())
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10_000), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.integers(), max_size=2))


def _nest(flat: dict[str, object]) -> dict[str, object]:
    root: dict[str, object] = {}
    for dotted, value in flat.items():
        node = root
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})  # type: ignore[assignment]
        node[leaf] = value
    return root


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(LEAF_PATHS), scalars, max_size=4))
def test_any_lane_input_types_or_names_its_key(flat: dict[str, object]) -> None:
    try:
        sweep = structured(SweepConfig, {"lane": _nest(flat)})
    except ConfigError as exc:
        assert exc.key.startswith("lane") or exc.key == "<root>", exc.key
        assert ": got " in str(exc) and "allowed:" in str(exc)
        return
    for dotted, value in flat.items():
        node = sweep.lane
        for part in dotted.split("."):
            node = getattr(node, part)
        assert node is not None or value is None


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: "." not in k), scalars, max_size=3))
def test_unknown_top_level_keys_are_refused_by_name(data: dict[str, object]) -> None:
    known = {f.name for f in dataclasses.fields(SweepConfig)}
    unknown = [k for k in data if k not in known]
    try:
        structured(SweepConfig, data)
    except ConfigError as exc:
        assert exc.key in data or exc.key.split(".")[0] in data
        return
    assert not unknown, f"unknown keys {unknown} were accepted"


def test_every_leaf_has_a_type_the_error_message_can_name() -> None:
    hints = typing.get_type_hints(LaneConfig)
    assert set(hints) >= {"model", "features", "batch", "engine", "compile"}


# --- the pattern grammar ---

from ablate.config.pattern import parse_pattern  # noqa: E402

segments = st.lists(st.tuples(st.text(alphabet="AEMR", min_size=1, max_size=6), st.integers(1, 5)),
                    min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(segments)
def test_pattern_expansion_matches_its_segments(parts: list[tuple[str, int]]) -> None:
    written = "+".join(letters if count == 1 else f"{letters}*{count}" for letters, count in parts)
    assert parse_pattern(written) == "".join(letters * count for letters, count in parts)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="AEMR", min_size=0, max_size=8),
       st.characters(blacklist_characters="AEMR*+0123456789").filter(lambda c: not c.isspace()),
       st.text(alphabet="AEMR", min_size=0, max_size=8))
def test_any_foreign_character_is_named_with_its_position(left: str, bad: str, right: str) -> None:
    written = f"A{left}{bad}{right}"  # whitespace is ignored by the grammar, so it is not generated
    try:
        parse_pattern(written)
    except ConfigError as exc:
        assert exc.key == "lane.model.pattern"
        assert f"position {1 + len(left)}" in str(exc) and repr(bad) in str(exc)
    else:
        raise AssertionError(f"{written!r} was accepted")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12))
def test_parser_returns_family_letters_or_a_config_error(text: str) -> None:
    try:
        letters = parse_pattern(text)
    except ConfigError as exc:
        assert exc.key == "lane.model.pattern"
        return
    assert letters and set(letters) <= set("AEMR")
