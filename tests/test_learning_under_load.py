"""R4.5 and R4.6 (amended) under real load: a busy worker learns every range it serves while
the load lasts. Served forwards of a range still exploring are its timing samples, with the
shadow process frozen (SIGSTOP) while they run; mode 2, where load leaves shadows no clean
gap, serves vouched counts in turn to time them. Real L3 on onnxruntime, the real engine,
tuner, voucher sweep and SCHED_IDLE shadow process (what a deployment wires)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import L3, poll, row, wait_until
from vllm_srun.records.host_record import HostRecord, Scope
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings, output_bits
from vllm_srun.tuner.estimator import EARLY, losing_counts
from vllm_srun.tuner.free_cpus import FreeCpus
from vllm_srun.tuner.golden import golden_rows
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import preempted
from vllm_srun.tuner.report import build, from_tuner
from vllm_srun.tuner.shadows import ShadowProcess
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep, sweep

pytestmark = [pytest.mark.required_in_ci,  # CI runs on Linux
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, /proc")]


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: [0] the state, [11] and [12]
    user and system CPU ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_a_frozen_shadow_process_runs_nothing_until_thawed():
    shadows = ShadowProcess(resolve(L3), "onnxruntime")
    pid = shadows.process.pid
    pool = ThreadPoolExecutor(1)
    try:
        batch = pad([row(200)])
        first = shadows.forward(batch, 1)  # loaded and warm
        assert shadows.pause(True)
        pending = pool.submit(shadows.forward, batch, 2)
        time.sleep(0.5)
        ticks = proc_stat(pid)[11:13]
        time.sleep(1.0)
        assert proc_stat(pid)[0] == "T" and not pending.done()
        assert proc_stat(pid)[11:13] == ticks  # no CPU at all while frozen
        shadows.pause(False)
        second = pending.result(timeout=60)
        assert np.array_equal(output_bits(first.outputs), output_bits(second.outputs))
    finally:
        shadows.pause(False)
        pool.shutdown()
        shadows.close()
    assert not shadows.process.is_alive()


def test_a_frozen_shadow_process_dies_with_its_worker(tmp_path):
    """SIGKILL the worker while its shadow process is frozen: the kernel kills the child
    (PR_SET_PDEATHSIG with SIGKILL, which a stopped process cannot ignore)."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from vllm_srun.runtime.artifact import resolve
        from vllm_srun.runtime.engine import pad
        from vllm_srun.tuner.shadows import ShadowProcess

        if __name__ == "__main__":
            shadows = ShadowProcess(resolve(sys.argv[1]), "onnxruntime")
            shadows.forward(pad([[101, 2000, 102]]), 1)
            shadows.pause(True)
            print(shadows.process.pid, flush=True)
            time.sleep(600)
    """))
    worker = subprocess.Popen([sys.executable, str(script), L3], stdout=subprocess.PIPE,
                              text=True, cwd=tmp_path)
    try:
        child = int(worker.stdout.readline())
        wait_until(lambda: proc_stat(child)[0] == "T", 30, "the shadow process frozen")
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)

        def gone() -> bool:
            try:
                return proc_stat(child)[0] == "Z"  # dead, not yet reaped by init
            except FileNotFoundError:
                return True

        wait_until(gone, 30, "the frozen shadow process to die with its worker")
    finally:
        worker.kill()
        worker.wait(30)


def shadowed_runner(manifest, backend, mode: AdaptiveMode, scope: Scope, record: HostRecord,
                    settings: TunerSettings, args: EngineArgs, on_forward=None,
                    pause=None, free_cpus: bool = True):
    """A runner with the tuner wired as a deployment wires it: shadows in the SCHED_IDLE
    child process, frozen beside timed forwards (``pause``: the test may wrap it), the free
    cores read from /proc (``free_cpus``; without, nothing is scaled by them)."""
    shadows = ShadowProcess(manifest, "onnxruntime")
    runner = Runner(manifest, backend, args, on_forward=on_forward)
    free = FreeCpus(lambda: (shadows.process.pid,)) if free_cpus else None

    def close() -> None:
        if free is not None:
            free.close()
        shadows.close()

    tuner = AdaptiveThreads(mode, 1, (1, 2), scope, record, runner.engine.forward_batch,
                            settings, shadow_forward=shadows.forward, on_close=close,
                            pause_shadows=pause(shadows) if pause else shadows.pause,
                            free_cpu_s=free.latest if free is not None else None)
    runner.engine.threads = tuner
    runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer)))
    return runner, tuner, shadows


def hog() -> subprocess.Popen:
    """A CPU-bound neighbour at normal priority (a real one: the kernel schedules it)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def why_pending(tuner) -> dict:
    """What holds due shadows back, for a test that waited for them in vain: each job's
    counts and backoff, the gate's, the freezer, what runs, the tally, the host's load."""
    with tuner.lock:
        now = tuner.clock()
        flight = tuner.flight
        return {
            "jobs": {lo: (job.counts, job.retries, round(job.not_before - now, 2))
                     for lo, job in tuner.learner.board.jobs.items()},
            "backoff_s": round(tuner.gate.backoff.after_s - now, 2),
            "quiet_s": round(tuner.gate.quiet(now), 3),
            "idle_s": round(now - tuner.gate.idle_since, 2),
            "frozen": (tuner.side.freezer.running, tuner.side.freezer.held),
            "flight": (flight.busy, flight.shadowing, flight.held_until, flight.claim_until),
            "side_error": tuner.side.error, "tally": vars(tuner.tally),
            "loadavg": open("/proc/loadavg").read().strip(),
        }


def test_a_shadow_that_waited_for_a_cpu_another_task_held_is_not_a_sample(tmp_path):
    """R4.5: an idle-class shadow at 2 threads beside a CPU-bound neighbour loses a CPU to it
    and runs many times slower; its time is the neighbour's, not the count's. The shadow
    process measures how long its threads waited (schedstat) and the tuner keeps no such
    sample; once the neighbour leaves, the count is timed."""
    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    runner, tuner, shadows = shadowed_runner(
        manifest, backend, AdaptiveMode.LEARN,
        Scope("test-host", manifest.revision, "onnxruntime"), HostRecord(tmp_path / "r.sqlite"),
        TunerSettings.of(min_samples=3, window=3, budget_fraction=1.0),
        EngineArgs(num_threads=1, cache_entries=0))
    lo = size_range(120)[0]

    def samples(n: int) -> int:
        return len(tuner.learner.ranges[lo].samples.get(n, ())) if lo in tuner.learner.ranges else 0

    neighbour = None
    try:
        batch = pad([row(120)])
        quiet = []  # the shared host's other tasks can hold a CPU for a while: up to 30 tries
        while len(quiet) < 30 and not any(not preempted(r.forward_s, r.waited_s)
                                          for r in quiet):
            quiet.append(shadows.forward(batch, 2))
        assert all(r.waited_s is not None for r in quiet)
        assert any(not preempted(r.forward_s, r.waited_s) for r in quiet), \
            [(r.forward_s, r.waited_s) for r in quiet]
        neighbour = hog()
        time.sleep(0.3)
        busy = shadows.forward(batch, 2)
        assert preempted(busy.forward_s, busy.waited_s), (busy.forward_s, busy.waited_s)
        for i in range(6):  # paced: each batch's shadows run before the next
            runner.engine.submit([row(120, i)]).result(timeout=60)
            wait_until(lambda i=i: tuner.pending_shadows() == 0 or tuner.tally.preempted > i, 60)
        assert tuner.tally.preempted >= 1 and samples(2) == 0, (tuner.tally.preempted, samples(2))
        assert tuner.ledger.comparisons >= 1  # still compared bit for bit, only not timed
        neighbour.kill()
        neighbour.wait(10)
        neighbour = None
        for i in range(6, 30):
            runner.engine.submit([row(120, i)]).result(timeout=60)
            if samples(2) >= 3:
                break
            assert poll(lambda: tuner.pending_shadows() == 0, 60, 0.1), why_pending(tuner)
        assert samples(2) >= 1 and tuner.ledger.retired is None
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait(10)
        runner.stop()


def test_an_idle_worker_backs_off_a_shadow_that_other_tasks_cpus_held_up(tmp_path):
    """R4.5: a worker with no traffic of its own is always idle, so idle time cannot space out
    the retries of a 2-thread shadow (it shares the cores of a 1-thread served forward) that a
    CPU-bound task elsewhere held up. Each such try runs beside that task and costs it (here
    another server, measured next, was 15-20% slower), so after one that the task held up
    for half its time or more (``held_hog``; else after ``held_streak`` in a row) the next
    waits 0.1 s, then twice as long each time, up to ``held_backoff_max_s``; once the task
    is gone the count is timed."""
    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    runner, tuner, _ = shadowed_runner(
        manifest, backend, AdaptiveMode.LEARN,
        Scope("test-host", manifest.revision, "onnxruntime"), HostRecord(tmp_path / "r.sqlite"),
        TunerSettings.of(min_samples=3, budget_fraction=1.0),
        EngineArgs(num_threads=1, cache_entries=0))
    lo = size_range(120)[0]
    neighbour = None
    try:
        wait_until(lambda: tuner.side.warm, 60, "the shadow side warm")
        neighbour = hog()
        time.sleep(0.3)
        runner.engine.submit([row(120)]).result(timeout=60)
        time.sleep(6)  # no traffic: only the backoff spaces the tries out
        with tuner.lock:
            tries = tuner.tally.preempted
        neighbour.kill()
        neighbour.wait(10)
        neighbour = None
        # one clean try times the count; on a shared host a try may still be held up by
        # something else and back off again (up to ``held_backoff_max_s``), so allow several
        if not poll(lambda: tuner.learner.ranges[lo].samples.get(2), 90, 0.1):
            with tuner.lock:
                raise AssertionError(f"2 threads not timed 90 s after the neighbour left: "
                                     f"{tuner.tally}, load {os.getloadavg()}")
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait(10)
        runner.stop()
    print(f"tries held up in 6 s: {tries}")
    # the hog holds a CPU throughout each try, so each backs off: 0.1 + 0.2 + ... + 3.2 s,
    # at most 7 in 6 s (measured: 7); 9 if it let go of some (then 3 in a row first, and
    # 0.1 + ... + 1.6 s), plus the 1-thread one, not retried
    assert 1 <= tries <= 9, tries


def test_mode2_under_saturation_learns_every_range_it_serves_while_the_load_lasts(tmp_path):
    """16 clients keep the engine busy; its micro-batches reach ranges no single request
    does. Every range the load keeps reaching gets a learned count before it stops; served
    forwards are samples (the shadow side frozen for each, thawed after, never left frozen)
    and, where shadows kept overlapping, mode 2 served the vouched counts in turn to time
    them. Every shadow and audit agreed bit for bit with the served answer."""
    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    record = HostRecord(tmp_path / "r.sqlite")
    scope = Scope("test-host", manifest.revision, "onnxruntime")
    plan = plan_sweep(ShapeBounds(max_rows=8, max_len=40, max_padded=320))  # the engine's
    swept = sweep(lambda b, n: backend.forward(b, n), 1, (1, 2), plan.shapes)
    assert swept.mismatches == 0 and swept.comparisons > 250
    record.add_voucher(scope, "verify", swept.comparisons, 0, plan.coverage((1, 2)))

    pauses: list[bool] = []

    def recorded(shadows: ShadowProcess):
        def pause(frozen: bool) -> bool:
            done = shadows.pause(frozen)
            if done or not frozen:  # not a freeze asked before the child can die with us
                pauses.append(frozen)
            return done
        return pause

    forwards = []
    runner, tuner, shadows = shadowed_runner(
        manifest, backend, AdaptiveMode.SERVE, scope, record,
        TunerSettings.of(min_samples=3, window=3, budget_fraction=1.0),
        EngineArgs(num_threads=1, max_num_seqs=8, max_num_batched_tokens=320, cache_entries=0),
        on_forward=forwards.append, pause=recorded)
    stop = threading.Event()

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        while not stop.is_set():
            runner.engine.submit([row(int(rng.integers(20, 41)), int(rng.integers(1e9)))]) \
                .result(timeout=60)

    def served_under_load() -> set[int]:
        """Ranges the load keeps reaching (not the few forwards of its first moments)."""
        counts = Counter(size_range(f.padded_tokens)[0] for f in list(forwards))
        return {lo for lo, n in counts.items() if n >= 20}

    def all_reached_learned() -> bool:
        return all((r := tuner.learner.ranges.get(lo)) is not None and r.learned is not None
                   for lo in served_under_load())

    clients = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        for c in clients:
            c.start()
        try:
            wait_until(lambda: len(forwards) > 200 and all_reached_learned(), 90)
        except TimeoutError:
            raise AssertionError(("not every range the load reached was learned under load",
                                  tuner.tally.served_samples, tuner.tally.explored,
                                  tuner.tally.uncovered, {
                lo: (r.learned, r.explore_served, {n: len(v) for n, v in r.samples.items()})
                for lo, r in sorted(tuner.learner.ranges.items())})) from None
        during = (len(forwards), tuner.tally.served_samples, tuner.tally.explored,
                  tuner.tally.discarded)
        reached = sorted(served_under_load())
        state = {lo: (r.learned, r.explore_served, {n: len(v) for n, v in r.samples.items()})
                 for lo, r in sorted(tuner.learner.ranges.items())}
        stop.set()
        for c in clients:
            c.join(60)
        # the audits of what it served while exploring, and the window, run as shadows
        wait_until(lambda: tuner.ledger.comparisons > 0, 60, "a shadow once the load stopped")
    finally:
        stop.set()
        runner.stop()
    print(f"ranges reached {reached}; under load: forwards, served samples, explored, "
          f"discarded = {during}; {state}")
    assert [lo for lo in reached if lo >= 256], reached  # batches no single request makes
    assert during[1] > 0  # served forwards timed themselves
    assert tuner.ledger.retired is None and tuner.ledger.comparisons > 0
    # never left frozen; a run in which no shadow was in flight beside a timed forward
    # froze nothing (1 run of 8 here, before and after onnxruntime's pools stopped spinning)
    assert not pauses or pauses[-1] is False
    assert all(a != b for a, b in zip(pauses, pauses[1:], strict=False))  # freeze, thaw, ...
    if any(r.explore_served for r in tuner.learner.ranges.values()):
        assert during[2] > 0 and any(f.num_threads == 2 for f in forwards)
    assert not os.path.exists(f"/proc/{shadows.process.pid}/task")  # closed: gone


def test_mode2_without_a_sweep_verifies_the_shapes_it_serves_from_the_share_under_load(
        tmp_path):
    """R4.8, R4.5 amended: a mode-2 worker with no voucher, kept busy by 16 clients (no idle
    time to verify shapes in), verifies the shapes it serves most, paid from the learning
    share: each one's answers at 1 and 2 threads compared bit for bit and recorded one by
    one (the most served against the answer served for them), the share's bound kept.
    Without, such a worker served the configured count for every shape its shadows had not
    happened to compare."""
    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    record = HostRecord(tmp_path / "r.sqlite")
    scope = Scope("test-host", manifest.revision, "onnxruntime")
    # a share above the default's 2%: paid timing shadows come first, and beside a CPU-bound
    # neighbour (run slow, charged what they ran) they overdrew 2% for the whole 90 s; how
    # fast the default share covers a real load is the bench's (``bench.mode2_coverage``)
    runner, tuner, _ = shadowed_runner(
        manifest, backend, AdaptiveMode.SERVE, scope, record, TunerSettings.of(learning_share=0.2),
        EngineArgs(num_threads=1, max_num_seqs=4, max_num_batched_tokens=240, cache_entries=0))
    stop = threading.Event()

    def client(i: int) -> None:  # lengths of 8-60 tokens: more shapes than shadows compare
        rng = np.random.default_rng(i)
        while not stop.is_set():
            runner.engine.submit([row(int(rng.integers(8, 61)), int(rng.integers(1e9)))]) \
                .result(timeout=60)

    def state() -> dict:
        v, paid = tuner.side.verifier, tuner.side.paid
        return {"paid": v.verified_paid, "idle": v.verified, "runs": v.runs,
                "against served answers": v.against_served, "kept": len(v.kept),
                "unverified served": len(v.seen), "comparisons": tuner.ledger.comparisons,
                "credit": paid.credit_s, "ranges": paid.range_credit_s,
                "frozen": tuner.side.freezer.running, "learning": tuner.ledger.learning}

    clients = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        for c in clients:
            c.start()
        try:
            wait_until(lambda: tuner.side.verifier.verified_paid >= 1
                       and tuner.side.verifier.against_served >= 1, 120)
        except TimeoutError:
            raise AssertionError(("no shape verified from the share", state())) from None
        stop.set()
        for c in clients:
            c.join(60)
        tuner.flush()
        paid, learning = tuner.side.paid, build(from_tuner(tuner))["learning"]
    finally:
        stop.set()
        runner.stop()
    verified = record.voucher(scope).verified
    assert learning["shapes_verified_paid"] >= 1 and verified, verified
    assert all(c == 1 and n == 2 for _, _, n, c in verified)  # 2 threads against 1
    assert tuner.ledger.retired is None and record.voucher(scope).clean
    # the share's bound: its share of served forward time, the bucket's cap, one overrun
    assert paid.paid_s <= paid.share * paid.served_s + paid.cap_s + 0.5, (paid.paid_s,
                                                                          paid.served_s)


def test_mode2_gives_way_to_a_neighbour_and_takes_its_count_back_when_it_leaves(tmp_path):
    """R4.13: mode 2 serving a learned 2 threads (vouched): a CPU-bound neighbour takes a
    core, 2 threads run ~2x slower while 1 thread does not slow, and the free cores read from
    /proc say so: by the load factor (``samples.load_factor``: 2x at 2 threads, 1x at 1)
    1 thread is faster, and serves within a few windows; 2 threads serve again once the
    neighbour leaves and the next window reads its core free. Nothing probes, and a
    neighbour this brief relearns nothing. Real L3 on onnxruntime, a real neighbour process,
    the real SCHED_IDLE shadow process."""
    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    record = HostRecord(tmp_path / "r.sqlite")
    scope = Scope("test-host", manifest.revision, "onnxruntime")
    plan = plan_sweep(ShapeBounds(max_rows=1, max_len=130, max_padded=130))
    swept = sweep(lambda b, n: backend.forward(b, n), 1, (1, 2), plan.shapes)
    assert swept.mismatches == 0
    record.add_voucher(scope, "verify", swept.comparisons, 0, plan.coverage((1, 2)))
    forwards = []
    runner, tuner, _ = shadowed_runner(
        manifest, backend, AdaptiveMode.SERVE, scope, record,
        TunerSettings.of(min_samples=6, window=3, budget_fraction=1.0),
        EngineArgs(num_threads=1, cache_entries=0), on_forward=forwards.append)
    lo = size_range(128)[0]
    salt = iter(range(10**6))

    def serve(n: int) -> list[int]:
        """Counts of ``n`` forwards of 128 padded tokens, one client."""
        start = len(forwards)
        for _ in range(n):
            runner.engine.submit([row(128, next(salt))]).result(timeout=60)
        return [f.num_threads for f in forwards[start:]]

    neighbour = None
    try:
        for _ in range(60):  # learn, pass the window: 2 threads serve (1.7x faster here)
            serve(5)
            if (r := tuner.learner.ranges.get(lo)) is not None and r.serving:
                break
        r = tuner.learner.ranges[lo]
        assert r.learned == 2 and r.serving, (r.learned, r.serving, r.samples, tuner.tally)
        # with no neighbour, 2 threads serve; the first few may follow a reading of the
        # free cores taken while the window's shadows or another task ran (once here: the
        # first three of ten at 1 thread, the host's suite at 20 minutes, not 18)
        assert serve(10).count(2) >= 7
        neighbour = hog()
        beside = serve(60)
        # by the load factor (2x at 2 threads beside one core held, 1x at 1 thread), 1
        # thread is faster where 2 threads' speed-up is under 2x; here it is 1.7-1.85x
        # quiet, and as learned 1.5-2.2x (10 runs: samples are scaled by the cores read,
        # which a quiet host's other processes put at 1.9-2.0). Measured where the learned
        # speed-up was under 1.9x (7 of 10 runs): 1 thread from the 5th-8th of these
        # forwards on, every one after; above 2x, 2 threads all along. Near 2x the choice
        # follows the window: while 2 threads serve beside it, the free cores read up to
        # 1.58, a factor of 1.84 (a CI run at a learned 1.86x served 2 threads in 6 of the
        # 51 forwards after the first at 1), so all but a few at 1 thread is asserted only
        # where the speed-up is clear of that (under 1.75x: the factor would need 1.63 cores
        # free), most of them up to 1.9x
        speedup = r.baselines[(1, "shadow")] / r.baselines[(2, "shadow")]
        if speedup < 1.9:
            assert tuner.tally.contended >= 8 and 1 in beside, (beside, speedup)
            after_first = beside[beside.index(1):]
            share = 0.9 if speedup < 1.75 else 0.5
            assert after_first.count(1) >= share * len(after_first), (beside, speedup)
        elif speedup > 2.1:
            assert beside.count(2) >= 0.9 * len(beside), (beside, speedup)
        neighbour.kill()
        neighbour.wait(10)
        neighbour = None
        back = time.monotonic() + 10  # the next windows read its core free
        while time.monotonic() < back and serve(10).count(2) < 9:
            pass
        after = serve(40)
        assert after.count(2) >= 36, after
        assert tuner.learner.ranges[lo].relearns == 0 and tuner.ledger.retired is None
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait(10)
        runner.stop()


def learning_runner(tmp_path):
    """Mode 1 on L3 (1 thread configured, counts 1 and 2) with the shadow side's freezes and
    thaws recorded: (when, frozen, the running shadow's epoch)."""
    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    pauses: list[tuple[float, bool, int]] = []
    made: list = []  # the tuner, once made (the pause is called with its lock held)

    def pause(shadows):
        def wrapped(frozen: bool) -> bool:
            pauses.append((time.monotonic(), frozen, made[0].flight.shadow_epoch if made else -1))
            return shadows.pause(frozen)
        return wrapped

    runner, tuner, _ = shadowed_runner(
        manifest, backend, AdaptiveMode.LEARN,
        Scope("test-host", manifest.revision, "onnxruntime"), HostRecord(tmp_path / "r.sqlite"),
        TunerSettings.of(min_samples=6, budget_fraction=1.0),
        EngineArgs(num_threads=1, cache_entries=0), pause=pause)
    made.append(tuner)
    return runner, tuner, pauses


def test_back_to_back_load_holds_timing_shadows_for_the_quiet_and_learns_in_it(tmp_path):
    """R4.5: mode 1, one client sending back to back: every gap between served forwards is
    the client's turnaround, shorter than a shadow. A shadow timing 2 threads needs the core
    the next served forward runs on (an idle-class one sharing it made served forwards 1.5x
    slower here), would be frozen and its time thrown away; such shadows wait until the
    worker has been idle long enough, so under this load few start, and once the client
    stops, 2 threads is timed on the last batch and the range is learned. The shadow side
    is frozen beside a served forward only while a shadow runs."""
    runner, tuner, pauses = learning_runner(tmp_path)
    lo = size_range(120)[0]
    try:
        wait_until(lambda: tuner.side.warm, 60, "the shadow side warm")
        forwards = 200
        for i in range(forwards):
            runner.engine.submit([row(120, i)]).result(timeout=60)
        with tuner.lock:
            started = tuner.ledger.comparisons
            overlapped, froze = tuner.tally.discarded, [f for _, f, _ in pauses].count(True)
            timed_served = tuner.tally.served_samples
        wait_until(lambda: tuner.learner.ranges[lo].learned is not None, 60,
                   "2 threads timed once the client stopped")
    finally:
        runner.stop()
    print(f"{forwards} forwards: shadows compared {started}, overlapped {overlapped}, "
          f"freezes {froze}, served forwards timed {timed_served}")
    assert timed_served >= forwards // 2  # the configured count timed on served forwards
    assert overlapped <= 6  # measured 1-2 (each forward froze a shadow's wait before)
    # a freeze only while a shadow runs: measured 6-31 (every one of them froze before)
    assert froze < forwards // 2
    # 2 threads timed once the client stopped: its samples, or the first EARLY where they all
    # ran slower than 1 thread (the host's 2 threads no faster at 120 tokens: once in CI-like
    # runs here, [26.8, 21.9, 20.2] ms)
    samples = tuner.learner.ranges[lo].samples
    assert len(samples[2]) >= 6 or (len(samples[2]) >= EARLY
                                    and 2 in losing_counts(samples, (1, 2))), samples


def test_a_shadow_cut_into_by_load_is_frozen_once_not_at_every_gap(tmp_path):
    """R4.5: mode 1; a shadow timing 2 threads on a large batch starts in the quiet (it shares
    the served forwards' cores) and back-to-back load begins while it runs. The first served
    forward freezes it; while served forwards take most of the time it stays frozen (thawed
    in the gaps it would be cut into again at once, and served forwards overlapped it: it
    cannot be a sample) until its range has starved ``starved_s``; then it runs unfrozen in
    the idle class and ends (its time no sample). Before, it was thawed and frozen again
    around every forward whose gap outlasted the hold: tens of freezes. Pauses are counted
    for this shadow alone (its epoch): a later shadow of the load's own range may start and
    be frozen while the load still runs (a slower host, CI)."""
    runner, tuner, pauses = learning_runner(tmp_path)
    try:
        wait_until(lambda: tuner.side.warm, 60, "the shadow side warm")
        big = [row(120, 10**6 + i) for i in range(8)]  # 960 padded tokens: a long shadow
        runner.engine.submit(big).result(timeout=60)
        wait_until(lambda: tuner.flight.shadowing and tuner.flight.shadow_gated, 10,
                   "a shadow that shares the served forwards' cores")
        with tuner.lock:
            epoch = tuner.flight.shadow_epoch
        began = time.monotonic()
        for i in range(600):
            runner.engine.submit([row(60, i)]).result(timeout=60)
        ended = time.monotonic()
        wait_until(lambda: tuner.flight.shadow_epoch != epoch or not tuner.flight.shadowing,
                   30, "the shadow to end")
    finally:
        runner.stop()
    during = [(round(at - began, 3), frozen) for at, frozen, e in pauses
              if e == epoch and began <= at <= ended]
    freezes = [frozen for _, frozen in during].count(True)
    print(f"load {ended - began:.2f} s, this shadow's pauses during it {during}, "
          f"frozen beside {tuner.tally.frozen_beside}")
    assert during and during[0][1] is True  # frozen by the first forward
    # measured 1 here (thawed once starved), 2 on CI (a first thaw before the busy share
    # passed ``busy_max``); one per gap before
    assert freezes <= 3, during


def test_a_worker_loaded_from_its_first_second_warms_its_shadow_side_and_learns(tmp_path):
    """R4.5 (amended): back-to-back served forwards from start-up, every one timed (every
    range explores), mode 2 with no voucher. The shadow side's warm pass runs as a paid
    shadow, never frozen, and comparisons follow. As an idle-class shadow each timed forward
    froze it: the shadow process stayed stopped and a server loaded with 16 connections from
    its first second compared nothing in 120 s (``bench/results/adaptive_load_steady.json``)."""
    manifest = resolve(L3)
    runner, tuner, shadows = shadowed_runner(
        manifest, load_backend(manifest, "onnxruntime"), AdaptiveMode.SERVE,
        Scope("test-host", manifest.revision, "onnxruntime"), HostRecord(tmp_path / "r.sqlite"),
        TunerSettings(), EngineArgs(num_threads=1, cache_entries=0))
    stop = threading.Event()

    def load(k: int) -> None:
        i = 0
        while not stop.is_set():
            runner.engine.submit([row(40, 1000 * k + i)]).result(timeout=60)
            i += 1

    loaders = [threading.Thread(target=load, args=(k,)) for k in range(2)]
    for t in loaders:
        t.start()
    try:
        wait_until(lambda: tuner.side.warm, 60, "the shadow side warm under load")
        wait_until(lambda: tuner.ledger.comparisons > 0, 60, "a comparison under load")
    finally:
        stop.set()
        for t in loaders:
            t.join(60)
        runner.stop()
