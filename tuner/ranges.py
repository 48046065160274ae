"""One size range's learning as an explicit state machine (R4.5, R4.6, R4.11), and the states
the report shows (R4.10).

A range's own ``Phase`` moves only through the functions here:

    EXPLORING --learned--> LEARNED     (mode 1, or the configured count won)
              \\-learned--> VERIFYING   (mode 2, another count won) --window passed--> SERVING
    SERVING --voucher withdrawn--> VERIFYING --vouched again, window passed--> SERVING
    LEARNED | VERIFYING | SERVING --its time moved (R4.11)--> RELEARNING --learned--> ...

RELEARNING explores like EXPLORING (fresh samples), and may keep serving the count it had
verified meanwhile (``keep_serving``). Whether a count's transition window has passed, and
whether an answer may be served at a count at all, is the exactness ledger's to say
(``ledger.ExactnessLedger``); the phase records what the ledger last said, so the report and
``served_threads`` read one state. Host-wide states (locked before the golden check, retired
by drift, mode 2 without a voucher) are the ledger's too: ``report_state`` combines both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm_srun.runtime.sizes import size_range
from vllm_srun.tuner.samples import at_size


class RangeState(enum.StrEnum):
    """What the report (``GET /v1/threads``, ``vllm-srun threads report``) and the metrics
    call a range's verification state."""

    LOCKED = "locked-before-golden"
    EXPLORING = "exploring"
    LEARNED = "learned"
    VERIFYING = "verifying"  # mode 2: learned, inside its transition window
    SERVING = "serving-learned"
    NO_VOUCHER = "no-voucher"  # mode 2 without a voucher acts as mode 1
    RETIRED = "retired-by-drift"
    RELEARNING = "relearning"


class Phase(enum.StrEnum):
    """A range's own state (host-wide states are the ledger's)."""

    EXPLORING = "exploring"
    RELEARNING = "relearning"
    LEARNED = "learned"  # answers stay at the configured count (mode 1, or it won)
    VERIFYING = "verifying"
    SERVING = "serving"


@dataclass
class RangeLearning:
    phase: Phase = Phase.EXPLORING
    samples: dict[int, list[float]] = field(default_factory=dict)  # count -> forward ms
    tokens: dict[int, list[int]] = field(default_factory=dict)  # count -> padded tokens
    # of each sample; the size exponent the range was learned with (``samples.at_size``)
    exponent: float = 1.0
    learned: int | None = None
    relearns: int = 0
    keep_serving: int | None = None  # relearning: the verified count served meanwhile
    served_at_learned: int = 0
    # R4.11: (count, "shadow" | "served") -> ms at the range's smallest size when learned,
    # and since
    baselines: dict[tuple[int, str], float] = field(default_factory=dict)
    recent: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    explore_served: bool = False  # mode 2, vouched: its own served forwards time each count
    # R4.12: a live sibling's learned count this range times against the configured one
    # instead of exploring every count (None: it explores them all), and the sibling counts
    # its own timing rejected (``learning.Learner.adopt``)
    candidate: int | None = None
    rejected: set[int] = field(default_factory=set)
    # R4.12: count -> forwards this range explored it on that the host's core ledger served
    # below it (``estimator.out_of_reach``)
    refused: dict[int, int] = field(default_factory=dict)
    # count -> the first and the latest of this range's forwards that found other tasks'
    # load keeping it from being tried, with none between that found its cores left (mode 2)
    held: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def learned_from(self) -> str | None:
        """Where the learned count came from: "sibling" (a live sibling's count, confirmed
        by this worker's own samples), "own" (its own exploration), None (none learned)."""
        if self.learned is None:
            return None
        return "sibling" if self.learned == self.candidate else "own"

    @property
    def exploring(self) -> bool:
        return self.phase in (Phase.EXPLORING, Phase.RELEARNING)

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING

    @property
    def relearning(self) -> bool:
        return self.phase is Phase.RELEARNING


def sized(r: RangeLearning) -> dict[int, list[float]]:
    """Range ``r``'s samples as forwards of its smallest size (``samples.at_size``: its
    sizes differ up to 2x, and its forwards' times with them): what its counts are
    compared by."""
    some = next((v[0] for v in r.tokens.values() if v), 1)
    return at_size(r.samples, r.tokens, size_range(some)[0])


def learn(r: RangeLearning, count: int, configured: int, serve_mode: bool,
          may_serve: bool) -> None:
    """EXPLORING | RELEARNING -> LEARNED | VERIFYING | SERVING: ``count`` won. ``may_serve``:
    the ledger admits ``count`` for this range already (its window passed, vouched)."""
    r.learned = count
    if count == configured or not serve_mode:
        r.phase, r.keep_serving = Phase.LEARNED, None
    elif may_serve:
        r.phase, r.keep_serving = Phase.SERVING, None
    else:
        r.phase = Phase.VERIFYING  # keeps serving ``keep_serving`` meanwhile, if any


def settle(r: RangeLearning, may_serve: bool) -> bool:
    """VERIFYING <-> SERVING as the ledger now says of the learned count (its window, the
    voucher). Returns whether the range started serving it."""
    if r.phase is Phase.VERIFYING and may_serve:
        r.phase, r.keep_serving = Phase.SERVING, None
        return True
    if r.phase is Phase.SERVING and not may_serve:
        r.phase = Phase.VERIFYING
    return False


def relearn(r: RangeLearning, keep_serving: int | None) -> RangeLearning:
    """-> RELEARNING: a fresh range that explores again, serving ``keep_serving`` (a count
    the ledger admitted) meanwhile, or the configured count."""
    return RangeLearning(phase=Phase.RELEARNING, relearns=r.relearns + 1,
                         keep_serving=keep_serving)


def wanted_count(r: RangeLearning | None, configured: int) -> int:
    """The count the range would serve, before the ledger's say."""
    if r is None:
        return configured
    if r.phase is Phase.SERVING and r.learned is not None:
        return r.learned
    return r.keep_serving or configured


def report_state(r: RangeLearning, locked: bool, retired: bool, no_voucher: bool) -> RangeState:
    """The state the report shows: host-wide ones (the ledger's) first, then the phase.
    ``no_voucher``: mode 2 and the voucher does not cover the learned count."""
    if retired:
        return RangeState.RETIRED
    if locked:
        return RangeState.LOCKED
    if r.phase is Phase.EXPLORING:
        return RangeState.EXPLORING
    if r.phase is Phase.RELEARNING:
        return RangeState.RELEARNING
    if r.phase is Phase.LEARNED:
        return RangeState.LEARNED
    if no_voucher:
        return RangeState.NO_VOUCHER
    return RangeState.SERVING if r.phase is Phase.SERVING else RangeState.VERIFYING
