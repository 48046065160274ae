"""How fast mode 2, with no sweep, verifies the shapes its traffic uses (R4.6, R4.8).

The real engine serves Poisson arrivals (70% short, 25% passages, 5% long inputs; a tenth of
requests carry 4 rows) in mode 2 with an empty host record, shadows in a SCHED_IDLE process
as a deployment runs them. Every ``--every-s`` it prints: distinct shapes (rows x padded
length) served so far, how many of them are verified one by one at 2 threads against 1, and
of the forwards served in the last window, the share whose shape was verified when it ran,
and the share served at 2 threads. Forward times the tuner sees at 1 thread are scaled by
``--slower-at-1`` (answers stay real): 2 threads win in every range, the case where every
shape needs a voucher before it may serve.

    python -m bench.voucher_coverage [--seconds 300] [--rate 20] [--every-s 30]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.corpus import mixed_length, token_row
from vllm_srun.records.host_record import HostRecord, Scope
from vllm_srun.runtime.artifact import DEFAULT_MODEL, resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.golden import golden_rows
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.shadows import ShadowProcess


def _scaled(forward, factor: float):
    def run(batch, n):
        result = forward(batch, n)
        return replace(result, forward_s=result.forward_s * factor) if n == 1 else result
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--rate", type=float, default=20)
    ap.add_argument("--every-s", type=float, default=30)
    ap.add_argument("--slower-at-1", type=float, default=3.0)
    ap.add_argument("--backend", default="onnxruntime")
    args = ap.parse_args()
    manifest = resolve(DEFAULT_MODEL)
    backend = load_backend(manifest, args.backend)
    served: list[tuple[float, int, int, int, bool]] = []  # (when, rows, length, count, ok)
    runner = Runner(manifest, backend, EngineArgs(num_threads=1, cache_entries=0))
    proc = ShadowProcess(manifest, args.backend)
    record = HostRecord(Path(tempfile.mkdtemp()) / "record.sqlite")
    tuner = AdaptiveThreads(AdaptiveMode.SERVE, 1, (1, 2), Scope("bench", "b", "b"), record,
                            _scaled(runner.engine.forward_batch, args.slower_at_1),
                            TunerSettings(), shadow_forward=_scaled(proc.forward,
                                                                   args.slower_at_1),
                            on_close=proc.close, pause_shadows=proc.pause)

    class Watched:  # the tuner, and what each served forward's shape was when it ran
        def served_threads(self, batch):
            return tuner.served_threads(batch)

        def observe(self, batch, result):
            if result is not None:
                rows, length = batch.input_ids.shape
                served.append((time.monotonic(), rows, length, result.num_threads,
                               tuner.ledger.voucher.covers(rows, length, 2, 1)))
            tuner.observe(batch, result)

        def __getattr__(self, name):
            return getattr(tuner, name)

    runner.engine.threads = Watched()
    runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer)))
    time.sleep(8)  # the shadow side loads and warms before traffic starts
    rng = np.random.default_rng(0)
    pending, start = [], time.monotonic()
    stop = threading.Event()

    def report() -> None:
        seen: set[tuple[int, int]] = set()
        last = 0
        print("| s | shapes served | of them verified | window forwards | verified when run "
              "| served at 2 |")
        print("|---|---|---|---|---|---|")
        while not stop.wait(args.every_s):
            now, window = time.monotonic() - start, served[last:]
            last += len(window)
            seen |= {(r, n) for _, r, n, _, _ in window}
            verified = {(r, n) for r, n, k, c in tuner.ledger.voucher.verified if (k, c) == (2, 1)}
            ok = sum(w[4] for w in window) / max(1, len(window))
            at2 = sum(w[3] == 2 for w in window) / max(1, len(window))
            print(f"| {now:.0f} | {len(seen)} | {len(seen & verified)} | {len(window)} | "
                  f"{ok:.0%} | {at2:.0%} |", flush=True)

    watcher = threading.Thread(target=report, daemon=True)
    watcher.start()
    t = start
    while t - start < args.seconds:
        t += float(rng.exponential(1 / args.rate))
        time.sleep(max(0.0, t - time.monotonic()))
        rows = 4 if rng.random() < 0.1 else 1
        length = mixed_length(rng)
        pending.append(runner.engine.submit([token_row(length if i == 0 else max(
            4, length - int(rng.integers(0, 4))), rng) for i in range(rows)]))
    for f in pending:
        f.result(timeout=120)
    stop.set()
    watcher.join()
    print(f"learned: { {lo: r.learned for lo, r in sorted(tuner.learner.ranges.items())} }; "
          f"shadow comparisons {tuner.ledger.comparisons}, "
          f"uncovered forwards {tuner.tally.uncovered}, "
          f"shadow seconds {tuner.side.budget.used_s:.1f}; shapes verified in idle time "
          f"{tuner.side.verifier.verified} (run {tuner.side.verifier.runs})")
    runner.stop()


if __name__ == "__main__":
    main()
