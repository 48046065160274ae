"""CPU backends behind one seam: ``Backend.forward(batch, num_threads)`` (R1.3, R2.1).

A forward of a ``thread_bound`` backend (torch: its intra-op count lives on the OS thread) must
be called on the thread context's lane for ``num_threads``; one that is not (onnxruntime: the
count is the session's) may be called on any thread. A forward returns the pooled embeddings
(or logits) and the count observed from inside the forward.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Protocol

import numpy as np

from vllm_srun.runtime import device as devices
from vllm_srun.runtime.errors import ArtifactError, Unsupported
from vllm_srun.runtime.pooling import l2_normalize, pool
from vllm_srun.runtime.precision import Precision, check_supported
from vllm_srun.runtime.types import BackendName, ForwardResult, Manifest, Task, TokenBatch


class Backend(Protocol):
    name: BackendName
    thread_bound: bool  # a forward must run on the lane of its count (see the module doc)

    def forward(self, batch: TokenBatch, num_threads: int) -> ForwardResult: ...

    def twin(self) -> Backend:
        """A backend for shadow forwards: the same answers, but no thread pool or lock shared
        with this one, its pools made by whichever thread first runs each count on it."""
        ...

    def close(self) -> None: ...


# Rank of the model output each task reads: pooled later from [rows, tokens, dim], logits
# [rows, labels], or per-token logits [rows, tokens, labels].
OUTPUT_RANK = {Task.EMBED: 3, Task.CLASSIFY: 2, Task.RERANK: 2, Task.TOKEN_CLASSIFY: 3}


def _finish(manifest: Manifest, out: np.ndarray, batch: TokenBatch) -> np.ndarray:
    """The rows a task answers: pooled vectors, logits, per-token logits, or rerank scores
    (the cross-encoder's one logit, through a sigmoid when its CrossEncoder applies one).
    Rows of ``batch.raw_rows`` skip the last step (Normalize, the sigmoid)."""
    raw = batch.raw_rows
    if manifest.task is Task.EMBED:
        if raw is None or not raw.any():
            return pool(out, batch.attention_mask, manifest.pooling, manifest.normalize)
        pooled = pool(out, batch.attention_mask, manifest.pooling, False)
        if manifest.normalize and not raw.all():
            pooled[~raw] = l2_normalize(pooled[~raw])
        return pooled
    out = np.ascontiguousarray(out, dtype=np.float32)
    if manifest.task is Task.RERANK and manifest.sigmoid:
        scores = (np.float32(1) / (np.float32(1) + np.exp(-out))).astype(np.float32)
        out = scores if raw is None else np.where(raw[:, None], out, scores)
    return out


# A session's intra-op pool spins after each run, waiting for the next, while its caller's
# thread goes on. Where one process runs forwards at several counts (mode 2 serving learned
# counts, the shadow side), the pool of the count that just ran spins through the next
# forward at another count: a 1-thread forward after 2-thread ones ran 1.5-1.6x slower here
# beside a thread like the front end's (busy 40% of a core), and not at all with the pool told
# to stop spinning after each run, which cost a 2-thread forward after 2-thread ones nothing
# (quiet or beside that thread; 2 vCPUs, a 3 x 20-token batch). Served that way under 16
# connections, whichever count a range served less often read slower than it is (ranges 1.6x
# faster at 2 threads learned 1, then relearned). onnxruntime's session key for it:
SPIN_STOP = "session.force_spinning_stop"


class OnnxBackend:
    """onnxruntime: the intra-op pool belongs to a session, so one session per count."""

    name = BackendName.ONNXRUNTIME
    thread_bound = False

    def __init__(self, manifest: Manifest, onnx_path: str,
                 like: OnnxBackend | None = None,
                 precision: Precision = Precision.FLOAT32,
                 session_path: str | None = None, stop_spinning: bool = False) -> None:
        import onnxruntime as ort

        self._ort = ort
        self.manifest = manifest
        self.precision = precision
        self.stop_spinning = stop_spinning  # see ``SPIN_STOP``
        self.onnx_path = onnx_path  # the artifact's ONNX file (or its int8 copy)
        # what sessions load: the shared copy of ``onnx_path`` (``weights.py``), or itself
        self.session_path = session_path or onnx_path
        self._sessions: dict[int, object] = {}
        self._lock = threading.Lock()
        if like is not None:  # a twin: no session until a thread runs a count on it
            self._input_names, self._output = like._input_names, like._output
            return
        probe = self._session(1)
        self._input_names = [i.name for i in probe.get_inputs()]
        want_rank = OUTPUT_RANK[manifest.task]
        outputs = [o for o in probe.get_outputs() if len(o.shape) == want_rank]
        if not outputs:
            raise ArtifactError(f"{onnx_path} has no output of rank {want_rank}")
        self._output = outputs[0].name

    def _session(self, num_threads: int):
        with self._lock:
            session = self._sessions.get(num_threads)
            if session is None:
                opts = self._ort.SessionOptions()
                opts.intra_op_num_threads = num_threads
                opts.inter_op_num_threads = 1
                opts.execution_mode = self._ort.ExecutionMode.ORT_SEQUENTIAL
                opts.log_severity_level = 3
                if self.stop_spinning and num_threads > 1:
                    opts.add_session_config_entry(SPIN_STOP, "1")
                try:
                    session = self._ort.InferenceSession(
                        self.session_path, opts, providers=["CPUExecutionProvider"])
                except Exception as exc:  # onnxruntime raises its own untyped errors
                    raise ArtifactError(f"cannot load {self.session_path}: {exc}") from exc
                self._sessions[num_threads] = session
            return session

    def forward(self, batch: TokenBatch, num_threads: int) -> ForwardResult:
        session = self._session(num_threads)
        feed = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if "token_type_ids" in self._input_names:
            feed["token_type_ids"] = (batch.token_type_ids if batch.token_type_ids is not None
                                      else np.zeros_like(batch.input_ids))
        feed = {k: v for k, v in feed.items() if k in self._input_names}
        start = time.perf_counter()
        (out,) = session.run([self._output], feed)
        forward_s = time.perf_counter() - start
        observed = session.get_session_options().intra_op_num_threads
        return ForwardResult(_finish(self.manifest, out, batch), num_threads, observed, forward_s)

    def twin(self) -> OnnxBackend:
        """Sessions of its own: an onnxruntime session's intra-op pool is made by the thread
        that creates the session, and served and shadow forwards must not share one."""
        return OnnxBackend(self.manifest, self.onnx_path, like=self, precision=self.precision,
                           session_path=self.session_path, stop_spinning=self.stop_spinning)

    def close(self) -> None:
        with self._lock:
            self._sessions.clear()


class TorchBackend:
    """torch: one module; the lane's OS thread carries the intra-op count."""

    name = BackendName.TORCH
    thread_bound = True

    def __init__(self, manifest: Manifest, device: str = "cpu",
                 precision: Precision = Precision.FLOAT32, share_weights: bool = True) -> None:
        import torch

        from vllm_srun.runtime.torch_fast import faster
        from vllm_srun.runtime.torch_model import load_module
        from vllm_srun.runtime.weights import (
            align,
            release_pages,
            share_module,
            shared_state_path,
        )

        self._torch = torch
        self.manifest = manifest
        self.precision = precision
        self.device = torch.device(device)
        self.module = load_module(manifest, precision).to(self.device)
        # parameters mapped from one file the shadow process maps too (``weights.py``)
        self.shared = (share_weights and self.device.type == "cpu"
                       and precision is not Precision.INT8
                       and share_module(manifest, precision, self.module))
        if self.device.type == "cpu" and not self.shared and precision is not Precision.INT8:
            align(self.module)  # laid out as shared ones are (int8 is never shared)
        if self.device.type == "cpu":  # traced; bfloat16 Linear weights packed (torch_fast)
            self.module = faster(self.module, precision, release=partial(
                release_pages, path=shared_state_path(manifest, precision))
                if self.shared else None)
        self._seen = threading.local()
        self.module.register_forward_pre_hook(self._observe)

    def _observe(self, _module, _args) -> None:
        self._seen.num_threads = self._torch.get_num_threads()

    def forward(self, batch: TokenBatch, num_threads: int) -> ForwardResult:
        torch = self._torch
        start = time.perf_counter()
        ids = torch.from_numpy(batch.input_ids).to(self.device)
        mask = torch.from_numpy(batch.attention_mask).to(self.device)
        types = (torch.from_numpy(batch.token_type_ids).to(self.device)
                 if batch.token_type_ids is not None else None)
        with torch.inference_mode():
            out = self.module(ids, mask, types).float().cpu().numpy()
        forward_s = time.perf_counter() - start
        observed = self._seen.num_threads
        return ForwardResult(_finish(self.manifest, out, batch), num_threads, observed, forward_s)

    def twin(self) -> TorchBackend:
        """The same module: torch's intra-op pools belong to the OS thread that runs the
        forward, so a shadow lane brings its own."""
        return self

    def close(self) -> None:
        pass

    def discard(self) -> None:
        """Give this backend's memory back once no forward will run on it (a precision the
        quality gate loaded and did not keep): its frozen trace's constants are emptied
        (``torch_fast.forget``), not left to torch's compilation unit. Not ``close``: a
        stopping worker closes its backend after waiting a bounded time for its forwards
        (``Engine.stop``), so one may still run."""
        from vllm_srun.runtime.torch_fast import forget

        forget(self.module)


_built = threading.Event()  # set once this process builds a backend (``built_any``)


def built_any() -> bool:
    """Whether this process has built a backend: it may have run a multithreaded forward, so
    a process forked from it now could hang in its own (``tuner/zygote.py``)."""
    return _built.is_set()


def load_backend(manifest: Manifest, backend: BackendName | str, device: str = "cpu",
                 precision: Precision | str = Precision.FLOAT32,
                 several_counts: bool = False) -> Backend:
    """Build a backend for the artifact at ``precision`` (exporting ONNX, and quantizing it
    for int8, once per revision if needed), its weights mapped from the file its shadow
    process maps too (``weights.py``). A GPU device always runs torch: the onnxruntime
    build here is CPU-only. A precision the backend does not run is Unsupported.
    ``several_counts``: the process runs forwards at more than one count (``SPIN_STOP``)."""
    try:
        name = BackendName(backend)
    except ValueError:
        raise Unsupported(f"backend must be one of {[b.value for b in BackendName]}, "
                          f"got {backend!r}") from None
    if devices.is_gpu(device):
        name = BackendName.TORCH
    precision = check_supported(name, precision)
    if devices.is_gpu(device) and precision is Precision.INT8:  # quantize_dynamic: CPU only
        raise Unsupported(f"precision int8 runs on the CPU only, not on {device}")
    _built.set()
    if name is BackendName.TORCH:
        return TorchBackend(manifest, devices.torch_device(device) if devices.is_gpu(device)
                            else "cpu", precision)
    from vllm_srun.runtime.export import ensure_onnx, ensure_quantized
    from vllm_srun.runtime.weights import shared_onnx

    path = ensure_quantized(manifest) if precision is Precision.INT8 else ensure_onnx(manifest)
    return OnnxBackend(manifest, str(path), precision=precision,
                       session_path=str(shared_onnx(manifest, precision, path)),
                       stop_spinning=several_counts)
