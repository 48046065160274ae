"""R4.5, R4.6, R4.11 on a simulated many-core host (tuner/simulate.py): the real tuner, a
fake clock, and a forward-time model of 4, 16 and 64 cores fit to FACTS.md. What only many
cores can show: convergence, no oscillation, a neighbour tracked, adaptive ahead of every
fixed count, and learned counts 3x and 6x faster than the configured one never relearned."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_srun.tuner.adaptive import TunerSettings
from vllm_srun.tuner.simulate import (
    Arrival,
    Neighbour,
    SimulatedHost,
    TimeModel,
    poisson_trace,
    shifting_trace,
)

SIZES = [16, 16, 64, 256, 1024]


def changes(outcome, trace, size: int) -> list[tuple[float, int]]:
    """(time, new count) each time the served count of forwards of ``size`` changed; mode
    2's exploring forwards (served at a count to time it) aside."""
    picked = [(at, n) for at, n, a, explored in zip(outcome.at_s, outcome.served_threads,
                                                    trace, outcome.explored, strict=True)
              if a.padded_tokens == size and not explored]
    return [(at, n) for (at, n), (_, prev) in zip(picked[1:], picked[:-1], strict=True)
            if n != prev]


@pytest.mark.parametrize("cores", [4, 16, 64])
def test_each_range_converges_within_80_forwards_to_a_count_within_10_percent_of_best(cores):
    """Within 10%: a count must beat the configured one by the 5% margin, and noise is 5%."""
    model = TimeModel(cores)
    trace = poisson_trace(4 if cores == 4 else 12, 300, SIZES, seed=cores)
    host = SimulatedHost(model, seed=cores)
    outcome = host.run(trace)
    assert set(outcome.learned_at) == set(SIZES_RANGES)
    assert max(outcome.learned_at.values()) <= 80, outcome.learned_at
    for lo, r in host.tuner.ranges.items():
        best = model.forward_ms(lo, model.best(lo, host.counts, cores), cores)
        assert model.forward_ms(lo, r.learned, cores) <= 1.10 * best, (lo, r.learned)


SIZES_RANGES = {16, 64, 256, 1024}


@pytest.mark.parametrize("cores", [16, 64])
def test_a_steady_load_never_relearns_and_each_range_switches_at_most_once(cores):
    trace = poisson_trace(12, 900, SIZES, seed=7)
    outcome = SimulatedHost(TimeModel(cores), seed=7).run(trace)
    assert outcome.relearns == 0
    for size in set(SIZES):
        assert len(changes(outcome, trace, size)) <= 1  # configured -> learned, then stays


def test_a_learned_count_serves_at_once_when_its_exploring_shadows_already_matched():
    """R4.6: the shadows at a count that matched served answers while the range explored are
    passes of its transition window, so once learned (12 samples per count, each compared
    bit for bit) the count serves from the next forward of its range."""
    model = TimeModel(16)
    trace = poisson_trace(4, 300, [1024], seed=3)  # quiet: shadows run in the gaps
    host = SimulatedHost(model, seed=3, configured=1)
    outcome = host.run(trace)
    r = host.tuner.ranges[1024]
    assert r.learned not in (None, host.configured) and r.serving
    assert r.verified[r.learned] >= host.tuner.settings.window
    learned_at = outcome.learned_at[1024]  # forwards of the range seen when it was learned
    first = next(i for i, (n, explored) in enumerate(zip(outcome.served_threads,
                                                         outcome.explored, strict=True))
                 if n == r.learned and not explored)
    assert first <= learned_at, (first, learned_at)


def settled_s(model, outcome, trace, size, start, end, free) -> float:
    """Seconds after ``start`` from which every forward of ``size`` up to ``end`` ran at a
    count within 10% of the model's best for ``free`` cores (mode 2's exploring forwards,
    served at a count to time it, aside: the caller bounds those)."""
    counts = (1, 2, 4, 8, 16)
    best = min(model.forward_ms(size, n, free) for n in counts)
    picked = [(at, n) for at, n, a, explored in zip(outcome.at_s, outcome.served_threads,
                                                    trace, outcome.explored, strict=True)
              if a.padded_tokens == size and start <= at < end and not explored]
    bad = [at for at, n in picked if model.forward_ms(size, n, free) > 1.10 * best]
    return (bad[-1] - start) if bad else 0.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_neighbour_is_tracked_within_180_s_of_arriving_and_of_leaving(seed):
    """16 cores; a neighbour takes 14 of them from t = 300 s to 600 s. Long inputs want 8-16
    threads alone and 2 beside it (the served count slows by more than the 1.5x relearning
    factor); short ones want 2 throughout. A neighbour that costs the served count less than
    the factor is not tracked. Measured (seeds 1-3, 12 forwards/s, a fifth of them long):
    settled 8.1-9.2 s after it arrived (at once it serves the count below the learned one
    that looks fastest now, stepping down as each is seen slow; after 10 s the range
    relearns from its own served forwards, and the shadows that matched them count toward
    the window) and 78-101 s after it left (probes at the other counts come every 8th forward
    of the range, 4 per check)."""
    model = TimeModel(16)
    trace = poisson_trace(12, 900, SIZES, seed=seed)
    outcome = SimulatedHost(model, [Neighbour(14, 300, 600)], seed=seed).run(trace)
    assert model.best(1024, (1, 2, 4, 8, 16), 2) == 2
    before = settled_s(model, outcome, trace, 1024, 150, 300, 16)
    beside = settled_s(model, outcome, trace, 1024, 300, 600, 2)
    after = settled_s(model, outcome, trace, 1024, 600, 900, 16)
    print(f"seed {seed}: settled {beside:.1f} s after arriving, {after:.1f} s after leaving")
    assert before == 0.0 and beside <= 30 and after <= 180, (beside, after)
    for start, end, free in ((150, 300, 16), (300, 600, 2), (600, 900, 16)):
        assert settled_s(model, outcome, trace, 16, start, end, free) == 0.0  # short: kept
    assert sum(outcome.explored) <= 0.05 * len(trace)  # served at a count to time it


@pytest.mark.parametrize("seed", [10, 20, 30])
@pytest.mark.parametrize(("cores", "taken", "latency_gain"), [(16, 12, 1.04), (64, 60, 1.03),
                                                              (4, 3, 1.15)])
def test_on_a_shifting_load_adaptive_beats_every_fixed_count(cores, taken, latency_gain, seed):
    """Mean served forward time of mode 2 against every fixed allowed count on the same
    trace, and mean latency (queueing included). Measured, over the 3 seeds: 16 cores
    1.055-1.074x faster forwards, latency 1.077-1.098x; 64 cores 1.065-1.071x forwards,
    latency 1.081-1.086x; 4 cores (a quarter of the traffic) 1.304-1.332x forwards,
    1.301-1.334x latency (before the tuner read the free cores: 16 cores 1.053-1.067x and
    1.071-1.082x, 64 cores 1.062-1.067x and 1.066-1.079x, 4 cores 1.264-1.279x and
    1.254-1.272x).
    Beside the neighbour, shadows at more threads than the cores left wait for them and are
    not samples (as on a real host, where an idle-class shadow there gets next to no CPU);
    the learned count, slowed, gives way at once to the fastest count below it
    (contention), and the range relearns from its own served forwards (4-5% of them served
    at a count to time it) once the neighbour has stayed 10 s."""
    model, neighbours = TimeModel(cores), [Neighbour(taken, 300, 600)]
    trace = shifting_trace(seed)
    if cores == 4:  # a 4-core host takes a quarter of the traffic
        trace = trace[::4]
    adaptive = SimulatedHost(model, neighbours, seed=1).run(trace)
    fixed = {n: SimulatedHost(model, neighbours, fixed=n, seed=1).run(trace)
             for n in SimulatedHost(model).counts}
    served = min(np.mean(f.served_ms) for f in fixed.values()) / np.mean(adaptive.served_ms)
    latency = min(f.mean_latency_ms for f in fixed.values()) / adaptive.mean_latency_ms
    print(f"cores {cores} seed {seed}: forwards {served:.3f}x, latency {latency:.3f}x of the "
          f"best fixed count")
    assert served >= 1.04, {n: np.mean(f.served_ms) for n, f in fixed.items()}
    assert latency >= latency_gain


@pytest.mark.parametrize(("free_cpus", "gain"), [(True, 1.10), (False, 1.02)])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_beside_a_neighbour_on_half_the_time_mode2_beats_every_fixed_count(seed, free_cpus,
                                                                           gain):
    """2 cores (this host's shape), configured 1 thread, learned 2; a neighbour takes one
    core for 2 s out of every 4. Alone, 2 threads win by 1.47x on long inputs; beside it
    they run 1.6x slower than 1 thread. Mode 2 serves 1 thread while 2 threads run slower
    than 1 would (contention followed within a few forwards), and never relearns over a
    neighbour this brief. It is over once the neighbour leaves the core free
    (``free_cpus``, read from /proc on a real host), or, where that cannot be read, after a
    forward at 2 threads every 0.25 s, two in a row, ran fast. Measured (seeds 1-3),
    against the best fixed count (fixed 1): with free cores read, forwards 1.103-1.112x,
    latency 1.12-1.14x; with probes, forwards 1.028-1.037x, latency 0.97-0.99x; without
    following contention 0.86-0.87x (fixed 2's times). With 10 s on, 10 s off: 1.158-1.165x
    forwards, latency 1.21-1.25x (probes: 1.068-1.085x, 1.03-1.09x)."""
    model = TimeModel(2)
    neighbours = [Neighbour(1, t, t + 2) for t in range(60, 600, 4)]
    trace = poisson_trace(15, 600, [16, 64, 256, 512], seed=seed)
    host = SimulatedHost(model, neighbours, seed=seed, free_cpus=free_cpus)
    adaptive = host.run(trace)
    fixed = {n: SimulatedHost(model, neighbours, fixed=n, seed=seed).run(trace)
             for n in (1, 2)}

    def mean_ms(o) -> float:  # once learned (the first minute is quiet)
        return float(np.mean([ms for ms, at in zip(o.served_ms, o.at_s, strict=True)
                              if at >= 60]))

    best = min(mean_ms(f) for f in fixed.values())
    assert best / mean_ms(adaptive) >= gain, (best, mean_ms(adaptive))
    assert adaptive.relearns == 0
    t = host.tuner
    assert t.contended > 0
    if free_cpus:  # it ended once per range (4) and departure (135), never probed
        assert t.contention_probes == 0 and 500 <= t.contention_freed <= 4 * 135
    else:
        assert t.contention_probes > 0 and t.contention_freed == 0
    assert all(r.learned == 2 and r.serving for r in t.ranges.values())


@pytest.mark.parametrize(("serial", "speedup"), [(0.25, 3.0), (0.07, 6.0)])
def test_a_learned_count_3x_or_6x_faster_than_the_configured_is_served_and_never_relearned(
        serial, speedup):
    """R4.11: relearning compares the learned count with itself, so a speed-up this large
    (configured 1 thread, learned 16) is kept for good on a steady load."""
    model = TimeModel(16, serial=serial)
    assert model.forward_ms(1024, 1, 16) / model.forward_ms(1024, 16, 16) >= speedup
    trace = poisson_trace(6, 400, [1024], seed=5)
    host = SimulatedHost(model, seed=5, configured=1)
    outcome = host.run(trace)
    r = host.tuner.ranges[1024]
    assert r.learned == 16 and r.serving and outcome.relearns == 0
    assert np.median(r.samples[1]) / np.median(r.samples[16]) >= 0.95 * speedup
    tail = outcome.served_threads[len(outcome.served_threads) // 4:]
    assert tail == [16] * len(tail)
    assert changes(outcome, trace, 1024) == [changes(outcome, trace, 1024)[0]]


def test_a_range_relearnt_to_a_count_that_passed_its_window_serves_it_at_once():
    """R4.6, R4.11: a count that passed its transition window for a range in this worker
    passed it for good (a drift would have retired learning), so a relearn that lands on it
    again serves it from that forward, not the configured count meanwhile. 16 cores; a
    neighbour takes 14 of them twice: the second time, the range relearns 2, which passed
    its window the first time."""
    seen = []
    for seed in (1, 2, 3):
        host = SimulatedHost(TimeModel(16), [Neighbour(14, 300, 420), Neighbour(14, 600, 720)],
                             seed=seed)
        tuner, update = host.tuner, host.tuner._update

        def spy(lo, r, update=update, tuner=tuner):  # the real method, watched
            passed, before = r.passed, r.learned
            update(lo, r)
            if before is None and r.learned in passed:
                seen.append((lo, r.learned, tuner.ranges[lo].serving))

        tuner._update = spy
        host.run(poisson_trace(12, 900, SIZES, seed=seed))
    assert any(lo == 1024 and n == 2 for lo, n, _ in seen), seen
    assert all(serving for *_, serving in seen), seen


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_learning_beside_a_toggling_neighbour_spans_its_phases(seed):
    """R4.6: 2 cores, configured 1 thread, 30 forwards/s of 64 padded tokens (2 threads
    1.37x faster alone, 1.6x slower beside the neighbour); a neighbour takes one core 2 s
    out of every 4 from t = 0, so 12 samples per count take under 1 s, inside one of its
    phases. Learned from those (measured, seeds 1-3), the range first learns 1 thread, and
    only a relearn on probes corrects it (on a real host such probes are idle-class shadows
    that share the neighbour's cores and rarely run: bench/adaptive_load.py's sixth pass
    kept 1 thread). Where a forward whose cores other tasks held is no sample (the free
    cores read), it learns 2 threads at once and never relearns. (A range that learned only
    from samples spanning 5 s did too, here; on the real host that made mode 1 time 2
    threads once per range in a whole bench pass, for reasons not found, and it is gone.)"""

    def first_learned(settings: TunerSettings, free_cpus: bool) -> tuple[int, int]:
        neighbours = [Neighbour(1, t, t + 2) for t in range(0, 600, 4)]
        host = SimulatedHost(TimeModel(2), neighbours, seed=seed, settings=settings,
                             free_cpus=free_cpus)
        tuner, update, first = host.tuner, host.tuner._update, []

        def spy(lo, r):  # the real method, watched
            update(lo, r)
            if not first and tuner.ranges[lo].learned is not None:
                first.append(tuner.ranges[lo].learned)

        tuner._update = spy
        outcome = host.run(poisson_trace(30, 120, [64], seed=seed))
        return first[0], outcome.relearns

    assert first_learned(TunerSettings(background=False), True) == (2, 0)
    assert first_learned(TunerSettings(background=False), False) == (1, 1)


def test_where_the_free_cores_cannot_be_read_contention_is_probed():
    """``FreeCpus`` returns None where /proc cannot be read: contention still ends, probed."""
    neighbours = [Neighbour(1, t, t + 2) for t in range(60, 200, 4)]
    host = SimulatedHost(TimeModel(2), neighbours, seed=1)
    host.tuner.free_cpu_s = lambda: None
    host.run(poisson_trace(15, 200, [64, 256], seed=1))
    t = host.tuner
    assert t.contended > 0 and t.contention_probes > 0 and t.contention_freed == 0
    assert all(r.learned == 2 and r.serving for r in t.ranges.values())


def test_a_slowdown_with_the_cores_free_is_not_contention():
    """R4.5: contention (a count below the learned one served meanwhile) starts only where
    another task holds the learned count's cores. Here every forward at 2 threads slows as
    a neighbour's would make it (the load itself, a throttled host), but the free cores read
    say no task holds them: mode 2 serves on at 2 threads. With the free cores read as they
    are, it follows the neighbour (the test above)."""
    neighbours = [Neighbour(1, t, t + 2) for t in range(60, 200, 4)]
    host = SimulatedHost(TimeModel(2), neighbours, seed=1)
    host.tuner.free_cpu_s = lambda: (host.now_s, 2 * host.now_s)  # both cores free
    outcome = host.run(poisson_trace(15, 200, [64, 256], seed=1))
    t = host.tuner
    assert t.slow_cores_free > 0 and t.contended == 0 and outcome.relearns == 0
    assert all(r.learned == 2 and r.serving for r in t.ranges.values())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_range_served_every_few_seconds_is_not_relearned_over_a_toggling_neighbour(seed):
    """R4.11: contention relearns a range only when it lasted ``contention_relearn_s``
    (10 s) without a break. A range served once every ~7 s (512 padded tokens; 64 and 256
    come 15 times a second) beside a neighbour 2 s on and 2 s off is contended at many of
    its forwards, but the neighbour left between them: measured from its own first
    contended forward, it relearned 6-9 times in 9 minutes (seeds 1-3); now never."""
    neighbours = [Neighbour(1, t, t + 2) for t in range(60, 600, 4)]
    sparse = [Arrival(0.5 * k, 512) for k in range(1, 60)] + \
        [Arrival(60 + 7.3 * k, 512) for k in range(75)]
    trace = sorted(poisson_trace(15, 600, [64, 256], seed=seed) + sparse,
                   key=lambda a: a.at_s)
    host = SimulatedHost(TimeModel(2), neighbours, seed=seed)
    outcome = host.run(trace)
    r = host.tuner.ranges[512]
    assert outcome.relearns == 0 and r.learned == 2 and r.serving


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_pause_in_traffic_does_not_count_as_contention(seed):
    """R4.11: contention relearns a range only over ``contention_relearn_s`` (10 s) seen
    contended. Traffic in 10-s bursts with 10-s pauses (the bench's rounds) beside a
    neighbour 2 s on and 2 s off: no forward reads the free cores in a pause, and counted
    from the last contended forward before it, the first forward after it relearned (real
    host, 2 cores: 64-127 and 16-31 padded tokens, ``contended_s=13``, each right after a
    pause); now a pause restarts the count."""
    neighbours = [Neighbour(1, t, t + 2) for t in range(60, 400, 4)]
    trace = poisson_trace(15, 60, [64, 256], seed=seed)
    for start in range(60, 400, 20):
        trace += poisson_trace(15, 10, [64, 256], seed=seed + start, start_s=start)
    host = SimulatedHost(TimeModel(2), neighbours, seed=seed)
    outcome = host.run(trace)
    assert host.tuner.contended > 0  # it followed the neighbour
    assert outcome.relearns == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_range_that_explores_for_long_beside_a_toggling_neighbour_keeps_no_slowed_sample(
        seed):
    """R4.6: a forward whose cores other tasks held was no sample only for a range's first
    10 s of exploring (a neighbour there for good is the host); a range that explored
    longer beside a neighbour 2 s on and 2 s off kept samples from both phases. On the real
    host (64-127 padded tokens, served mostly in the 1-connection bursts of the bench's
    learning) 8 of its 15 samples at 2 threads were the neighbour's (14.6-41 ms; the rest
    7.2-11.7) and it learned 1 thread, where 2 are 1.2-1.3x faster without the neighbour. Here 40
    samples per count at 3 forwards/s: before, 9-15 of the 40 at 2 threads were over 1.3x
    the quiet time (seeds 1-5); now held cores reject a sample until no window has left them
    free for 10 s, and 0-3 are (forwards that began as the neighbour came: the window before
    them saw the cores free)."""
    neighbours = [Neighbour(1, t, t + 2) for t in range(0, 300, 4)]
    trace = sorted(poisson_trace(40, 300, [128], seed=seed)
                   + poisson_trace(3, 300, [64], seed=seed + 10), key=lambda a: a.at_s)
    model = TimeModel(2)
    host = SimulatedHost(model, neighbours, seed=seed,
                         settings=TunerSettings(background=False, min_samples=40))
    host.run(trace)
    r = host.tuner.ranges[64]
    assert r.learned == 2 and len(r.samples[2]) >= 40
    slowed = [ms for ms in r.samples[2] if ms > 1.3 * model.forward_ms(64, 2, 2)]
    assert len(slowed) <= 3, (slowed, r.samples[2])


def bursts(seed: int, bursts: int = 12, burst_s: float = 4.0, pause_s: float = 1.0,
           every_s: float = 0.02, size: int = 512) -> list[Arrival]:
    """Closed-loop-like bursts: a forward of ``size`` padded tokens every ``every_s`` (more
    than a worker serves: a queue builds), ``burst_s`` on, ``pause_s`` off."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for _ in range(bursts):
        end = t + burst_s
        while t < end:
            out.append(Arrival(t, size))
            t += every_s * float(rng.uniform(0.5, 1.5))
        t = end + pause_s
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_under_bursts_a_learned_range_passes_its_window_in_the_first_lull(seed):
    """R4.6: 4 cores, 512 padded tokens in 4-s bursts just past what 2 threads serve (a queue
    builds: few gaps), 1-s lulls; the range learns 4 threads in the first burst. Each newer
    batch used to replace the last before its comparison ran, so a lull passed about one
    window comparison: serving 2 threads (1.3x slower) for two more bursts. The batches it
    replaced wait in a backlog, and the first lull after learning passes the whole window."""

    def learned_and_serving(backlog: bool) -> tuple[float, float]:
        host = SimulatedHost(TimeModel(4), seed=seed)
        tuner, update, serve = host.tuner, host.tuner._update, host.tuner._maybe_serve
        if not backlog:  # as before: every newer batch replaced the last
            tuner._backlog_job = lambda lo, r, old, new: None
        learned_at, serving_at = [], []

        def spy_update(lo, r):  # the real methods, watched
            update(lo, r)
            if not learned_at and tuner.ranges[lo].learned is not None:
                learned_at.append(host.now_s)

        def spy_serve(lo, r):
            was = r.serving
            serve(lo, r)
            if r.serving and not was:
                serving_at.append(host.now_s)

        tuner._update, tuner._maybe_serve = spy_update, spy_serve
        host.run(bursts(seed, every_s=0.04))
        r = tuner.ranges[512]
        assert r.learned == 4 and r.serving and r.relearns == 0, r
        return learned_at[0], serving_at[0]

    learned, serving = learned_and_serving(backlog=True)
    lull_ends = next(t + 5.0 for t in np.arange(0, 60, 5.0) if t + 4.0 >= learned)
    before = learned_and_serving(backlog=False)
    print(f"learned at {learned:.1f} s, serving from {serving:.1f} s; without the backlog "
          f"{before[1]:.1f} s")
    assert serving <= lull_ends and before[1] > lull_ends  # measured: 4.7-4.9 s; 14.6-15.6 s
