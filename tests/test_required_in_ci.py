"""The suite's own rule (tests/conftest.py): where CI is set, a test marked required_in_ci
that skips fails the run, unless it skips for a feature this CPU lacks (``cpu_lacks``); other
skips stay skips, and every skip prints its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = '''
import pytest

@pytest.mark.required_in_ci
def test_required_but_skipped():
    pytest.skip("the tool is missing")

@pytest.mark.required_in_ci
@pytest.mark.skipif(True, reason="marked skip")
def test_required_marked_skip():
    pass

@pytest.mark.required_in_ci
def test_required_and_run():
    pass

def test_optional_skipped():
    pytest.skip("optional here")

@pytest.mark.required_in_ci
def test_required_but_this_cpu_lacks_the_feature():
    from tests.conftest import cpu_lacks
    cpu_lacks("no bfloat16 here")
'''


def run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only the suite's own rule, started fast
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "tests.conftest",
                           "-p", "no:cacheprovider", "test_cases.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_required_test_that_skips_fails_where_ci_is_set(tmp_path):
    r = run(tmp_path, "true")
    assert r.returncode == 1, r.stdout
    assert "1 failed, 1 passed, 2 skipped, 1 error" in r.stdout, r.stdout  # error: at setup
    assert "required in CI (CI=true) but skipped: the tool is missing" in r.stdout
    assert "required in CI (CI=true) but skipped: marked skip" in r.stdout
    assert "SKIPPED [1] test_cases.py:18: optional here" in r.stdout
    # a CPU CI may run on without the feature: a skip there too, saying so
    assert "this CPU lacks it: no bfloat16 here" in r.stdout
    assert "but skipped: this CPU lacks it" not in r.stdout


def test_elsewhere_it_skips_saying_why(tmp_path):
    for ci in (None, "false"):
        r = run(tmp_path, ci)
        assert r.returncode == 0, r.stdout
        assert "1 passed, 4 skipped" in r.stdout, r.stdout
        for reason in ("the tool is missing", "marked skip", "optional here"):
            assert reason in r.stdout
