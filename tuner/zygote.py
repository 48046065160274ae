"""A copy of a worker's process, made before the worker loads, that becomes its shadow
process, so the two share the libraries' memory (R4.5: learning's memory).

How it works: where a worker that learns is about to load (``prepare``), its process imports
the backend's libraries and forks a *zygote*: a copy of itself that waits on a socket. When
the worker's ``ShadowProcess`` starts its child (``spawn``), the zygote becomes that child:
it runs the shadow loop, which loads its own backend over the worker's weights file as a
spawned child does. Every page the imports wrote (torch's operator tables, transformers'
module state: ~250 MB for a torch worker) is then one page in memory for both processes
until one of them writes it (copy on write); a spawned child imports it all again into memory
of its own. The zygote is used once: a child started after it (a respawn, after the first
died or hung) is spawned.

The invariant that makes the fork safe: the zygote is forked before the process built any
backend (``backend.built_any``), so no OpenMP team exists yet (a child forked after its
parent ran a multithreaded OpenMP region hangs in its own first one: GNU OpenMP keeps the
parent's team, whose threads the child lacks). The shadow loop then makes its own.

The zygote dies with the worker (PR_SET_PDEATHSIG) and ignores SIGINT (a terminal's Ctrl-C
reaches the whole process group; the worker's exit ends it). Where there is no zygote
(``prepare`` was not called, the process had built a backend, the zygote was used or is
gone) ``ShadowProcess`` spawns its child.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import pickle
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection

from vllm_srun.runtime.lifetime import die_with_parent, set_process_name

log = logging.getLogger(__name__)

# what each backend's shadow imports before it loads a model: imported before the fork, it
# is shared (transformers' model code pulls torch.distributed, sympy, scipy: ~105 MB)
PRELOAD = {
    "torch": ("torch", "transformers.modeling_utils", "vllm_srun.runtime.torch_fast",
              "vllm_srun.runtime.torch_model"),
    "onnxruntime": ("onnxruntime",),
}
# the shadow loop's own modules
COMMON = ("numpy", "vllm_srun.runtime.backend", "vllm_srun.tuner.shadow_child")
# their names in ps and /proc/<pid>/comm (15 bytes at most)
ZYGOTE_NAME, CHILD_NAME = b"vllm-zygote", b"vllm-shadows"
_MSG_BYTES = 1 << 20  # one pickled start request: a manifest and a few names
_JOIN_POLL_S = 0.01
_DISCARD_WAIT_S = 5.0  # a discarded zygote exits at once (EOF on its socket); else killed

_zygote: Zygote | None = None


def prepare(backend: str) -> Zygote | None:
    """Fork this process's zygote (once), after importing what ``backend``'s shadow loop
    needs. Call it before the process builds any backend, from a thread that lives as long
    as the process (the zygote dies when that thread does: PR_SET_PDEATHSIG); None where the
    process cannot fork or has built one."""
    global _zygote
    if _zygote is not None:
        return current()
    if not hasattr(os, "fork") or not hasattr(socket, "send_fds"):
        return None
    from vllm_srun.runtime.backend import built_any

    if built_any():
        log.info("shadow_zygote_unavailable reason=backend_built_before action=spawn")
        return None
    backend = str(getattr(backend, "value", backend))
    for name in (*COMMON, *PRELOAD.get(backend, ())):
        with contextlib.suppress(ImportError):  # the shadow's own load reports it
            importlib.import_module(name)
    _zygote = Zygote()
    log.info("shadow_zygote_started pid=%d backend=%s", _zygote.pid, backend)
    return _zygote


def discard() -> None:
    """This process will start no shadow process: the waiting zygote exits."""
    if _zygote is not None:
        _zygote.discard()


def current() -> Zygote | None:
    """This process's zygote, while it waits to become a shadow process."""
    return _zygote if _zygote is not None and _zygote.waiting() else None


class Forked:
    """The shadow process a zygote became: the parts of ``multiprocessing.Process`` a
    ``ShadowProcess`` uses. A child of this process, reaped here."""

    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode = pid, None

    def is_alive(self) -> bool:
        if self.exitcode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                self.exitcode = -1
            else:
                if pid:
                    self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode is None

    def kill(self) -> None:
        if self.is_alive():
            os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (end is None or time.monotonic() < end):
            time.sleep(_JOIN_POLL_S)


class Status:
    """A child's status over its own socket: the child sends a mark once (a byte); the
    worker reads whether it came without blocking."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self._seen = sock, set()

    def flag(self, mark: bytes) -> Flag:
        return Flag(self, mark)

    def send(self, mark: bytes) -> None:
        self._sock.send(mark)

    def seen(self, mark: bytes) -> bool:
        while mark not in self._seen:
            try:
                got = self._sock.recv(64, socket.MSG_DONTWAIT)
            except OSError:  # nothing yet (BlockingIOError), or the child is gone
                return False
            if not got:
                return False
            self._seen.update(bytes([b]) for b in got)
        return True


class Flag:
    """One mark of a ``Status``: what a ``multiprocessing.Event`` is to a spawned child
    (``set`` in the child, ``is_set`` in the worker)."""

    def __init__(self, status: Status, mark: bytes) -> None:
        self._status, self._mark = status, mark

    def set(self) -> None:
        self._status.send(self._mark)

    def is_set(self) -> bool:
        return self._status.seen(self._mark)


class Zygote:
    """The forked copy of this process that becomes its shadow process (``spawn``)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        gc.collect()
        gc.freeze()  # the collector's passes write every object's header: pages copied
        pid = os.fork()
        if pid == 0:  # the zygote
            ours.close()
            _zygote_main(theirs, parent)  # does not return
        theirs.close()
        self.pid, self.process, self._sock, self._used = pid, Forked(pid), ours, False
        self._lock = threading.Lock()

    def waiting(self) -> bool:
        """Not yet used, and alive (one that died is reaped)."""
        if not self._used and not self.process.is_alive():
            self._used = True
        return not self._used

    def discard(self) -> None:
        """Unused, it exits (its socket closed: the end of its wait), and is reaped; killed
        if it has not exited after ``_DISCARD_WAIT_S``."""
        with self._lock:
            if self._used:
                return
            self._used = True
            self._sock.close()
        self.process.join(_DISCARD_WAIT_S)
        self.process.kill()
        self.process.join()

    def spawn(self, target, args: tuple, kwargs: dict
              ) -> tuple[Forked, Connection, Flag, Flag]:
        """The zygote becomes a process running ``target(conn, *args, parent=, armed=,
        loaded=, **kwargs)``: ``parent`` is this process's pid; ``armed`` and ``loaded`` are
        ``Flag``s it sets. Returns it, this end of its pipe and the two flags; OSError where
        the zygote was used or is gone."""
        conn_ours, conn_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        status_ours, status_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                if self._used:
                    raise OSError("the shadow zygote was used")
                self._used = True
                socket.send_fds(self._sock, [pickle.dumps((target, args, kwargs))],
                                [conn_theirs.fileno(), status_theirs.fileno()])
                self._sock.close()
        except OSError:
            conn_ours.close()
            status_ours.close()
            raise
        finally:
            conn_theirs.close()
            status_theirs.close()
        status = Status(status_ours)
        return (self.process, Connection(conn_ours.detach()), status.flag(b"a"),
                status.flag(b"l"))


def _zygote_main(sock: socket.socket, parent: int) -> None:
    code = 1
    try:
        die_with_parent(parent, signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        set_process_name(ZYGOTE_NAME)
        gc.freeze()
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MSG_BYTES, 2)
        except OSError:
            msg, fds = b"", []
        sock.close()
        if msg and len(fds) == 2:
            set_process_name(CHILD_NAME)
            target, args, kwargs = pickle.loads(msg)
            status = Status(socket.socket(fileno=fds[1]))
            target(Connection(fds[0]), *args, parent=parent, armed=status.flag(b"a"),
                   loaded=status.flag(b"l"), **kwargs)
        code = 0
    except BaseException:
        log.exception("shadow_zygote_failed")
    finally:
        os._exit(code)
