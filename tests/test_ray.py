"""vllm-srun on Ray Serve (issue: past one machine): two engines under ray.init(num_cpus=2).
Answers equal a local server's, our bytes router spreads load, each actor sees its thread
budget. Skipped only where ``ray`` is not installed (CI installs the extra)."""

from __future__ import annotations

import collections
import importlib.util
import socket

import numpy as np
import pytest

from tests.conftest import L6

# found, not imported: importing ray at collection would load its libraries into every test
pytestmark = [pytest.mark.required_in_ci,  # .ci/run installs the ray extra
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed: pip install 'vllm-srun[ray]'")]

RAY_KEY = "ray-app-secret-1"
TEXTS = [f"ray request {i} " + "word " * (i % 30) for i in range(40)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    import ray
    from ray import serve

    # the actors' environment carries the key, as the Secret does on KubeRay
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {"VLLM_SRUN_API_KEY": RAY_KEY}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    from tests.conftest import write_config
    from vllm_srun.server.frontend.ray_serve import app_builder

    config = write_config(tmp_path_factory.mktemp("cfg") / "config.yaml", {"primary": {
        "artifact": L6, "replicas": [{"device": "cpu"}] * 2,
        "engine": {"num_threads": 1}}})
    app = app_builder({"config": str(config), "bytes_router": True})  # the same config.yaml
    handle = serve.run(app, name="vllm-srun", route_prefix="/")
    yield handle, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_answers_equal_a_local_server_and_load_spreads(ray_app, l6_server):
    import asyncio

    handle, _ = ray_app

    async def burst():
        return await asyncio.gather(*(handle.embed.remote([t]) for t in TEXTS))

    results = asyncio.run(burst())
    local = l6_server.client.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]
    for got, want in zip(results, local, strict=True):
        assert np.allclose(got["data"][0], want["embedding"], atol=1e-6)
    per_replica = collections.Counter(r["replica"] for r in results)
    assert len(per_replica) == 2 and min(per_replica.values()) >= len(TEXTS) // 4, per_replica
    assert {(r["budget"], r["threads"]) for r in results} == {(1, 1)}  # num_cpus=1 each


def test_http_through_rays_proxy_reaches_the_openai_api(ray_app):
    import httpx

    _, url = ray_app
    auth = {"authorization": f"Bearer {RAY_KEY}"}
    r = httpx.post(url + "/v1/embeddings", json={"input": ["hello", "world"]}, headers=auth,
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    bad = httpx.post(url + "/v1/embeddings", json={"input": []}, headers=auth, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


def test_the_ray_app_honours_the_api_key_on_the_path_rays_proxy_routes(ray_app):
    """Issue 11 item 4: $VLLM_SRUN_API_KEY guards HTTP through Ray's proxy as it guards
    vllm-srun serve; /health stays open for probes."""
    import httpx

    _, url = ray_app
    for headers in ({}, {"authorization": "Bearer wrong-key-123"}):
        r = httpx.post(url + "/v1/embeddings", json={"input": "hello"}, headers=headers,
                       timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert httpx.get(url + "/health", timeout=60).status_code == 200


def test_bytes_router_reserves_on_choice_and_releases_on_completion():
    """The router's own bookkeeping, driven with Ray's own objects' shape."""
    import asyncio
    from types import SimpleNamespace

    from vllm_srun.server.frontend.ray_serve import FewestBytesRouter

    router = FewestBytesRouter.__new__(FewestBytesRouter)
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=f"r{i}") for i in range(2)]

    def pending(i, texts):
        return SimpleNamespace(args=(texts,), kwargs={},
                               metadata=SimpleNamespace(internal_request_id=f"q{i}"))

    async def choose(i, texts):
        return (await router.choose_replicas(replicas, pending(i, texts)))[0][0].replica_id

    first = asyncio.run(choose(0, ["x" * 1000]))
    second = asyncio.run(choose(1, ["y" * 10]))  # reserved bytes steer it away at once
    third = asyncio.run(choose(2, ["z" * 10]))
    assert first != second and third == second
    router.on_request_completed(first, "q0")
    assert router.outstanding[first] == 0
    assert asyncio.run(choose(3, ["w"])) == first
