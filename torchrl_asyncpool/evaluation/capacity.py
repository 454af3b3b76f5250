"""``check_capacity``: build and reset every env an evaluation would run at once, step none.

Before spending policy calls (or moving a robot), it answers "can this machine hold ``num_envs``
of these simulators at once, and how long do they take to come up and go away": each slot's env
is built in its worker and reset with the seed and options of the episode it would run first,
then the pool is closed. Nothing is stepped.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

from torchrl_asyncpool.evaluation.episodes import Episode, PlannedEnvFactory, check_episode_set
from torchrl_asyncpool.pool.env_pool import close_noting
from torchrl_asyncpool.pool.env_pool import AsyncEnvPool

__all__ = ["check_capacity"]


def check_capacity(
    create_env_fn: Callable,
    episodes: Sequence[Episode],
    *,
    num_envs: int = 8,
    envs_per_worker: int | str = "auto",
    env_threads: bool | str = "auto",
    timeout_s: Optional[float] = None,
    create_env_kwargs: Optional[dict] = None,
    close_timeout_s: float = 10.0,
) -> dict:
    """Builds ``min(num_envs, len(episodes))`` envs in workers, resets each with the seed of the
    episode its slot would run first, waits for every first record and closes the pool.

    Args:
        create_env_fn (callable): builds one env, as for :func:`~torchrl_asyncpool.evaluation.evaluate`.
        episodes (sequence of Episode): the manifest; slot ``s`` is reset for ``episodes[s]``.

    Keyword Args:
        num_envs (int): envs at once. Defaults to 8.
        envs_per_worker (int or "auto", optional): envs per worker process, as in
            :class:`~torchrl_asyncpool.AsyncEnvPool`. Defaults to ``"auto"``.
        env_threads (bool or "auto", optional): one thread per env in a worker, as in
            :class:`~torchrl_asyncpool.AsyncEnvPool`. Defaults to ``"auto"``.
        timeout_s (float, optional): limit for building and resetting them all
            (:class:`TimeoutError` past it). Defaults to ``None``.
        create_env_kwargs (dict, optional): keyword arguments for ``create_env_fn``.
        close_timeout_s (float): seconds the workers get to close their envs before they are
            killed (``close_s`` measures it). Defaults to ``10.0``, as for ``evaluate``.

    Returns:
        dict: ``{"envs", "workers", "start_s", "close_s"}``: how many envs were up at once, in how
        many worker processes, the seconds from the start to the last first record, and the
        seconds ``close()`` took.

    Raises:
        EnvError: an env raised while being built or reset (names the env, with its traceback).
        WorkerDiedError: a worker died while building or resetting.
        TimeoutError: past ``timeout_s``.
        Exception: what closing the pool raised, when nothing else failed (after another
            error, a failure to close is added to that error's notes and warned about, never
            raised in its place).

    Examples:
        >>> import gymnasium as gym
        >>> from torchrl_asyncpool.evaluation import Episode, check_capacity
        >>> report = check_capacity(lambda: gym.make("CartPole-v1"), [Episode(f"e{i}", seed=i) for i in range(4)],
        ...                         num_envs=2)
        >>> report["envs"]
        2
    """
    episodes = check_episode_set(episodes, num_envs, "check")
    n = min(num_envs, len(episodes))
    fns = [PlannedEnvFactory(create_env_fn, [(ep.seed, None, ep.options)]) for ep in episodes[:n]]
    if not (isinstance(close_timeout_s, (int, float)) and 0 <= close_timeout_s < math.inf):
        raise ValueError(f"close_timeout_s must be a finite number >= 0, got {close_timeout_s!r}.")
    t0 = time.monotonic()
    pool = AsyncEnvPool(fns, create_env_kwargs=create_env_kwargs, envs_per_worker=envs_per_worker,
                        env_threads=env_threads, start_timeout=timeout_s)
    try:
        remaining = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))
        ready = pool.wait_ready(n, timeout=remaining)
        if ready < n:
            raise TimeoutError(f"{ready} of {n} envs had published their first record after timeout_s={timeout_s}s.")
        start_s = time.monotonic() - t0
        workers = pool.num_workers
    except BaseException as exc:
        close_noting(pool, close_timeout_s, exc)  # never raises: the first error is the one to see
        raise
    t1 = time.monotonic()
    pool.close(close_timeout_s)  # the check's own question: a failure to close is its result
    close_s = time.monotonic() - t1
    return {"envs": n, "workers": workers, "start_s": start_s, "close_s": close_s}
