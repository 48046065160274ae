"""Outlier ejection and backoff rules (R5.5, R5.6), with an injected clock.

The scenarios port the matrix of Envoy's outlier-detection tests
(test/common/upstream/outlier_detection_impl_test.cc: consecutive-error threshold, reset by
success, release and re-ejection, ejection time growth and cap, max-ejection-percent overflow,
errors while ejected) to the seed's rules, plus the seed's own: a model slow on every replica
keeps them all, a one-worker deployment is never ejected, ejected replicas serve when no
other can, and a passing /health never readmits early.
"""

from __future__ import annotations

import pytest

from vllm_srun.server.pool.outlier import Outcome, OutlierPolicy, OutlierSettings

T, S, F = Outcome.TIMEOUT, Outcome.SUCCESS, Outcome.FAILURE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(n: int = 3, **settings) -> tuple[OutlierPolicy, Clock, list]:
    clock, events = Clock(), []
    policy = OutlierPolicy(OutlierSettings(**settings), clock, events.append)
    for i in range(n):
        policy.add(f"r{i}")
    return policy, clock, events


def ids(policy: OutlierPolicy) -> list[str]:
    return list(policy.replicas)


def kinds(events, kind: str) -> list:
    return [e for e in events if e.kind == kind]


def answered(policy: OutlierPolicy, *names: str) -> None:
    for name in names:
        policy.report(name, S, ids(policy))


def timeouts(policy: OutlierPolicy, name: str, n: int) -> None:
    for _ in range(n):
        policy.report(name, T, ids(policy))


def streak(policy: OutlierPolicy, name: str, n: int = 3, witness: str = "r1") -> None:
    """n timeouts in a row, with ``witness`` answering after the first (the guard's
    "another ready replica has answered since the timeouts began")."""
    timeouts(policy, name, 1)
    answered(policy, witness)
    timeouts(policy, name, n - 1)


def test_threshold_ejects_at_consecutive_timeouts():
    policy, clock, events = make()
    answered(policy, "r1")
    timeouts(policy, "r0", 1)
    answered(policy, "r1")  # another replica answers after the timeouts began
    timeouts(policy, "r0", 1)
    assert policy.state_of("r0") != "ejected"
    timeouts(policy, "r0", 1)
    assert policy.state_of("r0") == "ejected"
    (ejected,) = kinds(events, "replica_ejected")
    assert ejected.ejection_ms == 30_000 and "3 consecutive timeouts" in ejected.reason


def test_zero_turns_ejection_off():
    policy, clock, events = make(consecutive_timeouts=0)
    timeouts(policy, "r0", 1)
    answered(policy, "r1")
    timeouts(policy, "r0", 10)
    assert policy.state_of("r0") != "ejected" and not kinds(events, "replica_ejected")


def test_success_resets_the_count():
    policy, clock, events = make()
    timeouts(policy, "r0", 2)
    answered(policy, "r0", "r1")
    timeouts(policy, "r0", 2)
    assert policy.replicas["r0"].consecutive_timeouts == 2
    assert not kinds(events, "replica_ejected")


@pytest.mark.parametrize("neutral", [Outcome.FAILURE, Outcome.CANCELLED, Outcome.REFUSED,
                                     Outcome.NEUTRAL])
def test_failure_cancel_refusal_neither_count_nor_reset(neutral):
    policy, clock, events = make()
    timeouts(policy, "r0", 1)
    answered(policy, "r1")
    timeouts(policy, "r0", 1)
    for _ in range(5):
        policy.report("r0", neutral, ids(policy))
    assert policy.replicas["r0"].consecutive_timeouts == 2
    assert not kinds(events, "replica_ejected")
    timeouts(policy, "r0", 1)
    assert policy.state_of("r0") == "ejected"


def test_release_after_cool_down_then_next_timeout_ejects_for_twice_as_long():
    policy, clock, events = make()
    streak(policy, "r0")
    assert policy.state_of("r0") == "ejected"
    clock.advance(29.9)
    policy.expire()
    assert policy.state_of("r0") in ("ejected", "backoff") and policy.replicas["r0"].ejected(
        clock.now)
    clock.advance(0.2)
    policy.expire()
    assert not policy.replicas["r0"].ejected(clock.now)
    (readmitted,) = kinds(events, "replica_readmitted")
    assert readmitted.reason == "cool-down ended"
    timeouts(policy, "r0", 1)  # its next timeout ejects it again
    second = kinds(events, "replica_ejected")[-1]
    assert policy.state_of("r0") == "ejected" and second.ejection_ms == 60_000


def test_ejection_time_grows_and_caps_at_max():
    policy, clock, events = make(base_ejection_ms=1000, max_ejection_ms=5000)
    times = []
    for _ in range(6):
        streak(policy, "r0") if not times else timeouts(policy, "r0", 1)
        times.append(kinds(events, "replica_ejected")[-1].ejection_ms)
        clock.advance(times[-1] / 1000 + 0.01)
        policy.expire()
    assert times == [1000, 2000, 4000, 5000, 5000, 5000]


def test_max_ejection_defaults_to_ten_times_base_at_most_an_hour_never_below_base():
    assert OutlierSettings(base_ejection_ms=30_000).max_ms == 300_000
    assert OutlierSettings(base_ejection_ms=1_000_000).max_ms == 3_600_000
    assert OutlierSettings(base_ejection_ms=5_000, max_ejection_ms=1_000).max_ms == 5_000


def test_success_readmits_at_once_and_starts_over():
    policy, clock, events = make()
    streak(policy, "r0")
    clock.advance(31)
    policy.expire()
    timeouts(policy, "r0", 1)  # second ejection: 60 s
    assert kinds(events, "replica_ejected")[-1].ejection_ms == 60_000
    clock.advance(1)
    policy.report("r0", S, ids(policy))  # e.g. an in-flight request answered
    assert not policy.replicas["r0"].ejected(clock.now)
    assert kinds(events, "replica_readmitted")[-1].reason == "successful answer"
    timeouts(policy, "r0", 1)
    answered(policy, "r1")
    timeouts(policy, "r0", 1)
    assert policy.state_of("r0") != "ejected"  # the count started over
    timeouts(policy, "r0", 1)
    assert kinds(events, "replica_ejected")[-1].ejection_ms == 30_000  # and the time too


def test_timeouts_while_ejected_do_not_extend_the_ejection():
    policy, clock, events = make()
    streak(policy, "r0")
    until = policy.replicas["r0"].ejected_until
    clock.advance(10)
    timeouts(policy, "r0", 5)  # requests that were in flight when it was ejected
    assert policy.replicas["r0"].ejected_until == until
    assert len(kinds(events, "replica_ejected")) == 1


def test_max_ejection_percent_holds_back_with_one_always_allowed():
    policy, clock, events = make(n=4)  # 50% of 4: two may be out
    for name in ("r0", "r1", "r2"):
        streak(policy, name, witness="r3")
    assert [policy.state_of(n) == "ejected" for n in ("r0", "r1", "r2")] == [True, True, False]
    withheld = kinds(events, "replica_ejection_withheld")[-1]
    assert withheld.replica_id == "r2" and "max_ejection_percent" in withheld.reason

    policy, clock, events = make(n=3, max_ejection_percent=0)  # 0%: one may still go
    streak(policy, "r0", witness="r2")
    streak(policy, "r1", witness="r2")
    assert policy.state_of("r0") == "ejected" and policy.state_of("r1") != "ejected"


def test_all_replicas_slow_at_once_keeps_them_all():
    policy, clock, events = make()
    answered(policy, "r0", "r1", "r2")
    clock.advance(0.01)
    for _ in range(5):
        for name in ids(policy):
            timeouts(policy, name, 1)
    assert all(policy.state_of(n) != "ejected" for n in ids(policy))
    assert kinds(events, "replica_ejection_withheld")
    assert all("no other ready replica has answered" in e.reason
               for e in kinds(events, "replica_ejection_withheld"))


def test_answer_from_a_replica_that_is_not_ready_does_not_count_for_the_guard():
    policy, clock, events = make()
    policy.report("r0", T, ["r0", "r1"])
    answered(policy, "r1")
    for _ in range(2):
        policy.report("r0", T, ["r0"])  # r1 answered, but it is no longer ready
    assert policy.state_of("r0") != "ejected"


def test_single_worker_is_never_ejected():
    policy, clock, events = make(n=1)
    timeouts(policy, "r0", 10)
    assert policy.state_of("r0") != "ejected"
    assert "single worker" in kinds(events, "replica_ejection_withheld")[0].reason


def test_ejected_replicas_serve_when_no_other_can():
    policy, clock, events = make(n=2)
    streak(policy, "r0")
    clock.advance(5)  # past the backoff, still ejected
    assert policy.dispatch_tiers(["r0", "r1"]) == [["r1"]]
    assert policy.dispatch_tiers(["r0"]) == [["r0"]]  # r1 is gone: the ejected one serves


def test_passing_health_ends_backoff_but_never_an_ejection():
    policy, clock, events = make()
    policy.report("r0", F, ids(policy))
    assert policy.state_of("r0") == "backoff"
    policy.probe_passed("r0")
    assert policy.state_of("r0") is None
    streak(policy, "r0")
    policy.probe_passed("r0")
    assert policy.state_of("r0") == "ejected"


def test_backoff_doubles_from_a_tenth_to_three_point_two_seconds_and_resets_on_success():
    policy, clock, events = make()
    steps = []
    for _ in range(8):
        policy.report("r0", F, ids(policy))
        steps.append(round(policy.replicas["r0"].backoff_until - clock.now, 3))
    assert steps == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 3.2, 3.2]
    assert policy.replicas["r0"].probe_due
    policy.report("r0", S, ids(policy))
    policy.report("r0", T, ids(policy))
    assert round(policy.replicas["r0"].backoff_until - clock.now, 3) == 0.1
    clock.advance(0.2)
    assert policy.replicas["r0"].probe_ready(clock.now)  # the backoff ran out: probe it
    assert policy.state_of("r0") == "backoff"  # and only a passing probe lets it back
    policy.probe_passed("r0")
    assert policy.state_of("r0") is None


def test_backed_off_replicas_serve_when_no_other_can():
    policy, clock, events = make(n=2)
    policy.report("r0", F, ids(policy))
    policy.report("r1", F, ids(policy))
    assert policy.dispatch_tiers(["r0", "r1"]) == [["r0", "r1"]]


# -- R5.5 (amended): whose deadline ran out decides backoff ---------------------------------

def test_a_callers_shorter_deadline_counts_but_causes_no_backoff():
    policy, _clock, events = make(3)
    answered(policy, "r1")
    for _ in range(2):
        policy.report("r0", Outcome.DEADLINE, ids(policy))
    assert policy.replicas["r0"].consecutive_timeouts == 2
    assert policy.state_of("r0") is None and not kinds(events, "replica_backoff")
    assert policy.dispatch_tiers(ids(policy)) == [["r0", "r1", "r2"]]


def test_caller_deadlines_reaching_the_threshold_eject_under_the_seeds_guards():
    policy, _clock, events = make(3)
    policy.report("r0", Outcome.DEADLINE, ids(policy))
    answered(policy, "r1")  # another ready replica answered since the timeouts began
    policy.report("r0", Outcome.DEADLINE, ids(policy))
    policy.report("r0", Outcome.DEADLINE, ids(policy))
    assert [e.replica_id for e in kinds(events, "replica_ejected")] == ["r0"]
    assert not kinds(events, "replica_backoff")


def test_a_timeout_past_the_deployments_limit_backs_off_and_says_so():
    policy, _clock, events = make(3)
    policy.report("r0", T, ids(policy))
    assert policy.state_of("r0") == "backoff"
    assert [e.reason.split(":")[0] for e in kinds(events, "replica_backoff")] == ["timeout"]


def test_a_request_never_sent_neither_counts_nor_resets():
    policy, _clock, events = make(3)
    timeouts(policy, "r0", 2)
    policy.report("r0", Outcome.NOT_SENT, ids(policy))
    assert policy.replicas["r0"].consecutive_timeouts == 2
    assert len(kinds(events, "replica_backoff")) == 2  # from the two timeouts only
