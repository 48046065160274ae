"""Open-loop traces for the adaptive-threads bench: request bodies written to a file (one JSON
body per line, used in order, so every server of a round gets the same requests at the same
times), each server's served forward time per padded-token range read from ``/metrics``, and
the per-range oracle over a trace (pure functions over those figures).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.adaptive_wrk import MIX

_WORDS = ("the", "search", "query", "result", "vector", "model", "server", "thread", "input",
          "token", "embedding", "latency", "throughput", "request", "answer", "system",
          "memory", "batch", "length", "short", "long", "kernel", "host", "python", "record",
          "cache", "route", "worker")


def write_bodies(path: Path, model: str, count: int, seed: int, mix=MIX) -> Path:
    """``count`` unique embedding requests (a unique first word: the result cache never
    answers) of the mix's lengths, one JSON body per line, the same for the same seed."""
    rng = random.Random(seed)
    total = sum(share for _, share, _ in mix)
    lines = []
    for i in range(count):
        u, words = rng.random() * total, mix[-1][2]
        for _, share, n in mix:
            if u < share:
                words = n
                break
            u -= share
        text = " ".join([f"s{seed}r{i}", *(rng.choice(_WORDS) for _ in range(words))])
        lines.append(json.dumps({"model": model, "input": [text]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True)
class RangeTime:
    """Served forwards of one padded-token range: how many and their total seconds."""
    forwards: float
    seconds: float


def parse_forward_totals(text: str) -> dict[str, RangeTime]:
    """``vllm_srun_forward_seconds`` from a ``/metrics`` page, summed over thread counts and
    replicas, per ``size_range``."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "vllm_srun_forward_seconds":
            continue
        for s in family.samples:
            rng = s.labels.get("size_range")
            if s.name.endswith("_sum"):
                sums[rng] = sums.get(rng, 0.0) + s.value
            elif s.name.endswith("_count"):
                counts[rng] = counts.get(rng, 0.0) + s.value
    return {r: RangeTime(counts.get(r, 0.0), sums[r]) for r in sums}


def forward_totals(url: str) -> dict[str, RangeTime]:
    return parse_forward_totals(httpx.get(f"{url}/metrics", timeout=30).text)


def since(after: dict[str, RangeTime], before: dict[str, RangeTime]) -> dict[str, RangeTime]:
    """What one run added (the metrics are totals since the server started)."""
    zero = RangeTime(0.0, 0.0)
    out = {r: RangeTime(a.forwards - before.get(r, zero).forwards,
                        a.seconds - before.get(r, zero).seconds) for r, a in after.items()}
    return {r: t for r, t in out.items() if t.forwards > 0}


def total_seconds(ranges: dict[str, RangeTime]) -> float:
    return sum(t.seconds for t in ranges.values())


def range_oracle(served: dict[str, RangeTime], fixed: dict[str, dict[str, RangeTime]]) -> dict:
    """The per-range oracle for the forwards ``served`` ran over a trace: in each padded-token
    range, those forwards at the mean forward time of the fixed count fastest in that range
    over the same trace (batching differs a little between servers, so a range's count of
    forwards is the served server's own; ``sum_of_minima`` is the cruder sum of each range's
    smaller fixed total). A range no fixed server ran keeps the served time (no evidence).
    Returns the oracle seconds, the best count per range and the cruder figure."""
    oracle, best, crude = 0.0, {}, 0.0
    for rng, t in served.items():
        means = {name: f[rng].seconds / f[rng].forwards for name, f in fixed.items()
                 if rng in f and f[rng].forwards > 0}
        if not means:
            oracle += t.seconds
            crude += t.seconds
            continue
        best[rng] = min(means, key=means.__getitem__)
        oracle += t.forwards * means[best[rng]]
    for rng in {r for f in fixed.values() for r in f}:
        crude += min(f[rng].seconds for f in fixed.values() if rng in f)
    return {"oracle_s": oracle, "best_per_range": best, "sum_of_minima_s": crude}
