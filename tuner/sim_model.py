"""The simulator's forward-time model: what one forward of ``rows`` x ``length`` padded tokens
at ``n`` threads costs on a quiet host, fitted to measurements (``tuner/simulate.py`` runs it).

One backend x precision on the measured host (``ConfigFit``, fitted to
``bench/results/forward_table.json`` by ``fit_table``, on the statistic the table names: each
cell's fastest forward, the forward's own cost, where load only adds time)::

    t(R, L, n) = overhead * (overhead_serial + (1 - overhead_serial) / e(n)) + sync * (n > 1)
                 + work(R, L) * left(n, R * L)
    work(R, L) = per_row * R + per_token * R * L + per_token_length * R * L**2
    left(n, T) = serial + (1 - serial) * (1 / e(n) + (1 - 1 / e(n)) * grain / (grain + T))

``overhead`` is the per-forward cost that does not grow with the input (op dispatch, small
ops), of which ``overhead_serial`` does not split; ``sync`` what a second thread adds (the
team's fork and barriers; a fit has one of the two: a 2-thread forward of the smallest shape
either gains on the overhead or pays for sync); ``work`` the part that grows with the input:
the matmuls (per token), attention (per token per token of length) and per-row work, of
which ``serial`` does not parallelise, and the rest splits only as far as the forward has
rows of tokens to split (``grain``: the tokens at which a team gains half what it would on a
large input; measured, a 1-row forward gains much less from a second thread than a 16-row
one of as many tokens). The measured host has 2 vCPUs, so it pins ``e(n) = n`` for
``n <= 2`` only. Beyond, the many-core model (``ManyCore``, fitted to a measured 16-core
table by ``sim_calibration.fit_many_core``, or to published figures by
``sim_calibration.fit_published``) takes over: ``e(n) = n / (1 + contention * (n - 2))`` (a
team's threads gain less each, as memory bandwidth and barriers bind) and each thread past the
second adds ``sync_growth * overhead``.

Cores are shared (``cores_share``): normal-priority threads (served forwards, a neighbour) run
at ``cores / demand`` of a core each when they ask for more than the host has, on average; a
forward of several threads meets at barriers, so it runs at the pace of its slowest thread,
the one on a core shared with the most others: ``1 / ceil(demand / cores)`` (``Shares.team``).
Idle-class shadows get only the cores those leave, and slow the served forwards beside them
through the caches and memory they share (``SHADOW_INTERFERENCE``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

TABLE = Path(__file__).resolve().parents[1] / "bench" / "results" / "forward_table.json"

# An idle-class shadow slows the served forwards beside it by ``1 + SHADOW_INTERFERENCE *
# (cores it runs on) / cores``: measured once on this 2-vCPU host (FACTS / tuner/adaptive.py:
# a 2-thread idle-class shadow beside 1-thread served forwards made them 1.5x slower, the
# shadow on the one core they left: 1 + 1.0 * 1/2). Two vCPUs that are likely SMT siblings;
# on a many-core host with its own physical cores this is assumed, likely an overestimate.
SHADOW_INTERFERENCE = 1.0


# A forward table is calibration-grade (``loaded`` is None) when no round of it ran with the
# 1-minute load average above this many per CPU: the bench's own 1-2 threads and half a CPU of
# others on this 2-vCPU host (set before the quietest table was measured, at 1.5-1.8). Past
# it, other tasks held the CPUs for a large share of its forwards (measured here: at a load of
# 4.4-5.4 on 2 CPUs, cells' IQRs reached half their medians and 2 threads read slower than 1
# at most shapes), which no forward model reproduces. A guess from those runs.
QUIET_LOAD_PER_CPU = 1.25
# The load average counts the bench's own 1-2 busy threads, so it hides a neighbour that
# holds a CPU: the table measured at a load of 1.5-1.8 had torch's 2-thread forwards no faster
# than 1-thread ones at small shapes in every round, one measured an hour later at 1.2-1.8
# had them 1.3-1.6x faster. Tables that record other processes' CPU time per round (from
# /proc/stat, the bench's own excluded) must also keep it below this many CPUs in every
# round: a quarter of a CPU on average over a round of ~40 s. A guess, not a sweep (the
# committed table's rounds ran beside 0.01-0.03 CPUs of others, at a load of 1.2-1.7).
QUIET_OTHERS_CPUS = 0.25


class TableError(ValueError):
    """The forward table is missing or malformed (names the key)."""


@dataclass(frozen=True)
class ManyCore:
    """How a team of more than 2 threads scales (fitted in ``sim_calibration``)."""

    contention: float  # e(n) = n / (1 + contention * (n - 2)) beyond 2 threads
    sync_growth: float  # each thread past the second adds this many times ``overhead``


@dataclass(frozen=True)
class ConfigFit:
    backend: str
    precision: str
    overhead_ms: float
    sync_ms: float
    per_row_ms: float
    per_token_ms: float
    per_token_length_ms: float
    serial: float
    overhead_serial: float = 1.0
    grain_tokens: float = 0.0
    many: ManyCore | None = None  # None: 1 and 2 threads only (the measured range)

    def work_ms(self, rows: int, length: int) -> float:
        return rows * (self.per_row_ms + length * (self.per_token_ms
                                                   + length * self.per_token_length_ms))

    def parallel(self, n: int) -> float:
        """The work's effective speed-up at ``n`` threads, each on its own core."""
        if n <= 2:
            return float(n)
        if self.many is None:
            raise ValueError(f"threads: {n} is past the measured 2; give a ManyCore fit")
        return n / (1 + self.many.contention * (n - 2))

    def quiet_ms(self, rows: int, length: int, n: int) -> float:
        """Forward ms of ``rows`` x ``length`` at ``n`` threads, each thread on its own core."""
        e = self.parallel(n)
        sync = self.sync_ms * min(n - 1, 1)
        if n > 2:
            sync += self.many.sync_growth * self.overhead_ms * (n - 2)
        return (self.overhead_ms * (self.overhead_serial + (1 - self.overhead_serial) / e)
                + sync + self.work_ms(rows, length) * self.left(n, rows * length))

    def left(self, n: int, tokens: int) -> float:
        """The share of the work's 1-thread time a forward of ``tokens`` takes at ``n``."""
        e = self.parallel(n)
        return left(self.serial, self.grain_tokens, e, tokens)

    def with_many(self, many: ManyCore) -> ConfigFit:
        return replace(self, many=many)


# -- fitting the measured table ----------------------------------------------------------------

def load_table(path: Path | str = TABLE) -> dict:
    """The forward table at ``path``, each cell's ``fit_ms`` set to the statistic the table
    names as ``fitted`` (``min_ms``: the fastest forward; tables that name none: the median)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TableError(f"forward table {path}: {exc} (measure it: python -m "
                         "bench.forward_table)") from exc
    cells = doc.get("cells") if isinstance(doc, dict) else None
    if not isinstance(cells, list) or not cells:
        raise TableError(f"forward table {path}: 'cells' must be a non-empty list")
    fitted = doc.get("fitted", "median_ms")  # tables before the bench named it: the median
    if fitted not in ("min_ms", "median_ms"):
        raise TableError(f"forward table {path}: 'fitted' must be min_ms or median_ms, "
                         f"not {fitted!r}")
    for i, c in enumerate(cells):
        for key in ("backend", "precision", "rows", "padded_tokens", "threads", fitted):
            if key not in c:
                raise TableError(f"forward table {path}: cells[{i}] lacks {key!r}")
        c["fit_ms"] = float(c[fitted])
    return doc


def loaded(doc: dict) -> str | None:
    """Why a forward table (``load_table``) is no calibration: the load it was measured at,
    past ``QUIET_LOAD_PER_CPU`` or ``QUIET_OTHERS_CPUS`` in some round; None when it is."""
    load = doc["load"]
    worst_load = max(load["per_round_1min"])
    others = max(load.get("others_cpus_per_round", [0.0]))  # older tables lack it
    if worst_load <= QUIET_LOAD_PER_CPU * doc["cpus"] and others <= QUIET_OTHERS_CPUS:
        return None
    return (f"at a 1-minute load of up to {worst_load:.1f} on {doc['cpus']} CPUs, other "
            f"processes using up to {others:.2f} CPUs")


def left(serial: float, grain: float, e: float, tokens: int) -> float:
    return serial + (1 - serial) * (1 / e + (1 - 1 / e) * grain / (grain + tokens))


def _design(cells: Sequence[dict], serial: float,
            grain: float) -> tuple[np.ndarray, np.ndarray]:
    """Columns: the fixed part at 1 thread, at 2 threads, per_row, per_token,
    per_token_length; rows weighted by 1 / measured time (least squares on relative
    error)."""
    x, y = [], []
    for c in cells:
        n, rows, length = c["threads"], c["rows"], c["padded_tokens"]
        p = left(serial, grain, n, rows * length)
        x.append([float(n == 1), float(n == 2), rows * p, rows * length * p,
                  rows * length ** 2 * p])
        y.append(c["fit_ms"])
    x, y = np.asarray(x, float), np.asarray(y, float)
    return x / y[:, None], np.ones_like(y)


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop the most negative, refit)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or not keep:
            return coef
        keep.remove(int(np.argmin(coef)))


def _minimax(x: np.ndarray, y: np.ndarray, rounds: int = 40) -> np.ndarray:
    """Coefficients >= 0 whose worst relative error is (near) the least: Lawson's
    reweighted least squares, each cell's weight grown by its error, the best kept."""
    w = np.full(len(y), 1 / len(y))
    best, best_err = None, math.inf
    for _ in range(rounds):
        root = np.sqrt(w)[:, None]
        coef = nonnegative_lstsq(x * root, y * root[:, 0])
        err = np.abs(x @ coef - y)
        if err.max() < best_err:
            best, best_err = coef, float(err.max())
        w = w * err / max(float((w * err).sum()), 1e-12)
    return best


GRAINS = (0.0, *(2.0 ** k for k in range(3, 13)))  # tokens: 8 .. 4096
SERIALS = tuple(np.linspace(0, 0.95, 20))
REFINED = 8  # grid points refined by ``_minimax`` (the least-squares ranking's best)


def fit_config(cells: Sequence[dict]) -> ConfigFit:
    """One backend x precision: the serial fraction and the grain by grid (``SERIALS``,
    ``GRAINS``), the rest by least squares; the few grid points with the smallest worst-cell
    relative error are refined by ``_minimax``, and the best wins."""
    ranked = []
    for grain in GRAINS:
        for serial in SERIALS:
            x, y = _design(cells, serial, grain)
            coef = nonnegative_lstsq(x, y)
            ranked.append((float(np.abs(x @ coef - y).max()), float(serial), grain))
    best = None
    for _, serial, grain in sorted(ranked)[:REFINED]:
        x, y = _design(cells, serial, grain)
        coef = _minimax(x, y)
        worst = float(np.abs(x @ coef - y).max())
        if best is None or worst < best[0]:
            best = (worst, serial, grain, coef)
    _, serial, grain, (o, o2, row, tok, tok2) = best
    # the fixed part at 2 threads: more than at 1 is sync, less is the overhead splitting
    sync, o_serial = (o2 - o, 1.0) if o2 >= o or o == 0 else (0.0, max(0.0, 2 * o2 / o - 1))
    c0 = cells[0]
    return ConfigFit(c0["backend"], c0["precision"], float(o), float(sync), float(row),
                     float(tok), float(tok2), serial, float(o_serial), grain)


def fit_table(doc: dict) -> dict[tuple[str, str], ConfigFit]:
    """(backend, precision) -> its fit, from a forward table (``load_table``)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in doc["cells"]:
        groups.setdefault((c["backend"], c["precision"]), []).append(c)
    return {k: fit_config(v) for k, v in groups.items()}


def errors(fit: ConfigFit, cells: Iterable[dict]) -> list[tuple[dict, float]]:
    """Each cell with the fit's relative error on it (model / the cell's fitted statistic,
    ``fit_ms`` as ``load_table`` sets it, - 1)."""
    return [(c, fit.quiet_ms(c["rows"], c["padded_tokens"], c["threads"]) / c["fit_ms"] - 1)
            for c in cells if (c["backend"], c["precision"]) == (fit.backend, fit.precision)]


# -- cores shared among forwards ----------------------------------------------------------------

@dataclass(frozen=True)
class Shares:
    served: float  # progress rate of each one-thread served forward (1: its quiet speed)
    shadow: float  # of each unfrozen shadow
    shadow_cores: float  # cores the shadows run on
    team: float = 0.0  # of each served forward of two threads or more (``cores_share``)

    def rate(self, threads: int) -> float:
        """Progress rate of a served forward of ``threads`` threads."""
        return self.team if threads > 1 else self.served


def cores_share(cores: int, normal_threads: float, shadow_threads: float) -> Shares:
    """Fair sharing: normal-priority threads (served forwards and neighbours) get
    ``cores / demand`` of a core each when they want more than ``cores``; a forward of
    several threads runs at its slowest thread's pace, ``1 / ceil(demand / cores)`` (its
    threads meet at barriers; one of them shares a core with the most others). Idle-class
    shadows share what normal threads leave, and slow served forwards by
    ``SHADOW_INTERFERENCE``. Checked, not fitted: the loaded Arm figure (16 threads beside a
    busy thread per core: both rules give 1/2) and this host's served forwards beside a
    neighbour holding one of 2 vCPUs (``bench/results/shadow_vs_served.json``: 2 threads
    1.97-2.12x slower than with no neighbour, 1 thread 0.99-1.05x; fair sharing alone
    said 1.5x)."""
    q = 1.0 if normal_threads <= cores else cores / normal_threads
    team = 1.0 if normal_threads <= cores else 1 / math.ceil(normal_threads / cores - 1e-9)
    left = max(0.0, cores - normal_threads)
    used = min(shadow_threads, left)
    q_shadow = 1.0 if shadow_threads <= left else (left / shadow_threads if shadow_threads
                                                    else 1.0)
    interference = 1 + SHADOW_INTERFERENCE * used / cores
    return Shares(q / interference, q_shadow, used, team / interference)
