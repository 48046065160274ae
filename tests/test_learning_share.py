"""R4.5 amended: where traffic leaves no idle CPU, learning takes a bounded paid share of
serving so that mode 2's transition window completes. The real tuner, real L3 forwards (so
every comparison is bit for bit), back-to-back served forwards on a fake clock: a shadow may
only start while a served forward runs, as under steady closed-loop load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import L3, row
from vllm_srun.records.host_record import Coverage, Scope, Voucher
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.share import PaidShare

M = resolve(L3)
# on the fake clock: a served forward at 1 thread 20 ms, at 2 threads 10 ms; a shadow 10 ms
SERVED_S, SHADOW_S = {1: 0.020, 2: 0.010}, 0.010


@pytest.fixture(scope="module")
def backend():
    return load_backend(M, "onnxruntime")


def back_to_back(backend, share: float, forwards: int, mode: AdaptiveMode = AdaptiveMode.SERVE,
                 waited: float = 0.0, first: list[int] | None = None
                 ) -> tuple[AdaptiveThreads, int | None]:
    """Serve up to ``forwards`` one-row forwards back to back (each shadow step runs while
    one is in flight); returns the tuner and the forward at which range 16-31 served 2. A
    shadow's threads each waited ``waited`` of its time for a CPU. ``first``: a row served
    once before them (of a range the traffic then never reaches again)."""
    now = [0.0]
    settings = TunerSettings.of(background=False, min_samples=4, window=4, learning_share=share)
    paid_runs = []

    def shadow(batch, n, paid=False):
        result = backend.forward(batch, n)
        paid_runs.append(paid)
        now[0] += SHADOW_S
        return replace(result, forward_s=SHADOW_S, waited_s=waited * n * SHADOW_S)

    tuner = AdaptiveThreads(mode, 1, (1, 2), Scope("h", M.revision, "o"), None,
                            backend.forward, settings, clock=lambda: now[0],
                            shadow_forward=shadow, paid_forward=lambda b, n: shadow(b, n, True))
    tuner.ledger.locked_reason = None
    tuner.ledger.voucher = Voucher(1, 0, True, (Coverage((1, 2), 1, 2, 64, 64, 64, 63),))
    for i in range(forwards):
        batch = pad([first if first is not None and i == 0 else row(20, i)])
        n = tuner.served_threads(batch)
        while tuner.step():  # the shadow loop, while this forward runs
            pass
        result = backend.forward(batch, n)
        now[0] += SERVED_S[n]
        tuner.observe(batch, replace(result, forward_s=SERVED_S[n]))
        if n == 2 and tuner.learner.ranges[16].serving:
            assert all(paid_runs), "no idle-class shadow can start under this load"
            return tuner, i
    return tuner, None


def test_a_paid_share_completes_the_window_under_back_to_back_load_within_its_share(backend):
    tuner, at = back_to_back(backend, 0.02, 3000)
    assert at is not None and at < 3000, tuner.learner.ranges
    paid = tuner.side.paid
    assert paid.paid_shadows >= tuner.settings.learning.window  # the audits of exploring forwards
    # paid time within 2% of served forward time, plus what the bucket may hold, plus one
    assert paid.paid_s <= 0.02 * paid.served_s + paid.cap_s + SHADOW_S
    learning = tuner.ledger
    assert learning.window_passed(16, 2) and learning.retired is None


def test_without_a_share_the_window_never_completes_under_back_to_back_load(backend):
    tuner, at = back_to_back(backend, 0.0, 600)
    r = tuner.learner.ranges[16]
    assert at is None and r.learned == 2 and not r.serving
    assert tuner.side.paid.paid_shadows == 0


def test_a_range_the_traffic_reached_once_learns_from_paid_shadows_of_that_batch(backend):
    """R4.5 amended, mode 1 under back-to-back load: one batch of range 64-127 was served,
    then only rows of 20 tokens. The share pays for shadows of that one batch, each
    ``starved_s`` after the last, at every count, until the range has its samples and learns
    (before, only a newly served batch of the range restarted its starvation clock: it got
    one paid shadow, and at 60% of capacity a range reached 3 times in 5 minutes never
    learned)."""
    tuner, _ = back_to_back(backend, 0.02, 2000, AdaptiveMode.LEARN, first=row(100))
    r = tuner.learner.ranges[64]
    need = tuner.settings.learning.min_samples
    assert r.learned is not None, (r.samples, tuner.side.paid)
    assert all(len(r.samples.get(n, ())) >= need for n in (1, 2)), r.samples
    paid = tuner.side.paid
    assert paid.paid_s <= 0.02 * paid.served_s + paid.cap_s + SHADOW_S


def test_in_mode_2_a_range_pays_for_its_learning_from_its_own_served_time(backend):
    """R4.5 amended, mode 2 under back-to-back load: one batch of 64-127 tokens, then only
    rows of 20. Range 16-31 pays for its window from its own forwards and serves 2 threads;
    the rare range's bucket holds 2% of its one forward, under the cost of one shadow, so
    none is paid for it (from one bucket for all, under steady load the share went on at 2%
    of served time on such ranges long after the load's ranges had learned). Mode 1 pays for
    it from the whole share (``test_a_range_the_traffic_reached_once...``)."""
    tuner, at = back_to_back(backend, 0.02, 3000, first=row(100))
    assert at is not None, tuner.learner.ranges
    paid, rare = tuner.side.paid, tuner.learner.ranges[64]
    assert paid.range_credit_s[64] == pytest.approx(0.02 * SERVED_S[1])  # never charged
    assert rare.learned is None and not rare.samples.get(2)
    assert paid.paid_s <= 0.02 * paid.served_s + paid.cap_s + SHADOW_S


def test_a_ranges_own_bucket_bounds_what_it_may_be_paid_in_mode_2_only():
    mode2, mode1 = PaidShare(0.02, cap_s=0.5, per_range=True), PaidShare(0.02, cap_s=0.5)
    for share in (mode2, mode1):
        share.accrue(10.0, 16)  # 0.2 s in the bucket, all from range 16
        share.accrue(0.5, 64)  # 0.01 s from range 64
    assert mode2.affords(0.2, 16) and not mode2.affords(0.05, 64)
    assert mode1.affords(0.2, 64)  # one bucket for all
    mode2.charge(0.2, 16)
    assert mode2.range_credit_s[16] == pytest.approx(0.0) and not mode2.affords(0.01, 16)


def test_the_paid_bucket_fills_at_the_share_caps_and_is_charged():
    share = PaidShare(0.02, cap_s=0.5)
    share.accrue(10.0)  # 0.2 s of credit
    assert share.affords(0.2) and not share.affords(0.3)
    share.charge(0.25)  # one overran its expected cost: repaid before the next
    assert not share.affords(0.01) and share.credit_s == pytest.approx(-0.05)
    share.accrue(1000.0)
    assert share.credit_s == 0.5 and share.affords(2.0)  # the longest wait for a full bucket
    assert not PaidShare(0.0).affords(0.0)


def test_the_share_setting_is_validated_and_named_in_its_error():
    """``--learning-share`` / $VLLM_SRUN_CPU_LEARNING_SHARE: a fraction within 0..0.5."""
    from vllm_srun.runtime.errors import ConfigError
    from vllm_srun.tuner.modes import LEARNING_SHARE_ENV, learning_share

    assert learning_share(None, {}) is None
    assert learning_share(None, {LEARNING_SHARE_ENV: " 0.05 "}) == 0.05
    assert learning_share("0", {LEARNING_SHARE_ENV: "0.3"}) == 0.0  # the flag wins
    for bad in ("0.9", "-0.1", "two percent", "nan"):
        with pytest.raises(ConfigError, match=LEARNING_SHARE_ENV):
            learning_share(None, {LEARNING_SHARE_ENV: bad})
        with pytest.raises(ConfigError, match="--learning-share"):
            learning_share(bad, {})


@pytest.mark.parametrize("waited", [0.6, 1.0])
def test_a_paid_shadow_whose_threads_mostly_waited_is_compared_but_not_timed(backend, waited):
    """R4.5: a paid shadow runs beside served forwards at normal priority; where its threads
    waited for a CPU for most of its time, what is left once the wait is taken out is no
    measure of the count (it came to 0 ms, and a median of 0 ms divided the range's speed-up
    by zero, which ended the shadow loop). Such a shadow is still compared bit for bit and
    counted as preempted, and gives no sample."""
    tuner, _ = back_to_back(backend, 0.02, 300, AdaptiveMode.LEARN, waited)
    r = tuner.learner.ranges[16]
    assert tuner.side.paid.paid_shadows >= 1 and tuner.tally.preempted >= 1
    assert not r.samples.get(2) and r.learned is None
    assert tuner.ledger.comparisons >= 1 and tuner.ledger.retired is None


def test_the_share_is_kept_for_the_oldest_starved_range_not_spent_on_cheaper_ones(backend):
    """R4.5 amended, mode 1: a range the traffic reaches rarely (64-127, its shadow 30 ms)
    and a frequent one (16-31, 10 ms) both wait for a paid shadow. With 15 ms in the bucket
    the rare one, oldest, is short, and nothing is paid for until the bucket holds its
    shadow: spent on the cheaper shadows as it came, it never would while they kept coming
    (range 128-255 was timed 11 s past the 2 minutes at 60% of capacity). In mode 2, where a
    range's own bucket is what it lacks, the others go on."""
    for mode in (AdaptiveMode.LEARN, AdaptiveMode.SERVE):
        tuner = AdaptiveThreads(mode, 1, (1, 2), Scope("h", M.revision, "o"), None,
                                backend.forward, TunerSettings.of(background=False),
                                clock=lambda: 100.0)
        tuner.ledger.locked_reason = None
        tuner.ledger.voucher = Voucher(1, 0, True, (Coverage((1, 2), 1, 2, 128, 128, 128,
                                                             127),))
        for r, served_s in ((row(100), 0.060), (row(20), 0.020)):  # rare first: the oldest
            batch = pad([r])
            tuner.observe(batch, replace(backend.forward(batch, 1), forward_s=served_s))
        board, paid = tuner.learner.board, tuner.side.paid
        assert list(board.jobs) == [64, 16] and all(2 in j.counts for j in board.jobs.values())
        for lo in board.jobs:
            board.starved_since[lo] = 0.0
        paid.credit_s = 0.015  # the rare one's shadow expected 30 ms, the frequent one's 10
        paid.range_credit_s = {64: 1.0, 16: 1.0}
        if mode is AdaptiveMode.LEARN:
            assert board.paid_due(100.0, paid.affords) is None  # kept for range 64
            paid.credit_s = 0.03
            assert board.paid_due(100.0, paid.affords)[:2] == (64, board.jobs[64])
        else:
            paid.credit_s, paid.range_credit_s[64] = 1.0, 0.015  # its own bucket is short
            assert board.paid_due(100.0, paid.affords)[:2] == (16, board.jobs[16])


def test_a_paid_shadow_that_times_a_count_runs_in_the_served_forwards_place(backend):
    """R4.5 amended, mode 1 under back-to-back load with a shadow loop thread: a paid shadow
    whose time is a sample (count 2, which mode 1 serves never) does not run beside a served
    forward (beside one on 2 vCPUs at 60% of capacity it timed the CPUs that forward left:
    1.4-2.0x the served 1-thread median). Due while one runs, it claims the next forward's
    place and starts once that one ended; each of them ran with no served forward in flight,
    and the range learns from them."""
    now = [0.0]
    # served forwards take more than ``busy_max`` of each second, as at 60% of capacity: no
    # idle-class shadow on their cores starts, even between two of them
    settings = TunerSettings.of(background=True, min_samples=4, learning_share=0.02,
                                busy_max=0.0)
    beside = []

    def shadow(batch, n, paid=False):
        result = backend.forward(batch, n)
        if paid:
            beside.append((n, tuner.flight.busy, tuner.flight.held_until > 0))
        now[0] += SHADOW_S
        return replace(result, forward_s=SHADOW_S, waited_s=0.0)

    tuner = AdaptiveThreads(AdaptiveMode.LEARN, 1, (1, 2), Scope("h", M.revision, "o"), None,
                            backend.forward, settings, clock=lambda: now[0],
                            shadow_forward=shadow, paid_forward=lambda b, n: shadow(b, n, True))
    tuner.ledger.locked_reason = None
    claims = 0
    for i in range(600):
        batch = pad([row(20, i)])
        n = tuner.served_threads(batch)
        now[0] += SERVED_S[n] / 2
        while tuner.step():  # the shadow loop, halfway through this forward
            pass
        claims += tuner.flight.claim_until > 0
        result = backend.forward(batch, n)
        now[0] += SERVED_S[n] / 2
        tuner.observe(batch, replace(result, forward_s=SERVED_S[n]))
        while tuner.step():  # ... and woken as it ended
            pass
        assert tuner.flight.claim_until == 0.0  # a claim lasts until the shadow loop's turn
    r = tuner.learner.ranges[16]
    timed = [(busy, held) for count, busy, held in beside if count == 2]
    assert len(r.samples.get(2, ())) >= 4 and r.learned is not None, r
    assert claims >= 1 and len(timed) >= 4
    assert set(timed) == {(0, True)}  # none beside a served forward, each holding its place


def test_a_served_forward_waits_while_a_paid_shadow_holds_its_place(backend):
    """The engine's side: a served forward about to start while a paid shadow that times a
    count runs waits until it ends (the shadow loop's thread, a real one here)."""
    import threading
    import time

    release, running = threading.Event(), threading.Event()

    def paid(batch, n):
        running.set()
        release.wait(10)
        return replace(backend.forward(batch, n), waited_s=0.0)

    tuner = AdaptiveThreads(AdaptiveMode.LEARN, 1, (1, 2), Scope("h", M.revision, "o"), None,
                            backend.forward, TunerSettings.of(background=True),
                            clock=lambda: 100.0, paid_forward=paid)
    tuner.ledger.locked_reason = None
    batch = pad([row(20)])
    tuner.observe(batch, replace(backend.forward(batch, 1), forward_s=0.02))  # due: count 2
    tuner.learner.board.starved_since[16] = 0.0
    tuner.side.paid.credit_s = 1.0
    tuner.side.budget.used_s = 1e9  # no idle-class shadow may start: only a paid one
    loop = threading.Thread(target=tuner.step)
    loop.start()
    assert running.wait(10) and tuner.flight.held_until
    started = []
    served = threading.Thread(target=lambda: started.append(tuner.served_threads(batch)))
    served.start()
    time.sleep(0.3)
    assert not started  # it waits for the shadow
    release.set()
    loop.join(10)
    served.join(10)
    assert started == [1] and not tuner.flight.held_until
    assert tuner.tally.waited == 1 and tuner.tally.waited_s >= 0.3