"""GPU workers, run on the CPU (R1.4, issue 11 item 3): every GPU code path of the pool and the
worker runs here with both vendors' device names, through the test-only launcher's
``--fake-gpus`` (torch's CPU device stands in for the GPU, and the device reports 8 GiB free).
Only the two calls in ``vllm_srun.runtime.device`` that need a real GPU are left to
``bench/gpu_check``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.conftest import L6, Server, wait_until
from vllm_srun.runtime.calibrate import gpu_tokens
from vllm_srun.runtime.device import parse_device, torch_device


@pytest.mark.parametrize(("name", "want"), [("cpu", "cpu"), ("cuda:0", "cuda:0"),
                                            ("rocm:0", "cuda:0"), ("rocm:3", "cuda:3")])
def test_one_function_names_every_device_for_torch(name, want):
    assert torch_device(name) == want


@pytest.mark.parametrize("bad", ["rocm", "gpu:0", "cuda:x", "cpu:0", "ROCM:0", ""])
def test_a_bad_device_name_is_refused_with_the_name(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        parse_device(bad)


def test_headline_rocm_dp2_starts_calibrates_and_answers_like_the_cpu(reference):
    """The seed's headline ``serve MODEL --platform rocm -dp 2 --device-ids 0,1``: two GPU
    workers start (the ROCm name once crash-looped calibration), calibrate their token budget
    from free memory, and answer as the CPU does."""
    server = Server(L6, "--platform", "rocm", "-dp", "2", "--device-ids", "0,1",
                    fake_gpus=True).wait_ready()
    try:
        def ready():
            reps = server.client.get("/v1/inventory").json()["deployments"][0]["replicas"]
            return reps if all(r["state"] == "ready" for r in reps) else None

        reps = wait_until(ready, 120, "both rocm workers ready")
        assert [(r["device"], r["kind"], r["restarts"]) for r in reps] == [
            ("rocm:0", "gpu", 0), ("rocm:1", "gpu", 0)]
        expected = gpu_tokens(8 << 30, 384, 256)
        assert {r["limits"]["max_num_batched_tokens"] for r in reps} == {expected}
        got = server.client.post("/v1/embeddings", json={"input": reference[0]}).json()
        rows = np.array([d["embedding"] for d in got["data"]], dtype=np.float32)
        assert np.abs(rows - reference[1]).max() < 1e-5
    finally:
        server.close()


def test_cuda_and_rocm_replicas_of_one_deployment_behind_one_dispatch(tmp_path, reference):
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"global": {"model_catalog": {"deployments": {"primary": {
        "artifact": L6, "backend": "torch", "replicas": [{"device": "cuda:0"},
                                                         {"device": "rocm:1"}],
        "engine": {"max_num_seqs": 16}}}}}}))
    server = Server("--config", str(config), fake_gpus=True).wait_ready()
    try:
        def ready():
            reps = server.client.get("/v1/inventory").json()["deployments"][0]["replicas"]
            return reps if all(r["state"] == "ready" for r in reps) else None

        reps = wait_until(ready, 120, "both GPU workers ready")
        assert {r["kind"] for r in reps} == {"gpu"}
        assert all(r["limits"]["max_num_seqs"] == 16 for r in reps)
        seen = set()
        for text, want in zip(*reference, strict=True):
            r = server.client.post("/v1/embeddings", json={"input": text})
            seen.add(r.headers["x-vllm-srun-replica"])
            assert np.abs(np.array(r.json()["data"][0]["embedding"]) - want).max() < 1e-5
        assert seen == {"primary-0", "primary-1"}
    finally:
        server.close()


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
