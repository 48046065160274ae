"""Result cache (R3.4): identical inputs to the same artifact revision return the stored answer.

Keys are a 16-byte digest of (truncate, input), never the input itself, so long inputs pin no
memory; the cache is bounded in entries and in the bytes of the answers it keeps (per-token
answers of long inputs are large), dropping the least recently used first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

from vllm_srun.runtime.types import TextInput

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
_ENTRY_OVERHEAD = 200  # bytes a kept entry costs beyond its answer (key, tuple, array header)


def cache_key(truncate: bool, item: TextInput, raw: bool = False) -> bytes:
    """The digest of (truncate, raw, input); a text pair hashes both texts,
    length-prefixed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"T" if truncate else b"F")
    if raw:
        h.update(b"R")
    for text in (item,) if isinstance(item, str) else item:
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    h.update(b"s" if isinstance(item, str) else b"p")
    return h.digest()


class ResultCache:
    """A thread-safe LRU of answers: key digest -> (answer, token count)."""

    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[bytes, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> tuple[np.ndarray, int] | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: bytes, vector: np.ndarray, tokens: int) -> None:
        size = vector.nbytes + _ENTRY_OVERHEAD
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        vector = vector.copy()
        vector.setflags(write=False)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[0].nbytes + _ENTRY_OVERHEAD
            self._entries[key] = (vector, tokens)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _key, (dropped, _tokens) = self._entries.popitem(last=False)
                self.bytes -= dropped.nbytes + _ENTRY_OVERHEAD

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
