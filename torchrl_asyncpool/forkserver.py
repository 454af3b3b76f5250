"""The fork server that env workers and inference server processes start from.

``multiprocessing`` keeps one fork server per process, started by the first ``"forkserver"``
process anyone starts, and it imports its preload list once, when it starts: every child
forked from it then has torch, TorchRL and this package already imported. A fork server
that other code started first, without these modules, still works, but each child imports
them itself: seconds per worker on a machine with few cores (eight single-env workers on 2
cores took 15 s to start instead of 0.2 s). :func:`forkserver_context` is what the pool and
the server process start from; it warns once when it finds such a fork server running.
"""
from __future__ import annotations

import multiprocessing as mp
import warnings

__all__ = ["PRELOAD", "forkserver_context"]

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
