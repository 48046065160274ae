"""R4.8 with R3.1: a mode 2 worker pads a forward whose exact shape no sweep (and no shape
verified one by one) covers up to the length grid (``runtime.sizes.grid_length``: every
length up to 16, then steps of at most 1/8 of the length), so the shapes it must verify one
by one are the grid's, not every length; a shape a sweep covers runs as it comes, and other
modes pad to the longest row. The grid is restated here, the padding it adds is bounded, the
batch limit counts the padded length, and a real worker in mode 2 runs its forwards on the
grid with answers within 1e-5 of the same worker in mode 0, or unpadded once swept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FAST, L6, wait_for
from vllm_srun.records.host_record import HostRecord
from vllm_srun.records.voucher import Coverage
from vllm_srun.records.voucher import on_grid as voucher_on_grid
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.batching import PendingRow, next_batch
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.sizes import grid_length, on_grid
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.server.worker.assembly import Worker
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.tuner.modes import AdaptiveMode
from vllm_srun.tuner.verify import ShapeBounds, plan_sweep, sweep


def test_the_grid_keeps_short_lengths_and_steps_by_at_most_an_eighth_above():
    assert [grid_length(n, 512) for n in (2, 9, 16, 17, 31, 33, 65, 100, 129, 300, 511)] == \
        [2, 9, 16, 18, 32, 36, 72, 104, 144, 320, 512]
    for max_len in (256, 300, 512, 8192):
        grid = [n for n in range(2, max_len + 1) if on_grid(n, max_len)]
        for n in range(2, max_len + 1):
            g = grid_length(n, max_len)
            assert g == min(x for x in grid if x >= n), (n, max_len)  # the next grid length
            assert n <= g <= max_len and (g - n) * 8 < n, (n, g)
    assert grid_length(300, 300) == 300 and on_grid(300, 300)  # the model's limit is on it
    assert grid_length(600, 512) == 600  # a length over the limit is not cut


def test_the_batch_limit_counts_the_length_the_grid_pads_to():
    rows = [PendingRow(request_id=i, index=0, length=n) for i, n in enumerate((100, 97, 99))]
    assert len(next_batch(rows, 32, 300)) == 3  # 3 x 100
    padded = next_batch(rows, 32, 300, lambda rows, n: grid_length(n, 512))
    assert [r.length for r in padded] == [100, 97]  # 3 x 104 would be 312


def test_pad_to_the_grid_pads_ids_mask_and_token_types_with_zeros():
    batch = pad([[101, 5, 102], [101, 7, 8, 9, 102]] + [[101] + [3] * 15 + [102]],
                [None, [0, 0, 0, 1, 1], None], to=lambda rows, n: grid_length(n, 512))
    assert batch.input_ids.shape == (3, 18)  # the longest, 17, padded to 18
    assert batch.attention_mask.sum(axis=1).tolist() == [3, 5, 17]
    assert batch.token_type_ids[1].tolist() == [0, 0, 0, 1, 1] + [0] * 13
    assert not batch.input_ids[:, 17].any()


class ShapeNotes:
    """The real backend, noting the shape of every forward served through it."""

    def __init__(self, backend, shapes: list) -> None:
        self._backend, self.shapes = backend, shapes

    def forward(self, batch, num_threads):
        self.shapes.append(batch.input_ids.shape)
        return self._backend.forward(batch, num_threads)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def served(mode: AdaptiveMode, tmp_path: Path, texts: list[str], swept: int = 0):
    """Each text served alone by a real worker in ``mode``: token counts, the shapes the
    backend ran, the answers. ``swept``: first a real sweep of one row of every length up
    to that many tokens, recorded as the worker's voucher."""
    shapes: list = []
    spec = WorkerSpec(L6, "onnxruntime", EngineArgs(num_threads=1, cache_entries=0), budget=2,
                      mode=mode, record_path=str(tmp_path / f"{mode.name}.sqlite"),
                      settings=FAST, calibrate=False)
    made = Worker(spec, wrap_backend=lambda b: ShapeNotes(b, shapes))
    runner = made.load()
    try:
        assert runner.ready, runner.not_ready_reason
        if swept:
            vouch(made, tmp_path, swept)
        rows = runner.tokenizer.encode(texts, truncate=True)
        shapes.clear()  # the warm pass and the golden check
        answers = [runner.engine.submit([r]).result(timeout=60)[0] for r in rows]
        return [len(r) for r in rows], shapes[: len(rows)], np.stack(answers)
    finally:
        runner.stop()


@pytest.mark.parametrize("mode", [AdaptiveMode.OFF, AdaptiveMode.LEARN])
def test_only_a_mode_2_worker_pads_to_the_grid(tmp_path, mode):
    texts = ["a query of a handful of words that runs past sixteen tokens in all, surely",
             "short"]
    lengths, shapes, _ = served(mode, tmp_path, texts)
    assert lengths[0] > 16 and grid_length(lengths[0], 512) != lengths[0]
    assert shapes == [(1, n) for n in lengths]


def test_a_mode_2_worker_serves_on_the_grid_with_the_answers_of_mode_0(tmp_path):
    texts = ["a query of a handful of words that runs past sixteen tokens in all, surely",
             "short", "a longer passage " * 12]
    lengths, shapes, off = served(AdaptiveMode.OFF, tmp_path, texts)
    lengths2, shapes2, on = served(AdaptiveMode.SERVE, tmp_path, texts)
    assert lengths2 == lengths and any(grid_length(n, 512) != n for n in lengths)
    assert shapes2 == [(1, grid_length(n, 512)) for n in lengths]
    assert np.abs(on - off).max() < 1e-5


def vouch(made: Worker, tmp_path: Path, longest: int) -> None:
    plan = plan_sweep(ShapeBounds(max_rows=1, max_len=longest, max_padded=longest))
    backend = load_backend(made.manifest, "onnxruntime")
    checked = sweep(lambda b, n: backend.forward(b, n), 1, (1, 2), plan.shapes)
    backend.close()
    assert checked.mismatches == 0 and checked.comparisons == len(plan.shapes)
    HostRecord(made.record_path).add_voucher(made.tuner.sync.scope, "verify",
                                             checked.comparisons, 0, plan.coverage((1, 2)))
    assert wait_for(lambda: made.tuner.ledger.voucher.swept, 30)


def test_a_mode_2_worker_runs_a_shape_a_sweep_covers_as_it_comes(tmp_path):
    texts = ["a query of a handful of words that runs past sixteen tokens in all, surely",
             "a longer passage " * 25]  # 77 tokens: padded to 80
    lengths, shapes, on = served(AdaptiveMode.SERVE, tmp_path, texts, swept=64)
    assert lengths[0] < 64 < lengths[1] and grid_length(lengths[1], 512) != lengths[1]
    assert shapes == [(1, lengths[0]), (1, grid_length(lengths[1], 512))]  # swept: exact
    _, _, off = served(AdaptiveMode.OFF, tmp_path, texts)
    assert np.array_equal(on[0], off[0]) and np.abs(on - off).max() < 1e-5


def test_a_grid_sweeps_voucher_covers_grid_lengths_and_an_older_one_every_length():
    cov = plan_sweep(ShapeBounds(max_rows=2, max_len=64, max_padded=128, grid=True)
                     ).coverage((1, 2))
    assert cov.grid == 3 and cov.shapes == 2 * len([n for n in range(2, 65) if on_grid(n, 64)])
    assert cov.covers_shape(1, 18) and cov.covers_shape(2, 64) and not cov.covers_shape(1, 17)
    older = json.loads(cov.to_json())
    del older["grid"]  # a voucher recorded before the grid: its sweep ran every length
    assert Coverage.from_json(json.dumps(older)).covers_shape(1, 17)
    for bad in ('"yes"', "true", "0", "2.5"):
        with pytest.raises(ValueError, match="grid"):
            Coverage.from_json(cov.to_json().replace('"grid": 3', f'"grid": {bad}'))


def test_the_records_grid_rule_is_the_grid_the_engine_pads_to():
    for shift in (2, 3, 4):
        for max_len in (40, 256, 300, 8192):
            assert [n for n in range(1, max_len + 1) if voucher_on_grid(n, max_len, shift)] == \
                [n for n in range(1, max_len + 1) if on_grid(n, max_len, shift)]


def test_the_bench_plans_the_products_grid_and_every_length_as_the_sweep_would():
    from bench.length_grid import mix_bodies, plan_figures

    grid = plan_sweep(ShapeBounds(max_rows=32, max_len=256, max_padded=16384, grid=True))
    assert (len(grid.shapes) - grid.sampled, grid.sampled, grid.above) == (1023, 28, 481)
    ours = grid.shapes
    assert len(ours) == 1051 and plan_figures(3, 256) == {
        "shapes": 1051, "padded_tokens_per_count": sum(r * n for r, n in ours)}
    assert plan_figures(None, 256)["shapes"] == 3030
    assert len(set(mix_bodies(50))) == 50  # unique bodies, as the wrk script sends
