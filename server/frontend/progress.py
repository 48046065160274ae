"""Progress of a long command (``vllm-srun threads verify`` runs for minutes) on stderr: on a
terminal a bar redrawn in place, elsewhere (a log, CI) one line every ``every_s`` seconds, and
a summary line at the end. The ETA scales the time so far by the work left, in the command's
own unit of work (for a sweep: padded tokens, which forward time follows more closely than the
count of shapes: the sweep's last shapes are its longest)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24
TTY_REDRAW_S = 0.2  # a bar redrawn more often only costs the terminal


def eta_s(elapsed_s: float, done: float, total: float) -> float | None:
    """Seconds left at the rate so far; None before any work is done."""
    if done <= 0 or total <= 0:
        return None
    return max(0.0, elapsed_s * (total - done) / done)


def clock_text(seconds: float | None) -> str:
    """``h:mm:ss`` or ``m:ss``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """``update(work_done, text)`` as the command goes; ``finish(text)`` once at the end."""

    def __init__(self, label: str, total_work: float, stream: TextIO | None = None,
                 every_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 tty: bool | None = None) -> None:
        self.label, self.total = label, total_work
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = TTY_REDRAW_S if self.tty else every_s
        self.clock = clock
        self.started = self.last = clock()

    def update(self, work_done: float, text: str) -> None:
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        elapsed = now - self.started
        share = min(1.0, work_done / self.total) if self.total else 1.0
        timing = (f"{share:.0%}, elapsed {clock_text(elapsed)}, ETA "
                  f"{clock_text(eta_s(elapsed, work_done, self.total))}")
        if self.tty:
            filled = int(share * BAR_WIDTH)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.stream.write(f"\r{self.label}: [{bar}] {text}; {timing}\x1b[K")
        else:
            self.stream.write(f"{self.label}: {text}; {timing}\n")
        self.stream.flush()

    def finish(self, text: str) -> None:
        elapsed = clock_text(self.clock() - self.started)
        self.stream.write(("\r" if self.tty else "") + f"{self.label}: {text} in {elapsed}"
                          + ("\x1b[K" if self.tty else "") + "\n")
        self.stream.flush()
