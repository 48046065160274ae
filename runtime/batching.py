"""Which pending rows share the next forward (R3.1): a small pure policy.

Rows are length-bucketed (powers of two, at least 8 tokens) so a forward pads each row to at
most about twice its length. The oldest pending row chooses the bucket, so no row waits behind
an endless stream of others; the forward then takes that bucket's rows in arrival order while
``max_num_seqs`` rows and ``max_num_batched_tokens`` padded tokens allow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingRow:
    request_id: int
    index: int  # position of the row in its request
    length: int  # tokens, special tokens included


def length_bucket(tokens: int) -> int:
    bucket = 8
    while bucket < tokens:
        bucket *= 2
    return bucket


def next_batch(pending: Sequence[PendingRow], max_num_seqs: int, max_num_batched_tokens: int,
               pad_to: Callable[[int, int], int] | None = None) -> list[PendingRow]:
    """Rows for the next forward; ``pending`` is in arrival order and not empty. ``pad_to``
    gives the padded length from the rows and the longest row where the forward pads
    further (mode 2's length grid)."""
    bucket = length_bucket(pending[0].length)
    chosen: list[PendingRow] = []
    longest = 0
    for row in pending:
        if length_bucket(row.length) != bucket:
            continue
        length = max(longest, row.length)
        rows = len(chosen) + 1
        padded = rows * (pad_to(rows, length) if pad_to is not None else length)
        if chosen and padded > max_num_batched_tokens:
            continue
        chosen.append(row)
        longest = max(longest, row.length)
        if len(chosen) >= max_num_seqs:
            break
    return chosen
