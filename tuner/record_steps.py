"""The host record's side of one worker's learning (``adaptive.AdaptiveThreads``, whose part
this is, R4.7, R4.11, R4.12): what a new worker reads back at start, the flush of its
learnings, and the watch that reads drift, the voucher and live siblings' counts back. A
mixin: it reads the tuner's ``lock``, ``clock``, ``settings``, ``sync``, ``ledger``,
``learner``, ``counts`` and ``configured``, and holds no state of its own.
"""

from __future__ import annotations


class RecordSteps:
    def _load(self) -> None:
        """Drift retirement and the voucher survive a restart; stored samples and learned
        counts are history: a new worker learns from fresh samples (R4.11), starting from
        what live siblings of its scope learned (R4.12, ``siblings``)."""
        event, voucher = self.sync.read_back()
        if event is not None:
            self.ledger.retire(event)
        self.ledger.voucher = voucher or self.ledger.voucher
        self.learner.adopt(self.sync.siblings(self.counts, self.configured))

    def flush_due(self) -> bool:
        """Learnings wait to be written and ``flush_s`` has passed since the last flush."""
        with self.lock:
            return bool(self.sync.pending) and \
                self.clock() - self.sync.last_flush >= self.settings.flush_s

    def flush(self) -> None:
        """Write pending samples, learned counts and traffic comparisons to the record."""
        with self.lock:
            taken = self.sync.take(self.clock())
            learned = {lo: (r.learned, self.learner.speedup(r),
                            self.ledger.progress(lo, r.learned), r.learned_from)
                       for lo in taken.learned if (r := self.learner.ranges[lo]).learned}
        try:
            self.sync.write(taken, learned, self.configured)
        finally:
            with self.lock:
                self.sync.written += 1

    def poll_record(self) -> None:
        """Read drift, the voucher and live siblings' counts back from the record (the watch
        thread): a drift any worker of the scope recorded retires this one; a new sweep or a
        reset shows here. Say this worker lives (``RecordSync.heartbeat``)."""
        if self.sync.record is None or self.ledger.retired is not None:
            return
        self.sync.heartbeat(self.settings.flush_s)
        with self.lock:
            settled = self.sync.settled()
        event, voucher = self.sync.read_back()
        siblings = self.sync.siblings(self.counts, self.configured)
        with self.lock:
            if settled is None or settled != self.sync.settled():
                voucher = None  # a flush overlapped the read: the next one reads the voucher
            self.learner.read_back(event, voucher)
            self.learner.adopt(siblings)
