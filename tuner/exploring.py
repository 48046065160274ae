"""Which counts an exploring range times (R4.5, R4.8, R4.12; ``learning.Learner``, whose part this
is): those it still needs samples of by the estimator's rule, less those the host's cores keep
out of its reach (a live sibling's count first, R4.12), and in mode 2 with a voucher the count
a served forward explores at. A mixin: it reads the learner's ``ranges``, ``counts``,
``configured``, ``settings``, ``ledger``, ``free_cores`` and ``tally``, and calls its
``update``.
"""

from __future__ import annotations

import logging

from vllm_srun.tuner.estimator import counts_to_sample, out_of_reach
from vllm_srun.tuner.policy import explore_count
from vllm_srun.tuner.ranges import Phase, RangeLearning, sized
from vllm_srun.tuner.samples import load_factor, served_sample_ms

log = logging.getLogger(__name__)

# why a range no longer times a count (``Exploring.unreachable``; the report shows it)
REFUSED, HELD = "the core ledger refused it", "other tasks held its cores"


class Exploring:
    def need(self, r: RangeLearning) -> list[int]:
        """Counts an exploring range still needs samples of (``explored``): ``min_samples``
        of each, then more of those the rule is unsure of (``estimator.counts_to_sample``),
        judged by the samples ``update`` decides on (``ranges.sized``): a count ruled out by its
        times in ms but not at one size would be neither timed nor decided without, and
        the range would explore for good."""
        s = self.settings.learning
        return counts_to_sample(sized(r), self.explored(r), self.configured,
                                s.min_samples, s.max_samples, s.margin)

    def explored(self, r: RangeLearning) -> tuple[int, ...]:
        """The counts a range times: a sibling's candidate and the configured count, or all;
        less those the host's core ledger keeps out of its reach (``estimator.out_of_reach``)."""
        counts = self.counts if r.candidate is None else (self.configured, r.candidate)
        out = self.unreachable(r)
        kept = tuple(n for n in counts if n not in out)
        # a sibling's pair all out: every count (the smallest is never out of reach)
        return kept or tuple(n for n in self.counts if n not in out)

    def unreachable(self, r: RangeLearning) -> dict[int, str]:
        """Count -> why range ``r`` no longer times it (``estimator.out_of_reach``): the core
        ledger refused it, or other tasks held its cores for ``held_out_s`` on end, as this
        range's forwards read them (``explore_served``)."""
        if not r.refused and not r.held:
            return {}
        long = self.settings.learning.held_out_s
        held_out = [n for n, (first, last) in r.held.items() if last - first >= long]
        held = out_of_reach({}, r.samples, self.counts, self.configured, held_out)
        refused = out_of_reach(r.refused, r.samples, self.counts, self.configured)
        return {**dict.fromkeys(held, HELD), **dict.fromkeys(refused, REFUSED)}

    def adopt(self, candidates: dict[int, int]) -> None:
        """R4.12: range -> a count a live sibling of the scope learned there. A range that has
        not started relearning, nor rejected that count, times it against the configured
        count instead of exploring every count; the ledger still gates what it serves."""
        for lo, n in candidates.items():
            r = self.ranges.setdefault(lo, RangeLearning())
            if r.phase is Phase.EXPLORING and r.candidate is None and n not in r.rejected:
                r.candidate = n
                log.info("threads_sibling_candidate range=%d-%d num_threads=%d", lo,
                         2 * lo - 1, n)
                self.update(lo, r)  # samples it took already may decide it

    def explore_served(self, lo: int, r: RangeLearning, serving: int, now: float,
                       behind: bool = False) -> int:
        """Mode 2, vouched: an exploring range times each count on served forwards, the one
        it lacks samples of most first (``policy.explore_count``), unless the engine is
        ``behind`` (more rows wait than one forward takes): the forward then serves the count
        fastest so far. A count slower than the best delays every row waiting, not only its
        own, and a worker behind forms larger batches, of size ranges not reached before,
        each exploring in turn: beside a neighbour that took half of 16 cores, a simulated
        worker timed 1,500 padded tokens at 1 thread (0.8 s) and stayed behind to the end
        of the run (``bench/tuner_sweep.py``, 16 cores, seed 31). A count whose forward would
        now take twice its time or more (``samples.load_factor``: other tasks want a core
        of it) waits: it would give no sample (``served``) and cost the forward that much.
        Such a count is out of the range's reach once this range's own forwards found it held
        for ``held_out_s`` with none between that found its cores left (``unreachable``),
        and back in it at the next that does: the time since one such forward, with no
        forward of the range in it, says nothing of the cores."""
        if r.candidate is not None:  # a sibling's count serves after its window only
            return serving

        def vouched(n: int) -> bool:
            return self.ledger.voucher.covers_counts(n, self.configured)

        if behind:
            self.tally.behind += 1
            return explore_count(r.samples, self.counts, serving, (), vouched)
        if not r.explore_served:
            r.explore_served = True
            log.info("threads_explore_served range=%d-%d", lo, 2 * lo - 1)
        free = self.free_cores.at(now)
        for k in {*self.need(r), *r.held}:  # those held out of reach too: they come back
            if served_sample_ms(1.0, load_factor(k, free)) is None:
                r.held[k] = (r.held.get(k, (now, now))[0], now)
            else:
                r.held.pop(k, None)
        need = [k for k in self.need(r) if k not in r.held]
        if not need and r.held:
            self.update(lo, r)  # a count held out of reach may leave the rule sure
            need = [k for k in self.need(r) if k not in r.held]
        return explore_count(r.samples, self.counts, serving, need, vouched)
