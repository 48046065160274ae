"""One import namespace, nothing shadowed (R9.1): the distribution installs only ``vllm_srun``,
and every entry point run from a folder full of look-alike modules (a user's own
``server.py``, ``records.py``, a ``runtime/`` package, a ``vllm_srun/`` package, even a
``multiprocessing.py``) runs the installed code: ``vllm-srun serve -dp 2`` as an editable
install and as a wheel, mode 1 with its shadow process, ``threads verify``, and ``--mkl-cbwr``'s
re-exec of both."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.conftest import L3, L6, wait_until, words

ROOT = Path(__file__).resolve().parent.parent
POISON = "raise SystemExit('shadowed: {name} from the working directory was imported')\n"


def hostile_folder(path: Path) -> Path:
    """A working directory whose files would shadow bare module names."""
    path.mkdir()
    for name in ("server.py", "records.py", "tuner.py", "multiprocessing.py"):
        (path / name).write_text(POISON.format(name=name))
    for pkg in ("runtime", "vllm_srun", "vllm_srun/server"):
        (path / pkg).mkdir(parents=True)
        (path / pkg / "__init__.py").write_text(POISON.format(name=pkg))
    (path / "vllm_srun" / "server" / "worker.py").write_text(POISON.format(name="worker"))
    return path


def vllm_srun(*args: str) -> list[str]:
    """The installed console script with ``args``: it puts its own folder first on sys.path."""
    return [str(Path(sys.executable).with_name("vllm-srun")), *args]


@contextlib.contextmanager
def serving(cwd: Path, env: dict[str, str | None], *args: str, dp: int | None = 2,
            model: str = L3):
    """``vllm-srun serve MODEL [-dp N] ARGS`` from ``cwd`` (``env`` over this one's; None removes a
    variable): yields a client and the server's pid once every worker is ready with no
    restart; afterwards nothing it or its children wrote says "shadowed"."""
    cmd = vllm_srun("serve", model, *(["-dp", str(dp)] if dp else []), "--threads", "1", *args,
                    "--port", "0", "--log-level", "warning")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={k: v for k, v in {**os.environ, **env}.items()
                                            if v is not None})
    try:
        line = proc.stdout.readline()
        assert "http://" in line, proc.stderr.read() if proc.poll() is not None else line
        client = httpx.Client(base_url=line.strip().rsplit(" ", 1)[-1], timeout=60)

        def ready():
            reps = client.get("/v1/inventory").json()["deployments"][0]["replicas"]
            return all(r["state"] == "ready" for r in reps) and reps

        replicas = wait_until(ready, 120, "every worker ready")
        assert [r["restarts"] for r in replicas] == [0] * (dp or 1)
        yield client, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "shadowed" not in proc.stderr.read()


def serve_dp2(cwd: Path, env: dict[str, str]) -> None:
    """``vllm-srun serve L3 -dp 2`` from ``cwd``: both workers ready, an answer from each."""
    with serving(cwd, env) as (client, _pid):
        answered = {client.post("/v1/embeddings", json={"input": f"text {i}"}).headers[
            "x-vllm-srun-replica"] for i in range(4)}
    assert answered == {"primary-0", "primary-1"}


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


@pytest.mark.parametrize("dp", [None, 1], ids=["in-process-worker", "worker-process"])
def test_mode1_and_its_shadow_process_from_a_hostile_folder(tmp_path, dp):
    """Mode 1 runs shadows in a child process of each worker, whether the worker is the front
    end itself (``serve MODEL``) or a process of its own (``-dp 1``): the worker's zygote, a
    copy of its process made before it loaded (``tuner/zygote.py``), so from the hostile
    folder it runs the installed code the worker imported, shown by the shadow answers the
    worker compared with its served ones. Traffic with pauses, at most 60 s of it."""
    env = {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "1"}
    with serving(hostile_folder(tmp_path / "work"), env, "--max-threads", "2", "--record",
                 str(tmp_path / "r.sqlite"), dp=dp) as (client, pid):
        end = time.monotonic() + 60
        for i in range(5000):
            assert client.post("/v1/embeddings", json={"input": words(40) + f" {i}"}) \
                .status_code == 200
            time.sleep(0.03)
            (rep,) = client.get("/v1/threads").json()["reports"]
            if rep["learning"]["shadow_comparisons"] or time.monotonic() > end:
                break
        tree = _descendants(pid)
    assert rep["mode"] == 1 and rep["allowed_counts"] == [1, 2]
    assert rep["learning"]["shadow_comparisons"] > 0, rep["learning"]
    (worker,) = [p for p, (_, name) in tree.items() if name == "vllm-shadows"]
    worker = tree[worker][0]  # the shadow process's parent
    assert worker == pid if dp is None else tree[worker][0] == pid


def _descendants(pid: int) -> dict[int, tuple[int, str]]:
    """``pid``'s descendants: pid -> (its parent, its name)."""
    found: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat, name = (entry / "stat").read_text(), (entry / "comm").read_text().strip()
        except OSError:  # gone meanwhile
            continue
        found[int(entry.name)] = (int(stat.rpartition(")")[2].split()[1]), name)
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for p, (pp, name) in found.items():
            if pp == parent:
                out[p] = (pp, name)
                todo.append(p)
    return out


@pytest.mark.parametrize(("args", "shapes"), [
    ((L3, "--backend", "onnxruntime", "--max-num-seqs", "2", "--max-num-batched-tokens", "48",
      "--max-tokens", "40"), 62),
    ((L6, "--backend", "torch", "--mkl-cbwr", "--max-num-seqs", "1",
      "--max-num-batched-tokens", "12", "--max-tokens", "12"), 11),
], ids=["onnxruntime", "torch-mkl-cbwr-reexec"])
def test_threads_verify_from_a_hostile_folder(tmp_path, args, shapes):
    """``threads verify`` (small bounds: seconds) from the hostile folder sweeps and records;
    with ``--mkl-cbwr`` it first starts itself again with MKL_CBWR=AUTO. Whether torch's
    answers drift here is not this test's concern: only that the sweep ran to its end."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}  # so --mkl-cbwr re-execs
    r = subprocess.run(vllm_srun("threads", "verify", *args, "--threads", "1", "--max-threads",
                                 "2", "--record", str(tmp_path / "r.sqlite")),
                       cwd=hostile_folder(tmp_path / "work"), capture_output=True, text=True,
                       env=env, timeout=300)
    assert "shadowed" not in r.stderr
    assert r.returncode in (0, 1), r.stdout + r.stderr
    assert f"verify: {shapes}/{shapes} shapes, {shapes} comparisons" in r.stderr
    # what it recorded: a voucher, or (torch's answers drifting across counts on this CPU,
    # as on the 2-vCPU AMD EPYC here) the mismatches and that mode 2 will not serve
    assert "covered: counts [1, 2]" in r.stdout or \
        "mode 2 will not serve learned counts" in r.stdout, r.stdout


def test_serve_mkl_cbwr_reexec_from_a_hostile_folder(tmp_path):
    """``serve L6 --backend torch --mkl-cbwr`` starts itself again with MKL_CBWR=AUTO (the
    process's environment shows it); from the hostile folder the new process and its worker
    run the installed code."""
    with serving(hostile_folder(tmp_path / "work"), {"MKL_CBWR": None}, "--backend", "torch",
                 "--mkl-cbwr", dp=1, model=L6) as (client, pid):
        r = client.post("/v1/embeddings", json={"input": "text"})
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"MKL_CBWR=AUTO" in environ
    assert r.status_code == 200 and r.headers["x-vllm-srun-replica"] == "primary-0"
