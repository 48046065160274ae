"""What the other workers of a scope learned (R4.12), as a new worker's starting point: the
count each range last learned, read from the host record, and the pure rule for which of
them a new worker starts verifying instead of exploring from zero. A worker still times and
verifies its own answers before it serves any of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_srun.records.host_record import HostRecord, HostRecordError, Scope

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SiblingCount:
    """The count a worker of the same scope learned for a range, as the record keeps it."""

    num_threads: int
    speedup: float  # over the configured count, as that worker measured it
    since_s: float  # time.time() it was last written
    verified_passes: int


def siblings_learned(record: HostRecord, scope: Scope) -> dict[int, SiblingCount]:
    """Range (its lowest padded size) -> what workers of ``scope`` learned for it (the newest
    per range), read from the host record; empty if the record cannot be read. A starting
    point only: a worker still times and verifies its own answers before serving a count."""
    try:
        rows = record.learned(scope)
    except HostRecordError as exc:
        log.warning("siblings_learned_unreadable path=%s error=%s", record.path, exc)
        return {}
    return {lo: SiblingCount(int(r["num_threads"]), float(r["speedup"]),
                             float(r["updated_at"]), int(r["verified_passes"]))
            for lo, r in rows.items()}


def starting_counts(siblings: dict[int, SiblingCount], counts: tuple[int, ...],
                    configured: int, now_s: float, max_age_s: float) -> dict[int, int]:
    """Range -> the count a new worker starts verifying there instead of exploring from
    zero: a sibling's count learned within ``max_age_s``, among this worker's ``counts``,
    other than the configured one (which serves already)."""
    return {lo: s.num_threads for lo, s in sorted(siblings.items())
            if s.num_threads in counts and s.num_threads != configured
            and now_s - s.since_s <= max_age_s}
