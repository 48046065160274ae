"""A shadow's run delay is its forward's own threads' (R4.5): ``tuner/run_delay.py``."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from vllm_srun.tuner.run_delay import RunDelay, forward_wait_s

MS = 1_000_000  # ns


def test_only_the_threads_that_ran_the_forward_count_each_up_to_its_wall_time():
    """Of the threads the process holds, the ``threads`` that ran longest are the forward's;
    a pool thread of another count that waited all along (spinning, runnable) is not, and no
    thread's wait counts for more than the forward's wall time."""
    before = {"main": (0, 0), "lane": (0, 0), "spinner": (0, 0)}
    after = {"main": (1 * MS, 0), "lane": (9 * MS, 2 * MS), "spinner": (1 * MS, 40 * MS),
             "pool": (8 * MS, 30 * MS)}  # "pool" started during the forward
    assert forward_wait_s(before, after, 1, 0.010) == pytest.approx(0.002)
    assert forward_wait_s(before, after, 2, 0.010) == pytest.approx(0.002 + 0.010)
    assert forward_wait_s(None, after, 1, 0.010) is None
    assert forward_wait_s(before, None, 1, 0.010) is None


def _hash_for(seconds: float) -> None:
    data = b"x" * (1 << 20)  # hashlib lets go of the GIL for inputs this large
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hashlib.sha256(data).digest()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_on_one_busy_cpu_the_forward_waits_no_longer_than_it_ran():
    """Real kernel counters: four CPU-bound threads of this process share one CPU for
    ``wall``. Summed over every thread of the process (the old rule) their waits come to
    about three times ``wall``, which made every shadow on a busy host read as preempted and
    cost nothing; the forward's own thread waited at most ``wall``."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # this thread; the threads below inherit it
    try:
        rd = RunDelay()
        wall = 0.6
        others = [threading.Thread(target=_hash_for, args=(wall + 0.3,)) for _ in range(3)]
        for t in others:
            t.start()
        time.sleep(0.05)
        before = rd.snapshot()
        start = time.monotonic()
        _hash_for(wall)
        wall_s = time.monotonic() - start
        after = rd.snapshot()
        for t in others:
            t.join()
    finally:
        os.sched_setaffinity(0, cpus)
    assert before is not None and after is not None
    every_thread_s = sum(w - before.get(tid, (0, 0))[1] for tid, (_, w) in after.items()) / 1e9
    assert every_thread_s > 1.5 * wall_s, every_thread_s  # the host really was busy
    waited = forward_wait_s(before, after, 1, wall_s)
    assert 0.0 < waited <= wall_s
