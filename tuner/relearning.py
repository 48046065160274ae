"""R4.11 for each size range (``learning.Learner``, whose part this is): a learned range watches
the forwards at its counts, like against like (``estimator.changed``), and explores again
when they moved; a served forward's slowdown also feeds the contention watch. A mixin: it
reads the learner's ``ranges``, ``counts``, ``settings``, ``contention`` and ``board``.
"""

from __future__ import annotations

import logging

from vllm_srun.runtime.types import ForwardResult
from vllm_srun.tuner.estimator import changed, typical
from vllm_srun.tuner.ranges import Phase, RangeLearning, relearn

log = logging.getLogger(__name__)


class Relearning:
    def watch_served(self, lo: int, r: RangeLearning, result: ForwardResult, tokens: int,
                     contention: str | None) -> None:
        """A learned range served a forward: its slowdown for the contention watch, and its
        time for the change detector (``watch``)."""
        per_token = result.forward_s * 1000 / tokens
        if (base := r.baselines.get((result.num_threads, "shadow"))) is not None:
            self.contention.note_slowdown(result.num_threads, per_token / base,
                                          contention == "probe")
        if contention is None and r.phase is not Phase.VERIFYING and not (
                r.serving and result.num_threads == r.learned > min(self.counts)):
            # a served count that contention can fall back from relearns by
            # ``contention_relearn_s`` instead (a brief neighbour: no relearning); a range in
            # its transition window is not relearned on the count it serves meanwhile (a
            # neighbour that comes and goes restarted it, again and again, before it could
            # pass)
            self.watch(lo, r, (result.num_threads, "served"), per_token,
                       self.settings.learning.relearn_window)

    def watch(self, lo: int, r: RangeLearning, key: tuple[int, str], per_token_ms: float,
              window: int) -> None:
        """R4.11, the change detector (``estimator.changed``): forwards at one count against
        forwards at that same count when the range was learned, like against like: probe
        shadows (clean, SCHED_IDLE) against the samples it was learned from; served forwards
        against the first ``window`` served after it was learned. A learned count far faster
        than the configured one never triggers it; a neighbour that arrives slows the served
        count, one that leaves speeds up a probe."""
        recent = r.recent.setdefault(key, [])
        recent.append(per_token_ms)
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
        self.contention.forget(lo)
        self.board.forget(lo)

