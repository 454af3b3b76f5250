"""Background threads that run torch code at their creator's torch thread count.

OpenMP's thread count is per thread: ``torch.set_num_threads(1)`` in the caller does not reach
a thread started later, whose first parallel op (a ``Linear``, say) then starts a team of one
thread per core that spins between calls. Measured on 2 cores with the inference server's
thread: a core at ~93 % and 25 % fewer frames/s on the 2 ms pixel env.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

__all__ = ["start_daemon_thread"]


def start_daemon_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Starts ``target`` in a daemon thread that first re-applies the caller's torch thread count.

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool._sys.threads import start_daemon_thread
        >>> seen = []
        >>> start_daemon_thread(lambda: seen.append(torch.get_num_threads()), "probe").join()
        >>> seen == [torch.get_num_threads()]
        True
    """
    num_threads = torch.get_num_threads()

    def run():
        torch.set_num_threads(num_threads)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
