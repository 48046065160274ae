"""The free cores mode 2's contention following reads (``FreeCpus``, R4.5): a real CPU-bound
process takes about one core off them; this process's own CPU time, that of the processes it
names (its shadow process), and that of processes that yield to it (idle class, nice 15 and
up) counts as free. Real /proc, real processes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from vllm_srun.tuner.cores import CoreShare
from vllm_srun.tuner.free_cpus import FreeCpus, share_of_pool

pytestmark = [pytest.mark.required_in_ci,  # CI runs on Linux
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")]

SPAWN = multiprocessing.get_context("spawn")
SPIN = [sys.executable, "-c", "while True: pass"]
YIELDING = {  # a spinning process that yields to a normal one
    "idle class": "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))",
    "nice 19": "import os; os.nice(19)",
}


def cores_free(free: FreeCpus, seconds: float = 0.5) -> float:
    a, t = free(), time.monotonic()
    time.sleep(seconds)
    b, u = free(), time.monotonic()
    return (b - a) / (u - t)


def held_over(seconds: float = 0.3) -> float:
    """``held`` over one window of ``seconds``, read by hand (its sampler closed)."""
    free = FreeCpus()
    free.close()
    free.sample()
    time.sleep(seconds)
    free.sample()
    return free.held()


def spinning(proc: subprocess.Popen) -> bool:
    """Its CPU time grows (it has started its loop)."""
    def ticks() -> int:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])
    before = ticks()
    time.sleep(0.05)
    return ticks() > before


def test_a_cpu_bound_neighbour_takes_about_one_core_off_the_free_cores():
    free = FreeCpus()
    cores = len(os.sched_getaffinity(0))
    alone = cores_free(free)
    held_alone = held_over()
    hog = subprocess.Popen(SPIN)
    try:
        wait_until(lambda: spinning(hog), 10, "the neighbour to spin")
        free.scan()  # it does not yield: still a neighbour
        beside = cores_free(free)
        held = held_over()
    finally:
        hog.kill()
        hog.wait(10)
        free.close()
    assert alone <= cores + 0.1
    assert alone - beside >= 0.6 and beside <= cores - 0.6, (alone, beside)
    # the core ledger leaves it its core (R4.12)
    assert 0.6 <= held - held_alone <= 1.4, (held_alone, held)


def test_cpu_time_of_the_named_processes_counts_as_free():
    """A spinning child named in ``pids`` (as a worker names its shadow process) leaves the
    free cores as they were; the same child unnamed is a neighbour."""
    child = subprocess.Popen(SPIN)
    try:
        wait_until(lambda: spinning(child), 10, "the child to spin")
        named, unnamed = FreeCpus(lambda: (child.pid,)), FreeCpus()
        named.close()
        unnamed.close()
        # one window for both: what else the host runs meanwhile falls on both alike (two
        # windows one after another, after the heavier tests, once read 0.6 apart or less)
        a, b, t = named(), unnamed(), time.monotonic()
        time.sleep(0.5)
        elapsed = time.monotonic() - t
        gap = ((named() - a) - (unnamed() - b)) / elapsed
    finally:
        child.kill()
        child.wait(10)
    assert gap >= 0.6, gap


@pytest.mark.parametrize("how", list(YIELDING))
def test_a_process_that_yields_to_the_worker_counts_as_free(how):
    """Another server's idle-class shadows running on idle time looked like a neighbour to
    mode 2; a spinning process that yields (found by the scan) leaves the free cores whole."""
    cores = len(os.sched_getaffinity(0))
    quiet = FreeCpus()  # the shared host's own load, side by side (a suite's last test
    quiet.close()  # still tearing down took a third of a core once)
    alone = cores_free(quiet)
    # it says when it yields: its interpreter's start-up burns CPU time before then, so
    # "its CPU time grows" alone let a scan run first and find it still at normal priority
    child = subprocess.Popen(
        [sys.executable, "-c", YIELDING[how] + "\nprint('yielding', flush=True)"
         "\nwhile True: pass"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "yielding"
        wait_until(lambda: spinning(child), 10, "the child to spin")
        free = FreeCpus()  # scans once at once, then every scan_s
        free.close()
        beside = cores_free(free)
    finally:
        child.kill()
        child.wait(10)
    assert beside >= min(alone, cores) - 0.3, (alone, beside)


def test_a_named_process_that_is_gone_counts_nothing():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    free = FreeCpus(lambda: (child.pid,))
    free.close()
    assert free() is not None


def test_a_worker_gets_its_fair_share_of_the_pool_beside_its_siblings():
    """R4.12: siblings are charged what they used up to an equal share of the pool each;
    this worker gets the rest (``share_of_pool``)."""
    assert share_of_pool(8.0, []) == 8.0  # alone: everything free is its own
    assert share_of_pool(64.0, [0.0] * 7) == 64.0  # siblings idle: the whole pool
    assert share_of_pool(8.0, [8.0] * 7) == 8.0  # all busy, no neighbour: 64 / 8
    assert share_of_pool(4.0, [4.0] * 7) == 4.0  # a neighbour on 32 of 64: 32 / 8
    # 2 cores, one sibling holds both and another idles: this one is charged the hog's third
    # only, and the idle sibling's third is left to it too
    assert share_of_pool(0.0, [2.0, 0.0]) == pytest.approx(4 / 3)
    assert share_of_pool(0.0, [1.0, 1.0]) == pytest.approx(2 / 3)  # both busy: a third each


def _sibling_spinning_on(path: str, cpu: int, ready) -> None:
    share = CoreShare.open(path, 8, "sibling")
    os.sched_setaffinity(0, {cpu})
    ready.set()
    try:
        while True:
            pass
    finally:
        share.close()


def test_a_sibling_on_the_core_ledger_is_no_neighbour(tmp_path):
    """A sibling worker (its slot in the core ledger) spinning on one CPU: read beside it as
    a sibling, this worker keeps half that CPU, its equal share; read as a neighbour, it
    keeps none. Both read the same window of that CPU alone (``cpus``)."""
    cpu = min(os.sched_getaffinity(0))
    path, ready = str(tmp_path / "host.cores"), SPAWN.Event()
    sibling = SPAWN.Process(target=_sibling_spinning_on, args=(path, cpu, ready))
    sibling.start()
    share = CoreShare.open(path, 8, "this one")
    try:
        assert ready.wait(60)
        wait_until(lambda: share.sibling_pids() == (sibling.pid,), 10, "the sibling's slot")
        pooled = FreeCpus(cpus={cpu}, siblings=share.sibling_pids)
        alone = FreeCpus(cpus={cpu})
        pooled.close()
        alone.close()
        time.sleep(0.2)  # the sibling spins
        (t0, a0), (_, b0) = pooled.sample(), alone.sample()
        time.sleep(0.5)
        (t1, a1), (_, b1) = pooled.sample(), alone.sample()
        held_pooled, held_alone = pooled.held(), alone.held()
    finally:
        sibling.kill()
        sibling.join(30)
        share.close()
    as_sibling, as_neighbour = (a1 - a0) / (t1 - t0), (b1 - b0) / (t1 - t0)
    assert as_neighbour <= 0.25 and 0.3 <= as_sibling <= 0.7, (as_sibling, as_neighbour)
    # what the core ledger leaves other tasks (``held``): a sibling holds none of it
    assert held_pooled <= 0.3 and held_alone >= 0.7, (held_pooled, held_alone)
    assert share.sibling_pids() == ()  # closed: no ledger to read


def test_the_free_cpus_resolution_counts_each_rounded_counter_it_sums():
    """Each CPU's idle and iowait, each process's user and system time: a tick each, rounded
    at both readings (variance 1/6 tick squared per counter)."""
    cpus = os.sched_getaffinity(0)
    free = FreeCpus(cpus=cpus)
    free.close()
    assert free.resolution_s() == 0.0  # one reading: no difference yet
    free.sample()
    counters = 6 * (free.resolution_s() * os.sysconf("SC_CLK_TCK")) ** 2
    # this process, and any idle-class or niced one the host runs now (each yields to it)
    assert counters >= 2 * len(cpus) + 2 - 1e-6
    assert counters == pytest.approx(round(counters / 2) * 2)


def test_what_the_held_reading_cannot_resolve_reads_as_nothing_held():
    """The core ledger's reading of the cores other tasks hold (R4.12) follows the rounding
    as the worker's own does: under twice its standard deviation, nothing is held. 64 CPUs,
    160 rounded counters over 0.1 s: sd 0.52 core; a pool that read 63.2 free cores holds
    nothing, one that read 62 holds 2 less 1.03 cores."""
    from vllm_srun.tuner.free_cpus import held_cores

    sd = (160 / 6) ** 0.5 / 100 / 0.1  # ticks of 10 ms over a 0.1-s window, in cores
    assert held_cores(64, 63.2, sd) == 0.0
    assert held_cores(64, 62.0, sd) == pytest.approx(2.0 - 2 * sd)
    assert held_cores(2, 1.0, 0.0) == 1.0  # an exact reading: the deficit itself
