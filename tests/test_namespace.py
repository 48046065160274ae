"""One import namespace, nothing shadowed (R9.1): the distribution installs only ``vllm_srun``,
and ``vllm-srun serve -dp 2`` run from a folder full of look-alike modules (a user's own
``server.py``, ``records.py``, a ``runtime/`` package, even a ``vllm_srun/`` folder) starts its
workers from the installed code, as an editable install and as a wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.conftest import L3, wait_until

ROOT = Path(__file__).resolve().parent.parent
POISON = "raise SystemExit('shadowed: {name} from the working directory was imported')\n"


def hostile_folder(path: Path) -> Path:
    """A working directory whose files would shadow bare module names."""
    path.mkdir()
    for name in ("server.py", "records.py", "tuner.py"):
        (path / name).write_text(POISON.format(name=name))
    for pkg in ("runtime", "vllm_srun/server"):
        (path / pkg).mkdir(parents=True)
        (path / pkg / "__init__.py").write_text(POISON.format(name=pkg))
    (path / "vllm_srun" / "server" / "worker.py").write_text(POISON.format(name="worker"))
    return path


def serve_dp2(cwd: Path, env: dict[str, str]) -> None:
    """``vllm-srun serve L3 -dp 2`` from ``cwd``: both workers ready, an answer from each."""
    cmd = [str(Path(sys.executable).with_name("vllm-srun")), "serve", L3, "-dp", "2",
           "--threads", "1", "--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    try:
        line = proc.stdout.readline()
        assert "http://" in line, proc.stderr.read() if proc.poll() is not None else line
        client = httpx.Client(base_url=line.strip().rsplit(" ", 1)[-1], timeout=60)

        def ready():
            reps = client.get("/v1/inventory").json()["deployments"][0]["replicas"]
            return all(r["state"] == "ready" for r in reps) and reps

        replicas = wait_until(ready, 120, "both workers ready")
        assert [r["restarts"] for r in replicas] == [0, 0]
        answered = {client.post("/v1/embeddings", json={"input": f"text {i}"}).headers[
            "x-vllm-srun-replica"] for i in range(4)}
        assert answered == {"primary-0", "primary-1"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "shadowed" not in proc.stderr.read()


def test_serve_from_a_folder_of_look_alike_modules_editable_install(tmp_path):
    serve_dp2(hostile_folder(tmp_path / "work"), {})


def test_the_wheel_installs_only_vllm_srun_and_serves_from_a_hostile_folder(tmp_path):
    source = tmp_path / "source"  # built from a copy: a build leaves build/ in its tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "results", ".*_cache"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("vllm_srun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"vllm_srun"}, tops
    assert "vllm_srun/tuner/golden_reference.json" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    env = {"PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-P", "-c", "import vllm_srun.server.worker.main as w;"
                            "print(w.__file__)"], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, **env}, check=True)
    assert where.stdout.strip().startswith(str(site)), where.stdout  # the wheel, not the tree
    serve_dp2(hostile_folder(tmp_path / "work"), env)


@pytest.mark.parametrize("name", ["server", "records", "runtime", "tuner"])
def test_no_bare_top_level_module_is_installed(name, tmp_path):
    """From a neutral folder, the old bare names are not importable at all."""
    out = subprocess.run([sys.executable, "-P", "-c", f"import {name}"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "No module named" in out.stderr
