"""Input-size ranges: padded tokens of a forward, in logarithmic (power-of-two) ranges."""

from __future__ import annotations

from collections.abc import Callable


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
# (R4.8); padding the length of a forward no sweep covers up to a coarse grid makes far
# fewer shapes to verify, at the cost of the padding. ``bench.length_grid`` measures both
# per step bound 1/2**shift on the 2-vCPU Xeon: 1/4, 1/8, 1/16 leave the default sweep
# 0.18, 0.29, 0.47 of its padded tokens and the bench mix's 51 lengths 8, 13, 22, for
# 1.105, 1.052, 1.024x the forward time of one-row forwards of the mix. At 1/8 a busy
# mode 2 worker without a sweep ran every forward at a verified shape from 4:02 on; at
# 1/16, 3.6% of the forwards of its fifth minute still ran at the configured count for want
# of one (``bench.mode2_coverage``; two runs at 1/8, one at 1/16): 1/8 covers the traffic
# within 5 minutes, the least padding that did.
GRID_SHIFT = 3


def grid_length(tokens: int, max_len: int, shift: int = GRID_SHIFT) -> int:
    """The padded length of a forward whose longest row has ``tokens`` tokens, on the length
    grid: ``tokens`` up to 16; above, rounded up to a multiple of the largest power of two
    not above ``tokens`` / 8 (17 -> 18, 100 -> 104, 300 -> 320); at most ``max_len`` (the
    tokenizer's limit, itself on the grid). ``shift``: the step's bound, 1/2**shift (the
    other values are for ``bench.length_grid``)."""
    if tokens < 2 << shift:
        return tokens
    step = 1 << (tokens.bit_length() - 1 - shift)
    return max(tokens, min(-(-tokens // step) * step, max_len))


def padded_length(rows: int, longest: int, max_len: int,
                  exact: Callable[[int, int], bool]) -> int:
    """A mode 2 forward's padded length: the longest row where ``exact(rows, longest)`` (a
    sweep or a shape verified one by one covers that exact shape, so it needs no grid),
    else ``grid_length``."""
    if exact(rows, longest):
        return longest
    return grid_length(longest, max_len)


def on_grid(length: int, max_len: int, shift: int = GRID_SHIFT) -> bool:
    """Can a forward padded to the grid (``grid_length``) have ``length``?"""
    return length == max_len or grid_length(length, max_len, shift) == length
