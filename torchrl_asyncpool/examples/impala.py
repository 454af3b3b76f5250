"""IMPALA's learner step: V-trace targets and the actor-critic loss on one collector batch.

Central asynchronous inference is IMPALA's natural setting: the collector keeps stepping the
envs while the learner trains, so a batch holds transitions of older policy versions. Each
transition carries the behaviour log-probability ``"sample_log_prob"`` that the acting policy
wrote (:class:`~torchrl_asyncpool.examples.actor_critic.ActorCritic`); V-trace corrects for the
lag with the importance ratios ``pi_learner(a|s) / mu_behaviour(a|s)``, truncated at ``rho_bar``
(the targets and the policy gradient) and ``c_bar`` (the traces).

The batch must be grouped by env (:func:`~torchrl_asyncpool.examples.batches.group_by_env`):
V-trace runs along each env's run, cut at episode ends and at the run's end (bootstrapping from
the value of the next observation). Used by ``sota-implementations/impala_cartpole.py`` and by
the ``torchrl-asyncpool demo`` command.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from tensordict import TensorDict
from torchrl.objectives.value.functional import vtrace_advantage_estimate

from torchrl_asyncpool.examples.batches import normalize, segment_ends

__all__ = ["impala_update", "vtrace_step"]


def impala_update(agent: nn.Module, optim: torch.optim.Optimizer, batch: TensorDict, *, gamma: float,
                  rho_bar: float = 1.0, c_bar: float = 1.0, vf_coef: float = 0.5, ent_coef: float = 0.01,
                  max_grad_norm: float = 0.5, normalize_advantage: bool = True) -> dict:
    """One gradient step of ``agent`` (``.actor`` logits, ``.critic`` value) on a grouped ``batch``.

    Returns ``{"loss", "loss_policy", "loss_value", "entropy", "rho_mean", "rho_clipped_frac"}``
    as floats (``rho``: the importance ratios, clipped where above ``rho_bar``).
    """
    ends = segment_ends(batch)
    behaviour_log_prob = batch["sample_log_prob"].unsqueeze(-1)
    dist = torch.distributions.Categorical(logits=agent.actor(batch["observation"]))
    log_pi = dist.log_prob(batch["action"]).unsqueeze(-1)
    value = agent.critic(batch["observation"])
    with torch.no_grad():
        next_value = agent.critic(batch["next", "observation"])
    return vtrace_step(optim, agent.parameters(), dist, log_pi, behaviour_log_prob, value, next_value,
                       batch["next", "reward"], ends, batch["next", "terminated"], gamma=gamma, rho_bar=rho_bar,
                       c_bar=c_bar, vf_coef=vf_coef, ent_coef=ent_coef, max_grad_norm=max_grad_norm,
                       normalize_advantage=normalize_advantage)


def vtrace_step(optim: torch.optim.Optimizer, params, dist, log_pi, behaviour_log_prob, value, next_value, reward,
                ends, terminated, *, gamma: float, rho_bar: float, c_bar: float, vf_coef: float, ent_coef: float,
                max_grad_norm: float, normalize_advantage: bool) -> dict:
    """V-trace targets along the batch (cut at ``ends``), the actor-critic loss and one optimizer
    step over ``params``: the part of an IMPALA update that does not depend on the network.

    ``log_pi`` and ``value`` carry gradients; ``next_value`` (the value of each next
    observation), ``behaviour_log_prob``, ``reward``, ``ends`` and ``terminated`` are ``[N, 1]``.
    Returns ``{"loss", "loss_policy", "loss_value", "entropy", "rho_mean", "rho_clipped_frac"}``.
    """
    with torch.no_grad():
        # NB: TorchRL's argument names are swapped w.r.t. its docstring: the ratio is
        # exp(log_pi - log_mu), so log_pi is the learner and log_mu the behaviour policy.
        pg_adv, vs = vtrace_advantage_estimate(
            gamma, log_pi.detach()[None], behaviour_log_prob[None], value.detach()[None], next_value[None],
            reward[None], ends[None], terminated[None], rho_thresh=rho_bar, c_thresh=c_bar,
        )
        pg_adv, vs = pg_adv[0], vs[0]
        rho = (log_pi - behaviour_log_prob).exp()
        if normalize_advantage:
            pg_adv = normalize(pg_adv)
    loss_pi = -(log_pi * pg_adv).mean()
    loss_v = 0.5 * (value - vs).pow(2).mean()
    entropy = dist.entropy().mean()
    loss = loss_pi + vf_coef * loss_v - ent_coef * entropy
    optim.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(params, max_grad_norm)
    optim.step()
    stats = torch.stack([loss.detach(), loss_pi.detach(), loss_v.detach(), entropy.detach(), rho.mean(),
                         (rho > rho_bar).float().mean()]).tolist()
    return dict(zip(("loss", "loss_policy", "loss_value", "entropy", "rho_mean", "rho_clipped_frac"), stats))
