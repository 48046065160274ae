"""Exporting an artifact to ONNX once per revision, into the cache (R1.3).

Several workers may start at once: an exclusive file lock makes one export and the others
wait and reuse it; the file appears by atomic rename, so a killed exporter leaves no half file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import warnings
from pathlib import Path

from vllm_srun.runtime.paths import cache_dir
from vllm_srun.runtime.types import Manifest

log = logging.getLogger(__name__)


def exported_path(manifest: Manifest) -> Path:
    return cache_dir() / "onnx" / f"{manifest.revision}-{manifest.task.value}.onnx"


def ensure_onnx(manifest: Manifest) -> Path:
    """The artifact's ONNX file: its own, else the cached export (made now if missing)."""
    if manifest.onnx_path:
        return Path(manifest.onnx_path)
    target = exported_path(manifest)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _export(manifest, target)
    return target


def _export(manifest: Manifest, target: Path) -> None:
    import torch

    from vllm_srun.runtime.torch_model import load_module

    log.info("onnx_export model=%s revision=%s path=%s", manifest.name, manifest.revision, target)
    module = load_module(manifest)
    ids = torch.ones((2, 8), dtype=torch.long)
    out = "logits" if manifest.task.value == "classify" else "last_hidden_state"
    axes = {"input_ids": {0: "rows", 1: "tokens"}, "attention_mask": {0: "rows", 1: "tokens"},
            out: {0: "rows"} if out == "logits" else {0: "rows", 1: "tokens"}}
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (ids, ids.clone()), str(tmp), dynamo=False,
                              input_names=["input_ids", "attention_mask"], output_names=[out],
                              dynamic_axes=axes, opset_version=17)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
