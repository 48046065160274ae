"""R3.1, R3.3, R3.4: micro-batching, deadlines and the result cache, with the real model."""

from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.conftest import L6, words
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import TimedFuture
from vllm_srun.runtime.errors import ConfigError, DeadlineExceeded, InputTooLong
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.types import EngineArgs

LONG = [101] + [7592] * 254 + [102]


@pytest.fixture(scope="module")
def backend():
    return load_backend(resolve(L6), "onnxruntime")


@pytest.fixture
def runner(backend):
    records = []
    r = Runner(resolve(L6), backend, EngineArgs(num_threads=1), on_forward=records.append)
    r.records = records
    r.start()
    yield r
    r.stop()


def test_concurrent_requests_share_forwards(runner):
    engine = runner.engine
    blocker = engine.submit([LONG] * 16)  # keeps the engine busy while the others queue
    small = [engine.submit([[101] + [7592] * (5 + i % 3) + [102]]) for i in range(24)]
    blocker.result(timeout=60)
    outs = [f.result(timeout=60) for f in small]
    served = [r for r in runner.records if r.padded_tokens < 16 * 256]
    assert sum(r.rows for r in served) == 24
    assert len(served) < 24 and max(r.requests for r in served) > 1
    alone = engine.forward([[101] + [7592] * 5 + [102]], 1).outputs[0]
    assert np.abs(outs[0][0] - alone).max() < 1e-5


def test_a_request_is_answered_as_one_unit_in_order(runner):
    texts = [words(3), words(100), words(10), words(60)]
    future, tokens = runner.submit(texts)
    out = future.result(timeout=60)
    assert out.shape == (4, 384) and tokens == 3 + 100 + 10 + 60 + 8
    for i, t in enumerate(texts):
        single, _ = runner.submit([t])
        assert np.abs(single.result(timeout=60)[0] - out[i]).max() < 1e-5


def test_request_larger_than_max_num_seqs_is_split_but_answered_whole(backend):
    records = []
    r = Runner(resolve(L6), backend, EngineArgs(num_threads=1, max_num_seqs=4),
               on_forward=records.append)
    r.start()
    try:
        out = r.engine.submit([[101, 7592 + i, 102] for i in range(10)]).result(timeout=60)
    finally:
        r.stop()
    assert out.shape == (10, 384)
    assert [x.rows for x in records] == [4, 4, 2]


def test_expired_request_is_dropped_before_its_forward(runner):
    engine = runner.engine
    blocker = engine.submit([LONG] * 16)
    late = engine.submit([[101, 7592, 102]], deadline=time.monotonic() + 0.001)
    blocker.result(timeout=60)
    with pytest.raises(DeadlineExceeded):
        late.result(timeout=60)
    assert all(r.padded_tokens != 3 for r in runner.records)


def test_a_cancelled_request_drops_its_queued_rows(runner):
    blocker = runner.engine.submit([LONG] * 16)
    out, _ = runner.submit([words(37)])  # queued behind the blocker
    assert out.cancel()
    blocker.result(timeout=60)
    runner.submit([words(3)])[0].result(timeout=60)  # the engine has moved past it
    assert all(r.padded_tokens != 37 + 2 for r in runner.records)


def test_a_served_request_leaves_no_garbage_for_the_cyclic_collector(runner):
    """A request's futures are freed when it is answered, not by the cyclic collector, whose
    passes hold the GIL beside the forwards (a strong link between the two futures made
    every request ~40 objects of cyclic garbage)."""
    futures = [runner.submit([words(4 + i)])[0] for i in range(8)]
    for f in futures:
        f.result(timeout=60)
    del futures, f
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for i in range(8):
            runner.submit([words(20 + i)])[0].result(timeout=60)
        gc.collect()
        futures = [o for o in gc.garbage if isinstance(o, TimedFuture)]
        kinds = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not futures, kinds


def test_engine_timeout_ms_bounds_every_request(backend):
    r = Runner(resolve(L6), backend, EngineArgs(num_threads=1, timeout_ms=1))
    r.start()
    try:
        blocker = r.engine.submit([LONG] * 16)
        late = r.engine.submit([[101, 7592, 102]])
        with pytest.raises(DeadlineExceeded):
            late.result(timeout=60)
        with pytest.raises(DeadlineExceeded):
            blocker.result(timeout=60)
    finally:
        r.stop()


def test_cached_answer_is_returned_for_identical_input(runner):
    first, _ = runner.submit(["cache me", "and me"])
    a = first.result(timeout=60)
    forwards = runner.engine.forwards
    second, tokens = runner.submit(["and me", "cache me"])
    b = second.result(timeout=60)
    assert runner.engine.forwards == forwards and runner.cache.hits >= 2
    assert np.array_equal(a[::-1], b) and tokens == 4 + 4


def test_truncate_is_part_of_the_cache_key(runner):
    with pytest.raises(InputTooLong):
        runner.submit([words(300)])
    out, tokens = runner.submit([words(300)], truncate=True)
    assert out.result(timeout=60).shape == (1, 384) and tokens == 256
    with pytest.raises(InputTooLong):  # a cached cut answer never serves a non-truncate call
        runner.submit([words(300)])


def test_bad_input_costs_no_other_request_its_answer(runner):
    with ThreadPoolExecutor(max_workers=8) as pool:
        def good(i):
            return runner.submit([words(5 + i)])[0].result(timeout=60)

        def bad(_):
            with pytest.raises(InputTooLong):
                runner.submit([words(1000)])

        futures = [pool.submit(good if i % 2 else bad, i) for i in range(20)]
        outs = [f.result() for f in futures]
    assert sum(o is not None for o in outs) == 10


@pytest.mark.parametrize(("field", "value"), [("num_threads", 0), ("max_num_seqs", 0),
                                              ("max_num_batched_tokens", 100),
                                              ("timeout_ms", -1), ("cache_entries", -1),
                                              ("concurrent_forwards", 0)])
def test_bad_engine_arguments_name_the_key(backend, field, value):
    args = {"num_threads": 1, field: value}
    with pytest.raises(ConfigError, match=field):
        Runner(resolve(L6), backend, EngineArgs(**args))


# -- the result cache (R3.4, issue 15 item 5) -------------------------------------------------

def test_cache_keys_are_digests_of_truncate_and_input():
    from vllm_srun.runtime.cache import cache_key

    long = "word " * 20_000
    assert len(cache_key(False, long)) == 16  # the key pins 16 bytes, not the text
    assert cache_key(False, "a") != cache_key(True, "a")
    assert cache_key(False, ("ab", "c")) != cache_key(False, ("a", "bc"))
    assert cache_key(False, ("a", "b")) != cache_key(False, "ab")


def test_cache_is_an_lru_bounded_in_bytes_as_well_as_entries():
    import numpy as np

    from vllm_srun.runtime.cache import ResultCache, cache_key

    row = np.zeros(1000, dtype=np.float32)  # 4,000 bytes an answer
    cache = ResultCache(max_entries=100, max_bytes=3 * (row.nbytes + 200))
    for i in range(3):
        cache.put(cache_key(False, str(i)), row, 1)
    assert cache.get(cache_key(False, "0")) is not None  # the oldest, now the most recent
    for i in (3, 4):
        cache.put(cache_key(False, str(i)), row, 1)
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes
    # least recently used went first (1, 2), not the oldest put (0: first in, first out)
    assert [i for i in range(5) if cache.get(cache_key(False, str(i))) is not None] == [0, 3, 4]
    cache.put(cache_key(False, "huge"), np.zeros(10_000, dtype=np.float32), 1)
    assert cache.get(cache_key(False, "huge")) is None and len(cache) == 3  # never fits
    by_entries = ResultCache(max_entries=2)
    for key in ("a", "b"):
        by_entries.put(cache_key(False, key), row, 1)
    assert by_entries.get(cache_key(False, "a")) is not None
    by_entries.put(cache_key(False, "c"), row, 1)
    assert by_entries.get(cache_key(False, "b")) is None  # "a" was used since: it stays
    assert by_entries.get(cache_key(False, "a")) is not None and len(by_entries) == 2


def test_an_input_answered_nan_fails_its_request_alone():
    """A row whose answer holds NaN fails its own request with 422 ``unsupported`` naming the
    input (JSON cannot carry NaN: it used to go out as null); the other requests of the same
    forward are answered. The fault is real: the torch model's embedding of one token is set
    to infinity, so any input holding that token answers NaN through the LayerNorm."""
    import torch

    from vllm_srun.runtime.errors import NonFiniteAnswer
    from vllm_srun.server.frontend.errors import CODE_TO_STATUS
    from vllm_srun.server.worker.metrics import WorkerMetrics

    bad_token = 2000
    torched = load_backend(resolve(L6), "torch")
    weights = dict(torched.module.named_parameters())  # the served module is traced: by name
    with torch.no_grad():
        weights[next(name for name in weights if name.endswith(
            "embeddings.word_embeddings.weight"))][bad_token] = float("inf")
    r = Runner(resolve(L6), torched, EngineArgs(num_threads=1))
    r.start()
    try:
        engine = r.engine
        blocker = engine.submit([LONG] * 16)  # the next two queue and share one forward
        good = engine.submit([[101, 7592, 102]])
        poisoned = engine.submit([[101, 7592, 102], [101, bad_token, 102]])
        blocker.result(timeout=60)
        assert np.isfinite(good.result(timeout=60)).all()
        with pytest.raises(NonFiniteAnswer, match="NaN or infinity for input 1") as caught:
            poisoned.result(timeout=60)
        assert CODE_TO_STATUS[caught.value.code] == 422 and engine.non_finite == 1
        page = WorkerMetrics("r").render(0, non_finite=engine.non_finite).decode()
        assert 'vllm_srun_non_finite_answers{replica="r"} 1.0' in page
        again = engine.submit([[101, 7592, 102]]).result(timeout=60)  # the engine serves on
        assert np.abs(again - good.result()).max() < 1e-5
    finally:
        r.stop()
        torched.close()


def test_a_worker_loaded_to_serve_is_frozen_for_the_collector_until_unloaded():
    """The objects a serving worker's load built are out of the cyclic collector's full
    passes while it serves, and back in them once the process drops it (a reload)."""
    from vllm_srun.server.worker.assembly import Worker
    from vllm_srun.server.worker.spec import WorkerSpec

    worker = Worker(WorkerSpec(L6, "onnxruntime", EngineArgs(num_threads=1, cache_entries=0),
                               budget=1, calibrate=False))
    runner = worker.load_to_serve()
    try:
        assert runner.ready and gc.get_freeze_count() > 0
        assert not any(o is runner.engine for o in gc.get_objects())
        assert runner.submit([words(5)])[0].result(timeout=60).shape == (1, 384)
    finally:
        runner.stop()
        worker.unload()
    assert gc.get_freeze_count() == 0
    assert any(o is runner.engine for o in gc.get_objects())
