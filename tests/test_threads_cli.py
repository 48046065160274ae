"""R4.1, R4.8, R4.10 end to end: the env var, `threads verify|report|reset`, GET /v1/threads,
a golden failure seen from /health, and a record that cannot be written."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from tests.conftest import L3, Server, run_cli, words


def test_junk_adaptive_mode_is_a_startup_error():
    r = run_cli("serve", "--port", "0", env={"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "fast"})
    assert r.returncode == 2 and "VLLM_SRUN_CPU_ADAPTIVE_THREADS" in r.stderr


SMALL = ("--max-num-seqs", "2", "--max-num-batched-tokens", "48", "--max-tokens", "40")


def test_verify_report_reset(tmp_path):
    """R4.8, R4.10: the sweep covers every shape within the bounds given (2 rows, 48 padded
    tokens, lengths 2-40: 62 shapes), says so and records it; a reset retires the voucher and
    a new sweep vouches again."""
    record = str(tmp_path / "r.sqlite")
    verify = ("threads", "verify", L3, "--threads", "1", "--max-threads", "2", "--record",
              record, *SMALL)
    r = run_cli(*verify)
    assert r.returncode == 0, r.stderr
    assert "bit-identical across counts [1, 2] in all 62 comparisons" in r.stdout
    assert "covered: counts [1, 2]; 1-2 rows x padded length 2-40, several rows up to 48 " \
           "padded tokens: every shape (62)" in r.stdout
    assert "verify: 62/62 shapes, 62 comparisons, 0 mismatches" in r.stderr
    r = run_cli("threads", "report", "--record", record, "--json")
    (rep,) = json.loads(r.stdout)["reports"]
    assert rep["voucher"]["vouches"] and rep["voucher"]["comparisons"] == 62
    (cov,) = rep["voucher"]["coverage"]
    assert (cov["counts"], cov["max_rows"], cov["min_len"], cov["max_len"], cov["max_padded"],
            cov["shapes"]) == ([1, 2], 2, 2, 40, 48, 62)
    png = tmp_path / "plot.png"
    r = run_cli("threads", "report", "--record", record, "--plot", str(png))
    assert r.returncode == 0 and "voucher: yes" in r.stdout and "vouched: counts [1, 2]" \
        in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run_cli("threads", "reset", L3, "--record", record)
    assert r.returncode == 0 and "reset learning" in r.stdout and "vouchers retired" in r.stdout
    (rep,) = json.loads(run_cli("threads", "report", "--record", record, "--json").stdout)[
        "reports"]
    assert not rep["voucher"]["vouches"] and rep["voucher"]["coverage"] == []
    assert run_cli(*verify).returncode == 0
    (rep,) = json.loads(run_cli("threads", "report", "--record", record, "--json").stdout)[
        "reports"]
    assert rep["voucher"]["vouches"] and rep["voucher"]["comparisons"] == 62


def test_a_bounded_sweep_vouches_for_exactly_what_it_compared_and_a_rerun_goes_on(tmp_path):
    """R4.8: `--max-shapes 10` compares 10 of the 62 shapes, records each one by one and says
    what it left; it vouches for no bounds (no coverage), only those shapes. A run without
    the bound skips the 10, compares the other 52 and records the bounds: 62 comparisons in
    all, each shape once."""
    record = str(tmp_path / "r.sqlite")
    verify = ("threads", "verify", L3, "--threads", "1", "--max-threads", "2", "--record",
              record, *SMALL)
    r = run_cli(*verify, "--max-shapes", "10")
    assert r.returncode == 0, r.stderr
    assert "0 verified already, 62 to compare" in r.stderr and "at most 10 shapes" in r.stderr
    assert "stopped at --max-shapes: 10 of 62 shapes compared, bit-identical" in r.stdout
    assert "52 left: run again to go on" in r.stdout
    (rep,) = json.loads(run_cli("threads", "report", "--record", record, "--json").stdout)[
        "reports"]
    v = rep["voucher"]
    assert (v["vouches"], v["swept"], v["coverage"], v["comparisons"]) == (True, False, [], 10)
    assert v["shapes_verified"] == {"2": 10}
    r = run_cli(*verify)
    assert r.returncode == 0, r.stderr
    assert "10 verified already, 52 to compare" in r.stderr
    assert "bit-identical across counts [1, 2] in all 52 comparisons" in r.stdout
    (rep,) = json.loads(run_cli("threads", "report", "--record", record, "--json").stdout)[
        "reports"]
    v = rep["voucher"]
    assert (v["vouches"], v["swept"], v["comparisons"]) == (True, True, 62)
    assert v["shapes_verified"] == {"2": 62} and v["coverage"][0]["shapes"] == 62
    text = run_cli("threads", "report", "--record", record).stdout
    assert "shapes verified one by one against the configured count: 62 at 2 threads" in text
    r = run_cli(*verify)
    assert r.returncode == 0 and "every shape of the sweep was verified already" in r.stdout


def test_a_grid_sweep_covers_the_lengths_of_the_grid_only(tmp_path):
    """R4.8: `--grid` sweeps only the padded lengths of the grid mode 2 pads to (2-16, 18,
    20, ..., 32, 36, 40: 44 of the 62 shapes) and records that it covered those only."""
    record = str(tmp_path / "r.sqlite")
    r = run_cli("threads", "verify", L3, "--threads", "1", "--max-threads", "2", "--record",
                record, *SMALL, "--grid")
    assert r.returncode == 0, r.stderr
    assert "covered: counts [1, 2]; 1-2 rows x padded length 2-40 on the length grid, several " \
           "rows up to 48 padded tokens: every shape (44)" in r.stdout
    (rep,) = json.loads(run_cli("threads", "report", "--record", record, "--json").stdout)[
        "reports"]
    (cov,) = rep["voucher"]["coverage"]
    assert cov["grid"] and cov["shapes"] == 44 and rep["voucher"]["comparisons"] == 44


def test_verify_with_one_count_records_nothing(tmp_path):
    """R4.8: a sweep that compares nothing vouches for nothing, and says so."""
    record = tmp_path / "r.sqlite"
    r = run_cli("threads", "verify", L3, "--threads", "1", "--max-threads", "1", "--record",
                str(record), *SMALL)
    assert r.returncode == 1 and "nothing to compare, no voucher" in r.stdout
    assert not record.exists()


@pytest.mark.parametrize(("flags", "message"), [
    (("--max-num-seqs", "0"), "--max-num-seqs must be a positive integer"),
    (("--budget-s", "0"), "--budget-s must be a positive integer"),
    (("--max-shapes", "x"), "--max-shapes must be a positive integer"),
    (("--max-tokens", "4096"), "above paraphrase-MiniLM-L3-v2's limit of 128"),
    (("--min-tokens", "50", "--max-tokens", "40"), "--min-tokens 50 is above --max-tokens 40"),
])
def test_verify_bad_bounds_are_clear_errors(tmp_path, flags, message):
    r = run_cli("threads", "verify", L3, "--record", str(tmp_path / "r.sqlite"), *flags)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_threads_endpoint_in_mode_1(tmp_path):
    server = Server(L3, "--threads", "1", "--max-threads", "2", "--record",
                    str(tmp_path / "r.sqlite"), env={"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "1"})
    try:
        server.wait_ready()
        # traffic with pauses: shadows run in them. On 2 cores the frontend and this client
        # hold a CPU in part of each pause, so a 2-thread shadow can wait for it and is not
        # timed (then the next backs off); it goes on until one was, at most 30 s
        end = time.monotonic() + 30
        for i in range(2000):
            server.client.post("/v1/embeddings", json={"input": words(40) + f" {i}"})
            time.sleep(0.03)
            if i % 10 == 9:
                (rep,) = server.client.get("/v1/threads").json()["reports"]
                (rng,) = [r for r in rep["ranges"] if r["size_range"] == "32-63"]
                if rng["counts"]["2"]["samples"] or time.monotonic() > end:
                    break
    finally:
        server.close()
    assert rep["mode"] == 1 and rep["allowed_counts"] == [1, 2]
    assert rng["served_threads"] == 1 and rng["counts"]["2"]["samples"] > 0, rep["learning"]
    assert rng["state"] in ("exploring", "learned")


def test_threads_endpoint_when_off(l6_server):
    (rep,) = l6_server.client.get("/v1/threads").json()["reports"]
    assert rep["mode"] == 0 and rep["ranges"] == [] and "off" in rep["notes"][0]
    assert rep["state"] == "locked" and "VLLM_SRUN_CPU_ADAPTIVE_THREADS=1" in \
        rep["recommendation"]


def test_golden_failure_keeps_the_worker_out_with_its_reason(tmp_path):
    record = tmp_path / "r.sqlite"
    env = {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "1"}
    first = Server(L3, "--threads", "1", "--record", str(record), env=env).wait_ready()
    first.close()
    conn = sqlite3.connect(record)
    conn.execute("UPDATE golden SET digest = 'from-another-day'")
    conn.commit()
    conn.close()
    server = Server(L3, "--threads", "1", "--record", str(record), env=env)
    try:
        for _ in range(600):
            health = server.client.get("/health")
            if "golden" in health.text:
                break
            time.sleep(0.1)
        assert health.status_code == 503 and "golden check failed" in health.text
        r = server.client.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 503 and "golden" in r.json()["error"]["message"]
        (rep,) = server.client.get("/v1/threads").json()["reports"]
        assert "golden check failed" in rep["locked_reason"] and rep["state"] == "locked"
    finally:
        server.close()


@pytest.mark.parametrize("mode", ["1", "2"])
def test_unwritable_record_still_serves_and_says_so(tmp_path, mode):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    server = Server(L3, "--threads", "1", "--record", str(blocker / "r.sqlite"),
                    env={"VLLM_SRUN_CPU_ADAPTIVE_THREADS": mode})
    try:
        server.wait_ready()
        r = server.client.post("/v1/embeddings", json={"input": "still served"})
        (rep,) = server.client.get("/v1/threads").json()["reports"]
    finally:
        server.close()
    assert r.status_code == 200
    assert any("host record not written" in n for n in rep["notes"])
