"""``ppo_mujoco.py``'s acting module and compiled loss: the collector's plain-torch ``TanhNormal``
draw must be the ``ProbabilisticActor``'s (the same action for the same random state, and the
log-prob the learner's ``ClipPPOLoss`` recomputes), and the compiled loss the eager one."""
from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded

from conftest import load_script


@pytest.fixture(scope="module")
def ppo():
    return load_script("ppo_mujoco")


def _models(ppo, low=-1.0, high=1.0, obs_dim=5, n_act=3):
    spec = Bounded(low=torch.full((n_act,), low), high=torch.full((n_act,), high), shape=(n_act,))
    torch.manual_seed(0)
    actor, critic, norm = ppo.make_ppo_models(obs_dim, spec, hidden=16, normalize_obs=True)
    norm.update(torch.randn(64, obs_dim) * 3 + 1)  # statistics away from (0, 1): they are part of the path
    return actor, critic, spec


@pytest.mark.parametrize("low, high", [(-1.0, 1.0), (-2.0, 0.5)])
def test_acting_draws_the_actors_action_and_log_prob(ppo, low, high):
    actor, _, spec = _models(ppo, low, high)
    acting = ppo.make_acting_policy(actor, spec)
    obs = TensorDict({"observation": torch.randn(32, 5) * 4}, [32])
    with torch.no_grad():
        torch.manual_seed(7)
        ref = actor(obs.clone())
        torch.manual_seed(7)
        out = acting(obs.clone())
        # the same random state -> the same action, inside [low, high]
        torch.testing.assert_close(out["action"], ref["action"])
        assert ((out["action"] >= low) & (out["action"] <= high)).all()
        # the log-prob the learner computes for that action under the same weights
        torch.testing.assert_close(out["action_log_prob"], ref["action_log_prob"], atol=2e-5, rtol=1e-5)
        dist = actor.get_dist(obs.clone())
        torch.testing.assert_close(out["action_log_prob"], dist.log_prob(out["action"]), atol=2e-5, rtol=1e-5)


def test_acting_log_prob_matches_at_saturated_actions(ppo):
    """Where tanh saturates to +-1 both clamp it the same way (TorchRL's safe tanh): the stored
    log-prob stays finite and equal to the learner's, so the PPO ratio is not NaN or inf."""
    actor, _, spec = _models(ppo)
    acting = ppo.make_acting_policy(actor, spec)
    with torch.no_grad():
        actor.module[0].module[1][-1].bias.fill_(30.0)  # loc ~ 30: tanh rounds to 1 in float32
        obs = TensorDict({"observation": torch.randn(16, 5)}, [16])
        out = acting(obs.clone())
        assert (out["action"].abs() > 0.999).all()
        assert torch.isfinite(out["action_log_prob"]).all()
        ref = actor.get_dist(obs.clone()).log_prob(out["action"])
        torch.testing.assert_close(out["action_log_prob"], ref, atol=1e-3, rtol=1e-4)


def test_acting_shares_the_actors_weights_and_ships_them_by_state_dict(ppo):
    actor, _, spec = _models(ppo)
    acting = ppo.make_acting_policy(actor, spec)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.5)
    # the collector's copy is loaded from acting.state_dict(): every parameter and buffer is in it
    names = set(acting.state_dict())
    assert {"module.half_range", "module.mid"} <= names
    net_params = {n for n in names if n.startswith("module.net.")}
    assert len(net_params) == len(actor.state_dict())
    for (_, a), (_, b) in zip(sorted(actor.state_dict().items()), sorted(
            (k, v) for k, v in acting.state_dict().items() if k.startswith("module.net."))):
        assert a.data_ptr() == b.data_ptr()


def test_compiled_loss_falls_back_to_eager_with_a_warning(ppo):
    calls = []

    class Loss(torch.nn.Module):
        tensor_keys = "the loss's keys"

        def forward(self, td):
            calls.append(td)
            return td

    loss = ppo.CompiledLoss(Loss())

    def failing(td):
        raise RuntimeError("no C++ compiler")

    loss._call = failing
    with pytest.warns(RuntimeWarning, match="torch.compile of the loss failed .*no C\\+\\+ compiler"):
        assert loss("batch") == "batch"
    assert loss.tensor_keys == "the loss's keys"  # attributes are the module's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loss("again") == "again"  # eager from then on, without warning again
    assert calls == ["batch", "again"]


@pytest.mark.slow
def test_compiled_loss_equals_the_eager_loss(ppo):
    from torchrl.objectives import ClipPPOLoss

    actor, critic, spec = _models(ppo)
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_bonus=False, critic_coeff=0.25,
                       loss_critic_type="l2", normalize_advantage=True, functional=False)
    with torch.no_grad():
        td = actor(TensorDict({"observation": torch.randn(64, 5)}, [64]))
    td["advantage"] = torch.randn(64, 1)
    td["value_target"] = torch.randn(64, 1)
    eager = loss(td.clone())
    compiled = ppo.CompiledLoss(loss)(td.clone())
    for key in ("loss_objective", "loss_critic", "kl_approx", "clip_fraction"):
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-5, rtol=1e-4)
