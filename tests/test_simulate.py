"""The simulator (tuner/simulate.py, sim_model.py, sim_host.py): its forward model reproduces
this host's measured forward table (bench/results/forward_table.json) and the published
many-core figures it is fitted to; cores are shared among workers, neighbours and shadows as
stated; noise is correlated; the real tuner (R4.5, R4.6) runs in every worker through its
public API only. No timing here: the table is read, never measured."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from vllm_srun.tuner import report
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.sim_calibration import (
    EPYC_9575F_16_THREADS_MS,
    KUNPENG_29_TOKENS_MS,
    LONG_INPUT_SPEEDUP_16,
    LONG_INPUT_TOKENS,
    REFERENCE,
    TimeModel,
    calibrated,
    fit_published,
    log_error,
    many_core_cells,
)
from vllm_srun.tuner.sim_model import (
    ConfigFit,
    ManyCore,
    TableError,
    cores_share,
    errors,
    fit_table,
    load_table,
    loaded,
)
from vllm_srun.tuner.simulate import (
    Arrival,
    Neighbour,
    Noise,
    SimulatedHost,
    herd,
    ledger,
    many_core,
    poisson_trace,
    trace_at_load,
)

TOLERANCE = 0.15  # issue 27: every cell within 15%


CONFIGS = [("torch", "float32"), ("torch", "bfloat16"), ("onnxruntime", "float32")]


@pytest.mark.required_in_ci
@pytest.mark.parametrize(("backend", "precision"), CONFIGS)
def test_the_forward_model_reproduces_every_cell_of_the_measured_table(backend, precision):
    """Both backends (torch, onnxruntime), float32 and bfloat16 (torch), 1 and 2 threads,
    rows x padded length: the fit of each backend x precision is within 15% of every cell's
    fitted statistic (the fastest forward; the median in tables before it). A table measured
    on a loaded host is no calibration: the test says so and skips (a failure in CI) until
    ``python -m bench.forward_table`` is run on a quiet host."""
    doc = load_table()
    fits = fit_table(doc)
    assert {c["threads"] for c in doc["cells"]} == {1, 2}
    assert len({c["rows"] for c in doc["cells"]}) >= 3
    fit = fits[(backend, precision)]
    errs = errors(fit, doc["cells"])
    assert len(errs) >= 20
    cell, err = max(errs, key=lambda ce: abs(ce[1]))
    worst = f"{err:+.1%} at {cell['rows']}x{cell['padded_tokens']}, {cell['threads']} thread(s)"
    print(f"{backend} {precision}: worst cell {worst}; load: {doc['load']['note']}")
    why = loaded(doc)
    if why:
        pytest.skip(f"bench/results/forward_table.json was measured {why} (worst cell "
                    f"{worst}): rerun python -m bench.forward_table on a quiet host")
    assert abs(err) <= TOLERANCE, worst


def test_a_table_is_fitted_on_the_statistic_it_names_and_an_unknown_one_is_refused(tmp_path):
    cell = {"backend": "torch", "precision": "float32", "rows": 1, "padded_tokens": 8,
            "threads": 1, "median_ms": 12.0, "min_ms": 10.0}
    path = tmp_path / "table.json"
    for fitted, ms in ((None, 12.0), ("min_ms", 10.0), ("median_ms", 12.0)):
        doc = {"cells": [dict(cell)]} | ({"fitted": fitted} if fitted else {})
        path.write_text(json.dumps(doc))
        assert load_table(path)["cells"][0]["fit_ms"] == ms, fitted
    path.write_text(json.dumps({"fitted": "mean_ms", "cells": [cell]}))
    with pytest.raises(TableError, match="'fitted'.*'mean_ms'"):
        load_table(path)
    del cell["min_ms"]
    path.write_text(json.dumps({"fitted": "min_ms", "cells": [cell]}))
    with pytest.raises(TableError, match=r"cells\[0\] lacks 'min_ms'"):
        load_table(path)


def test_a_table_is_calibration_grade_only_when_no_round_ran_beside_other_work():
    """The load average counts the bench's own threads; other processes' CPUs (recorded by
    the bench from /proc/stat) catch a neighbour it hides. Older tables lack them."""
    def doc(load, others=None):
        extra = {} if others is None else {"others_cpus_per_round": others}
        return {"cpus": 2, "load": {"per_round_1min": load, **extra}}

    assert loaded(doc([1.6, 2.5])) is None
    assert loaded(doc([1.6, 1.7], [0.1, 0.25])) is None
    assert loaded(doc([1.6, 2.6])) == ("at a 1-minute load of up to 2.6 on 2 CPUs, other "
                                       "processes using up to 0.00 CPUs")
    assert "other processes using up to 0.90 CPUs" in loaded(doc([1.6, 1.7], [0.1, 0.9]))


def test_the_many_core_fit_reproduces_the_published_figures():
    """Fitted: the EPYC's 16-thread length curve (within 10% per length), the Arm host's
    quiet 29-token 1/16-thread ratio and the ~1,200-token 2.4x (exactly: two equations, two
    unknowns). Checked, not fitted: with the Arm host loaded by one busy thread per core
    (assumed; the record does not say), fair sharing makes 16 threads slower than 1 by
    157/87.7 within 15%."""
    p = fit_published()
    for tokens, ms in EPYC_9575F_16_THREADS_MS.items():
        assert p.t16_ms(tokens) == pytest.approx(ms, rel=0.10), tokens
    o = p.overhead_share * p.a16_ms

    def t1(tokens):  # the published model's 1-thread time
        return o + (p.t16_ms(tokens) - p.a16_ms) / p.p16

    quiet = KUNPENG_29_TOKENS_MS["quiet"]
    assert t1(29) / p.t16_ms(29) == pytest.approx(quiet[1] / quiet[16], rel=1e-6)
    assert t1(LONG_INPUT_TOKENS) / p.t16_ms(LONG_INPUT_TOKENS) == \
        pytest.approx(LONG_INPUT_SPEEDUP_16, rel=1e-6)
    loaded = KUNPENG_29_TOKENS_MS["loaded"]
    slow1 = 1 / cores_share(16, 1 + 16, 0).rate(1)
    slow16 = 1 / cores_share(16, 16 + 16, 0).rate(16)
    ratio = p.t16_ms(29) * slow16 / (t1(29) * slow1)
    assert ratio == pytest.approx(loaded[16] / loaded[1], rel=0.15), ratio


def test_past_two_threads_the_calibrated_model_follows_the_measured_16_core_host():
    """Past 2 threads the host's fit carries on with the scaling a 16-core Xeon measured
    (``bench/results/precision_xeon16.json``: 4, 8 and 16 threads over 2, seven shapes): its
    speed-ups within 20% in log rms for torch float32, 30% for the two whose cells of 3
    rounds scatter (bfloat16's AMX kernels: 1 x 128 read 1.6x at 8 threads and 1.2x at 16;
    onnxruntime: 1 x 32 read 2x slower at 4 threads than at 2, 1.7x faster at 8), and nearer
    than the published figures bring them. The published fit misses torch float32's
    16-thread forward of 8 x 256 tokens by more than 2x (its 16 threads also read slower
    than 2 on one row of 8, where the Xeon's gained 1.2x). More threads never make the work
    slower (only sync does)."""
    p = fit_published()
    for (backend, precision), limit in ((("onnxruntime", "float32"), 0.3),
                                        (("torch", "float32"), 0.2),
                                        (("torch", "bfloat16"), 0.3)):
        fit = calibrated(backend, precision)
        cells = many_core_cells((backend, precision))
        published = fit.with_many(p.many_core(fit.serial, fit.grain_tokens))
        rms = float(np.sqrt(np.mean(log_error(fit, cells) ** 2)))
        assert rms <= limit, (backend, precision, rms)
        assert rms < float(np.sqrt(np.mean(log_error(published, cells) ** 2)))
        assert all(fit.parallel(n + 1) >= fit.parallel(n) for n in range(1, 64))
    torch32 = calibrated("torch", "float32")
    published = torch32.with_many(p.many_core(torch32.serial, torch32.grain_tokens))
    long_ratio = {(r, t, n): m for r, t, n, m in many_core_cells(("torch", "float32"))}
    measured = long_ratio[(8, 256, 16)]
    assert measured / (published.quiet_ms(8, 256, 2) / published.quiet_ms(8, 256, 16)) > 2.0
    assert published.quiet_ms(1, 8, 16) > published.quiet_ms(1, 8, 2)
    assert long_ratio[(1, 8, 16)] > 1.1


FACTS_XEON_QUIET_MS = {  # FACTS.md: torch float32, best of 7, (1 thread, 2 threads)
    (1, 8): (6.20, 4.02), (1, 32): (10.24, 7.05), (1, 128): (23.46, 14.40),
    (1, 256): (44.98, 26.81), (16, 64): (169.2, 82.4), (8, 256): (373.9, 205.7)}


def test_the_reference_model_reproduces_the_quiet_xeon_table_it_was_fitted_to():
    """The fixed model the tuner's tests run on (``TimeModel``'s default), apart from the
    measured table: within 7% of every cell, and the published speed-up past 2 threads."""
    for (rows, length), times in FACTS_XEON_QUIET_MS.items():
        for n, ms in zip((1, 2), times, strict=True):
            assert REFERENCE.quiet_ms(rows, length, n) == pytest.approx(ms, rel=0.07)
    assert REFERENCE.left(16, LONG_INPUT_TOKENS) == pytest.approx(fit_published().p16,
                                                                   rel=1e-3)


def test_cores_are_shared_fairly_and_shadows_get_what_is_left():
    assert cores_share(64, 64, 0).served == 1.0
    assert cores_share(64, 128, 0).served == 0.5  # 8 workers x 16 threads on 64 cores
    beside = cores_share(64, 64, 16)  # no core left: the shadows wait, interfere with none
    assert (beside.shadow, beside.shadow_cores, beside.served) == (0.0, 0.0, 1.0)
    # this host's measurement: a 2-thread idle-class shadow beside 1-thread served forwards
    # on 2 cores made them 1.5x slower
    two = cores_share(2, 1, 2)
    assert (two.shadow_cores, two.shadow) == (1.0, 0.5)
    assert 1 / two.served == pytest.approx(1.5)


def test_a_forward_of_several_threads_beside_a_neighbour_runs_at_its_slowest_threads_pace():
    """Checked against this host's served forwards (onnxruntime, 2 vCPUs) with a neighbour
    holding one core against none, same shapes, same run (``bench/shadow_vs_served.py``):
    1 thread keeps its speed, 2 threads run about half as fast, where fair sharing of the
    3 threads said 2/3 (one of the team's threads shares a core, the other waits for it at
    every barrier). Within 15% per shape."""
    doc = json.loads((Path(__file__).parents[1] / "bench" / "results" /
                      "shadow_vs_served.json").read_text())
    served: dict[tuple, list[float]] = {}
    for c in doc["cells"]:
        served.setdefault((c["neighbour"], c["rows"], c["length"], c["threads"]),
                          []).append(c["served_ms"])
    shapes = {k[1:] for k in served if k[0] == "none"}
    assert len(shapes) >= 6
    for rows, length, n in sorted(shapes):
        measured = (statistics.median(served[("one core", rows, length, n)]) /
                    statistics.median(served[("none", rows, length, n)]))
        model = cores_share(2, n, 0).rate(n) / cores_share(2, n + 1, 0).rate(n)
        assert model == pytest.approx(measured, rel=0.15), (rows, length, n)
    assert cores_share(2, 3, 0).served == pytest.approx(2 / 3)  # one thread: fair share


def flat(overhead_ms=1.0, per_token_ms=0.1) -> ConfigFit:
    """A model whose work splits perfectly (serial 0, no sync): times are easy to check."""
    return ConfigFit("sim", "sim", overhead_ms, 0.0, 0.0, per_token_ms, 0.0, 0.0,
                     many=ManyCore(0.0, 0.0))


QUIET = Noise(forward=0.0, host=0.0)


def test_a_worker_beside_a_neighbour_runs_at_its_fair_share():
    """4 cores, one worker at 4 threads; a neighbour holds 4 busy threads from 10 s: the
    forwards then take twice as long (8 threads want 4 cores)."""
    model = flat()
    host = SimulatedHost(TimeModel(4, model), [Neighbour(4, 10.0)], fixed=4, noise=QUIET)
    trace = [Arrival(k * 0.5, 64) for k in range(40)]
    out = host.run(trace)
    quiet = model.quiet_ms(1, 64, 4)
    for at, ms in zip(out.at_s, out.served_ms, strict=True):
        assert ms == pytest.approx(quiet if at < 10 else 2 * quiet, rel=1e-6), at


def test_workers_share_the_cores_and_the_most_served_threads_are_counted():
    """8 workers at 16 threads each on 64 cores, all busy: 128 threads want 64 cores, so each
    forward takes twice its quiet time; at 8 threads each they fit and take their own."""
    model = flat(overhead_ms=0.0)
    burst = [Arrival(0.0, 512) for _ in range(8)]
    for n, slow in ((16, 2.0), (8, 1.0)):
        out = SimulatedHost(TimeModel(64, model), fixed=n, workers=8, noise=QUIET,
                            max_rows=1).run(burst)
        assert out.max_served_threads == 8 * n
        assert out.served_ms == pytest.approx([slow * model.quiet_ms(1, 512, n)] * 8)


def test_queued_requests_share_a_forward_as_the_runtime_batches_them():
    """R3.1: requests that wait share the next forward (one length bucket, up to
    ``max_rows`` rows and ``max_tokens`` padded tokens), timed as rows x padded length."""
    model = flat()
    trace = [Arrival(0.0, 20)] * 5 + [Arrival(0.0, 30)] * 3 + [Arrival(0.0, 100)]
    out = SimulatedHost(TimeModel(2, model), fixed=2, noise=QUIET, max_rows=32).run(trace)
    assert out.rows == [8, 1]  # 17-32 tokens together, the 100-token one alone
    assert out.served_ms == pytest.approx([model.quiet_ms(8, 30, 2),
                                           model.quiet_ms(1, 100, 2)])


def test_a_cores_hook_clamps_what_each_worker_serves():
    """The hook tuner/cores.py plugs in: it sees the count a worker wants and the counts the
    others serve now, and what it returns runs."""
    seen = []

    def hook(worker, wanted, others, lower, held):
        seen.append((wanted, sum(others)))
        return min(wanted, 64 // 8)  # an even split

    burst = [Arrival(0.0, 256) for _ in range(8)]
    out = SimulatedHost(TimeModel(64, flat()), fixed=16, workers=8, noise=QUIET, max_rows=1,
                        cores_hook=hook).run(burst)
    assert out.max_served_threads == 64 and len(seen) == 8
    assert seen[0] == (16, 0) and seen[-1] == (16, 7 * 8)  # the others' counts as they run


def test_workers_sharing_a_ledger_charge_a_busy_one_only_its_fair_share():
    """R4.12, as ``free_cpus.share_of_pool`` reads a real host: 4 cores, two workers, one
    serving a forward at 4 threads, the other idle. Read as a neighbour, the busy one leaves
    the idle one no free core; beside a sibling in the core ledger (a cores hook), it is
    charged its fair share (2) and the idle one reads the other 2."""
    def asked(worker, wanted, others, lower, held):
        return wanted

    for hook, idle_reads in ((None, 0.0), (asked, 2.0)):
        host = SimulatedHost(TimeModel(4, flat()), fixed=4, workers=2, noise=QUIET,
                             max_rows=1, cores_hook=hook)
        host.run([Arrival(0.0, 512)])
        rates = sorted(free / host.clock.now_s for free in host.clock.free_s)
        assert rates == pytest.approx([idle_reads, 4.0]), hook


def test_the_host_wide_noise_is_correlated_over_seconds_and_forward_noise_is_not():
    """One worker, fixed count, one forward every 0.2 s: the host-wide factor (sigma 0.2,
    30-s time constant) keeps neighbouring forwards' slowness alike; per-forward noise
    alone does not."""

    def log_slowness(noise):
        model = flat()
        out = SimulatedHost(TimeModel(2, model), fixed=1, noise=noise, seed=3).run(
            [Arrival(0.2 * k, 64) for k in range(1500)])
        return np.log(np.asarray(out.served_ms) / model.quiet_ms(1, 64, 1))

    def lag1(x):
        return float(np.corrcoef(x[:-1], x[1:])[0, 1])

    host = log_slowness(Noise(forward=0.0, host=0.2, host_tau_s=30.0))
    each = log_slowness(Noise(forward=0.2, host=0.0))
    assert lag1(host) > 0.9 and abs(lag1(each)) < 0.15
    assert 0.1 < float(np.std(host)) < 0.35 and float(np.std(each)) == pytest.approx(0.2,
                                                                                      rel=0.2)



def test_every_run_of_one_seed_meets_the_same_host_wide_noise():
    """Common random numbers: mode 2 and each fixed count of one seed are compared run
    against run, so the host-wide factor is one path in virtual time whatever each run's
    events (two counts, two traffic levels here); drawn per event, each run had its own."""
    paths = []
    for fixed, rate in ((1, 5.0), (2, 40.0)):
        host = SimulatedHost(TimeModel(2, flat()), fixed=fixed, seed=3,
                             noise=Noise(forward=0.05, host=0.2, host_tau_s=30.0))
        host.run(poisson_trace(rate, 60, [16, 64, 256], seed=fixed))
        paths.append([host.clock.slowness.log_at(t) for t in np.arange(0.0, 60.0, 0.5)])
    assert paths[0] == paths[1] and float(np.std(paths[0])) > 0.02

def test_one_seed_gives_one_run():
    def run():
        host = SimulatedHost(TimeModel(4), seed=5, workers=2)
        return host.run(poisson_trace(20, 20, [16, 64, 256], seed=5)).served_ms

    assert run() == run()


def learned(host: SimulatedHost, worker: int = 0) -> dict[int, int]:
    """range lo -> learned count, read through the report (R4.10), as an operator would."""
    doc = report.build(report.from_tuner(host.tuners[worker]))
    return {int(r["size_range"].split("-")[0]): r["learned_threads"] for r in doc["ranges"]
            if r["learned_threads"] is not None}


@pytest.mark.parametrize("cores", [2, 16])
def test_mode2_learns_a_count_near_the_models_best_for_each_range(cores):
    """R4.5: one worker, the reference model (``TimeModel``'s default), a quiet host: each
    range it learns
    picks a count whose modelled time is within 10% of the best allowed count's (a count
    must beat the configured one by the 5% margin; noise is 5%)."""
    model = TimeModel(cores)
    host = SimulatedHost(model, seed=cores)
    sizes = [16, 64, 256, 512]
    host.run(poisson_trace(6, 240, sizes, seed=cores))
    got = learned(host)
    assert got, "nothing learned"
    for lo, n in got.items():
        best = min(model.forward_ms(lo, k) for k in host.counts)
        assert model.forward_ms(lo, n) <= 1.10 * best, (lo, n, got)


def test_a_paid_shadow_that_times_a_count_holds_its_simulated_workers_place():
    """R4.5 amended, as on the real engine (``ShadowSteps.step``): mode 1 on 2 cores at 90% of
    a 1-thread worker's capacity leaves no gap for a 2-thread shadow, so the learning share
    pays for them; each runs in the served forwards' place: it starts only once the served
    forward in flight ended, and no served forward starts while it runs (the event loop holds
    them back, as ``served_threads`` waits on the real engine). The ranges get 2-thread
    samples."""
    model = TimeModel(2)
    host = SimulatedHost(model, mode=AdaptiveMode.LEARN, configured=1, counts=(1, 2), seed=5)
    start, held = host.clock.start_forward, {}  # id -> the shadow (kept: no id reused)

    def start_forward(w, batch, n, shadow):
        if shadow and host.tuner.place_held_until() > host.clock.now_s:
            # none of its worker's served forwards in flight
            assert all(f.shadow for f in host.clock.forwards), host.clock.now_s
            fwd = start(w, batch, n, shadow)
            held[id(fwd)] = fwd
            return fwd
        if not shadow:
            assert not any(id(f) in held for f in host.clock.forwards), host.clock.now_s
        return start(w, batch, n, shadow)

    host.clock.start_forward = start_forward
    host.run(trace_at_load(model.fit(), 0.9, 1, 1, 120.0, seed=5))
    assert len(held) >= 3, len(held)
    ranges = report.build(report.from_tuner(host.tuners[0]))["ranges"]
    assert any(r["counts"]["2"]["samples"] for r in ranges), ranges


def test_the_many_core_scenario_reports_mode2_against_every_fixed_count():
    """64 cores, 8 workers, a neighbour between none and half the host: the figures the
    scenario reports exist for mode 2 and every fixed count, on the same requests. What they
    show is printed, not asserted (python -m vllm_srun.tuner.simulate for the full run)."""
    runs = many_core(seed=1, duration_s=10)
    names = [r.name for r in runs]
    assert names[0].startswith("mode 2") and names[1].startswith("mode 2 + core ledger")
    assert names[2:] == [f"fixed {n}" for n in (1, 2, 4, 8, 16)]
    requests = {r.forwards for r in runs}
    assert all(r.forwards > 100 and r.herd is not None for r in runs), requests
    for r in runs[2:]:
        n = int(r.name.split()[1])
        assert r.max_served_threads <= 8 * n and r.herd.changes == 0
    for r in runs:
        print(r)


def _most_threads_at_once(out, after_s: float) -> int:
    """The most served threads all workers ran at once among forwards started after
    ``after_s`` (from each forward's start and time)."""
    edges = sorted((t, sign * n) for t, ms, n in zip(out.at_s, out.served_ms,
                                                     out.served_threads, strict=True)
                   if t >= after_s for t, sign in ((t, 1), (t + ms / 1000, -1)))
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def test_workers_sharing_the_ledger_leave_a_neighbour_its_cores():
    """R4.12 on the simulated host: 16 cores, 4 mode 2 workers configured 4 (an even split),
    a neighbour on 8 cores from 2 s on. Under back-to-back load the workers' configured
    counts alone fill the 16 cores; with the core ledger (``simulate.ledger``: the room the
    neighbour leaves, vouched counts below the configured one), once a window has read the
    neighbour they together serve at most the 8 it leaves them."""
    cores, workers, neighbour_from = 16, 4, 2.0
    trace = poisson_trace(400, 6, [64, 128], seed=3)

    def run(hook):
        return SimulatedHost(TimeModel(cores, flat()), [Neighbour(8, neighbour_from)],
                             seed=3, configured=4, counts=(1, 2, 4), workers=workers,
                             noise=QUIET, max_rows=1, cores_hook=hook).run(trace)

    shared = _most_threads_at_once(run(ledger(cores, 4, workers)), neighbour_from + 0.3)
    alone = _most_threads_at_once(run(None), neighbour_from + 0.3)
    assert shared <= cores - 8 < alone, (shared, alone)


def test_herd_sets_changes_close_in_time_against_independent_ones():
    """Three workers change within 0.1 s of each other, a fourth alone much later: each of
    the three sees two others near it, where as many changes spread over 100 s would give
    almost none."""
    from vllm_srun.tuner.sim_host import Outcome

    out = Outcome(changes=[(1.0, 0, 2), (1.05, 1, 2), (1.08, 2, 2), (90.0, 3, 4)])
    h = herd(out, workers=4, duration_s=100.0, window_s=0.1)
    assert (h.changes, h.most_workers) == (4, 3)
    assert h.coincident == pytest.approx(6 / 4)
    assert h.expected < 0.01 and h.ratio > 100
    assert herd(Outcome(), 4, 100.0).changes == 0


def test_a_range_learns_without_the_counts_the_core_ledger_keeps_out_of_reach():
    """R4.12, R4.5: mode 2 on 16 cores, configured 4, beside a core ledger that never
    gives more than 4 threads (other workers hold the rest). The counts above 4, tried in
    turn, run at 4 and give themselves no samples; once refused more often than timed they
    are out of the range's reach and it learns among 1, 2 and 4, where before it explored on,
    serving every count in turn, for as long as the load lasted."""
    def at_most_4(worker, wanted, others, lower, held):
        return min(wanted, 4)

    host = SimulatedHost(TimeModel(16, flat()), seed=7, configured=4, counts=(1, 2, 4, 8, 16),
                         noise=QUIET, max_rows=1, cores_hook=at_most_4)
    out = host.run(poisson_trace(40, 60, [64, 256], seed=7))
    ranges = host.tuners[0].learner.ranges
    assert set(ranges) == {64, 256}
    for lo, r in ranges.items():
        assert r.learned == 4 and r.refused.keys() <= {8, 16}, (lo, r.phase, r.refused)
    explored = sum(out.explored)
    assert explored < 0.2 * len(out.explored), explored  # learning ended early in the run


def test_a_configured_count_the_core_ledger_refuses_stays_learned_and_serves_what_fits():
    """R4.12, R4.13: mode 2, two workers configured 8 on 16 cores sharing them through the
    core ledger beside a neighbour on 7: each worker's share is 4 threads, and 8 is refused
    nearly always. Out of reach once refused more often than timed, the configured count
    too, a range keeps the configured count (no other count can be judged against it) and
    the ledger serves it at what fits. Before, a range waited for samples of 8 it seldom
    got: one still explored after 60 s, its 8 refused over a thousand times (simulated
    16 cores, seed 12 of ``bench/tuner_sweep.py``: ranges explored 30-50 s so, auditing
    every 8th forward at 8 threads on the one core left)."""
    host = SimulatedHost(TimeModel(16, flat()), [Neighbour(7, 0.0)], seed=7, configured=8,
                         counts=(1, 2, 4, 8, 16), noise=QUIET, max_rows=1, workers=2,
                         cores_hook=ledger(16, 8, 2))
    out = host.run(poisson_trace(80, 60, [64, 256], seed=7))
    for t in host.tuners:
        for lo, r in t.learner.ranges.items():
            assert r.learned == 8 and not r.exploring, (lo, r.phase, r.refused)
    late = [n for n, at in zip(out.served_threads, out.at_s, strict=True) if at > 30]
    assert late and set(late) == {4}, set(late)


def test_a_range_decides_without_the_counts_a_neighbour_keeps_from_being_tried():
    """R4.5, R4.8: mode 2 on 16 cores, configured 8, beside a neighbour on 12 cores for the
    whole run. A forward at 8 or 16 would take twice its time or more beside it, so exploring
    on served forwards never tries them and they give no samples; after ``held_out_s`` of
    that they are out of the range's reach (the configured count too) and it decides. Without
    the rule (``held_out_s`` past the run) range 64 explores to the end (16 threads gave it
    too few samples to lose; in 256 they lost)."""
    from vllm_srun.tuner.settings import TunerSettings

    def run(held_out_s: float):
        host = SimulatedHost(TimeModel(16, flat()), [Neighbour(12, 0.0)], seed=11,
                             configured=8, counts=(1, 2, 4, 8, 16), noise=QUIET, max_rows=1,
                             settings=TunerSettings.of(background=False,
                                                       held_out_s=held_out_s))
        host.run(poisson_trace(40, 60, [64, 256], seed=11))
        return host.tuners[0].learner.ranges

    ranges = run(20.0)
    assert set(ranges) == {64, 256}
    assert not any(r.exploring for r in ranges.values()), [r.phase for r in ranges.values()]
    assert run(1e9)[64].exploring


def test_workers_of_one_scope_start_from_what_a_sibling_learned():
    """R4.12 on the simulated host: each worker's record watch runs on the virtual clock
    (every ``watch_s``, staggered), so a count one worker learned and flushed reaches the
    other as a sibling's candidate, which it times against its configured count instead of
    exploring every count. With the watch put off past the run, no worker hears of the
    other's counts."""
    from vllm_srun.tuner.settings import TunerSettings

    trace = poisson_trace(40, 30, [16, 64, 256], seed=5)

    def candidates(**knobs) -> int:
        host = SimulatedHost(TimeModel(4, flat()), seed=5, configured=1, counts=(1, 2, 4),
                             workers=2, noise=QUIET, max_rows=1,
                             settings=TunerSettings.of(background=False, **knobs))
        host.run(trace)
        return sum(r.candidate is not None for t in host.tuners
                   for r in t.learner.ranges.values())

    assert candidates(watch_s=1e9) == 0
    assert candidates() >= 1


def test_a_run_summary_shows_learnings_cost_span_by_span():
    """The many-core table's last column: per 30 s of the run, the mean forward time of the
    forwards started then and the share served only to time a count, so learning's cost
    (the first span) reads apart from what a learned worker serves after."""
    from vllm_srun.tuner.sim_host import Outcome
    from vllm_srun.tuner.simulate import summarise, table

    out = Outcome(served_ms=[1.0, 3.0, 10.0], at_s=[0.0, 10.0, 40.0],
                  explored=[True, False, False], latency_ms=[1.0, 3.0, 10.0])
    run = summarise("mode 2", out, workers=1, duration_s=60.0)
    assert run.spans == ((2.0, 0.5), (10.0, 0.0))
    assert table([run], 2)[-1].endswith("| 2.0 (50%), 10.0 |")


def test_the_moving_best_bench_pairs_mode2_with_every_fixed_count_and_the_oracle():
    """bench/moving_best.py at its smallest: every round serves one trace with mode 2 and
    every fixed count; the oracle ratio is 1 only where each forward ran at its shape's
    fastest count (checked by hand on the model), and mode 2's at most 1."""
    from bench.moving_best import oracle_ratio, run

    config = calibrated("torch", "bfloat16")
    counts = (1, 2, 4, 8, 16)
    fastest = [min(counts, key=lambda n, r=r, t=t: config.quiet_ms(r, t, n))
               for r, t in ((1, 8), (8, 256))]
    assert fastest[0] != fastest[1]  # the model's best count moves with size
    assert oracle_ratio(config, [1, 8], [8, 256], fastest, counts) == pytest.approx(1.0)
    slow = oracle_ratio(config, [1, 8], [8, 256], [1, 1], counts)
    assert slow == pytest.approx(
        (config.quiet_ms(1, 8, fastest[0]) + config.quiet_ms(8, 256, fastest[1]))
        / (config.quiet_ms(1, 8, 1) + config.quiet_ms(8, 256, 1)))
    out = run([1, 2], [0.5], 10.0)
    level = out["levels"]["0.5"]
    assert [set(r["fixed_ms"]) for r in level["rounds"]] == [{"1", "2", "4", "8", "16"}] * 2
    for r in level["rounds"]:
        assert r["vs_best_fixed"] == pytest.approx(min(r["fixed_ms"].values()) / r["mode2_ms"])
        assert 0 < r["vs_oracle"] <= 1 and sum(r["served_threads"].values()) > 0
    assert len(level["vs_oracle"]["ci95"]) == 2


def test_the_sweep_on_several_processes_gives_the_figures_of_one():
    """``python -m bench.tuner_sweep --jobs N`` runs each simulation in a pool of processes:
    the simulator is deterministic per seed, so the figures are one process's exactly."""
    from bench.tuner_sweep import _runs, main

    tasks = [("2 cores", seed, 2, None) for seed in (1, 2)]
    assert _runs(tasks, 2) == _runs(tasks, 1)
    with pytest.raises(SystemExit):
        main(["--jobs", "0", "--only", "--scenarios", "2 cores"])
