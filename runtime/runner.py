"""One loaded model: tokenizer, backend, engine and (optionally) the result cache.

This is what a worker serves; the HTTP front end and, later, worker processes call it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import Backend, load_backend
from vllm_srun.runtime.cache import ResultCache, cache_key
from vllm_srun.runtime.engine import Engine, ThreadsPolicy, TimedFuture, stack_rows
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.runtime.sizes import padded_length
from vllm_srun.runtime.tokenizer import Tokenizer
from vllm_srun.runtime.types import BackendName, EngineArgs, ForwardRecord, Manifest, TextInput

log = logging.getLogger(__name__)

WARM_TEXTS = ("warm up", "a warm-up pass keeps first-call costs out of served latency " * 4)


def check_args(args: EngineArgs, manifest: Manifest) -> None:
    """Engine arguments must be positive and able to hold one row of the longest input."""
    for key in ("num_threads", "max_num_seqs", "max_num_batched_tokens", "timeout_ms",
                "concurrent_forwards"):  # 0 forwards at once would never serve one
        if getattr(args, key) < 1:
            raise ConfigError(f"{key} must be a positive integer, got {getattr(args, key)}")
    if args.cache_entries < 0:
        raise ConfigError(f"cache_entries must be >= 0, got {args.cache_entries}")
    if args.max_num_batched_tokens < manifest.max_tokens:
        raise ConfigError(f"max_num_batched_tokens ({args.max_num_batched_tokens}) must be at "
                          f"least the model's max tokens ({manifest.max_tokens})")


def _cancel(ref: weakref.ref) -> None:
    """Cancel the future ``ref`` points to, if it is still alive (queued or running)."""
    if (future := ref()) is not None:
        future.cancel()


class Runner:
    def __init__(self, manifest: Manifest, backend: Backend, args: EngineArgs,
                 threads: ThreadsPolicy | None = None, use_cache: bool = True,
                 on_forward: Callable[[ForwardRecord], None] | None = None) -> None:
        check_args(args, manifest)
        self.manifest = manifest
        self.backend = backend
        self.args = args
        self.tokenizer = Tokenizer(manifest.tokenizer_path, manifest.max_tokens)
        self.engine = Engine(backend, args, threads=threads, on_forward=on_forward)
        self.cache = ResultCache(args.cache_entries if use_cache else 0)
        self.ready = False
        self.not_ready_reason: str | None = "loading"

    def pad_to_grid(self, exact: Callable[[int, int], bool]) -> None:
        """Pad each served forward whose exact shape ``exact(rows, longest)`` does not cover
        up to the length grid (``sizes.padded_length``): a mode 2 worker's, whose shapes are
        verified one by one (R4.8)."""
        self.engine.pad_to = partial(padded_length, max_len=self.tokenizer.max_tokens, exact=exact)

    @classmethod
    def load(cls, model: str | None, backend: BackendName | str, args: EngineArgs,
             **kwargs) -> Runner:
        manifest = resolve(model)
        check_args(args, manifest)
        return cls(manifest, load_backend(manifest, backend), args, **kwargs)

    def start(self, check: Callable[[], str | None] | None = None) -> None:
        """Start the engine, run a warm pass at the configured count, then ``check`` (e.g.
        the golden check): ready unless it returns a reason, kept in ``not_ready_reason``."""
        self.engine.start()
        start = time.perf_counter()
        self.engine.forward(self.tokenizer.encode(WARM_TEXTS, truncate=True),
                            self.args.num_threads)
        if check is not None and (reason := check()) is not None:
            self.not_ready_reason = reason
            log.warning("worker_not_ready model=%s reason=%s", self.manifest.name, reason)
            return
        log.info("worker_ready model=%s revision=%s backend=%s num_threads=%d warm_s=%.3f",
                 self.manifest.name, self.manifest.revision, self.backend.name.value,
                 self.args.num_threads, time.perf_counter() - start)
        self.not_ready_reason = None
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self.engine.stop()
        self.backend.close()

    def submit(self, texts: Sequence[TextInput], truncate: bool = False,
               deadline: float | None = None, field: str = "input",
               raw: bool = False) -> tuple[TimedFuture, int]:
        """Queue texts (or text pairs); returns (future of float32 [len(texts), dim], or
        [len(texts), tokens, labels] for token classification, and prompt tokens). ``raw``:
        the rows before the model's last step (no Normalize module, no sigmoid).

        Raises InputError (naming the input as ``field[i]``) before anything is queued.
        """
        keys = [cache_key(truncate, t, raw) for t in texts]
        hits = [self.cache.get(k) for k in keys]
        miss_at = [i for i, h in enumerate(hits) if h is None]
        if not miss_at:  # answered from the cache: no timing (nothing queued or ran)
            out = TimedFuture()
            out.set_result(stack_rows([h[0] for h in hits]))
            return out, sum(h[1] for h in hits)
        encoded = self.tokenizer.rows([texts[i] for i in miss_at], truncate, miss_at, field)
        rows = encoded.ids
        tokens = sum(h[1] for h in hits if h is not None) + sum(len(r) for r in rows)
        inner = self.engine.submit(rows, deadline, encoded.type_ids, raw)
        out = TimedFuture()
        inner.add_done_callback(lambda done: self._merge(done, out, hits, keys, miss_at, rows))
        # Cancelling ``out`` cancels ``inner`` through a weak reference: a strong one would
        # make the two futures (which keep their callbacks once done) a reference cycle, and
        # every request's futures, conditions and callbacks garbage only the cyclic collector
        # frees (~40 objects a request, young collections holding the GIL beside forwards).
        inner_ref = weakref.ref(inner)
        out.add_done_callback(lambda f: _cancel(inner_ref) if f.cancelled() else None)
        return out, tokens

    def _merge(self, done: TimedFuture, out: TimedFuture, hits: list, keys: list[bytes],
               miss_at: list[int], rows: list[list[int]]) -> None:
        """The engine answered the misses: cache them and answer the whole request."""
        if done.cancelled() or done.exception() is not None:
            if not out.done():
                out.set_exception(done.exception() if not done.cancelled()
                                  else TimeoutError("cancelled"))
            return
        vectors = done.result()
        out.timing = done.timing
        full: list[np.ndarray] = [h[0] if h is not None else None for h in hits]
        for j, i in enumerate(miss_at):
            vector = vectors[j] if vectors.ndim == 2 else vectors[j][: len(rows[j])]
            full[i] = vector
            self.cache.put(keys[i], vector, len(rows[j]))
        if not out.done():
            out.set_result(stack_rows(full))
