"""config.yaml schema (R6.1) and the serve flags that write the same canonical config (R6.2)."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import SEED_PLACEMENT, run_cli
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.server.pool.config import check_placement, load, validate
from vllm_srun.server.pool.flags import apply_flags, single

# The seed's two examples, as written.
SEED_OUTLIER = """
global:
  model_catalog:
    deployments:
      primary:
        provider: model_runtime
        artifact: vllm-sr/Vela-2.0-4B
        replicas:
          - device: rocm:0
          - device: rocm:1
        outlier_detection:
          consecutive_timeouts: 3 # default 3; 0 turns ejection off
          base_ejection_ms: 30000 # default 30000
          max_ejection_ms: 300000 # default ten times the base, at most an hour
          max_ejection_percent: 50 # default 50
"""

CPU_ONLY = {"cpu": 1}


def doc(text: str) -> dict:
    return yaml.safe_load(text)


@pytest.mark.parametrize("text", [SEED_PLACEMENT, SEED_OUTLIER])
def test_seed_examples_load_as_written_and_placement_is_refused_without_the_gpus(text):
    config = validate(doc(text))
    dep = config.deployments["primary"]
    assert [r.device for r in dep.placements()] == ["rocm:0", "rocm:1"]
    assert config.bound == "primary"
    with pytest.raises(ConfigError, match=r"deployments\.primary\.replicas\[0\]\.device: "
                                          r"rocm:0 is not available on this machine"):
        check_placement(config, CPU_ONLY)
    check_placement(config, {"cpu": 1, "rocm": 2})  # a machine with two ROCm GPUs


def test_seed_outlier_fields_are_read():
    o = validate(doc(SEED_OUTLIER)).deployments["primary"].outlier_detection
    assert (o.consecutive_timeouts, o.base_ejection_ms, o.max_ejection_ms,
            o.max_ejection_percent) == (3, 30000, 300000, 50)


def _with(path: list, value, base: str = SEED_PLACEMENT) -> dict:
    data = doc(base)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


DEP = ["global", "model_catalog", "deployments", "primary"]


@pytest.mark.parametrize("path,value,message", [
    (DEP + ["replicas"], [{"device": "tpu:0"}],
     r"deployments\.primary\.replicas\[0\]: device must be 'cpu', 'cuda:N' or 'rocm:N'"),
    (DEP + ["replicas"], [{"device": "cuda"}], r"replicas\[0\]: .*needs an index"),
    (DEP + ["replicas"], [{"endpoint": "http://10.0.0.1:8000"}],
     r"replicas\[0\]: an attached replica \(endpoint\) needs its own model"),
    (DEP + ["replicas"], [{"endpoint": "ftp://x", "model": "m"}],
     r"replicas\[0\]\.endpoint: endpoint must be an http\(s\) URL"),
    (DEP + ["replicas"], [{"device": "cpu", "gpu": 1}], r"replicas\[0\]\.gpu: unknown key"),
    (DEP + ["replicas"], [], r"deployments\.primary: replicas must not be empty"),
    (DEP + ["device"], "cpu",
     r"deployments\.primary: replicas cannot be combined with deployment-level device"),
    (DEP + ["provider"], "openai", r"deployments\.primary\.provider: "),
    (DEP + ["colour"], "blue", r"deployments\.primary\.colour: unknown key"),
    (DEP + ["engine"], {"max_num_seqs": 0}, r"engine\.max_num_seqs: .*greater than or equal"),
    (DEP + ["engine"], {"max_num_seqs": "8"}, r"engine\.max_num_seqs: "),
    (DEP + ["outlier_detection"], {"max_ejection_percent": 101},
     r"outlier_detection\.max_ejection_percent: "),
    (DEP + ["outlier_detection"], {"max_ejection_ms": 7_200_000},
     r"outlier_detection\.max_ejection_ms: "),
    (["global", "router", "enabled"], True, r"global\.router: this runtime has no semantic "
                                             r"router"),
    (["global", "system", "decision_model", "deployment"], "other",
     r"decision_model\.deployment names 'other'"),
    (["global", "extra"], 1, r"global\.extra: unknown key"),
])
def test_bad_values_name_the_key(path, value, message):
    with pytest.raises(ConfigError, match=message):
        validate(_with(path, value))


def test_bad_documents_are_refused_clearly(tmp_path):
    for text, message in [("[1, 2]", "top level must be a mapping"),
                          ("global: [", "not valid YAML"),
                          ("{}", "global: Field required")]:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load(path)
    with pytest.raises(ConfigError, match="cannot read --config"):
        load(tmp_path / "missing.yaml")


def test_one_worker_shorthand_and_attached_shorthand():
    config = validate({"global": {"model_catalog": {"deployments": {
        "a": {"artifact": "all-MiniLM-L6-v2"},
        "b": {"artifact": "x", "endpoint": "http://127.0.0.1:9/", "model": "served-x"}}}}})
    a, b = config.deployments["a"], config.deployments["b"]
    assert a.shorthand and [r.device for r in a.placements()] == ["cpu"]
    (attached,) = b.placements()
    assert attached.endpoint == "http://127.0.0.1:9" and attached.model == "served-x"
    assert config.bound == "a"  # no binding: the first deployment


def flags(config=None, **kw):
    base = dict(model=None, backend=None, platform=None, dp=None, device_ids=None, engine={},
                available=CPU_ONLY)
    return apply_flags(config, **{**base, **kw})


def test_only_model_keeps_replicas_and_engine_arguments():
    config = validate(_with(DEP + ["engine"], {"max_num_seqs": 8}))
    out = flags(config, model="all-MiniLM-L6-v2")
    dep = out.deployments["primary"]
    assert dep.artifact == "all-MiniLM-L6-v2"
    assert [r.device for r in dep.placements()] == ["rocm:0", "rocm:1"]
    assert dep.engine.max_num_seqs == 8


def test_dp_resizes_existing_placements_in_declared_order():
    config = validate(doc(SEED_PLACEMENT))
    gpus = {"cpu": 1, "rocm": 2}
    assert [r.device for r in flags(config, dp=3, available=gpus)
            .deployments["primary"].placements()] == ["rocm:0", "rocm:1", "rocm:0"]
    assert [r.device for r in flags(config, dp=1, available=gpus)
            .deployments["primary"].placements()] == ["rocm:0"]


def test_dp_on_a_new_gpu_placement_takes_the_first_n_and_refuses_too_few():
    out = flags(None, platform="cuda", dp=2, available={"cpu": 1, "cuda": 4})
    assert [r.device for r in out.deployments["primary"].placements()] == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match="-dp 3 on --platform cuda needs 3 devices; 2 "
                                          "available"):
        flags(None, platform="cuda", dp=3, available={"cpu": 1, "cuda": 2})


def test_device_ids_spread_in_order_and_repeat():
    gpus = {"cpu": 1, "rocm": 2}
    one = flags(None, platform="rocm", dp=2, device_ids=[0], available=gpus)
    assert [r.device for r in one.deployments["primary"].placements()] == ["rocm:0", "rocm:0"]
    two = flags(None, platform="rocm", dp=2, device_ids=[0, 1], available=gpus)
    assert [r.device for r in two.deployments["primary"].placements()] == ["rocm:0", "rocm:1"]
    with pytest.raises(ConfigError, match="device rocm:5 is not available"):
        flags(None, platform="rocm", dp=1, device_ids=[5], available=gpus)
    with pytest.raises(ConfigError, match="--device-ids applies to --platform cuda or rocm"):
        flags(None, platform="cpu", dp=1, device_ids=[0])


def test_flags_write_the_same_canonical_config_the_file_holds(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(flags(None, dp=2, engine={"num_threads": 1, "max_num_seqs": 16}).to_yaml())
    shown = run_cli("config", "show", "--config", str(path))
    assert shown.returncode == 0, shown.stderr
    assert validate(yaml.safe_load(shown.stdout)) == load(path)
    from_flags = run_cli("config", "show", "-dp", "2", "--threads", "1", "--max-num-seqs", "16")
    assert from_flags.stdout == shown.stdout  # flags and file: one resource
    bad = run_cli("config", "show", "--device-ids", "0,x")
    assert bad.returncode == 2 and "--device-ids must be comma-separated integers" in bad.stderr


def test_serve_refuses_a_placement_this_machine_cannot_hold(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(SEED_PLACEMENT)
    out = run_cli("serve", "--config", str(path), "--port", "0")
    assert out.returncode == 2
    assert "replicas[0].device: rocm:0 is not available on this machine" in out.stderr


def test_single_builds_a_bound_shorthand():
    config = single("all-MiniLM-L6-v2")
    assert config.bound == "primary" and config.deployments["primary"].shorthand


# -- adaptive_threads, served_model_name, revision (R4.1, R7.5, R1.1 as amended) ------------

@pytest.mark.parametrize("value,expected", [("off", "off"), ("learn", "learn"),
                                            ("serve", "serve"), (False, "off")])
def test_adaptive_threads_takes_off_learn_serve(value, expected):
    """``adaptive_threads: off`` unquoted is YAML's false: read as off."""
    dep = validate(_with(DEP + ["adaptive_threads"], value, SEED_OUTLIER)).deployments["primary"]
    assert dep.adaptive_threads == expected


def test_unquoted_off_in_a_file_is_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("global:\n  model_catalog:\n    deployments:\n      primary:\n"
                    "        artifact: all-MiniLM-L6-v2\n        adaptive_threads: off\n")
    config = load(path)
    assert config.deployments["primary"].adaptive_threads == "off"
    assert load_text(config.to_yaml()) == config  # the canonical form reads back the same


def load_text(text: str):
    return validate(yaml.safe_load(text))


@pytest.mark.parametrize("key,value,message", [
    ("adaptive_threads", "2", r"primary\.adaptive_threads: adaptive_threads must be one of "
                              r"off, learn, serve, got '2'"),
    ("adaptive_threads", True, r"primary\.adaptive_threads: .*YAML reads unquoted on"),
    ("adaptive_threads", "fast", r"primary\.adaptive_threads: "),
    ("served_model_name", "", r"primary\.served_model_name: served_model_name must be"),
    ("served_model_name", " padded", r"primary\.served_model_name: "),
    ("served_model_name", "a\nb", r"primary\.served_model_name: "),
    ("served_model_name", "x" * 257, r"primary\.served_model_name: "),
    ("served_model_name", 7, r"primary\.served_model_name: served_model_name must be a name "
                             r"or a list of names, got 7"),
    ("served_model_name", [], r"primary\.served_model_name: served_model_name must list at "
                              r"least one name"),
    ("served_model_name", ["a", "b", "a"], r"primary\.served_model_name: "
                                           r"served_model_name\[2\] repeats 'a'"),
    ("served_model_name", ["a", " b"], r"primary\.served_model_name: served_model_name\[1\] "
                                       r"must be 1-256 printable"),
    ("served_model_name", ["a", 3], r"primary\.served_model_name: served_model_name\[1\] "),
    ("revision", "a..b", r"primary\.revision: revision must be a Hugging Face Hub branch"),
    ("revision", "-x", r"primary\.revision: "),
])
def test_new_deployment_keys_refuse_bad_values_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        validate(_with(DEP + [key], value, SEED_OUTLIER))


def test_served_model_names_are_unique_ids():
    deployments = {"a": {"artifact": "all-MiniLM-L6-v2"},
                   "b": {"artifact": "all-MiniLM-L6-v2", "served_model_name": "a"}}
    with pytest.raises(ConfigError, match=r"deployments\.b\.served_model_name 'a' is already "
                                          r"an id of deployment 'a'"):
        validate({"global": {"model_catalog": {"deployments": deployments}}})
    deployments["b"]["served_model_name"] = "b"  # its own deployment's name: one id
    deployments["a"]["served_model_name"] = "org/model"
    validate({"global": {"model_catalog": {"deployments": deployments}}})
    deployments["b"]["served_model_name"] = "org/model"
    with pytest.raises(ConfigError, match="already an id of deployment 'a'"):
        validate({"global": {"model_catalog": {"deployments": deployments}}})


def test_served_model_name_takes_a_list_whose_names_are_unique_across_deployments():
    """Several served names (vLLM's and infinity's ``--served-model-name a b``): the first is
    the reported id; every one is an id no other deployment may take."""
    deployments = {"a": {"artifact": "all-MiniLM-L6-v2", "served_model_name": ["x", "y"]},
                   "b": {"artifact": "all-MiniLM-L6-v2", "served_model_name": ["z", "b"]}}
    config = validate({"global": {"model_catalog": {"deployments": deployments}}})
    assert config.deployments["a"].served_names == ("x", "y")
    assert config.deployments["b"].served_names == ("z", "b")  # its own name: one id
    assert load_text(config.to_yaml()) == config
    assert validate(_with(DEP + ["artifact"], "m", SEED_OUTLIER)).deployments[
        "primary"].served_names == ()
    for clash, owner in (("y", "a"), ("a", "a")):
        deployments["b"]["served_model_name"] = ["z", clash]
        with pytest.raises(ConfigError, match=rf"deployments\.b\.served_model_name {clash!r} is "
                                              rf"already an id of deployment {owner!r}"):
            validate({"global": {"model_catalog": {"deployments": deployments}}})


def test_adaptive_threads_is_refused_where_no_worker_is_managed():
    with pytest.raises(ConfigError, match=r"deployments\.b: adaptive_threads applies to managed"):
        validate({"global": {"model_catalog": {"deployments": {"b": {
            "artifact": "x", "endpoint": "http://127.0.0.1:9", "model": "m",
            "adaptive_threads": "learn"}}}}})


def test_flag_settings_write_their_keys_and_model_replaces_the_hub_revision():
    out = flags(None, settings={"served_model_name": "BAAI/bge-small-en-v1.5",
                                "adaptive_threads": "learn", "engine.num_threads": 2})
    dep = out.deployments["primary"]
    assert (dep.served_model_name, dep.adaptive_threads, dep.engine.num_threads) == (
        "BAAI/bge-small-en-v1.5", "learn", 2)
    hub = validate(_with(DEP + ["revision"], "v2", SEED_OUTLIER))
    assert flags(hub).deployments["primary"].revision == "v2"
    moved = flags(hub, model="all-MiniLM-L6-v2").deployments["primary"]
    assert (moved.artifact, moved.revision) == ("all-MiniLM-L6-v2", None)
    with pytest.raises(ConfigError, match=r"primary\.adaptive_threads: "):
        flags(None, settings={"adaptive_threads": "sometimes"})
