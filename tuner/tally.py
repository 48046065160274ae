"""What timed and checked what: the counts the report's ``learning`` section shows (R4.10),
kept by the tuner under its lock."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_srun.tuner.ledger import Refusal, Verdict


@dataclass
class Tally:
    forwards: int = 0  # served forwards whose count the tuner chose
    discarded: int = 0  # shadows whose time overlapped a served forward
    preempted: int = 0  # shadows whose threads waited for CPUs other tasks held
    uncovered: int = 0  # forwards kept at the configured count: the voucher lacks the shape
    frozen_beside: int = 0  # served forwards that froze a shadow sharing their cores
    served_samples: int = 0  # samples taken from served forwards
    explored: int = 0  # mode 2: forwards served at a vouched count to time it
    contended: int = 0  # mode 2: forwards served below the learned count: other tasks held
    # cores it needs (``samples.fastest_under``)
    samples_scaled: int = 0  # served samples divided by a load factor over 1: other tasks
    # held cores they needed (``samples.load_factor``)
    samples_cores_held: int = 0  # served samples not kept: half their time or more was
    # other tasks' (``samples.served_sample_ms``)
    beside: int = 0  # forwards served below the count wanted: the worker's other forwards
    # running at once held the cores (``AdaptiveThreads._beside_others``)
    not_solo: int = 0  # served forwards another served forward ran beside: no sample,
    # nothing the change detector watches
    behind: int = 0  # mode 2: forwards of an exploring range served at the fastest count
    # so far, not explored on: more rows waited than one forward takes (``Engine.behind``)
    waited: int = 0  # served forwards that waited for a paid shadow timing a count in their
    waited_s: float = 0.0  # place (``ShadowSteps.step``), and how long they waited in all

    def served(self, verdict: Verdict, contention: str | None, other: bool) -> None:
        """Why a served forward runs where it does: the ledger's ``verdict`` on the count
        chosen, ``contention``: "fallback" where the cores other tasks hold made a count below
        the learned one faster, ``other``: not the count its range's state wants."""
        self.forwards += 1
        if not verdict.allowed:
            self.uncovered += verdict.refusal is Refusal.UNCOVERED  # R4.8: the shape
        elif contention == "fallback":
            self.contended += 1
        elif other:
            self.explored += 1
