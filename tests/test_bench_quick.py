"""The bench's quick variant runs in CI, so the suite never rots (R8.1). It asserts that every
case and peer produced its section, not any speed: speed is measured in bench/, never in tests.
"""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_bench_writes_every_section(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    for section in ("Forward time per input size", "HTTP: throughput", "Ratios",
                    "per-range oracle", "Front-end overhead", "one hung",
                    "round robin", "Pool: overload", "forward.png"):
        assert section in report, section
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("vllm-srun (default threads)", "fastapi+onnxruntime peer (2 threads)",
                 "sentence-transformers+fastapi peer (2 threads)",
                 "vllm-srun adaptive mode 2 (1 thread, max 2)"):
        assert "error" not in results["http"][name], results["http"][name]
    assert (tmp_path / "forward.png").stat().st_size > 1000
    assert (tmp_path / "http.png").stat().st_size > 1000


def test_the_forward_table_bench_writes_a_table_the_simulator_fits(tmp_path):
    """bench/forward_table.py at its smallest (torch float32, 1x8 and 1x16, 3 rounds): the
    table names its fitted statistic (the fastest forward), each cell's fastest is at most its
    median, and every round records the load, other processes' CPUs and steal; ``--compare``
    finds a table identical to itself. No speed is asserted."""
    from vllm_srun.tuner.sim_model import fit_table, load_table

    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, "-m", "bench.forward_table", "--rounds", "3",
                           "--repeats", "2", "--max-tokens", "16", "--configs",
                           "torch-float32", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibration-grade" in done.stdout  # the bench says whether the test will skip
    doc = load_table(out)
    assert doc["fitted"] == "min_ms"
    assert {(c["rows"], c["padded_tokens"], c["threads"]) for c in doc["cells"]} == {
        (1, 8, 1), (1, 8, 2), (1, 16, 1), (1, 16, 2)}
    for c in doc["cells"]:
        assert c["fit_ms"] == c["min_ms"] <= c["p25_ms"] <= c["median_ms"]
        assert c["rounds"] == 3 and 3 <= c["repeats"] <= 6
    for key in ("per_round_1min", "others_cpus_per_round", "steal_cpus_per_round"):
        assert len(doc["load"][key]) == 3 and min(doc["load"][key]) >= 0, key
    assert set(fit_table(doc)) == {("torch", "float32")}
    same = subprocess.run([sys.executable, "-m", "bench.forward_table", "--compare", str(out),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same.stderr[-3000:]
    lines = same.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["torch/float32 1 thread(s)",
                                                       "torch/float32 2 thread(s)"]
    assert all("b/a geometric mean 1.000, 1.000-1.000" in ln for ln in lines[:2]), lines
    assert len(lines) == 6 and all("checked on" in ln for ln in lines[2:]), lines
