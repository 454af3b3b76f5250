"""``AsyncEnvPool(seed=...)`` and ``AsyncPoolCollector(seed=...)``: env ``i``'s first reset gets
``seed + i``, later resets continue its own stream; vector and batched envs seed their sub-envs.

The envs here draw their observation from their own random generator at every reset, so each
test compares what the pool delivered with the same env reset in this process.
"""
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase, SerialEnv

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool.testing._specs import _done_spec


class _RandomReset(gym.Env):
    """Observation: one draw of ``np_random`` at reset (``int64 [1]``); every step truncates."""

    observation_space = gym.spaces.Box(0, 2**31, (1,), np.int64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.integers(0, 2**31, size=1), {}

    def step(self, action):
        return np.zeros(1, np.int64), 0.0, False, True, {}


class _RandomResetTorchRL(EnvBase):
    """The TorchRL counterpart: ``set_seed`` seeds a generator that each reset draws from."""

    def __init__(self):
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(observation=Unbounded(shape=(1,), dtype=torch.int64))
        self.action_spec = Categorical(2, shape=(), dtype=torch.int64)
        self.reward_spec = Unbounded(shape=(1,), dtype=torch.float32)
        self.done_spec = _done_spec()
        self._gen = torch.Generator()

    def _set_seed(self, seed):
        self._gen.manual_seed(int(seed))

    def _reset(self, tensordict=None, **kwargs):
        obs = torch.randint(0, 2**31, (1,), generator=self._gen)
        false = torch.zeros(1, dtype=torch.bool)
        return TensorDict({"observation": obs, "done": false, "terminated": false, "truncated": false}, [])

    def _step(self, tensordict):
        true = torch.ones(1, dtype=torch.bool)
        return TensorDict({"observation": torch.zeros(1, dtype=torch.int64), "reward": torch.zeros(1),
                           "done": true, "terminated": torch.zeros(1, dtype=torch.bool), "truncated": true}, [])


def _serial_random_reset():
    return SerialEnv(2, _RandomResetTorchRL)


def _gym_vector():
    return gym.vector.SyncVectorEnv([_RandomReset] * 2)


def _first_records(pool) -> dict:
    """``{env index: observation of its first record}``."""
    ready = pool.recv(min_get=pool.num_envs)
    return {int(i): int(ready["observation"][k].reshape(-1)[0]) for k, i in enumerate(ready.env_indices.tolist())}


def _local_gym(seed: int, resets: int = 1) -> list:
    env = _RandomReset()
    return [int(env.reset(seed=seed if r == 0 else None)[0][0]) for r in range(resets)]


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_gymnasium_envs_get_seed_plus_index_and_keep_their_stream(envs_per_worker, env_threads):
    with AsyncEnvPool([_RandomReset] * 4, envs_per_worker=envs_per_worker, env_threads=env_threads, seed=10) as pool:
        first = _first_records(pool)
        assert first == {i: _local_gym(10 + i)[0] for i in range(4)}
        # every step truncates: the next record is each env's second reset, which continues
        # its own stream instead of being seeded again
        pool.send(TensorDict({"action": torch.zeros(4, dtype=torch.int64)}, [4]), torch.arange(4))
        pool.recv(min_get=4)  # the truncated records
        pool.send(TensorDict({"action": torch.zeros(4, dtype=torch.int64)}, [4]), torch.arange(4))
        second = _first_records(pool)
    assert second == {i: _local_gym(10 + i, resets=2)[1] for i in range(4)}
    assert second != first


def test_unseeded_pools_differ():
    with AsyncEnvPool([_RandomReset] * 2) as a, AsyncEnvPool([_RandomReset] * 2) as b:
        assert _first_records(a) != _first_records(b)


def test_gymnasium_vector_envs_seed_their_sub_envs_like_their_slots():
    with AsyncEnvPool([_gym_vector] * 2, seed=20) as pool:
        assert pool.num_envs == 4
        assert _first_records(pool) == {i: _local_gym(20 + i)[0] for i in range(4)}


def test_torchrl_envs_get_set_seed_before_their_first_reset():
    def local(seed):
        env = _RandomResetTorchRL()
        env.set_seed(seed)
        return int(env.reset()["observation"][0])

    with AsyncEnvPool([_RandomResetTorchRL] * 3, envs_per_worker=3, seed=5) as pool:
        assert _first_records(pool) == {i: local(5 + i) for i in range(3)}


def test_batched_torchrl_envs_seed_their_sub_envs_as_torchrl_does():
    def local(seed):
        env = _serial_random_reset()
        env.set_seed(seed)
        return env.reset()["observation"][:, 0].tolist()

    with AsyncEnvPool([_serial_random_reset] * 2, seed=7) as pool:
        first = _first_records(pool)
    assert [first[i] for i in range(4)] == local(7) + local(9)  # the second factory's first slot is 2


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_bad_seeds_are_refused_before_any_env_is_built(seed):
    built = []

    def factory():
        built.append(1)
        return _RandomReset()

    with pytest.raises(ValueError, match="seed must be None or a non-negative int"):
        AsyncEnvPool([factory], seed=seed)
    assert not built


def _greedy(td):
    # a deterministic policy: the env's trajectory then depends on its seed alone
    return td.set("action", (td["observation"][..., 2] > 0).long())


def _per_env_observations(collector) -> dict:
    out = {}
    for batch in collector:
        for e, obs in zip(batch["env_index"].tolist(), batch["observation"]):
            out.setdefault(e, []).append(obs.tolist())
    return out


def test_collector_seed_makes_each_envs_trajectory_reproducible():
    runs = []
    for _ in range(2):
        c = AsyncPoolCollector([lambda: gym.make("CartPole-v1")] * 3, policy=_greedy, frames_per_batch=60,
                               total_frames=180, seed=3)
        try:
            runs.append(_per_env_observations(c))
        finally:
            c.shutdown()
    a, b = runs
    assert set(a) == set(b) == {0, 1, 2}
    for e in a:  # batches mix envs in timing order; each env's own sequence is fixed
        n = min(len(a[e]), len(b[e]))
        assert n > 10 and a[e][:n] == b[e][:n], e
    assert a[0][0] == list(gym.make("CartPole-v1").reset(seed=3)[0].tolist())
    assert a[0][0] != a[1][0]


def test_collector_set_seed_warns_that_it_seeds_nothing():
    c = AsyncPoolCollector([_RandomReset], policy=lambda td: td.set("action", td["observation"][..., 0] * 0),
                           frames_per_batch=4, total_frames=4)
    try:
        with pytest.warns(UserWarning, match="Pass seed= to AsyncPoolCollector"):
            assert c.set_seed(5) == 5
    finally:
        c.shutdown()


class _NoSeedArgument(_RandomReset):
    def reset(self):  # an env that predates gymnasium's reset(seed=, options=)
        return np.zeros(1, np.int64), {}


def test_unseeded_pools_call_reset_without_a_seed_argument():
    with AsyncEnvPool([_NoSeedArgument] * 2, envs_per_worker=2) as pool:
        assert _first_records(pool) == {0: 0, 1: 0}
