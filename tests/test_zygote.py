"""A worker's shadow process is its zygote: a copy of the worker's process forked before it
loaded (``tuner/zygote.py``; R4.5: learning's memory). Each case runs in a fresh Python
process: the zygote must be forked before the process builds any backend, and this test
process has built many."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import L3, L6

# the worker's side, in a fresh process: forks the zygote (or not), loads the backend, serves
# a batch at 1 and 2 threads, and asks its ShadowProcess for the same at 2, 1 and 2 threads;
# then kills the shadow child under it and asks again (a new, spawned child)
WORKER = """
import json, os, sys
import numpy as np
from vllm_srun.tuner import zygote
model, backend, fork_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.types import TokenBatch
from vllm_srun.tuner.shadows import ShadowProcess
manifest = resolve(model)
made = zygote.prepare(backend) if fork_first else None
served_by = load_backend(manifest, backend, several_counts=True)
late = zygote.prepare(backend)  # the one made before, else None: a backend was built here
ids = np.random.default_rng(0).integers(1000, 20000, (4, 64)).astype(np.int64)
batch = TokenBatch(ids, np.ones_like(ids), np.zeros_like(ids), None)
served = {n: served_by.forward(batch, n).outputs for n in (1, 2)}
def same(a, b):
    return a.dtype == b.dtype and np.array_equal(a, b)
def parent(pid):
    return int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])
def comm(pid):
    return open(f"/proc/{pid}/comm").read().strip()
shadows = ShadowProcess(manifest, backend)
first = shadows.process.pid
out = {"zygote": made.pid if made else None, "late": late is not None, "worker": os.getpid(),
       "first": first, "first_parent": parent(first),
       "same": [same(served[n], shadows.forward(batch, n).outputs) for n in (2, 1, 2)]}
out["first_name"] = comm(first)  # (named once running: after its first answer)
os.kill(first, 9)
try:
    shadows.forward(batch, 2)
except Exception as exc:
    out["after_kill"] = str(exc)
out["again"] = same(served[2], shadows.forward(batch, 2).outputs)
out["second"], out["respawns"] = shadows.process.pid, shadows.respawns
out["second_parent"] = parent(out["second"])
shadows.close()
out["alive_after_close"] = shadows.process.is_alive()
print(json.dumps(out), flush=True)
"""


def _worker(model: str, backend: str, fork_first: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", WORKER, model, backend, str(int(fork_first))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("model", "backend"), [(L3, "onnxruntime"), (L6, "torch")])
def test_the_zygote_becomes_the_shadow_process_and_answers_as_the_worker(model, backend):
    """The zygote becomes the worker's shadow process: bit for bit the worker's answers at 1
    and 2 threads (torch's 2-thread OpenMP team is its own: forked after the worker ran
    2-thread forwards, it would hang). Killed under a shadow, it fails that shadow; the next
    child is spawned (the zygote is used once); ``close`` leaves none."""
    out = _worker(model, backend, fork_first=True)
    assert out["zygote"] is not None and out["zygote"] != out["worker"]
    assert out["first"] == out["zygote"] and out["first_parent"] == out["worker"]
    assert out["first_name"] == "vllm-shadows"
    assert out["same"] == [True, True, True]
    assert "shadow process gone" in out["after_kill"]
    assert out["again"] and out["respawns"] == 1
    assert out["second"] != out["first"] and out["second_parent"] == out["worker"]
    assert not out["alive_after_close"]
    assert out["late"]  # asked again before its use: the same zygote


def test_a_process_that_built_a_backend_spawns_its_shadows():
    """No zygote once the process built a backend (it may have run a multithreaded forward):
    the shadow process is spawned by the worker itself, and answers the same."""
    out = _worker(L3, "onnxruntime", fork_first=False)
    assert out["zygote"] is None and not out["late"]
    assert out["first_parent"] == out["worker"] and out["first_name"] != "vllm-shadows"
    assert out["same"] == [True, True, True] and out["again"]
    assert out["second_parent"] == out["worker"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("used", [False, True], ids=["waiting", "shadow"])
def test_the_zygote_dies_with_the_worker(used):
    """A worker killed outright (SIGKILL: no cleanup runs) takes its zygote with it, whether
    the zygote still waits or became the shadow process."""
    code = ("import os, sys, time\n"
            "from vllm_srun.tuner import zygote\n"
            "from vllm_srun.runtime.artifact import resolve\n"
            "from vllm_srun.tuner.shadows import ShadowProcess\n"
            "z = zygote.prepare('onnxruntime')\n"
            f"s = ShadowProcess(resolve({L3!r}), 'onnxruntime') if {used} else None\n"
            "print(z.pid, s.process.pid if s else z.pid, flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        zygote_pid, child = (int(x) for x in proc.stdout.readline().split())
        assert _alive(zygote_pid) and child == zygote_pid
    finally:
        proc.kill()
        proc.wait()
    end = time.monotonic() + 30
    while _alive(zygote_pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(zygote_pid)


def test_a_zygote_that_died_leaves_shadows_spawned():
    """The zygote killed before it was used: the shadow child is spawned by the worker
    itself, and learning goes on."""
    code = ("import os, signal, time\n"
            "import numpy as np\n"
            "from vllm_srun.tuner import zygote\n"
            "from vllm_srun.runtime.artifact import resolve\n"
            "from vllm_srun.runtime.types import TokenBatch\n"
            "from vllm_srun.tuner.shadows import ShadowProcess\n"
            "z = zygote.prepare('onnxruntime')\n"
            "os.kill(z.pid, signal.SIGKILL)\n"
            "while zygote.current() is not None: time.sleep(0.01)\n"
            f"s = ShadowProcess(resolve({L3!r}), 'onnxruntime')\n"
            "ids = np.full((1, 8), 2000, dtype=np.int64)\n"
            "r = s.forward(TokenBatch(ids, np.ones_like(ids), np.zeros_like(ids), None), 1)\n"
            "ppid = int(open(f'/proc/{s.process.pid}/stat').read().rpartition(')')[2].split()[1])\n"
            "print(ppid == os.getpid(), r.num_threads, flush=True)\n"
            "s.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env={**os.environ})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "1"]


def test_a_discarded_zygote_exits_and_is_reaped():
    """A worker that will start no shadow process after all (its precision refused, say)
    discards its zygote: it exits and leaves no zombie; none is handed out after."""
    code = ("import os\n"
            "from vllm_srun.tuner import zygote\n"
            "z = zygote.prepare('onnxruntime')\n"
            "zygote.discard()\n"
            "gone = not os.path.exists(f'/proc/{z.pid}')\n"
            "print(gone, zygote.current() is None, zygote.prepare('onnxruntime') is None)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "True", "True"]
