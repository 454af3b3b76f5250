"""The pool's TorchRL specs: what an ``EnvBase`` of batch size ``[num_envs]`` would have.

Each kind of env a pool hosts is compared with the specs TorchRL itself gives the same env
(``GymEnv`` for gymnasium envs, the env's own specs for TorchRL envs), expanded to the pool's
batch size; the collector exposes them through ``collector.env``.
"""
import functools
import warnings

import gymnasium as gym
import pytest
import torch
from torchrl.data import Binary, Categorical, Composite, MultiCategorical, Unbounded
from torchrl.envs import GymEnv, SerialEnv

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool.testing import OracleEnv
from torchrl_asyncpool.envs.gymnasium_adapters import GymnasiumEnvAdapter
from torchrl_asyncpool.envs.specs import SPEC_GROUPS, _checked, batched_specs, slot_specs

N = 3


def _expanded(env, n):
    return {name: getattr(env, name).expand(n) for name in SPEC_GROUPS}


def _assert_specs(pool, expected):
    assert pool.batch_size == torch.Size([N])
    for name in SPEC_GROUPS:
        assert getattr(pool, name) == expected[name], name


def test_gymnasium_env_specs_are_gymenvs_with_categorical_actions():
    with AsyncEnvPool([lambda: gym.make("CartPole-v1")] * N, envs_per_worker=N) as pool:
        reference = GymEnv("CartPole-v1", categorical_action_encoding=True)
        _assert_specs(pool, _expanded(reference, N))
        assert isinstance(pool.action_spec, Categorical) and pool.action_spec.shape == (N,)
        assert pool.action_spec.rand().shape == (N,)
        assert pool.observation_spec["observation"].shape == (N, 4)
        assert pool.reward_spec.shape == (N, 1)
        assert set(pool.done_spec.keys()) == {"done", "terminated", "truncated"}


def test_torchrl_env_specs_are_its_own():
    with AsyncEnvPool([lambda: GymEnv("Pendulum-v1")] * N, envs_per_worker=N) as pool:
        _assert_specs(pool, _expanded(GymEnv("Pendulum-v1"), N))
        assert pool.action_spec.space.low.shape == (N, 1)  # a bounded spec keeps its bounds


def test_batched_torchrl_env_specs_drop_its_batch_dimension():
    def serial(k):
        return SerialEnv(k, [functools.partial(OracleEnv, env_id=j) for j in range(k)])

    with AsyncEnvPool([functools.partial(serial, N)]) as pool:
        assert pool.num_envs == N
        single = OracleEnv(env_id=0)
        expected = _expanded(single, N)
        _assert_specs(pool, expected)


def test_done_spec_gains_terminated_and_truncated():
    """A TorchRL env without ``truncated`` still has all three, which the pool delivers."""
    from torchrl.envs import EnvBase
    from tensordict import TensorDict

    class DoneOnly(EnvBase):
        def __init__(self):
            super().__init__()
            self.observation_spec = Composite(observation=Unbounded((2,)))
            self.action_spec = Categorical(3)
            self.reward_spec = Unbounded((1,))
            self.done_spec = Composite(done=Categorical(2, (1,), dtype=torch.bool))

        def _reset(self, td):
            return TensorDict({"observation": torch.zeros(2), "done": torch.zeros(1, dtype=torch.bool)})

        def _step(self, td):
            return TensorDict({"observation": torch.zeros(2), "reward": torch.zeros(1),
                               "done": torch.zeros(1, dtype=torch.bool)})

        def _set_seed(self, seed):
            return seed

    env = DoneOnly()
    assert "truncated" not in env.full_done_spec.keys()
    with AsyncEnvPool([DoneOnly] * N, envs_per_worker=N) as pool:
        assert set(pool.full_done_spec.keys()) == {"done", "terminated", "truncated"}
        assert pool.full_done_spec["done"] == env.full_done_spec["done"].expand(N, 1)
        assert pool.full_done_spec["truncated"] == Categorical(2, (N, 1), dtype=torch.bool)


def test_gymnasium_space_kinds():
    class Spaces(gym.Env):
        observation_space = gym.spaces.Dict(
            {"pixels": gym.spaces.Box(0, 255, (4, 4, 3), dtype="uint8"), "flags": gym.spaces.MultiBinary(3)}
        )
        action_space = gym.spaces.MultiDiscrete([2, 3])

    specs = slot_specs(GymnasiumEnvAdapter(Spaces()))
    obs = specs["full_observation_spec"]
    assert obs["pixels"].shape == (4, 4, 3) and obs["pixels"].dtype == torch.uint8
    assert isinstance(obs["flags"], Binary) and obs["flags"].dtype == torch.int8
    assert isinstance(specs["full_action_spec"]["action"], MultiCategorical)


def test_a_spec_that_disagrees_with_its_field_becomes_unbounded_with_a_warning():
    specs = {"full_observation_spec": Composite(observation=Categorical(4, dtype=torch.int32))}
    fields = ({"observation": ((), torch.int64)}, {})
    declared = r"declares 'observation' as shape \(\) torch.int32.*holds \(\) torch.int64"
    with pytest.warns(RuntimeWarning, match=declared):
        out = _checked(specs, fields)
    assert out["full_observation_spec"]["observation"] == Unbounded((), dtype=torch.int64)


def test_specs_that_cannot_be_read_fall_back_to_the_fields():
    class Unreadable(GymnasiumEnvAdapter):
        def specs(self):
            raise ValueError("no conversion for this space")

    adapter = Unreadable(gym.make("CartPole-v1"))
    with pytest.warns(RuntimeWarning, match="no conversion for this space"):
        specs = slot_specs(adapter)
    assert specs["full_observation_spec"]["observation"] == Unbounded((4,), dtype=torch.float32)
    assert specs["full_action_spec"]["action"] == Unbounded((), dtype=torch.int64)
    assert specs["full_done_spec"]["terminated"] == Categorical(2, (1,), dtype=torch.bool)


def test_collector_env_has_the_specs():
    def policy(td):
        td["action"] = torch.zeros(td.shape, dtype=torch.int64)
        return td

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # CartPole's specs convert without a fallback
        collector = AsyncPoolCollector([lambda: gym.make("CartPole-v1")] * N, policy=policy,
                                       frames_per_batch=6, total_frames=6)
    try:
        assert collector.env.action_spec == Categorical(2, (N,), dtype=torch.int64)
        batch = next(iter(collector))
        assert collector.env.observation_spec["observation"][0].is_in(batch["observation"][0])
    finally:
        collector.shutdown()


def test_scalar_box_and_discrete_spaces_keep_the_slot_shape_and_dtype():
    """TorchRL makes a scalar ``Box`` ``[1]`` and keeps a ``Discrete``'s dtype; the slot holds the
    scalar and an int64, so the specs say so (without a mismatch warning), bounds kept."""
    import numpy as np

    class Scalars(gym.Env):
        observation_space = gym.spaces.Dict({"level": gym.spaces.Box(-3, 3, shape=(), dtype=np.int64),
                                             "room": gym.spaces.Discrete(5, start=0)})
        action_space = gym.spaces.Discrete(4)
        action_space.dtype = np.dtype(np.int32)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        specs = slot_specs(GymnasiumEnvAdapter(Scalars()))
    obs = specs["full_observation_spec"]
    assert obs["level"].shape == () and obs["level"].space.high.item() == 3
    assert obs["room"] == Categorical(5, (), dtype=torch.int64)
    assert specs["full_action_spec"]["action"] == Categorical(4, (), dtype=torch.int64)


def _nested_agent_env():
    from tensordict import TensorDict
    from torchrl.data import Bounded
    from torchrl.envs import EnvBase

    class NestedAgent(EnvBase):
        def __init__(self):
            super().__init__()
            self.observation_spec = Composite(agent=Composite(obs=Bounded(-1, 1, (3,))))
            self.action_spec = Composite(agent=Composite(action=Bounded(-2, 2, (2,))))
            self.reward_spec = Unbounded((1,))
            self.done_spec = Composite(done=Categorical(2, (1,), dtype=torch.bool),
                                       terminated=Categorical(2, (1,), dtype=torch.bool))

        def _reset(self, td):
            return TensorDict({("agent", "obs"): torch.zeros(3), "done": torch.zeros(1, dtype=torch.bool),
                               "terminated": torch.zeros(1, dtype=torch.bool)})

        def _step(self, td):
            flags = {"done": torch.zeros(1, dtype=torch.bool), "terminated": torch.zeros(1, dtype=torch.bool)}
            reward = td["agent", "action"].sum(-1, True)
            return TensorDict({("agent", "obs"): torch.zeros(3), "reward": reward, **flags})

        def _set_seed(self, seed):
            return seed

    return NestedAgent()


def test_nested_action_keys_follow_envbase_shortcut_rules():
    env = _nested_agent_env()
    with AsyncEnvPool([_nested_agent_env] * N, envs_per_worker=N) as pool:
        # EnvBase: the leaf only when the one action key is "action"; here the whole group
        assert isinstance(env.action_spec, Composite) and isinstance(pool.action_spec, Composite)
        assert pool.full_action_spec == env.full_action_spec.expand(N)
        assert pool.full_observation_spec == env.full_observation_spec.expand(N)
        td = pool.recv(min_get=N)
        action = pool.full_action_spec.rand()[td.env_indices]  # random actions from the spec are accepted
        pool.send(action, td.env_indices)
        assert pool.recv(min_get=N)["reward"].shape == (N, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_specs_of_an_env_on_the_gpu_are_on_the_cpu_as_the_records_are():
    moved = {name: getattr(_nested_agent_env(), name).to("cuda") for name in SPEC_GROUPS}
    specs = batched_specs(moved, N)
    assert all(leaf.device == torch.device("cpu") for spec in specs.values() for leaf in
               (spec[k] for k in spec.keys(True, True)))


def test_layout_dtype_names_each_fields_dtype_and_refuses_other_keys():
    """``layout_dtype``: the slot dtype of an action, an observation or a policy output, the same
    as the pool's specs say; a key that is not a field: ``KeyError`` naming it."""
    with AsyncEnvPool([lambda: gym.make("Pendulum-v1")] * 2) as pool:
        assert pool.layout_dtype("action") == torch.float32 == pool.full_action_spec["action"].dtype
        assert pool.layout_dtype("observation") == torch.float32
        assert pool.layout_dtype(("observation",)) == torch.float32  # a nested-key tuple of one
        with pytest.raises(KeyError, match="'velocity' is not a field of this pool"):
            pool.layout_dtype("velocity")
