"""R1.5 (as amended): a deployment's precision (float32 | bfloat16 | int8 | auto), admitted by a
quality gate against float32 at load; R4.9 (as amended): learning kept per precision.

No test asserts that a reduced precision is faster: CI runs on CPUs with and without the
matrix units (AMX, AVX-512 BF16), and ``auto`` measures."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import L3, L6, Server, poll, record_at_schema, run_cli, write_config
from vllm_srun.records.host_record import DriftEvent, HostRecord, Scope
from vllm_srun.records.schema import SCHEMA_VERSION
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.errors import ConfigError, Unsupported
from vllm_srun.runtime.precision import Precision, Trial, cpu_flags, fastest, missing_units
from vllm_srun.runtime.quality import GateThresholds, QualityFigures, figures, verdict
from vllm_srun.runtime.selection import choose
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.server.pool.config import validate

M = resolve(L6)
UNREACHABLE = GateThresholds(min_cosine=0.99999999)


class _Kept:
    """A backend ``choose`` may close but not discard: the fixture hands it to later tests."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __getattr__(self, name: str):
        if name == "discard":
            raise AttributeError(name)
        return getattr(self.backend, name)


@pytest.fixture(scope="module")
def torch_l6():
    """``load`` for ``choose``: each precision's torch backend of L6, loaded once."""
    cache: dict = {}

    def load(p):
        if p not in cache:
            cache[p] = _Kept(load_backend(M, "torch", precision=p))
        return cache[p]
    return load


# -- flag and config key ------------------------------------------------------------------

def _config(**dep) -> dict:
    return {"global": {"model_catalog": {"deployments": {"primary": {"artifact": L6,
                                                                       **dep}}}}}


def test_dtype_flag_writes_the_deployment_key():
    """R1.5, R6.2: ``--dtype`` writes ``dtype`` into the canonical config; a backend that does
    not run the precision is refused naming the key, the backend and the precision."""
    from vllm_srun.server.frontend.cli import build_parser, config_from_args

    args = build_parser().parse_args(["config", "show", "--backend", "torch", "--dtype",
                                      "bfloat16"])
    dep = config_from_args(args).deployments["primary"]
    assert (dep.backend, dep.dtype) == ("torch", "bfloat16")
    args = build_parser().parse_args(["config", "show", "--dtype", "bfloat16"])
    with pytest.raises(ConfigError, match=r"deployments\.primary\.dtype: backend onnxruntime "
                                          r"does not run precision bfloat16"):
        config_from_args(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["config", "show", "--dtype", "fp8"])


def test_quality_gate_flags_write_thresholds():
    from vllm_srun.server.frontend.cli import build_parser, config_from_args

    args = build_parser().parse_args(["config", "show", "--quality-gate-min-cosine", "0.9995",
                                      "--quality-gate-max-prob-diff", "0.1"])
    dep = config_from_args(args).deployments["primary"]
    assert dep.thresholds() == GateThresholds(min_cosine=0.9995, max_prob_diff=0.1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["config", "show", "--quality-gate-min-cosine", "2"])


@pytest.mark.parametrize(("dep", "message"), [
    ({"dtype": "fp8"}, "primary.dtype: Input should be 'float32', 'bfloat16', 'int8' or 'auto'"),
    ({"dtype": "bfloat16"}, "primary.dtype: backend onnxruntime does not run precision "
                            "bfloat16 (it runs float32, int8)"),
    ({"device": "cuda:0", "dtype": "int8"}, "primary.dtype: int8 runs on the CPU only, not on "
                                            "cuda:0"),
    ({"endpoint": "http://127.0.0.1:9", "model": L6, "dtype": "bfloat16"},
     "primary.dtype: dtype applies to managed workers"),
    ({"quality_gate": {"min_cosine": 1.5}}, "primary.quality_gate.min_cosine: Input should be "
                                            "less than or equal to 1"),
    ({"quality_gate": {"min_cosin": 0.9}}, "primary.quality_gate.min_cosin: unknown key"),
])
def test_bad_dtype_or_gate_keys_name_the_key(dep, message):
    with pytest.raises(ConfigError) as err:
        validate(_config(**dep))
    assert message in str(err.value)


def test_dtype_and_thresholds_reach_the_worker_spec():
    from vllm_srun.server.worker.spec import WorkerSpec

    dep = validate(_config(backend="torch", dtype="auto",
                           quality_gate={"min_cosine": 0.99, "max_prob_diff": 0.05})
                   ).deployments["primary"]
    assert dep.thresholds() == GateThresholds(min_cosine=0.99, max_prob_diff=0.05)
    spec = WorkerSpec(L6, "torch", EngineArgs(1), 2, dtype=dep.dtype,
                      quality_gate=dep.thresholds())
    assert WorkerSpec.from_json(spec.to_json()) == spec
    assert validate(_config()).deployments["primary"].dtype is None  # float32
    gpu = validate(_config(device="cuda:0", dtype="bfloat16")).deployments["primary"]
    assert gpu.dtype == "bfloat16"  # GPU replicas run torch, whatever the CPU backend


# -- the gate's figures and verdict -------------------------------------------------------

def test_verdict_names_the_figure_its_value_and_the_threshold():
    measured = QualityFigures(32, min_cosine=0.99981)
    assert verdict(measured, GateThresholds()) is None
    assert verdict(measured, UNREACHABLE) == (
        "quality gate: min_cosine 0.99981000 is below the threshold quality_gate.min_cosine "
        "0.99999999 (against float32 on 32 evaluation texts)")
    probs = QualityFigures(8, label_agreement=1.0, max_prob_diff=0.2)
    assert verdict(probs, GateThresholds()) is None  # reported, not a threshold by default
    assert "max_prob_diff 0.20000000 is above the threshold quality_gate.max_prob_diff 0.1" \
        in verdict(probs, GateThresholds(max_prob_diff=0.1))


def test_a_precision_that_answers_nan_is_refused_at_any_threshold():
    """A precision whose answers hold NaN is refused, however low the thresholds: a NaN
    cosine compares false with every threshold, so the gate used to pass it (seen on a Xeon
    with AMX: an int8 copy answered NaN on every shape at 16 threads). The fault is real: one
    weight of the bfloat16 copy's last LayerNorm set to NaN, which reaches every pooled
    vector."""
    import torch

    def load(p):
        backend = load_backend(M, "torch", precision=p)
        if p is Precision.BFLOAT16:
            # the last layer norm's weight (the served module is traced: found by name)
            norms = [p for name, p in backend.module.named_parameters()
                     if name.endswith("LayerNorm.weight")]
            with torch.no_grad():
                norms[-1][7] = float("nan")
        return backend

    backend, choice = choose(M, "torch", "bfloat16", GateThresholds(min_cosine=0.0), 1, load)
    backend.close()
    assert choice.refusal == ("quality gate: 32 of 32 evaluation texts answered NaN or "
                              "infinity (non_finite)")
    assert choice.measured["bfloat16"]["non_finite"] == 32


def test_a_classifier_with_nan_logits_is_refused_though_its_labels_agree():
    """np.argmax picks the first NaN as the label, so the labels of a NaN row may agree."""
    from vllm_srun.runtime.types import Manifest, Pooling, Task, TokenBatch

    m = Manifest("m", "/", "r", Task.CLASSIFY, Pooling.MEAN, True, 8, 2, "t")
    one = [TokenBatch(np.ones((2, 4), np.int64), np.ones((2, 4), np.int64))]
    ref = [np.array([[2.0, 0.0], [1.0, 0.0]], np.float32)]
    got = [np.array([[np.nan, 0.0], [1.0, 0.0]], np.float32)]
    c = figures(m, one, ref, got)
    assert c.label_agreement == 1.0 and c.non_finite == 1
    assert verdict(c, GateThresholds()) == (
        "quality gate: 1 of 2 evaluation texts answered NaN or infinity (non_finite)")
    assert figures(m, one, ref, ref).non_finite == 0


def test_thresholds_outside_0_1_are_refused():
    with pytest.raises(ValueError, match="quality_gate.min_cosine must be within 0..1"):
        GateThresholds(min_cosine=2.0)


# -- the gate on real models --------------------------------------------------------------

def test_bfloat16_passes_the_default_gate_and_says_so(torch_l6):
    """The built-in model in bfloat16 keeps a cosine of at least 0.999 to float32 on every
    evaluation text; a CPU without the bf16 units runs it too, with a warning naming them."""
    backend, choice = choose(M, "torch", "bfloat16", GateThresholds(), 1, torch_l6,
                             flags=frozenset({"avx2", "avx512f"}))
    assert choice.refusal is None and choice.precision is Precision.BFLOAT16
    assert backend.precision is Precision.BFLOAT16
    (measured,) = choice.measured.values()
    assert measured["texts"] == 32 and 0.999 <= measured["min_cosine"] < 1.0
    assert "lacks amx_bf16 and avx512_bf16" in choice.warning
    report = choice.report()
    assert report["quality_gate"]["thresholds"]["min_cosine"] == 0.999
    assert report["quality_gate"]["measured"]["bfloat16"] == measured


def test_bfloat16_keeps_no_float32_weights_once_chosen():
    """Memory: a bfloat16 worker's module has no float32 parameter or buffer left, and the
    float32 copy that answered the gate's reference is freed before ``choose`` returns (the
    test never collects garbage itself), so its weights do not stay resident beside the
    bfloat16 ones."""
    import weakref

    loaded = {}

    def load(p):
        backend = load_backend(M, "torch", precision=p)
        loaded[p] = weakref.ref(backend.module)
        return backend

    backend, choice = choose(M, "torch", "bfloat16", GateThresholds(min_cosine=0.0), 1, load)
    assert choice.precision is Precision.BFLOAT16 and set(loaded) == {Precision.FLOAT32,
                                                                      Precision.BFLOAT16}
    assert loaded[Precision.FLOAT32]() is None
    floats = {str(t.dtype) for t in [*backend.module.parameters(), *backend.module.buffers()]
              if t.is_floating_point()}
    assert floats == {"torch.bfloat16"}


def test_the_float32_reference_leaves_no_page_mapped_once_bfloat16_is_chosen():
    """The float32 copy that answered the gate's reference is gone from the process, its
    shared weights file unmapped: a frozen trace's graph outlives its module in torch's
    compilation unit, and it held every float32 weight as a constant (462 MB resident for a
    ModernBERT-base-shaped model in a bfloat16 worker) until ``release`` discarded it. In a
    fresh process: the suite's other backends map the same file."""
    code = f"""
import json
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.precision import Precision
from vllm_srun.runtime.quality import GateThresholds
from vllm_srun.runtime.selection import choose
from vllm_srun.runtime.weights import shared_state_path
m = resolve({L6!r})
backend, choice = choose(m, "torch", "bfloat16", GateThresholds(min_cosine=0.0), 1,
                         lambda p: load_backend(m, "torch", precision=p))
path = shared_state_path(m, Precision.FLOAT32)
maps = open("/proc/self/maps").read()
print(json.dumps({{"chosen": choice.precision.value, "written": path.is_file(),
                  "mapped": str(path) in maps}}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"chosen": "bfloat16", "written": True, "mapped": False}, got


def test_bfloat16_below_the_threshold_is_refused_and_auto_falls_back(torch_l6):
    _, refused = choose(M, "torch", "bfloat16", UNREACHABLE, 1, torch_l6)
    assert refused.precision is Precision.BFLOAT16
    assert refused.refusal.startswith("quality gate: min_cosine 0.99")
    assert "below the threshold quality_gate.min_cosine 0.99999999" in refused.refusal
    backend, auto = choose(M, "torch", "auto", UNREACHABLE, 1, torch_l6)
    assert auto.precision is Precision.FLOAT32 and auto.refusal is None
    assert backend.precision is Precision.FLOAT32
    assert "bfloat16 refused: quality gate: min_cosine" in auto.reason
    assert "int8 refused: quality gate: min_cosine" in auto.reason
    assert set(auto.measured) == {"bfloat16", "int8"}


def test_auto_chooses_among_what_passed_and_says_why(torch_l6):
    _, auto = choose(M, "torch", "auto", GateThresholds(), 1, torch_l6)
    passed = {p for p, m in auto.measured.items() if m["min_cosine"] >= 0.999}
    assert auto.precision.value in passed | {"float32"}
    assert auto.reason.startswith("fastest that passed the quality gate (")
    assert "float32" in auto.reason and " ms" in auto.reason


def test_auto_never_picks_a_precision_slower_than_float32():
    """On a CPU without the units a reduced precision can be slower: auto keeps float32, and
    a refused precision is never chosen however fast."""
    f32 = Trial(Precision.FLOAT32, None, 100.0)
    assert fastest([Trial(Precision.BFLOAT16, None, 180.0), f32])[0] is Precision.FLOAT32
    assert fastest([Trial(Precision.BFLOAT16, None, 97.0), f32])[0] is Precision.FLOAT32
    assert fastest([Trial(Precision.INT8, "quality gate: ...", 10.0), f32])[0] \
        is Precision.FLOAT32
    chosen, why = fastest([Trial(Precision.BFLOAT16, None, 40.0),
                           Trial(Precision.INT8, "quality gate: x", 20.0), f32])
    assert chosen is Precision.BFLOAT16 and "2.50x float32" in why and "int8 refused" in why


def test_cpu_units_are_read_from_cpuinfo():
    amd = "processor : 0\nflags : fpu avx2 avx512f avx512bw\n"
    xeon = "processor : 0\nflags : fpu avx512f avx512_bf16 amx_bf16 amx_int8 avx512_vnni\n"
    assert missing_units(Precision.BFLOAT16, cpu_flags(amd)) == ("amx_bf16", "avx512_bf16")
    assert missing_units(Precision.INT8, cpu_flags(amd)) == ("amx_int8", "avx512_vnni",
                                                             "avx_vnni")
    assert missing_units(Precision.BFLOAT16, cpu_flags(xeon)) == ()
    assert missing_units(Precision.FLOAT32, cpu_flags(amd)) == ()


def test_a_precision_the_backend_does_not_run_is_refused(torch_l6):
    with pytest.raises(Unsupported, match="backend onnxruntime does not run precision "
                                          "bfloat16"):
        load_backend(M, "onnxruntime", precision="bfloat16")
    with pytest.raises(Unsupported, match="backend onnxruntime does not run precision "
                                          "bfloat16"):
        choose(M, "onnxruntime", "bfloat16", GateThresholds(), 1, torch_l6)


def test_onnxruntime_int8_is_quantized_once_beside_the_export_and_gated():
    from vllm_srun.runtime.export import quantized_path

    m = resolve(L3)
    _, choice = choose(m, "onnxruntime", "int8", GateThresholds(), 1,
                       lambda p: load_backend(m, "onnxruntime", precision=p))
    path = quantized_path(m)
    made = path.stat().st_mtime_ns
    measured = choice.measured["int8"]
    assert 0.0 < measured["min_cosine"] <= 1.0
    assert (choice.refusal is None) == (measured["min_cosine"] >= 0.999)
    backend = load_backend(m, "onnxruntime", precision="int8")
    assert backend.onnx_path == str(path) and path.stat().st_mtime_ns == made


def test_classifier_rerank_and_token_figures(classifier_dir, cross_encoder_dir,
                                             token_classifier_dir):
    """Each task's figures on real (tiny) models in bfloat16 against float32."""
    out = {}
    for folder in (classifier_dir, cross_encoder_dir, token_classifier_dir):
        m = resolve(str(folder))
        _, choice = choose(m, "torch", "bfloat16", GateThresholds(), 1,
                           lambda p, m=m: load_backend(m, "torch", precision=p))
        out[m.task.value] = choice.measured["bfloat16"]
    assert {t: o.pop("non_finite") for t, o in out.items()} == dict.fromkeys(out, 0)
    assert set(out["classify"]) == {"texts", "label_agreement", "max_prob_diff"}
    assert 0.0 <= out["classify"]["label_agreement"] <= 1.0
    assert 0.0 <= out["classify"]["max_prob_diff"] < 1.0
    assert set(out["rerank"]) == {"texts", "order_agreement"} and out["rerank"]["texts"] == 32
    assert set(out["token_classify"]) == {"texts", "label_agreement", "span_agreement"}


def test_figures_of_each_task_on_known_outputs():
    from vllm_srun.runtime.quality import QUERIES
    from vllm_srun.runtime.types import Manifest, Pooling, Task, TokenBatch

    def manifest(task, labels=()):
        return Manifest("m", "/", "r", task, Pooling.MEAN, True, 8, 2, "t", labels=labels)

    one = [TokenBatch(np.ones((2, 4), np.int64), np.ones((2, 4), np.int64))]
    ref = [np.array([[2.0, 0.0], [0.0, 1.0]], np.float32)]
    got = [np.array([[1.0, 0.2], [0.3, 0.1]], np.float32)]
    c = figures(manifest(Task.CLASSIFY), one, ref, got)
    assert c.label_agreement == 0.5 and c.max_prob_diff == pytest.approx(0.2809, abs=1e-3)
    scores = np.arange(QUERIES * 3, dtype=np.float32).reshape(-1, 1)
    swapped = scores.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # one pair of the first query's 3 pairs
    r = figures(manifest(Task.RERANK), one, [scores], [swapped])
    assert r.order_agreement == pytest.approx(1 - 1 / (QUERIES * 3))
    labels = ("O", "B-PER", "I-PER")
    tokens = np.zeros((1, 6, 3), np.float32)
    tokens[0, [1, 2, 3], [1, 2, 0]] = 5.0  # [CLS] B-PER I-PER O O [SEP]
    moved = tokens.copy()
    moved[0, 2] = [5.0, 0, 0]  # the span ends a token early
    six = [TokenBatch(np.ones((1, 6), np.int64), np.ones((1, 6), np.int64))]
    t = figures(manifest(Task.TOKEN_CLASSIFY, labels), six, [tokens], [moved])
    assert t.span_agreement == 0.0 and t.label_agreement == 0.75


# -- the record: migration and learning per precision -------------------------------------

def _old_record(path) -> None:
    """A host record as schema 3 wrote it, with one row in every table."""
    conn = record_at_schema(path, 3)
    key = ("host", "rev", "torch")
    conn.execute("INSERT INTO workers VALUES (?, ?, ?, 'm', 1, 1, '[1, 2]', 0)", key)
    conn.execute("INSERT INTO golden VALUES (?, ?, ?, 'digest', 0)", key)
    conn.execute("INSERT INTO timings VALUES (?, ?, ?, 64, 2, '[1.5]', 0)", key)
    conn.execute("INSERT INTO learned VALUES (?, ?, ?, 64, 2, 1.4, 3, 0)", key)
    conn.execute("INSERT INTO vouchers (fingerprint, revision, backend, source, comparisons,"
                 " mismatches, created_at) VALUES (?, ?, ?, 'traffic', 5, 0, 0)", key)
    conn.execute("INSERT INTO drift (fingerprint, revision, backend, padded_tokens, "
                 "served_threads, shadow_threads, first_index, served_value, shadow_value, "
                 "created_at) VALUES (?, ?, ?, 7, 1, 2, '[0, 0]', 0.0, 1.0, 0)", key)
    conn.close()


def test_an_old_record_migrates_its_rows_to_float32(tmp_path):
    """R4.9: schema 4 keys every table by precision; rows written before are float32's."""
    path = tmp_path / "r.sqlite"
    _old_record(path)
    record = HostRecord(path)
    assert record.quarantined is None
    version = sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0]
    assert version == SCHEMA_VERSION == 6
    f32, bf16 = Scope("host", "rev", "torch"), Scope("host", "rev", "torch", "bfloat16")
    assert f32.precision == "float32" and record.scopes() == [f32]
    assert record.worker(f32) == {"model": "m", "mode": 1, "configured": 1, "counts": [1, 2]}
    assert record.golden(f32) == "digest" and record.timings(f32) == {64: {2: [1.5]}}
    assert record.learned(f32)[64]["num_threads"] == 2
    assert record.voucher(f32).comparisons == 5 and record.drift(f32).padded_tokens == 7
    assert (record.golden(bf16), record.timings(bf16), record.learned(bf16),
            record.drift(bf16), record.voucher(bf16).comparisons) == (None, {}, {}, None, 0)
    record.put_learned(bf16, 64, 1, 1.1, 1)  # same range, other precision: its own row
    record.put_golden(bf16, "other")
    assert record.learned(f32)[64]["num_threads"] == 2 and record.golden(f32) == "digest"
    assert record.learned(bf16)[64]["num_threads"] == 1


def test_a_bfloat16_drift_retires_bfloat16_learning_only(tmp_path):
    """R4.9: a worker serving bfloat16 keys its scope by the precision; a drift recorded
    there retires it, and float32's learning in the same record file is untouched."""
    import torch  # noqa: F401  (its builds are part of the torch fingerprint)

    from vllm_srun.runtime.host import host_fingerprint
    from vllm_srun.server.worker.assembly import Worker
    from vllm_srun.server.worker.spec import WorkerSpec
    from vllm_srun.tuner.modes import AdaptiveMode

    path = tmp_path / "r.sqlite"
    fingerprint, _ = host_fingerprint("torch", 2)
    f32 = Scope(fingerprint, M.revision, "torch")
    bf16 = Scope(fingerprint, M.revision, "torch", "bfloat16")
    record = HostRecord(path)
    record.put_learned(f32, 64, 2, 1.5, 3)
    record.record_drift(bf16, DriftEvent(7, 1, 2, (0, 0), 0.0, 1.0))
    worker = Worker(WorkerSpec(L6, "torch", EngineArgs(1, cache_entries=0), 2,
                               AdaptiveMode.LEARN, record_path=str(path), dtype="bfloat16",
                               calibrate=False))
    runner = worker.load()
    try:
        assert runner.ready and worker.tuner.sync.scope == bf16
        assert worker.tuner.ledger.retired is not None
        assert worker.threads_report(runner)["scope"]["precision"] == "bfloat16"
    finally:
        runner.stop()
    fresh = HostRecord(path)
    assert fresh.drift(f32) is None and fresh.learned(f32)[64]["num_threads"] == 2
    assert fresh.golden(bf16) is not None and fresh.golden(f32) is None


def test_threads_reset_takes_the_precision(tmp_path):
    from vllm_srun.runtime.budget import cpu_budget
    from vllm_srun.runtime.host import host_fingerprint

    path = tmp_path / "r.sqlite"
    fingerprint, _ = host_fingerprint("onnxruntime", cpu_budget())
    m = resolve(L3)
    scopes = {p: Scope(fingerprint, m.revision, "onnxruntime", p) for p in ("float32", "int8")}
    record = HostRecord(path)
    for scope in scopes.values():
        record.put_learned(scope, 64, 2, 1.5, 3)
    r = run_cli("threads", "reset", L3, "--dtype", "int8", "--record", str(path))
    assert r.returncode == 0, r.stderr
    assert "precision int8" in r.stdout
    assert record.learned(scopes["int8"]) == {} and 64 in record.learned(scopes["float32"])
    r = run_cli("threads", "reset", L3, "--dtype", "bfloat16", "--record", str(path))
    assert r.returncode == 2 and "backend onnxruntime does not run precision bfloat16" \
        in r.stderr


# -- served: /health and /v1/models -------------------------------------------------------

def test_models_report_the_choice_and_a_refused_worker_stays_out(tmp_path):
    """R1.5: a bfloat16 deployment whose gate cannot pass stays out of dispatch with the
    gate's reason (as a failed golden check does); an auto deployment with the same gate
    falls back to float32 in its worker process; /v1/models says which, why, and the
    thresholds and figures."""
    gate = {"min_cosine": 0.99999999}
    # limits set: no calibration at start (not what this test is about)
    ENGINE = {"num_threads": 1, "max_num_seqs": 8, "max_num_batched_tokens": 256}  # noqa: N806
    config = write_config(tmp_path / "config.yaml", {
        "gated": {"artifact": L6, "backend": "torch", "dtype": "bfloat16",
                  "quality_gate": gate, "engine": ENGINE},
        "auto": {"artifact": L6, "backend": "torch", "dtype": "auto", "quality_gate": gate,
                 "replicas": [{"device": "cpu"}], "engine": ENGINE}},
        bound="gated")
    server = Server("--config", str(config))
    try:
        def settled():
            data = server.client.get("/v1/models").json()["data"]
            entries = {e["deployment"]: e for e in data}
            return entries if all("precision" in e for e in entries.values()) else None
        entries = poll(settled, 180, 0.2)
        assert entries is not None, server.client.get("/v1/models").text
        gated, auto = entries["gated"]["precision"], entries["auto"]["precision"]
        assert entries["gated"]["dtype"] == "bfloat16" and entries["auto"]["dtype"] == "auto"
        assert gated["chosen"] == "bfloat16"
        assert "below the threshold quality_gate.min_cosine 0.99999999" in gated["refused"]
        assert gated["quality_gate"]["thresholds"]["min_cosine"] == 0.99999999
        assert 0.99 < gated["quality_gate"]["measured"]["bfloat16"]["min_cosine"] < 0.99999999
        assert (auto["requested"], auto["chosen"]) == ("auto", "float32")
        assert "bfloat16 refused" in auto["reason"] and "refused" not in auto
        health = server.client.get("/health")
        assert health.status_code == 503
        assert "quality gate: min_cosine" in health.json()["error"]["message"]
        r = server.client.post("/v1/embeddings", json={"model": "gated", "input": "hi"})
        assert r.status_code == 503 and "quality gate" in r.text
        r = server.client.post("/v1/embeddings", json={"model": "auto", "input": "hi"})
        assert r.status_code == 200, r.text
    finally:
        server.close()
