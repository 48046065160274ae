"""The tuner's settings (R4.5-R4.7, R4.11): every knob of adaptive threads, each with its
default and why, in four groups, one per part that reads them (``Learning``: the estimator
and the ledger's window; ``Spending``: what shadows may take; ``Gaps``: when an idle-class
shadow may start; ``Contention``: the cores other tasks leave). A value chosen from one run on
one host is a guess and says so.

``TunerSettings.of`` takes any knob by its flat name (``of(min_samples=3, busy_max=1.0,
contention_free_window_s=0.2)``) and ``with_`` replaces some of them: tests and the sweep name a
knob without its group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from vllm_srun.tuner.share import DEFAULT_SHARE


# Swept on the simulated host (``python -m bench.tuner_sweep``, ``bench/results/
# tuner_sweep.json``: 6 seeds per value, 2 cores quiet, 2 cores beside a neighbour, 16 cores
# with two workers; ``retry_backoff_max_s`` on 64 cores too, ``tuner_sweep_64.json``):
# ``min_samples``, ``window``, ``margin``, ``audit_every``, ``relearn_factor``,
# ``max_samples``, ``budget_fraction``, ``starved_s``, ``retry_backoff_max_s``.
# ``budget_fraction`` 0.25 resolved worse on 2 cores. ``min_samples`` 4 resolved better on 2
# cores (0.93x the default's latency) and 16 cores (0.83x), not beside the neighbour (1.06x,
# interval 0.85-1.25): at 4 samples the estimator's interval is every sample, and the real
# host's noise (+-30%) is wider than the simulator's. Run at 4 on the real host (mode 1 out
# of the box, 60% load, one run) it decided every range by 45 s where 12 took 151 s, but
# kept 1 thread in every range where 2 threads' medians were 9-17% lower: four samples
# beside the load spread past the margin. So 12 stays. No other value resolved either way.
# ``held_out_s`` (12 seeds, 16 cores and 2 cores beside a neighbour,
# ``bench/results/tuner_sweep_held_out.json``): 2.5 s resolved worse beside the 2-core
# neighbour (it holds a core 2 s of every 4, and 2 threads were dropped for good); 20 s
# resolved better than never on 16 cores and was even beside the 2-core neighbour.
@dataclass(frozen=True)
class Learning:
    min_samples: int = 12  # clean timed shadows per count per range before a count is learned
    window: int = 8  # mode 2: consecutive verified shadows before a learned count serves
    margin: float = 0.05  # a non-configured count must be this much faster
    audit_every: int = 8  # every Nth forward of a learned range: a probe (and audit) shadow
    relearn_factor: float = 1.5  # time at the learned count moved this much: explore again
    relearn_window: int = 16  # served forwards at one count each relearning check rests on
    probe_window: int = 4  # probe shadows at one count each relearning check rests on
    # recent samples per count per range that decisions rest on: an unsure decision takes
    # samples up to it, then the medians decide (``estimator.choose``)
    max_samples: int = 48
    # mode 2 exploring on served forwards: a count the cores other tasks hold kept from
    # being tried (``samples.load_factor`` 2 or more) for this long is out of the range's
    # reach, with every count above it (``estimator.out_of_reach``)
    held_out_s: float = 20.0


@dataclass(frozen=True)
class Spending:
    budget_fraction: float = 0.5  # shadow time at most this share of wall time
    # ... of which idle time banks at most this long's worth: over any stretch, shadows
    # take at most ``budget_fraction`` of it plus ``budget_fraction * budget_window_s``
    # (5 s at 0.5; a back-to-back burst after an idle stretch: 10 s at most). Unbanked, an
    # idle hour let half an hour of shadows run in one go. A guess, not swept: a few of the
    # longest shadows (the longest L6 inputs run about a second at 1 thread, FACTS.md) or
    # a whole transition window of short ones fit in it, so a lull after load still
    # passes a range's window in one go
    budget_window_s: float = 10.0
    # R4.5 amended: where no idle CPU comes, learning takes at most this share of served
    # forward time (``share.PaidShare``; ``--learning-share``)
    learning_share: float = DEFAULT_SHARE
    # ... for a due shadow (mode 2's window, or timing a count mode 1 lacks samples of) of a
    # range that made no progress in this long: the gaps of Poisson traffic at half of
    # capacity are tens of ms, so a second without one that lets it run is no idle CPU; short
    # against the two minutes in which learning must complete (swept: see above)
    starved_s: float = 1.0
    # a served batch whose shadow a served forward overlapped (no sample) goes back on the
    # board, its next try 0.1 s later, twice as long with each more, up to this: tried again
    # in every gap, a rare range's few batches ran without end on a busy host (the simulated
    # 64-core host: 5 of its 64 cores on the shadows of 7 batches); dropped after a few
    # tries instead, a range only load reaches went unlearned once the load eased (swept:
    # see above; 0 tries again at once)
    retry_backoff_max_s: float = 8.0


@dataclass(frozen=True)
class Gaps:
    quiet_max_s: float = 1.0  # the most idle time a core-sharing shadow waits for (_quiet_s)
    # ... which halves each this many seconds too: gaps shorter than it, always, would
    # otherwise keep every such shadow out for good (mode 1 under steady 35-ms gaps, after
    # a few shadows were cut into: 17 comparisons in 30 s, none timed)
    quiet_halflife_s: float = 1.0
    # core-sharing shadows whose threads waited for CPUs other tasks held, this many in a
    # row: the next starts 0.1 s after, doubling with each more up to ``held_backoff_max_s``
    # (a clean one ends the run): an idle worker retrying at once beside another busy
    # server cost that one's forwards 15-20%. Not after one alone: on 2 cores the frontend
    # and the client hold a CPU in part of each gap, and backing off after each such one
    # kept mode 1 from timing 2 threads at all under steady traffic
    held_streak: int = 3
    # ... but after one alone where its threads waited this share of its time or more: a
    # CPU-bound task held a CPU throughout (over 1.0 beside one such process here). Retried
    # up to the streak beside a neighbour on one core half the time, mode 2 froze 705 shadows
    # for served forwards in a 5-minute bench section; with this, 317 (one run each; the
    # backoff after every held-up one: 47)
    held_hog: float = 0.5
    held_backoff_max_s: float = 8.0
    # a shadow that waits for a gap starts only while served forwards took at most this
    # share of the last ``busy_window_s`` seconds
    busy_max: float = 0.3
    busy_window_s: float = 1.0
    thaw_hold_s: float = 0.005  # a frozen shadow side stays so this long at most after a
    # served forward ends (twice the recent idle gaps): back-to-back forwards, one freeze


@dataclass(frozen=True)
class Contention:
    """The cores other tasks leave a worker, an input to the estimate (R4.13,
    ``contention.FreeCores``). Flat names (``TunerSettings.of``) carry the prefix
    ``contention_``."""

    # the free cores are read over windows of at least this long: a few forwards of the
    # default model, so a neighbour's change shows in the next; shorter windows read the
    # kernel's time slices (``FreeCpus`` reads every 0.05 s, half of it). A guess, not swept
    free_window_s: float = 0.1


_GROUPS = {"learning": (Learning, ""), "spending": (Spending, ""), "gaps": (Gaps, ""),
           "contention": (Contention, "contention_")}


@dataclass(frozen=True)
class TunerSettings:
    learning: Learning = field(default_factory=Learning)
    spending: Spending = field(default_factory=Spending)
    gaps: Gaps = field(default_factory=Gaps)
    contention: Contention = field(default_factory=Contention)
    flush_s: float = 2.0  # how often learnings are written to the record
    watch_s: float = 0.5  # how often drift and the voucher are read back from the record
    background: bool = True  # run shadows on the tuner's own idle thread (tests step by hand)
    # without ``background``: a paid shadow that times a count still holds the served
    # forwards' place where the caller asks (``place_held_until``) before it starts each
    # served forward, as the simulator's event loop does (tests that step by hand do not)
    hold_place: bool = False

    @classmethod
    def of(cls, **knobs) -> TunerSettings:
        """Settings with ``knobs`` named flat (a group's field, ``contention_`` before a
        contention knob), the rest at their defaults; TypeError names an unknown knob."""
        return cls().with_(**knobs)

    def with_(self, **knobs) -> TunerSettings:
        """These settings with ``knobs`` (flat names, as ``of``) replaced."""
        own, groups = {}, {}
        for knob, v in knobs.items():
            group, name = _where(knob)
            (groups.setdefault(group, {}) if group else own)[name] = v
        return replace(self, **own, **{g: replace(getattr(self, g), **kv)
                                       for g, kv in groups.items()})

    def value(self, knob: str):
        """A knob's value by its flat name (``of``); TypeError names an unknown one."""
        group, name = _where(knob)
        return getattr(getattr(self, group) if group else self, name)


def _where(knob: str) -> tuple[str | None, str]:
    """The group (None: ``TunerSettings`` itself) and field a flat knob name means."""
    if knob in ("flush_s", "watch_s", "background", "hold_place"):
        return None, knob
    for group, (kind, prefix) in _GROUPS.items():
        name = knob.removeprefix(prefix)
        if knob.startswith(prefix) and name in {f.name for f in fields(kind)}:
            return group, name
    raise TypeError(f"unknown tuner setting: {knob}")
