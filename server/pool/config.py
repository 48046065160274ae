"""``config.yaml`` (R6.1): the canonical config that the ``serve`` flags also write (R6.2,
:mod:`.flags`). Errors name the key (``global.model_catalog.deployments.primary.replicas[1]
.device: ...``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vllm_srun.runtime.device import is_gpu, parse_device
from vllm_srun.runtime.errors import ConfigError, Unsupported
from vllm_srun.runtime.precision import AUTO, check_supported
from vllm_srun.runtime.quality import GateThresholds
from vllm_srun.server.pool.fields import (
    check_adaptive,
    check_endpoint,
    check_env_name,
    check_revision,
    check_served_names,
)

DEFAULT_DEPLOYMENT = "primary"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Positive = Annotated[int, Field(ge=1, strict=True)]


class EngineConfig(_Strict):
    """Engine arguments; batch limits left unset are calibrated per worker (R3.2)."""

    num_threads: Positive | None = None
    max_num_seqs: Positive | None = None
    max_num_batched_tokens: Positive | None = None
    timeout_ms: Positive = 30_000
    cache_entries: Annotated[int, Field(ge=0, strict=True)] = 4096
    concurrent_forwards: Annotated[int, Field(ge=1, le=16, strict=True)] = 1


class OutlierConfig(_Strict):
    consecutive_timeouts: Annotated[int, Field(ge=0, strict=True)] = 3
    base_ejection_ms: Positive = 30_000
    max_ejection_ms: Annotated[int, Field(ge=1, le=3_600_000, strict=True)] | None = None
    max_ejection_percent: Annotated[int, Field(ge=0, le=100, strict=True)] = 50


Share = Annotated[float, Field(ge=0.0, le=1.0)]


class QualityGateConfig(_Strict):
    """Thresholds a reduced precision must reach against float32 at load (R1.5); unset keys
    keep ``GateThresholds``' defaults."""

    min_cosine: Share | None = None
    min_label_agreement: Share | None = None
    max_prob_diff: Share | None = None
    min_order_agreement: Share | None = None
    min_span_agreement: Share | None = None

    def thresholds(self) -> GateThresholds:
        return GateThresholds(**self.model_dump(exclude_none=True))


class ReplicaConfig(_Strict):
    device: str | None = None
    endpoint: str | None = None
    model: str | None = None
    # the environment variable holding the Bearer key of a protected attached endpoint
    api_key_env: str | None = None

    _endpoint = field_validator("endpoint")(lambda v: None if v is None else check_endpoint(v))
    _key_env = field_validator("api_key_env")(check_env_name)

    @model_validator(mode="after")
    def _one_placement(self):
        if (self.device is None) == (self.endpoint is None):
            raise ValueError("a replica needs exactly one of device or endpoint")
        if self.device is not None:
            parse_device(self.device)
            if self.model is not None:
                raise ValueError("model names an attached replica's served model; "
                                 "a managed replica serves the deployment's artifact")
            if self.api_key_env is not None:
                raise ValueError("api_key_env is for attached replicas (endpoint); managed "
                                 "workers are reached on owner-only sockets")
        else:
            if not self.model:
                raise ValueError("an attached replica (endpoint) needs its own model")
        return self


class DeploymentConfig(_Strict):
    provider: Literal["model_runtime"] = "model_runtime"
    artifact: str
    backend: Literal["onnxruntime", "torch"] | None = None
    device: str | None = None
    endpoint: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    replicas: list[ReplicaConfig] | None = None
    revision: str | None = None  # the Hub revision of a Hugging Face Hub id artifact
    # the ids clients send, the first the one answers report (default: the model's name)
    served_model_name: str | list[str] | None = None
    adaptive_threads: Literal["off", "learn", "serve"] | None = None  # None: the env var

    _revision = field_validator("revision")(lambda v: None if v is None else check_revision(v))
    _served = field_validator("served_model_name", mode="before")(
        lambda v: None if v is None else check_served_names(v))
    _adaptive = field_validator("adaptive_threads", mode="before")(
        lambda v: None if v is None else check_adaptive(v))
    # numeric precision of the forwards (R1.5); None: float32
    dtype: Literal["float32", "bfloat16", "int8", "auto"] | None = None
    quality_gate: QualityGateConfig | None = None

    _endpoint = field_validator("endpoint")(lambda v: None if v is None else check_endpoint(v))
    _key_env = field_validator("api_key_env")(check_env_name)
    engine: EngineConfig = EngineConfig()
    outlier_detection: OutlierConfig = OutlierConfig()

    @field_validator("dtype")
    @classmethod
    def _backend_runs_dtype(cls, dtype: str | None, info: ValidationInfo) -> str | None:
        """The backend runs it: CPU replicas the deployment's backend, GPU replicas torch
        (and no int8: its quantized kernels are CPU-only)."""
        if dtype is None or dtype == AUTO:
            return dtype
        replicas = info.data.get("replicas") or []
        if info.data.get("endpoint") or (replicas and all(r.endpoint for r in replicas)):
            raise ValueError("dtype applies to managed workers; an attached endpoint serves "
                             "in its own precision")
        devices = [r.device for r in replicas if r.device] or [info.data.get("device") or "cpu"]
        gpu = [d for d in devices if is_gpu(d)]
        if gpu and dtype == "int8":
            raise ValueError(f"int8 runs on the CPU only, not on {gpu[0]}")
        backend = "torch" if len(gpu) == len(devices) else info.data.get("backend")
        try:
            check_supported(backend or "onnxruntime", dtype)
        except Unsupported as exc:
            raise ValueError(str(exc)) from None
        return dtype

    def thresholds(self) -> GateThresholds:
        return self.quality_gate.thresholds() if self.quality_gate else GateThresholds()

    @model_validator(mode="after")
    def _placement(self):
        if self.replicas is not None:
            if self.device is not None or self.endpoint is not None:
                raise ValueError("replicas cannot be combined with deployment-level device or "
                                 "endpoint")
            if not self.replicas:
                raise ValueError("replicas must not be empty (omit it for one worker)")
            if self.model is not None or self.api_key_env is not None:
                raise ValueError("model and api_key_env belong to an attached replica, not "
                                 "the deployment")
        elif self.endpoint is not None or self.device is not None or self.model is not None:
            ReplicaConfig(device=self.device, endpoint=self.endpoint, model=self.model,
                          api_key_env=self.api_key_env)
        if self.adaptive_threads is not None and all(r.endpoint for r in self.placements()):
            raise ValueError("adaptive_threads applies to managed workers; this deployment "
                             "only attaches endpoints")
        return self

    def placements(self) -> list[ReplicaConfig]:
        """The replicas, with the one-worker shorthand spelled out."""
        if self.replicas is not None:
            return list(self.replicas)
        if self.endpoint is not None:
            return [ReplicaConfig(endpoint=self.endpoint, model=self.model,
                                  api_key_env=self.api_key_env)]
        return [ReplicaConfig(device=self.device or "cpu")]

    @property
    def shorthand(self) -> bool:
        return self.replicas is None

    @property
    def served_names(self) -> tuple[str, ...]:
        """``served_model_name`` as a tuple (empty: unset); the first is the reported id."""
        names = self.served_model_name
        return () if names is None else (names,) if isinstance(names, str) else tuple(names)


class RouterConfig(_Strict):
    enabled: bool = False

    @model_validator(mode="after")
    def _no_router(self):
        if self.enabled:
            raise ValueError("this runtime has no semantic router; set enabled: false")
        return self


class CatalogConfig(_Strict):
    deployments: dict[str, DeploymentConfig]

    @model_validator(mode="after")
    def _names(self):
        if not self.deployments:
            raise ValueError("deployments must name at least one deployment")
        for name in self.deployments:
            if not _NAME.match(name):
                raise ValueError(f"deployment name {name!r} must be 1-63 characters of "
                                 "letters, digits, '.', '_' or '-'")
        taken = {name: name for name in self.deployments}  # id -> the deployment it names
        for name, dep in self.deployments.items():
            for served in dep.served_names:
                if taken.get(served, name) != name:
                    raise ValueError(f"deployments.{name}.served_model_name {served!r} is "
                                     f"already an id of deployment {taken[served]!r}; ids must "
                                     f"be unique")
                taken[served] = name
        return self


class BindingConfig(_Strict):
    deployment: str


class SystemConfig(_Strict):
    decision_model: BindingConfig | None = None


class GlobalConfig(_Strict):
    router: RouterConfig = RouterConfig()
    model_catalog: CatalogConfig
    system: SystemConfig = SystemConfig()

    @model_validator(mode="after")
    def _binding(self):
        bound = self.system.decision_model
        if bound is not None and bound.deployment not in self.model_catalog.deployments:
            raise ValueError(f"system.decision_model.deployment names {bound.deployment!r}, "
                             f"not one of {sorted(self.model_catalog.deployments)}")
        return self


class Config(_Strict):
    global_: GlobalConfig = Field(alias="global")
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @property
    def deployments(self) -> dict[str, DeploymentConfig]:
        return self.global_.model_catalog.deployments

    @property
    def bound(self) -> str:
        """The deployment that serves requests naming no model."""
        b = self.global_.system.decision_model
        return b.deployment if b is not None else next(iter(self.deployments))

    def to_yaml(self) -> str:
        data = self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=False)
        return yaml.safe_dump(data, sort_keys=False)


def _key_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "literal[", "constrained-")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "config"


def validate(data: object, source: str = "config") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with a 'global' key")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = _key_path(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        raise ConfigError(f"{source}: {key}: {msg}") from None


def load(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --config {p}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return validate(data, str(p))


def endpoint_key(r: ReplicaConfig, where: str) -> str | None:
    """The Bearer key of a protected attached endpoint, read from the environment variable
    its ``api_key_env`` names (never from the file); ConfigError names ``where`` if unset."""
    if r.api_key_env is None:
        return None
    value = os.environ.get(r.api_key_env, "")
    if not value:
        raise ConfigError(f"{where}.api_key_env: environment variable {r.api_key_env} is not "
                          f"set (it must hold the endpoint's API key)")
    return value


def replica_key_path(name: str, dep: DeploymentConfig, index: int) -> str:
    base = f"global.model_catalog.deployments.{name}"
    return base if dep.shorthand else f"{base}.replicas[{index}]"


def check_endpoint_keys(config: Config) -> None:
    """Every protected attached endpoint's key variable is set."""
    for name, dep in config.deployments.items():
        for i, r in enumerate(dep.placements()):
            endpoint_key(r, replica_key_path(name, dep, i))


def check_placement(config: Config, available: dict[str, int]) -> None:
    """Refuse placements on devices this machine does not have, naming the key."""
    for name, dep in config.deployments.items():
        for i, r in enumerate(dep.placements()):
            if r.device is None:
                continue
            platform, index = parse_device(r.device)
            if platform == "cpu":
                continue
            have = available.get(platform, 0)
            if index >= have:
                key = (f"global.model_catalog.deployments.{name}."
                       + (f"replicas[{i}].device" if not dep.shorthand else "device"))
                raise ConfigError(f"{key}: {r.device} is not available on this machine "
                                  f"({have} {platform} device(s) visible)")
