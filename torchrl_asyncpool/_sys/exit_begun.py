"""Whether another process has begun to exit before its end can be seen, read from ``/proc`` (Linux).

A process's death descriptor (:func:`~torchrl_asyncpool._sys.forkserver.death_fd`) turns readable
only once every thread of the process has ended. A worker whose main thread died (a crash, a kill,
or an env that ended that thread alone) can linger long after: the kernel's teardown of its memory
runs in whichever thread exits last, and a ``SCHED_IDLE`` idle poller on a busy core got ~0.3 %
of it (over a minute), while a thread the main thread left running keeps the process up for good.
Its main thread runs no more Python, so its envs answer nothing: the pool reads the main thread's
state instead (:func:`exit_begun`) every :data:`EXIT_CHECK_S`.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["EXIT_CHECK_S", "exit_begun", "describe_exit"]

#: seconds between two looks at the workers' main threads (a look costs ~10 us a worker)
EXIT_CHECK_S = 0.25


def exit_begun(pid: Optional[int]) -> Optional[int]:
    """The exit status of process ``pid`` once its main thread has exited (the process runs no
    more of its own code, or only threads it left), as ``multiprocessing`` reports one: ``-N``
    killed by signal ``N``, else the exit code; ``None`` while the main thread runs, and where
    ``/proc`` cannot say (the process already reaped, another OS: its death descriptor answers
    then).

    Examples:
        >>> import os
        >>> from torchrl_asyncpool._sys.exit_begun import exit_begun
        >>> exit_begun(os.getpid()) is None  # running
        True
        >>> exit_begun(-1) is None  # no such process
        True
    """
    if pid is None:  # a worker thread's
        return None
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    # fields[0] is proc(5)'s field 3 (state): a main thread that has exited while others run on
    # is a zombie. Field 52 (Linux 3.5 and later) is then its exit status in waitpid's form;
    # it is not read while the thread runs: a debugger's stop (py-spy, gdb) writes it too
    if fields[0] not in (b"Z", b"X"):
        return None
    status = int(fields[49]) if len(fields) > 49 else 0
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def describe_exit(code: Optional[int]) -> str:
    """``"killed by signal N"`` or ``"exit code N"`` for a ``multiprocessing`` exit status.

    Examples:
        >>> from torchrl_asyncpool._sys.exit_begun import describe_exit
        >>> describe_exit(-9), describe_exit(3)
        ('killed by signal 9', 'exit code 3')
    """
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
