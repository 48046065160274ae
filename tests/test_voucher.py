"""R4.6-R4.8 with real forwards: mode 2 serves a learned count only for the counts and shapes a
voucher covers, and a drift any worker of the scope meets retires every worker within a
second. The real mismatch is torch's on this host (FACTS.md: drift between 1 and 2 threads at
some shapes); which shapes drift is measured here, not assumed."""

from __future__ import annotations

import calendar
import time
from dataclasses import replace

import numpy as np
import pytest

from tests.test_adaptive import FAST, M, SlowerAt, row, serve_paced, start, wait_for
from vllm_srun.records.host_record import HostRecord, Scope
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.tuner.adaptive import output_bits
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.policy import RangeState
from vllm_srun.tuner.report import build, from_tuner, table
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep, sweep

COUNTS = (1, 2)


def vouch(backend, record: HostRecord, bounds: ShapeBounds) -> None:
    """A real sweep of ``bounds`` at counts 1 and 2, recorded as the scope's voucher."""
    plan = plan_sweep(bounds)
    context = ThreadContext()
    try:
        res = sweep(lambda b, n: context.run(n, lambda: backend.forward(b, n)), 1, COUNTS,
                    plan.shapes)
    finally:
        context.shutdown()
    assert res.comparisons == len(plan.shapes) and res.mismatches == 0, res.first_mismatch
    record.add_voucher(Scope("test-host", M.revision, backend.name.value), "verify",
                       res.comparisons, res.mismatches, plan.coverage(COUNTS))


def serve_until_serving(runner, tuner, lo: int, lengths: list[int], tries: int = 40) -> None:
    for i in range(tries):
        serve_paced(runner, tuner, row(lengths[i % len(lengths)], i))
        if (r := tuner.ranges.get(lo)) is not None and r.serving:
            return
    raise AssertionError(f"range {lo} never served its learned count: {build(from_tuner(tuner))}")


def test_mode2_serves_learned_counts_only_for_covered_shapes(tmp_path):
    """R4.8: the voucher covers one row of 2-40 tokens at counts 1 and 2. In range 16-31 the
    learned count (2) serves single rows; two rows of the same padded size stay at the
    configured count, and the report counts them."""
    backend = load_backend(M, "onnxruntime")
    record = HostRecord(tmp_path / "r.sqlite")
    vouch(backend, record, ShapeBounds(max_rows=1, max_len=40, max_padded=40))
    runner, tuner = start(SlowerAt(backend, 1, 1000.0), record, AdaptiveMode.SERVE, 1, COUNTS)
    try:
        serve_until_serving(runner, tuner, 16, [20, 24, 28])
        before = len(runner.served)
        runner.engine.submit([row(22, 1)]).result(timeout=60)  # 1 x 22: covered
        runner.engine.submit([row(11, 2), row(11, 3)]).result(timeout=60)  # 2 x 11: not
        served = runner.served[before:]
        report = build(from_tuner(tuner))
    finally:
        runner.stop()
    assert [(r.rows, r.padded_tokens, r.num_threads) for r in served] == [(1, 22, 2),
                                                                          (2, 22, 1)]
    assert tuner.uncovered == 1 and report["uncovered_forwards"] == 1
    assert any("outside every voucher's coverage" in n for n in report["notes"])
    (cov,) = report["voucher"]["coverage"]
    assert (cov["counts"], cov["max_rows"], cov["min_len"], cov["max_len"]) == ([1, 2], 1, 2, 40)


def test_a_voucher_for_other_counts_does_not_let_mode2_serve(tmp_path):
    """R4.8: a sweep at counts {1, 4} does not vouch for a worker whose learned count is 2."""
    backend = load_backend(M, "onnxruntime")
    record = HostRecord(tmp_path / "r.sqlite")
    plan = plan_sweep(ShapeBounds(max_rows=1, max_len=40, max_padded=40))
    record.add_voucher(Scope("test-host", M.revision, "onnxruntime"), "verify", 39, 0,
                       plan.coverage((1, 4)))
    runner, tuner = start(SlowerAt(backend, 1, 1000.0), record, AdaptiveMode.SERVE, 1, COUNTS)
    try:
        for i in range(10):
            serve_paced(runner, tuner, row(20, i))
        report = build(from_tuner(tuner))
    finally:
        runner.stop()
    assert tuner.ranges[16].learned == 2 and not tuner.ranges[16].serving
    assert {r.num_threads for r in runner.served} == {1}
    (rng,) = [r for r in report["ranges"] if r["size_range"] == "16-31"]
    assert rng["state"] == RangeState.NO_VOUCHER


def drifts(backend, context: ThreadContext, n: int, salts: int = 2) -> bool:
    """Does a one-row input of n tokens differ in any bit between 1 and 2 threads? Measured
    on the rows the test serves."""
    for salt in range(salts):
        batch = pad([row(n, salt)])
        a, b = (context.run(k, lambda k=k, x=batch: backend.forward(x, k)).outputs
                for k in COUNTS)
        if not np.array_equal(output_bits(a), output_bits(b)):
            return True
    return False


def find_shapes(backend, run: int = 4) -> tuple[int, list[int], int | None]:
    """A size range lo..2lo-1 of one-row lengths holding ``run`` consecutive lengths that do
    not drift and one that does: (lo, clean run, drifting length or None). Tries 32-63 (drift
    at 57+ on the Intel host) then 8-15 (5-11 on the AMD ones). Forwards at 2 threads are slow
    on a busy 2-core host, so it measures only as far as it must."""
    context = ThreadContext()
    try:
        for lo in (32, 8):
            clean: list[int] = []
            for n in range(lo, 2 * lo):
                clean = [*clean, n] if not drifts(backend, context, n) else []
                if len(clean) == run:
                    break
            if len(clean) < run:
                continue
            bad = next((n for n in reversed(range(lo, 2 * lo))
                        if n not in clean and drifts(backend, context, n, 1)), None)
            if bad is not None:
                return lo, clean, bad
    finally:
        context.shutdown()
    return 0, [], None


def test_torch_mode2_real_mismatch_never_served_and_retires_every_worker(tmp_path):
    """R4.6-R4.8 on a backend that really drifts: two workers share one record. Answers served
    at the learned count for covered shapes equal the configured count's bit for bit; a
    drifting shape outside the voucher is served at the configured count; its shadow meets the
    drift, which retires this worker and, through the record, the other within a second; the
    other's report names who saw it, when and on what shape."""
    backend = load_backend(M, "torch")
    lo, covered, drifting = find_shapes(backend)  # one size range holds both
    if drifting is None:
        pytest.skip("torch does not drift here in one-row 8-15 or 32-63 beside a clean run")
    path = tmp_path / "r.sqlite"
    vouch(backend, HostRecord(path), ShapeBounds(1, covered[-1], covered[-1], covered[0]))
    context = ThreadContext()

    def reference(n: int, salt: int) -> np.ndarray:  # the answer at the configured count
        return context.run(1, lambda: backend.forward(pad([row(n, salt)]), 1)).outputs

    slow = SlowerAt(backend, 1, 1000.0)  # 2 threads learned, whatever this host's timings
    settings = replace(FAST, min_samples=2, window=2)  # 2-thread forwards are slow here
    a, ta = start(slow, HostRecord(path), AdaptiveMode.SERVE, 1, COUNTS, settings)
    b, tb = start(slow, HostRecord(path), AdaptiveMode.SERVE, 1, COUNTS, settings)
    ta.worker, tb.worker = "replica a pid 1", "replica b pid 2"
    try:
        for runner, tuner in ((a, ta), (b, tb)):
            serve_until_serving(runner, tuner, lo, covered)
        for runner, tuner in ((a, ta), (b, tb)):
            for i in range(4):  # covered shapes: served at 2 threads, never moved
                n = covered[i % len(covered)]
                out = serve_paced(runner, tuner, row(n, i))
                assert runner.served[-1].num_threads == 2
                assert np.array_equal(output_bits(out), output_bits(reference(n, i)))
        for i in range(2 * FAST.audit_every):  # the drifting shape, until a probe meets it
            out = serve_paced(a, ta, row(drifting, i))
            assert a.served[-1].num_threads == 1  # not covered: the configured count
            assert np.array_equal(output_bits(out), output_bits(reference(drifting, i)))
            if ta.retired is not None:
                break
        assert ta.retired is not None and ta.retired.padded_tokens == drifting
        assert wait_for(lambda: tb.retired is not None, 5.0)
        lag_s = tb.retired_at - ta.retired.created_at
        print(f"worker b retired {lag_s:.3f} s after worker a's drift")
        assert lag_s < 1.0  # B stopped serving learned counts within a second
        out = b.engine.submit([row(covered[0], 0)]).result(timeout=60)
        assert b.served[-1].num_threads == 1
        assert np.array_equal(output_bits(out), output_bits(reference(covered[0], 0)))
        report = build(from_tuner(tb))
    finally:
        a.stop()
        b.stop()
        context.shutdown()
    d = report["drift"]
    assert (d["worker"], d["rows"], d["padded_length"]) == ("replica a pid 1", 1, drifting)
    seen_at = calendar.timegm(time.strptime(d["seen_at"], "%Y-%m-%dT%H:%M:%SZ"))
    assert abs(seen_at - ta.retired.created_at) < 2  # when
    assert "RETIRED BY DRIFT seen by replica a pid 1" in table(report)
    assert all(r["state"] == RangeState.RETIRED for r in report["ranges"])
