"""R4.8, the sweep plan above 1,024 padded tokens: every shape up to 1,024 padded tokens, and
above it a stratified sample (per size range of padded tokens x power-of-two row count: its
smallest shape, its largest and one drawn by a seed) that is the same for the same seed. The
bounds are a long-input worker's (32 rows, lengths 2-512, 8,192 padded tokens), where the
shapes above 1,024 tokens are thousands."""

from __future__ import annotations

import pytest

from vllm_srun.runtime.sizes import size_range
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep

BIG = ShapeBounds(max_rows=32, max_len=512, max_padded=8192)


def every_shape(b: ShapeBounds) -> set[tuple[int, int]]:
    """Every (rows, padded length) the engine can form within ``b``, counted here afresh."""
    return {(rows, n) for rows in range(1, b.max_rows + 1) for n in range(b.min_len, b.max_len + 1)
            if rows == 1 or rows * n <= b.max_padded}


def strata(shapes: set[tuple[int, int]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The shapes above 1,024 padded tokens by (padded-token range, row-count range)."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rows, n in shapes:
        if rows * n > 1024:
            out.setdefault((size_range(rows * n)[0], size_range(rows)[0]), []).append((rows, n))
    return out


@pytest.fixture(scope="module")
def plan():
    return plan_sweep(BIG)


def test_every_shape_up_to_1024_padded_tokens_is_swept(plan):
    everything = every_shape(BIG)
    small = {s for s in everything if s[0] * s[1] <= 1024}
    assert len(small) == 3599
    assert small <= set(plan.shapes)
    assert set(plan.shapes) <= everything and len(set(plan.shapes)) == len(plan.shapes)
    assert [s[0] * s[1] for s in plan.shapes] == sorted(s[0] * s[1] for s in plan.shapes)


def test_each_stratum_above_1024_is_sampled_with_its_smallest_and_largest_shape(plan):
    by_stratum = strata(every_shape(BIG))
    assert len(by_stratum) == 14 and sum(map(len, by_stratum.values())) == 10108
    chosen = {s for s in plan.shapes if s[0] * s[1] > 1024}
    for key, members in sorted(by_stratum.items()):
        picked = chosen & set(members)
        assert len(picked) == min(3, len(members)), (key, sorted(picked))
        assert min(members, key=lambda s: (s[0] * s[1], s)) in picked, key
        assert max(members, key=lambda s: (s[0] * s[1], s)) in picked, key
    assert chosen <= {s for members in by_stratum.values() for s in members}
    assert (plan.sampled, plan.above) == (len(chosen), 10108) == (38, 10108)
    cov = plan.coverage((1, 2))
    assert (cov.exhaustive_padded, cov.shapes, cov.sampled, cov.above) == (1024, 3637, 38,
                                                                           10108)


def test_the_plan_is_the_same_for_a_seed_and_its_random_picks_follow_the_seed(plan):
    assert plan_sweep(BIG, seed=0) == plan
    other = plan_sweep(BIG, seed=1)
    assert other != plan and len(other.shapes) == len(plan.shapes)
    small = [s for s in plan.shapes if s[0] * s[1] <= 1024]
    assert [s for s in other.shapes if s[0] * s[1] <= 1024] == small


def test_the_defaults_for_minilm_are_the_readme_figures():
    """README: for all-MiniLM-L6-v2 (lengths up to 256) at the defaults, 32 rows and 16,384
    padded tokens, "3,002 shapes plus 28 of the 5,158 above"."""
    p = plan_sweep(ShapeBounds(max_rows=32, max_len=256, max_padded=16384))
    assert (len(p.shapes) - p.sampled, p.sampled, p.above) == (3002, 28, 5158)
