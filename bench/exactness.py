"""Exactness at scale (R4.6, R4.8): a mode-2 server serving learned counts against a mode-0
server, on held-out inputs sent by concurrent clients so micro-batches form: every answer must
be byte-identical.

Steps: ``threads verify`` sweeps every shape the servers' batch limits allow; a mode-2 server
learns from training traffic (bursts from 1 and 16 clients) until it serves a learned count;
then ``inputs`` held-out texts of 1 token to the model's limit go to both servers from
``clients`` threads each (base64 answers: the float32 bytes themselves), and the answers are
compared byte for byte. Reports the forwards the mode-2 server ran at each count meanwhile.

    python -m bench.exactness [--model paraphrase-MiniLM-L3-v2] [--inputs 5000] [--clients 16]
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from bench.adaptive_wrk import Server

WORDS = tuple(" ".join([
    "the search query result vector model server thread input token embedding latency",
    "throughput request answer system memory batch length short long kernel host python",
    "record cache route worker river mountain green paper window music history garden",
    "science market travel coffee winter silver planet bridge doctor letter energy"]).split(" "))


def texts(n: int, max_words: int, seed: int) -> list[str]:
    """``n`` texts of 1 to ``max_words`` words (log-uniform lengths; longer than the model's
    limit are truncated), distinct from four words up (a tag)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = max(1, int(np.exp(rng.uniform(0, np.log(max_words)))))
        text = " ".join(rng.choice(WORDS, k))
        out.append(text + f" {seed}x{i}" if k > 3 else text)
    return out


def embed_all(url: str, model: str, inputs: list[str], clients: int) -> list[bytes]:
    with httpx.Client(base_url=url, timeout=120) as client:
        def one(text: str) -> bytes:
            r = client.post("/v1/embeddings", json={"model": model, "input": text,
                                                    "encoding_format": "base64",
                                                    "truncate": True})
            r.raise_for_status()
            return base64.b64decode(r.json()["data"][0]["embedding"])

        with ThreadPoolExecutor(clients) as pool:
            return list(pool.map(one, inputs))


def forwards_by_count(url: str) -> dict[str, int]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, int] = {}
    for m in re.finditer(r'vllm_srun_forward_seconds_count\{[^}]*num_threads="(\d+)"[^}]*\} '
                         r'([\d.e+]+)', text):
        out[m[1]] = out.get(m[1], 0) + int(float(m[2]))
    return out


def run(model: str, inputs: int, clients: int, limits: tuple[int, int],
        learn_s: float = 120.0, work: Path | None = None, threads: int = 1) -> dict:
    """``threads``: the configured count (on a busy host 1 thread wins, so configure 2 to see
    learned counts served)."""
    work = work or Path(tempfile.mkdtemp(prefix="exactness-"))
    record = str(work / "record.sqlite")
    seqs, tokens = limits
    flags = ["--threads", str(threads), "--max-threads", "2", "--max-num-seqs", str(seqs),
             "--max-num-batched-tokens", str(tokens)]
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "vllm_srun.server", "threads", "verify", model,
                    *flags, "--record", record], check=True, capture_output=True)
    verify_s = time.monotonic() - began
    held_out = texts(inputs, 160, seed=2)
    adaptive = Server(model, [*flags, "--record", record], {"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "2"})
    try:
        end, bursts = time.monotonic() + learn_s, 0
        while time.monotonic() < end:  # learn until some range serves a learned count
            embed_all(adaptive.url, model, texts(64, 120, seed=100 + bursts), 1 + 15 * (bursts % 2))
            bursts += 1
            time.sleep(0.5)  # a gap: shadows run in it
            if any(r["state"] == "serving-learned" for r in adaptive.threads()["ranges"]):
                break
        before = forwards_by_count(adaptive.url)
        served = embed_all(adaptive.url, model, held_out, clients)
        after = forwards_by_count(adaptive.url)
        report = adaptive.threads()
    finally:
        adaptive.close()
    fixed = Server(model, flags, {})
    try:
        expected = embed_all(fixed.url, model, held_out, clients)
    finally:
        fixed.close()
    differing = sum(a != b for a, b in zip(served, expected, strict=True))
    return {"model": model, "inputs": inputs, "clients": clients, "limits": list(limits),
            "configured_threads": threads,
            "verify_s": round(verify_s, 1), "learning_bursts": bursts,
            "forwards_by_count": {n: after.get(n, 0) - before.get(n, 0) for n in after},
            "serving_ranges": [r["size_range"] for r in report["ranges"]
                               if r["state"] == "serving-learned"],
            "uncovered_forwards": report.get("uncovered_forwards"),
            "drift": report.get("drift"), "differing_answers": differing}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="paraphrase-MiniLM-L3-v2")
    p.add_argument("--inputs", type=int, default=5000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="the configured count")
    args = p.parse_args()
    print(json.dumps(run(args.model, args.inputs, args.clients,
                         (args.max_num_seqs, args.max_num_batched_tokens),
                         threads=args.threads), indent=1))


if __name__ == "__main__":
    main()
