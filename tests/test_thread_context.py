"""R2.1/R2.2: every forward runs at exactly the count it states, under concurrency.

Two engines at different counts share one process; forwards are interleaved from several
Python threads while a saboteur thread keeps calling ``torch.set_num_threads`` (which writes
torch's process-global seed value). The count each forward actually ran with is observed from
inside the forward: torch's own count and threadpoolctl's view of the OpenMP pool.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info

from tests.conftest import L6
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import OnnxBackend, TorchBackend, load_backend
from vllm_srun.runtime.engine import Engine
from vllm_srun.runtime.threads import ThreadContext, lane_threads
from vllm_srun.runtime.types import EngineArgs


@pytest.fixture(scope="module")
def manifest():
    return resolve(L6)


@pytest.fixture(scope="module")
def torch_backend(manifest):
    return TorchBackend(manifest)


class Observer:
    """A hook inside the model's first layer: records (stated, torch count, OpenMP count)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int | None, int, int]] = []
        self._lock = threading.Lock()

    def __call__(self, _module, _args) -> None:
        omp = next(i["num_threads"] for i in threadpool_info()  # torch's own libgomp: other
                   if i["internal_api"] == "openmp"  # packages may load one of their own
                   and f"torch{os.sep}lib" in i["filepath"])
        with self._lock:
            self.seen.append((lane_threads(), torch.get_num_threads(), omp))


def _saboteur(stop: threading.Event) -> None:
    counts = [3, 1, 2, 5]
    i = 0
    while not stop.is_set():
        torch.set_num_threads(counts[i % len(counts)])
        i += 1
        stop.wait(0.001)


def test_concurrent_engines_each_run_at_their_own_count(torch_backend):
    observer = Observer()
    # on the served module, just before its forward (traced: no Python inside to hook)
    handle = torch_backend.module.register_forward_pre_hook(observer)
    context = ThreadContext()
    engines = {n: Engine(torch_backend, EngineArgs(num_threads=n), context=context)
               for n in (1, 2)}
    for e in engines.values():
        e.start()
    stop = threading.Event()
    saboteur = threading.Thread(target=_saboteur, args=(stop,))
    saboteur.start()
    try:
        rows = [[101] + [7592] * k + [102] for k in (3, 20, 60)]
        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [pool.submit(lambda n=n, r=r: engines[n].submit([r]).result(timeout=60))
                       for _ in range(10) for n in (1, 2) for r in rows]
            results = [f.result() for f in futures]
    finally:
        stop.set()
        saboteur.join()
        handle.remove()
        for e in engines.values():
            e.stop()
        context.shutdown()
    assert len(results) == 60
    assert len(observer.seen) >= 30  # micro-batching may merge some forwards
    assert {s for s, _, _ in observer.seen} == {1, 2}
    for stated, torch_count, omp_count in observer.seen:
        assert (torch_count, omp_count) == (stated, stated)


def test_forward_results_report_the_observed_count(torch_backend, manifest):
    context = ThreadContext()
    engine = Engine(torch_backend, EngineArgs(num_threads=2), context=context)
    try:
        for n in (2, 1, 2):
            torch.set_num_threads(3)  # whatever ran before in the process
            result = engine.forward([[101, 7592, 102]], n)
            assert (result.num_threads, result.observed_threads) == (n, n)
    finally:
        context.shutdown()


def test_onnxruntime_sessions_per_count_reproduce_their_answers(manifest):
    backend = load_backend(manifest, "onnxruntime")
    assert isinstance(backend, OnnxBackend)
    context = ThreadContext()
    rows = [[101] + [7592] * 8 + [102], [101] + [2088] * 40 + [102]]
    try:
        engine = Engine(backend, EngineArgs(num_threads=1), context=context)
        reference = {n: engine.forward([r], n).outputs for n in (1, 2) for r in rows[:1]}
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda n: engine.forward([rows[0]], n),
                                    [1, 2] * 20))
    finally:
        context.shutdown()
    for res in results:
        assert res.observed_threads == res.num_threads
        assert np.array_equal(res.outputs, reference[res.num_threads])


def test_a_process_serving_several_counts_stops_each_pools_spinning_after_a_run(manifest):
    """A session's pool spins after each run; where one process runs several counts (mode 2
    serving, the shadow side), the pool of the count that just ran would spin through the
    next forward at another count (``backend.SPIN_STOP``). Such a backend tells each session
    above 1 thread to stop spinning after a run (its twin, the in-process shadow side's, too)
    and answers exactly as one that does not; a backend of one count keeps onnxruntime's
    default."""
    from vllm_srun.runtime.backend import SPIN_STOP
    from vllm_srun.runtime.engine import pad

    def entry(backend: OnnxBackend, n: int) -> str | None:
        try:
            return backend._session(n).get_session_options().get_session_config_entry(SPIN_STOP)
        except RuntimeError:  # onnxruntime: "does not have configuration with key"
            return None

    several = load_backend(manifest, "onnxruntime", several_counts=True)
    one = load_backend(manifest, "onnxruntime")
    twin = several.twin()
    batch = pad([[101] + [7592] * 12 + [102], [101, 2088, 102]])
    try:
        assert [entry(several, 2), entry(twin, 2), entry(one, 2)] == ["1", "1", None]
        assert entry(several, 1) is None  # 1 thread: no pool to spin
        for n in (1, 2):
            assert np.array_equal(several.forward(batch, n).outputs,
                                  one.forward(batch, n).outputs)
    finally:
        for b in (several, one, twin):
            b.close()


@pytest.mark.parametrize("mode, stops", [(0, False), (1, False), (2, True)])
def test_only_a_worker_that_serves_several_counts_stops_its_pools_spinning(mode, stops):
    """Mode 2 serves learned counts beside the configured one; modes 0 and 1 serve one count
    (mode 1's other counts run in the shadow process, whose backend stops spinning too)."""
    from vllm_srun.server.worker.assembly import Worker
    from vllm_srun.server.worker.spec import WorkerSpec
    from vllm_srun.tuner.modes import AdaptiveMode

    spec = WorkerSpec(L6, "onnxruntime", EngineArgs(num_threads=1, cache_entries=0), budget=2,
                      mode=AdaptiveMode(mode), calibrate=False)
    backend = Worker(spec)._choose_backend()
    try:
        assert backend.stop_spinning is stops
    finally:
        backend.close()


def _placement(lead_name: str) -> tuple[set[int], int, dict[int, set[int]]]:
    """Inside a forward on a lane: the lead's mask and CPU, and each helper's mask (the
    threads carrying the lead's OS name)."""
    from vllm_srun.runtime.placement import _sched_getcpu

    me, helpers = threading.get_native_id(), {}
    for tid in os.listdir("/proc/self/task"):
        if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == lead_name and \
                int(tid) != me:
            helpers[int(tid)] = os.sched_getaffinity(int(tid))
    return os.sched_getaffinity(0), _sched_getcpu(), helpers


@pytest.mark.parametrize("spread", ["1", "0"])
def test_a_two_thread_forward_holds_its_team_on_distinct_cpus_while_it_runs(
        torch_backend, monkeypatch, spread):
    """R2.1, ``runtime.placement``: a 2-thread torch forward handed to a lane runs with its
    lead thread held on its CPU and the team's helper kept off that CPU, and the lead is free
    again once the forward ends (a lane's team after a pause ran both threads on one CPU, as
    slow as one thread). $VLLM_SRUN_CPU_SPREAD_THREADS=0 leaves them to the kernel, and the
    answers are the same either way. Where the process may use one CPU, nothing is held."""
    from vllm_srun.runtime.engine import pad

    monkeypatch.setenv("VLLM_SRUN_CPU_SPREAD_THREADS", spread)
    allowed = os.sched_getaffinity(0)
    batch = pad([[101] + [7592] * 40 + [102]] * 4)
    reference = torch_backend.forward(batch, 2).outputs
    context = ThreadContext()
    try:
        name = context._lane(2).submit(
            lambda: Path("/proc/thread-self/comm").read_text().strip()).result()
        assert name.startswith("vs-fwd2-")  # the lane's unique name, its helpers' too

        def forward_and_look():
            result = torch_backend.forward(batch, 2)
            return result, _placement(name)

        result, (lead, cpu, helpers) = context.run(2, forward_and_look)
        after = context._lane(2).submit(lambda: os.sched_getaffinity(0)).result()
    finally:
        context.shutdown()
    assert np.array_equal(result.outputs, reference)
    assert after == allowed  # the lead is released when the forward ends
    if spread == "1" and len(allowed) >= 2:
        assert lead == {cpu} and cpu in allowed
        assert len(helpers) == 1 and all(m == allowed - {cpu} for m in helpers.values())
    else:
        assert lead == allowed


class _Serves:
    """A threads policy that serves each forward at the next count of ``counts``, in turn."""

    def __init__(self, *counts: int) -> None:
        self.counts, self.i = counts, 0

    def served_threads(self, _batch) -> int:
        self.i += 1
        return self.counts[(self.i - 1) % len(self.counts)]

    def observe(self, _batch, _result) -> None:
        pass

    def close(self) -> None:
        pass


def _serve_one_by_one(torch_backend, policy, forwards: int) -> tuple[list, list]:
    """``forwards`` served forwards of one row each, one after another: (thread, stated count,
    torch count, OpenMP count) of each as it ran, and each answer."""
    from vllm_srun.runtime import home as home_module

    seen: list = []
    observer = Observer()

    def hook(module, args):
        observer(module, args)
        seen.append((threading.current_thread().name, *observer.seen[-1]))

    handle = torch_backend.module.register_forward_pre_hook(hook)
    context = ThreadContext()
    engine = Engine(torch_backend, EngineArgs(num_threads=1), threads=policy, context=context)
    engine.start()
    row = [101] + [7592] * 20 + [102]
    try:
        answers = [engine.submit([row]).result(timeout=60) for _ in range(forwards)]
    finally:
        handle.remove()
        engine.stop()
        context.shutdown()
    assert forwards > home_module.HOME_WINDOW
    return seen, answers


def test_the_scheduler_moves_to_a_thread_of_the_count_most_forwards_are_served_at(
        torch_backend):
    """Configured 1, every forward served at 2 (mode 2 once it learned 2 threads): each
    forward is handed to the lane of 2 and back until, after ``HOME_WINDOW`` forwards, the
    loop moves to a new thread of count 2 (its home) and serves them inline; every forward
    runs at its stated count and answers the same on either thread."""
    from vllm_srun.runtime.home import HOME_WINDOW

    seen, answers = _serve_one_by_one(torch_backend, _Serves(2), HOME_WINDOW + 20)
    threads = [name for name, *_ in seen]
    assert all(t.startswith("forward-2t") for t in threads[:HOME_WINDOW])  # the lane
    assert set(threads[HOME_WINDOW + 1:]) == {"engine"}  # ... then its own loop
    for _, stated, torch_count, omp_count in seen[HOME_WINDOW + 1:]:
        assert (stated, torch_count, omp_count) == (2, 2, 2)
    assert all(np.array_equal(a, answers[0]) for a in answers)


def test_the_scheduler_stays_where_no_count_serves_most_forwards(torch_backend):
    """Forwards served at 1 and 2 in turn: the loop keeps its home (each move costs a cold
    team's first forward), and the forwards at 2 go to the lane of 2."""
    from vllm_srun.runtime.home import HOME_WINDOW

    seen, _ = _serve_one_by_one(torch_backend, _Serves(1, 2), HOME_WINDOW + 20)
    for name, stated, torch_count, _ in seen:
        assert torch_count == stated
        assert name == ("engine" if stated == 1 else "forward-2t_0")
