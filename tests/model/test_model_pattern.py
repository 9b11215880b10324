"""Pattern grammar: presets, repetition, and errors that name the bad character and its position."""

from __future__ import annotations

import pytest

from ablate.config.schema import ConfigError
from trainers.model import parse_pattern
from ablate.config.pattern import family_counts


def test_nam56r_preset_counts() -> None:
    letters = parse_pattern("nam56r")
    assert letters == "AEMEAEMEAEMR" * 4 + "AEME"
    assert len(letters) == 52
    assert family_counts(letters) == {"A": 13, "M": 13, "E": 22, "R": 4}
    assert parse_pattern("NAM56R") == letters
    assert parse_pattern("AEMEAEMEAEMR*4+AEME") == letters


@pytest.mark.parametrize("pattern,expected", [
    ("AEMR", "AEMR"),
    ("AE*2+M", "AEAEM"),
    ("A*3", "AAA"),
    (" AE * 2 + R ", "AEAER"),
    ("M*10+E", "M" * 10 + "E"),
])
def test_repetition_expands(pattern: str, expected: str) -> None:
    assert parse_pattern(pattern) == expected


@pytest.mark.parametrize("pattern,char,position", [("AEXM", "X", 2), ("AE*2+Mq", "q", 6), ("aemr", "a", 0)])
def test_bad_character_names_char_and_position(pattern: str, char: str, position: int) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pattern(pattern)
    assert info.value.key == "lane.model.pattern"
    assert info.value.value == pattern
    message = str(info.value)
    assert f"bad character {char!r} at position {position}" in message
    assert "nam56r" in message  # the allowed part lists the presets


@pytest.mark.parametrize("pattern,fragment", [
    ("", "empty"),
    ("A**2", "second '*'"),
    ("*2", "no letters"),
    ("A*0", ">= 1"),
    ("A+", "empty term"),
    ("A*", "without a repeat count"),
    ("A*x", "expected a digit"),
])
def test_malformed_patterns_raise(pattern: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="lane.model.pattern") as info:
        parse_pattern(pattern)
    assert fragment in str(info.value)
