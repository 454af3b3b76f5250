"""Env workers as threads of the pool's own process (``AsyncEnvPool(backend="threading")``).

A thread worker runs the same worker loop as a worker process
(:func:`~torchrl_asyncpool.workers.worker.run_worker`) on the same shared-memory arena,
doorbells and chunk buffers, so records, autoreset, delivery and every error path are those of
the process backend. What differs is only what a process gave for free:

- **Descriptors.** A child process gets its own copies of the arena, doorbell and life-pipe
  descriptors; the thread gets duplicates (``os.dup``) that it closes when it ends, so the pool
  closing its own never pulls a descriptor from under a thread still inside an env's step
  (nor lets a reused descriptor number receive a doorbell's write).
- **A sentinel.** The consumers notice a dead worker process by its sentinel becoming readable;
  a thread worker's sentinel is the read end of a pipe whose write end the thread closes as its
  very last act, so the same ``poll`` sees a thread worker end.
- **No process-wide settings.** Signal handlers, process groups, ``torch.set_num_threads``,
  the idle-poll default and the scheduling class belong to the user's process and are left
  alone.
- **No kill.** Python cannot stop a thread: a thread stuck in an env's step is left running
  (a daemon thread, gone when the process exits) when the pool closes, and the pool says so.
"""
from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection

from torchrl_asyncpool._sys.descriptors import InheritedFd

__all__ = ["ThreadWorker"]


class ThreadWorker:
    """One pool worker run in a daemon thread, behind the part of :class:`multiprocessing.Process`
    the pool uses (``start``, ``sentinel``, ``join``, ``exitcode``, ``is_alive``, ``kill``).

    Args:
        target (callable): the worker loop,
            :func:`~torchrl_asyncpool.workers.worker.run_worker`.
        args (tuple): its arguments; every :class:`~torchrl_asyncpool.exchange.doorbell.InheritedFd`
            in them (also inside lists and the chunk handle) is replaced by a duplicate that the
            thread owns and closes when it ends.
        name (str): the thread's name.

    Attributes:
        pid (None): a thread worker has no process of its own (nothing to signal or kill).
        exitcode (int or None): ``0`` once the thread has ended, ``None`` while it runs.
    """

    pid = None

    def __init__(self, target, args, name: str):
        self.name = name
        self.exitcode = None
        self._owned: list[int] = []
        self._args = tuple(self._dup(a) for a in args)
        self._target = target
        self._sentinel_r, self._sentinel_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _dup(self, value):
        if isinstance(value, InheritedFd):
            fd = os.dup(value.fd)
            self._owned.append(fd)
            return InheritedFd(fd)
        if isinstance(value, (list, tuple)):
            return type(value)(self._dup(v) for v in value)
        if hasattr(value, "__dataclass_fields__"):  # the chunk handle carries two descriptors
            import dataclasses

            return dataclasses.replace(value, **{
                f.name: self._dup(getattr(value, f.name)) for f in dataclasses.fields(value)
                if isinstance(getattr(value, f.name), InheritedFd)
            })
        return value

    def start(self) -> None:
        """Starts the thread."""
        self._thread.start()

    def _run(self) -> None:
        try:
            self._target(*self._args)
        finally:
            for arg in self._args:  # the worker's end of its start-up pipe
                if isinstance(arg, Connection):
                    arg.close()
            for fd in self._owned:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._owned.clear()
            self.exitcode = 0
            os.close(self._sentinel_w)  # last: the sentinel says the worker is gone

    @property
    def sentinel(self) -> int:
        """A descriptor that becomes readable (end of file) when the thread has ended."""
        return self._sentinel_r

    def join(self, timeout: float | None = None) -> None:
        """Waits up to ``timeout`` seconds (``None``: no limit) for the thread to end."""
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the thread still runs."""
        return self.exitcode is None

    def kill(self) -> None:
        """Does nothing: a thread cannot be stopped from outside (see the module docstring)."""

    terminate = kill

    def close(self) -> None:
        """Releases the sentinel once the thread has ended (no-op while it runs)."""
        if self.exitcode is not None and self._sentinel_r >= 0:
            os.close(self._sentinel_r)
            self._sentinel_r = -1

    def __repr__(self) -> str:
        return f"<ThreadWorker {self.name} {'running' if self.exitcode is None else 'ended'}>"
