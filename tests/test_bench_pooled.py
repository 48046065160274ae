"""bench.adaptive_wrk's pooled percentile: several runs' tails (wrk's 90-100% quantiles per
run) give the percentile of all their requests together, which the p99 targets of
bench.adaptive_load are judged on besides the per-run p99s."""

from __future__ import annotations

import numpy as np

from bench.adaptive_wrk import TAIL_FROM, TAIL_POINTS, TAIL_STEP, pooled_percentile


def tail(latencies_us: np.ndarray) -> list[float]:
    """What the wrk script writes: quantiles from TAIL_FROM% in TAIL_STEP% steps, then the max."""
    qs = [TAIL_FROM + i * TAIL_STEP for i in range(TAIL_POINTS - 1)]
    return [float(v) for v in np.percentile(latencies_us, qs)] + [float(latencies_us.max())]


def test_the_pooled_p99_of_runs_is_the_p99_of_all_their_requests():
    rng = np.random.default_rng(0)
    runs, every = [], []
    for n, sigma in ((400, 0.5), (350, 0.7), (500, 0.6), (300, 0.9)):  # unlike runs
        lat = rng.lognormal(9, sigma, n)
        every.append(lat)
        runs.append({"requests": n, "tail_us": tail(lat)})
    want = float(np.percentile(np.concatenate(every), 99)) / 1e3
    assert abs(pooled_percentile(runs) - want) <= 0.03 * want


def test_one_run_pools_to_its_own_p99():
    lat = np.random.default_rng(1).lognormal(9, 0.6, 1000)
    want = float(np.percentile(lat, 99)) / 1e3
    assert abs(pooled_percentile([{"requests": 1000, "tail_us": tail(lat)}]) - want) <= \
        0.01 * want


def test_runs_without_tails_pool_to_nothing():
    assert pooled_percentile([{"requests": 10, "tail_us": []}]) is None
    assert pooled_percentile([]) is None
