"""Outlier ejection and short backoff (R5.5, R5.6): pure policy with an injected clock.

The pool reports each exchange's outcome here and asks who may take requests; nothing in this
module does I/O, so every rule of the seed is tested with a fake clock
(``tests/test_outlier.py`` ports the scenario matrix of Envoy's outlier-detection tests).

Rules, as the seed states them:

- Per replica, count the exchanges in a row that ran out of their deadline (the caller's or
  the deployment's ``timeout_ms``). A cancellation, a refused request or a failure neither
  counts nor resets the count; a successful answer starts it again. A request whose deadline
  passed before it reached the replica is no exchange: it neither counts nor resets.
- Only an exchange past the deployment's ``timeout_ms``, or a failure, also takes the replica
  out of dispatch for a short backoff (0.1 s, doubling to 3.2 s), after which its ``/health``
  is probed; it returns to dispatch when the probe passes (a failed probe is a failure: the
  next, longer backoff). An exchange past a caller's own shorter deadline counts, but causes
  no backoff (R5.5).
- Reaching ``consecutive_timeouts`` ejects the replica for ``base_ejection_ms``; each further
  ejection lasts twice as long, up to ``max_ejection_ms``. After the cool-down the replica
  returns, and its next timeout ejects it again (for twice as long). A successful answer
  readmits it at once and starts over. A passing ``/health`` never readmits early.
- An ejection is withheld (and logged with the reason) when the deployment has one worker,
  when no other ready replica has answered since this replica's timeouts began (a model slow
  on every replica keeps them all), or when ``max_ejection_percent`` of the replicas are
  already out (one may always be).
- If no other replica can take requests, ejected ones serve again (the pool's dispatch does
  this through :meth:`OutlierPolicy.dispatch_tiers`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vllm_srun.server.pool.backoff import REPLICA_BACKOFF
from vllm_srun.server.pool.states import ReplicaState

log = logging.getLogger("vllm_srun.pool")



class Outcome(enum.StrEnum):
    SUCCESS = "success"        # an answer within the deadline
    TIMEOUT = "timeout"        # the exchange ran past the deployment's timeout_ms
    DEADLINE = "deadline"      # the exchange ran past the caller's own shorter deadline
    FAILURE = "failure"        # the worker failed (connection lost, 5xx, crash)
    REFUSED = "refused"        # the worker refused (its own overload, not ready)
    CANCELLED = "cancelled"    # the caller went away
    NEUTRAL = "neutral"        # answered with a client error (bad input): says nothing
    NOT_SENT = "not_sent"      # the deadline passed before the request reached the replica


@dataclass(frozen=True)
class OutlierSettings:
    consecutive_timeouts: int = 3
    base_ejection_ms: int = 30_000
    max_ejection_ms: int | None = None   # default 10 x base, capped at one hour
    max_ejection_percent: int = 50

    @property
    def max_ms(self) -> int:
        cap = self.max_ejection_ms if self.max_ejection_ms is not None \
            else min(10 * self.base_ejection_ms, 3_600_000)
        return max(cap, self.base_ejection_ms)


@dataclass
class ReplicaHealth:
    """What the policy knows about one replica."""

    replica_id: str
    consecutive_timeouts: int = 0
    timeouts_began: float | None = None   # when the current run of timeouts started
    last_success: float | None = None
    ejections: int = 0                     # ejections since the last success (sets the time)
    ejected_until: float | None = None
    backoff_s: float = 0.0                 # the current backoff step (0 = none yet)
    backoff_until: float | None = None
    total_ejections: int = 0
    total_readmissions: int = 0
    probe_due: bool = False

    def ejected(self, now: float) -> bool:
        return self.ejected_until is not None and now < self.ejected_until

    def backing_off(self, now: float) -> bool:
        """Out of dispatch after a timeout or failure: for the backoff, and then until a
        ``/health`` probe passes."""
        return self.probe_due or (self.backoff_until is not None and now < self.backoff_until)

    def probe_ready(self, now: float) -> bool:
        """A probe is due now: the backoff ran out, or the replica was just ejected (probed
        at once)."""
        return self.probe_due and (self.ejected(now) or self.backoff_until is None
                                   or now >= self.backoff_until)


@dataclass(frozen=True)
class Event:
    kind: str  # replica_ejected | replica_readmitted | replica_ejection_withheld | replica_backoff
    replica_id: str
    at: float
    reason: str
    ejection_ms: int | None = None


@dataclass
class OutlierPolicy:
    """Ejection and backoff state of one deployment's replicas."""

    settings: OutlierSettings
    clock: Callable[[], float]
    on_event: Callable[[Event], None] = lambda _e: None
    replicas: dict[str, ReplicaHealth] = field(default_factory=dict)

    def add(self, replica_id: str) -> ReplicaHealth:
        return self.replicas.setdefault(replica_id, ReplicaHealth(replica_id))

    def remove(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    # -- outcomes -------------------------------------------------------------------------

    def report(self, replica_id: str, outcome: Outcome, ready: Iterable[str] = ()) -> None:
        """Record one exchange's outcome. ``ready`` names the replicas now ready (for the
        "another ready replica has answered" guard)."""
        h = self.replicas.get(replica_id)
        if h is None:
            return
        now = self.clock()
        self.expire(now)
        if outcome is Outcome.SUCCESS:
            h.consecutive_timeouts, h.timeouts_began, h.last_success = 0, None, now
            h.ejections, h.backoff_s, h.backoff_until = 0, 0.0, None
            if h.ejected_until is not None:
                self._readmit(h, now, "successful answer")
            return
        if outcome in (Outcome.TIMEOUT, Outcome.FAILURE):
            self._backoff(h, now, outcome)
        if outcome not in (Outcome.TIMEOUT, Outcome.DEADLINE):
            return
        if h.consecutive_timeouts == 0:
            h.timeouts_began = now
        h.consecutive_timeouts += 1
        threshold = self.settings.consecutive_timeouts
        if threshold and h.consecutive_timeouts >= threshold and not h.ejected(now):
            self._maybe_eject(h, now, set(ready))

    def _backoff(self, h: ReplicaHealth, now: float, outcome: Outcome) -> None:
        h.backoff_s = REPLICA_BACKOFF.next(h.backoff_s)
        h.backoff_until = now + h.backoff_s
        h.probe_due = True
        self._emit(Event("replica_backoff", h.replica_id, now,
                         f"{outcome.value}: out of dispatch for {h.backoff_s:g} s, then a "
                         f"/health probe"), level=logging.INFO)

    def _maybe_eject(self, h: ReplicaHealth, now: float, ready: set[str]) -> None:
        n = len(self.replicas)
        if n <= 1:
            return self._withhold(h, now, "single worker: a one-worker deployment is never "
                                          "ejected")
        began = h.timeouts_began if h.timeouts_began is not None else now
        answered = [o for o in self.replicas.values()
                    if o is not h and o.replica_id in ready and not o.ejected(now)
                    and o.last_success is not None and o.last_success >= began]
        if not answered:
            return self._withhold(h, now, "no other ready replica has answered since this "
                                          "replica's timeouts began")
        out = sum(1 for o in self.replicas.values() if o.ejected(now))
        allowed = max(1, n * self.settings.max_ejection_percent // 100)
        if out >= allowed:
            return self._withhold(h, now, f"max_ejection_percent: {out} of {n} replicas "
                                          f"already ejected (at most {allowed})")
        ms = min(self.settings.base_ejection_ms * 2 ** h.ejections, self.settings.max_ms)
        h.ejections += 1
        h.total_ejections += 1
        h.ejected_until = now + ms / 1000
        h.probe_due = True
        self._emit(Event("replica_ejected", h.replica_id, now,
                         f"{h.consecutive_timeouts} consecutive timeouts", ms))

    def _withhold(self, h: ReplicaHealth, now: float, reason: str) -> None:
        self._emit(Event("replica_ejection_withheld", h.replica_id, now, reason))

    def _readmit(self, h: ReplicaHealth, now: float, reason: str) -> None:
        h.ejected_until = None
        h.total_readmissions += 1
        self._emit(Event("replica_readmitted", h.replica_id, now, reason))

    def _emit(self, event: Event, level: int = logging.WARNING) -> None:
        log.log(level, "%s replica=%s reason=%r%s", event.kind, event.replica_id, event.reason,
                    f" ejection_ms={event.ejection_ms}" if event.ejection_ms else "")
        self.on_event(event)

    # -- time -----------------------------------------------------------------------------

    def expire(self, now: float | None = None) -> None:
        """Readmit replicas whose cool-down has ended. Their timeout count is kept, so their
        next timeout ejects them again, for twice as long."""
        now = self.clock() if now is None else now
        for h in self.replicas.values():
            if h.ejected_until is not None and now >= h.ejected_until:
                self._readmit(h, now, "cool-down ended")

    def probe_passed(self, replica_id: str) -> None:
        """A passing ``/health`` ends a backoff, never an ejection."""
        h = self.replicas.get(replica_id)
        if h is not None:
            h.backoff_until = None
            h.probe_due = False

    # -- dispatch -------------------------------------------------------------------------

    def dispatch_tiers(self, ready: Iterable[str]) -> list[list[str]]:
        """Ready replicas in the order dispatch may use them: first those neither ejected nor
        backing off; if there are none, the rest (ejected or backing off replicas serve again
        when no other replica can take requests)."""
        now = self.clock()
        self.expire(now)
        first, rest = [], []
        for rid in ready:
            h = self.replicas.get(rid)
            if h is not None and (h.ejected(now) or h.backing_off(now)):
                rest.append(rid)
            else:
                first.append(rid)
        return [first] if first else [rest]

    def state_of(self, replica_id: str) -> ReplicaState | None:
        """``ejected``, ``backoff`` or None (for inventory)."""
        h = self.replicas.get(replica_id)
        if h is None:
            return None
        now = self.clock()
        if h.ejected(now):
            return ReplicaState.EJECTED
        if h.backing_off(now):
            return ReplicaState.BACKOFF
        return None
