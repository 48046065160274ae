"""GPU workers, run on the CPU (R1.4): every GPU code path of the pool and the worker runs here
with each vendor's device names, through the test-only launcher's ``--fake-gpus VENDOR`` (R9.2:
a machine of two GPUs of that one vendor, device 0 with 8 GiB free and device 1 with 2 GiB;
torch's CPU device stands in for the GPU each worker asks for, and the launcher notes which it
was). Only the two calls in ``vllm_srun.runtime.device`` that need a real GPU are left to
``bench/gpu_check``."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.conftest import L6, Server, wait_until
from vllm_srun.runtime.device import parse_device, torch_device


@pytest.mark.parametrize(("name", "want"), [("cpu", "cpu"), ("cuda:0", "cuda:0"),
                                            ("rocm:0", "cuda:0"), ("rocm:3", "cuda:3")])
def test_one_function_names_every_device_for_torch(name, want):
    assert torch_device(name) == want


@pytest.mark.parametrize("bad", ["rocm", "gpu:0", "cuda:x", "cpu:0", "ROCM:0", ""])
def test_a_bad_device_name_is_refused_with_the_name(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        parse_device(bad)


def ready_replicas(server: Server, what: str) -> list[dict]:
    def ready():
        reps = server.client.get("/v1/inventory").json()["deployments"][0]["replicas"]
        return reps if all(r["state"] == "ready" for r in reps) else None

    return wait_until(ready, 120, what)


def gpu_notes(log) -> set[tuple[str, str, str]]:
    """(replica, what, device) for each device a worker asked torch or the driver for."""
    return {(n["who"], k, n[k]) for n in map(json.loads, log.read_text().splitlines())
            for k in ("torch_device", "free_bytes_of") if k in n}


def test_headline_rocm_dp2_starts_calibrates_and_answers_like_the_cpu(tmp_path, reference):
    """The seed's headline ``serve MODEL --platform rocm -dp 2 --device-ids 0,1``: two GPU
    workers start (the ROCm name once crash-looped calibration), each asks torch for its own
    device through the ``cuda`` API (``rocm:1`` -> ``cuda:1``), calibrates its token budget
    from its own device's free memory (8 GiB: 32,768 tokens; 2 GiB: 8,192: half the free
    memory at 4 x 64 x 384 bytes a token, as a power of two), and answers as the CPU does."""
    log = tmp_path / "gpus.jsonl"
    server = Server(L6, "--platform", "rocm", "-dp", "2", "--device-ids", "0,1",
                    fake_gpus="rocm", gpu_log=log).wait_ready()
    try:
        reps = ready_replicas(server, "both rocm workers ready")
        got = server.client.post("/v1/embeddings", json={"input": reference[0]}).json()
    finally:
        server.close()
    assert [(r["id"], r["device"], r["kind"], r["restarts"]) for r in reps] == [
        ("primary-0", "rocm:0", "gpu", 0), ("primary-1", "rocm:1", "gpu", 0)]
    assert [r["limits"]["max_num_batched_tokens"] for r in reps] == [32768, 8192]
    assert gpu_notes(log) == {("primary-0", "torch_device", "cuda:0"),
                              ("primary-0", "free_bytes_of", "rocm:0"),
                              ("primary-1", "torch_device", "cuda:1"),
                              ("primary-1", "free_bytes_of", "rocm:1")}
    rows = np.array([d["embedding"] for d in got["data"]], dtype=np.float32)
    assert np.abs(rows - reference[1]).max() < 1e-5


def test_two_cuda_replicas_of_one_deployment_behind_one_dispatch(tmp_path, reference):
    """A config's replicas on ``cuda:1`` and ``cuda:0``: each worker asks torch for the device
    its replica names, and one dispatch spreads requests over both."""
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"global": {"model_catalog": {"deployments": {"primary": {
        "artifact": L6, "backend": "torch", "replicas": [{"device": "cuda:1"},
                                                         {"device": "cuda:0"}],
        "engine": {"max_num_seqs": 16}}}}}}))
    log = tmp_path / "gpus.jsonl"
    server = Server("--config", str(config), fake_gpus="cuda", gpu_log=log).wait_ready()
    try:
        reps = ready_replicas(server, "both GPU workers ready")
        seen = set()
        for text, want in zip(*reference, strict=True):
            r = server.client.post("/v1/embeddings", json={"input": text})
            seen.add(r.headers["x-vllm-srun-replica"])
            assert np.abs(np.array(r.json()["data"][0]["embedding"]) - want).max() < 1e-5
    finally:
        server.close()
    assert [(r["id"], r["device"], r["kind"]) for r in reps] == [
        ("primary-0", "cuda:1", "gpu"), ("primary-1", "cuda:0", "gpu")]
    assert [(r["limits"]["max_num_seqs"], r["limits"]["max_num_batched_tokens"])
            for r in reps] == [(16, 8192), (16, 32768)]
    assert gpu_notes(log) == {("primary-0", "torch_device", "cuda:1"),
                              ("primary-0", "free_bytes_of", "cuda:1"),
                              ("primary-1", "torch_device", "cuda:0"),
                              ("primary-1", "free_bytes_of", "cuda:0")}
    assert seen == {"primary-0", "primary-1"}


def test_a_config_naming_the_other_vendor_is_refused_before_any_worker_starts(tmp_path):
    """On a ROCm machine a config that also names ``cuda:0`` is refused at start, naming the
    key and what the machine has; no worker asked for any device."""
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"global": {"model_catalog": {"deployments": {"primary": {
        "artifact": L6, "backend": "torch", "replicas": [{"device": "rocm:0"},
                                                         {"device": "cuda:0"}]}}}}}))
    log = tmp_path / "gpus.jsonl"
    with pytest.raises(RuntimeError) as refused:
        Server("--config", str(config), fake_gpus="rocm", gpu_log=log)
    assert "global.model_catalog.deployments.primary.replicas[1].device: cuda:0 is not " \
           "available on this machine (0 cuda device(s) visible)" in str(refused.value)
    assert not log.exists()


@pytest.fixture(scope="module")
def reference():
    """Texts and their embeddings from the torch backend on the CPU, in this process."""
    from vllm_srun.runtime.runner import Runner
    from vllm_srun.runtime.types import EngineArgs

    texts = [f"a sentence for the gpu path number {i} " + "word " * i for i in range(6)]
    runner = Runner.load(L6, "torch", EngineArgs(num_threads=1))
    runner.start()
    try:
        future, _tokens = runner.submit(texts, False, time.monotonic() + 60)
        rows = future.result(60)
    finally:
        runner.stop()
    return texts, np.asarray(rows, dtype=np.float32)
