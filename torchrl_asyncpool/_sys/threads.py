"""Background threads that run torch code at their creator's torch thread count.

OpenMP's thread count is per thread: ``torch.set_num_threads(1)`` in the caller does not reach
a thread started later, whose first parallel op (a ``Linear``, say) then starts a team of one
thread per core that spins between calls. Measured on 2 cores with the inference server's
thread: a core at ~93 % and 25 % fewer frames/s on the 2 ms pixel env.

A thread that once ran torch at more threads than it needs harms the process's other threads
too, for as long as it lives: beside one that started at the learner's 2 threads (and then went
down to 1), a 2-thread CPU learner's gradient step took ~2x longer on 2 cores, its OpenMP threads
sleeping between parallel regions instead of spinning. So the package's own threads start at
the count they run at (the serving thread at ``policy_num_threads``, the replay writer at 1),
never at the caller's first.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

__all__ = ["start_daemon_thread"]


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
        torch.set_num_threads(num_threads)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
