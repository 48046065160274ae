"""R4.11 for each size range (``learning.Learner``, whose part this is): a learned range watches
the forwards at its counts, like against like (``estimator.changed``), and explores again
when they moved. A mixin: it reads the learner's ``ranges``, ``counts``, ``settings`` and
``board``.
"""

from __future__ import annotations

import logging

from vllm_srun.tuner.estimator import changed, typical
from vllm_srun.tuner.ranges import Phase, RangeLearning, relearn

log = logging.getLogger(__name__)


class Relearning:
    def watch_served(self, lo: int, r: RangeLearning, count: int, ms: float, tokens: int,
                     contention: str | None, followed: bool) -> None:
        """A learned range served a forward at ``count`` that took ``ms`` with its cores free
        (``Learner.served``): its time for the change detector (``watch``). Not a count
        that serves below the learned one meanwhile, nor the learned count where it
        serves above the smallest where the free cores are read (``followed``; where
        they are not, a neighbour shows only here): other tasks that take its cores are
        followed by serving a count below it (``samples.fastest_under``), and a
        lasting change by the probe shadows (idle class, their threads' waits taken
        out), so a neighbour the load factor reads short of its real cost relearns
        nothing (whether the scaled served times could watch it too is not measured).
        Not a range in its transition window on the count it serves meanwhile either (a
        neighbour that came and went restarted it, again and again, before it could
        pass)."""
        if contention is None and r.phase is not Phase.VERIFYING and not (
                followed and r.serving and count == r.learned > min(self.counts)):
            self.watch(lo, r, (count, "served"), self.at_lo(lo, r, ms, tokens),
                       self.settings.learning.relearn_window)

    @staticmethod
    def at_lo(lo: int, r: RangeLearning, ms: float, tokens: int) -> float:
        """One forward's time as a forward of ``lo`` padded tokens, by the size exponent
        its range was learned with (``samples.at_size``): like against like."""
        return ms * (lo / tokens) ** r.exponent

    def watch(self, lo: int, r: RangeLearning, key: tuple[int, str], sized_ms: float,
              window: int) -> None:
        """R4.11, the change detector (``estimator.changed``): forwards at one count against
        forwards at that same count when the range was learned, like against like: probe
        shadows (clean, SCHED_IDLE) against the samples it was learned from; served forwards
        against the first ``window`` served after it was learned. A learned count far faster
        than the configured one never triggers it; a neighbour that arrives slows the served
        count, one that leaves speeds up a probe."""
        recent = r.recent.setdefault(key, [])
        recent.append(sized_ms)
        if len(recent) < window:
            return
        r.recent[key] = []
        baseline = r.baselines.get(key)
        if baseline is None:
            r.baselines[key] = typical(recent)
            return
        if changed(recent, baseline, self.settings.learning.relearn_factor):
            log.info("threads_relearn range=%d-%d num_threads=%d forwards=%s ratio=%.2f",
                     lo, 2 * lo - 1, key[0], key[1], typical(recent) / baseline)
            # a probe moved: the verified count serves on meanwhile; not if it slowed
            self.relearn(lo, r, r.learned if r.serving and key[1] == "shadow" else None)

    def relearn(self, lo: int, r: RangeLearning, keep_serving: int | None) -> None:
        self.ranges[lo] = relearn(r, keep_serving)
        self.board.forget(lo)

