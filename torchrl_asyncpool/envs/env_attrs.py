"""What the pool and the evaluation tell an env through attributes, and the request keys an
env may not use: shared by every adapter of :mod:`torchrl_asyncpool.envs`."""
from __future__ import annotations

import torch

__all__ = ["RESERVED_KEYS", "EPISODE_PLAN_ATTR", "FIRST_SEED_ATTR", "EpisodePlan", "own_attr", "plan_of",
           "env_where", "torch_dtype"]

#: Request keys the exchange defines itself; an env observation may not use them.
RESERVED_KEYS = ("reward", "step_type", "done", "terminated", "truncated", "env_index")

#: Attribute an env may carry to fix its episodes: a sequence of ``(seed, max_steps, options)``,
#: one per reset, in order (set by :mod:`torchrl_asyncpool.evaluation`). Each reset takes the
#: next entry: the env is reset with that seed (and, for a gymnasium env, those reset options),
#: and its episode is truncated after ``max_steps`` steps unless it ends first. Resets past the
#: end of the plan are unseeded and unlimited.
EPISODE_PLAN_ATTR = "_torchrl_asyncpool_episode_plan"

#: Attribute an env may carry to seed its first reset (set by ``AsyncEnvPool(seed=...)``): a
#: gymnasium env is reset with ``seed=`` once (a vector env seeds its sub-envs from it, as
#: gymnasium does), a TorchRL env gets ``set_seed`` before its first reset; later resets continue
#: the env's own random stream. An episode plan, where there is one, takes precedence.
FIRST_SEED_ATTR = "_torchrl_asyncpool_first_seed"


class EpisodePlan:
    """The per-reset (seed, step limit) of an env that carries :data:`EPISODE_PLAN_ATTR`."""

    def __init__(self, plan):
        self.plan = list(plan)
        self.episode = -1
        self.limit = None
        self.t = 0

    def next_reset(self):
        """``(seed, options)`` of the next episode; sets its step limit."""
        self.episode += 1
        seed, self.limit, options = self.plan[self.episode] if self.episode < len(self.plan) else (None, None, None)
        self.t = 0
        return seed, options

    def cut(self, truncated: bool = False) -> bool:
        """Counts a step; True when it reaches the episode's step limit.

        ``truncated``: the env truncated the episode itself at this step. When that step is also
        the limit's, the plan's entry is told (its ``ended_by_env()``, where it has one): the
        env's own end, not the plan's cut, ended the episode (the evaluation reports it
        completed, not timed out)."""
        self.t += 1
        at_limit = self.limit is not None and self.t >= self.limit
        if at_limit and truncated:
            note = getattr(self.plan[self.episode], "ended_by_env", None)
            if note is not None:
                note()
        return at_limit


def own_attr(env, name):
    """``env``'s own instance attribute ``name`` (``None`` when it has none), not one found on
    its class or forwarded: batched TorchRL envs forward unknown attributes to their (possibly
    not yet built) sub-envs, which reading them would build."""
    try:
        return vars(env).get(name)
    except TypeError:  # no __dict__
        return None


def plan_of(env):
    """The fixed episode plan :func:`~torchrl_asyncpool.evaluation.evaluate` attached to ``env``
    (an :class:`EpisodePlan`), or ``None`` for an env without one."""
    plan = own_attr(env, EPISODE_PLAN_ATTR)
    return None if plan is None else EpisodePlan(plan)


def env_where(env_index) -> str:
    """How error messages name an env: ``"env 3"``, or ``"the env"`` when its index is unknown."""
    return f"env {env_index}" if env_index is not None else "the env"


def torch_dtype(np_dtype) -> torch.dtype:
    """The torch dtype of numpy dtype ``np_dtype`` (``TypeError`` for one torch lacks)."""
    import numpy as np

    return torch.from_numpy(np.zeros((), dtype=np_dtype)).dtype
