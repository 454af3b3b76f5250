"""mean_eval_return: the scripts' end-of-training evaluation (seeded episodes, a mean, failures raised)."""
import functools

import gymnasium as gym
import numpy as np
import pytest
import torch

from torchrl_asyncpool.evaluation import Episode, evaluate
from torchrl_asyncpool.examples.eval_return import mean_eval_return


class _SeedReturn(gym.Env):
    """Pays its reset seed once, then ends: the return of an episode is the seed it was given."""

    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, fail_seed=-1):
        self.fail_seed = fail_seed

    def reset(self, *, seed=None, options=None):
        self.seed_ = seed
        return np.zeros(1, np.float32), {}

    def step(self, action):
        if self.seed_ == self.fail_seed:
            raise RuntimeError("simulator lost")
        return np.zeros(1, np.float32), float(self.seed_ or 0), True, False, {}


def _zeros(td):
    return td.set("action", torch.zeros(td.batch_size[0], dtype=torch.int64))


def test_the_episodes_are_seeded_from_the_run_seed_and_averaged():
    # seeds 10_000 + 5 + i for i in 0..2 -> returns 10005, 10006, 10007
    assert mean_eval_return(_SeedReturn, _zeros, episodes=3, seed=5, max_steps=10) == pytest.approx(10006.0)


def test_it_matches_evaluate_on_the_same_episodes():
    episodes = [Episode(f"e{i}", seed=10_000 + 2 + i, max_steps=10) for i in range(4)]
    results = evaluate(_SeedReturn, _zeros, episodes, num_envs=4)
    expected = sum(r.episode_return for r in results) / 4
    assert mean_eval_return(_SeedReturn, _zeros, episodes=4, seed=2, max_steps=10, num_envs=2) == expected


def test_a_failed_episode_raises_with_its_name_and_cause():
    make = functools.partial(_SeedReturn, fail_seed=10_001)
    with pytest.raises(RuntimeError, match=r"(?s)'eval-1' \(seed 10001.*simulator lost.*1 of 3 failed"):
        mean_eval_return(make, _zeros, episodes=3, seed=0, max_steps=10)


@pytest.mark.parametrize("kwargs", [{"episodes": 0, "max_steps": 10}, {"episodes": 2, "max_steps": 0}])
def test_bad_counts_are_refused(kwargs):
    with pytest.raises(ValueError, match="must be >= 1"):
        mean_eval_return(_SeedReturn, _zeros, seed=0, **kwargs)


def test_the_training_policy_is_not_the_one_evaluated():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def forward(self, td):
            self.calls += 1
            return _zeros(td)

    policy = Counting()
    mean_eval_return(_SeedReturn, policy, episodes=2, seed=0, max_steps=10)
    assert policy.calls.item() == 0  # a copy acted
