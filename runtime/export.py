"""Exporting an artifact to ONNX once per revision, into the cache (R1.3), and its int8 copy
(``quantization.py``'s default recipe, R1.5) once per revision and recipe beside it.

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
from vllm_srun.runtime.types import Manifest, Task

log = logging.getLogger(__name__)


def exported_path(manifest: Manifest) -> Path:
    return cache_dir() / "onnx" / f"{manifest.revision}-{manifest.task.value}.onnx"


def quantized_path(manifest: Manifest) -> Path:
    """The int8 copy's cache file, named by the recipe: a changed recipe makes a new copy."""
    from vllm_srun.runtime.quantization import DEFAULT

    return cache_dir() / "onnx" / (f"{manifest.revision}-{manifest.task.value}-int8-"
                                   f"{DEFAULT.name}.onnx")


def ensure_onnx(manifest: Manifest) -> Path:
    """The artifact's ONNX file: its own, else the cached export (made now if missing)."""
    if manifest.onnx_path:
        return Path(manifest.onnx_path)
    return once(exported_path(manifest), lambda target: _export(manifest, target))


def ensure_quantized(manifest: Manifest) -> Path:
    """The int8 copy of the artifact's ONNX file, in the cache (made now if missing)."""
    source = ensure_onnx(manifest)
    return once(quantized_path(manifest), lambda target: _quantize(manifest, source, target))


def once(target: Path, make) -> Path:
    """``target`` (a file or a folder), made by ``make(target)`` under a file lock unless it
    exists; ``make`` must create it by atomic rename."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            make(target)
    return target


def _quantize(manifest: Manifest, source: Path, target: Path) -> None:
    """The default int8 recipe (``quantization.py``: which MatMuls get int8 weights and which
    kernel runs them; onnxruntime's MLAS uses VNNI / AMX int8 units where the CPU has them)."""
    from vllm_srun.runtime.quantization import DEFAULT, quantize

    log.info("onnx_quantize model=%s revision=%s recipe=%s path=%s", manifest.name,
             manifest.revision, DEFAULT.name, target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        quantize(source, tmp, DEFAULT)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _export(manifest: Manifest, target: Path) -> None:
    import torch

    from vllm_srun.runtime.torch_model import load_module

    log.info("onnx_export model=%s revision=%s path=%s", manifest.name, manifest.revision, target)
    module = load_module(manifest)
    ids = torch.ones((2, 8), dtype=torch.long)
    out = "last_hidden_state" if manifest.task is Task.EMBED else "logits"
    per_token = manifest.task in (Task.EMBED, Task.TOKEN_CLASSIFY)
    inputs = ["input_ids", "attention_mask"]
    args: tuple = (ids, ids.clone())
    if manifest.task is Task.RERANK:  # text pairs: the second text's token type ids
        inputs.append("token_type_ids")
        args = (ids, ids.clone(), torch.zeros_like(ids))
    axes = {name: {0: "rows", 1: "tokens"} for name in inputs}
    axes[out] = {0: "rows", 1: "tokens"} if per_token else {0: "rows"}
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, str(tmp), dynamo=False,
                              input_names=inputs, output_names=[out],
                              dynamic_axes=axes, opset_version=17)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
