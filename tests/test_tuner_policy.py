"""R4.1/R4.2 and the pure decisions of the tuner."""

from __future__ import annotations

import pytest

from vllm_srun.runtime.errors import ConfigError
from vllm_srun.tuner.estimator import changed, choose, counts_needing_samples, losing_counts
from vllm_srun.tuner.modes import (
    ADAPTIVE_ENV,
    AdaptiveMode,
    allowed_counts,
    max_threads,
    parse_mode,
)
from vllm_srun.tuner.policy import clean_window, likely_uninterrupted, preempted, shadow_plan


@pytest.mark.parametrize(("raw", "mode"), [(None, AdaptiveMode.OFF), ("", AdaptiveMode.OFF),
                                           ("0", AdaptiveMode.OFF), ("1", AdaptiveMode.LEARN),
                                           ("2", AdaptiveMode.SERVE)])
def test_modes(raw, mode):
    assert parse_mode({} if raw is None else {ADAPTIVE_ENV: raw}) is mode


@pytest.mark.parametrize("raw", ["3", "yes", "-1", "1.0", "on"])
def test_other_values_are_an_error_naming_the_variable(raw):
    with pytest.raises(ConfigError, match=ADAPTIVE_ENV):
        parse_mode({ADAPTIVE_ENV: raw})


@pytest.mark.parametrize(("configured", "budget", "top", "counts"), [
    (1, 1, None, (1,)), (1, 2, None, (1, 2)), (2, 2, None, (1, 2)),
    (3, 6, None, (1, 2, 3, 4, 6)), (6, 12, None, (1, 2, 4, 6, 8, 12)),
    (16, 64, None, (1, 2, 4, 8, 16)), (8, 24, None, (1, 2, 4, 8, 16)),
    (1, 8, 2, (1, 2)), (6, 16, 16, (1, 2, 4, 6, 8, 16)), (4, 8, 2, (1, 2, 4)),
    (4, 6, 6, (1, 2, 4, 6))])
def test_allowed_counts_go_up_to_the_budget_unless_narrowed(configured, budget, top, counts):
    """R4.2 (amended): 1, powers of two, the configured count and the budget, up to the
    budget and at most 16 by default; --max-threads narrows; the configured count stays in."""
    assert allowed_counts(configured, budget, top) == counts


def test_a_default_server_may_learn_a_count_above_the_configured_one():
    """R4.2: out of the box (no --max-threads) the default count (half the budget) is not the
    top of the set, so mode 1 can learn that long inputs want more threads."""
    from vllm_srun.runtime.budget import configured_threads

    for budget in (2, 4, 16, 24):  # from 32 CPUs on, the default is already 16, the cap
        configured = configured_threads(budget, None, {})
        assert max(allowed_counts(configured, budget, max_threads(budget, None, {}))) > \
            configured


def test_max_threads_is_capped_by_the_budget():
    assert max_threads(2, 8) == 2
    assert max_threads(8, env={"VLLM_SRUN_CPU_MAX_THREADS": "4"}) == 4
    assert max_threads(8, env={}) is None
    with pytest.raises(ConfigError, match="VLLM_SRUN_CPU_MAX_THREADS"):
        max_threads(8, env={"VLLM_SRUN_CPU_MAX_THREADS": "0"})


def test_no_count_is_learned_before_every_count_has_its_samples():
    samples = {1: [5.0] * 12, 2: [3.0] * 11}
    assert choose(samples, (1, 2), 1, 12, 0.05, 48) is None
    assert counts_needing_samples(samples, (1, 2), 12) == [2]


def test_the_fastest_count_is_learned():
    assert choose({1: [5.0] * 12, 2: [3.0] * 12}, (1, 2), 1, 12, 0.05, 48) == 2
    assert choose({1: [3.0] * 12, 2: [5.0] * 12}, (1, 2), 2, 12, 0.05, 48) == 1


def test_a_count_within_the_margin_does_not_displace_the_configured_one():
    assert choose({1: [5.0] * 12, 2: [4.9] * 12}, (1, 2), 1, 12, 0.05, 48) == 1


def test_relearning_triggers_when_served_time_moves_either_way():
    assert changed([3.0, 3.1, 2.9], 1.0, 1.5)
    assert changed([0.5, 0.6], 1.0, 1.5)
    assert not changed([1.2, 1.3, 1.1], 1.0, 1.5)


def test_a_shadow_is_a_sample_only_if_no_served_forward_ran_during_it():
    """R4.5 (amended): an overlapped shadow is discarded, not stored."""
    assert clean_window(0, 10, 10)
    assert not clean_window(1, 10, 10)  # one was running when it started
    assert not clean_window(0, 10, 11)  # one started during it
    assert not clean_window(0, 10, 12)  # one started and ended during it


def test_a_shadow_whose_threads_waited_for_a_cpu_is_not_a_sample():
    """R4.5: waiting is measured in the shadow process (schedstat); None: not measured."""
    assert not preempted(0.010, None)
    assert not preempted(0.010, 0.0004)  # wake-up latency on a quiet host (<0.05 measured)
    assert not preempted(0.001, 0.0001)  # a short forward's floor
    assert preempted(0.010, 0.0025)
    assert preempted(0.024, 0.024)  # 2 threads beside a CPU-bound process: 1.0 measured


def test_a_timing_shadow_starts_only_if_the_next_served_forward_likely_leaves_it_time():
    """R4.5: judged from the recent idle gaps between served forwards, given how long the
    worker has been idle already."""
    back_to_back = [0.0004] * 32  # one closed-loop client: its turnaround
    assert not likely_uninterrupted(back_to_back, 0.0, 0.005)
    assert likely_uninterrupted(back_to_back, 0.001, 0.005)  # longer than any: load stopped
    assert likely_uninterrupted([], 0.0, 0.005)  # nothing known yet
    poisson = [0.002, 0.030, 0.011, 0.045, 0.004, 0.020, 0.060, 0.009]
    assert likely_uninterrupted(poisson, 0.0, 0.005)  # 6 of 8 gaps were longer
    assert not likely_uninterrupted(poisson, 0.0, 0.025)  # 3 of 8
    assert likely_uninterrupted(poisson, 0.010, 0.010)  # 4 of the 5 that lasted 10 ms
    assert not likely_uninterrupted(poisson, 0.010, 0.040)  # 1 of 5
    assert likely_uninterrupted(poisson, 0.025, 0.100)  # too few lasted 25 ms to say


def test_counts_far_behind_after_their_first_samples_need_no_more():
    samples = {1: [10.0, 5.0, 12.0], 2: [6.0] * 3, 16: [40.0] * 3}
    assert losing_counts(samples, (1, 2, 16)) == {16}
    assert counts_needing_samples(samples, (1, 2, 16), 12) == [1, 2]
    samples[1] = [10.0, 9.0, 12.0]  # every sample past 2's: out too
    assert losing_counts(samples, (1, 2, 16)) == {1, 16}
    full = {1: [10.0] * 12, 2: [6.0] * 12, 16: [40.0] * 3}
    assert choose(full, (1, 2, 16), 1, 12, 0.05, 48) == 2


def test_shadow_plan():
    """Exploring: every count due; mode 2's window: the learned count; then every Nth
    forward one probe at another count than the served one, in turn (R4.11)."""
    assert shadow_plan([1, 4], False, None, 2, (1, 2, 4), 0, 8) == [1, 4]
    assert shadow_plan([], True, 4, 2, (1, 2, 4), 3, 8) == [4]
    assert shadow_plan([], False, 4, 4, (1, 2, 4), 3, 8) == []
    probes = [shadow_plan([], False, 4, 4, (1, 2, 4), i, 8) for i in (8, 16, 24)]
    assert probes == [[2], [1], [2]]
    assert shadow_plan([], False, 1, 1, (1,), 8, 8) == []


def test_a_serving_ranges_audit_waits_for_a_gap_however_long_the_load_lasts():
    """An audit of a range serving its learned count is evidence beside the voucher and the
    window, not work that must complete (R4.5 amended: the share pays for timing and the
    window only): under back-to-back served forwards no audit starts, however long they
    last; once the worker is idle it starts in the gap, sharing the served cores. It ran
    every 2 s whatever the load before, beside served forwards on 2 cores (0.982x fixed 2
    with it, 0.992x without, 16 connections, one run each)."""
    import numpy as np

    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.types import ForwardResult
    from vllm_srun.tuner.ranges import Phase, RangeLearning
    from vllm_srun.tuner.scheduling import ShadowGate, ShadowJob
    from vllm_srun.tuner.settings import TunerSettings

    now = [0.0]
    gate = ShadowGate(TunerSettings(), configured=1, top=2, clock=lambda: now[0])
    ranges = {64: RangeLearning(phase=Phase.SERVING, learned=2)}
    batch, out = pad([[1] * 100]), np.zeros((1, 4), np.float32)
    job = ShadowJob(batch, out, served_threads=2, counts=[1], served_s=0.03)
    starts = []
    for _ in range(400):  # 12 s of 30-ms forwards at 2 threads, 1 ms apart
        gate.served_started(now[0], first=True)
        now[0] += 0.03
        gate.served_ended(now[0], True, ForwardResult(out, 2, 2, 0.03))
        now[0] += 0.001
        if gate.next_shadow(now[0], {64: job}, ranges, AdaptiveMode.SERVE) is not None:
            starts.append(now[0])
    # (in the load's first forwards the busy window has not filled yet)
    assert [t for t in starts if t > TunerSettings().gaps.busy_window_s] == []
    now[0] += 1.5  # the load ends: idle for longer than the busy window
    due = gate.next_shadow(now[0], {64: job}, ranges, AdaptiveMode.SERVE)
    assert due is not None and due[2] == 1 and due[3] is True  # in the gap, on shared cores
