"""The actor-critic of the PPO and IMPALA examples: two MLPs over a flat observation, a
categorical action."""
from __future__ import annotations

import torch
import torch.nn as nn
from tensordict import TensorDict

__all__ = ["mlp", "ActorCritic"]


def mlp(n_in: int, n_out: int, hidden: int, out_std: float) -> nn.Sequential:
    """Two tanh layers of ``hidden`` units, orthogonal initialisation (gain ``out_std`` on the last)."""
    net = nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                        nn.Linear(hidden, n_out))
    for layer in net:
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, 2 ** 0.5)
            nn.init.zeros_(layer.bias)
    nn.init.orthogonal_(net[-1].weight, out_std)
    return net


class ActorCritic(nn.Module):
    """Actor and critic. ``forward`` is the acting policy (``TensorDict -> TensorDict``): it
    samples ``"action"`` and writes its log-probability ``"sample_log_prob"`` (the behaviour
    policy's, which the learner's importance ratios divide by)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()
        self.actor = mlp(obs_dim, n_actions, hidden, out_std=0.01)
        self.critic = mlp(obs_dim, 1, hidden, out_std=1.0)

    def forward(self, td: TensorDict) -> TensorDict:
        dist = torch.distributions.Categorical(logits=self.actor(td["observation"]))
        action = dist.sample()
        td.set("action", action)
        td.set("sample_log_prob", dist.log_prob(action))
        return td
