"""Child processes that never outlive their parent (Linux ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import os
import signal


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when ``parent`` dies, even by SIGKILL;
    exit now if it already has. ``SIGKILL`` also ends a process that is stopped."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)
