"""The voucher sweep (R4.8 amended): every forward shape the engine can run, at every allowed
count, compared bit for bit with the configured count's answer.

A shape is rows x padded length, as ``runtime.batching.next_batch`` forms it: at most
``max_rows`` rows (``max_num_seqs``), a padded length up to the model's limit, and at most
``max_padded`` padded tokens (``max_num_batched_tokens``) unless the forward is one row.
With ``grid``, only the lengths on the grid a mode 2 engine pads to the shapes no sweep
covers (``runtime.sizes.grid_length``): a third of the shapes, whose workers then pad.
Every shape up to ``EXHAUSTIVE_PADDED`` padded tokens is swept; above it, where shapes are
many and forwards long, a stratified sample: per stratum (size range of padded tokens x
power-of-two row count) its largest shape, its smallest and ``per_stratum - 2`` drawn at
random (seeded). The ``Coverage`` the sweep returns says which, and mode 2 serves a learned
count only for counts and shapes inside it.

A sweep may also stop early (``until``: a time budget, a number of shapes): it then vouches
for no bounds, only for the shapes it compared, each recorded one by one as it goes
(``on_shape``), as traffic's shadows record theirs. ``order_shapes`` puts the size ranges
traffic reached first, so a bounded sweep spends its time where forwards are served.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from vllm_srun.records.host_record import Coverage
from vllm_srun.runtime.batching import length_bucket
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.sizes import GRID_SHIFT, on_grid, size_range
from vllm_srun.runtime.types import ForwardResult, TokenBatch
from vllm_srun.tuner.ledger import output_bits

EXHAUSTIVE_PADDED = 1024  # every shape up to this many padded tokens is swept
PER_STRATUM = 3  # shapes sampled per stratum above it

Shape = tuple[int, int]  # (rows, padded length)


@dataclass(frozen=True)
class ShapeBounds:
    """The shapes an engine can run: its batch limits and the model's length limit."""

    max_rows: int
    max_len: int
    max_padded: int
    min_len: int = 2  # a tokenized input has at least its two special tokens
    grid: bool = False  # padded lengths on the length grid only (``threads verify --grid``)

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_len", "max_padded", "min_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, not {getattr(self, name)}")
        if self.min_len > self.max_len:
            raise ValueError(f"min_len {self.min_len} is above max_len {self.max_len}")

    def shapes(self) -> list[Shape]:
        """Every shape within the bounds, smallest first."""
        lengths = [n for n in range(self.min_len, self.max_len + 1)
                   if not self.grid or on_grid(n, self.max_len)]
        out = [(rows, length) for rows in range(1, self.max_rows + 1) for length in lengths
               if rows == 1 or rows * length <= self.max_padded]
        return sorted(out, key=lambda s: (s[0] * s[1], s))


@dataclass(frozen=True)
class SweepPlan:
    bounds: ShapeBounds
    shapes: list[Shape]  # to sweep, smallest first
    exhaustive_padded: int
    sampled: int
    above: int

    def coverage(self, counts: tuple[int, ...]) -> Coverage:
        b = self.bounds
        return Coverage(tuple(sorted(counts)), b.max_rows, b.min_len, b.max_len, b.max_padded,
                        self.exhaustive_padded, len(self.shapes), self.sampled, self.above,
                        GRID_SHIFT if b.grid else None)


def plan_sweep(bounds: ShapeBounds, exhaustive_padded: int = EXHAUSTIVE_PADDED,
               per_stratum: int = PER_STRATUM, seed: int = 0) -> SweepPlan:
    shapes = bounds.shapes()
    small = [s for s in shapes if s[0] * s[1] <= exhaustive_padded]
    large = [s for s in shapes if s[0] * s[1] > exhaustive_padded]
    strata: dict[tuple[int, int], list[Shape]] = {}
    for s in large:
        strata.setdefault((size_range(s[0] * s[1])[0], size_range(s[0])[0]), []).append(s)
    rng = np.random.default_rng(seed)
    chosen: set[Shape] = set()
    for members in strata.values():
        members.sort(key=lambda s: (s[0] * s[1], s))
        picks = {members[-1], members[0]} if per_stratum >= 2 else {members[-1]}
        rest = [s for s in members if s not in picks]
        for i in rng.permutation(len(rest))[: max(0, per_stratum - len(picks))]:
            picks.add(rest[int(i)])
        chosen |= picks
    sampled = sorted(chosen, key=lambda s: (s[0] * s[1], s))
    return SweepPlan(bounds, small + sampled, exhaustive_padded, len(sampled), len(large))


def shape_batch(shape: Shape, rng: np.random.Generator) -> TokenBatch:
    """A batch of this shape as the engine forms one: the first row has the padded length,
    the others lengths of the same length bucket (so their masks vary)."""
    rows, length = shape
    floor = max(2, length_bucket(length) // 2 + 1) if length > 8 else 2

    def row(n: int) -> list[int]:
        return [101, *(int(t) for t in rng.integers(1000, 29000, max(0, n - 2))), 102][:n]

    return pad([row(length)] + [row(int(rng.integers(min(floor, length), length + 1)))
                                for _ in range(rows - 1)])


def order_shapes(shapes: list[Shape], weights: dict[int, int]) -> list[Shape]:
    """``shapes``, those of the size ranges (padded tokens) with the most ``weights`` (the
    timing samples the record holds per range: what traffic reached) first, smallest first
    within each and among the rest."""
    return sorted(shapes, key=lambda s: (-weights.get(size_range(s[0] * s[1])[0], 0),
                                         s[0] * s[1], s))


def unverified(shapes: list[Shape], verified: frozenset[tuple[int, int, int, int]],
               configured: int, counts: tuple[int, ...]) -> list[Shape]:
    """The shapes not yet verified one by one at every count against ``configured``."""
    others = [n for n in counts if n != configured]
    return [s for s in shapes if not all((*s, n, configured) in verified for n in others)]


@dataclass
class SweepResult:
    comparisons: int = 0
    mismatches: int = 0
    shapes: int = 0  # shapes swept so far
    stopped: bool = False  # ``until`` ended it before its last shape
    by_range: dict[int, list[int]] = field(default_factory=dict)  # lo -> [comparisons, bad]
    first_mismatch: dict | None = None


def sweep(forward: Callable[[TokenBatch, int], ForwardResult], configured: int,
          counts: tuple[int, ...], shapes: list[Shape], seed: int = 0,
          progress: Callable[[SweepResult, int], None] | None = None,
          until: Callable[[SweepResult], bool] | None = None,
          on_shape: Callable[[Shape, int, bool], None] | None = None,
          lanes: Sequence[Callable[[TokenBatch, int], ForwardResult]] = (),
          cores: int = 1) -> SweepResult:
    """Run each shape at the configured count, then at every other count, and compare the
    bits. ``progress(result, total)`` after each shape; ``on_shape(shape, count, equal)``
    after each comparison; ``until(result)`` true before a shape: stop there.

    ``lanes``: more forwards like ``forward``, each safe to run beside the others (a backend
    twin on a thread context of its own). Shapes then go in chunks, and a chunk's forwards at
    count n run on up to ``cores // n`` lanes at once, so that the sweep keeps the ``cores``
    busy: on 2 cores one forward at 2 threads, or two at 1 (sequentially, a 1-thread forward
    left a core idle). A forward's answer does not depend on what runs beside it, only on
    its count, so the comparisons are the same; a sweep stopped by ``until`` records no
    shape past where it stopped, though it may have run the rest of that chunk."""
    ways = [forward, *lanes]
    rng = np.random.default_rng(seed)
    result = SweepResult()
    others = [n for n in counts if n != configured]
    chunk = 1 if len(ways) == 1 else CHUNK_PER_LANE * len(ways)
    for at in range(0, len(shapes), chunk):
        part = shapes[at:at + chunk]
        if until is not None and until(result):
            result.stopped = True
            return result
        batches = [shape_batch(shape, rng) for shape in part]
        bits = {n: _run_all(ways[:max(1, min(len(ways), cores // n))], batches, n)
                for n in (configured, *others)}
        for i, (shape, batch) in enumerate(zip(part, batches, strict=True)):
            if i and until is not None and until(result):
                result.stopped = True
                return result
            _compare(result, shape, batch, configured, others,
                     {n: bits[n][i] for n in bits}, on_shape)
            result.shapes += 1
            if progress is not None:
                progress(result, len(shapes))
    return result


# shapes per lane in a chunk of a sweep with lanes: the chunk's forwards at a count wait for
# its slowest before the next count's start, and shapes are sorted by size, so a chunk's
# forwards are alike; a larger chunk leaves the cores less often, and runs more forwards
# past a stop (``until``) for nothing
CHUNK_PER_LANE = 8


def _run_all(ways: Sequence[Callable[[TokenBatch, int], ForwardResult]],
             batches: list[TokenBatch], n: int) -> list[np.ndarray]:
    """The output bits of each batch at ``n``, on ``ways`` at once (each takes the next batch
    not yet taken)."""
    if len(ways) == 1:
        return [output_bits(ways[0](b, n).outputs) for b in batches]
    out: list[np.ndarray | None] = [None] * len(batches)
    taken = itertools.count()

    def lane(way) -> None:
        while (i := next(taken)) < len(batches):
            out[i] = output_bits(way(batches[i], n).outputs)

    with ThreadPoolExecutor(len(ways)) as pool:
        for f in [pool.submit(lane, way) for way in ways]:
            f.result()
    return out  # type: ignore[return-value]


def _compare(result: SweepResult, shape: Shape, batch: TokenBatch, configured: int,
             others: list[int], bits: dict[int, np.ndarray],
             on_shape: Callable[[Shape, int, bool], None] | None) -> None:
    reference = bits[configured]
    tally = result.by_range.setdefault(size_range(batch.padded_tokens)[0], [0, 0])
    for n in others:
        out = bits[n]
        result.comparisons += 1
        tally[0] += 1
        equal = np.array_equal(out, reference)
        if on_shape is not None:
            on_shape(shape, n, equal)
        if not equal:
            result.mismatches += 1
            tally[1] += 1
            if result.first_mismatch is None:
                at = tuple(np.argwhere(out != reference)[0])
                result.first_mismatch = {
                    "rows": shape[0], "padded_length": shape[1],
                    "padded_tokens": batch.padded_tokens, "threads": [configured, n],
                    "first_index": [int(i) for i in at],
                    "values": [float(np.asarray(a).view(np.float32))
                               for a in (reference[at], out[at])]}
