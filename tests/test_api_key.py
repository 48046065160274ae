"""The API key end to end (issue 11 item 4): a pool attaches a protected vllm-srun with the key
from the environment variable its config names (never the key in the file); a wrong or
missing key is a clear ``unauthorized`` replica, not a permanent ``incompatible``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import L3, Server, wait_until
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.server.pool.config import check_endpoint_keys, validate

UPSTREAM_KEY = "upstream-secret-1"


def attached(endpoint: str, key_env: str | None) -> dict:
    replica = {"endpoint": endpoint, "model": L3}
    if key_env:
        replica["api_key_env"] = key_env
    return {"artifact": L3, "replicas": [replica]}


def doc(deployments: dict, bound: str) -> dict:
    return {"global": {"model_catalog": {"deployments": deployments},
                       "system": {"decision_model": {"deployment": bound}}}}


@pytest.mark.parametrize(("replica", "says"), [
    ({"device": "cpu", "api_key_env": "K"}, "api_key_env is for attached replicas"),
    ({"endpoint": "http://x:1", "model": "m", "api_key_env": "sk-abc def"},
     "names an environment variable"),
])
def test_api_key_env_is_validated_naming_the_key(replica, says):
    with pytest.raises(ConfigError, match=r"replicas\[0\].*" + says):
        validate(doc({"d": {"artifact": L3, "replicas": [replica]}}, "d"), "config.yaml")


def test_an_unset_key_variable_is_a_startup_error_naming_key_and_variable(tmp_path,
                                                                          monkeypatch):
    monkeypatch.delenv("NOT_SET_KEY", raising=False)
    config = validate(doc({"d": attached("http://127.0.0.1:9", "NOT_SET_KEY")}, "d"), "c")
    with pytest.raises(ConfigError, match=r"deployments\.d\.replicas\[0\]\.api_key_env: "
                                          r"environment variable NOT_SET_KEY is not set"):
        check_endpoint_keys(config)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc({"d": attached("http://127.0.0.1:9", "NOT_SET_KEY")},
                                       "d")))
    out = subprocess.run([sys.executable, "-m", "vllm_srun.server", "serve", "--config",
                          str(path), "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "NOT_SET_KEY is not set" in out.stderr


def test_a_protected_endpoint_is_reached_with_its_key_and_refused_clearly_without(tmp_path):
    upstream = Server(L3, "--threads", "1", env={"VLLM_SRUN_API_KEY": UPSTREAM_KEY})
    front = None
    try:
        upstream.wait_ready()
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump(doc({
            "good": attached(upstream.url, "UP_KEY"),
            "wrong": attached(upstream.url, "UP_WRONG"),
            "none": attached(upstream.url, None)}, "good")))
        front = Server("--config", str(config), env={"UP_KEY": UPSTREAM_KEY,
                                                     "UP_WRONG": "not-the-key-1"})

        def settled():
            deps = {d["name"]: d["replicas"][0]
                    for d in front.client.get("/v1/inventory").json()["deployments"]}
            return deps if all(r["state"] in ("ready", "unauthorized")
                               for r in deps.values()) else None

        deps = wait_until(settled, 120, "attached replicas settled")
        assert deps["good"]["state"] == "ready"
        assert deps["wrong"]["state"] == "unauthorized"
        assert "refused the API key from api_key_env" in deps["wrong"]["reason"]
        assert deps["none"]["state"] == "unauthorized"
        assert "set api_key_env" in deps["none"]["reason"]
        r = front.client.post("/v1/embeddings", json={"model": "good", "input": "hello"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        r = front.client.post("/v1/embeddings", json={"model": "wrong", "input": "hello"})
        assert r.status_code == 503 and "unauthorized" in r.json()["error"]["message"]
    finally:
        if front is not None:
            front.close()
        upstream.close()
