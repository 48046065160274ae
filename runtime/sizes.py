"""Input-size ranges: padded tokens of a forward, in logarithmic (power-of-two) ranges."""

from __future__ import annotations


def size_range(padded_tokens: int) -> tuple[int, int]:
    """The range [lo, hi] holding ``padded_tokens``: 1-1, 2-3, 4-7, 8-15, ..."""
    lo = 1
    while lo * 2 <= padded_tokens:
        lo *= 2
    return lo, lo * 2 - 1


def range_label(padded_tokens: int) -> str:
    lo, hi = size_range(padded_tokens)
    return f"{lo}-{hi}"
