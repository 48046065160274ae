"""Result cache (R3.4): identical inputs to the same artifact revision return the stored answer."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np


class ResultCache:
    """A thread-safe LRU of row answers: key -> (vector, token count)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> tuple[np.ndarray, int] | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: Hashable, vector: np.ndarray, tokens: int) -> None:
        if self.max_entries <= 0:
            return
        vector = vector.copy()
        vector.setflags(write=False)
        with self._lock:
            self._entries[key] = (vector, tokens)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
