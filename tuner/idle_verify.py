"""Mode 2 verifies shapes in idle time (R4.8, the incremental voucher): the shapes its traffic
served at the configured count for want of a voucher, most served first, then the one-row
shapes of the size ranges traffic reached, shortest first (no longer than the longest
served: the model's limit is not the tuner's to know), on the length grid a mode 2 engine
pads to (``runtime.sizes.grid_length``).

How it works: the tuner notes each served forward whose shape no voucher covers at some
allowed count (``note``, on the served path: a counter, and for the most served such shapes
the latest batch served at the configured count with its answer). When the shadow loop has
nothing else due, ``step`` takes the next such shape and runs, on the shadow side, that
served batch at each count not yet verified for it and compares the bits with the answer
served; for a shape with no batch kept, one batch of it (``verify.shape_batch``, as a sweep
makes one) at the configured count as well: the evidence a sweep has for one shape. Equal:
the shape is verified (written with the tuner's next flush, read back as part of the
voucher). Different: as for a sweep, a shape that differed is recorded and nothing vouches
until a reset (mode 2 acts as mode 1); every answer served was the configured count's, so
none differed from what it should be: not a drift.
It starts where a shadow sharing the served forwards' cores may
(``scheduling.ShadowGate.may_share``: idle long enough, the recent gaps say the next forward
will not cut in; the shadow budget not spent, no due shadow waiting); served forwards freeze
it as they freeze such shadows. Where no such idle time let a shape be verified for
``starved_s``, the learning share pays for the most served one it affords, at normal
priority and unfrozen, as for a paid shadow (``step``). It decides nothing about what is
served: what it verified reaches the voucher, which ``ExactnessLedger.may_serve`` reads
(``Voucher.covers``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from vllm_srun.runtime.sizes import on_grid, size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.estimator import typical
from vllm_srun.tuner.ledger import output_bits
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import clean_window, preempted
from vllm_srun.tuner.verify import shape_batch

log = logging.getLogger(__name__)

Shape = tuple[int, int]  # (rows, padded length)
MAX_NOTED = 4096  # unverified shapes remembered (the most served stay)
# unverified shapes whose latest served batch and answer are kept, the most served: a paid
# verification picks the most served shape it affords, and 65 were verified in 3 minutes
# under 16 connections (``bench.mode2_coverage``), so a few dozen cover what it reaches;
# the bound on memory is this many batches of ``max_num_batched_tokens`` and their answers
MAX_KEPT = 64


class IdleVerifier:
    def __init__(self, tuner, seed: int = 0) -> None:
        self.tuner = tuner  # an ``AdaptiveThreads``: its gate, board, budget, freezer, sync
        self.longest = 0  # the longest padded length served
        self.seen: Counter[Shape] = Counter()  # unverified shapes served, how often
        self.served_s: dict[Shape, float] = {}  # ... and how long the last one took
        # ... and, for at most MAX_KEPT of them, the last batch served at the configured
        # count with its answer (verified against it, no forward at the configured count runs)
        self.kept: dict[Shape, tuple[TokenBatch, np.ndarray]] = {}
        self.ranges: set[int] = set()  # size ranges traffic reached
        self._rng = np.random.default_rng(seed)
        # (rows, length, count) it verified since the tuner last read the voucher back (a
        # reset forgets them in the record; a read after a flush holds them)
        self.done: set[tuple[int, int, int]] = set()
        self._voucher = None  # the voucher ``done`` goes with
        self.verified = 0  # shapes this verifier verified in idle time
        self.verified_paid = 0  # ... and paid from the learning share
        self._progress_at = tuner.clock()  # when it last verified a shape (or began)
        self.runs = 0  # shapes it ran (verified, or cut into and run again later)
        self.against_served = 0  # shapes it verified against an answer it served

    def note(self, batch: TokenBatch, result: ForwardResult) -> None:
        """A served forward ended (the tuner's lock held): remember its shape if a count
        other than the configured one is not vouched for it, and, served at the configured
        count, keep the batch and its answer if the shape is among the most served."""
        t = self.tuner
        if t.mode is not AdaptiveMode.SERVE:
            return
        rows, length = shape = batch.input_ids.shape
        self.ranges.add(size_range(rows * length)[0])
        self.longest = max(self.longest, length)
        if (len(self.seen) < MAX_NOTED or shape in self.seen) and self._todo(shape):
            self.seen[shape] += 1
            self.served_s[shape] = result.forward_s
            if result.num_threads == t.configured:
                self._keep(shape, batch, result.outputs)

    def _keep(self, shape: Shape, batch: TokenBatch, outputs: np.ndarray) -> None:
        if shape not in self.kept and len(self.kept) >= MAX_KEPT:
            least = min(self.kept, key=lambda s: self.seen[s])
            if self.seen[least] >= self.seen[shape]:
                return
            del self.kept[least]
        self.kept[shape] = (batch, outputs)

    def _forget(self, shape: Shape) -> None:
        del self.seen[shape]
        self.served_s.pop(shape, None)
        self.kept.pop(shape, None)

    def pending(self) -> bool:
        t = self.tuner
        return t.mode is AdaptiveMode.SERVE and t.ledger.voucher.clean and \
            bool(self.seen or self.ranges)

    def _todo(self, shape: Shape) -> list[int]:
        t = self.tuner
        return [n for n in t.counts if n != t.configured
                and not t.ledger.voucher.covers(*shape, n, t.configured)
                and (*shape, n) not in t.sync.pending.shapes and (*shape, n) not in self.done]

    def _next(self, fits: Callable[[Shape, list[int]], bool] | None = None
              ) -> tuple[Shape, list[int]] | None:
        """The most served unverified shape (with ``fits``, the most served that fits, and
        nothing else); else the shortest unverified one-row shape of a range traffic
        reached."""
        for shape, _ in self.seen.most_common():
            if todo := self._todo(shape):
                if fits is None or fits(shape, todo):
                    return shape, todo
                continue
            self._forget(shape)  # verified meanwhile (most_common made a list)
        if fits is not None:
            return None
        for lo in sorted(self.ranges):
            for length in range(max(2, lo), 2 * lo):
                if length > self.longest:
                    break
                if not on_grid(length, self.longest):  # no mode 2 forward has it
                    continue
                if todo := self._todo((1, length)):
                    return (1, length), todo
            self.ranges.discard(lo)
            return None  # one range at a time: the next call goes on
        return None

    def _may_start(self, now: float) -> bool:
        """Learning runs in mode 2 and nothing vouches against it (the tuner's lock held)."""
        t = self.tuner
        return t.mode is AdaptiveMode.SERVE and t.ledger.learning and t.ledger.voucher.clean

    def _idle(self, now: float) -> bool:
        """No served forward runs, no due shadow waits, the idle-class budget is not spent
        and a core-sharing shadow may start (``ShadowGate.may_share``)."""
        t = self.tuner
        return (not t.learner.board.jobs and not t.flight.busy and not t.side.budget.over(now)
                and t.gate.may_share(now, None))

    def _forward_s(self, shape: Shape) -> float | None:
        """What one forward of ``shape`` is expected to take: as long as the last served
        forward of that shape (at the configured count: it was not verified), else the
        typical time of its range's at the configured count (None: neither known; a range's
        samples alone left it unknown where other tasks held cores, since such forwards are
        no samples)."""
        t = self.tuner
        one = self.served_s.get(shape)
        if one is None:
            known = t.learner.ranges.get(size_range(shape[0] * shape[1])[0])
            ms = known.samples.get(t.configured) if known is not None else None
            one = typical(ms) / 1000 if ms else None
        return one

    def _cost_s(self, shape: Shape, counts: list[int]) -> float | None:
        """What verifying ``shape`` at ``counts`` is expected to take: a forward at each
        count, and at the configured count too where no served answer is kept for it, none
        taken as faster than one at the configured count (``_forward_s``)."""
        one = self._forward_s(shape)
        return None if one is None else one * (len(counts) + (shape not in self.kept))

    def _affords(self, shape: Shape, counts: list[int]) -> bool:
        cost_s = self._cost_s(shape, counts)
        return cost_s is not None and self.tuner.side.paid.affords(
            cost_s, size_range(shape[0] * shape[1])[0])

    def _paid(self, now: float) -> tuple[Shape, list[int]] | None:
        """No idle time let a shape be verified for ``starved_s``, so the learning share pays
        for the most served unverified shape whose cost it affords (``_cost_s``; mode 2: its
        range's own bucket too), where no timed served forward holds the shadow side
        frozen."""
        t = self.tuner
        if now - self._progress_at < t.settings.spending.starved_s or t.side.freezer.running:
            return None
        return self._next(fits=self._affords)

    def step(self) -> bool:
        """Verify one shape now: in idle time, if the tuner lets a core-sharing shadow start;
        else, where no idle time came for ``starved_s``, paid from the learning share (R4.5
        amended). Under 16 connections on 2 vCPUs a worker without a sweep verified no shape
        in idle time; with comparisons alone it had 26 verified after 3 minutes, the share
        0.5% spent, and ran 19 forwards a second at the configured count for want of one;
        paid, 65 (38 paid), the share 2.0%, and 16 a second; paid with a batch made for the
        shape at both counts, 102 after 5 minutes and 14.5 a second, 0.79x a fixed 2;
        against the answers served (one forward each, not two), 155-158 and 3.5-4.6 a
        second, 0.86-0.89x (``bench.mode2_coverage``, one run each, two of the last).
        False when neither may (the shadow loop waits as it does for shadows)."""
        t = self.tuner
        with t.lock:
            now = t.clock()
            if not self._may_start(now):
                return False
            if t.ledger.voucher is not self._voucher:
                self._voucher, self.done = t.ledger.voucher, set()
            paid = not self._idle(now)
            pick = self._paid(now) if paid else self._next()
            if pick is None:
                return False
            (rows, length), counts = pick
            lo = size_range(rows * length)[0]
            one = self._forward_s((rows, length))
            if not paid and one and not t.gate.may_share(now, 2 * one):
                return False
            kept = self.kept.get((rows, length))
            if paid:  # never frozen (held frozen since the last forward: released)
                t.side.freezer.release()
                t.flight.shadow_began(lo, False, True)
            else:  # a served forward that shares its cores freezes it
                t.flight.shadow_gated = True
            epoch, began, frozen = t.flight.epoch, now, t.side.freezer.frozen_total(now)
        batch, served = kept if kept is not None else (shape_batch((rows, length), self._rng),
                                                        None)
        ran = []
        try:
            if served is None:
                ran.append((t.configured, t.run_shadow(batch, t.configured, paid)))
                served = ran[0][1].outputs
            results = [(n, t.run_shadow(batch, n, paid)) for n in counts]
        finally:
            with t.lock:
                t.flight.shadow_paid = False
        ran += results
        with t.lock:
            now = t.clock()
            t.side.wall_s += now - began
            waited = sum((r.waited_s or 0.0) / max(1, n) for n, r in ran)
            if paid:
                t.side.paid.charge(max(0.0, now - began - waited), lo)
                self._progress_at = now
            else:
                frozen = t.side.freezer.frozen_total(now) - frozen
                t.side.budget.charge(now - began - frozen - waited, now)
                held_up = any(preempted(r.forward_s, r.waited_s) for _, r in results)
                t.gate.after_sharing(ran[0][1], clean_window(0, epoch, t.flight.epoch)
                                     and not held_up, held_up, now)  # cut into: longer gaps
            self.runs += 1
            if not t.ledger.learning:
                return True
            for n, result in results:
                if not np.array_equal(output_bits(result.outputs), output_bits(served)):
                    self._differed(rows, length, n)
                    return True
                t.ledger.comparisons += 1
                t.sync.pending.comparisons += 1
                t.sync.pending.shapes.add((rows, length, n))
                self.done.add((rows, length, n))
            self.against_served += kept is not None
            self.kept.pop((rows, length), None)
            if paid:
                self.verified_paid += 1
            else:
                self.verified += 1
                self._progress_at = now
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
        self.served_s.clear()
        self.kept.clear()
        self.ranges.clear()
        log.warning("threads_idle_verify_mismatch rows=%d padded_length=%d threads=%d "
                    "configured=%d", rows, length, n, t.configured)
        t.sync.guard("write_shape_mismatch", lambda rec: rec.add_verified_shapes(
            t.sync.scope, t.configured, [], differed=[(rows, length, n)]))
