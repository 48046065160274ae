"""Loaded by the servers ``bench.engine_split`` starts (``PYTHONPATH``): times where their
engine's scheduler thread spends each served forward and writes the running totals to
``$VLLM_SRUN_ENGINE_SPLIT-<pid>.json`` twice a second. A bench probe, never loaded by a
server a user starts."""

import json
import os
import threading
import time

if os.environ.get("VLLM_SRUN_ENGINE_SPLIT"):
    from vllm_srun.runtime import engine as _engine
    from vllm_srun.runtime import threads as _threads

    TOTALS = dict.fromkeys(("serve_s", "run_s", "forward_s", "lane_wait_s", "policy_s",
                            "deliver_s", "pad_s"), 0.0) | {"forwards": 0, "handed": 0}
    _clock = time.perf_counter

    def _write() -> None:
        path = f"{os.environ['VLLM_SRUN_ENGINE_SPLIT']}-{os.getpid()}.json"
        while True:
            time.sleep(0.5)
            with open(path + ".tmp", "w") as f:
                json.dump(TOTALS, f)
            os.replace(path + ".tmp", path)

    def _timed(key, fn):
        def wrapper(*args, **kwargs):
            t = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                TOTALS[key] += _clock() - t
        return wrapper

    def _policy(policy):
        if not getattr(policy, "_split_timed", False):
            policy.served_threads = _timed("policy_s", policy.served_threads)
            policy.observe = _timed("policy_s", policy.observe)
            policy._split_timed = True

    serve, run = _engine.Engine._serve, _engine.Engine._run

    def _serve(self, *args, **kwargs):
        _policy(self.threads)
        TOTALS["forwards"] += 1
        return _timed("serve_s", serve)(self, *args, **kwargs)

    def _run(self, n, fn, *args):
        def forward():
            result = fn()
            TOTALS["forward_s"] += result.forward_s
            return result
        return _timed("run_s", run)(self, n, forward, *args)

    lane_run = _threads.ThreadContext.run

    def _lane_run(self, n, fn):
        handed = not (_threads.lane_threads() == n and getattr(
            _threads._local, "lane_idle", False) == self.idle)
        t = _clock()
        box = {}

        def marked():
            box["at"] = _clock()
            return fn()
        result = lane_run(self, n, marked)
        if handed and not self.idle:  # from the hand-off to the lane's start of ``fn``
            TOTALS["handed"] += 1
            TOTALS["lane_wait_s"] += box["at"] - t
        return result

    _engine.Engine._serve, _engine.Engine._run = _serve, _run
    _engine.Engine._deliver = _timed("deliver_s", _engine.Engine._deliver)
    _engine.pad = _timed("pad_s", _engine.pad)
    _threads.ThreadContext.run = _lane_run
    threading.Thread(target=_write, daemon=True).start()
