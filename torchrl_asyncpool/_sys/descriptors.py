"""File descriptors handed to a child process (doorbells, arenas, pipes).

:class:`InheritedFd` is a descriptor that survives being pickled into a child's arguments;
:func:`ship_fds` sends many of them after a fork server start message instead of inside it
(whose room is ~250); :func:`ensure_fd_capacity` raises the soft ``RLIMIT_NOFILE`` where a pool
needs more (see the comment above :data:`FD_MARGIN`).
"""
from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading

__all__ = ["InheritedFd", "ship_fds", "ensure_fd_capacity", "reduce_inherited_fd", "FD_MARGIN"]


class InheritedFd:
    """A file descriptor that survives being handed to a child process.

    Under ``fork`` the child inherits it as is; under ``forkserver``/``spawn`` pickling
    goes through :class:`multiprocessing.reduction.DupFd`, which ships the descriptor with
    the process start-up message (the only time anything is pickled). A fork server's start
    message holds about 250 descriptors: inside
    :func:`ship_fds` (how pools and inference servers start
    their processes) they are sent right after the start instead, in batches, any number of
    them; see :func:`reduce_inherited_fd`.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return reduce_inherited_fd(self.fd)


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
        >>> from torchrl_asyncpool._sys.descriptors import ensure_fd_capacity
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
    """Around ``Process.start()``: the descriptors (:class:`InheritedFd`) among
    the process's arguments are sent after the start, in batches over a socketpair, instead of
    in the start message (which a fork server limits to ~250; see the comment above). The child
    receives them while unpickling its arguments; its code sees no difference. Nested blocks
    ship with the outermost one; a block that starts nothing sends nothing.

    Examples:
        >>> import os
        >>> from torchrl_asyncpool._sys.descriptors import InheritedFd
        >>> from torchrl_asyncpool._sys.descriptors import ship_fds
        >>> from torchrl_asyncpool._sys.forkserver import exit_code, forkserver_context
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
    return InheritedFd(dupfd.detach())


def _courier_fd(inbox, index: int):
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
