"""Small seed-conformance rules with real processes (issue 11 item 7): the replica header on
error answers too; a replica serving another artifact revision than its deployment is
``incompatible``; a pooled worker refused by its golden check shows the reason in inventory
and ``/health``, and is not restarted into the same refusal."""

from __future__ import annotations

import shutil
import sqlite3

import yaml

from tests.conftest import L3, Server, wait_until, words


def config_file(path, deployments: dict, bound: str) -> str:
    path.write_text(yaml.safe_dump({"global": {"model_catalog": {"deployments": deployments},
                                               "system": {"decision_model":
                                                          {"deployment": bound}}}}))
    return str(path)


def replicas(server: Server, deployment: str) -> list[dict]:
    inv = server.client.get("/v1/inventory").json()
    return next(d for d in inv["deployments"] if d["name"] == deployment)["replicas"]


def test_error_answers_name_the_replica_that_gave_them(tmp_path):
    server = Server("--config", config_file(tmp_path / "c.yaml", {"primary": {
        "artifact": L3, "replicas": [{"device": "cpu"}] * 2,
        "engine": {"num_threads": 1}}}, "primary"))
    try:
        server.wait_ready()
        wait_until(lambda: all(r["state"] == "ready" for r in replicas(server, "primary")),
                   120, "both replicas ready")
        seen = set()
        for _ in range(4):
            r = server.client.post("/v1/embeddings", json={"input": words(400)})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
            seen.add(r.headers["x-vllm-srun-replica"])
        assert seen == {"primary-0", "primary-1"}
    finally:
        server.close()


def test_a_replica_serving_another_revision_is_incompatible(tmp_path, classifier_dir):
    """An attached endpoint serving the same model name from other weights: its revision
    differs from the deployment's, so it is kept out of dispatch with both revisions named."""
    from safetensors.numpy import load_file, save_file

    ours = tmp_path / "a" / "model"
    theirs = tmp_path / "b" / "model"
    shutil.copytree(classifier_dir, ours)
    shutil.copytree(classifier_dir, theirs)
    weights = load_file(theirs / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1.0  # other weights, same shapes and name
    save_file(weights, theirs / "model.safetensors", metadata={"format": "pt"})
    upstream = Server(str(theirs), "--threads", "1")
    front = None
    try:
        upstream.wait_ready()
        front = Server("--config", config_file(tmp_path / "c.yaml", {"primary": {
            "artifact": str(ours), "replicas": [{"endpoint": upstream.url, "model": "model"}]}},
            "primary"))
        (rep,) = wait_until(lambda: [r for r in replicas(front, "primary")
                                     if r["state"] not in ("starting", "failed")], 120,
                            "the attached replica settled")
        assert rep["state"] == "incompatible"
        assert "serves revision" in rep["reason"] and "the deployment's is" in rep["reason"]
    finally:
        if front is not None:
            front.close()
        upstream.close()


def test_a_pooled_worker_refused_by_its_golden_check_says_why(tmp_path):
    record = tmp_path / "record.sqlite"
    cfg = config_file(tmp_path / "c.yaml", {"primary": {
        "artifact": L3, "replicas": [{"device": "cpu"}], "engine": {"num_threads": 1}}},
        "primary")
    env = {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "1"}
    first = Server("--config", cfg, "--record", str(record), env=env)
    try:
        first.wait_ready()  # the first start stores this host's golden answer
    finally:
        first.close()
    with sqlite3.connect(record) as db:
        assert db.execute("UPDATE golden SET digest = 'not-this-hosts-answer'").rowcount == 1
    second = Server("--config", cfg, "--record", str(record), env=env)
    try:
        (rep,) = wait_until(lambda: [r for r in replicas(second, "primary")
                                     if r["state"] == "failed"], 120, "the refusal")
        assert rep["reason"].startswith("golden check failed") and rep["restarts"] == 0
        health = second.client.get("/health")
        assert health.status_code == 503 and "golden check failed" in health.json()[
            "error"]["message"]
        assert replicas(second, "primary")[0]["pid"] == rep["pid"]  # not crash-looped
    finally:
        second.close()


def test_every_workers_forward_metrics_reach_metrics_labelled_by_replica(tmp_path):
    """Issue 15 item 4: with -dp 2 the workers' forward time by size range and count reaches
    the front end's /metrics, one family, each sample labelled by its replica."""
    server = Server(L3, "-dp", "2", "--threads", "1")
    try:
        server.wait_ready()
        wait_until(lambda: all(r["state"] == "ready" for r in replicas(server, "primary")),
                   120, "both replicas ready")
        for i in range(6):
            assert server.client.post("/v1/embeddings", json={"input": f"m {i}"}).is_success
        text = server.client.get("/metrics").text
        counts = {line.split('replica="')[1].split('"')[0]: float(line.split()[-1])
                  for line in text.splitlines()
                  if line.startswith("vllm_srun_forward_seconds_count{")}
        assert set(counts) == {"primary-0", "primary-1"} and sum(counts.values()) >= 6
        assert text.count("# TYPE vllm_srun_forward_seconds histogram") == 1
        assert "vllm_srun_requests_total" in text  # the front end's own families too
    finally:
        server.close()
