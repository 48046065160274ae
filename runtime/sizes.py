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


# Mode 2 serves a learned count only for shapes verified bit for bit, one forward per shape
# (R4.8); padding a batch's length up to a coarse grid makes far fewer shapes to verify. A
# step of at most 1/8 of the length bounds the padding added to a forward at 1/8 (4% on
# average over lengths 17-256); lengths up to 16 keep step 1, where a step would cost most.
GRID_SHIFT = 3


def grid_length(tokens: int, max_len: int) -> int:
    """The padded length of a forward whose longest row has ``tokens`` tokens, on the length
    grid: ``tokens`` up to 16; above, rounded up to a multiple of the largest power of two
    not above ``tokens`` / 8 (17 -> 18, 100 -> 104, 300 -> 320); at most ``max_len`` (the
    tokenizer's limit, itself on the grid)."""
    if tokens < 2 << GRID_SHIFT:
        return tokens
    step = 1 << (tokens.bit_length() - 1 - GRID_SHIFT)
    return max(tokens, min(-(-tokens // step) * step, max_len))


def on_grid(length: int, max_len: int) -> bool:
    """Can a forward padded to the grid (``grid_length``) have ``length``?"""
    return length == max_len or grid_length(length, max_len) == length
