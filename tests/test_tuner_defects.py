"""Five defects of the tuner found by reading it (R4.5, R4.7), each guarded here: a text
pair's shadow got no token type ids, the shadow budget banked idle time, contention flapped
between its start and end thresholds, ``/proc`` was read on the served path, and the shadow
process's death, hang or zombie stopped learning for good or blocked ``close``.

Real parts: the worker assembly a deployment runs (``Worker``: the real ``ShadowProcess``
child, ``FreeCpus`` over the real ``/proc``), real tiny models, real signals. A fake clock
only where time itself is the input (the budget)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FAST, wait_for
from vllm_srun.records.host_record import HostRecord
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.server.worker.assembly import Worker
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.tuner.adaptive import TunerSettings
from vllm_srun.tuner.modes import AdaptiveMode

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, signals")

QUERY = "where does Maria live?"
DOCUMENTS = ["Maria lives in Berlin.", "The quick brown fox jumps over the lazy dog.",
             "Paris is a city in France.", "She moved to London last year."]


def worker(model: str, tmp_path: Path, mode: AdaptiveMode = AdaptiveMode.LEARN,
           settings: TunerSettings = FAST):
    """A worker assembled as a deployment assembles it (``Worker``: shadows in a real
    ``SCHED_IDLE`` child process, free cores read from ``/proc``), 1 thread configured,
    counts 1 and 2; returns it and its started runner."""
    spec = WorkerSpec(model, "onnxruntime", EngineArgs(num_threads=1, cache_entries=0),
                      budget=2, mode=mode, record_path=str(tmp_path / "record.sqlite"),
                      settings=settings, calibrate=False)
    made = Worker(spec)
    runner = made.load()
    assert runner.ready, runner.not_ready_reason
    return made, runner


# -- 1. a text pair's shadow gets every input the served forward got (R4.5, R4.7) ----------

def test_a_cross_encoders_pair_shadows_match_the_served_answer_and_record_no_drift(
        cross_encoder_dir, tmp_path):
    """R4.5, R4.7: the shadow process got only ``input_ids`` and ``attention_mask``; a
    cross-encoder's shadow then ran with zero token type ids, answered differently, and the
    drift it recorded retired learning for the whole host for good. Mode 1, a real BERT
    cross-encoder (tests/tiny_models.py) on text pairs: every shadow reproduces the served
    answer, nothing drifts, and the type ids do matter to this model."""
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.threads import ThreadContext
    from vllm_srun.runtime.types import TokenBatch
    from vllm_srun.tuner.adaptive import output_bits

    made, runner = worker(str(cross_encoder_dir), tmp_path)
    tuner = made.tuner
    try:
        for i in range(6):
            pairs = [(f"{QUERY} {i}", d) for d in DOCUMENTS]
            runner.submit(pairs)[0].result(timeout=60)
            wait_for(lambda i=i: tuner.comparisons > i or tuner.retired, 30)
        # (compared, timed or not: on a loaded host most shadows wait for CPUs, untimed)
        assert wait_for(lambda: tuner.comparisons >= 6 or tuner.retired, 120)
        assert tuner.retired is None and tuner.comparisons >= 6, tuner.comparisons
        # the shadow process's answer to a pair batch, bit for bit the served path's
        encoded = runner.tokenizer.rows([(QUERY, d) for d in DOCUMENTS])
        batch = pad(encoded.ids, encoded.type_ids)
        assert batch.token_type_ids is not None and batch.token_type_ids.any()
        served = load_backend(made.manifest, "onnxruntime")
        context = ThreadContext()
        reference = context.run(1, lambda: served.forward(batch, 1)).outputs
        context.shutdown()
        shadows = tuner.shadow_forward.__self__
        for n in (1, 2):
            shadow = shadows.forward(batch, n).outputs
            assert np.array_equal(output_bits(shadow), output_bits(reference))
        untyped = shadows.forward(TokenBatch(batch.input_ids, batch.attention_mask), 1)
        assert not np.array_equal(untyped.outputs, reference)  # the type ids matter here
    finally:
        runner.stop()
    assert HostRecord(tmp_path / "record.sqlite").drift(tuner.scope) is None
