"""CPU time of other processes' threads, read from ``/proc`` (Linux): what the collector's CPU plan
weighs a workload with, since a step's wall time also counts the turns of the processes it shares
a core with (two workers on one core each see the other's steps in their own)."""
from __future__ import annotations

import os

__all__ = ["thread_cpu_s", "CpuMeter"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_s(pid: int, tid: int | None = None) -> float | None:
    """Seconds of CPU the thread ``tid`` of process ``pid`` (default: its main thread) has run:
    from ``schedstat`` (nanoseconds) where the kernel keeps it, else ``stat``'s user and system
    clock ticks; ``None`` when the thread is gone or ``/proc`` is not there.

    Examples:
        >>> import os
        >>> from torchrl_asyncpool._sys.cpu_time import thread_cpu_s
        >>> thread_cpu_s(os.getpid()) > 0
        True
        >>> thread_cpu_s(-1) is None
        True
    """
    base = f"/proc/{pid}/task/{pid if tid is None else tid}"
    try:
        with open(f"{base}/schedstat") as f:
            return int(f.read().split()[0]) * 1e-9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{base}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None


class CpuMeter:
    """The CPU a changing set of threads has run since the meter started: the main threads of
    processes (given by pid) or single threads (given as ``(pid, tid)``). Each call adds what
    each thread ran since the previous call, so a thread or process that is replaced (a restarted
    worker) neither loses nor double-counts what the others ran.

    Examples:
        >>> import os, threading
        >>> from torchrl_asyncpool._sys.cpu_time import CpuMeter
        >>> meter = CpuMeter()
        >>> meter([os.getpid()])  # the first call starts the count
        0.0
        >>> sum(range(10**6)) > 0 and meter([os.getpid()]) > 0
        True
        >>> this_thread = CpuMeter()
        >>> this_thread([(os.getpid(), threading.get_native_id())])
        0.0
    """

    def __init__(self):
        self._last: dict = {}
        self.total = 0.0

    def __call__(self, pids) -> float:
        """The running total, in seconds, after adding what ``pids`` (pids and ``(pid, tid)``
        pairs) ran since the last call."""
        seen = {}
        for item in pids:
            if item is None:
                continue
            now = thread_cpu_s(*item) if isinstance(item, tuple) else thread_cpu_s(item)
            if now is None:
                continue
            before = self._last.get(item)
            if before is not None and now >= before:
                self.total += now - before
            seen[item] = now
        self._last = seen
        return self.total
