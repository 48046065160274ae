"""wrk, the C load generator (Debian's ``wrk`` package), driven from Python: unique request
bodies per request (so no result cache answers), counts by status, latency percentiles.

A Python load generator shares the two cores with the server and adds milliseconds; wrk costs
far less per request (FACTS.md). wrk's latency histogram covers every response; where one
status dominates (the 429s of an overload run), its percentiles are that status's."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

# Every wrk thread gets its own id, counter and random seed, so bodies never repeat.
LUA = r"""
local threads = {}
function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end
function init(args)
  math.randomseed(id * 7919 + os.time())
  counter, ok, overloaded, other = 0, 0, 0, 0
end
function request()
  counter = counter + 1
  local body = string.format('{"input": "%s %d %d %d"}', TEXT, id, counter,
                             math.random(1, 1000000000))
  return wrk.format("POST", "/v1/embeddings", {["Content-Type"] = "application/json"}, body)
end
function response(status, headers, body)
  if status == 200 then ok = ok + 1
  elseif status == 429 then overloaded = overloaded + 1
  else other = other + 1 end
end
function done(summary, latency, requests)
  local o, v, x = 0, 0, 0
  for _, t in ipairs(threads) do
    o = o + t:get("ok"); v = v + t:get("overloaded"); x = x + t:get("other")
  end
  io.write(string.format("STATUS ok=%d overloaded=%d other=%d\n", o, v, x))
  io.write(string.format("LATENCY_MS p50=%.3f p90=%.3f p99=%.3f\n", latency:percentile(50)
    / 1000, latency:percentile(90) / 1000, latency:percentile(99) / 1000))
  io.write(string.format("SECONDS %.3f\n", summary.duration / 1e6))
end
"""


@dataclass(frozen=True)
class WrkResult:
    connections: int
    wall_s: float
    ok: int
    overloaded: int
    other: int
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @property
    def goodput_rps(self) -> float:
        return self.ok / self.wall_s

    @property
    def refusals_rps(self) -> float:
        return self.overloaded / self.wall_s


def available() -> bool:
    return shutil.which("wrk") is not None


def run(url: str, connections: int, duration_s: float, threads: int = 2,
        text: str = "a short query about the weather in the mountains") -> WrkResult:
    """Closed-loop: ``connections`` clients that send again as soon as answered (429s
    included: they ignore Retry-After)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(f"TEXT = {text!r}\n".replace("'", '"') + LUA)
        script.flush()
        out = subprocess.run(["wrk", "-t", str(min(threads, connections)), "-c",
                              str(connections), "-d", f"{duration_s:g}s", "--timeout", "30s",
                              "-s", script.name, url], capture_output=True, text=True,
                             timeout=duration_s + 60, check=True).stdout
    status = dict(re.findall(r"(\w+)=(\d+)", re.search(r"STATUS (.*)", out).group(1)))
    lat = dict(re.findall(r"(p\d+)=([\d.]+)", re.search(r"LATENCY_MS (.*)", out).group(1)))
    return WrkResult(connections, float(re.search(r"SECONDS ([\d.]+)", out).group(1)),
                     int(status["ok"]), int(status["overloaded"]), int(status["other"]),
                     float(lat["p50"]), float(lat["p90"]), float(lat["p99"]))
