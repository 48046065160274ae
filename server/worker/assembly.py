"""Assembling one worker (a ``Worker``): artifact, backend at the precision the quality gate
admits (R1.5), engine arguments and, when asked, the adaptive thread tuner with its host
record. The same assembly runs in a worker process and, for the one-worker shorthand, in the
front end's process."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from vllm_srun.records.host_record import HostRecord, HostRecordError, Scope, default_record_path
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import Backend, load_backend
from vllm_srun.runtime.calibrate import calibrate
from vllm_srun.runtime.device import is_gpu
from vllm_srun.runtime.host import host_fingerprint
from vllm_srun.runtime.paths import data_dir
from vllm_srun.runtime.runner import Runner
from vllm_srun.runtime.selection import PrecisionChoice, choose
from vllm_srun.runtime.types import BackendName, ForwardRecord, Manifest
from vllm_srun.server.worker.spec import WorkerSpec
from vllm_srun.tuner import zygote
from vllm_srun.tuner.adaptive import AdaptiveThreads, TunerSettings
from vllm_srun.tuner.core_rules import SharedCores
from vllm_srun.tuner.cores import CoreShare, CoreShareError, cores_path
from vllm_srun.tuner.free_cpus import FreeCpus
from vllm_srun.tuner.golden import golden_rows, reference_outputs, reference_tolerance
from vllm_srun.tuner.modes import AdaptiveMode, allowed_counts
from vllm_srun.tuner.report import build, from_tuner, off_report
from vllm_srun.tuner.shadows import ShadowProcess

log = logging.getLogger(__name__)


def fork_shadow_zygote(spec: WorkerSpec) -> None:
    """Where this process is about to load a CPU worker that learns: fork now, before it loads
    anything, the copy of this process that becomes the worker's shadow process, so the two
    share the libraries' memory (``tuner/zygote.py``)."""
    if spec.mode is not AdaptiveMode.OFF and not is_gpu(spec.device):
        zygote.prepare(spec.backend)


def record_path(spec_path: str | None) -> Path:
    return Path(spec_path) if spec_path else default_record_path(data_dir())


def open_record(path: Path) -> tuple[HostRecord | None, str | None]:
    try:
        return HostRecord(path), None
    except HostRecordError as exc:
        log.error("host_record_unavailable path=%s error=%s", path, exc)
        return None, str(exc)


def scope_for(manifest: Manifest, backend: Backend, budget: int,
              precision: str = "float32") -> Scope:
    fingerprint, _ = host_fingerprint(backend.name, budget)
    return Scope(fingerprint, manifest.revision, backend.name.value, precision)


class Worker:
    """Builds and starts the Runner of a spec; keeps the tuner for reports."""

    def __init__(self, spec: WorkerSpec, manifest: Manifest | None = None,
                 wrap_backend: Callable[[Backend], Backend] | None = None,
                 replica_id: str | None = None) -> None:
        self.spec = spec
        self.replica_id = replica_id
        self.wrap_backend = wrap_backend
        self.manifest = manifest or resolve(spec.model, spec.revision)
        self.tuner: AdaptiveThreads | None = None
        self.cores: SharedCores | None = None
        self.precision: PrecisionChoice | None = None
        self.record_path = record_path(spec.record_path)

    def load(self, on_forward: Callable[[ForwardRecord], None] | None = None) -> Runner:
        runner = self._load(on_forward)
        if self.spec.calibrate and runner.ready:
            calibrate(runner, self.spec.set_max_num_seqs, self.spec.set_max_num_batched_tokens,
                      self.spec.device)
        return runner

    def load_to_serve(self, on_forward: Callable[[ForwardRecord], None] | None = None
                      ) -> Runner:
        """``load`` in a process that then serves from it (a worker process, or the server
        with its one worker in-process). What the load built (the model, its libraries'
        module state: ~420,000 objects for a torch worker) lives as long as the worker; the
        cyclic collector's full passes would walk all of it for nothing (~0.14 s each, one
        every few seconds under load, holding the GIL beside the forwards). Frozen
        (``gc.freeze``), they walk only what serving allocates since."""
        runner = self.load(on_forward)
        gc.freeze()
        return runner

    @staticmethod
    def unload() -> None:
        """The process drops a worker it loaded to serve (a reload): what ``load_to_serve``
        froze is collected again (a frozen reference cycle would never be freed). The whole
        process is unfrozen, the worker that replaced it too (a reload loads the new one
        first): full passes walk it again, as before any freeze, until the next start."""
        gc.unfreeze()

    def _choose_backend(self) -> Backend:
        """The backend at the precision the spec asks for, once the quality gate admits it
        (``self.precision`` says which and why; a refusal keeps the worker out of dispatch)."""
        spec, manifest = self.spec, self.manifest
        name = BackendName.TORCH if is_gpu(spec.device) else spec.backend
        backend, self.precision = choose(
            manifest, name, spec.dtype, spec.quality_gate, spec.args.num_threads,
            lambda p: load_backend(manifest, spec.backend, spec.device, p,
                                   several_counts=spec.mode is AdaptiveMode.SERVE))
        return backend

    def _load(self, on_forward: Callable[[ForwardRecord], None] | None) -> Runner:
        spec, manifest = self.spec, self.manifest
        backend = self._choose_backend()
        if self.wrap_backend is not None:
            backend = self.wrap_backend(backend)
        precision = self.precision.precision.value
        if self.precision.refusal or spec.mode is AdaptiveMode.OFF or is_gpu(spec.device):
            zygote.discard()  # no shadow process: a zygote made for one exits
            runner = Runner(manifest, backend, spec.args, on_forward=on_forward)
            if not self.precision.refusal and not is_gpu(spec.device):
                self._share_cores(runner)
            runner.start(check=lambda: self.precision.refusal)
            return runner
        counts = allowed_counts(spec.args.num_threads, spec.budget, spec.max_threads)
        record, error = open_record(self.record_path)
        scope = scope_for(manifest, backend, spec.budget, precision)
        if record is not None:
            try:
                record.note_host(scope.fingerprint, host_fingerprint(backend.name,
                                                                     spec.budget)[1])
                record.note_worker(scope, manifest.name, int(spec.mode), spec.args.num_threads,
                                   list(counts))
            except HostRecordError as exc:
                error = str(exc)
        runner = Runner(manifest, backend, spec.args, on_forward=on_forward)
        shadows = ShadowProcess(manifest, backend.name.value, precision)
        free = FreeCpus(lambda: (shadows.process.pid,), worker=self.replica_id,
                        siblings=lambda: self.cores.share.sibling_pids() if self.cores else ())

        def close() -> None:
            free.close()
            shadows.close()

        settings = spec.settings or TunerSettings()
        if spec.learning_share is not None:
            settings = settings.with_(learning_share=spec.learning_share)
        tuner = AdaptiveThreads(spec.mode, spec.args.num_threads, counts, scope, record,
                                runner.engine.forward_batch, settings,
                                shadow_forward=shadows.forward, on_close=close,
                                paid_forward=partial(shadows.forward, paid=True),
                                pause_shadows=shadows.pause, free_cpu_s=free.latest,
                                free_cpu_resolution_s=free.resolution_s,
                                cores=spec.budget,
                                worker=(f"replica {self.replica_id} " if self.replica_id
                                        else "") + f"pid {os.getpid()}")
        tuner.sync.error = tuner.sync.error or error
        runner.engine.threads = tuner
        tuner.behind = runner.engine.behind
        if spec.mode is AdaptiveMode.SERVE:  # shapes no sweep covers: on the length grid
            runner.pad_to_grid(tuner.runs_exactly)
        self.tuner = tuner
        self._share_cores(runner, free.held)
        tolerance = reference_tolerance(precision, spec.quality_gate.min_cosine)
        runner.start(check=lambda: tuner.startup(golden_rows(runner.tokenizer),
                                                 reference_outputs(manifest.revision),
                                                 tolerance))
        return runner

    def _share_cores(self, runner: Runner,
                     held: Callable[[], float | None] | None = None) -> None:
        """Hold this worker's served counts in the host's core ledger (R4.12) when the pool
        asks: a count serves only while the CPU workers of the host together stay within the
        budget less the cores other tasks ``held`` (``FreeCpus.held``; None: the budget),
        else a lower count that answers the same (``core_rules.grant``). Without the ledger
        the worker serves as it would alone."""
        spec = self.spec
        if not spec.share_cores:
            return
        path = cores_path(self.record_path)
        try:
            share = CoreShare.open(path, spec.budget, self.replica_id or f"pid {os.getpid()}",
                                   held=held)
        except CoreShareError as exc:
            log.error("core_share_unavailable path=%s error=%s", path, exc)
            return
        self.cores = SharedCores(runner.engine.threads, share, spec.args.num_threads)
        runner.engine.threads = self.cores

    def precision_report(self) -> dict | None:
        return self.precision.report() if self.precision is not None else None

    def threads_report(self, runner: Runner | None) -> dict:
        """This worker's report (``tuner/report.py``: one shape, learning or not)."""
        if self.tuner is not None:
            return {**build(from_tuner(self.tuner, str(self.record_path))),
                    "model": self.manifest.name}
        num_threads = runner.args.num_threads if runner else self.spec.args.num_threads
        return off_report(num_threads, model=self.manifest.name)
