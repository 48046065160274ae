"""Mode 2 does not explore on served forwards while the engine is behind its arrivals (R4.5,
R4.8): more rows wait than one forward takes (``max_num_seqs``). A forward at a count slower
than the best delays every row waiting, and a worker behind forms larger batches, of size
ranges it had not reached, each exploring in turn; so such a forward serves the count fastest
so far. A real worker wires its engine's ``behind`` into its tuner; the learner's rule is
shown on its own."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.conftest import FAST, L6, row
from tests.test_length_grid import vouch
from vllm_srun.records.host_record import Scope
from vllm_srun.records.voucher import Coverage, Voucher
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.server.worker.assembly import Worker
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.tuner.contention import FreeCores
from vllm_srun.tuner.learning import Learner
from vllm_srun.tuner.ledger import ExactnessLedger
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import RecordSync
from vllm_srun.tuner.ranges import RangeLearning
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.tally import Tally


class HeldFirst:
    """The real backend; the first forward of ``length`` tokens that the engine serves is held
    from its start until ``release`` is set."""

    def __init__(self, backend, length: int) -> None:
        self._backend, self.length = backend, length
        self.started, self.release = threading.Event(), threading.Event()

    def forward(self, batch, num_threads):
        if (batch.input_ids.shape == (1, self.length) and not self.started.is_set()
                and threading.current_thread().name.startswith("engine")):
            self.started.set()
            assert self.release.wait(60)
        return self._backend.forward(batch, num_threads)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_a_mode_2_worker_does_not_explore_while_more_rows_wait_than_a_forward_takes(
        tmp_path: Path):
    held: list[HeldFirst] = []

    def hold(backend) -> HeldFirst:
        held.append(HeldFirst(backend, 15))
        return held[-1]

    spec = WorkerSpec(L6, "onnxruntime", EngineArgs(num_threads=1, cache_entries=0), budget=2,
                      mode=AdaptiveMode.SERVE, record_path=str(tmp_path / "r.sqlite"),
                      settings=FAST, calibrate=False)
    made = Worker(spec, wrap_backend=hold)
    runner = made.load()
    try:
        assert runner.ready, runner.not_ready_reason
        engine, tuner = runner.engine, made.tuner
        assert tuner.behind == engine.behind  # the worker wired the two
        vouch(made, tmp_path, 16)  # a voucher: mode 2 may explore on served forwards
        first = engine.submit([row(15)])
        assert held[0].started.wait(30)
        assert not engine.behind()
        rows = [engine.submit([row(14, salt=i)]) for i in range(3 * 32 + 16)]
        assert engine.behind()  # 112 rows wait; a forward takes 32
        held[0].release.set()
        assert first.result(timeout=60).shape == (1, 384)
        assert all(f.result(timeout=60).shape == (1, 384) for f in rows)
        assert not engine.behind()
        # forwards of 32 rows: the first met a range not seen before (no state yet), the
        # second left 48 rows waiting and did not explore; the third left 16
        assert tuner.tally.behind == 1
        learning = made.threads_report(runner)["learning"]
        assert learning["forwards_not_explored_engine_behind"] == tuner.tally.behind
    finally:
        if held:
            held[0].release.set()
        runner.stop()


def test_behind_an_exploring_range_serves_its_fastest_count_so_far():
    settings = TunerSettings.of(background=False)
    mode = AdaptiveMode.SERVE
    ledger = ExactnessLedger(mode, 1, 8)
    ledger.voucher = Voucher(1, 0, True, (Coverage((1, 2, 4), 32, 2, 512, 2048, 2048, 1),))
    tally = Tally()
    learner = Learner(mode, 1, (1, 2, 4), settings, ledger,
                      RecordSync(None, Scope("test-host", "rev1", "onnxruntime"), lambda: 0.0),
                      FreeCores(None, 0.1), tally, "w")
    r = learner.ranges[64] = RangeLearning()
    for _ in range(4):
        learner.sample(64, r, 1, 9.0, 64)
        learner.sample(64, r, 2, 5.0, 64)
    assert r.learned is None  # 4 threads not timed yet
    assert learner.explore_served(64, r, 1, 1.0, behind=True) == 2  # the fastest so far
    assert tally.behind == 1
    assert learner.explore_served(64, r, 1, 2.0) == 4  # not behind: the count it lacks
    assert tally.behind == 1
