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
