"""Exceptions raised by pools, servers and collectors."""
from __future__ import annotations

__all__ = ["EnvError", "WorkerDiedError", "PoolClosedError", "PoolStartCancelled"]


class EnvError(RuntimeError):
    """An environment raised in its worker; carries the env index and the original traceback.

    Attributes:
        env_index (int): the slot (env index) whose env raised.
        worker_traceback (str): the traceback formatted in the worker process.
    """

    def __init__(self, env_index: int, phase: str, worker_traceback: str):
        self.env_index = env_index
        self.phase = phase
        self.worker_traceback = worker_traceback
        super().__init__(
            f"env {env_index} raised during {phase} in its worker process; original traceback:\n{worker_traceback}"
        )

    def __reduce__(self):
        return (type(self), (self.env_index, self.phase, self.worker_traceback))


class WorkerDiedError(RuntimeError):
    """A worker process exited while the pool was running (killed, crashed, out of memory).

    Attributes:
        env_indices (tuple of int): the envs (slots) the worker hosted; empty when unknown.
    """

    def __init__(self, message: str, env_indices=()):
        self.env_indices = tuple(int(i) for i in env_indices)
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.env_indices))


class PoolClosedError(RuntimeError):
    """The pool was used after :meth:`~torchrl_asyncpool.AsyncEnvPool.close`."""


class PoolStartCancelled(RuntimeError):
    """The pool's start-up was abandoned because its ``cancel_start`` callable returned true
    (see :class:`~torchrl_asyncpool.AsyncEnvPool`); the pool's processes are gone."""
