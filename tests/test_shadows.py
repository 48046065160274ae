"""R4.5 (amended): shadows never in the way, and a busy worker learns the shapes load makes.

Real backends and the real engine and tuner. A deployment runs shadows in a ``SCHED_IDLE``
child process; tests that wrap a backend use the in-process variant (``SCHED_IDLE`` lanes over
the backend's twin), checked here too. Scheduling policies are read from
``/proc/<pid>/task/<tid>/sched`` (5 = SCHED_IDLE).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import L3, L6, row, wait_for, wait_until
from vllm_srun.records.host_record import Scope
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.threads import SCHED_IDLE_POLICY, ThreadContext
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings, output_bits
from vllm_srun.tuner.golden import golden_rows
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.shadows import idle_shadows, shadow_process

pytestmark = [pytest.mark.required_in_ci,  # CI runs on Linux
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE")]


def thread_policies(pid: int | None = None) -> dict[int, int]:
    """tid -> scheduling policy of every thread of a process (default: this one)."""
    out = {}
    for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir():
        try:
            text = (task / "sched").read_text()
            line = next(x for x in text.splitlines() if x.startswith("policy"))
            out[int(task.name)] = int(line.split(":")[1])
        except (OSError, StopIteration):  # no sched file: the stat file's 41st field
            try:
                stat = (task / "stat").read_text()
                out[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[38])
            except OSError:
                continue  # the thread ended meanwhile
    return out


@pytest.mark.parametrize(("model", "backend_name"), [(L3, "onnxruntime"), (L6, "torch")])
def test_shadow_threads_and_the_intra_op_threads_they_make_are_sched_idle(model, backend_name):
    backend = load_backend(resolve(model), backend_name)
    batch = pad([row(200)])
    served = ThreadContext()
    served.run(2, lambda: backend.forward(batch, 2))  # served pools exist first
    before = thread_policies()
    shadow_forward, close = idle_shadows(backend)
    try:
        for n in (1, 2):
            shadow_forward(batch, n)
        after = thread_policies()
        new = {tid: p for tid, p in after.items() if tid not in before}
        # the lanes of counts 1 and 2, and at least one intra-op thread made by the 2-lane
        assert len(new) >= 3, (before, after)
        assert set(new.values()) == {SCHED_IDLE_POLICY}
        # the served side kept its policy (threads earlier tests left behind may be idle)
        assert all(after[tid] == p for tid, p in before.items() if tid in after)
        served.run(2, lambda: backend.forward(batch, 2))
        assert thread_policies() == after  # a served forward made no thread and took no idle one
    finally:
        close()
        served.shutdown()


class GatedTwin:
    """The real backend; its twin's forwards (shadows) wait at a gate the test opens."""

    def __init__(self, backend) -> None:
        self.backend, self.name = backend, backend.name
        self.gate, self.inside = threading.Event(), threading.Event()

    def forward(self, batch, num_threads):
        return self.backend.forward(batch, num_threads)

    def twin(self):
        outer, twin = self, self.backend.twin()

        class Shadow:
            name = twin.name

            def forward(self, batch, num_threads):
                if batch.padded_tokens > 30:  # not the warm-up
                    outer.inside.set()
                    outer.gate.wait(60)
                return twin.forward(batch, num_threads)

        return Shadow()

    def close(self) -> None:
        self.backend.close()


def _tuner(runner, backend, settings, mode=AdaptiveMode.LEARN, counts=(1, 2)):
    shadow_forward, close = idle_shadows(backend)
    tuner = AdaptiveThreads(mode, runner.args.num_threads, counts,
                            Scope("h", runner.manifest.revision, "onnxruntime"), None,
                            runner.engine.forward_batch, settings,
                            shadow_forward=shadow_forward, on_close=close)
    runner.engine.threads = tuner
    runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer)))
    return tuner


def test_a_served_forward_never_waits_for_a_shadow_and_its_overlap_is_not_a_sample():
    backend = GatedTwin(load_backend(resolve(L6), "onnxruntime"))
    runner = Runner(resolve(L6), backend, EngineArgs(num_threads=1, cache_entries=0))
    tuner = _tuner(runner, backend,
                   TunerSettings.of(min_samples=3, budget_fraction=1.0))
    try:
        first = runner.engine.submit([row(100)]).result(timeout=60)
        assert backend.inside.wait(60)  # a shadow of it is now in the middle of its forward
        second = runner.engine.submit([row(100, 1)]).result(timeout=30)  # served meanwhile
        assert tuner.ledger.comparisons == 0 and not backend.gate.is_set()
        backend.gate.set()
        assert wait_for(lambda: tuner.ledger.comparisons >= 1)
        assert tuner.tally.discarded >= 1  # the overlapped shadow was compared, not timed
        assert wait_for(lambda: tuner.pending_shadows() == 0)  # its count ran again, now cleanly
        assert all(len(tuner.learner.ranges[64].samples.get(n, [])) >= 1 for n in (1, 2))
        assert first.shape == second.shape == (1, 384)
    finally:
        backend.gate.set()
        runner.stop()


def test_ranges_that_only_load_reaches_get_learned():
    """16 clients keep the engine busy; its micro-batches reach ranges no single request
    does. Every range served gets clean samples at every count: under load, in the gaps
    between forwards, or as soon as the load eases; none waits for a pause it never gets."""
    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    forwards = []
    runner = Runner(manifest, backend, EngineArgs(num_threads=1, cache_entries=0),
                    on_forward=forwards.append)
    tuner = _tuner(runner, backend,
                   TunerSettings.of(min_samples=3, budget_fraction=1.0))
    stop = threading.Event()

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        while not stop.is_set():
            runner.engine.submit([row(int(rng.integers(20, 60)), int(rng.integers(1e9)))]) \
                .result(timeout=60)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        for c in clients:
            c.start()
        time.sleep(6)  # load for a while (a duration, not a proof of "not yet")
        stop.set()
        for c in clients:
            c.join(60)
        under_load = {lo: {n: len(v) for n, v in r.samples.items()}
                      for lo, r in tuner.learner.ranges.items()}
        assert wait_for(lambda: tuner.pending_shadows() == 0, 120)
    finally:
        stop.set()
        runner.stop()
    reached = {size_range(f.padded_tokens)[0] for f in forwards}
    large = {lo for lo in reached if lo >= 256}
    assert large, sorted(reached)  # load made batches no single request makes
    for lo in reached:
        assert all(len(tuner.learner.ranges[lo].samples.get(n, [])) >= 3 for n in (1, 2)), \
            (lo, under_load, tuner.tally.discarded)
    print(f"ranges reached {sorted(reached)}; samples when the load stopped {under_load}; "
          f"{tuner.tally.discarded} shadows overlapped a served forward and were not timed")


def test_a_deployments_shadow_process_runs_every_thread_in_sched_idle():
    """What a deployment uses: a child process in SCHED_IDLE before it loads anything, so
    every thread in it (lanes, onnxruntime pools) is idle; it shares no lock, not even the
    GIL, with the worker. Its answers are the served path's, bit for bit."""
    manifest = resolve(L3)
    served = load_backend(manifest, "onnxruntime")
    idle_before = {t for t, p in thread_policies().items() if p == SCHED_IDLE_POLICY}
    shadow_forward, close = shadow_process(manifest, "onnxruntime")
    proc = shadow_forward.__self__.process
    try:
        batch = pad([row(120)])
        context = ThreadContext()
        for n in (1, 2):
            shadow = shadow_forward(batch, n)
            assert shadow.observed_threads == n
            reference = context.run(1, lambda: served.forward(batch, 1))
            assert np.array_equal(output_bits(shadow.outputs), output_bits(reference.outputs))
        context.shutdown()
        policies = thread_policies(proc.pid)
        assert len(policies) >= 3 and set(policies.values()) == {SCHED_IDLE_POLICY}
        idle_now = {t for t, p in thread_policies().items() if p == SCHED_IDLE_POLICY}
        assert idle_now <= idle_before  # no thread of the worker itself went idle
    finally:
        close()
    assert not proc.is_alive()


def test_a_killed_shadow_process_stops_no_serving_and_the_report_counts_it():
    """Serving goes on; the shadow forward that met the dead child fails, is counted and
    named in the report (tests/test_tuner_defects.py: a new child is started and learning
    goes on)."""
    from vllm_srun.tuner.report import build, from_tuner

    manifest = resolve(L3)
    backend = load_backend(manifest, "onnxruntime")
    runner = Runner(manifest, backend, EngineArgs(num_threads=1, cache_entries=0))
    shadow_forward, close = shadow_process(manifest, "onnxruntime")
    tuner = AdaptiveThreads(AdaptiveMode.LEARN, 1, (1, 2), Scope("h", manifest.revision, "o"),
                            None, runner.engine.forward_batch,
                            TunerSettings.of(min_samples=3, budget_fraction=1.0),
                            shadow_forward=shadow_forward, on_close=close)
    runner.engine.threads = tuner
    runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer)))
    try:
        shadow_forward.__self__.process.kill()
        for i in range(5):
            assert runner.engine.submit([row(60, i)]).result(timeout=30).shape == (1, 384)
        assert wait_for(lambda: tuner.side.faults >= 1, 30)
        report = build(from_tuner(tuner))
        assert any("shadow process gone" in n for n in report["notes"]), report["notes"]
        assert report["learning"]["shadow_faults"] >= 1
        assert runner.engine.submit([row(60, 9)]).result(timeout=30).shape == (1, 384)
    finally:
        runner.stop()


def test_the_shadow_process_outlives_the_thread_that_started_it():
    """A worker loads on a thread of its own that ends once it is loaded. The kernel's
    parent-death signal (the shadow process's SIGKILL when its worker dies) follows the
    *thread* that forked the child, so a child forked from that thread was killed when it
    ended, and learning stopped ("shadow process gone", seen in a benchmark). The child is
    forked from a thread that lives as long as it does."""
    from vllm_srun.tuner.shadows import ShadowProcess

    made: list[ShadowProcess] = []

    def load() -> None:  # as a worker's loader: it goes on (the golden check), then ends
        made.append(ShadowProcess(resolve(L3), "onnxruntime"))
        made[0]._armed.wait(60)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    proc = made[0]
    try:
        wait_until(lambda: proc._loaded.is_set(), 120, "the shadow process loaded")
        time.sleep(0.5)  # a SIGKILL from the loader's end has landed by now
        assert proc.process.is_alive()
        assert proc.forward(pad([row(20)]), 1).outputs.shape[0] == 1
    finally:
        proc.close()
    assert not proc.process.is_alive()


def test_the_shadow_process_dies_with_its_worker_even_while_frozen(tmp_path):
    """A worker killed outright (SIGKILL) takes its shadow process with it, frozen or not:
    no orphan holds a copy of the model. A real worker process."""
    import signal
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from tests.conftest import L3
        from vllm_srun.runtime.artifact import resolve
        from vllm_srun.tuner.shadows import ShadowProcess
        if __name__ == "__main__":
            made = []
            t = threading.Thread(target=lambda: made.append(ShadowProcess(resolve(L3),
                                                                          "onnxruntime")))
            t.start(); t.join()
            made[0]._loaded.wait(120)
            assert made[0].pause(True)
            print(made[0].process.pid, flush=True)
            time.sleep(600)
    """)
    path = tmp_path / "worker.py"
    path.write_text(script)
    worker = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        # frozen: SIGSTOP is delivered asynchronously, so the state is read until it shows
        wait_until(lambda: "stopped" in Path(f"/proc/{child}/status").read_text(), 10,
                   "the shadow process frozen")
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        wait_until(lambda: not Path(f"/proc/{child}").exists() or "zombie" in Path(
            f"/proc/{child}/status").read_text(), 30, "the shadow process gone")
    finally:
        worker.kill()
        worker.wait(30)
