"""R2.3/R6.2: bad environment values and flags are startup errors that name them. R9.2: the
product has no test-only fault hooks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import L3, Server, run_cli, write_config


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_threads_env_is_a_startup_error(value):
    r = run_cli("serve", "--port", "0", env={"VLLM_SRUN_CPU_THREADS": value})
    assert r.returncode == 2 and "VLLM_SRUN_CPU_THREADS" in r.stderr and "http://" not in r.stdout


@pytest.mark.parametrize(("flag", "value"), [("--threads", "0"), ("--max-num-seqs", "x"),
                                             ("--port", "70000"), ("--timeout-ms", "-5")])
def test_bad_flag_is_a_startup_error_naming_it(flag, value):
    r = run_cli("serve", flag, value)
    assert r.returncode == 2 and flag in r.stderr


def test_bad_model_path_is_a_startup_error(tmp_path):
    r = run_cli("serve", str(tmp_path / "no-such-model"), "--port", "0")
    assert r.returncode == 2 and "no-such-model" in r.stderr


def test_token_budget_below_the_model_limit_is_refused():
    r = run_cli("serve", "--max-num-batched-tokens", "100", "--port", "0")
    assert r.returncode == 2 and "max_num_batched_tokens" in r.stderr


def test_help_explains_every_flag():
    r = run_cli("serve", "--help")
    for flag in ("--backend", "--threads", "--host", "--port", "--max-num-seqs",
                 "--max-num-batched-tokens", "--timeout-ms"):
        assert flag in r.stdout


# -- R9.2: the product has no fault hooks (they live in the test-only tests/faults.py) -------

def test_the_removed_fault_variable_does_nothing_to_a_real_server(tmp_path):
    """VLLM_SRUN_WORKER_FAULTS once made managed workers read fault files; it is gone. A real
    server started with it naming a folder that tells every worker to exit mid-forward (what
    tests/faults.py would do with it) answers as usual, and its worker never restarts."""
    faults = tmp_path / "faults"
    faults.mkdir()
    for name in ("all", "primary-0", "worker"):
        (faults / name).write_text("exit")
    config = write_config(tmp_path / "c.yaml", {"primary": {
        "artifact": L3, "replicas": [{"device": "cpu"}], "engine": {"num_threads": 1}}})
    server = Server("--config", str(config),
                    env={"VLLM_SRUN_WORKER_FAULTS": str(faults)}).wait_ready()
    try:
        before = server.client.get("/v1/inventory").json()["deployments"][0]["replicas"][0]
        assert before["pid"] is not None and before["pid"] != server.proc.pid  # its own process
        for i in range(3):
            r = server.client.post("/v1/embeddings", json={"input": f"fault-free {i}"})
            assert r.status_code == 200, r.text
        after = server.client.get("/v1/inventory").json()["deployments"][0]["replicas"][0]
        assert (after["pid"], after["restarts"], after["state"]) == (before["pid"], 0, "ready")
    finally:
        server.close()


@pytest.mark.parametrize("argv", [
    ("serve", "--faults", "FOLDER", L3, "--port", "0"),
    ("serve", L3, "--fake-gpus", "--port", "0"),
    ("--fake-gpus", "serve", L3, "--port", "0")])
def test_the_test_launchers_options_are_refused_by_the_product(argv, tmp_path):
    """tests/faults.py's --faults and --fake-gpus are not options of ``vllm-srun``."""
    argv = [str(tmp_path) if a == "FOLDER" else a for a in argv]
    r = run_cli(*argv)
    option = next(a for a in argv if a in ("--faults", "--fake-gpus"))
    assert r.returncode == 2 and f"unrecognized arguments: {option}" in r.stderr, r.stderr
    assert "http://" not in r.stdout


def test_the_test_launchers_options_are_refused_by_the_product_worker(tmp_path):
    """The worker command the pool starts (``python -P -m vllm_srun.server.worker.main``) has
    no fault option either."""
    r = subprocess.run([sys.executable, "-P", "-m", "vllm_srun.server.worker.main",
                        "--faults", str(tmp_path), "--socket", str(tmp_path / "w.sock"),
                        "--spec", "{}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --faults" in r.stderr, r.stderr
    assert not (tmp_path / "w.sock").exists()
