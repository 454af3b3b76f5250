"""The Nature-DQN CNN actor-critic of ``impala_atari.py`` and its V-trace learner step.

:class:`NatureCNNActorCritic` is one torso (Mnih et al. 2015: conv 32x8x8/4, 64x4x4/2,
64x3x3/1, dense 512, ReLU) with a policy head (logits) and a value head, as in TorchRL's
``impala/utils.py``. :meth:`NatureCNNActorCritic.act` is the acting policy (observation ->
sampled action index and its log-probability ``"sample_log_prob"``); wrap it in a
``TensorDictModule`` to serve it from a collector.

:func:`impala_cnn_update` is :func:`torchrl_asyncpool.examples.impala.impala_update` for a
shared torso: one torso pass gives the logits and values of every observation; the value of
``("next", "observation")`` is the next row's value inside an env's run, and is computed only for
the transitions that end an episode or their env's run (a torso pass on those few rows), instead
of a second pass over the whole batch.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, exploration_type

from torchrl_asyncpool.examples.batches import segment_ends
from torchrl_asyncpool.examples.impala import vtrace_step

__all__ = ["NatureCNNActorCritic", "ActModule", "impala_cnn_update"]


class NatureCNNActorCritic(nn.Module):
    """``(..., 4, 84, 84)`` uint8 frames -> ``(logits, value)``; inputs are scaled by 1/255."""

    def __init__(self, n_actions: int, in_channels: int = 4):
        super().__init__()
        self.torso = nn.Sequential(
            nn.Conv2d(in_channels, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(),
        )
        self.policy_head = nn.Linear(512, n_actions)
        self.value_head = nn.Linear(512, 1)

    def heads(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = obs.shape[:-3]
        feats = self.torso(obs.reshape(-1, *obs.shape[-3:]).float() / 255.0)
        return self.policy_head(feats).reshape(*batch, -1), self.value_head(feats).reshape(*batch, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(obs)

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled action index and its log-probability (the behaviour policy's); the most
        likely action under TorchRL's ``ExplorationType.DETERMINISTIC`` or ``MODE`` (evaluation)."""
        logits, _ = self.heads(obs)
        dist = torch.distributions.Categorical(logits=logits)
        if exploration_type() in (ExplorationType.DETERMINISTIC, ExplorationType.MODE):
            action = logits.argmax(-1)
        else:
            action = dist.sample()
        return action, dist.log_prob(action)


class ActModule(nn.Module):
    """``NatureCNNActorCritic.act`` as a module's forward (for ``TensorDictModule``)."""

    def __init__(self, net: NatureCNNActorCritic):
        super().__init__()
        self.net = net

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net.act(obs)


def impala_cnn_update(net: NatureCNNActorCritic, optim: torch.optim.Optimizer, batch: TensorDict, *, gamma: float,
                      rho_bar: float = 1.0, c_bar: float = 1.0, vf_coef: float = 0.5, ent_coef: float = 0.01,
                      max_grad_norm: float = 40.0, clip_rewards: bool = True,
                      normalize_advantage: bool = False) -> dict:
    """One gradient step of ``net`` on a batch grouped by env
    (:func:`~torchrl_asyncpool.examples.batches.group_by_env`).

    Rewards are clipped to their sign when ``clip_rewards`` (as TorchRL's IMPALA recipe's
    ``SignTransform``). Returns ``{"loss", "loss_policy", "loss_value", "entropy", "rho_mean",
    "rho_clipped_frac"}`` as floats.
    """
    ends = segment_ends(batch)
    reward = batch["next", "reward"].float()
    if clip_rewards:
        reward = reward.sign()
    logits, value = net.heads(batch["observation"])
    dist = torch.distributions.Categorical(logits=logits)
    log_pi = dist.log_prob(batch["action"]).unsqueeze(-1)
    behaviour_log_prob = batch["sample_log_prob"].reshape(log_pi.shape)
    with torch.no_grad():
        # inside an env's run the next observation is the next row's observation
        next_value = torch.empty_like(value)
        next_value[:-1] = value[1:].detach()
        rows = ends.squeeze(-1).nonzero().squeeze(-1)
        if rows.numel():
            next_value[rows] = net.heads(batch["next", "observation"][rows])[1]
    return vtrace_step(optim, net.parameters(), dist, log_pi, behaviour_log_prob, value, next_value, reward, ends,
                       batch["next", "terminated"], gamma=gamma, rho_bar=rho_bar, c_bar=c_bar, vf_coef=vf_coef,
                       ent_coef=ent_coef, max_grad_norm=max_grad_norm, normalize_advantage=normalize_advantage)
