"""Child processes that never outlive their parent (Linux ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import os
import signal


def _prctl(option: int, arg) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
    except (OSError, AttributeError):
        pass


def set_process_name(name: bytes) -> None:
    """This process's name in ``ps`` and ``/proc/<pid>/comm`` (15 bytes at most; a forked
    process keeps its parent's)."""
    import ctypes

    _prctl(15, ctypes.c_char_p(name))  # PR_SET_NAME


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when ``parent`` dies, even by SIGKILL;
    exit now if it already has. ``SIGKILL`` also ends a process that is stopped."""
    _prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)
