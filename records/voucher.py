"""What vouches for bit-identity across thread counts (R4.8): a sweep's ``Coverage`` (counts and
shape bounds), the shapes verified one by one, and the ``Voucher`` they make together, read
back from the host record (``HostRecord.voucher``)."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Coverage:
    """What one ``threads verify`` sweep compared (R4.8): the thread counts, and the forward
    shapes (rows x padded length) within these bounds. Shapes up to ``exhaustive_padded``
    padded tokens were all swept; above it ``sampled`` of the ``above`` shapes there were, a
    stratified sample (``sampled == above`` when the sweep was exhaustive). ``grid``: the
    sweep ran only the padded lengths of the length grid of that step (``on_grid``; mode 2
    pads the shapes nothing covers to it, ``runtime.sizes.grid_length``); None (and every
    sweep recorded before the grid): every length."""

    counts: tuple[int, ...]
    max_rows: int  # max_num_seqs
    min_len: int  # padded length (tokens per row) bounds
    max_len: int
    max_padded: int  # max_num_batched_tokens (a single row may reach max_len regardless)
    exhaustive_padded: int
    shapes: int  # shapes swept in all
    sampled: int = 0
    above: int = 0
    grid: int | None = None  # the grid's step bound 1/2**grid, as recorded

    def covers_shape(self, rows: int, length: int) -> bool:
        return (1 <= rows <= self.max_rows and self.min_len <= length <= self.max_len
                and (rows == 1 or rows * length <= self.max_padded)
                and (self.grid is None or on_grid(length, self.max_len, self.grid)))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "counts": list(self.counts)})

    @classmethod
    def from_json(cls, text: str) -> Coverage:
        raw = json.loads(text)
        grid = raw.get("grid")
        if grid is not None and (type(grid) is not int or not 1 <= grid <= 16):
            raise ValueError(f"a coverage's grid is a step shift of 1-16 or null, not {grid!r}")
        return cls(**{**raw, "counts": tuple(raw["counts"])})


def on_grid(length: int, max_len: int, shift: int) -> bool:
    """Is ``length`` on the length grid of step bound 1/2**``shift``: every length below
    2**(shift+1), then the multiples of the largest power of two not above length /
    2**shift, and the limit ``max_len``? The rule a grid sweep's coverage is read by, kept
    with the record (``runtime.sizes.grid_length`` pads to the same grid; a test holds the
    two together)."""
    if length == max_len or length < 2 << shift:
        return True
    return length % (1 << (length.bit_length() - 1 - shift)) == 0


VerifiedShape = tuple[int, int, int, int]  # (rows, padded length, count, configured count)


@dataclass(frozen=True)
class Voucher:
    """The scope's vouchers since its last reset: comparisons and mismatches of sweeps and
    traffic, what the sweeps covered, and the shapes verified one by one (``verified``: a
    shadow or a bounded sweep ran that exact shape at a count and at the configured count,
    bit-identical). Nothing vouches once anything ever differed. A sweep that compared
    something covers a served count together with the configured count in its counts, and a
    shape inside its bounds; a verified shape covers exactly that shape, count and configured
    count."""

    comparisons: int
    mismatches: int
    swept: bool  # a ``threads verify`` sweep that compared something contributed
    coverages: tuple[Coverage, ...] = ()
    legacy: int = 0  # sweeps recorded before coverage was stored: they cover nothing
    verified: frozenset[VerifiedShape] = frozenset()
    shape_mismatches: int = 0  # shapes compared one by one whose answers differed
    # (count, configured) pairs of ``verified``: ``covers_counts`` runs on the served path
    _pairs: frozenset[tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pairs", _pairs(self.verified))

    @property
    def clean(self) -> bool:
        return self.mismatches == 0 and self.shape_mismatches == 0

    @property
    def vouches(self) -> bool:
        """Something vouches: a sweep that compared something, or one verified shape."""
        return self.clean and (self.swept and bool(self.coverages) and self.comparisons > 0
                               or bool(self.verified))

    def covers_counts(self, served: int, configured: int) -> bool:
        """May ``served`` serve any shape at all where ``configured`` is configured (a sweep
        had both counts, or some shape was verified at ``served``)? A range's transition
        window starts only then; each forward still asks ``covers``."""
        return self.vouches and ((served, configured) in self._pairs or any(
            {served, configured} <= set(c.counts) for c in self._sweeps()))

    def covers(self, rows: int, length: int, served: int, configured: int) -> bool:
        """May a forward of ``rows`` x ``length`` be served at ``served`` threads?"""
        return self.vouches and ((rows, length, served, configured) in self.verified or any(
            {served, configured} <= set(c.counts) and c.covers_shape(rows, length)
            for c in self._sweeps()))

    def shapes_verified(self, configured: int) -> dict[int, int]:
        """count -> shapes verified one by one at it against ``configured``."""
        out: dict[int, int] = {}
        for _, _, n, c in self.verified:
            if c == configured:
                out[n] = out.get(n, 0) + 1
        return dict(sorted(out.items()))

    def _sweeps(self) -> tuple[Coverage, ...]:
        return self.coverages if self.swept and self.comparisons > 0 else ()


@functools.lru_cache(maxsize=16)
def _pairs(verified: frozenset[VerifiedShape]) -> frozenset[tuple[int, int]]:
    """(count, configured) of ``verified``: a record read back unchanged hands the same set
    again (``HostRecord._verified``), whose hash a frozenset keeps, so this is not redone."""
    return frozenset((n, c) for _, _, n, c in verified)


def shape_item(item: tuple[int, int, int], configured: int) -> tuple[int, int, int]:
    """A verified shape's (rows, padded length, count), checked."""
    try:
        rows, length, n = (int(x) for x in item)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a verified shape is (rows, padded length, count), not {item!r}") \
            from exc
    if min(rows, length, n, configured) < 1 or n == configured:
        raise ValueError(f"verified shape {item!r} against {configured} threads: rows, length "
                         "and count must be positive, the count other than the configured one")
    return rows, length, n
