"""R2.3/R6.2: bad environment values and flags are startup errors that name them."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli


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
