"""R4.8, the voucher sweep on lanes: its forwards at a count run on up to ``cores // count``
lanes at once (a backend twin each, on a thread context of its own), so on 2 cores two
1-thread forwards run together and 2-thread ones alone; the comparisons, their order and
what a stopped sweep records are those of the sweep on one lane. Real forwards, on
onnxruntime and on torch."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import L3, L6
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep, sweep

SHAPES = plan_sweep(ShapeBounds(max_rows=4, max_len=40, max_padded=96)).shapes


class Lanes:
    """Two lanes over a real backend and its twin, each forward noted with its lane, count
    and when it ran."""

    def __init__(self, name: str = "onnxruntime") -> None:
        backend = load_backend(resolve(L3 if name == "onnxruntime" else L6), name)
        self.name = name
        self.ways = [(backend, ThreadContext()), (backend.twin(), ThreadContext())]
        self.runs: list[tuple[int, int, float, float]] = []
        self._lock = threading.Lock()

    def forward(self, lane: int):
        way, context = self.ways[lane]

        def run(batch, n):
            start = time.monotonic()
            out = context.run(n, lambda: way.forward(batch, n))
            with self._lock:
                self.runs.append((lane, n, start, time.monotonic()))
            return out
        return run

    def overlapped(self, n: int) -> int:
        """Pairs of forwards at ``n`` on different lanes that ran at the same time."""
        at = [r for r in self.runs if r[1] == n]
        return sum(a[0] != b[0] and a[2] < b[3] and b[2] < a[3]
                   for i, a in enumerate(at) for b in at[i + 1:])

    def close(self) -> None:
        for _, context in self.ways:
            context.shutdown()


@pytest.fixture(params=["onnxruntime", "torch"])
def lanes(request):
    """onnxruntime's twin has sessions of its own; torch's is the same module (a lane's
    OS thread carries its own intra-op pool; L3 has no torch weights, so L6)."""
    ways = Lanes(request.param)
    yield ways
    ways.close()


def test_a_sweep_on_two_lanes_keeps_two_cores_busy_and_compares_as_one_lane_does(lanes):
    seen: dict[str, list] = {"one": [], "two": []}
    alone = sweep(lanes.forward(0), 1, (1, 2), SHAPES,
                  on_shape=lambda *a: seen["one"].append(a))
    lanes.runs.clear()
    packed = sweep(lanes.forward(0), 1, (1, 2), SHAPES, lanes=[lanes.forward(1)], cores=2,
                   on_shape=lambda *a: seen["two"].append(a))
    assert (packed.shapes, packed.comparisons, packed.mismatches, packed.by_range) == \
        (alone.shapes, alone.comparisons, alone.mismatches, alone.by_range)
    assert packed.shapes == len(SHAPES)
    assert lanes.name == "torch" or packed.mismatches == 0  # (torch may differ across counts)
    assert seen["two"] == seen["one"]  # the same shapes and verdicts, in the same order
    assert {lane for lane, n, _, _ in lanes.runs if n == 1} == {0, 1}
    assert lanes.overlapped(1) > 0  # two 1-thread forwards at once
    assert {lane for lane, n, _, _ in lanes.runs if n == 2} == {0}  # 2 threads: one lane
    assert len(lanes.runs) == 2 * len(SHAPES)


def test_a_sweep_on_lanes_stopped_records_no_shape_past_the_stop(lanes):
    recorded = []
    res = sweep(lanes.forward(0), 1, (1, 2), SHAPES, lanes=[lanes.forward(1)], cores=2,
                until=lambda r: r.shapes >= 5, on_shape=lambda *a: recorded.append(a))
    assert res.stopped and res.shapes == 5 and [s for s, _, _ in recorded] == SHAPES[:5]


def test_lanes_run_one_at_a_time_where_the_cores_fit_one(lanes):
    sweep(lanes.forward(0), 1, (1, 2), SHAPES[:40], lanes=[lanes.forward(1)], cores=1)
    assert {lane for lane, _, _, _ in lanes.runs} == {0}
