"""R4.6-R4.8, R4.13: the exactness ledger is the one gate on what is served. Its truth table
over the golden check, mode, voucher (counts and shape), transition window and drift, on
plain data (no model, no clock)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_srun.records.host_record import Coverage, DriftEvent, Voucher
from vllm_srun.tuner.ledger import ExactnessLedger, Refusal, first_difference
from vllm_srun.tuner.modes import AdaptiveMode

# one row of 2-64 tokens, or several up to 64 padded tokens, at counts 1, 2 and 4
VOUCHED = Voucher(100, 0, True, (Coverage((1, 2, 4), 4, 2, 64, 64, 64, 100),))
WINDOW = 3


def ledger(mode=AdaptiveMode.SERVE, voucher=VOUCHED, locked=None) -> ExactnessLedger:
    led = ExactnessLedger(mode, 1, WINDOW)
    led.locked_reason, led.voucher = locked, voucher
    return led


def refusal(led: ExactnessLedger, count=2, rows=1, length=20, explore=False) -> Refusal | None:
    return led.may_serve(16, count, rows, length, explore).refusal


def test_the_configured_count_always_serves():
    drift = DriftEvent(20, 1, 2, (0, 0), 0.0, 1.0, 0.0, 1, "w")
    for led in (ledger(), ledger(AdaptiveMode.LEARN), ledger(locked="not run"),
                ledger(voucher=Voucher(0, 0, False))):
        led.retire(drift)
        assert led.may_serve(16, 1, 9, 999).allowed


def test_each_rule_refuses_another_count_and_says_which():
    assert refusal(ledger(locked="golden check has not run")) is Refusal.LOCKED
    assert refusal(ledger(AdaptiveMode.LEARN)) is Refusal.LEARN_ONLY
    assert refusal(ledger(voucher=Voucher(0, 0, False))) is Refusal.UNCOVERED
    led = ledger()
    assert refusal(led) is Refusal.WINDOW  # vouched, but no agreement yet
    assert refusal(led, rows=2, length=40) is Refusal.UNCOVERED  # 80 padded: over 64
    assert refusal(led, count=8) is Refusal.UNCOVERED  # a count no sweep ran
    assert led.may_serve(16, 2, 1, 20, explore=True).allowed  # vouched exploration


def test_the_window_passes_after_window_agreements_in_that_range_only():
    led = ledger()
    for i in range(WINDOW):
        assert led.window_due(16, 2) and not led.may_serve(16, 2, 1, 20).allowed
        assert led.toward_window(16, 1, 2, learned=2)
        led.agree(16, 1, 2)  # served at 1, the shadow at 2 agreed
        assert led.progress(16, 2) == i + 1
    assert led.may_serve(16, 2, 1, 20).allowed and led.may_serve_range(16, 2)
    assert not led.window_due(16, 2) and not led.toward_window(16, 1, 2, learned=2)
    assert refusal(led, length=40) is None and not led.may_serve(32, 2, 1, 40).allowed
    assert led.comparisons == WINDOW and led.audits == 0


def test_agreements_count_against_the_configured_count_or_a_verified_one():
    led = ledger()
    led.agree(16, 4, 2)  # neither side verified: nothing passes on it
    assert (led.progress(16, 2), led.progress(16, 4), led.audits) == (0, 0, 1)
    for _ in range(WINDOW):
        led.agree(16, 2, 1)  # exploring served at 2, audited at the configured count
    led.agree(16, 4, 2)  # 2 is verified now: 4 agreeing with it counts
    assert (led.progress(16, 2), led.progress(16, 4)) == (WINDOW, 1)


def test_exploring_audits_count_but_not_shadows_of_configured_batches():
    led = ledger()
    assert led.toward_window(16, 2, 1, learned=None)  # what exploring served at 2, audited
    assert not led.toward_window(16, 1, 2, learned=None)  # a timing shadow while exploring
    assert not ledger(AdaptiveMode.LEARN).toward_window(16, 1, 2, learned=2)
    assert not ledger(voucher=Voucher(0, 0, False)).toward_window(16, 1, 2, learned=2)


def test_drift_retires_every_count_and_a_withdrawn_voucher_stops_serving():
    led = ledger()
    for _ in range(WINDOW):
        led.agree(16, 1, 2)
    assert led.may_serve(16, 2, 1, 20).allowed
    led.voucher = Voucher(0, 0, False)  # `threads reset`
    assert refusal(led) is Refusal.UNCOVERED and not led.may_serve_range(16, 2)
    led.voucher = VOUCHED  # a new sweep: the agreements still stand
    assert led.may_serve(16, 2, 1, 20).allowed
    led.retire(DriftEvent(20, 1, 2, (0, 0), 0.0, 1.0, 0.0, 1, "w"))
    assert refusal(led) is Refusal.RETIRED and refusal(led, explore=True) is Refusal.RETIRED
    assert not led.learning and led.retired_at is not None


@pytest.mark.parametrize(("served", "shadow", "at"), [
    (np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32), None),
    (np.zeros((2, 3), np.float32), np.array([[0, 0, 0], [0, -0.0, 0]], np.float32), (1, 1)),
    (np.zeros(3, np.float32), np.zeros(4, np.float32), (0,))])
def test_first_difference_is_bit_for_bit(served, shadow, at):
    """-0.0 == 0.0 numerically, not in bits: a difference."""
    assert first_difference(served, shadow) == at
