"""Mode 2 verifies shapes in idle time (R4.8, the incremental voucher): the shapes its traffic
served at the configured count for want of a voucher, most served first, then the one-row
shapes of the size ranges traffic reached, shortest first (no longer than the longest
served: the model's limit is not the tuner's to know).

How it works: the tuner notes each served forward whose shape no voucher covers at some
allowed count (``note``, on the served path: a counter). When the shadow loop has nothing
else due, ``step`` takes the next such shape and runs, on the shadow side, one batch of it
(``verify.shape_batch``, as a sweep makes one) at the configured count and at each count not
yet verified for it, and compares the bits: the evidence a sweep has for one shape. Equal:
the shape is verified (written with the tuner's next flush, read back as part of the
voucher). Different: as for a sweep, a shape that differed is recorded and nothing vouches
until a reset (mode 2 acts as mode 1); no served answer differed, so it is not a drift.
It starts only where a shadow sharing the served forwards' cores may
(``scheduling.ShadowGate.may_share``: idle long enough, the recent gaps say the next forward
will not cut in; the shadow budget not spent, no due shadow waiting); served forwards freeze
it as they freeze such shadows. It decides nothing about what is served: what it verified
reaches the voucher, which ``ExactnessLedger.may_serve`` reads (``Voucher.covers``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import numpy as np

from vllm_srun.runtime.sizes import size_range
from vllm_srun.runtime.types import TokenBatch
from vllm_srun.tuner.estimator import typical
from vllm_srun.tuner.ledger import output_bits
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import clean_window, preempted
from vllm_srun.tuner.verify import shape_batch

log = logging.getLogger(__name__)

Shape = tuple[int, int]  # (rows, padded length)
MAX_NOTED = 4096  # unverified shapes remembered (the most served stay)


class IdleVerifier:
    def __init__(self, tuner, seed: int = 0) -> None:
        self.tuner = tuner  # an ``AdaptiveThreads``: its gate, board, budget, freezer, sync
        self.longest = 0  # the longest padded length served
        self.seen: Counter[Shape] = Counter()  # unverified shapes served, how often
        self.ranges: set[int] = set()  # size ranges traffic reached
        self._rng = np.random.default_rng(seed)
        # (rows, length, count) it verified since the tuner last read the voucher back (a
        # reset forgets them in the record; a read after a flush holds them)
        self.done: set[tuple[int, int, int]] = set()
        self._voucher = None  # the voucher ``done`` goes with
        self.verified = 0  # shapes this verifier verified
        self.runs = 0  # shapes it ran (verified, or cut into and run again later)

    def note(self, batch: TokenBatch) -> None:
        """A served forward ended (the tuner's lock held): remember its shape if a count
        other than the configured one is not vouched for it."""
        t = self.tuner
        if t.mode is not AdaptiveMode.SERVE:
            return
        rows, length = batch.input_ids.shape
        self.ranges.add(size_range(rows * length)[0])
        self.longest = max(self.longest, length)
        if (len(self.seen) < MAX_NOTED or (rows, length) in self.seen) \
                and self._todo((rows, length)):
            self.seen[(rows, length)] += 1

    def pending(self) -> bool:
        t = self.tuner
        return t.mode is AdaptiveMode.SERVE and t.ledger.voucher.clean and \
            bool(self.seen or self.ranges)

    def _todo(self, shape: Shape) -> list[int]:
        t = self.tuner
        return [n for n in t.counts if n != t.configured
                and not t.ledger.voucher.covers(*shape, n, t.configured)
                and (*shape, n) not in t.sync.pending.shapes and (*shape, n) not in self.done]

    def _next(self) -> tuple[Shape, list[int]] | None:
        """The most served unverified shape; else the shortest unverified one-row shape of a
        range traffic reached."""
        for shape, _ in self.seen.most_common():
            if todo := self._todo(shape):
                return shape, todo
            del self.seen[shape]  # verified meanwhile (most_common made a list)
        for lo in sorted(self.ranges):
            for length in range(max(2, lo), 2 * lo):
                if length > self.longest:
                    break
                if todo := self._todo((1, length)):
                    return (1, length), todo
            self.ranges.discard(lo)
            return None  # one range at a time: the next call goes on
        return None

    def _may_start(self, now: float) -> bool:
        """Learning runs in mode 2, nothing vouches against it, no served forward runs, no
        due shadow waits, and the idle-class budget is not spent (the tuner's lock held)."""
        t = self.tuner
        return (t.mode is AdaptiveMode.SERVE and t.ledger.learning and t.ledger.voucher.clean
                and not t.learner.board.jobs and not t.flight.busy
                and not t.side.budget.over(now))

    def step(self) -> bool:
        """Verify one shape now, if the tuner lets a core-sharing shadow start. False when
        none may (the shadow loop waits as it does for shadows)."""
        t = self.tuner
        with t.lock:
            now = t.clock()
            if not self._may_start(now) or not t.gate.may_share(now, None):
                return False
            if t.ledger.voucher is not self._voucher:
                self._voucher, self.done = t.ledger.voucher, set()
            pick = self._next()
            if pick is None:
                return False
            (rows, length), counts = pick
            known = t.learner.ranges.get(size_range(rows * length)[0])
            ms = known.samples.get(t.configured) if known is not None else None
            if ms and not t.gate.may_share(now, 2 * typical(ms) / 1000):
                return False
            t.flight.shadow_gated = True  # a served forward that shares its cores freezes it
            epoch, began, frozen = t.flight.epoch, now, t.side.freezer.frozen_total(now)
        batch = shape_batch((rows, length), self._rng)
        reference = t.run_shadow(batch, t.configured)
        results = [(n, t.run_shadow(batch, n)) for n in counts]
        with t.lock:
            now = t.clock()
            t.side.wall_s += now - began
            waited = sum((r.waited_s or 0.0) / max(1, n) for n, r in
                         [(t.configured, reference), *results])
            frozen = t.side.freezer.frozen_total(now) - frozen
            t.side.budget.charge(now - began - frozen - waited, now)
            held_up = any(preempted(r.forward_s, r.waited_s) for _, r in results)
            t.gate.after_sharing(reference, clean_window(0, epoch, t.flight.epoch) and not held_up,
                                 held_up, now)  # cut into: wait for longer gaps, as shadows do
            self.runs += 1
            if not t.ledger.learning:
                return True
            for n, result in results:
                if not np.array_equal(output_bits(result.outputs),
                                      output_bits(reference.outputs)):
                    self._differed(rows, length, n)
                    return True
                t.ledger.comparisons += 1
                t.sync.pending.comparisons += 1
                t.sync.pending.shapes.add((rows, length, n))
                self.done.add((rows, length, n))
            self.verified += 1
        return True

    def _differed(self, rows: int, length: int, n: int) -> None:
        """A shape's answers differed across counts (the tuner's lock held): recorded as a
        sweep's mismatch is, and nothing vouches from now on (the ledger refuses every count
        but the configured one; serving ranges go back to verifying, as when a reset
        retires the voucher)."""
        t = self.tuner
        voucher = t.ledger.voucher
        t.ledger.voucher = replace(voucher, shape_mismatches=voucher.shape_mismatches + 1)
        t.learner.settle_all()
        self.seen.clear()
        self.ranges.clear()
        log.warning("threads_idle_verify_mismatch rows=%d padded_length=%d threads=%d "
                    "configured=%d", rows, length, n, t.configured)
        t.sync.guard("write_shape_mismatch", lambda rec: rec.add_verified_shapes(
            t.sync.scope, t.configured, [], differed=[(rows, length, n)]))
