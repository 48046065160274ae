"""Kubernetes manifests (deploy/k8s/), validated offline, and the CPU budget a pod gets
(issue: past one machine). No cluster needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import cgroup_v2_tree
from vllm_srun.runtime.budget import cgroup_cpus, cpu_budget, default_threads
from vllm_srun.server.pool.config import check_placement, parse_device, validate

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
K8S_VERSION = "1.30.0"


def documents() -> list[dict]:
    return [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def kind(k: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == k]


def test_there_are_manifests_for_cpu_gpu_and_a_front_end():
    names = {d["metadata"]["name"] for d in kind("Deployment")}
    assert names == {"vllm-srun-embed-cpu", "vllm-srun-embed-gpu", "vllm-srun-frontend"}
    assert len(kind("Service")) == 3 and len(kind("ConfigMap")) == 3


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/"
                                                       f"{d['metadata']['name']}")
def test_manifest_validates_against_the_kubernetes_schema(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _config_of(deployment: dict):
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    cm_name = next(v["configMap"]["name"] for v in volumes if "configMap" in v)
    cm = next(c for c in kind("ConfigMap") if c["metadata"]["name"] == cm_name)
    return validate(yaml.safe_load(cm["data"]["config.yaml"]), cm_name)


@pytest.mark.parametrize("deployment", kind("Deployment"), ids=lambda d: d["metadata"]["name"])
def test_pods_are_sized_whole_and_safe(deployment):
    spec = deployment["spec"]["template"]["spec"]
    assert not any("hostPath" in v for v in spec.get("volumes", []))
    assert not spec.get("hostNetwork") and not spec.get("hostPID")
    assert spec["securityContext"]["runAsNonRoot"] is True
    config = _config_of(deployment)
    for c in spec["containers"]:
        res = c["resources"]
        assert res["requests"] == res["limits"], "requests must equal limits"
        cpu = str(res["limits"]["cpu"])
        assert cpu.isdigit() and int(cpu) >= 1, f"whole CPUs only, got {cpu}"
        sc = c["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health"
        gpus = int(res["limits"].get("nvidia.com/gpu", 0))
        devices = [parse_device(r.device) for d in config.deployments.values()
                   for r in d.placements() if r.device]
        ordinals = sorted({i for p, i in devices if p == "cuda"})
        assert ordinals == list(range(gpus)), "GPU count must equal the allocation ordinals"
        check_placement(config, {"cpu": 1, "cuda": gpus})  # our own loader accepts it
        args = c["args"]
        assert args[args.index("--config") + 1].startswith("/etc/vllm-srun/")


def test_front_end_attaches_the_other_pods_services():
    front = next(d for d in kind("Deployment") if d["metadata"]["name"] == "vllm-srun-frontend")
    endpoints = {r.endpoint for d in _config_of(front).deployments.values()
                 for r in d.placements()}
    services = {f"http://{s['metadata']['name']}:{s['spec']['ports'][0]['port']}"
                for s in kind("Service")}
    assert endpoints and endpoints <= services


def test_a_pod_limited_to_4_cpus_on_a_64_core_node_gets_2_threads(tmp_path):
    """R2.3 in a container: cpu.max of the pod's cgroup (limits.cpu: 4) beats the node's 64
    CPUs in the affinity mask; the default per-worker count is then 2, not 32."""
    root, proc = cgroup_v2_tree(tmp_path, "/kubepods.slice/pod-abc/cri-123",
                     {"/kubepods.slice/pod-abc": "400000 100000",
                      "/kubepods.slice/pod-abc/cri-123": "max 100000"})
    quota = cgroup_cpus(root, proc)
    assert quota == 4.0
    budget = cpu_budget(affinity=64, quota=quota)
    assert (budget, default_threads(budget)) == (4, 2)


def test_rayservice_example_uses_our_builder_and_a_config_we_accept():
    doc = yaml.safe_load((K8S.parent / "ray" / "rayservice.yaml").read_text())
    assert doc["kind"] == "RayService"
    (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "vllm_srun.server.frontend.ray_serve:app_builder"
    cm_name = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "volumes"][0]["configMap"]["name"]
    cm = next(c for c in kind("ConfigMap") if c["metadata"]["name"] == cm_name)
    validate(yaml.safe_load(cm["data"]["config.yaml"]), cm_name)
    for group in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        for c in group["template"]["spec"]["containers"]:
            assert c["resources"]["requests"] == c["resources"]["limits"]


def _containers() -> list[tuple[str, dict]]:
    out = [(d["metadata"]["name"], c) for d in kind("Deployment")
           for c in d["spec"]["template"]["spec"]["containers"]]
    ray = yaml.safe_load((K8S.parent / "ray" / "rayservice.yaml").read_text())
    cluster = ray["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        out += [("rayservice", c) for c in group["template"]["spec"]["containers"]]
    return out


def _secret_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


@pytest.mark.parametrize(("name", "container"), _containers(), ids=lambda x: x
                         if isinstance(x, str) else x["name"])
def test_every_pod_takes_the_api_key_from_a_secret_never_a_literal(name, container):
    """Issue 11 item 4: the key reaches every front end (serve pods, the attaching front end,
    Ray's containers) from the Secret, required, and no manifest spells a key out."""
    ref = _secret_env(container).get("VLLM_SRUN_API_KEY")
    assert ref == {"name": "vllm-srun-api-key", "key": "key"}, container.get("env")
    assert not [e for e in container.get("env", []) if e["name"].endswith("KEY")
                and "value" in e]


def test_the_front_end_sends_each_attached_pod_a_key_named_by_variable():
    front = next(d for d in kind("Deployment") if d["metadata"]["name"] == "vllm-srun-frontend")
    (container,) = front["spec"]["template"]["spec"]["containers"]
    placements = [r for d in _config_of(front).deployments.values() for r in d.placements()]
    assert placements and all(r.api_key_env for r in placements)
    assert {r.api_key_env for r in placements} <= set(_secret_env(container))
