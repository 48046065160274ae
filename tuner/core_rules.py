"""The rules by which the workers of one host share its cores (R4.12; the ledger that applies
them: ``cores.py``): which count a worker may serve beside the others' (``grant``), how many
threads the workers may serve together (``room``), and the threads policy that claims each
served forward's count (``SharedCores``). Pure functions but the last; no clock, no file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from vllm_srun.runtime.types import ForwardResult, TokenBatch

if TYPE_CHECKING:
    from vllm_srun.tuner.cores import CoreShare

# Cores other tasks hold count to within this much of a core (``room``): a quiet 2-core
# host's 0.1-s windows read 0-0.11 cores held, the front end and the client under load a
# few tenths, one CPU-bound process 0.9-1.1 (tuner/free_cpus.py): half a core keeps the
# first two from costing a worker a thread and takes one off for the third. A guess, not
# swept.
HELD_SLACK = 0.5


def fair_share(budget: int, workers: int) -> int:
    """The threads each of ``workers`` live workers would have with ``budget`` split evenly
    among them, at least 1."""
    return max(1, budget // max(1, workers))


def grant(want: int, floor: int, in_use_by_others: int, idle_others: int, budget: int,
          lower: Sequence[int] = (), share: int = 1) -> int:
    """The count a worker may serve: ``want`` where the other workers' threads plus it, plus
    ``share`` threads for each other worker that runs nothing now (``idle_others``: it may
    start a forward any moment; the caller passes ``fair_share`` of the budget), stay
    within ``budget``; else the largest count below it that does, of ``lower`` (counts that
    answer as ``want`` does: mode 2's vouched counts for the shape) and ``floor`` (the
    configured count, exact at every vouched count), else the smallest of them. With
    nothing below ``want`` to serve instead (``want`` at most ``floor``, no ``lower``),
    ``want``: the configured count and those below it are never refused for want of
    another.

    Why an idle worker keeps its fair share rather than one thread: speed-ups are concave
    in the count, and with one thread kept for it the workers that claimed first took 8
    threads each while the neighbour held half the cores, leaving the others 1 or 2 where a
    fixed 4 gave each 4 (simulated, 64 cores, 8 workers); a forward that starts on an idle
    worker now finds its share, and a busy worker may still take what busy workers below
    their share leave. Where counts above a share were refused while a range explored,
    they are out of its reach (``estimator.out_of_reach``) and it learns among the rest."""
    taken = in_use_by_others + idle_others * share
    if taken + want <= budget:
        return want
    below = sorted({n for n in (*lower, floor) if n < want}, reverse=True)
    if not below:
        return want
    return next((n for n in below if taken + n <= budget), below[-1])


def room(budget: int, held: float | None, slack: float = HELD_SLACK) -> int:
    """The threads the workers may serve together: ``budget`` less the cores other tasks
    ``held`` (to within ``slack`` of a core), at least 1; ``budget`` where unread."""
    if held is None:
        return budget
    return max(1, min(budget, math.floor(budget - held + slack)))


class ThreadsPolicy(Protocol):  # runtime.engine.ThreadsPolicy, restated to stay a seam
    def served_threads(self, batch: TokenBatch) -> int: ...

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None: ...

    def close(self) -> None: ...


class SharedCores:
    """A worker's threads policy with its served counts held in the host's ledger: a count
    that does not fit serves the largest below it that does and answers the same (the
    policy's ``lower_counts``, where it has them: mode 2's vouched counts for the shape;
    the configured count)."""

    def __init__(self, policy: ThreadsPolicy, share: CoreShare, configured: int) -> None:
        self.policy, self.share, self.configured = policy, share, configured
        self.limited = 0  # forwards served below the count their policy wanted
        self._lower = getattr(policy, "lower_counts", None)

    def served_threads(self, batch: TokenBatch) -> int:
        want = self.policy.served_threads(batch)
        lower = self._lower(batch, want) if self._lower is not None else ()
        granted = self.share.claim(want, self.configured, lower)
        self.limited += granted != want
        return granted

    def observe(self, batch: TokenBatch, result: ForwardResult | None) -> None:
        self.share.release()
        self.policy.observe(batch, result)

    def close(self) -> None:
        try:
            self.policy.close()
        finally:
            self.share.close()
