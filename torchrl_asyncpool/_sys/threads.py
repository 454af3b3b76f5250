"""Background threads that run torch code at their creator's torch thread count.

OpenMP's thread count is per thread: ``torch.set_num_threads(1)`` in the caller does not reach
a thread started later, whose first parallel op (a ``Linear``, say) then starts a team of one
thread per core that spins between calls. Measured on 2 cores with the inference server's
thread: a core at ~93 % and 25 % fewer frames/s on the 2 ms pixel env.

A thread that runs torch at more threads than it needs harms the process's other threads too,
for as long as it lives: beside a serving thread that ran at the learner's 2 threads, a 2-thread
CPU learner's gradient step took ~2x longer on 2 cores, its OpenMP threads sleeping between
parallel regions instead of spinning. The serving thread had set 1, but torch initialises a
thread's count lazily from the last count any thread set (:func:`set_thread_num_threads`). So
the package's own threads start at the count they run at (the serving thread at
``policy_num_threads``, the replay writer at 1), made to stick.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

__all__ = ["start_daemon_thread", "set_thread_num_threads"]


def set_thread_num_threads(num_threads: int) -> None:
    """``torch.set_num_threads(num_threads)`` for the calling thread, made to stick.

    torch sets a thread's OpenMP count lazily, from the process-wide count of the last
    ``set_num_threads`` of any thread, on that thread's first parallel op or
    ``get_num_threads``: a thread that set 1 and then, before its first op, saw another thread
    set 2 runs at 2. Reading the count right away does that first initialisation now.

    Examples:
        >>> import threading, torch
        >>> from torchrl_asyncpool._sys.threads import set_thread_num_threads
        >>> before = torch.get_num_threads(); seen = []
        >>> ready, go = threading.Event(), threading.Event()
        >>> def probe():
        ...     set_thread_num_threads(1); ready.set(); go.wait(); seen.append(torch.get_num_threads())
        >>> t = threading.Thread(target=probe); t.start(); _ = ready.wait()
        >>> torch.set_num_threads(2); go.set(); t.join(); seen
        [1]
        >>> torch.set_num_threads(before)
    """
    torch.set_num_threads(num_threads)
    if torch.get_num_threads() != num_threads:  # the first read initialised it from another thread's count
        torch.set_num_threads(num_threads)


def start_daemon_thread(target: Callable[[], None], name: str, num_threads: Optional[int] = None) -> threading.Thread:
    """Starts ``target`` in a daemon thread that first sets its torch thread count: ``num_threads``,
    or the caller's when it is ``None``.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool._sys.threads import start_daemon_thread
        >>> seen = []
        >>> start_daemon_thread(lambda: seen.append(torch.get_num_threads()), "probe").join()
        >>> start_daemon_thread(lambda: seen.append(torch.get_num_threads()), "probe", 1).join()
        >>> seen == [torch.get_num_threads(), 1]
        True
    """
    if num_threads is None:
        num_threads = torch.get_num_threads()

    def run():
        set_thread_num_threads(num_threads)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
