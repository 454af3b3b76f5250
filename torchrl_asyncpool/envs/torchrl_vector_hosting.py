"""TorchRL's ``GymEnv(env_id, num_envs=k)`` built inside a pool worker.

``GymEnv`` builds its ``k`` envs as a gymnasium ``AsyncVectorEnv``, whose sub-processes a pool
worker (a daemonic process) may not start: the factory fails with "daemonic processes are not
allowed to have children". In a daemonic process, and only there (anywhere else TorchRL's own
behaviour is kept), :func:`install` makes ``GymEnv`` build a ``SyncVectorEnv`` of the same env
factories instead: the same envs, seeded the same way (sub-env ``j`` with ``seed + j``), in the
same ``NEXT_STEP`` autoreset mode, so the same records; the worker then hosts them as ``k``
slots (:class:`~torchrl_asyncpool.envs.torchrl_fast.adapters.TorchRLGymVectorFastAdapter`), each
sub-env stepped on its own when nothing on top needs the lockstep
(:meth:`~torchrl_asyncpool.envs.torchrl_fast.adapters.TorchRLGymVectorFastAdapter.split`).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import threading

__all__ = ["install", "in_daemonic_process", "synchronous_vector_envs"]

_ORIGINAL = "_torchrl_asyncpool_original_async_env"
_local = threading.local()


@contextlib.contextmanager
def synchronous_vector_envs():
    """Inside this context, in any process, ``GymEnv(..., num_envs=k)`` builds a
    ``SyncVectorEnv`` (the same records as its ``AsyncVectorEnv``): for an env built only to
    read its specs, where starting ``k`` processes costs seconds for nothing.

    Examples:
        >>> from torchrl_asyncpool.envs.torchrl_vector_hosting import synchronous_vector_envs
        >>> with synchronous_vector_envs():
        ...     pass
    """
    install()
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def in_daemonic_process() -> bool:
    """True in a process that multiprocessing forbids to start children (a pool worker).

    Returns:
        ``multiprocessing.current_process().daemon``.
    """
    return bool(multiprocessing.current_process().daemon)


def install() -> None:
    """Makes TorchRL's ``GymEnv(..., num_envs=k)`` build a ``SyncVectorEnv`` in daemonic
    processes (where its ``AsyncVectorEnv`` cannot start). Idempotent.

    Examples:
        >>> from torchrl_asyncpool.envs.torchrl_vector_hosting import install
        >>> install(); install()  # the second call changes nothing
    """
    try:
        from torchrl.envs.libs.gym import GymEnv
    except ImportError:  # pragma: no cover - torchrl is a dependency
        return
    if getattr(GymEnv, _ORIGINAL, None) is not None:
        return
    original = GymEnv._async_env

    def _async_env(self, *args, **kwargs):
        if in_daemonic_process() or getattr(_local, "depth", 0):
            from torchrl.envs.libs.gym import gym_backend

            # the backend TorchRL would have taken AsyncVectorEnv from (gymnasium, or gym)
            return gym_backend("vector").SyncVectorEnv(*args, **kwargs)
        return original(self, *args, **kwargs)

    _async_env.__doc__ = original.__doc__
    setattr(GymEnv, _ORIGINAL, original)
    GymEnv._async_env = _async_env
