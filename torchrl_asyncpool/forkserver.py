"""The fork server that env workers and inference server processes start from.

``multiprocessing`` keeps one fork server per process, started by the first ``"forkserver"``
process anyone starts, and it imports its preload list once, when it starts: every child
forked from it then has torch, TorchRL and this package already imported. A fork server
that other code started first, without these modules, still works, but each child imports
them itself: seconds per worker on a machine with few cores (eight single-env workers on 2
cores took 15 s to start instead of 0.2 s). :func:`forkserver_context` is what the pool and
the server process start from; it warns once when it finds such a fork server running.

A child's descriptors (its doorbells, arena, pipes) travel after its start message, whose room a
fork server limits to ~250, under :func:`ship_fds`; :func:`ensure_fd_capacity` raises the soft
``RLIMIT_NOFILE`` where a pool needs more (see the comment above :func:`ensure_fd_capacity`).
"""
from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import socket
import struct
import threading
import warnings
from multiprocessing.connection import wait

__all__ = ["PRELOAD", "forkserver_context", "exit_code", "picklable", "ship_fds", "ensure_fd_capacity"]

# Imported once by the fork server, so that every child forks with them already loaded (the
# union of what env workers and server processes need). "__main__": the user's script is
# imported (as ``__mp_main__``, so its guarded code does not run) once there instead of once per
# worker, which is what made start-up grow with the number of envs (64 workers each re-importing
# a script that imports gymnasium: ~10 s on 2 cores). A missing optional module is skipped.
#: What the fork server imports when it starts (see the comment above).
PRELOAD = [
    "__main__", "torchrl_asyncpool.workers.env_worker", "torchrl_asyncpool.inference._process", "torchrl.envs",
    "gymnasium",
]

_warned = False


def _running_preload():
    """The preload list of the fork server this process started, or ``None`` when none runs."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None:
        return None
    return list(getattr(server, "_preload_modules", []) or [])


def forkserver_context(user: str = "AsyncEnvPool"):
    """``multiprocessing``'s ``"forkserver"`` context with :data:`PRELOAD` set for its next start.

    Warns (``RuntimeWarning``, once per process) when a fork server already runs that was
    started without torch and TorchRL in its preload: ``user``'s children then import them
    one by one. Call ``multiprocessing.set_forkserver_preload(torchrl_asyncpool.forkserver.PRELOAD)``
    before other code starts the fork server, or build the pool first, to avoid it.

    Examples:
        >>> from torchrl_asyncpool.forkserver import forkserver_context
        >>> forkserver_context().get_start_method()
        'forkserver'
    """
    global _warned
    running = _running_preload()
    if running is not None and "torchrl.envs" not in running and not _warned:
        _warned = True
        warnings.warn(
            f"{user}: multiprocessing's fork server was already running, started by other code with preload "
            f"{running}: each process {user} starts imports torch and TorchRL itself (seconds per process on few "
            "cores). Call multiprocessing.set_forkserver_preload(torchrl_asyncpool.forkserver.PRELOAD) before "
            "the first forkserver process is started, or build the pool first.",
            RuntimeWarning,
            stacklevel=3,
        )
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


# A fork server's child reports its exit status once, as 4 bytes on its sentinel pipe, and
# ``Popen.poll`` is not thread-safe: of two threads polling the same ended child, the second
# reads EOF and records exit code 255 (over the first one's, when it stores last), so a worker
# SIGKILLed while both the serving thread and the learner's thread looked at it was reported
# as "exit code 255". Every poll of our children's status goes through this lock.
_POLL_LOCK = threading.Lock()


def exit_code(proc, timeout: float | None = 0.0):
    """``proc.exitcode`` (``None`` while it runs), after waiting up to ``timeout`` seconds for it
    to end (``None``: until it ends); safe to call from several threads at once (see
    ``_POLL_LOCK``).

    The wait happens outside the lock, so a thread waiting on one child does not hold up
    another thread reading a status.

    Examples:
        >>> import time
        >>> from torchrl_asyncpool.forkserver import exit_code, forkserver_context
        >>> p = forkserver_context().Process(target=time.sleep, args=(0,))
        >>> p.start()
        >>> exit_code(p, timeout=30)
        0
    """
    if timeout is None or timeout > 0:
        wait([proc.sentinel], timeout)
    with _POLL_LOCK:
        proc.join(0)  # reads the status if it ended; also drops it from multiprocessing's children
        return proc.exitcode


def picklable(fn):
    """``fn`` in a form that crosses to a child process started from the fork server.

    A module-level class or function (one of the user's script too: the fork server imports the
    script, see :data:`PRELOAD`) goes as it is, pickled by reference, so tracebacks from the
    child name its file and line. Anything else (a lambda, a closure, a function of an
    interactive session) is wrapped in TorchRL's ``CloudpickleWrapper``, which pickles it by
    value (its tracebacks then say ``<dynamic-code>``). A ``CloudpickleWrapper`` or a TorchRL
    ``EnvCreator`` (which pickles itself) is left as it is.

    Examples:
        >>> from torchrl_asyncpool.forkserver import picklable
        >>> type(picklable(lambda: 1)).__name__
        'CloudpickleWrapper'
        >>> picklable(len) is len
        True
        >>> picklable(picklable(lambda: 1)).fn()
        1
    """
    from torchrl.data.utils import CloudpickleWrapper

    if isinstance(fn, CloudpickleWrapper) or type(fn).__name__ == "EnvCreator":
        return fn
    return fn if _by_reference(fn) else CloudpickleWrapper(fn)


def _by_reference(fn) -> bool:
    """Whether plain pickle carries ``fn`` by reference to something the child can import: it
    pickles, and nothing in it is of a ``__main__`` the fork server cannot import (an interactive
    session, a script read from standard input)."""
    import pickle
    import sys

    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    importable_main = bool(main_file) and os.path.isfile(main_file)
    try:
        data = pickle.dumps(fn)
    except Exception:  # noqa: BLE001 - lambdas, closures, local classes: by value then
        return False
    return importable_main or b"__main__" not in data


# -- descriptors for a child process ----------------------------------------------------------
# A fork server's start message carries the child's descriptors (every InheritedFd and
# Connection among its arguments) as one SCM_RIGHTS message of at most 251 (CPython's
# MAXFDS_TO_SEND, 256, less what the fork server adds): "ValueError: too many fds". A threaded
# worker has a doorbell per env and an inference server's consumer handle one per env (threaded
# workers) or per worker, so that message capped a pool at about 250 envs per worker and 250 per
# server. Under ship_fds() (around Process.start) the InheritedFds of that start go apart: the
# start message carries one end of a fresh SOCK_SEQPACKET socketpair in their place, and once the
# child is started the parent sends them over the other end, a count first and then batches of
# _FDS_PER_MESSAGE (multiprocessing.reduction's sendfds, one sendmsg per batch: ~1 ms for a
# thousand). The child receives them while it unpickles its arguments (the first InheritedFd
# rebuilt receives them all, after making room for them under its RLIMIT_NOFILE), so its code
# sees the same InheritedFds as before and nothing else changes. Outside ship_fds(), a fork server
# start message that already holds _START_MESSAGE_FDS descriptors sends the rest through
# multiprocessing's resource sharer (one connection each, ~0.2 ms), so any process argument that
# holds many descriptors (a consumer handle passed by user code) still starts.

#: descriptors per message (Linux takes at most SCM_MAX_FD = 253 in one)
_FDS_PER_MESSAGE = 250
#: beyond this many descriptors in a fork server start message, InheritedFds outside ship_fds()
#: go through the resource sharer
_START_MESSAGE_FDS = 200
#: descriptors kept free beyond what a process is known to need (libraries, pipes, sockets)
FD_MARGIN = 64
_COURIER = threading.local()


def ensure_fd_capacity(extra: int, what: str) -> None:
    """Makes room for ``extra`` more open descriptors in this process: raises the soft
    ``RLIMIT_NOFILE`` to the hard limit when the descriptors open now, ``extra`` and
    :data:`FD_MARGIN` exceed it (as Ray does at start-up; children started afterwards inherit
    it); ``OSError`` (``EMFILE``) naming the limit when even the hard limit is too low.

    Args:
        extra (int): descriptors about to be opened or received.
        what (str): who needs them, for the error message.

    Examples:
        >>> from torchrl_asyncpool.forkserver import ensure_fd_capacity
        >>> ensure_fd_capacity(16, "a test")
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - no /proc: count nothing, the margin stays
        open_now = 0
    need = open_now + int(extra) + FD_MARGIN
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    top = hard
    if hard == resource.RLIM_INFINITY:  # Linux refuses a soft limit above fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                top = int(f.read())
        except (OSError, ValueError):
            top = max(need, soft)
    if top > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
            soft = top
        except (OSError, ValueError):
            pass
    if need > soft:
        raise OSError(
            errno.EMFILE,
            f"{what} needs about {need} open file descriptors in process {os.getpid()} ({open_now} open now, "
            f"{extra} more, {FD_MARGIN} spare), above its RLIMIT_NOFILE (soft {soft}, hard "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}). Raise the hard limit (`ulimit -Hn`, "
            "limits.conf, systemd's LimitNOFILE, docker's --ulimit nofile=...), or need fewer: a pool has a "
            "doorbell per env with env_threads (one per worker without), and a worker those of its envs.",
        )


@contextlib.contextmanager
def ship_fds():
    """Around ``Process.start()``: the descriptors (:class:`~torchrl_asyncpool.exchange.InheritedFd`) among
    the process's arguments are sent after the start, in batches over a socketpair, instead of
    in the start message (which a fork server limits to ~250; see the comment above). The child
    receives them while unpickling its arguments; its code sees no difference. Nested blocks
    ship with the outermost one; a block that starts nothing sends nothing.

    Examples:
        >>> import os
        >>> from torchrl_asyncpool.exchange import InheritedFd
        >>> from torchrl_asyncpool.forkserver import exit_code, forkserver_context, ship_fds
        >>> fds = [os.eventfd(0) for _ in range(300)]
        >>> p = forkserver_context().Process(target=len, args=([InheritedFd(fd) for fd in fds],))
        >>> with ship_fds():
        ...     p.start()
        >>> exit_code(p, timeout=60)
        0
        >>> for fd in fds: os.close(fd)
    """
    if getattr(_COURIER, "active", None) is not None:  # an outer block ships them
        yield
        return
    courier = _COURIER.active = _Courier()
    try:
        yield
    except BaseException:
        _COURIER.active = None
        courier.close()
        raise
    _COURIER.active = None
    try:
        courier.deliver()
    finally:
        courier.close()


def reduce_inherited_fd(fd: int):
    """``InheritedFd.__reduce__``: how descriptor ``fd`` travels to the process being started
    (with the start message, after it under :func:`ship_fds`, or through the resource sharer
    when the start message is full); the child rebuilds an ``InheritedFd`` of its own copy."""
    from multiprocessing import context, reduction, resource_sharer

    popen = context.get_spawning_popen()
    courier = getattr(_COURIER, "active", None)
    if courier is not None and popen is not None:
        return _courier_fd, (courier.outbox, courier.add(fd))
    if getattr(popen, "method", None) == "forkserver" and len(getattr(popen, "_fds", ())) >= _START_MESSAGE_FDS:
        return _rebuild_fd, (resource_sharer.DupFd(fd),)
    return _rebuild_fd, (reduction.DupFd(fd),)


def _rebuild_fd(dupfd):
    from torchrl_asyncpool.exchange.doorbell import InheritedFd

    return InheritedFd(dupfd.detach())


def _courier_fd(inbox, index: int):
    from torchrl_asyncpool.exchange.doorbell import InheritedFd

    return InheritedFd(inbox.fd(index))


class _Courier:
    """Parent side of :func:`ship_fds`: collects the descriptors pickled during one start."""

    def __init__(self):
        self.fds = []
        self._send, self._recv = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.outbox = _Outbox(self._recv.fileno())

    def add(self, fd: int) -> int:
        self.fds.append(int(fd))
        return len(self.fds) - 1

    def deliver(self) -> None:
        """Sends the count, then the descriptors in batches. A child that died meanwhile is not
        an error here: its start-up's owner sees it die."""
        from multiprocessing import reduction

        if not self.fds:
            return
        self._recv.close()  # the child holds its own end now: a dead child fails the sends below
        try:
            self._send.sendall(struct.pack("<Q", len(self.fds)))
            for i in range(0, len(self.fds), _FDS_PER_MESSAGE):
                reduction.sendfds(self._send, self.fds[i:i + _FDS_PER_MESSAGE])
        except OSError:
            pass

    def close(self) -> None:
        self._send.close()
        self._recv.close()


class _Outbox:
    """What the start message carries in place of the shipped descriptors: the child's end of
    the socketpair (pickled once per start; every shipped InheritedFd refers to it)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _Inbox, (reduction.DupFd(self.fd),)


class _Inbox:
    """Child side of :func:`ship_fds`: receives every shipped descriptor on first use."""

    def __init__(self, dupfd):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=dupfd.detach())
        self._fds = None

    def fd(self, index: int) -> int:
        if self._fds is None:
            try:
                self._fds = self._receive()
            finally:
                self._sock.close()
        return self._fds[index]

    def _receive(self) -> list:
        import array

        header = self._sock.recv(8)
        if len(header) != 8:
            raise EOFError("the parent process did not send this process's file descriptors (it failed or exited "
                           "while starting it).")
        (total,) = struct.unpack("<Q", header)
        ensure_fd_capacity(total, "receiving the file descriptors of this process's arguments")
        fds = []
        item = array.array("i").itemsize
        while len(fds) < total:
            want = min(_FDS_PER_MESSAGE, total - len(fds))
            msg, ancdata, flags, _ = self._sock.recvmsg(1, socket.CMSG_SPACE(want * item))
            if not msg and not ancdata:
                raise EOFError(f"the parent process stopped sending file descriptors ({len(fds)} of {total} "
                               "received).")
            got = array.array("i")
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got.frombytes(data[: len(data) - len(data) % item])
            fds.extend(got)
            if flags & socket.MSG_CTRUNC or len(got) != want:
                for fd in fds:
                    os.close(fd)
                raise OSError(errno.EMFILE, f"received {len(got)} of a batch of {want} file descriptors "
                                            f"({len(fds)} of {total} in all): RLIMIT_NOFILE too low?")
        return fds
