"""Exceptions raised by pools, servers and collectors."""
from __future__ import annotations

__all__ = ["EnvError", "SetupRefused", "WorkerDiedError", "PoolClosedError", "PoolStartCancelled"]


class EnvError(RuntimeError):
    """An environment raised; carries the env index, what it was doing and the original traceback.

    Envs raise in their worker process, except env 0's first instance: the pool builds it in the
    calling process to read the specs (and, with ``envs_per_worker="auto"``, times a few of its
    steps), so a factory or env that fails there is reported from this process.

    Attributes:
        env_index (int): the slot (env index) whose env raised.
        phase (str): what it was doing (``"construction"``, ``"reset"``, ``"step"``, ...).
        worker_traceback (str): the traceback formatted where it raised.
        where (str): where it raised (``"its worker process"`` or ``"this process"``).
    """

    def __init__(self, env_index: int, phase: str, worker_traceback: str, where: str = "its worker process"):
        self.env_index = env_index
        self.phase = phase
        self.worker_traceback = worker_traceback
        self.where = where
        super().__init__(
            f"env {env_index} raised during {phase} in {where}; original traceback:\n{worker_traceback}"
        )

    def __reduce__(self):
        return (type(self), (self.env_index, self.phase, self.worker_traceback, self.where))


class SetupRefused(TypeError):
    """An env this package refuses for the use at hand, found while its factory runs: a wrong
    setup, not the env's failure, so it is raised as is rather than as an :class:`EnvError`.

    :func:`~torchrl_asyncpool.evaluation.evaluate` raises it for a factory that returns a vector or batched
    env, or a remote env slot (it runs one seeded episode per local env at a time). A
    ``TypeError``: ``except TypeError`` catches it.

    Examples:
        >>> import functools, gymnasium as gym, torch
        >>> from torchrl_asyncpool import SetupRefused
        >>> from torchrl_asyncpool.evaluation import Episode, evaluate
        >>> make = functools.partial(gym.make_vec, "CartPole-v1", num_envs=2, vectorization_mode="vector_entry_point")
        >>> try:
        ...     evaluate(make, lambda td: td, [Episode("a", seed=0)], num_envs=1, progress=False)
        ... except SetupRefused as exc:
        ...     print(str(exc).split(";")[0])
        evaluate() runs one episode per env at a time and needs single envs
    """


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


def error_summary(exc: BaseException) -> str:
    r"""``"<type>: <first line of its message>"``: one line naming an error inside another message.

    Examples:
        >>> from torchrl_asyncpool.errors import error_summary
        >>> error_summary(ValueError("bad shape\nmore detail"))
        'ValueError: bad shape'
        >>> error_summary(RuntimeError())
        'RuntimeError: (no message)'
    """
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else '(no message)'}"
