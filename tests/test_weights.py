"""Shared weights (``runtime/weights.py``): a worker and its shadow process map one weights
file, and a shared load answers bit for bit like a private one (R4.5: a shadow must reproduce
the served answer bit for bit; the issue's target: learning holds <= 1.3x the memory of mode
0, measured in ``bench/memory.py``).

Real backends, a real ``ShadowProcess`` child; memory is read from ``/proc/<pid>/smaps``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import L3, L6, cpu_lacks, row
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import OnnxBackend, TorchBackend, load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.export import ensure_onnx, ensure_quantized
from vllm_srun.runtime.precision import Precision
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.torch_fast import packs
from vllm_srun.runtime.torch_fast import weights as torch_weights
from vllm_srun.runtime.weights import ALIGNMENT, align, shared_onnx_path, shared_state_path
from vllm_srun.tuner.adaptive import output_bits
from vllm_srun.tuner.shadows import ShadowProcess

pytestmark = [pytest.mark.required_in_ci,  # CI runs on Linux
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")]

BATCHES = [pad([row(9)]), pad([row(60, 1), row(33, 2)]), pad([row(200, 3)] * 4)]


def mapping_kb(pid: int, path: Path) -> tuple[int, int]:
    """(RSS, PSS) in kB of a process's mappings of ``path``."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and head[0] == "Rss:":
            rss += int(head[1])
        elif inside and head[0] == "Pss:":
            pss += int(head[1])
    return rss, pss


@pytest.mark.parametrize(("model", "backend_name"), [(L3, "onnxruntime"), (L6, "torch")])
def test_a_shadow_process_maps_the_weights_file_its_worker_maps(model, backend_name):
    """The child maps the very file the worker maps, and the pages both touched are counted
    half to each (PSS about half the RSS of the mapping); its answers are the worker's."""
    manifest = resolve(model)
    served = load_backend(manifest, backend_name)
    weights = (shared_onnx_path(manifest, Precision.FLOAT32, Path(manifest.onnx_path)).parent
               / "model.data"
               if backend_name == "onnxruntime"
               else shared_state_path(manifest, Precision.FLOAT32))
    shadows = ShadowProcess(manifest, backend_name)
    context = ThreadContext()
    try:
        batch = BATCHES[1]
        shadow = shadows.forward(batch, 1)
        reference = context.run(1, lambda: served.forward(batch, 1))
        assert np.array_equal(output_bits(shadow.outputs), output_bits(reference.outputs))
        worker_rss, _ = mapping_kb(os.getpid(), weights)
        child_rss, child_pss = mapping_kb(shadows.process.pid, weights)
        assert worker_rss > 1024 and child_rss > 1024, (worker_rss, child_rss)
        assert child_pss < 0.75 * child_rss, (child_pss, child_rss)
    finally:
        context.shutdown()
        shadows.close()


def _same_answers(a, b, counts=(1, 2), batches=BATCHES) -> None:
    context = ThreadContext()
    try:
        for batch in batches:
            for n in counts:
                x = context.run(n, lambda k=n, t=batch: a.forward(t, k)).outputs
                y = context.run(n, lambda k=n, t=batch: b.forward(t, k)).outputs
                assert np.array_equal(output_bits(x), output_bits(y)), (batch.input_ids.shape,
                                                                         n)
    finally:
        context.shutdown()


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_onnxruntime_shared_weights_answer_like_a_private_session(precision):
    """The shared copy (optimized, weights prepacked into a mapped file) changes no bit."""
    manifest = resolve(L3)
    shared = load_backend(manifest, "onnxruntime", precision=precision)
    source = ensure_quantized(manifest) if precision == "int8" else ensure_onnx(manifest)
    assert shared.onnx_path == str(source)
    assert shared.session_path == str(shared_onnx_path(manifest, Precision(precision), source))
    _same_answers(shared, OnnxBackend(manifest, str(source), precision=Precision(precision)))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_torch_shared_weights_answer_like_private_ones_and_are_file_backed(precision):
    manifest = resolve(L6)
    shared = load_backend(manifest, "torch", precision=precision)
    assert shared.shared
    path = str(shared_state_path(manifest, Precision(precision)))
    mapped = [line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines()
              if line.endswith(path)]
    spans = [tuple(int(x, 16) for x in m.split("-")) for m in mapped]
    # what the served forward reads: the frozen trace's constants (the same tensors as the
    # module's, not copies), all in the mapped file but for packed bfloat16 weights and the
    # biases of the attention's fused projections (the three side by side: 2 KB a layer)
    made = {p.data_ptr() for name, p in shared.module.named_parameters()
            if name.endswith("fused_projections.bias")}
    assert len(made) == (6 if packs(Precision(precision)) else 0)
    read = [t for t in torch_weights(shared.module)
            if not t.is_mkldnn and t.data_ptr() not in made]  # packed: private
    assert read
    for i, tensor in enumerate(read):
        assert any(lo <= tensor.data_ptr() < hi for lo, hi in spans), (i, tensor.shape)
    private = TorchBackend(manifest, precision=Precision(precision), share_weights=False)
    assert not private.shared
    _same_answers(shared, private)


def test_private_torch_weights_lie_as_shared_ones_do_and_answer_alike(cross_encoder_dir):
    """transformers maps weights straight from model.safetensors, where a tensor may start
    anywhere past an 8-byte boundary; ``torch.save`` (the shared file) starts each on 64
    bytes. On some CPUs float32 products answer otherwise with the weights elsewhere in a
    cache line (on an AMD EPYC host this small cross-encoder's answers changed in the last
    bits), so a private load is copied to aligned memory and answers as a shared one does."""
    manifest = resolve(str(cross_encoder_dir))
    private = TorchBackend(manifest, share_weights=False)
    assert not private.shared
    read = [t for t in torch_weights(private.module) if not t.is_mkldnn]
    assert read and all(t.data_ptr() % ALIGNMENT == 0 for t in read)
    shared = load_backend(manifest, "torch")
    assert shared.shared
    rng = np.random.default_rng(3)
    vocab = private.module.source.inner.config.vocab_size
    batches = [pad([[int(t) for t in rng.integers(5, vocab, n)] for n in lengths],
                   [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths])
               for lengths in ((7,), (9, 30, 17), (100,))]
    _same_answers(shared, private, batches=batches)


def test_align_copies_only_what_is_off_the_boundary_and_keeps_tied_tensors_tied():
    module = torch.nn.Module()
    base = torch.zeros(64 + 3)
    module.a = torch.nn.Linear(4, 4)
    module.b = torch.nn.Linear(4, 4)
    module.b.weight = module.a.weight  # tied
    module.register_buffer("odd", base[3:])  # 12 bytes past a boundary
    module.register_buffer("ids", torch.arange(5)[1:])  # not floating point: left alone
    kept = module.a.bias
    assert align(module) == 1 + (module.a.weight.data_ptr() % ALIGNMENT != 0)
    assert module.odd.data_ptr() % ALIGNMENT == 0 and torch.equal(module.odd, base[3:])
    assert module.a.bias is kept and module.b.weight is module.a.weight
    assert module.ids.data_ptr() % ALIGNMENT != 0
    assert align(module) == 0


def test_a_cache_that_cannot_hold_the_shared_copy_loads_private_weights(tmp_path, monkeypatch,
                                                                       caplog):
    """A worker whose cache folder cannot be written still serves (its own ONNX file, its
    own torch weights) and says why in the log."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_SRUN_CACHE_DIR", str(blocker / "cache"))
    manifest = resolve(L3)  # ships its ONNX file: no export into the cache
    with caplog.at_level(logging.WARNING, logger="vllm_srun.runtime.weights"):
        backend = load_backend(manifest, "onnxruntime")
    assert backend.session_path == backend.onnx_path == manifest.onnx_path
    assert backend.forward(BATCHES[0], 1).outputs.shape == (1, 384)
    assert "shared_weights_unavailable backend=onnxruntime" in caplog.text
    with caplog.at_level(logging.WARNING, logger="vllm_srun.runtime.weights"):
        torch_backend = load_backend(resolve(L6), "torch")
    assert not torch_backend.shared
    assert torch_backend.forward(BATCHES[0], 1).outputs.shape == (1, 384)
    assert "shared_weights_unavailable backend=torch" in caplog.text


def test_packed_bfloat16_weights_leave_the_mapped_originals_unresident():
    """Where ``torch_fast`` packs bfloat16 Linear weights, the mapped originals are read once
    (to pack) and then dropped from the process (``release_pages``): in a fresh process that
    loads the backend and serves, the shared file's mapping holds less than the file less
    half the packed weights; a tensor outside any mapping of the file is left alone."""
    if not packs(Precision.BFLOAT16):
        cpu_lacks("oneDNN does not run bfloat16 here: nothing is packed")
    code = f"""
import json, torch
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.precision import Precision
from vllm_srun.runtime.weights import release_pages, shared_state_path
manifest = resolve({L6!r})
served = load_backend(manifest, "torch", precision="bfloat16")
for n in (7, 50, 200):
    served.forward(pad([[101] + [2000 + i for i in range(n)] + [102]] * 2), 1)
path = shared_state_path(manifest, Precision.BFLOAT16)
rss, inside = 0, False
for line in open("/proc/self/smaps"):
    head = line.split()
    if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
        inside = len(head) >= 6 and head[5] == str(path)
    elif inside and head[0] == "Rss:":
        rss += int(head[1])
print(json.dumps({{"shared": served.shared, "file_kb": path.stat().st_size / 1024,
    "packed_kb": sum(b.numel() * 2 for n, b in served.module.source.named_buffers()
                     if n.endswith(".packed")) / 1024,
    "rss_kb": rss,
    "outside": release_pages([torch.ones(4096)], path)}}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    print(got)
    assert got["shared"] and got["packed_kb"] > 10_000 and not got["outside"]
    assert got["rss_kb"] < got["file_kb"] - got["packed_kb"] / 2, got
