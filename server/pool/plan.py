"""The reconfiguration plan (R5.10): which replicas a new config keeps, which it starts fresh
and which it retires, as a pure function over snapshots of the old pool and the new config.

A deployment keeps its replicas only while its artifact, backend, engine arguments and
one-worker shorthand are unchanged; then each declared placement keeps an old replica of the
same placement (device or endpoint, and served model), in order, and the rest are fresh.
Every old replica not kept is retired (it drains before it stops).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Placement = tuple[str | None, str | None]  # (device or endpoint, attached model)


@dataclass(frozen=True)
class DeploymentShape:
    """What decides whether replicas can be kept: shared settings and the placements."""

    key: tuple          # artifact, backend, engine arguments, shorthand
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class Slot:
    """One replica of the new pool: an old one kept (``keep``) or a fresh one."""

    index: int          # the placement's index in the new config
    keep: str | None    # the kept replica's id, None = start a fresh replica


@dataclass(frozen=True)
class Plan:
    slots: Mapping[str, tuple[Slot, ...]]   # per deployment of the new config
    retired: tuple[str, ...]                # old replica ids not kept

    def kept(self) -> set[str]:
        return {s.keep for slots in self.slots.values() for s in slots if s.keep}


def plan(old: Mapping[str, tuple[DeploymentShape, Sequence[tuple[str, Placement]]]],
         new: Mapping[str, DeploymentShape]) -> Plan:
    """``old``: per deployment, its shape and its replicas as (id, placement)."""
    slots: dict[str, tuple[Slot, ...]] = {}
    for name, shape in new.items():
        before = old.get(name)
        reusable = list(before[1]) if before is not None and before[0].key == shape.key else []
        out = []
        for index, placement in enumerate(shape.placements):
            match = next((rid for rid, p in reusable if p == placement), None)
            if match is not None:
                reusable = [(rid, p) for rid, p in reusable if rid != match]
            out.append(Slot(index, match))
        slots[name] = tuple(out)
    chosen = Plan(slots, ())
    kept = chosen.kept()
    retired = tuple(rid for _shape, replicas in old.values() for rid, _p in replicas
                    if rid not in kept)
    return Plan(slots, retired)
