"""Mode 2 with a voucher times counts on its own served forwards (R4.5, R4.8), so an exploring
range's shadows verify rather than time: after a forward at the configured count, no shadow
times a count the voucher covers for that forward's shape (the range's next forwards of the
shape serve it); after a forward at another count, its answer is audited at the configured
count while that fills the count's transition window, then on every ``audit_every``-th
forward explored on, as many as a learned range's forwards get. Every such shadow beside the
served forwards slows them: on a simulated 16-core host at 90% load, a worker configured 8
audited every forward it explored on at 8 threads and timed counts by shadows as well, and
served 0.97x a fixed 8 in 2 of 10 seeds (``bench/moving_best.py``)."""

from __future__ import annotations

from vllm_srun.records.host_record import Scope
from vllm_srun.records.voucher import Coverage, Voucher
from vllm_srun.runtime.types import ForwardResult
from vllm_srun.tuner.contention import FreeCores
from vllm_srun.tuner.learning import Learner
from vllm_srun.tuner.ledger import ExactnessLedger
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.persistence import RecordSync
from vllm_srun.tuner.ranges import RangeLearning
from vllm_srun.tuner.settings import TunerSettings
from vllm_srun.tuner.sim_types import answer, batch_of
from vllm_srun.tuner.tally import Tally

COUNTS = (1, 2, 4)
# a sweep of rows up to 8 and lengths 2-512: 64 tokens of 1 row covered, of 16 rows not
SWEPT = Coverage(COUNTS, 8, 2, 512, 2048, 2048, 1)


def learner(window: int = 8) -> tuple[Learner, RangeLearning]:
    settings = TunerSettings.of(background=False)
    mode = AdaptiveMode.SERVE
    ledger = ExactnessLedger(mode, 1, window)
    ledger.voucher = Voucher(1, 0, True, (SWEPT,))
    made = Learner(mode, 1, COUNTS, settings, ledger,
                   RecordSync(None, Scope("test-host", "rev1", "onnxruntime"), lambda: 0.0),
                   FreeCores(None, 0.1), Tally(), "w")
    r = made.ranges[64] = RangeLearning()
    return made, r


def shadows_after(made: Learner, served: int, rows: int = 1, length: int = 64) -> list[int]:
    """The counts a forward of ``rows`` x ``length`` served at ``served`` put on the shadow
    board for its range (64-127 padded tokens); no sample taken."""
    batch = batch_of(rows, length)
    made.served(batch, ForwardResult(answer(batch), served, served, 0.01), None, False, 1.0)
    job = made.board.jobs.pop(64, None)
    return job.counts if job is not None else []


def test_an_exploring_range_times_counts_on_its_served_forwards_not_on_shadows():
    made, r = learner()
    assert set(made.need(r)) == set(COUNTS)  # nothing timed yet
    assert shadows_after(made, 1) == [1, 2, 4]  # not yet exploring
    r.explore_served = True  # its served forwards now time each count in turn
    assert shadows_after(made, 1) == []
    # a shape the voucher does not cover serves only the configured count: shadows time
    # the other counts for it
    assert shadows_after(made, 1, rows=16, length=4) == [2, 4]


def test_a_forward_explored_on_is_audited_while_it_fills_the_window_then_at_the_audit_rate():
    made, r = learner(window=3)
    r.explore_served = True
    every = made.settings.learning.audit_every
    for _ in range(3):  # the window of 2 threads fills from audits of forwards served at 2
        made.tally.explored += 1
        assert shadows_after(made, 2) == [1]
        made.ledger.agree(64, 2, 1)
    assert made.ledger.window_passed(64, 2)
    audited = []
    for _ in range(4 * every):
        made.tally.explored += 1
        audited.append(shadows_after(made, 2) == [1])
    assert sum(audited) == 4  # every audit_every-th forward explored on
    # a count whose window is still open is audited each time
    made.tally.explored += 1
    assert shadows_after(made, 4) == [1]


def shadow_of(made: Learner, served: int, count: int, rows: int = 1, length: int = 64,
              ms: float = 5.0) -> list[int]:
    """A forward of ``rows`` x ``length`` served at ``served`` and its due shadow run once,
    clean, at ``count`` in ``ms``: the counts its job still holds after (a count still due
    runs that batch again)."""
    batch = batch_of(rows, length)
    made.served(batch, ForwardResult(answer(batch), served, served, 0.01), None, False, 1.0)
    job = made.board.jobs[64]
    made.after_shadow(64, job, count, ForwardResult(answer(batch), count, count, ms / 1000),
                      True, 2.0)
    return job.counts


def test_an_audit_of_a_count_served_forwards_time_is_no_sample_and_does_not_run_again():
    """An exploring range compares its counts on samples of one kind and of its traffic:
    where its served forwards time a count, a shadow of that count only verifies. Taken as
    samples, and run again while the count still lacked samples, audits of one batch
    served at 2 threads in a pause made the whole 1-thread estimate of 64-127 padded tokens
    (11 runs of one 65-token row, 8.8-10.6 ms), against 2-thread samples of served forwards
    of every size in the range under 16 connections: the range learned 1 thread where a
    fixed 2 served its passages faster (torch bfloat16, 2-vCPU EPYC, two runs of
    ``bench.mode2_learned`` with the samples logged)."""
    made, r = learner()
    made.ledger.locked_reason = None  # (no golden check: what a shadow gives is under test)
    r.explore_served = True
    assert shadow_of(made, 2, 1) == []  # the audit ran; it gives no sample, nor runs again
    assert 1 not in r.samples
    # a shape the voucher does not cover: shadows time its counts, and a count still due
    # runs the batch again
    assert shadow_of(made, 1, 2, rows=16, length=4) == [4, 2]
    assert r.samples[2] == [5.0]
