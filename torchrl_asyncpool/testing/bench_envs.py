"""Benchmark workloads: a zero-latency env and a slow env with pixel observations."""
from __future__ import annotations

import time

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl_asyncpool.testing._specs import _done_spec
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

__all__ = ["ZeroLatencyEnv", "SleepPixelEnv"]


class ZeroLatencyEnv(EnvBase):
    """An env whose step costs nothing but the framework: measures pure exchange overhead.

    A 4-float observation, 2 discrete actions, episodes truncated after ``episode_len``.

    Examples:
        >>> from torchrl_asyncpool.testing import ZeroLatencyEnv
        >>> env = ZeroLatencyEnv()
        >>> env.rollout(3)["next", "observation"].shape
        torch.Size([3, 4])
    """

    def __init__(self, episode_len: int = 200):
        super().__init__(batch_size=torch.Size([]))
        self.episode_len = episode_len
        self.observation_spec = Composite(observation=Unbounded(shape=(4,), dtype=torch.float32))
        self.action_spec = Categorical(2, shape=(), dtype=torch.int64)
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        self.done_spec = _done_spec()
        self._t = 0
        self._obs = torch.zeros(4)
        self._false = torch.zeros(1, dtype=torch.bool)
        self._true = torch.ones(1, dtype=torch.bool)
        self._reward = torch.ones(1)

    def _reset(self, tensordict=None, **kwargs):
        self._t = 0
        return TensorDict(
            {
                "observation": self._obs.clone(),
                "done": self._false,
                "terminated": self._false,
                "truncated": self._false,
            },
            batch_size=[],
        )

    def _step(self, tensordict: TensorDictBase):
        self._t += 1
        trunc = self._true if self._t >= self.episode_len else self._false
        return TensorDict(
            {
                "observation": self._obs + self._t,
                "reward": self._reward,
                "done": trunc,
                "terminated": self._false,
                "truncated": trunc,
            },
            batch_size=[],
        )

    def _set_seed(self, seed):
        return seed


class SleepPixelEnv(EnvBase):
    """An env whose step sleeps ``step_s`` seconds and returns 84x84x3 uint8 pixels and a 4-vector.

    Stands in for a slow simulator or game engine that releases the CPU while it works. The
    ideal throughput of ``N`` such envs is ``N / step_s`` transitions per second.

    Examples:
        >>> from torchrl_asyncpool.testing import SleepPixelEnv
        >>> env = SleepPixelEnv(step_s=0.0)
        >>> env.reset()["pixels"].shape
        torch.Size([84, 84, 3])
    """

    def __init__(self, step_s: float = 0.002, episode_len: int = 100):
        super().__init__(batch_size=torch.Size([]))
        self.step_s = step_s
        self.episode_len = episode_len
        self.observation_spec = Composite(
            pixels=Unbounded(shape=(84, 84, 3), dtype=torch.uint8),
            vector=Unbounded(shape=(4,), dtype=torch.float32),
        )
        self.action_spec = Categorical(4, shape=(), dtype=torch.int64)
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        self.done_spec = _done_spec()
        self._t = 0
        self._pixels = torch.zeros(84, 84, 3, dtype=torch.uint8)
        self._false = torch.zeros(1, dtype=torch.bool)
        self._true = torch.ones(1, dtype=torch.bool)

    def _frame(self):
        self._pixels.fill_(self._t % 256)
        return {"pixels": self._pixels, "vector": torch.full((4,), float(self._t))}

    def _reset(self, tensordict=None, **kwargs):
        self._t = 0
        return TensorDict(
            {**self._frame(), "done": self._false, "terminated": self._false, "truncated": self._false}, []
        )

    def _step(self, tensordict: TensorDictBase):
        if self.step_s:
            time.sleep(self.step_s)
        self._t += 1
        trunc = self._true if self._t >= self.episode_len else self._false
        return TensorDict(
            {**self._frame(), "reward": torch.ones(1), "done": trunc, "terminated": self._false, "truncated": trunc}, []
        )

    def _set_seed(self, seed):
        return seed
