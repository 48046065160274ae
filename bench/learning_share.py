"""Does mode 2's transition window complete under steady closed-loop load (R4.5 amended)?

The real engine and L6 in one process, mode 2 with a voucher for the shapes served, shadows in
a ``ShadowProcess`` (idle class; paid ones at normal priority) as a deployment wires them, 16
closed-loop clients of one-row requests (8-200 tokens) from the first second. The forward
time at the configured count (1) is reported 2x what it ran (a forward-time model, as the
tests' ``SlowerAt``: which count wins does not hang on this shared host's load), so every
range learns 2 threads and must pass its window to serve them. Run once with the paid
learning share at its default and once at 0 (idle CPU only), alternating; reports per run
how many ranges served their learned count, when the first and last began, and the paid
share's seconds against served forward seconds.

    python -m bench.learning_share [--seconds 60] [--rounds 1]
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import replace

import numpy as np

from vllm_srun.records.host_record import HostRecord, Scope
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.golden import golden_rows
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.shadows import ShadowProcess
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep

MODEL = "all-MiniLM-L6-v2"


class Slower1:
    """The backend with forward time at 1 thread reported 2x (answers unchanged)."""

    def __init__(self, backend) -> None:
        self.backend, self.name = backend, backend.name

    def forward(self, batch, num_threads):
        r = self.backend.forward(batch, num_threads)
        return replace(r, forward_s=r.forward_s * (2.0 if num_threads == 1 else 1.0))

    def twin(self):
        return Slower1(self.backend.twin())

    def close(self) -> None:
        self.backend.close()


def run_once(share: float, seconds: float, tmp: str, seed: int) -> dict:
    manifest = resolve(MODEL)
    backend = Slower1(load_backend(manifest, "onnxruntime"))
    record = HostRecord(f"{tmp}/r-{share}-{seed}.sqlite")
    scope = Scope("bench-host", manifest.revision, "onnxruntime")
    plan = plan_sweep(ShapeBounds(max_rows=1, max_len=256, max_padded=256))
    record.add_voucher(scope, "verify", len(plan.shapes), 0, plan.coverage((1, 2)))
    shadows = ShadowProcess(manifest, "onnxruntime")
    runner = Runner(manifest, backend, EngineArgs(num_threads=1, max_num_seqs=1,
                                                  cache_entries=0))
    tuner = AdaptiveThreads(AdaptiveMode.SERVE, 1, (1, 2), scope, record,
                            runner.engine.forward_batch, TunerSettings.of(learning_share=share),
                            shadow_forward=shadows.forward, on_close=shadows.close,
                            pause_shadows=shadows.pause,
                            paid_forward=lambda b, n: shadows.forward(b, n, paid=True))
    runner.engine.threads = tuner
    runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer)))
    stop, began, serving_at = threading.Event(), time.monotonic(), {}
    served = [0]

    def client(i: int) -> None:
        rng = np.random.default_rng(seed * 100 + i)
        while not stop.is_set():
            n = int(np.exp(rng.uniform(np.log(8), np.log(200))))
            runner.engine.submit([[101, *map(int, rng.integers(1000, 29000, n - 2)), 102]]) \
                .result(timeout=120)
            served[0] += 1

    clients = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for c in clients:
        c.start()
    try:
        while time.monotonic() - began < seconds:
            time.sleep(0.5)
            with tuner.lock:
                for lo, r in tuner.learner.ranges.items():
                    if r.serving and lo not in serving_at:
                        serving_at[lo] = round(time.monotonic() - began, 1)
    finally:
        stop.set()
        for c in clients:
            c.join(120)
        with tuner.lock:
            ranges = {lo: (r.phase.value, r.learned)
                      for lo, r in sorted(tuner.learner.ranges.items())}
            paid = tuner.side.paid
            out = {"share": share, "requests": served[0], "ranges": ranges,
                   "serving_from_s": serving_at, "paid_shadows": paid.paid_shadows,
                   "paid_s": round(paid.paid_s, 3), "served_s": round(paid.served_s, 3),
                   "comparisons": tuner.ledger.comparisons,
                   "drift": tuner.ledger.retired is not None}
        runner.stop()
    return out


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--rounds", type=int, default=1)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="learning-share-")
    for i in range(a.rounds):
        for share in (0.02, 0.0):
            print(run_once(share, a.seconds, tmp, i), flush=True)


if __name__ == "__main__":
    main()
