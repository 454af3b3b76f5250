"""Counting doorbells on Linux ``eventfd``.

A ring is one ``write(2)`` of 8 bytes: it never waits for the woken process to run (unlike
``multiprocessing.Event.set``, which takes a lock the waiter holds). A waiter blocks in
``poll(2)`` together with other file descriptors (worker sentinels, the parent's life
pipe), so death and readiness are observed by the same wait and nothing spins.

With the C extension, rings, drains and non-blocking polls keep the GIL, and a blocking wait
(:class:`BellWait`) lets it go once and drains its doorbell before taking it back.
``os.eventfd_read`` or ``poll(0)`` from Python let the GIL go for a system call of a
microsecond or two; when other threads want it (a threaded worker's env threads, the serving
thread and the learner) one of them takes it, and the caller waits for that thread's whole
Python run before it goes on.

Idle polling (C extension; ``BellWait(..., idle_poll=True)``, ``TORCHRL_ASYNCPOOL_IDLE_POLL=1``
for every wait of a process that does not say, or a pool's ``idle_poll``, see
:func:`resolve_idle_poll`): a blocking ``poll(2)`` makes the remote ring a cross-core wake-up,
which on a VM that halts idle vCPUs goes through the host (~100 us a round trip on the
benchmark VM). An idle-polled wait parks on a futex of its own process instead, and one
``SCHED_IDLE`` thread per process, which runs only when its core has nothing else to run, polls
the parked waiters' descriptors without blocking and wakes the one whose descriptors fired: a
same-core wake-up of a few microseconds. The cost: that thread keeps the cores busy whenever
they would idle while waits are parked, and a waiter whose core is busy is not woken before
the core goes idle or its own 1 ms check. Only a wait's first 5 ms idle-poll; the rest of a
longer wait blocks in ``poll(2)``, and the poller parks after 5 ms without a parked waiter, so
an idle pool leaves the cores idle; a process whose waits keep being woken late by their own
check (the poller starved: another process keeps the cores busy) blocks in ``poll(2)`` for half
a second before it tries again (``idle_poll.c``'s starvation rule). It pays off when each side
of the exchange has a core of its own and that core often idles (cheap CPU envs in a pinned
worker); threaded workers of sleeping envs share their core with many runnable threads and
measured worse (see
``benchmarks/README.md``). A pool's ``idle_poll="auto"`` follows exactly that: on for CPU-bound
workers where idle cores wake slowly (:func:`wake_cost_ns`), off otherwise.
"""
from __future__ import annotations

import operator
import os
import select
import time

try:  # the GIL-keeping calls (see the module docstring); os and select otherwise
    from torchrl_asyncpool.exchange import _native as _c
except ImportError:  # the package was installed without its C extension
    _c = None

from torchrl_asyncpool._sys.descriptors import InheritedFd

__all__ = [
    "BellWait", "Doorbell", "poll_for", "IDLE_POLL_ENV", "SLOW_WAKE_NS", "wake_cost_ns",
    "resolve_idle_poll", "set_process_idle_poll",
]

#: the environment variable that turns idle polling on (``1``) or off (``0``) for every wait
#: that does not say, and that a pool's ``idle_poll="auto"`` follows when it is set
IDLE_POLL_ENV = "TORCHRL_ASYNCPOOL_IDLE_POLL"
#: a cross-core round trip (two wake-ups, :func:`wake_cost_ns`) slower than this makes idle
#: polling pay for CPU-bound workers: 117-127 us on the benchmark VM, where it measured +10-30 %
#: frames/s on CartPole; a few to a few tens of us on bare metal with shallow C-states. On
#: 2026-12-02 the same kind of VM probed 48-80 us from one process to the next, and CartPole with
#: 32 envs ran at 73-77k frames/s idle-polled against 16-19k without: a bar at 60 us flipped the
#: choice from run to run, hence 30 us
SLOW_WAKE_NS = 30_000


_WAKE_COST: list = []  # the measured cost, once per process (a probe that got no answer is retried)


def wake_cost_ns() -> int | None:
    """What waking a thread parked on an idle core costs here: the median cross-core ``eventfd``
    round trip after a short sleep, measured once per process (~40 ms, C extension
    ``wake_probe``). ``None`` without the C extension, with a single CPU, or when the probe could
    not run."""
    if _WAKE_COST:
        return _WAKE_COST[0]
    cost = None if _c is None else _c.wake_probe(64, 300)
    if cost is not None:
        _WAKE_COST.append(cost)
    return cost


#: what turns idle polling off in :data:`IDLE_POLL_ENV` (any other non-empty value turns it on)
_OFF_WORDS = ("0", "false", "off", "no")


def resolve_idle_poll(idle_poll, *, cpu_bound: bool) -> bool:
    """Whether a pool's blocking waits (its workers' and its inference server's) idle-poll.

    Args:
        idle_poll (bool or "auto"): ``True``/``False`` as given; ``"auto"``: the environment
            variable :data:`IDLE_POLL_ENV` when it is set, else on for CPU-bound workers
            (``cpu_bound``) on a machine whose idle cores wake slowly
            (:func:`wake_cost_ns` above :data:`SLOW_WAKE_NS`).
        cpu_bound (bool): the workers step their envs in their own thread (not threaded
            workers of envs that sleep or block, which measured worse idle-polled).

    Returns:
        bool. Always ``False`` without the C extension.

    Examples:
        >>> from torchrl_asyncpool.exchange.doorbell import resolve_idle_poll
        >>> resolve_idle_poll(False, cpu_bound=True), resolve_idle_poll("auto", cpu_bound=False)
        (False, False)
    """
    if _c is None:
        return False
    if isinstance(idle_poll, bool):
        return idle_poll
    if idle_poll != "auto":
        raise ValueError(f"idle_poll must be True, False or 'auto', got {idle_poll!r}.")
    env = os.environ.get(IDLE_POLL_ENV, "").strip().lower()
    if env != "":
        return env not in _OFF_WORDS
    if not cpu_bound:
        return False
    cost = wake_cost_ns()
    return cost is not None and cost > SLOW_WAKE_NS


def set_process_idle_poll(on: bool) -> None:
    """Makes ``on`` the default of every wait of this process that does not say (a pool worker
    calls it at start-up with its pool's resolved ``idle_poll``); no-op without the C extension."""
    if _c is not None:
        _c.set_idle_poll(bool(on))


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
        >>> elapsed < 0.05  # ~0.2 ms on an idle machine; poll(2) alone would round it up to 1 ms
        True
        >>> bell.ring(); [fd == bell.fd for fd, _ in poll_for(p, 0.0002)]
        [True]
        >>> bell.close()
    """
    return _timed(poller.poll, timeout)


def _timed(poll, timeout: float | None) -> list:
    """``poll(ms)`` (``-1``: no limit) for a timeout in seconds, below a millisecond included
    (see :func:`poll_for`)."""
    if timeout is None:
        return poll(-1)
    ms = min(int(timeout * 1000.0), 2**31 - 1)  # poll(2) takes a C int; the callers loop on
    if ms >= 1:
        return poll(ms)
    events = poll(0)
    if events or timeout <= 0:
        return events
    time.sleep(timeout)
    return poll(0)


def _drain(fd: int) -> int:
    """Reads and zeroes the non-blocking eventfd ``fd``; what it held (0 when nothing)."""
    if _c is not None:
        return _c.drain(fd)
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


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
        if _c is not None:
            _c.ring(self.fd, n)
        else:
            os.eventfd_write(self.fd, operator.index(n))  # a numpy count too, as the C call takes it

    def drain(self) -> int:
        """Reads and zeroes the counter without blocking; returns what it held."""
        return _drain(self.fd)

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
        """Closes the eventfd (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BellWait:
    """One wait on a doorbell and other descriptors that drains the doorbell when it was rung.

    The wait loops of the workers and of the serving loop: they wait for a ring or for a stop,
    death or hang-up descriptor, then drain the doorbell and scan the slot states. With the C
    extension the poll and the drain are one call that lets the GIL go once, and a wait with
    a zero timeout keeps it (see the module docstring). Timeouts below a millisecond are
    honoured as :func:`poll_for` honours them.

    Args:
        bell (Doorbell or None): drained when it is among the descriptors that fired.
        others (sequence of int): descriptors whose readability (or hang-up) ends the wait.

    Keyword Args:
        idle_poll (bool or None): park blocking waits for this process's idle poller (see the
            module docstring) instead of blocking in ``poll(2)``; ``None`` (default): as the
            environment variable ``TORCHRL_ASYNCPOOL_IDLE_POLL`` (``1``/``0``, off when unset)
            says. Without the C extension waits always block in ``poll(2)``.

    Examples:
        >>> import os
        >>> from torchrl_asyncpool.exchange import BellWait, Doorbell
        >>> bell = Doorbell(); r, w = os.pipe()
        >>> waiter = BellWait(bell, [r])
        >>> waiter.wait(0.0)
        []
        >>> bell.ring(); waiter.wait() == [bell.fd], bell.drain()  # drained by the wait
        (True, 0)
        >>> _ = os.write(w, b"x"); waiter.wait(0.001) == [r]
        True
        >>> bell.close(); os.close(r); os.close(w)
    """

    __slots__ = ("bell_fd", "fds", "idle", "_poller")

    def __init__(self, bell: "Doorbell | None", others=(), *, idle_poll: bool | None = None):
        if idle_poll is not None and not isinstance(idle_poll, bool):
            raise TypeError(f"idle_poll must be True, False or None, got {idle_poll!r}.")
        self.idle = -1 if idle_poll is None else int(idle_poll)
        self.bell_fd = -1 if bell is None else bell.fd
        self.fds = tuple(int(fd) for fd in ([] if bell is None else [bell.fd]) + list(others))
        self._poller = None
        if _c is None:
            self._poller = select.poll()
            for fd in self.fds:
                self._poller.register(fd, select.POLLIN)

    def _poll(self, ms: int) -> list:
        if _c is not None:
            return _c.wait(self.fds, ms, self.bell_fd, self.idle)
        fired = [fd for fd, _ in self._poller.poll(None if ms < 0 else ms)]
        if self.bell_fd in fired:
            _drain(self.bell_fd)
        return fired

    def wait(self, timeout: float | None = None) -> list:
        """Blocks until a descriptor fires or ``timeout`` seconds pass (``None``: no limit);
        returns the descriptors that fired (the doorbell's among them, already drained)."""
        return _timed(self._poll, timeout)
