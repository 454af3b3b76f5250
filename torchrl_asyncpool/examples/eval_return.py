"""The evaluation a training script runs at its end: the mean return of a few seeded episodes.

Every script of ``sota-implementations/`` evaluates its final policy the same way, through
:func:`torchrl_asyncpool.evaluation.evaluate` (deterministic or greedy actions, one env per
episode, at most four at once), on episodes seeded apart from the training envs' seeds
(``10_000 + seed + i``), so that two runs of a script with the same ``--seed`` evaluate on the
same episodes whichever collector trained them.
"""
from __future__ import annotations

import copy
from typing import Callable

__all__ = ["mean_eval_return"]


def mean_eval_return(create_env_fn: Callable, policy: Callable, *, episodes: int, seed: int,
                     max_steps: int, num_envs: int = 4) -> float:
    """The mean return of ``episodes`` evaluation episodes of ``policy``.

    Episode ``i`` is reset with seed ``10_000 + seed + i`` and cut after ``max_steps`` steps
    (an episode the env ends itself at that step counts as completed). ``policy`` is copied
    first, so the training copy is never touched by the evaluation's process.

    Args:
        create_env_fn (callable): builds one env, as :func:`~torchrl_asyncpool.evaluation.evaluate`
            takes it (a picklable factory: the envs run in worker processes).
        policy (callable): ``TensorDict -> TensorDict`` writing the action.

    Keyword Args:
        episodes (int): how many episodes, >= 1.
        seed (int): the run's seed; the episodes' seeds follow from it.
        max_steps (int): steps after which an episode is cut, >= 1.
        num_envs (int): envs run at once, at most one per episode. Defaults to 4.

    Returns:
        float: the mean of the episodes' returns.

    Raises:
        ValueError: ``episodes`` or ``max_steps`` below 1.
        RuntimeError: an episode failed (its env raised): the message names it and the cause,
            instead of a mean that silently counts a failed episode's partial return.

    Examples:
        >>> import gymnasium as gym
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_asyncpool.examples.eval_return import mean_eval_return
        >>> def make_env():
        ...     return gym.make("CartPole-v1")
        >>> policy = TensorDictModule(lambda obs: (obs[..., 2] > 0).long(),
        ...                           in_keys=["observation"], out_keys=["action"])
        >>> mean_eval_return(make_env, policy, episodes=2, seed=0, max_steps=500) > 9
        True
    """
    from torchrl_asyncpool.evaluation import Episode, evaluate

    if episodes < 1 or max_steps < 1:
        raise ValueError(f"episodes and max_steps must be >= 1, got episodes={episodes}, max_steps={max_steps}.")
    planned = [Episode(f"eval-{i}", seed=10_000 + seed + i, max_steps=max_steps) for i in range(episodes)]
    results = evaluate(create_env_fn, copy.deepcopy(policy), planned, num_envs=min(episodes, num_envs))
    failed = [r for r in results if r.status == "failed"]
    if failed:
        raise RuntimeError(f"evaluation episode {failed[0].episode_id!r} (seed {failed[0].seed}, env slot "
                           f"{failed[0].env_index}) failed: {failed[0].error}; {len(failed)} of {episodes} failed.")
    return sum(r.episode_return for r in results) / len(results)
