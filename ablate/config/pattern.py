"""Layer-pattern grammar: one letter per layer, with repetition, or a named preset.

How to use::

    parse_pattern("AEMR")              -> "AEMR"
    parse_pattern("AEME*2+R")          -> "AEMEAEMER"
    parse_pattern("nam56r")            -> "AEMEAEMEAEMR" * 4 + "AEME"   (52 layers: 13 A, 22 E, 13 M, 4 R)

Grammar (spaces ignored)::

    pattern := term ("+" term)*
    term    := letters ["*" count]       letters: one or more of A M E R;  count: ASCII digits, >= 1

The expanded pattern may hold at most ``MAX_LAYERS`` layers; the length is summed before anything is expanded,
so ``AEMR*100000000`` is refused without allocating 400 M letters.

A = MLA attention, M = Mamba2 SSD, E = MoE FFN, R = minGRU recurrence. Errors are
``ConfigError("lane.model.pattern", value, allowed)`` whose message names the offending character and its 0-based
position in the string as written.
"""

from __future__ import annotations

from collections import Counter

from ablate.config.schema import ConfigError

FAMILIES = ("A", "M", "E", "R")
PRESETS: dict[str, str] = {
    "nam56r": "AEMEAEMEAEMR*4+AEME",
}
_KEY = "lane.model.pattern"
MAX_LAYERS = 1024
"""The deepest model a pattern may describe. The seeds' largest hybrid (NAM56R) has 52 layers; 1024 leaves 20x
headroom for real models while a typo like ``*100000000`` fails here instead of exhausting memory."""
_MAX_COUNT_DIGITS = len(str(MAX_LAYERS))
_DIGITS = "0123456789"
_GRAMMAR = ("letters A (MLA), M (Mamba2), E (MoE), R (recurrent) with optional '*N' repeats joined by '+', "
            f"e.g. 'AEMEAEMEAEMR*4+AEME', or a preset ({', '.join(sorted(PRESETS))})")


def _fail(value: str, why: str) -> ConfigError:
    return ConfigError(_KEY, value, f"{_GRAMMAR}; {why}")


def parse_pattern(pattern: str) -> str:
    """Expand a pattern string (or preset name) to one letter per layer."""
    if not isinstance(pattern, str):
        raise ConfigError(_KEY, pattern, _GRAMMAR)
    preset = PRESETS.get(pattern.strip().lower())
    source = preset if preset is not None else pattern
    if not source.strip():
        raise _fail(pattern, "the pattern is empty")
    terms: list[tuple[str, int]] = []
    num_layers = 0
    letters, count_digits = "", ""
    in_count = False

    def close_term(pos: int) -> None:
        nonlocal letters, count_digits, in_count, num_layers
        if not letters:
            raise _fail(pattern, f"empty term before position {pos}")
        if in_count and not count_digits:
            raise _fail(pattern, f"'*' without a repeat count before position {pos}")
        if len(count_digits.lstrip("0")) > _MAX_COUNT_DIGITS:
            raise _fail(pattern, f"at most {MAX_LAYERS} layers; the repeat count {count_digits[:12]}"
                                 f"{'...' if len(count_digits) > 12 else ''} before position {pos} is larger")
        repeat = int(count_digits.lstrip("0") or "0") if in_count else 1  # int() refuses > 4300 digits
        if repeat < 1:
            raise _fail(pattern, f"repeat count must be >= 1, got {repeat} before position {pos}")
        num_layers += len(letters) * repeat
        if num_layers > MAX_LAYERS:
            raise _fail(pattern, f"at most {MAX_LAYERS} layers; the terms up to position {pos} already expand to "
                                 f"{num_layers:,}")
        terms.append((letters, repeat))
        letters, count_digits, in_count = "", "", False

    for pos, char in enumerate(source):
        if char.isspace():
            continue
        if char == "+":
            close_term(pos)
        elif char == "*":
            if in_count:
                raise _fail(pattern, f"second '*' at position {pos}")
            if not letters:
                raise _fail(pattern, f"'*' at position {pos} has no letters to repeat")
            in_count = True
        elif in_count:
            if char not in _DIGITS:  # not str.isdigit(): it accepts '²', which int() then refuses
                raise _fail(pattern, f"bad character {char!r} at position {pos} (expected a digit after '*')")
            count_digits += char
        elif char in FAMILIES:
            letters += char
        else:
            raise _fail(pattern, f"bad character {char!r} at position {pos}")
    close_term(len(source))
    return "".join(letters * repeat for letters, repeat in terms)


def family_counts(letters: str) -> dict[str, int]:
    """Layers per family in canonical order, zeros included (an absent family is an inert toggle)."""
    counts = Counter(letters)
    return {family: counts.get(family, 0) for family in FAMILIES}
