"""Counting doorbells on Linux ``eventfd``.

A ring is one ``write(2)`` of 8 bytes: it never waits for the woken process to run (unlike
``multiprocessing.Event.set``, which takes a lock the waiter holds). A waiter blocks in
``poll(2)`` together with other file descriptors (worker sentinels, the parent's life
pipe), so death and readiness are observed by the same wait and nothing spins.
"""
from __future__ import annotations

import os
import select
import time

__all__ = ["Doorbell", "InheritedFd", "poll_for"]


def poll_for(poller, timeout: float | None) -> list:
    """``poller.poll`` with a timeout in seconds that is honoured below one millisecond.

    ``poll(2)`` counts its timeout in whole milliseconds and CPython rounds up, so a 100 us
    flush deadline used to cost a full millisecond of idle envs. Waits of a millisecond or
    more poll for the whole milliseconds (the caller loops and recomputes what is left);
    a shorter remainder is slept, then polled without blocking. A ring during that short
    sleep is seen when it ends, at most ``timeout`` (< 1 ms) late.

    Args:
        poller (select.poll): registered descriptors.
        timeout (float or None): seconds; ``None`` blocks until an event.

    Returns:
        the ``(fd, event)`` pairs of ``poller.poll``.

    Examples:
        >>> import select, time
        >>> from torchrl_asyncpool.exchange import Doorbell, poll_for
        >>> bell = Doorbell(); p = select.poll(); p.register(bell.fd, select.POLLIN)
        >>> t0 = time.monotonic(); poll_for(p, 0.0002); elapsed = time.monotonic() - t0
        []
        >>> elapsed < 0.0009 or elapsed  # well under poll(2)'s rounded-up millisecond (a loaded machine may exceed it)
        True
        >>> bell.ring(); [fd == bell.fd for fd, _ in poll_for(p, 0.0002)]
        [True]
        >>> bell.close()
    """
    if timeout is None:
        return poller.poll()
    ms = int(timeout * 1000.0)
    if ms >= 1:
        return poller.poll(ms)
    events = poller.poll(0)
    if events or timeout <= 0:
        return events
    time.sleep(timeout)
    return poller.poll(0)


class InheritedFd:
    """A file descriptor that survives being handed to a child process.

    Under ``fork`` the child inherits it as is; under ``forkserver``/``spawn`` pickling
    goes through :class:`multiprocessing.reduction.DupFd`, which ships the descriptor with
    the process start-up message (the only time anything is pickled).
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dupfd) -> InheritedFd:
    return InheritedFd(dupfd.detach())


class Doorbell:
    """An ``eventfd`` used as a counting wake-up signal.

    Args:
        fd (int, optional): an existing eventfd (in a child process). A new one is created
            when omitted.

    Examples:
        >>> from torchrl_asyncpool.exchange import Doorbell
        >>> bell = Doorbell()
        >>> bell.ring(); bell.ring()
        >>> bell.drain()
        2
        >>> bell.drain()
        0
        >>> bell.close()
    """

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.fd = fd

    def ring(self, n: int = 1) -> None:
        """Adds ``n`` to the counter, waking a waiter if any."""
        os.eventfd_write(self.fd, n)

    def drain(self) -> int:
        """Reads and zeroes the counter without blocking; returns what it held."""
        try:
            return os.eventfd_read(self.fd)
        except BlockingIOError:
            return 0

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until rung or ``timeout`` seconds passed; returns whether it was rung."""
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        if timeout is None:
            return bool(p.poll())
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            events = poll_for(p, deadline - time.monotonic())
            if events or time.monotonic() >= deadline:
                return bool(events)

    def inheritable(self) -> InheritedFd:
        """The descriptor wrapped for handing to a child process."""
        return InheritedFd(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
