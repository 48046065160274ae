"""What timed and checked what: the counts the report's ``learning`` section shows (R4.10),
kept by the tuner under its lock."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_srun.tuner.ledger import Refusal, Verdict


@dataclass
class Tally:
    discarded: int = 0  # shadows whose time overlapped a served forward
    preempted: int = 0  # shadows whose threads waited for CPUs other tasks held
    uncovered: int = 0  # forwards kept at the configured count: the voucher lacks the shape
    frozen_beside: int = 0  # served forwards that froze a shadow sharing their cores
    served_samples: int = 0  # samples taken from served forwards
    explored: int = 0  # mode 2: forwards served at a vouched count to time it
    contended: int = 0  # mode 2: forwards served below the learned count under contention
    contention_probes: int = 0  # ... and at the learned count meanwhile, to see it end
    samples_cores_busy: int = 0  # served samples not kept: other tasks held their cores

    def served(self, verdict: Verdict, contention: str | None, other: bool) -> None:
        """Why a served forward runs where it does: the ledger's ``verdict`` on the count
        chosen, contention's reason, ``other``: not the count its range's state wants."""
        if not verdict.allowed:
            self.uncovered += verdict.refusal is Refusal.UNCOVERED  # R4.8: the shape
        elif contention == "fallback":
            self.contended += 1
        elif contention == "probe":
            self.contention_probes += 1
        elif other:
            self.explored += 1
