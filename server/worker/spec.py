"""What one worker runs (the pool's order to a worker): a frozen dataclass, written to the
worker process as JSON by the pool and read back by the worker, or handed to an in-process
worker as it is."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import orjson

from vllm_srun.runtime.quality import GateThresholds
from vllm_srun.runtime.types import EngineArgs
from vllm_srun.tuner.adaptive import TunerSettings
from vllm_srun.tuner.modes import AdaptiveMode


@dataclass(frozen=True)
class WorkerSpec:
    model: str
    backend: str
    args: EngineArgs
    budget: int
    mode: AdaptiveMode = AdaptiveMode.OFF
    max_threads: int | None = None
    record_path: str | None = None
    settings: TunerSettings | None = None  # in-process only (tests): not sent to a process
    device: str = "cpu"
    # batch limits the deployment set; None = calibrate at start (R3.2). ``args`` holds
    # provisional values until then.
    set_max_num_seqs: int | None = None
    set_max_num_batched_tokens: int | None = None
    calibrate: bool = True
    revision: str | None = None  # the Hub revision when ``model`` is a Hugging Face Hub id
    dtype: str = "float32"  # a precision, or "auto" (R1.5)
    quality_gate: GateThresholds = GateThresholds()
    # share the host's cores with the other CPU workers through the ledger beside the host
    # record (R4.12): counts above the configured one only within ``budget`` together
    share_cores: bool = False
    learning_share: float | None = None  # the paid learning share; None: the tuner's default

    def to_json(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "settings"}
        fields["args"] = dataclasses.asdict(self.args)
        fields["mode"] = int(self.mode)
        return orjson.dumps(fields).decode()

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = orjson.loads(text)
        raw["args"] = EngineArgs(**raw["args"])
        raw["mode"] = AdaptiveMode(raw["mode"])
        if "quality_gate" in raw:
            raw["quality_gate"] = GateThresholds(**raw["quality_gate"])
        return cls(**raw)
