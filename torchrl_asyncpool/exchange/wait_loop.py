"""The one wait loop of every consumer of doorbell-signalled work.

Four waits share it: the pool's ``recv`` and ``wait_ready``
(:class:`~torchrl_asyncpool.exchange.consumer.SlotConsumer`), the serving loop's wait for a
flush (``inference/_loop.py``) and the driver's wait for full transition chunks
(:meth:`ChunkReader.take <torchrl_asyncpool.delivery.chunks.ChunkReader.take>`). Each pass:

1. read the clock and ask the caller's readiness test how long until the work is due
   (``<= 0``: now; a positive number of seconds: due by the clock alone then, as a flush
   deadline is; ``math.inf``: only a publication can make it due);
2. not due, and the doorbell not drained since the last test: drain it and test again. A ring
   after the drain wakes the wait below, and what was published between the first test and the
   drain is seen by the second, so nothing published is slept through. Draining only when a
   wait may follow saves a system call when the work is already due;
3. past the caller's deadline: give up (:data:`TIMED_OUT`);
4. run the caller's health hook (watchdogs, dead-worker checks);
5. block on the doorbell and the other descriptors for the time left (the sooner of the test's
   and the deadline's, at most ``max_wait``). A stop descriptor that fired ends the loop
   (:data:`STOPPED`); any other (a worker's sentinel) calls the caller's fault hook, which
   raises the fault it finds. A doorbell that fired was drained by the wait. Until
   :attr:`WaitLoop.deaf_until` (set by the caller) the wait leaves the doorbell out: a
   caller that knows its work cannot be due before then sleeps through the rings meanwhile.
   On a VM a ring that wakes a blocked thread costs the ringing process a cross-core wake-up
   (~100-200 us measured on the benchmark VM) and the woken thread a pass of this loop; a ring
   nobody waits on is a plain counter update.

The callables come with each :meth:`WaitLoop.run` (bound methods of its caller): the loop keeps
no reference to its owner, so owner and loop form no reference cycle, and a pass allocates no
closure or list of its own.
"""
from __future__ import annotations

import math
import time

from torchrl_asyncpool.exchange.doorbell import BellWait, Doorbell

__all__ = ["WaitLoop", "READY", "TIMED_OUT", "STOPPED", "NOT_DUE"]

#: :meth:`WaitLoop.run` results: the readiness test passed, the deadline passed first, a stop
#: descriptor fired
READY, TIMED_OUT, STOPPED = "ready", "timed out", "stopped"
#: what a readiness test returns when only a publication can make the work due
NOT_DUE = math.inf

_monotonic = time.monotonic


class WaitLoop:
    """Waits until a caller's readiness test passes (see the module docstring).

    Args:
        bell (Doorbell): rung whenever work may have become ready.
        others (sequence of int, optional): other descriptors that end a blocking wait when
            readable or hung up: stop descriptors and worker sentinels.

    Keyword Args:
        stop_fds (collection of int, optional): those of ``others`` that end the loop with
            :data:`STOPPED`; the rest call the fault hook.
        max_wait (float, optional): the longest single blocking wait, in seconds, so that the
            health hook runs at least that often; ``None`` (default): no bound.
        idle_poll (bool, optional): as :class:`~torchrl_asyncpool.exchange.doorbell.BellWait`
            takes it (``None``, the default: as this process's setting says).

    Attributes:
        waiter (BellWait): the blocking wait (on ``bell`` and ``others``).
        now (float): ``time.monotonic()`` at the last readiness test of the last run.
        waited (float): seconds the last run spent in blocking waits.
        deaf_until (float): ``time.monotonic()`` time before which blocking waits leave the
            doorbell out (step 5); ``0.0`` (the default): always listen. The readiness test is
            still run after each wait, so work published meanwhile is found when it ends.

    Examples:
        >>> import time
        >>> from torchrl_asyncpool.exchange import Doorbell
        >>> from torchrl_asyncpool.exchange.wait_loop import WaitLoop, NOT_DUE
        >>> bell = Doorbell(); loop = WaitLoop(bell)
        >>> published = []
        >>> def due(now):
        ...     return 0.0 if published else NOT_DUE
        >>> loop.run(due, deadline=time.monotonic() + 0.01)  # nothing published
        'timed out'
        >>> published.append(1); bell.ring(); loop.run(due)
        'ready'
        >>> bell.close()
    """

    __slots__ = ("_bell_fd", "_drain", "waiter", "_deaf", "_stop_fds", "_max_wait", "now", "waited", "deaf_until")

    def __init__(self, bell: Doorbell, others=(), *, stop_fds=(), max_wait: float | None = None,
                 idle_poll: bool | None = None):
        if max_wait is not None and not max_wait > 0:
            raise ValueError(f"max_wait must be None or > 0 seconds, got {max_wait!r}.")
        self._bell_fd = bell.fd
        self._drain = bell.drain
        self.waiter = BellWait(bell, others, idle_poll=idle_poll)
        self._deaf = BellWait(None, others, idle_poll=idle_poll)
        self.deaf_until = 0.0
        self._stop_fds = frozenset(stop_fds)
        unknown = self._stop_fds - set(others)
        if unknown:
            raise ValueError(f"stop_fds must be among others={list(others)}, got {sorted(unknown)} besides.")
        self._max_wait = math.inf if max_wait is None else float(max_wait)
        self.now = 0.0
        self.waited = 0.0

    def run(self, due, deadline: float | None = None, health=None, fault=None) -> str:
        """Waits until ``due(now) <= 0``; returns :data:`READY`, :data:`TIMED_OUT` or :data:`STOPPED`.

        Args:
            due (callable): ``now -> float``, the readiness test: seconds until the work is
                due (``<= 0``: now; :data:`NOT_DUE`: when something is published). It may
                raise (an env error it found), and keeps what it counted for its caller.
            deadline (float, optional): ``time.monotonic()`` time after which the loop gives
                up (:data:`TIMED_OUT`) if the test has not passed; ``None``: never.
            health (callable, optional): ``now -> bool or None``, run before each blocking
                wait (it may raise); a true result says it took time, and the clock is read again.
            fault (callable, optional): ``() -> None``, run when a descriptor other than the
                doorbell and the stop descriptors fired; it raises the fault it finds.
        """
        self.waited = 0.0
        drained = False
        bell_fd = self._bell_fd
        while True:
            now = self.now = _monotonic()
            left = due(now)
            if left <= 0.0:
                return READY
            if not drained:  # see the module docstring, step 2
                self._drain()
                drained = True
                continue
            if deadline is not None and now >= deadline:
                return TIMED_OUT
            if health is not None and health(now):
                now = _monotonic()
            if deadline is not None and deadline - now < left:
                left = max(0.0, deadline - now)
            if left > self._max_wait:
                left = self._max_wait
            if now < self.deaf_until:
                fired = self._deaf.wait(min(left, self.deaf_until - now))
            else:
                fired = self.waiter.wait(None if left == math.inf else left)
            self.waited += _monotonic() - now
            drained = False
            for fd in fired:
                if fd == bell_fd:
                    drained = True  # the wait drained it; a timeout drains on the next pass
                elif fd in self._stop_fds:
                    return STOPPED
                elif fault is not None:
                    fault()
