"""Weights a worker and its shadow process share: both map one read-only file per artifact
revision and precision, so the kernel keeps one copy of the weights in the page cache and a
learning worker holds about one model, not two.

How it works: the first load writes the file into the cache (under a file lock, by atomic
rename); every later load, in the worker and in its shadow child, memory-maps it.

- onnxruntime: an optimized copy of the model whose initializers, already prepacked by
  onnxruntime for this CPU (``session.save_external_prepacked_constant_initializers``), lie
  in an external data file that every session maps. A prepacked layout belongs to one CPU
  and one onnxruntime, so the host fingerprint is part of the copy's name. Without it each
  session (one per thread count) prepacked its own copy of every MatMul weight in private
  memory.
- torch: the module's state dict (float32 or bfloat16), loaded with ``torch.load(mmap=True)``
  and assigned into the module, so its parameters stay file-backed. int8 is not shared:
  ``quantize_dynamic`` packs weights into fbgemm's own memory; nor are bfloat16 ``Linear``
  weights where ``torch_fast.py`` packs them for oneDNN (each process its own packed copy;
  the mapped originals' pages are then dropped from the process, ``release_pages``; the rest
  of the model, embeddings included, stays shared).

Invariant: a shared load gives answers bit for bit the same as a private one (the same
values, the same kernels; ``tests/test_weights.py`` checks both backends), so a worker whose
cache cannot be written falls back to a private load (``shared_weights_unavailable`` in the
log) and its shadows still match its answers. That needs the private weights to lie in
memory as the shared ones do: on some CPUs float32 products answer otherwise when a weight
starts elsewhere within a cache line (measured on an AMD EPYC host: transformers maps
weights straight from model.safetensors, 8-byte aligned, and a small model's answers
changed in the last bits), and ``torch.save`` starts each tensor on 64 bytes, so a private
float32 or bfloat16 load is first copied to aligned memory (``align``). int8, never shared,
is not: its processes map model.safetensors alike (a mapping starts on a page, so each
tensor lies at the same offset in every process), and a copy would make resident the
float embeddings that the mapping reads only where a token touches them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from vllm_srun.runtime.export import once
from vllm_srun.runtime.host import host_fingerprint
from vllm_srun.runtime.paths import cache_dir
from vllm_srun.runtime.precision import Precision
from vllm_srun.runtime.types import BackendName, Manifest

log = logging.getLogger(__name__)

ONNX_DATA = "model.data"  # the external data file beside a shared model.onnx
ALIGNMENT = 64  # bytes: where torch.save starts each tensor, and its CPU allocator


def shared_onnx_path(manifest: Manifest, precision: Precision, source: Path) -> Path:
    """Where the shared copy of the ONNX file ``source`` lives for this host: named by the
    host fingerprint (CPU, onnxruntime) and by ``source`` itself (its path, size and time:
    an int8 copy made by another recipe, or a replaced model file, gets a copy of its own)."""
    host, _ = host_fingerprint(BackendName.ONNXRUNTIME, 0)
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{host}".encode())
    name = f"{manifest.revision}-{manifest.task.value}-{precision.value}-{key.hexdigest()[:16]}"
    return cache_dir() / "shared" / name / "model.onnx"


def shared_onnx(manifest: Manifest, precision: Precision, source: Path) -> Path:
    """The shared copy of ``source`` (made now if missing); ``source`` itself if the cache
    cannot hold it (then every session keeps a private copy)."""
    target = None
    try:
        target = shared_onnx_path(manifest, precision, source)
        once(target.parent, lambda folder: _write_onnx(source, folder))
    except Exception as exc:  # onnxruntime's errors are untyped; a private load still works
        log.warning("shared_weights_unavailable backend=onnxruntime path=%s error=%s",
                    target, exc)
        return source
    return target


def _write_onnx(source: Path, folder: Path) -> None:
    """Let onnxruntime optimize ``source`` and write the result, its prepacked weights as
    external data, into ``folder`` (which appears whole, by rename)."""
    import onnxruntime as ort

    log.info("shared_weights_write backend=onnxruntime source=%s path=%s", source, folder)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.optimized_model_filepath = str(tmp / "model.onnx")
        for key, value in (("session.save_external_prepacked_constant_initializers", "1"),
                           ("session.optimized_model_external_initializers_file_name",
                            ONNX_DATA),
                           ("session.optimized_model_external_initializers_min_size_in_bytes",
                            "128")):
            opts.add_session_config_entry(key, value)
        ort.InferenceSession(str(source), opts, providers=["CPUExecutionProvider"])
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shared_state_path(manifest: Manifest, precision: Precision) -> Path:
    """Where the shared state dict of an artifact's torch module lives."""
    import torch
    import transformers

    name = (f"{manifest.revision}-{manifest.task.value}-{precision.value}"
            f"-torch{torch.__version__}-transformers{transformers.__version__}.pt")
    return cache_dir() / "shared" / name


def share_module(manifest: Manifest, precision: Precision, module) -> bool:
    """Replace ``module``'s parameters and buffers by ones mapped from the shared state file
    (written from this module now if missing). Returns whether they are shared; on a cache
    that cannot hold the file the module keeps its private weights."""
    import torch

    target = shared_state_path(manifest, precision)
    try:
        once(target, lambda path: _write_state(module, path))
        state = torch.load(target, map_location="cpu", mmap=True, weights_only=True)
        module.load_state_dict(state, strict=True, assign=True)
    except Exception as exc:  # torch's errors are of many kinds; a private load still works
        log.warning("shared_weights_unavailable backend=torch path=%s error=%s", target, exc)
        return False
    return True


def align(module, to: int = ALIGNMENT) -> int:
    """Copy each floating-point parameter and buffer of ``module`` that does not start on a
    ``to``-byte boundary into memory that does (torch's CPU allocator aligns to 64 bytes), so
    private weights lie as the shared file's do. A tensor two modules hold stays one tensor.
    Returns how many tensors were copied."""
    import torch

    copies: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for owner in module.modules():
            held = [(name, t, True) for name, t in owner.named_parameters(recurse=False)]
            held += [(name, t, False) for name, t in owner.named_buffers(recurse=False)]
            for name, tensor, parameter in held:
                if not tensor.is_floating_point() or tensor.device.type != "cpu" \
                        or tensor.data_ptr() % to == 0:
                    continue
                key = tensor.data_ptr()
                if key not in copies:
                    copy = tensor.detach().clone(memory_format=torch.contiguous_format)
                    if copy.data_ptr() % to:
                        raise RuntimeError(f"torch's allocator gave {copy.data_ptr() % to} "
                                           f"bytes past a {to}-byte boundary")
                    copies[key] = (torch.nn.Parameter(copy, requires_grad=False)
                                   if parameter else copy)
                if parameter:
                    owner._parameters[name] = copies[key]
                else:
                    owner._buffers[name] = copies[key]
    return len(copies)


def release_pages(tensors, path: Path) -> int:
    """Drop this process's pages of each of ``tensors`` that lies inside a memory mapping of
    the file ``path`` and that nothing reads any more (``torch_fast`` packed copies of them):
    whole pages only, with ``madvise(MADV_DONTNEED)``. The file's pages stay in the page cache
    for the other processes that map it, and the kernel reads them from the file again if a
    tensor is touched; a tensor outside such a mapping (private weights) is left alone, and
    freed with its last reference. Returns how many tensors had pages dropped."""
    import ctypes
    import mmap

    try:
        with open("/proc/self/maps") as maps:
            spans = [tuple(int(x, 16) for x in fields[0].split("-"))
                     for fields in (line.split(maxsplit=5) for line in maps)
                     if len(fields) == 6 and fields[5].strip() == str(path)]
    except OSError:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page, released = mmap.PAGESIZE, 0
    for tensor in tensors:
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        first, last = -(-start // page) * page, (start + size) // page * page
        if last > first and any(lo <= start and start + size <= hi for lo, hi in spans):
            released += libc.madvise(first, last - first, mmap.MADV_DONTNEED) == 0
    return released


def _write_state(module, target: Path) -> None:
    import torch

    log.info("shared_weights_write backend=torch path=%s", target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        torch.save(module.state_dict(), tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
