"""The bench's statistics (SPEC R8.2): paired-round ratios, bootstrap intervals over rounds with
a fixed seed, and a verdict that is "met" only when the whole interval clears the goal."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.stats import (
    MIN_ROUNDS,
    Goal,
    Interval,
    bootstrap,
    median_interval,
    paired_ratios,
    percentile,
    pooled_ratio_interval,
    sum_ratio_interval,
    verdict,
)


def test_paired_ratios_skip_rounds_with_a_missing_or_zero_figure():
    assert paired_ratios([2.0, None, 3.0, math.nan, 4.0], [1.0, 1.0, 0.0, 1.0, 8.0]) == \
        [2.0, 0.5]


def test_bootstrap_is_reproducible_and_brackets_the_estimate():
    values = [0.9, 1.1, 1.0, 0.95, 1.05, 1.2, 0.85, 1.0, 1.02, 0.98]
    a, b = median_interval(values), median_interval(values)
    assert a == b  # fixed seed: one run's report reproduces
    assert a.rounds == 10 and a.estimate == statistics.median(values)
    assert min(values) <= a.lo <= a.estimate <= a.hi <= max(values)


def test_interval_narrows_with_more_rounds_and_covers_the_truth():
    rng = random.Random(5)
    draw = [rng.lognormvariate(0, 0.2) for _ in range(200)]  # true median 1.0
    few, many = median_interval(draw[:10]), median_interval(draw)
    assert many.hi - many.lo < (few.hi - few.lo) / 2
    assert many.lo < 1.0 < many.hi


def test_fewer_than_two_rounds_give_no_interval_and_no_verdict():
    one = median_interval([1.5])
    assert one.estimate == 1.5 and math.isnan(one.lo) and one.rounds == 1
    assert one.text() == "1.500 (no interval: 1 round)"
    assert verdict(one, Goal.parse(">= 0.97")) == "unresolved"
    assert median_interval([]).rounds == 0 and median_interval([]).text() == "n/a"


@pytest.mark.parametrize(("lo", "hi", "goal", "expected"), [
    (0.98, 1.10, ">= 0.97", "met"),
    (0.97, 1.10, ">= 0.97", "met"),       # the bound itself meets >=
    (0.90, 1.10, ">= 0.97", "unresolved"),
    (0.80, 0.96, ">= 0.97", "missed"),
    (0.80, 1.04, "<= 1.05", "met"),
    (0.99, 1.20, "<= 1.05", "unresolved"),
    (1.06, 1.20, "<= 1.05", "missed"),
    (1.00, 1.20, "> 1.00", "unresolved"),  # the bound itself does not meet >
])
def test_verdict_needs_the_whole_interval(lo, hi, goal, expected):
    assert verdict(Interval((lo + hi) / 2, lo, hi, 10), Goal.parse(goal)) == expected


def test_too_few_rounds_give_no_verdict_however_narrow():
    assert verdict(Interval(1.5, 1.4, 1.6, MIN_ROUNDS - 1), Goal.parse(">= 0.97")) == \
        "unresolved"
    assert verdict(Interval(1.5, 1.4, 1.6, MIN_ROUNDS), Goal.parse(">= 0.97")) == "met"


def test_goal_parse_names_what_is_wrong():
    assert Goal.parse("<= 1.05") == Goal("<=", 1.05) and str(Goal("<=", 1.05)) == "<= 1.05"
    with pytest.raises(ValueError, match="operator"):
        Goal.parse("~ 1")
    with pytest.raises(ValueError, match="'x' is not a number"):
        Goal.parse(">= x")


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100 and percentile([7.0], 99.9) == 7.0
    assert math.isnan(percentile([], 50))


def test_pooled_ratio_resamples_paired_rounds():
    a = [[10.0] * 99 + [100.0]] * 5  # every round: p99 10, the max 100
    b = [[10.0] * 100] * 5
    r = pooled_ratio_interval(a, b, lambda v: percentile(v, 99.5))
    assert r.rounds == 5 and r.estimate == 10.0 and r.lo == r.hi == 10.0
    same = pooled_ratio_interval(b, b, lambda v: percentile(v, 99))
    assert (same.estimate, same.lo, same.hi) == (1.0, 1.0, 1.0)


def test_sum_ratio_of_totals():
    r = sum_ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (r.estimate, r.lo, r.hi) == (2.0, 2.0, 2.0)
    mixed = sum_ratio_interval([1.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0])
    assert mixed.estimate == 1.0 and mixed.lo < 1.0 < mixed.hi


def test_bootstrap_of_any_statistic():
    r = bootstrap([1.0, 2.0, 3.0, 4.0], max)
    assert r.estimate == 4.0 and 1.0 <= r.lo <= r.hi == 4.0


def test_the_best_count_differs_by_size_only_where_no_count_is_best_at_both():
    """bench.precision with more than two counts: a shape's candidates are the counts not
    shown slower than the fastest (paired by round); the best count differs by size where
    two shapes' candidates have none in common, however many ties there are."""
    from bench.precision import summarise, verdict

    rounds = 6
    small = {1: [10.0] * rounds, 4: [8.0, 8.2] * 3, 8: [8.1, 7.9] * 3, 16: [11.0] * rounds}
    large = {1: [100.0] * rounds, 4: [40.0] * rounds, 8: [30.0] * rounds,
             16: [20.0, 21.0] * 3}
    rows = summarise({"c": {"1x128": small, "8x256": large}}, [1, 4, 8, 16])
    by = {r["shape"]: r for r in rows}
    assert by["1x128"]["candidates"] == [4, 8] and by["1x128"]["best_count"] == "tie"
    assert by["8x256"]["candidates"] == [16] and by["8x256"]["best_count"] == 16
    (line,) = verdict(rows)
    assert "DIFFERS by input size (1x128: [4, 8], 8x256: [16]" in line
    same = summarise({"c": {"1x128": large, "8x256": large}}, [1, 4, 8, 16])
    assert verdict(same) == ["- c: best count the same at every size (16) "
                             "[1x128:16, 8x256:16]"]
