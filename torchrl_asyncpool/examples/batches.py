"""A collector batch as the learners of the examples read it.

A batch of :class:`~torchrl_asyncpool.AsyncPoolCollector` is a concatenation of per-env runs of
consecutive transitions; sorting it by ``"env_index"`` (stably) makes each env's run one
contiguous, time-ordered segment, along which advantages are computed.
"""
from __future__ import annotations

import torch
from tensordict import TensorDict

__all__ = ["group_by_env", "segment_ends", "normalize", "EpisodeTracker"]


def group_by_env(batch: TensorDict) -> TensorDict:
    """Stable sort by env index: each env's transitions become one contiguous, time-ordered run."""
    order = torch.sort(batch["env_index"], stable=True).indices
    return batch[order]


def segment_ends(batch: TensorDict) -> torch.Tensor:
    """``[N, 1]`` bool: the transition ends an episode or its env's run in this (grouped) batch."""
    env = batch["env_index"]
    last_of_env = torch.ones_like(env, dtype=torch.bool)
    last_of_env[:-1] = env[1:] != env[:-1]
    return batch["next", "done"] | last_of_env.unsqueeze(-1)


def normalize(adv: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit std; a batch of one (the last one, when total_frames is not a multiple of
    frames_per_batch, or a minibatch of one) is only centred, as its std is undefined (NaN, which
    would reach the weights)."""
    if adv.numel() < 2:
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std() + 1e-8)


class EpisodeTracker:
    """Running per-env return; :meth:`update` returns the returns of the episodes a batch completes.

    Walking a batch in order visits each env's transitions in time order (grouped or not: a
    batch is a concatenation of per-env runs of consecutive transitions).
    """

    def __init__(self, num_envs: int):
        self.running = [0.0] * num_envs

    def update(self, batch: TensorDict) -> list[float]:
        finished = []
        rewards = batch["next", "reward"].flatten().tolist()
        dones = batch["next", "done"].flatten().tolist()
        for env, r, d in zip(batch["env_index"].tolist(), rewards, dones):
            self.running[env] += r
            if d:
                finished.append(self.running[env])
                self.running[env] = 0.0
        return finished
