"""The ``serve`` flags written into the canonical config (R6.2).

The file and the flags are one resource: :func:`apply_flags` turns ``MODEL --platform -dp
--device-ids --threads ...`` into edits of a :class:`~.config.Config`, and ``vllm-srun config
show`` prints the result; :func:`single` is the one-deployment config flags start from.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_srun.runtime.device import parse_device
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.server.pool.config import (
    DEFAULT_DEPLOYMENT,
    Config,
    DeploymentConfig,
    EngineConfig,
    ReplicaConfig,
    validate,
)


def single(artifact: str, backend: str | None = None, engine: EngineConfig | None = None,
           replicas: list[ReplicaConfig] | None = None) -> Config:
    dep = DeploymentConfig(artifact=artifact, backend=backend, replicas=replicas,
                           engine=engine or EngineConfig())
    return validate({"global": {"router": {"enabled": False},
                                "model_catalog": {"deployments": {
                                    DEFAULT_DEPLOYMENT: dep.model_dump(exclude_none=True)}},
                                "system": {"decision_model":
                                           {"deployment": DEFAULT_DEPLOYMENT}}}})


def _edit(config: Config, name: str, **changes) -> Config:
    data = config.model_dump(by_alias=True, exclude_none=True)
    data["global"]["model_catalog"]["deployments"][name].update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        data["global"]["model_catalog"]["deployments"][name].pop(key)
    return validate(data, "flags")


def apply_flags(config: Config | None, *, model: str | None, platform: str | None,
                dp: int | None, device_ids: list[int] | None, available: dict[str, int],
                backend: str | None = None, engine: Mapping[str, object] | None = None,
                settings: Mapping[str, object] | None = None) -> Config:
    """Write the ``serve`` flags into the canonical config (R6.2).

    - Only MODEL: the bound deployment's artifact changes; replicas and engine arguments stay.
    - ``settings`` maps dotted keys of the bound deployment (``served_model_name``,
      ``engine.num_threads``) to the values flags gave; ``backend`` and ``engine`` are the
      same for ``backend`` and ``engine.*``.
    - ``-dp N`` with device ids: N workers spread over the ids in order (repeating an id
      starts several workers on one device).
    - ``-dp N`` on a GPU platform without ids, for a new placement: the first N available
      devices; too few is refused. An existing placement resizes in its declared order.
    - ``available`` maps platform -> visible device count (cpu: any number).
    """
    settings = {**({"backend": backend} if backend is not None else {}),
                **{f"engine.{k}": v for k, v in (engine or {}).items()}, **(settings or {})}
    if config is None:
        from vllm_srun.runtime.artifact import DEFAULT_MODEL

        config = single(model or DEFAULT_MODEL, settings.pop("backend", None))
    elif model is not None:  # MODEL replaces the artifact and the file's Hub revision with it
        config = _edit(config, config.bound, artifact=model, revision=None)
    name = config.bound
    if settings:
        config = _write(config, name, settings)
    if dp is None and platform is None and device_ids is None:
        return config
    devices = _placed_devices(config.deployments[name], platform, dp, device_ids, available)
    data = config.model_dump(by_alias=True, exclude_none=True)
    entry = data["global"]["model_catalog"]["deployments"][name]
    for key in ("device", "endpoint", "model"):
        entry.pop(key, None)
    entry["replicas"] = [{"device": d} for d in devices]
    return validate(data, "flags")


def _write(config: Config, name: str, settings: Mapping[str, object]) -> Config:
    """``config`` with each dotted key of deployment ``name`` set to its value."""
    data = config.model_dump(by_alias=True, exclude_none=True)
    entry = data["global"]["model_catalog"]["deployments"][name]
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = entry
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return validate(data, "flags")


def _placed_devices(dep: DeploymentConfig, platform: str | None, dp: int | None,
                    device_ids: list[int] | None, available: dict[str, int]) -> list[str]:
    """The devices of ``-dp``/``--platform``/``--device-ids`` (R6.2's placement rules)."""
    current = dep.placements()
    current_platform = parse_device(current[0].device)[0] if current[0].device else None
    platform = platform or (current_platform or "cpu")
    if device_ids is not None and platform == "cpu":
        raise ConfigError("--device-ids applies to --platform cuda or rocm")
    if dp is None:
        dp = len(device_ids) if device_ids else len(current)
    same_platform = all(r.device and parse_device(r.device)[0] == platform for r in current)
    if platform == "cpu":
        return ["cpu"] * dp
    if device_ids is not None:
        devices = [f"{platform}:{device_ids[i % len(device_ids)]}" for i in range(dp)]
    elif same_platform and not dep.shorthand:
        declared = [r.device for r in current]
        devices = [declared[i % len(declared)] for i in range(dp)]  # declared order
    else:
        have = available.get(platform, 0)
        if have < dp:
            raise ConfigError(f"-dp {dp} on --platform {platform} needs {dp} devices; "
                              f"{have} available (pass --device-ids to repeat a device)")
        devices = [f"{platform}:{i}" for i in range(dp)]
    for d in devices:
        _, index = parse_device(d)
        if index is not None and index >= available.get(platform, 0):
            raise ConfigError(f"device {d} is not available: {available.get(platform, 0)} "
                              f"{platform} device(s) visible")
    return devices
