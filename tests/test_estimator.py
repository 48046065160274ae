"""R4.13, R4.11: the estimator's pure functions on recorded inputs: the statistic and its
interval, the rule that chooses a count, the change detector, and what a paid shadow's
measurement would cost a served forward."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_srun.records.host_record import Scope
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.contention import FreeCores
from vllm_srun.tuner.estimator import (
    changed,
    choose,
    counts_needing_samples,
    counts_to_sample,
    estimate,
    out_of_reach,
    past_a_slower_count,
)
from vllm_srun.tuner.learning import Learner
from vllm_srun.tuner.ledger import ExactnessLedger
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import RecordSync
from vllm_srun.tuner.policy import explore_count
from vllm_srun.tuner.ranges import RangeLearning
from vllm_srun.tuner.samples import (
    at_size,
    fastest_under,
    load_factor,
    served_cost_ms,
    served_sample_ms,
    size_exponent,
)
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.tally import Tally


def test_the_estimate_is_the_median_with_an_order_statistic_interval():
    e = estimate([float(x) for x in range(1, 13)])  # 1..12
    assert (e.ms, e.samples) == (6.5, 12)
    assert e.low_ms < e.ms < e.high_ms and (e.low_ms, e.high_ms) == (3.0, 9.0)
    # the interval holds the true median in about 80% of draws
    rng = np.random.default_rng(0)
    held = sum(estimate(list(rng.exponential(1.0, 12))).low_ms < np.log(2) <
               estimate(list(rng.exponential(1.0, 12))).high_ms for _ in range(400))
    assert held > 0.7 * 400
    assert estimate([]) is None and estimate([5.0]) == estimate([5.0])


def test_a_count_replaces_the_configured_one_only_when_its_interval_clears_the_margin():
    configured = [10.0] * 12
    clear = [8.0] * 12  # 20% faster throughout
    close = [9.7] * 12  # 3%: inside the 5% margin
    spread = [5.0] * 6 + [9.8] * 6  # median 7.4, but half its samples within the margin
    assert choose({1: configured, 2: clear}, (1, 2), 1, 12, 0.05, 48) == 2
    assert choose({1: configured, 2: close}, (1, 2), 1, 12, 0.05, 48) == 1
    assert choose({1: clear, 2: configured}, (1, 2), 2, 12, 0.05, 48) == 1
    assert choose({1: configured, 2: clear[:11]}, (1, 2), 1, 12, 0.05, 48) is None
    # unsure (its median under the bar, its interval over it): both counts take more
    # samples, up to the most a decision rests on, where the medians decide
    noisy = [9.6, 10.4] * 6  # median 10, its interval reaching into 2's
    unsure = {1: noisy, 2: spread}
    assert choose(unsure, (1, 2), 1, 12, 0.05, 48) is None
    assert counts_to_sample(unsure, (1, 2), 1, 12, 48, 0.05) == [1, 2]
    assert choose({1: noisy * 4, 2: spread * 4}, (1, 2), 1, 12, 0.05, 48) == 2
    # an interval wholly at or over the bar decides for the configured count at once; a
    # median over it with the interval reaching under it is unsure too
    assert choose({1: configured, 2: [9.6, 9.8, 10.2] * 4}, (1, 2), 1, 12, 0.05, 48) == 1
    over = {1: configured, 2: [9.8] * 6 + [5.0] * 5 + [9.9]}
    assert counts_to_sample(over, (1, 2), 1, 12, 48, 0.05) == [1, 2]


def test_an_unsure_count_takes_more_samples_so_noise_does_not_keep_the_configured_one():
    """Served samples beside 16 closed-loop clients spread about +-30%: deciding for the
    configured count as soon as 12 samples left the interval over the bar kept 1 thread
    where 2 were 1.25x faster in about half of the draws (and in 3-4 of 6 ranges of a real
    run); deciding for it as soon as the faster count's median lay over the bar kept it
    where 2 were 1.15x faster in 2 draws of 5 (a real steady run's 64-127 range kept 1
    thread in 3 of 6 rounds). Sampling every count whose interval straddles the bar on, up
    to 48, learns 1.15x in most draws and 1.25x in nearly all; it leaves the configured
    count for one as fast in about a third of flat ranges (no loss of speed: the price of
    asking at every sample), rarely for a slower one, and a flat range takes about 48
    samples in all."""
    def learned(speedup: float, seed: int) -> tuple[int, int]:
        rng, samples = np.random.default_rng(seed), {1: [], 2: []}
        while need := counts_to_sample(samples, (1, 2), 1, 12, 48, 0.05):
            n = min(need, key=lambda k: len(samples[k]))
            samples[n].append((1 / speedup if n == 2 else 1.0) * rng.lognormal(0, 0.3))
        return choose(samples, (1, 2), 1, 12, 0.05, 48), sum(map(len, samples.values()))

    def share(speedup: float) -> tuple[float, float]:
        runs = [learned(speedup, seed) for seed in range(200)]
        return (sum(n == 2 for n, _ in runs) / len(runs),
                sum(k for _, k in runs) / len(runs))

    assert share(1.15)[0] > 0.8 and share(1.25)[0] > 0.9 and share(1.5)[0] > 0.95
    assert share(1.0)[0] < 0.45 and share(0.9)[0] < 0.12
    assert share(1.0)[1] < 56  # samples in all: 24 at the least, 96 at the most
def test_a_count_behind_for_sure_early_needs_no_more_samples():
    """Its interval wholly above the fastest count's: at three samples, all of them above
    that interval; the host's noise, in the intervals, sets how far behind is sure."""
    samples = {1: [9.0, 10.0, 11.0] * 4, 2: [25.0, 30.0, 12.0]}
    assert counts_needing_samples(samples, (1, 2), 12) == []
    assert choose(samples, (1, 2), 1, 12, 0.05, 48) == 1
    samples[2] = [25.0, 30.0, 10.5]  # one sample within 1's interval keeps it in
    assert counts_needing_samples(samples, (1, 2), 12) == [2]
    samples[2] = [13.0, 12.5, 12.0]  # 1.2x behind, all three past 1's interval: out
    assert counts_needing_samples(samples, (1, 2), 12) == []
    samples[1] = [7.0, 10.0, 14.0] * 4  # as far behind on a noisier host: still in
    assert counts_needing_samples(samples, (1, 2), 12) == [2]


def test_counts_past_a_slower_one_are_not_timed_and_the_rest_decide():
    """Time is unimodal in the count: on 16 cores from a configured 8, once 4's first three
    forwards all ran slower than 8's median, 2 and 1 need no samples (a simulated 16-core
    host timed each a dozen times per range at up to 8x its best count's cost); 4 itself is
    still timed. 16 faster than 8 keeps every count above 8 in play."""
    counts = (1, 2, 4, 8, 16)
    samples = {8: [10.0, 10.4, 9.8], 4: [11.0, 11.5, 10.3], 16: [9.0, 9.5, 9.2]}
    # fastest is 16: 8 (between 16 and 4) is slower than its median, so 4, 2, 1 are out
    assert past_a_slower_count(samples, counts) == {1, 2, 4}
    samples[16] = [10.2, 11.0, 10.8]  # now 8 is fastest: only 2 and 1 lie past slower 4
    assert past_a_slower_count(samples, counts) == {1, 2}
    assert counts_needing_samples(samples, counts, 12) == [4, 8, 16]
    samples[4] = [11.0, 11.5, 9.9]  # one forward at 4 under 8's median: keep going down
    assert past_a_slower_count(samples, counts) == set()
    # the rule decides without 1 and 2 once the others have their samples
    full = {8: [10.0] * 12, 4: [11.0] * 12, 16: [10.8] * 12}
    assert choose(full, counts, 8, 12, 0.05, 48) == 8
    # the configured count itself past a slower one (never timed): the fastest decides
    assert choose({1: [9.0] * 12, 2: [5.0] * 12, 4: [6.0] * 12}, (1, 2, 4, 8), 8, 12,
                  0.05, 48) == 2
    # on two counts nothing lies past either
    assert past_a_slower_count({1: [10.0] * 3, 2: [20.0] * 3}, (1, 2)) == set()


def test_counts_the_core_ledger_mostly_refused_are_out_of_reach_and_the_rest_decide():
    """R4.12: a count the host's core ledger served below more often than it was timed is
    no longer timed, nor any count above it, the configured one too (never the fewest
    threads); the rule then decides among the rest, or keeps the configured count where it
    is out of reach (16 refused on every try kept a range exploring for good)."""
    counts = (1, 2, 4, 8, 16)
    samples = {1: [20.0] * 12, 2: [11.0] * 12, 4: [6.0] * 12, 8: [5.0] * 12, 16: [4.0] * 2}
    assert out_of_reach({}, samples, counts, 8) == set()
    assert out_of_reach({16: 2}, samples, counts, 8) == set()  # refused as often as timed
    assert out_of_reach({16: 3}, samples, counts, 8) == {16}
    assert out_of_reach({8: 13, 16: 1}, samples, counts, 4) == {8, 16}  # and all above
    assert out_of_reach({8: 13}, samples, counts, 8) == {8, 16}  # the configured count too
    assert out_of_reach({1: 13}, samples, counts, 8) == {2, 4, 8, 16}  # 1 thread stays
    assert choose(samples, (1, 2, 4), 8, 12, 0.05, 48) == 8  # out of reach: it stays,
    assert choose({1: [20.0]}, (1, 2, 4), 8, 12, 0.05, 48) == 8  # at once
    assert counts_needing_samples(samples, counts, 12) == [16]
    assert choose(samples, counts, 8, 12, 0.05, 48) is None  # waits for 16's samples
    reach = [n for n in counts if n not in out_of_reach({16: 3}, samples, counts, 8)]
    assert choose(samples, reach, 8, 12, 0.05, 48) == 8
    # held out by other tasks' load for ``held_out_s``: the configured count too, and above
    assert out_of_reach({}, samples, counts, 8, held_out=[8]) == {8, 16}
    assert out_of_reach({4: 13}, samples, counts, 8, held_out=[8]) == {4, 8, 16}
    assert out_of_reach({16: 3}, samples, counts, 8, held_out=[8]) == {8, 16}
    assert out_of_reach({}, samples, counts, 8, held_out=[1, 4]) == {4, 8, 16}  # 1 stays
    assert out_of_reach({}, samples, counts, 8, held_out=[1]) == set()


class _FreeSeconds:
    """A free-CPU reading (``FreeCpus``: when, cumulative free core-seconds) whose rate the
    test sets: ``rate`` cores left to the worker from each call of ``set`` on."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.rate, self.at_s, self.total = clock, 2.0, 0.0, 0.0

    def set(self, rate: float) -> None:
        self.total += self.rate * (self.clock[0] - self.at_s)
        self.rate, self.at_s = rate, self.clock[0]

    def __call__(self) -> tuple[float, float]:
        return self.clock[0], self.total + self.rate * (self.clock[0] - self.at_s)


def test_a_count_is_out_of_reach_only_once_its_own_range_saw_it_held_that_long():
    """Mode 2 (R4.13): a count other tasks keep from being tried for ``held_out_s`` leaves an
    exploring range's reach, judged on what that range's own forwards read. A range that
    read the count's cores held once and then served nothing for longer (other ranges, or
    no traffic: a bench measuring other servers between rounds) had the count out of reach
    at its next forward whatever the cores were then, and with the other count timed it
    learned that one with no sample of this one (likely what left 8-15 padded tokens at 1
    thread, 2 threads "held" and never tried, in the bench beside a neighbour on one of 2
    cores half the time, where mode 2 serves nothing while the other servers are measured).
    A free reading brings a held-out count back; held at every reading for ``held_out_s``
    it is out, as before."""
    clock = [0.0]
    reading = _FreeSeconds(clock)
    settings = TunerSettings.of(background=False)  # held_out_s 20
    mode = AdaptiveMode.SERVE
    learner = Learner(mode, 1, (1, 2), settings, ExactnessLedger(mode, 1, 8),
                      RecordSync(None, Scope("test-host", "rev1", "onnxruntime"),
                                 lambda: clock[0]),
                      FreeCores(reading, 0.1), Tally(), "w")

    def forward_at(t: float, free: float, r: RangeLearning) -> int:
        clock[0] = t - 0.15
        reading.set(free)
        learner.free_cores.at(clock[0])  # the window's start: a reading 0.15 s before
        clock[0] = t
        return learner.explore_served(8, r, 1, t)

    def fresh() -> RangeLearning:
        r = learner.ranges[8] = RangeLearning()
        for _ in range(12):
            learner.sample(8, r, 1, 5.0, 12)  # 1 thread timed; 2 threads not yet
        return r

    r = fresh()
    assert forward_at(1.0, 1.0, r) == 1  # a neighbour holds a core: 2 threads would be 2x
    assert forward_at(40.0, 2.0, r) == 2  # 39 s later, the cores free: 2 threads is tried
    assert r.learned is None and learner.unreachable(r) == {}
    r = fresh()
    forward_at(101.0, 1.0, r)
    assert forward_at(140.0, 1.0, r) == 1  # held at both ends, nothing free read between
    assert learner.unreachable(r) == {2: "other tasks held its cores"} and r.learned == 1
    r = fresh()
    for t in (201.0, 206.0, 211.0):
        forward_at(t, 1.0, r)
    assert forward_at(215.0, 2.0, r) == 2  # free once: the wait starts again
    for t in (216.0, 226.0, 235.0):
        assert forward_at(t, 1.0, r) == 1
    assert learner.unreachable(r) == {} and r.learned is None  # held 19 s on end, not 20
    forward_at(236.5, 1.0, r)
    assert learner.unreachable(r) == {2: "other tasks held its cores"} and r.learned == 1


def test_exploring_goes_outward_from_the_served_count():
    """Mode 2 explores the counts next to the one it serves before those further out, so the
    rule above can spare them."""
    counts, vouched = (1, 2, 4, 8, 16), lambda n: True
    need = [1, 2, 4, 8, 16]
    assert explore_count({}, counts, 8, need, vouched) == 8
    # 8 has three samples: 4 and 16 are next; 2 and 1 wait for 4's first three
    assert explore_count({8: [1.0] * 3}, counts, 8, need, vouched) == 4
    assert explore_count({8: [1.0] * 3, 4: [1.0] * 3}, counts, 8, need, vouched) == 16
    got = {8: [1.0] * 3, 4: [1.0] * 3, 16: [1.0] * 3}
    assert explore_count(got, counts, 8, need, vouched) == 2
    # on two counts: the one with fewer samples, as before
    assert explore_count({1: [1.0] * 4}, (1, 2), 1, [1, 2], vouched) == 2


def test_the_change_detector_compares_one_count_with_itself_either_way():
    assert not changed([1.2] * 8, 1.0, 1.5)
    assert changed([1.6] * 8, 1.0, 1.5) and changed([0.6] * 8, 1.0, 1.5)
    assert not changed([], 1.0, 1.5) and not changed([9.0], 0.0, 1.5)


@pytest.mark.parametrize(("forward_s", "waited_s", "threads", "ms"), [
    (0.030, None, 2, 30.0),  # the kernel keeps no run delay: as measured
    (0.030, 0.020, 2, 20.0),  # 20 ms of its two threads' waiting: 10 ms each
    (0.030, 0.010, 1, 20.0),
    (0.030, 0.030, 2, 15.0),  # waited half its time per thread: still a sample
    (0.030, 0.031, 1, None),  # waited more than it ran: no sample (was 0 ms below)
    (0.010, 0.050, 2, None)])  # (was 0 ms: a median of 0 divided a speed-up by zero)
def test_a_shadows_time_less_its_threads_run_delay_per_thread(forward_s, waited_s, threads,
                                                              ms):
    got = served_cost_ms(forward_s, waited_s, threads)
    assert got is None if ms is None else got == pytest.approx(ms)


def _learner(mode: AdaptiveMode = AdaptiveMode.LEARN) -> Learner:
    settings = TunerSettings.of(background=False)
    clock = [0.0]
    return Learner(mode, 1, (1, 2), settings, ExactnessLedger(mode, 1, 8),
                   RecordSync(None, Scope("test-host", "rev1", "onnxruntime"),
                              lambda: clock[0]),
                   FreeCores(None, 0.1), Tally(), "w")


def test_a_range_decides_at_one_size_so_its_size_mix_does_not_hide_a_speedup():
    """R4.13: a range spans sizes up to 2x apart (64-127 padded tokens), so its forwards' times
    spread with the sizes its traffic brings. Time in proportion to the tokens, 2 threads
    1.25x faster, 12 samples each, sizes uniform in the range, 10% noise: by the forwards' ms
    the interval of 2 threads reaches into the configured count's margin and the range keeps
    1 thread; at one size (here per token: the fitted exponent is about 1) the size mix
    leaves the interval and it learns 2. With no speed-up, it keeps 1 thread."""
    def draws(speedup: float, seed: int) -> list[tuple[int, float, int]]:
        rng = np.random.default_rng(seed)
        return [(n, tokens * 0.5 / (speedup if n == 2 else 1.0) * rng.lognormal(0, 0.1),
                 tokens) for _ in range(12) for n in (1, 2)
                for tokens in [int(rng.integers(64, 128))]]

    learner = _learner()
    r = learner.ranges.setdefault(64, RangeLearning())
    for count, ms, tokens in draws(1.25, seed=1):
        learner.sample(64, r, count, ms, tokens)
    assert choose(r.samples, (1, 2), 1, 12, 0.05, 48) is None  # by ms: unsure, more samples
    assert r.learned == 2 and learner.speedup(r) > 1.15
    flat = _learner()
    r = flat.ranges.setdefault(64, RangeLearning())
    for count, ms, tokens in draws(1.0, seed=1):
        flat.sample(64, r, count, ms, tokens)
    assert r.learned == 1


def test_a_range_compares_counts_at_one_size_by_its_fitted_size_exponent():
    """R4.13: short inputs cost mostly a fixed part, so per token a range's smallest inputs
    look 1.7x dearer than its largest at one count (the simulated bfloat16 16-core host:
    16-31 tokens, where 4 threads ran 10% faster than the configured 8, was learned at 8).
    Forward time ``2 + 0.03 * tokens`` ms, 2 threads 1.1x faster, 5% noise, sizes uniform
    over 16-31, the counts sampled in turn until the range decides: at one size (the slope
    of log ms on log tokens, fitted within each count) it learns 2 in every draw, per token
    in about half; with no speed-up it keeps 1."""
    def decide(seed: int, speed: float) -> tuple[int | None, int | None]:
        rng = np.random.default_rng(seed)
        learner = _learner()
        r = learner.ranges.setdefault(16, RangeLearning())
        per_token: dict[int, list[float]] = {1: [], 2: []}
        by_token = None
        for i in range(200):
            n, tokens = (1, 2)[i % 2], int(rng.integers(16, 32))
            ms = (2.0 + 0.03 * tokens) / (speed if n == 2 else 1.0) * rng.lognormal(0, 0.05)
            if by_token is None:
                per_token[n] = [*per_token[n], ms / tokens][-48:]
                by_token = choose(per_token, (1, 2), 1, 12, 0.05, 48)
            if r.learned is None:
                learner.sample(16, r, n, ms, tokens)
        return r.learned, by_token

    faster = [decide(seed, 1.1) for seed in range(10)]
    assert [sized for sized, _ in faster] == [2] * 10
    assert sum(by_token == 2 for _, by_token in faster) <= 7
    assert [decide(seed, 1.0)[0] for seed in range(10)] == [1] * 10


def test_the_size_exponent_is_fitted_within_each_count():
    """``ms ~ tokens ** p`` pooled over counts, each count's own speed taken out; 1 where
    no count's sizes differ (then any exponent compares the counts alike)."""
    tokens = {1: [16, 20, 24, 31], 2: [17, 23, 29, 30]}
    for p in (0.2, 1.0, 1.6):
        ms = {n: [k * t ** p for t in tokens[n]] for n, k in ((1, 3.0), (2, 2.0))}
        assert size_exponent(ms, tokens) == pytest.approx(p)
        sized = at_size(ms, tokens, 16)
        assert sized[1] == pytest.approx([3.0 * 16 ** p] * 4)
        assert sized[2] == pytest.approx([2.0 * 16 ** p] * 4)
    assert size_exponent({1: [5.0, 6.0], 2: [4.0, 4.5]}, {1: [64, 64], 2: [127, 127]}) == 1.0
    assert size_exponent({1: [1.0, 9.0]}, {1: [16, 17]}) == 2.0  # clipped: noise
    assert size_exponent({1: [9.0, 1.0]}, {1: [16, 17]}) == 0.0


def test_a_range_needs_the_samples_its_decision_waits_for():
    """What a range still needs is judged on the samples the decision uses (per padded token):
    2 threads ran its forwards on larger inputs, slower than 4 in ms but faster per token. By
    ms, 1 lay past a slower count and was never timed, while the decision, per token, waited
    for it: the range explored for good."""
    settings = TunerSettings.of(background=False)
    clock = [0.0]
    learner = Learner(AdaptiveMode.LEARN, 4, (1, 2, 4), settings,
                      ExactnessLedger(AdaptiveMode.LEARN, 4, 8),
                      RecordSync(None, Scope("test-host", "rev1", "onnxruntime"),
                                 lambda: clock[0]),
                      FreeCores(None, 0.1), Tally(), "w")
    r = learner.ranges.setdefault(64, RangeLearning())
    for _ in range(12):
        learner.sample(64, r, 4, 64.0, 64)  # 1.0 ms per token
        learner.sample(64, r, 2, 0.8 * 127, 127)  # 0.8 per token, 101.6 ms
    assert r.learned is None and learner.need(r) == [1]
    for _ in range(12):
        learner.sample(64, r, 1, 1.5 * 100, 100)
    assert r.learned == 2


# -- contention is an input (R4.13) ---------------------------------------------------------

def test_the_load_factor_of_the_cores_other_tasks_hold():
    """A forward waits for its slowest thread: one whose core another task wants runs at half
    pace while it does (``1 + min(2h, 1)`` for ``h`` cores used by other tasks), never faster
    than the fluid bound ``n / free``. Measured on a 2-core host beside one CPU-bound
    process (1.24-1.58 cores free read with 2 threads serving, 0.93-1.12 with 1): 2 threads
    2x slower, 1 thread not slower."""
    assert load_factor(2, None) == 1.0 and load_factor(2, 2.0) == 1.0 == load_factor(2, 3.5)
    assert load_factor(2, 1.0) == 2.0 and load_factor(1, 1.0) == 1.0
    assert load_factor(2, 1.5) == 2.0 and load_factor(2, 1.24) == 2.0
    assert load_factor(2, 1.75) == 1.5 and load_factor(2, 0.5) == 4.0
    assert load_factor(16, 15.0) == 2.0 and load_factor(16, 8.0) == 2.0  # one core; half each
    assert load_factor(1, 0.5) == 2.0 and load_factor(2, 0.0) == 20.0  # nothing left: bounded
    for free in (0.3, 1.0, 1.7, 3.0, 7.5, 15.0):  # never cheaper with more threads
        factors = [load_factor(n, free) for n in (1, 2, 4, 8, 16)]
        assert factors == sorted(factors), (free, factors)


def test_a_learned_count_gives_way_only_where_the_held_cores_make_a_lower_one_faster():
    """Mode 2's serving rule under contention: each count's estimate times the load factor
    now; the learned count keeps ties and serves where no estimate says otherwise."""
    est = {1: 1.7, 2: 1.0}  # 2 threads 1.7x faster with the cores free
    assert fastest_under(est, None, 2) == 2 and fastest_under(est, 2.0, 2) == 2
    assert fastest_under(est, 1.0, 2) == 1  # 2.0 against 1.7
    assert fastest_under(est, 1.75, 2) == 2  # 1.5 against 1.7
    assert fastest_under({1: 1.2, 2: 1.0}, 1.75, 2) == 1  # a small speed-up gives way sooner
    assert fastest_under({1: 1.5, 2: 1.0}, 1.75, 2) == 2  # a tie keeps the learned count
    assert fastest_under({1: 1.7}, 1.0, 2) == 2  # the learned count has no estimate
    est16 = {4: 2.5, 8: 2.2, 16: 1.6}
    assert fastest_under(est16, 16.0, 16) == 16 and fastest_under(est16, 15.0, 16) == 8
    assert fastest_under(est16, 3.0, 16) == 4  # 4 at 2x (a core held), 8 at 2.67x, 16 5.33x


class _Window:
    """Readings of ``free_cpu_s`` as ``FreeCpus.latest`` gives them, with the cores other
    tasks leave set by hand: (now, cumulative free seconds)."""

    def __init__(self) -> None:
        self.now, self.free_s, self.cores = 0.0, 0.0, 2.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.free_s += self.cores * seconds

    def __call__(self) -> tuple[float, float]:
        return self.now, self.free_s


def test_free_cores_are_read_over_whole_windows_and_stale_readings_say_nothing():
    reading = _Window()
    free = FreeCores(reading, 0.1)
    assert free.at(0.0) is None  # no window yet
    reading.advance(0.05)
    assert free.at(0.05) is None  # not a whole window
    reading.advance(0.06)
    assert free.at(0.11) == pytest.approx(2.0)
    reading.cores = 1.0
    reading.advance(0.05)
    assert free.at(0.16) == pytest.approx(2.0)  # the last whole window still
    reading.advance(0.1)
    assert free.at(0.26) == pytest.approx(1.0)  # from 0.11 s on: the window began there
    reading.advance(5.0)  # no forward read for 5 s: the next window says nothing
    assert free.at(5.26) is None
    assert free.at(6.0) is None  # the reader stopped: its last reading is too old
    assert FreeCores(None, 0.1).at(1.0) is None


def test_a_served_sample_beside_held_cores_is_the_counts_time_with_its_cores_free():
    """A served forward at 2 threads while other tasks used a quarter of its cores (load
    factor 1.5) took 1.5x its time: the sample is its time over the factor; at 1 thread it
    is taken as it is. With a whole core wanted (factor 2: half its time other tasks') it is
    no sample, and vouched exploration does not serve that count meanwhile."""
    assert served_sample_ms(30.0, 1.5) == pytest.approx(20.0)
    assert served_sample_ms(30.0, 2.0) is None and served_sample_ms(30.0, 1.0) == 30.0
    reading = _Window()
    learner = _learner(AdaptiveMode.SERVE)
    learner.free_cores = FreeCores(reading, 0.1)

    def held(cores: float) -> None:
        reading.cores = 2.0 - cores
        for _ in range(3):
            reading.advance(0.1)
            learner.free_cores.at(reading.now)

    held(0.25)
    batch = TokenBatch(np.ones((1, 64), np.int64), np.ones((1, 64), np.int64))
    out = np.zeros((1, 4), np.float32)
    learner.served(batch, ForwardResult(out, 2, 2, 0.030), None, True, reading.now)
    learner.served(batch, ForwardResult(out, 1, 1, 0.030), None, True, reading.now)
    r = learner.ranges[64]
    assert r.samples == {2: [pytest.approx(20.0)], 1: [pytest.approx(30.0)]}
    assert learner.tally.samples_scaled == 1 and learner.tally.served_samples == 2
    held(1.0)
    learner.served(batch, ForwardResult(out, 2, 2, 0.060), None, True, reading.now)
    assert len(r.samples[2]) == 1 and learner.tally.samples_cores_held == 1
    # exploring on served forwards, 2 threads lacking the most samples: it would cost 2x and
    # time nothing, so 1 thread serves; with the cores free, 2 threads are timed
    learner.sample(64, r, 1, 30.0, 64)
    assert learner.explore_served(64, r, 1, reading.now) == 1
    held(0.0)
    assert learner.explore_served(64, r, 1, reading.now) == 2  # the cores free: it is timed


def test_what_the_free_cores_reading_cannot_resolve_reads_as_nothing_held():
    """``/proc`` counts in ticks: over a 0.1-s window on 2 CPUs rounding alone moved the
    free cores by about 0.1 (sd), so a 2-thread worker with nothing else running read 1.89
    or fewer a tenth of the time and served 1 thread for it. Under twice the reading's
    resolution other tasks read as holding nothing (load factor 1 at 2 threads); a
    neighbour holding a core still reads as most of one (2x at 2 threads)."""
    reading = _Window()
    resolution = math.sqrt(8 / 6) / 100  # FreeCpus on 2 CPUs, two processes: 8 counters

    def over(cores: float, rounding_s: float | None) -> float:
        free = FreeCores(reading, 0.1, (lambda: rounding_s) if rounding_s is not None
                         else None)
        reading.cores = cores
        free.at(reading.now)
        reading.advance(0.11)
        return free.at(reading.now)

    assert load_factor(2, over(1.89, None)) == pytest.approx(1.22)  # unresolved: followed
    assert load_factor(2, over(1.89, resolution)) == 1.0
    assert over(2.0, resolution) == pytest.approx(2.0 + 0.2 * math.sqrt(8 / 6) / 1.1)
    assert load_factor(2, over(1.0, resolution)) == pytest.approx(2.0)
    assert load_factor(1, over(1.0, resolution)) == 1.0

