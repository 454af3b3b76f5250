"""The fork server that env workers and inference server processes start from.

``multiprocessing`` keeps one fork server per process, started by the first ``"forkserver"``
process anyone starts, and it imports its preload list once, when it starts: every child
forked from it then has torch, TorchRL and this package already imported. A fork server
that other code started first, without these modules, still works, but each child imports
them itself: seconds per worker on a machine with few cores (eight single-env workers on 2
cores took 15 s to start instead of 0.2 s). :func:`forkserver_context` is what the pool and
the server process start from; it warns once when it finds such a fork server running.

A child's descriptors (its doorbells, arena, pipes) travel as described in
:mod:`~torchrl_asyncpool._sys.descriptors`.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import warnings
import weakref
from multiprocessing.connection import wait

__all__ = ["PRELOAD", "START_METHODS", "forkserver_context", "death_fd", "exit_code", "picklable"]

#: The ``mp_start_method`` values a pool, a collector and an inference server accept (a ``fork``
#: after torch has started its threads can deadlock the child).
START_METHODS = ("forkserver", "spawn")

# Imported once by the fork server, so that every child forks with them already loaded (the
# union of what env workers and server processes need). "__main__": the user's script is
# imported (as ``__mp_main__``, so its guarded code does not run) once there instead of once per
# worker, which is what made start-up grow with the number of envs (64 workers each re-importing
# a script that imports gymnasium: ~10 s on 2 cores). A missing optional module is skipped.
#: What the fork server imports when it starts (see the comment above).
PRELOAD = [
    "__main__", "torchrl_asyncpool.workers.worker", "torchrl_asyncpool.inference._process", "torchrl.envs",
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
    one by one. Call ``multiprocessing.set_forkserver_preload(torchrl_asyncpool._sys.forkserver.PRELOAD)``
    before other code starts the fork server, or build the pool first, to avoid it.

    Examples:
        >>> from torchrl_asyncpool._sys.forkserver import forkserver_context
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
            "cores). Call multiprocessing.set_forkserver_preload(torchrl_asyncpool._sys.forkserver.PRELOAD) before "
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


def death_fd(proc) -> int:
    """A descriptor that becomes readable once ``proc`` (a started child process, or a
    :class:`~torchrl_asyncpool.workers.thread_worker.ThreadWorker`) has ended, and not before.

    A fork server's child has no sentinel of its own: ``proc.sentinel`` is the fork server's
    connection, which carries the exit status once the fork server reaps the child, and which
    also turns readable (EOF) when the fork server itself ends, with every child still running.
    Watching that, a pool took its live workers for dead: it started replacements beside them
    and the two stepped the same slots. A ``pidfd`` (Linux 5.3 and later) watches the process
    itself; where there is none (another OS, or a child already ended and reaped) the sentinel
    is the answer. The descriptor is the process object's: it is closed with it, or by
    :func:`release_death_fd`.

    Examples:
        >>> import select, time
        >>> from torchrl_asyncpool._sys.forkserver import death_fd, exit_code, forkserver_context
        >>> p = forkserver_context().Process(target=time.sleep, args=(0.2,))
        >>> p.start()
        >>> fd = death_fd(p)
        >>> select.select([fd], [], [], 0)[0]  # running
        []
        >>> exit_code(p, timeout=30)
        0
        >>> select.select([fd], [], [], 0)[0] == [fd]
        True
    """
    check_closed = getattr(proc, "_check_closed", None)
    if check_closed is not None:  # a closed process object raises ValueError, as its sentinel does
        check_closed()
    fd = getattr(proc, "_death_fd", None)
    if fd is not None:
        return fd
    fd, finalizer = proc.sentinel, None
    pid = getattr(proc, "pid", None)
    if pid is not None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # ended and reaped already (its sentinel has the status), or no pidfds here
            pass
        else:
            os.set_inheritable(fd, False)
            finalizer = weakref.finalize(proc, os.close, fd)
    proc._death_fd, proc._death_fd_finalizer = fd, finalizer
    return fd


def release_death_fd(proc) -> None:
    """Closes the pidfd :func:`death_fd` opened for ``proc`` (idempotent; the sentinel stays the
    process object's to close)."""
    finalizer = getattr(proc, "_death_fd_finalizer", None)
    if finalizer is not None:
        finalizer()


def _ended(proc, timeout) -> bool:
    """Whether ``proc`` has ended, after waiting up to ``timeout`` seconds (``None``: until it
    ends) on its :func:`death_fd`."""
    return bool(wait([death_fd(proc)], timeout))


def exit_code(proc, timeout: float | None = 0.0):
    """``proc.exitcode`` (``None`` while it runs), after waiting up to ``timeout`` seconds for it
    to end (``None``: until it ends); safe to call from several threads at once (see
    ``_POLL_LOCK``).

    Whether it runs is read from :func:`death_fd`, never from the fork server's connection (which
    also ends when the fork server does, while the child runs on); a child that ended after its
    fork server did reads ``255``, as ``multiprocessing`` reports a status it could not get.
    The wait happens outside the lock, so a thread waiting on one child does not hold up
    another thread reading a status.

    Examples:
        >>> import time
        >>> from torchrl_asyncpool._sys.forkserver import exit_code, forkserver_context
        >>> p = forkserver_context().Process(target=time.sleep, args=(0,))
        >>> p.start()
        >>> exit_code(p, timeout=30)
        0
    """
    if not _ended(proc, 0.0 if timeout is not None and timeout <= 0 else timeout):
        return None
    # a fork server writes the status a moment after its child ended
    wait([proc.sentinel], 1.0)
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
        >>> from torchrl_asyncpool._sys.forkserver import picklable
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
