"""R2.3/R6.2: bad environment values and flags are startup errors that name them. R9.2: the
product has no test-only fault hooks."""

from __future__ import annotations

import argparse
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


# -- the flags a new user reaches for (R6.2, R4.1, R7.5), --version, help texts ------------

def _parsers(parser=None, path=("vllm-srun",)):
    """Every (command path, parser) of the command line, subcommands included."""

    from vllm_srun.server.frontend.cli import build_parser

    parser = parser or build_parser()
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_version_comes_from_the_installed_distribution():
    from importlib.metadata import version

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"vllm-srun {version('vllm-srun')}"


def test_no_help_text_holds_internal_references():
    """Help is for users: no requirement numbers (R6.2), issue numbers or SPEC ids; every
    option says what it does."""
    import re

    paths = []
    for path, parser in _parsers():
        paths.append(path)
        text = parser.format_help()
        assert not re.search(r"\bR\d+\.\d+|\bSPEC\b|[Ii]ssue|#\d", text), (path, text)
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction):  # each choice has help
                assert action.help, (path, action.option_strings or action.dest)
    assert {"vllm-srun serve", "vllm-srun threads report", "vllm-srun threads verify",
            "vllm-srun threads reset", "vllm-srun config show"} <= set(paths)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--adaptive-threads", "2", "invalid choice: '2'"),
    ("--adaptive-threads", "on", "invalid choice: 'on'"),
    ("--served-model-name", " x", "served_model_name must be 1-256 printable characters"),
    ("--served-model-name", "", "served_model_name must be"),
    ("--revision", "a..b", "revision must be a Hugging Face Hub branch, tag or commit"),
    ("--cache-entries", "-1", "--cache-entries must be an integer >= 0"),
])
def test_bad_new_flag_values_are_refused_naming_the_flag(capsys, flag, value, message):
    from vllm_srun.server.frontend.cli import build_parser

    for command in (["serve"], ["config", "show"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*command, f"{flag}={value}"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"argument {flag}" in err and message in err


def test_served_model_name_takes_several_names_and_refuses_a_repeated_one():
    """``--served-model-name a b`` (vLLM's spelling) writes the list; one name stays a
    string; a repeated name is refused naming the key."""
    import yaml

    def shown(*names: str):
        out = run_cli("config", "show", "all-MiniLM-L6-v2", "--served-model-name", *names)
        return out, (yaml.safe_load(out.stdout)["global"]["model_catalog"]["deployments"]
                     ["primary"].get("served_model_name") if out.returncode == 0 else None)

    assert shown("org/a", "b")[1] == ["org/a", "b"]
    assert shown("org/a")[1] == "org/a"
    out, _ = shown("a", "b", "a")
    assert out.returncode != 0
    assert "primary.served_model_name: served_model_name[2] repeats 'a'" in out.stderr


def test_every_deployment_setting_writes_its_config_key():
    """The one declaration table: each flag is on serve and config show, and writes the key
    it names (config show prints it back)."""
    import yaml

    from vllm_srun.server.frontend.settings import DEPLOYMENT_SETTINGS

    samples = {"--backend": "torch", "--revision": "v2", "--served-model-name": "org/name",
               "--adaptive-threads": "learn", "--threads": "3", "--max-num-seqs": "7",
               "--max-num-batched-tokens": "900", "--timeout-ms": "1234",
               "--cache-entries": "0", "--dtype": "auto", "--concurrent-forwards": "2",
               "--quality-gate-min-cosine": "0.9995",
               "--quality-gate-min-label-agreement": "0.98",
               "--quality-gate-max-prob-diff": "0.05",
               "--quality-gate-min-order-agreement": "0.97",
               "--quality-gate-min-span-agreement": "0.96"}
    assert {s.flag for s in DEPLOYMENT_SETTINGS} == set(samples)
    argv = [x for s in DEPLOYMENT_SETTINGS for x in (s.flag, samples[s.flag])]
    shown = run_cli("config", "show", *argv)
    assert shown.returncode == 0, shown.stderr
    dep = yaml.safe_load(shown.stdout)["global"]["model_catalog"]["deployments"]["primary"]
    for s in DEPLOYMENT_SETTINGS:
        node = dep
        for part in s.key.split("."):
            node = node[part]
        want = samples[s.flag]
        assert str(node) == want, s.key
    helps = run_cli("serve", "--help").stdout
    assert all(s.flag in helps for s in DEPLOYMENT_SETTINGS)


@pytest.mark.parametrize(("name", "number"), [("off", 0), ("learn", 1), ("serve", 2)])
def test_adaptive_names_are_the_variables_numbers(name, number):
    """R4.1: off, learn, serve are VLLM_SRUN_CPU_ADAPTIVE_THREADS=0, 1, 2 (the variable also
    reads the names)."""
    from vllm_srun.tuner.modes import ADAPTIVE_ENV, MODE_NAMES, parse_mode

    assert int(MODE_NAMES[name]) == number
    assert parse_mode({ADAPTIVE_ENV: str(number)}) == parse_mode({ADAPTIVE_ENV: name})


def _announced_mode(*args: str, env: dict[str, str]) -> str:
    """The adaptive-threads mode `serve` announces (its first line), the server then ended."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "vllm_srun.server", "serve", *args,
                             "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    try:
        line = proc.stdout.readline()
    finally:
        proc.kill()
        proc.communicate()
    assert "adaptive threads mode" in line, line
    return line.split("adaptive threads mode ", 1)[1][0]


def test_adaptive_threads_precedence_is_flag_then_file_then_variable(tmp_path):
    """A flag writes the config, so it wins over the file's key; the variable applies where
    neither sets the mode (as for --threads and VLLM_SRUN_CPU_THREADS)."""
    path = tmp_path / "config.yaml"
    path.write_text("global:\n  model_catalog:\n    deployments:\n      primary:\n"
                    "        artifact: all-MiniLM-L6-v2\n        adaptive_threads: serve\n")
    env = {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "1"}
    assert _announced_mode(env=env) == "1"
    assert _announced_mode("--config", str(path), env=env) == "2"
    assert _announced_mode("--config", str(path), "--adaptive-threads", "off", env=env) == "0"


def test_bad_variable_is_refused_even_under_a_flag():
    """Every input is validated: a bad VLLM_SRUN_CPU_ADAPTIVE_THREADS is an error even where
    the flag decides the mode."""
    r = run_cli("serve", "--adaptive-threads", "off", "--port", "0",
                env={"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "3"})
    assert r.returncode == 2 and "VLLM_SRUN_CPU_ADAPTIVE_THREADS" in r.stderr
