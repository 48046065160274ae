"""What live sibling workers of a scope learned (R4.12), as a worker's starting point, without
breaking R4.11 (a restarted worker relearns from fresh samples).

How it works: each tuner is a *writer* with an id of its own (``new_writer``); it stores its
learned counts under that id and refreshes its row of live writers (pid, ``seen_at``) at each
flush and at least every ``HEARTBEAT_S`` (``persistence.RecordSync``); a worker that stops
deletes that row. A writer is live while it was seen within ``LIVE_S`` and its pid still runs
on this host (``is_live``): a killed worker's rows stop counting by themselves, and rows of a
worker's own former self, or of records from before writers were stored, never count. For
each range a live other writer learned, a worker times that count (the candidate) against the
configured count instead of exploring every count; it still verifies its own answers, and
serves the candidate only where the exactness ledger admits it (``learning.Learner.adopt``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from vllm_srun.records.host_record import HostRecord, HostRecordError, Scope
from vllm_srun.runtime.sizes import size_range

log = logging.getLogger(__name__)

# a live writer refreshes its row at each flush (``TunerSettings.flush_s``), and at least this
# often (the record watch does it where no flush came: an idle worker flushes nothing): the
# default flush period
HEARTBEAT_S = 2.0
# a writer seen within this long is live: five heartbeats, so a worker whose record watch a
# loaded 2-core host delayed for a few seconds still counts; a killed worker's rows count at
# most this long after its last heartbeat (and not at all once its pid is gone). A guess, not
# swept
LIVE_S = 5 * HEARTBEAT_S


def new_writer() -> str:
    """A writer id for one tuner instance: never the same across restarts."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class SiblingCount:
    """The count a live sibling of the same scope learned for a range, as the record keeps
    it."""

    num_threads: int
    speedup: float  # over the configured count, as that worker measured it
    since_s: float  # time.time() it was last written
    verified_passes: int
    writer: str = ""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one we may not signal runs; 0 or less
    names no process: ``kill`` would signal a group)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs as another user
        return True
    return True


def is_live(seen_at_s: float, pid: int, now_s: float, live_s: float = LIVE_S,
            alive: Callable[[int], bool] = pid_alive) -> bool:
    """A writer seen within ``live_s`` of ``now_s`` whose process still runs."""
    return 0 <= now_s - seen_at_s <= live_s and alive(pid)


def _sibling(row: dict) -> SiblingCount:
    """A record row as a ``SiblingCount``; ValueError or TypeError where it is not one."""
    count = SiblingCount(int(row["num_threads"]), float(row["speedup"]),
                         float(row["updated_at"]), int(row["verified_passes"]),
                         str(row["writer"]))
    if count.num_threads < 1 or not count.writer:
        raise ValueError(f"num_threads {count.num_threads}, writer {count.writer!r}")
    return count


def siblings_learned(record: HostRecord, scope: Scope, me: str, now_s: float | None = None,
                     live_s: float = LIVE_S, alive: Callable[[int], bool] = pid_alive
                     ) -> dict[int, SiblingCount]:
    """Range (its lowest padded size) -> what a live writer of ``scope`` other than ``me``
    learned for it (the newest per range); empty if the record cannot be read. A row that is
    not a learned count (a corrupt or foreign row) is skipped with a log line."""
    try:
        rows = record.writers_learned(scope)
    except HostRecordError as exc:
        log.warning("siblings_learned_unreadable path=%s error=%s", record.path, exc)
        return {}
    now_s = time.time() if now_s is None else now_s
    out: dict[int, SiblingCount] = {}
    for row in rows:
        try:
            live = row["writer"] != me and is_live(float(row["seen_at"]), int(row["pid"]),
                                                  now_s, live_s, alive)
            lo = int(row["size_lo"])
            if lo < 1 or size_range(lo)[0] != lo:
                raise ValueError(f"size_lo {lo} is no range's lowest size")
            if live:
                out[lo] = _sibling(row)
        except (TypeError, ValueError, KeyError) as exc:
            log.warning("sibling_row_skipped path=%s writer=%r error=%s", record.path,
                        row.get("writer"), exc)
    return out


def starting_counts(siblings: dict[int, SiblingCount], counts: tuple[int, ...],
                    configured: int) -> dict[int, int]:
    """Range -> the count a worker times against the configured one there instead of
    exploring every count: a live sibling's count among this worker's ``counts``, other
    than the configured one (which serves already)."""
    return {lo: s.num_threads for lo, s in sorted(siblings.items())
            if s.num_threads in counts and s.num_threads != configured}
