"""Env restarts inside a worker: the budget a pool gives them (:class:`RestartPolicy`), the one
check of its arguments that the pool, the collector and ``evaluate()`` share
(:func:`check_restart_budget`), and the error that carries a failure past the budget."""
from __future__ import annotations

import collections
import math
import time

__all__ = ["RestartPolicy", "DeferredEnvError", "check_restart_budget"]


def check_restart_budget(max_restarts_per_env, restart_window_s, max_restarts) -> None:
    """Refuses (``ValueError``, naming the argument and the value) a restart budget that is not
    one: ``max_restarts_per_env`` an int >= 1, ``restart_window_s`` a number of seconds > 0
    (``math.inf``: counted over the whole run), ``max_restarts`` ``None`` (no overall limit) or an
    int >= 0 (``0``: the first failure is raised, with its history).

    Examples:
        >>> from torchrl_asyncpool.workers.restarts import check_restart_budget
        >>> check_restart_budget(3, 60.0, None)
        >>> check_restart_budget(0, 60.0, None)
        Traceback (most recent call last):
        ...
        ValueError: max_restarts_per_env must be a positive int (>= 1), got 0.
    """
    per_env, window_s, total = max_restarts_per_env, restart_window_s, max_restarts
    if isinstance(per_env, bool) or not isinstance(per_env, int) or per_env < 1:
        raise ValueError(f"max_restarts_per_env must be a positive int (>= 1), got {per_env!r}.")
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or math.isnan(window_s) or window_s <= 0:
        raise ValueError(f"restart_window_s must be a number of seconds > 0 (math.inf: the whole run), "
                         f"got {window_s!r}.")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise ValueError(f"max_restarts must be None or an int >= 0, got {total!r}.")


class RestartPolicy:
    """What a worker does when one of its envs raises (``AsyncEnvPool(on_env_failure="restart")``).

    The env is closed and rebuilt from its factory (its ``r``-th rebuild first resets with seed
    ``seed + i + r * num_envs`` when the pool was seeded with ``seed``: env ``i``'s seeds never
    collide with another env's), at most ``per_env`` times per env within ``window_s`` seconds
    and ``total`` times in the whole pool; past that budget the failure is raised as without
    restarts, with the restart history in its text.

    Args:
        per_env (int): rebuilds allowed per env within ``window_s``.
        window_s (float): the window of ``per_env``, in seconds.
        total (int or None): rebuilds allowed over the pool's life, all envs together.
    """

    def __init__(self, per_env: int, window_s: float, total):
        self.per_env, self.window_s, self.total = per_env, window_s, total

    def budget(self, arena, num_slots):
        """A worker's own tracker of this policy (not shared between processes)."""
        return _RestartBudget(self, arena, num_slots)


class _RestartBudget:
    def __init__(self, policy, arena, num_slots):
        self.policy, self.arena, self.num_slots = policy, arena, num_slots
        self._times = {}  # env index -> deque of recent rebuild times
        self.history = {}  # env index -> [(phase, last line of the traceback)]

    def admit(self, index, phase, tb):
        """Counts a failure of env ``index``; raises :class:`DeferredEnvError` past the budget."""
        now = time.monotonic()
        recent = self._times.setdefault(index, collections.deque())
        while recent and now - recent[0] > self.policy.window_s:
            recent.popleft()
        cause = next((line for line in reversed(tb.strip().splitlines()) if line.strip()), "?").strip()
        history = self.history.setdefault(index, [])
        history.append((phase, cause))
        total = int(self.arena.restarts.sum())  # every worker's rebuilds, read from the arena
        over = len(recent) >= self.policy.per_env and "per_env"
        over = over or (self.policy.total is not None and total >= self.policy.total and "total")
        if over:
            what = (f"env {index} was rebuilt {len(recent)} times within {self.policy.window_s:g}s "
                    f"(max_restarts_per_env={self.policy.per_env})" if over == "per_env"
                    else f"the pool's envs were rebuilt {total} times (max_restarts={self.policy.total})")
            # the failure above is the last one: the history lists the ones before it
            shown = "; ".join(f"{p}: {c}" for p, c in history[-11:-1]) or "none"
            raise DeferredEnvError(f"{tb}\nrestart budget exhausted: {what}; env {index}'s earlier failures: {shown}")
        recent.append(now)
        return int(self.arena.restarts[index]) + 1


class DeferredEnvError(Exception):
    """A failure that happened while the slot belonged to the consumer; carries its traceback."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb
