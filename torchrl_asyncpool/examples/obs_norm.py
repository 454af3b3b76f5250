"""A running observation normaliser that lives in the model (``ppo_mujoco.py``).

TorchRL's PPO MuJoCo recipe normalises observations with a ``VecNorm`` transform in its single
env. With many envs stepped in worker processes, a per-env ``VecNorm`` would give each env its
own statistics; here the statistics are buffers of the policy and critic, updated by the learner
from each batch and shipped to the acting copy with the weights
(``collector.update_policy_weights_(actor.state_dict())``). The batches store raw observations,
so the PPO ratio ``pi_new(a|s) / mu(a|s)`` stays exact when the statistics move: the
normaliser is part of the policy function.
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RunningObsNorm"]


class RunningObsNorm(nn.Module):
    """``clamp((x - mean) / sqrt(var + eps), -clip, clip)`` with running (exact, Chan et al.)
    mean and variance over every observation given to :meth:`update`."""

    def __init__(self, dim: int, eps: float = 1e-2, clip: float = 10.0):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.zeros(()))
        self.eps, self.clip = eps, clip

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.mean.dtype)
        n, mean, var = x.shape[0], x.mean(0), x.var(0, unbiased=False)
        total = self.count + n
        delta = mean - self.mean
        m2 = self.var * self.count + var * n + delta.pow(2) * self.count * n / total
        self.mean += delta * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / (self.var + self.eps).sqrt()).clamp(-self.clip, self.clip)
