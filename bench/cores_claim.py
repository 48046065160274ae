"""What the host's core ledger (R4.12) costs a served forward: ``claim`` + ``release`` per
forward, timed in a tight loop, side by side in one run.

- ``configured``: a claim at the configured count (mode 0 and 1, and mode 2 wherever it
  serves the configured count): two lock-free stores.
- ``above``: a claim above the configured count, granted: the file lock taken and dropped
  (two ``fcntl`` calls) and the other workers' threads summed.
- ``above, refused``: the same, refused because another worker holds the budget.
- ``above, N workers``: N other processes claiming above their configured count meanwhile,
  once per forward of ``--forward-ms`` (their claim held while they sleep through it), and
  in a tight loop (0 ms: the worst case); a claim that finds the lock held ``LOCK_TRIES``
  times serves the configured count, and the run counts how many did.

Best of ``--repeats`` rounds of ``--claims`` pairs each, microseconds per pair.

    python -m bench.cores_claim [--claims 50000] [--repeats 5] [--workers 3] [--forward-ms 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

from vllm_srun.tuner.cores import CoreShare

BUDGET = 64


def _per_pair_us(share: CoreShare, want: int, floor: int, claims: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(claims):
            share.claim(want, floor)
            share.release()
        best = min(best, (time.perf_counter() - start) / claims * 1e6)
    return best


def _claim_forever(path: str, stop, forward_s: float) -> None:
    share = CoreShare.open(path, BUDGET, "neighbour", linger_s=0.0)
    while not stop.is_set():
        share.claim(4, 1)
        if forward_s:
            time.sleep(forward_s)
        share.release()
    share.close()


def _beside(share: CoreShare, workers: int, forward_s: float, claims: int,
            repeats: int) -> tuple[float, int]:
    """(us per pair, contended claims) with ``workers`` neighbours claiming meanwhile."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_claim_forever, args=(str(share.ledger.path), stop, forward_s))
             for _ in range(workers)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # the neighbours import and start claiming
    before = share.tally.contended
    us = _per_pair_us(share, 8, 2, claims, repeats)
    contended = share.tally.contended - before
    stop.set()
    for p in procs:
        p.join(30)
    return us, contended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claims", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "host.cores"
        share = CoreShare.open(path, BUDGET, "bench", linger_s=0.0)
        rows = [("configured", _per_pair_us(share, 2, 2, args.claims, args.repeats)),
                ("above", _per_pair_us(share, 8, 2, args.claims, args.repeats))]
        holder = CoreShare.open(path, BUDGET, "holder")
        holder.claim(60, 60)
        rows.append(("above, refused", _per_pair_us(share, 8, 2, args.claims, args.repeats)))
        holder.close()
        contended = {}
        for forward_ms in (args.forward_ms, 0.0):
            name = f"above, {args.workers} workers, {forward_ms:g}-ms forwards"
            us, contended[name] = _beside(share, args.workers, forward_ms / 1000, args.claims,
                                          args.repeats)
            rows.append((name, us))
        share.close()
    for name, us in rows:
        extra = (f"  ({contended[name]} of {args.claims * args.repeats} contended: served "
                 "the configured count)") if name in contended else ""
        print(f"{name:<36} {us:6.2f} us per claim + release{extra}")


if __name__ == "__main__":
    main()
