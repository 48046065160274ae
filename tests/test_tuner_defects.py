"""Five defects of the tuner found by reading it (R4.5, R4.7), each guarded here: a text
pair's shadow got no token type ids, the shadow budget banked idle time, contention flapped
between its start and end thresholds (now it has no state: each forward's count follows the
free cores), ``/proc`` was read on the served path, and the shadow
process's death, hang or zombie stopped learning for good or blocked ``close``. A sixth, found
on the simulated many-core host: a batch whose shadows gave no sample ran again without end.

Real parts: the worker assembly a deployment runs (``Worker``: the real ``ShadowProcess``
child, ``FreeCpus`` over the real ``/proc``), real tiny models, real signals. A fake clock
only where time itself is the input (the budget)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FAST, L3, SlowerAt, wait_for
from vllm_srun.records.host_record import HostRecord
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.server.worker.assembly import Worker
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.tuner.adaptive import TunerSettings
from vllm_srun.tuner.modes import AdaptiveMode

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, signals")

QUERY = "where does Maria live?"
DOCUMENTS = ["Maria lives in Berlin.", "The quick brown fox jumps over the lazy dog.",
             "Paris is a city in France.", "She moved to London last year."]


def worker(model: str, tmp_path: Path, mode: AdaptiveMode = AdaptiveMode.LEARN,
           settings: TunerSettings = FAST, wrap_backend=None):
    """A worker assembled as a deployment assembles it (``Worker``: shadows in a real
    ``SCHED_IDLE`` child process, free cores read from ``/proc``), 1 thread configured,
    counts 1 and 2; returns it and its started runner."""
    spec = WorkerSpec(model, "onnxruntime", EngineArgs(num_threads=1, cache_entries=0),
                      budget=2, mode=mode, record_path=str(tmp_path / "record.sqlite"),
                      settings=settings, calibrate=False)
    made = Worker(spec, wrap_backend=wrap_backend)
    runner = made.load()
    assert runner.ready, runner.not_ready_reason
    return made, runner


def vouch(made: Worker, tmp_path: Path) -> None:
    """A real sweep (R4.8) of the worker's model over one row of up to 64 tokens at 1 and
    2 threads, stored as the voucher of its scope; returns once the tuner has read it."""
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.tuner.verify import ShapeBounds, plan_sweep, sweep

    backend = load_backend(made.manifest, "onnxruntime")
    plan = plan_sweep(ShapeBounds(max_rows=1, max_len=64, max_padded=64))
    checked = sweep(lambda b, n: backend.forward(b, n), 1, (1, 2), plan.shapes)
    backend.close()
    assert checked.mismatches == 0 and checked.comparisons > 0
    HostRecord(tmp_path / "record.sqlite").add_voucher(
        made.tuner.sync.scope, "verify", checked.comparisons, 0, plan.coverage((1, 2)))
    assert wait_for(lambda: made.tuner.ledger.voucher.vouches, 30)


# -- 1. a text pair's shadow gets every input the served forward got (R4.5, R4.7) ----------

def test_a_cross_encoders_pair_shadows_match_the_served_answer_and_record_no_drift(
        cross_encoder_dir, tmp_path):
    """R4.5, R4.7: the shadow process got only ``input_ids`` and ``attention_mask``; a
    cross-encoder's shadow then ran with zero token type ids, answered differently, and the
    drift it recorded retired learning for the whole host for good. Mode 1, a real BERT
    cross-encoder (tests/tiny_models.py) on text pairs: every shadow reproduces the served
    answer, nothing drifts, and the type ids do matter to this model."""
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.threads import ThreadContext
    from vllm_srun.runtime.types import TokenBatch
    from vllm_srun.tuner.adaptive import output_bits

    made, runner = worker(str(cross_encoder_dir), tmp_path)
    tuner = made.tuner
    try:
        for i in range(6):
            pairs = [(f"{QUERY} {i}", d) for d in DOCUMENTS]
            runner.submit(pairs)[0].result(timeout=60)
            wait_for(lambda i=i: tuner.ledger.comparisons > i or tuner.ledger.retired, 30)
        # (compared, timed or not: on a loaded host most shadows wait for CPUs, untimed)
        assert wait_for(lambda: tuner.ledger.comparisons >= 6 or tuner.ledger.retired, 120)
        assert tuner.ledger.retired is None and tuner.ledger.comparisons >= 6, \
            tuner.ledger.comparisons
        # the shadow process's answer to a pair batch, bit for bit the served path's
        encoded = runner.tokenizer.rows([(QUERY, d) for d in DOCUMENTS])
        batch = pad(encoded.ids, encoded.type_ids)
        assert batch.token_type_ids is not None and batch.token_type_ids.any()
        served = load_backend(made.manifest, "onnxruntime")
        context = ThreadContext()
        reference = context.run(1, lambda: served.forward(batch, 1)).outputs
        context.shutdown()
        shadows = tuner.side.forward.__self__
        for n in (1, 2):
            shadow = shadows.forward(batch, n).outputs
            assert np.array_equal(output_bits(shadow), output_bits(reference))
        untyped = shadows.forward(TokenBatch(batch.input_ids, batch.attention_mask), 1)
        assert not np.array_equal(untyped.outputs, reference)  # the type ids matter here
    finally:
        runner.stop()
    assert HostRecord(tmp_path / "record.sqlite").drift(tuner.sync.scope) is None


# -- 2. the shadow budget banks idle time only up to a bound (R4.5) --------------------------

def test_an_idle_hour_banks_no_more_than_the_budget_window_of_shadow_time():
    """R4.5 (a bounded share): the budget grew from start-up without a cap, so after an idle
    hour half an hour of shadow time could run at once. Now idle time is banked for
    ``budget_window_s`` only: after the hour, at most ``budget_fraction`` of it (plus the
    one shadow that overdraws it) runs at once, then the rate holds again. The real tuner
    and the real L3 forwards; a fake clock, each shadow modelled as 0.1 s on it."""
    from vllm_srun.records.host_record import Scope
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.tuner.adaptive import AdaptiveThreads

    manifest, now = resolve(L3), [0.0]
    backend = load_backend(manifest, "onnxruntime")

    def shadow(batch, n):  # a real forward that takes 0.1 s on the fake clock
        result = backend.forward(batch, n)
        now[0] += 0.1
        return result

    settings = TunerSettings.of(background=False, budget_fraction=0.5, budget_window_s=10.0,
                                min_samples=10**6,  # the range explores all along
                                retry_backoff_max_s=0.0)  # ... its one batch always due
    tuner = AdaptiveThreads(AdaptiveMode.LEARN, 1, (1, 2), Scope("h", manifest.revision, "o"),
                            None, backend.forward, settings, clock=lambda: now[0],
                            shadow_forward=shadow)
    tuner.ledger.locked_reason = None  # no golden check: the budget is under test

    def shadows_run_at_once(salt: int) -> float:
        """Serve one forward, then run shadows until the budget (or 400 of them) stops it;
        the shadow seconds they charged."""
        batch = pad([row(30, salt)])
        tuner.observe(batch, backend.forward(batch, 1))
        before = tuner.side.budget.used_s
        for _ in range(400):
            if not tuner.step():
                break
        return tuner.side.budget.used_s - before

    now[0] = hour = 3600.0  # an idle hour since start-up
    spend = settings.spending
    cap = spend.budget_fraction * spend.budget_window_s  # 5 s banked at most

    def bound() -> float:  # the most shadow time since the hour ended: rate, bank, overdraw
        return settings.spending.budget_fraction * (now[0] - hour) + cap + 0.1 + 1e-9

    burst = shadows_run_at_once(1)  # back to back: the bank, plus the rate meanwhile
    assert cap <= burst <= bound() and burst <= 10.2, burst  # unbanked: all 400 (40 s)
    now[0] += 4.0  # 4 s later: about 2 s more (the rate), nothing more of the hour
    assert 2.0 - 0.1 <= shadows_run_at_once(2) <= 2.0 / (1 - 0.5) + 0.1 + 1e-9
    assert tuner.side.budget.used_s <= bound()

def test_a_batch_whose_shadows_give_no_sample_is_tried_again_later_and_later():
    """An exploring range's batch goes back on the board after a shadow that gave no sample
    (a served forward overlapped it), so that a shape only load makes is timed; tried again
    in every gap, a rare range's few batches ran for good on a busy host (the simulated
    64-core host: 5 of its cores on the shadows of 7 batches). Now each try after one that
    gave no sample waits 0.1 s, twice as long with each more, up to
    ``retry_backoff_max_s``; the shadow loop does not start it before. The real tuner, real
    L3 forwards, a fake clock."""
    from vllm_srun.records.host_record import Scope
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.sizes import size_range
    from vllm_srun.tuner.adaptive import AdaptiveThreads

    manifest, now = resolve(L3), [100.0]
    backend = load_backend(manifest, "onnxruntime")
    settings = TunerSettings.of(background=False, retry_backoff_max_s=0.5)
    tuner = AdaptiveThreads(AdaptiveMode.LEARN, 1, (1, 2), Scope("h", manifest.revision, "o"),
                            None, backend.forward, settings, clock=lambda: now[0])
    tuner.ledger.locked_reason = None  # no golden check: the board is under test
    batch = pad([row(30)])
    lo = size_range(batch.padded_tokens)[0]
    tuner.observe(batch, backend.forward(batch, 1))
    job = tuner.learner.board.jobs[lo]
    waits = []
    for _ in range(4):  # every shadow at 2 threads overlapped by a served forward
        tuner.learner.after_shadow(lo, job, 2, backend.forward(batch, 2), clean=False,
                                   now=now[0], overlapped_at=now[0])
        waits.append(round(job.not_before - now[0], 6))
    assert waits == [0.1, 0.2, 0.4, 0.5] and 2 in job.counts

    def due() -> bool:
        return tuner.gate.next_shadow(now[0], tuner.learner.board.jobs,
                                      tuner.learner.ranges, tuner.mode) is not None

    assert not due()
    # the share may pay for it meanwhile: a paid shadow is not overlapped out, and the
    # share bounds its cost (a backed-off range went unpaid for up to the backoff)
    board = tuner.learner.board
    board.starved_since[lo] = now[0] - 10.0
    paid = board.paid_due(now[0], lambda cost_s, lo: True)
    assert paid is not None and paid[:2] == (lo, job) and paid[2] in job.counts
    now[0] = job.not_before + 10.0  # idle since: any gap fits
    assert due()


def row(tokens: int, salt: int = 0) -> list[int]:
    """A row of ``tokens`` ids ([CLS] ... [SEP]) of the BERT vocabulary, fixed by its seed."""
    rng = np.random.default_rng(tokens * 1000 + salt)
    return [101, *(int(t) for t in rng.integers(1000, 29000, tokens - 2)), 102]


# -- 3. contention has no state to flap: the count follows the free cores, window by window --

def contention_run(held: list[tuple[float, float]], until_s: float):
    """Mode 2 on the simulated 2-core host (configured 1, both ranges learn 2 threads in
    the first minute); from 60 s a neighbour takes a core, while the free cores read say
    other tasks hold ``held`` cores: ``(from_s, cores)`` steps, the recorded input. Returns
    the tuner and the outcome."""
    from vllm_srun.tuner.simulate import Neighbour, SimulatedHost, TimeModel, poisson_trace

    host = SimulatedHost(TimeModel(2), [Neighbour(1, 60)], seed=1)
    steps = [(0.0, 0.0), *held]

    def free_s() -> tuple[float, float]:  # now, and the seconds cores were left free
        now, total = host.clock.now_s, 0.0
        for (start, cores), (end, _) in zip(steps, [*steps[1:], (float("inf"), 0.0)],
                                            strict=True):
            total += (2 - cores) * max(0.0, min(now, end) - start)
        return now, total

    host.tuner.free_cores.reading = free_s
    out = host.run(poisson_trace(15, 60, [64, 256], seed=1)
                   + poisson_trace(15, until_s - 60, [64, 256], seed=2, start_s=60))
    assert all(r.learned == 2 for r in host.tuner.learner.ranges.values())
    return host.tuner, out


def served(out, tokens: int, start_s: float, end_s: float) -> set[int]:
    """The counts served (not to time one) to forwards of ``tokens`` from ``start_s`` to
    ``end_s``."""
    return {n for n, at, length, explored in zip(out.served_threads, out.at_s, out.lengths,
                                                  out.explored, strict=True)
            if length == tokens and start_s <= at < end_s and not explored}


def test_a_steady_reading_serves_one_count_per_range_the_one_fastest_under_it():
    """Contention was a state that started at 0.25 core held and ended at 0.5: a steady 0.35
    did both, window by window (40 starts and as many ends in 9 s); later two thresholds
    and a state (R4.13: contention was a mode of its own). Now each forward's count is the
    one fastest under the cores read (``samples.fastest_under``): a steady reading serves
    each range one count all along, whichever the estimates make fastest under it."""
    from vllm_srun.tuner.samples import fastest_under

    for held in (0.2, 0.35, 0.6):
        tuner, out = contention_run([(60.0, held)], 69.0)
        for tokens in (64, 256):
            r = tuner.learner.ranges[tokens]
            est = {n: ms for (n, kind), ms in r.baselines.items() if kind == "shadow"}
            assert served(out, tokens, 60.2, 69.0) == {fastest_under(est, 2 - held, 2)}, \
                (held, tokens, est)


def test_a_neighbour_holding_a_core_serves_1_thread_while_it_does_and_2_once_it_leaves():
    """One core held (2 threads 2x slower by the load factor, 1.35-1.93x faster with the
    cores free in the simulator's model): 1 thread from the next window on; the reading back
    at none held: 2 threads from the next window on, with nothing to end or probe."""
    tuner, out = contention_run([(60.0, 1.0), (64.0, 0.0)], 69.0)
    for tokens in (64, 256):
        assert served(out, tokens, 60.2, 64.0) == {1}
        assert served(out, tokens, 64.2, 69.0) == {2}
    assert tuner.tally.contended > 0 and all(r.relearns == 0
                                             for r in tuner.learner.ranges.values())


# -- 4. /proc is read off the served path ----------------------------------------------------

def test_a_served_forward_reads_no_proc_file_and_the_free_cores_still_update(
        tmp_path, monkeypatch):
    """The free cores (``FreeCpus``: ``/proc/stat`` and one ``/proc/<pid>/stat`` per process
    it counts) were read under the tuner's lock by served forwards. A worker as a
    deployment assembles it: every ``/proc`` file ``free_cpus`` opens is counted with the
    thread that opened it, and the threads that ran ``served_threads`` and ``observe``
    opened none; the tuner's free-core figure is there and moves on meanwhile."""
    import builtins
    import threading
    import time

    from vllm_srun.tuner import free_cpus

    # mode 2, vouched: the range explores all along on served forwards, each of which
    # consults the free cores (whatever the shadow side does meanwhile)
    made, runner = worker(L3, tmp_path, AdaptiveMode.SERVE, FAST.with_(min_samples=10**6))
    vouch(made, tmp_path)
    tuner = made.tuner
    opened: list[tuple[int, str]] = []  # (thread id, path)
    served: set[int] = set()

    def counting_open(path, *args, **kwargs):
        opened.append((threading.get_ident(), str(path)))
        return builtins.open(path, *args, **kwargs)

    for name in ("served_threads", "observe"):  # the real methods, watched
        real = getattr(tuner, name)

        def watched(*args, real=real):
            served.add(threading.get_ident())
            return real(*args)

        monkeypatch.setattr(tuner, name, watched)
    monkeypatch.setattr(free_cpus, "open", counting_open, raising=False)
    try:
        windows = []
        for i in range(12):
            runner.engine.submit([row(40, i)]).result(timeout=60)
            time.sleep(0.15)  # forwards a window apart: each may read a new one
            windows.append(tuner.free_cores.window)
    finally:
        runner.stop()
    assert served and opened  # forwards ran; the reader read /proc meanwhile
    assert all(path.startswith("/proc/") for _, path in opened)
    on_served_path = [path for ident, path in opened if ident in served]
    assert on_served_path == []
    figures = [w for w in windows if w is not None]
    assert len(figures) >= 6 and len({began for _, began in figures}) >= 5, windows


# -- 5. the shadow process's life: respawned, hangs bounded, zombies reaped ----------------

def gone(pid: int) -> bool:
    """No such process, not even a zombie: it was reaped."""
    return not Path(f"/proc/{pid}").exists()


def dead_unreaped(pid: int) -> bool:
    """A zombie whose every thread has exited: its parent may reap it now (a killed
    process's leader reads as a zombie while its other threads still exit)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text() and \
            len(list(Path(f"/proc/{pid}/task").iterdir())) == 1
    except OSError:
        return False


def test_a_shadow_process_killed_mid_learning_is_respawned_and_learning_goes_on(tmp_path):
    """A shadow process that died stopped learning for good (no respawn, no audits, ranges
    in their transition window never passed). Mode 2, vouched by a real sweep, a worker as
    deployed (its forwards at 1 thread reported 5x slower, so it learns 2): kill -9 its
    shadow process once the range explores; the failed shadow is counted, the dead child
    reaped, a new one started after the backoff, and the range passes its transition
    window, which only shadows pass, and serves its learned count. (Mode 2 times counts on
    served forwards; mode 1's idle-class shadows, on a host loaded as this shared one, wait
    for CPUs and are not timed.)"""
    import os
    import signal
    import time

    from vllm_srun.tuner.report import build, from_tuner

    made, runner = worker(L3, tmp_path, AdaptiveMode.SERVE,
                          wrap_backend=lambda b: SlowerAt(b, 1, 5.0))
    tuner = made.tuner
    shadows = tuner.side.forward.__self__
    try:
        vouch(made, tmp_path)
        assert wait_for(lambda: tuner.side.warm, 120)
        runner.engine.submit([row(40, 0)]).result(timeout=60)
        assert tuner.learner.ranges[32].learned is None  # it explores
        first = shadows.process.pid
        os.kill(first, signal.SIGKILL)
        end = time.monotonic() + 120
        for i in range(1, 10**6):
            runner.engine.submit([row(40, i)]).result(timeout=60)
            if tuner.learner.ranges[32].serving or time.monotonic() > end:
                break
            time.sleep(0.05)
        r = tuner.learner.ranges[32]
        assert r.learned == 2 and r.serving, (r, tuner.side.error)
        assert shadows.respawns >= 1 and shadows.process.pid != first and gone(first)
        assert tuner.side.faults >= 1 and tuner.ledger.retired is None
        assert build(from_tuner(tuner))["learning"]["shadow_faults"] == tuner.side.faults
    finally:
        runner.stop()


def test_a_hung_shadow_process_does_not_hold_up_closing_and_is_gone_after(tmp_path):
    """A shadow child that hangs (SIGSTOP, not the tuner's freeze) with a shadow in flight:
    closing the worker waited on it (the shadow loop's 60-s join, then the child). Now
    closing returns within ``STOP_WAIT_S`` plus ``2 * CLOSE_WAIT_S`` (10 s here: 15 s
    allowed), and the child is killed and reaped."""
    import os
    import signal
    import time

    made, runner = worker(L3, tmp_path)
    tuner = made.tuner
    shadows = tuner.side.forward.__self__
    pid = shadows.process.pid
    try:
        assert wait_for(lambda: tuner.side.warm and tuner.flight.shadowing == 0, 120)
        os.kill(pid, signal.SIGSTOP)  # hung, no shadow in flight: nothing thaws it
        runner.engine.submit([row(40, 0)]).result(timeout=60)  # serving is not held up
        assert wait_for(lambda: tuner.flight.shadowing == 1, 30)  # its shadow: sent, unanswered
    finally:
        began = time.monotonic()
        runner.stop()
        closed_s = time.monotonic() - began
    assert closed_s < 15, closed_s
    assert gone(pid)


def test_a_hung_child_is_killed_and_a_new_one_answers_and_a_dead_one_is_not_frozen():
    """``ShadowProcess`` alone: a child that gives no answer and uses no CPU for
    ``hang_s`` (SIGSTOP) fails the forward and is killed and reaped, and the next forward
    starts a new one; a child killed outright is not counted frozen (``pause``) and is
    reaped there, not left a zombie."""
    import os
    import signal
    import time

    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.errors import RuntimeFault
    from vllm_srun.tuner.shadows import ShadowProcess

    shadows = ShadowProcess(resolve(L3), "onnxruntime", hang_s=2.0)
    batch = pad([row(20)])
    try:
        assert shadows.forward(batch, 1).outputs.shape == (1, 384)
        hung = shadows.process.pid
        os.kill(hung, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(RuntimeFault, match="no answer and no CPU time"):
            shadows.forward(batch, 1)
        assert 2.0 <= time.monotonic() - began < 10 and gone(hung)
        assert shadows.forward(batch, 2).outputs.shape == (1, 384)  # a new child
        assert shadows.respawns == 1 and shadows.process.pid != hung
        assert wait_for(lambda: shadows._loaded.is_set() and shadows._armed.is_set(), 60)
        dead = shadows.process.pid
        os.kill(dead, signal.SIGKILL)
        assert wait_for(lambda: dead_unreaped(dead), 10)
        assert shadows.pause(True) is False and gone(dead)
        with pytest.raises(RuntimeFault, match="shadow process gone"):
            shadows.forward(batch, 1)
        assert shadows.forward(batch, 1).outputs.shape == (1, 384)
        assert shadows.respawns == 2
    finally:
        shadows.close()
    assert gone(shadows.process.pid)
