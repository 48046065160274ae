"""Workers of one host share its cores (R4.12): the core ledger with real processes and a real
file, the pure grant rule, the per-worker cadence that keeps readings and reactions out of
step. (A real multi-replica deployment opening one ledger: tests/test_pool.py, the seed's
placement; what siblings of a scope learned: tests/test_siblings.py.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest

from vllm_srun.runtime.engine import FixedThreads
from vllm_srun.tuner import cadence
from vllm_srun.tuner.core_ledger import SLOTS
from vllm_srun.tuner.core_rules import HELD_SLACK, SharedCores, fair_share, grant, room
from vllm_srun.tuner.cores import CoreShare, CoreShareError

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fcntl OFD locks")
SPAWN = multiprocessing.get_context("spawn")
BUDGET = 8


# -- the pure rule -----------------------------------------------------------------------

@pytest.mark.parametrize(("want", "floor", "others", "budget", "granted"), [
    (4, 1, 4, 8, 4),   # fits exactly
    (4, 1, 5, 8, 1),   # one over: the configured count
    (1, 2, 64, 8, 1),  # below the configured count, nothing below it: always
    (2, 2, 64, 8, 2),  # the configured count, nothing below it: always, even past the budget
    (16, 4, 0, 16, 16),
    (16, 4, 1, 16, 4),
])
def test_grant_allows_a_higher_count_only_within_the_budget(want, floor, others, budget,
                                                           granted):
    """R4.12: a count above the configured one only while all workers' threads stay within
    the budget; the configured count (exact at every vouched count) otherwise."""
    assert grant(want, floor, others, 0, budget) == granted


@pytest.mark.parametrize(("want", "floor", "others", "idle", "room_", "lower", "granted"), [
    (8, 8, 56, 0, 60, (1, 2, 4), 4),   # the configured count does not fit: the largest that does
    (8, 8, 60, 0, 60, (1, 2, 4), 1),   # none fits: the smallest it may serve
    (8, 8, 60, 0, 60, (), 8),          # nothing below it may serve: the configured count
    (16, 8, 50, 0, 60, (1, 2, 4), 8),  # above the configured count: the configured one fits
    (16, 8, 53, 0, 60, (1, 2, 4), 4),  # ... and below it
    (4, 8, 56, 0, 60, (1, 2), 4),      # fits: as wanted
    (8, 8, 0, 3, 8, (1, 2, 4), 4),     # three idle workers keep a share (1 thread) each
    (16, 8, 0, 7, 64, (1, 2, 4), 16),  # ... and on 64 cores take nothing a worker needs
])
def test_grant_serves_the_largest_count_below_that_fits_where_the_tuner_offers_them(
        want, floor, others, idle, room_, lower, granted):
    """R4.12 with mode 2's vouched counts below the wanted one (``lower``): a worker serves
    at most what the room leaves it, less the share each other worker idle now keeps (1
    thread here; its fair share in the ledger, below), at the configured count too, as long
    as a count that answers the same fits."""
    assert grant(want, floor, others, idle, room_, lower) == granted


@pytest.mark.parametrize(("want", "others", "idle", "room_", "workers", "granted"), [
    (8, 0, 7, 35, 8, 4),   # a neighbour on 29 of 64 cores: 7 idle workers keep 4 each
    (8, 0, 7, 64, 8, 8),   # no neighbour: 8 each fits
    (8, 2, 6, 35, 8, 8),   # a busy worker on 2 (below its 4) leaves the rest of its share
    (8, 12, 5, 35, 8, 2),  # busy ones above their share: what is left
    (16, 0, 1, 16, 2, 8),  # two workers on 16 cores
])
def test_an_idle_worker_keeps_its_fair_share_of_the_room(want, others, idle, room_, workers,
                                                         granted):
    """R4.12: each other worker idle now keeps its fair share of the room (the room over
    the live workers, at least 1), not one thread: with one thread kept, the workers that
    claimed first took 8 each beside a neighbour on half the cores and left the last ones
    1 or 2 (simulated, 64 cores, 8 workers)."""
    share = fair_share(room_, workers)
    assert grant(want, 1, others, idle, room_, (1, 2, 4, 8), share) == granted
    assert (fair_share(35, 8), fair_share(4, 8), fair_share(64, 0)) == (4, 1, 64)


@pytest.mark.parametrize(("budget", "held", "expected"), [
    (64, None, 64),  # unread: the budget
    (64, 32.0, 32),  # a neighbour on half the cores
    (64, 0.4, 64),   # a few tenths (the front end, a client): within the slack
    (2, 1.0, 1),     # a CPU-bound process on one of two cores
    (2, 5.0, 1),     # the host is full: still one thread
])
def test_the_room_is_the_budget_less_what_other_tasks_hold(budget, held, expected):
    assert room(budget, held) == expected
    assert HELD_SLACK == 0.5


# -- the ledger with real processes ------------------------------------------------------

def _claim_in_a_loop(path: str, start, seconds: float, seed: int, out) -> None:
    """Claim 3-6 threads over and over (configured 0: a refusal holds nothing) and, while
    holding a grant, read what all workers hold: puts (most seen, grants, refusals)."""
    share = CoreShare.open(path, BUDGET, f"w{seed}", linger_s=0.0)
    start.wait(60)  # every process has opened the ledger
    most = granted = refused = 0
    end, want = time.monotonic() + seconds, 3 + seed % 4
    while time.monotonic() < end:
        if share.claim(want, 0):
            most = max(most, share.in_use_locked())
            granted += 1
        else:
            refused += 1
        share.release()
        want = 3 + (want + 1) % 4
    share.close()
    out.put((most, granted, refused))


@linux
def test_workers_claiming_at_once_never_hold_more_than_the_budget(tmp_path):
    """Four processes claim in a tight loop on one ledger: each, while it holds a grant, reads
    the threads all of them hold, and no reading passes the budget; grants and refusals both
    happen (they did contend)."""
    path = str(tmp_path / "host.cores")
    start, out = SPAWN.Barrier(4), SPAWN.Queue()
    procs = [SPAWN.Process(target=_claim_in_a_loop, args=(path, start, 1.5, seed, out))
             for seed in range(4)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            p.kill()
    assert max(most for most, _, _ in results) <= BUDGET, results
    assert sum(g for _, g, _ in results) > 100 and sum(r for _, _, r in results) > 100, results


def _hold_a_claim(path: str, ready) -> None:
    share = CoreShare.open(path, BUDGET, "doomed")
    if share.claim(4, 1) == 4:  # fits beside the idle survivor's share (8 over 2)
        ready.set()
    time.sleep(600)  # killed mid-forward


@linux
def test_a_worker_killed_holding_a_claim_is_reclaimed(tmp_path):
    """A worker SIGKILLed while its forward holds 4 of 8 threads: while it lives, another is
    refused 6 (and its slot is not taken for dead); once it is dead, the next refusal clears
    its slot and the grant passes."""
    path = tmp_path / "host.cores"
    ready = SPAWN.Event()
    doomed = SPAWN.Process(target=_hold_a_claim, args=(str(path), ready))
    doomed.start()
    share = CoreShare.open(path, BUDGET, "survivor", reap_s=0.0)
    try:
        assert ready.wait(60)
        assert share.claim(6, 1) == 1  # alive: its 4 count
        assert share.tally.reaped == 0 and doomed.pid in [s.pid for s in share.slots()]
        share.release()
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(30)
        assert share.claim(6, 1) == 6
        assert share.tally.reaped == 1 and [s.pid for s in share.slots()] == [os.getpid()]
    finally:
        share.close()
        doomed.kill()


@linux
def test_a_forward_just_ended_still_counts_for_its_linger(tmp_path):
    """Under load a worker's next forward follows the last at once: its threads count for
    others ``linger_s`` after it ended, then no more."""
    path = tmp_path / "host.cores"
    busy = CoreShare.open(path, BUDGET, "busy", linger_s=3600.0)
    idle = CoreShare.open(path, BUDGET, "idle", linger_s=0.0)
    other = CoreShare.open(path, BUDGET, "other")
    try:
        assert busy.claim(4, 1) == 4  # the two idle keep 2 each (8 over 3 workers)
        busy.release()
        assert other.claim(4, 1) == 1  # 4 lingering + 2 for the idle one + 4 > 8
        other.release()
        idle.claim(6, 1)
        idle.release()
        busy.close()
        assert other.claim(4, 1) == 4  # ended with no linger: free
    finally:
        idle.close()
        other.close()


@linux
def test_the_configured_count_is_never_refused_and_close_frees_the_slot(tmp_path):
    path = tmp_path / "host.cores"
    a, b = CoreShare.open(path, 2, "a"), CoreShare.open(path, 2, "b")
    assert a.claim(2, 2) == 2 and b.claim(2, 2) == 2 and a.in_use() == 4
    assert {(s.threads, s.configured) for s in a.slots()} == {(2, 2)}
    b.close()
    assert [s.pid for s in a.slots()] == [os.getpid()] and a.in_use() == 2
    a.close()


@linux
def test_a_full_ledger_and_a_foreign_file_are_refused_with_the_path(tmp_path):
    foreign = tmp_path / "not-a-ledger"
    foreign.write_bytes(b"hello")
    with pytest.raises(CoreShareError, match="not-a-ledger is not a core ledger"):
        CoreShare.open(foreign, BUDGET, "w")
    assert foreign.read_bytes() == b"hello"  # left as it was
    with pytest.raises(CoreShareError, match="budget must be a positive integer"):
        CoreShare.open(tmp_path / "x.cores", 0, "w")
    shares = [CoreShare.open(tmp_path / "full.cores", BUDGET, f"w{i}") for i in range(SLOTS)]
    try:
        with pytest.raises(CoreShareError, match="full.cores is full"):
            CoreShare.open(tmp_path / "full.cores", BUDGET, "one more")
    finally:
        for share in shares:
            share.close()


@linux
def test_shared_cores_serves_the_configured_count_when_the_host_is_full(tmp_path):
    """The policy wrapper a worker's engine runs: the wanted count while it fits, else the
    configured one, counted in ``limited``; ``observe`` releases the slot."""
    path = tmp_path / "host.cores"
    neighbour = CoreShare.open(path, BUDGET, "neighbour")
    policy = SharedCores(FixedThreads(4), CoreShare.open(path, BUDGET, "w", linger_s=0.0),
                         configured=2)
    try:
        assert policy.served_threads(None) == 4
        policy.observe(None, None)
        neighbour.claim(5, 5)  # its configured count: never refused
        assert policy.served_threads(None) == 2 and policy.limited == 1
        policy.observe(None, None)
        assert neighbour.in_use() == 5
    finally:
        policy.close()
        neighbour.close()


class _Offering(FixedThreads):
    """A fixed count that may also serve the counts below it (as mode 2's vouched ones)."""

    def lower_counts(self, batch, n):
        return tuple(c for c in (1, 2, 4, 8) if c < n)


@linux
def test_the_room_leaves_other_tasks_their_cores_and_mode_2_serves_below_the_configured(
        tmp_path):
    """R4.12: a neighbour (not a worker) holding 3 of 8 cores leaves the workers 5. A worker
    configured 4 beside a sibling serving 2: its configured count does not fit (2 + 4 > 5),
    so it serves the largest count below it that answers the same and fits (2); a worker
    with nothing below to serve keeps its configured count; with the reading gone, the
    budget alone."""
    path, held = tmp_path / "host.cores", [3.0]
    sibling = CoreShare.open(path, BUDGET, "sibling")
    share = CoreShare.open(path, BUDGET, "w", linger_s=0.0, held=lambda: held[0])
    policy = SharedCores(_Offering(4), share, configured=4)
    try:
        assert share.room_now() == 5
        sibling.claim(2, 2)
        assert policy.served_threads(None) == 2 and policy.limited == 1
        policy.observe(None, None)
        assert share.claim(4, 4) == 4  # nothing below offered: the configured count
        share.release()
        held[0] = None
        assert share.room_now() == BUDGET and policy.served_threads(None) == 4
        policy.observe(None, None)
    finally:
        policy.close()
        sibling.close()


# -- out of step ---------------------------------------------------------------------------

def test_each_worker_reads_at_its_own_phase_and_jitter():
    """R4.12: two workers' readings start at different offsets and wait differently; the
    same id draws the same ones again (a replay)."""
    a, b = cadence.waits("primary-0", 0.05), cadence.waits("primary-1", 0.05)
    first_a = [next(a) for _ in range(50)]
    first_b = [next(b) for _ in range(50)]
    again = cadence.waits("primary-0", 0.05)
    assert [next(again) for _ in range(50)] == first_a
    assert first_a[0] != first_b[0] and first_a[1:] != first_b[1:]
    assert all(0 <= w[0] < 0.05 for w in (first_a, first_b))
    assert all(0.04 <= w <= 0.06 for w in first_a[1:] + first_b[1:])


def test_a_worker_reacts_only_when_its_readings_agree_past_its_own_delay():
    worker = "primary-0"
    state = cadence.Reaction()
    for t in (0.0, 0.1):  # two readings say react, then one does not: nothing changes
        state = cadence.react(state, True, t, worker, spread_s=0.0)
    state = cadence.react(state, False, 0.2, worker, spread_s=0.0)
    assert not state.on and state.disagreeing == 0
    delay = cadence.delay_s(worker, 0)
    assert 0 <= delay < cadence.SPREAD_S and delay == cadence.delay_s(worker, 0)
    t, first = 1.0, 1.0
    while t < first + max(delay, 0.2) - 0.05:  # agreeing, but within its delay
        state = cadence.react(state, True, t, worker)
        assert not state.on, t
        t += 0.1
    state = cadence.react(state, True, first + max(delay, 0.2), worker)
    assert state.on and state.changes == 1
    # another change no sooner than HOLD_S after it, whatever the readings say
    state = cadence.react(state, False, state.changed_at_s + 0.1, worker, agree=1,
                          spread_s=0.0)
    assert state.on


def _settle(workers: int, room: int, steps: int, **damping) -> tuple[int, int]:
    """``workers`` read in 0.1-s windows whether the host has room for one more to take
    more threads (``room`` may); each reacts by ``react``. (Workers that took more threads,
    changes made in all.)"""
    states = [cadence.Reaction() for _ in range(workers)]
    for step in range(steps):
        on = sum(s.on for s in states)
        states = [cadence.react(s, on - s.on < room, step * 0.1, f"primary-{i}", **damping)
                  for i, s in enumerate(states)]
    return sum(s.on for s in states), sum(s.changes for s in states)


def test_workers_seeing_one_change_of_the_host_do_not_herd():
    """Room on the host for 2 of 8 workers to take more threads: with the damping they
    settle at 2 after a few changes; reacting at the first reading, all 8 take it, all give
    it back, and so on (what the damping prevents)."""
    on, changes = _settle(8, 2, 300)
    assert on == 2 and changes <= 6, (on, changes)
    herd_on, herd_changes = _settle(8, 2, 300, agree=1, spread_s=0.0, hold_s=0.0)
    assert herd_changes >= 100, (herd_on, herd_changes)
