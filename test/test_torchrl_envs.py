"""TorchRL env factories on the workers' fast path: the records are TorchRL's, key by key.

Each equivalence test runs TorchRL's own stepping of an env (``TorchRLEnvAdapter``, which calls
the env's ``_step``/``reset``) and the fast path (``make_adapter``) side by side from the same
seed with the same actions, over several episodes with terminations and truncations, and
compares the slot layout, the specs and every record: keys, dtypes, shapes, values, end flags.
"""
import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.envs import (CatTensors, Compose, DoubleToFloat, GymEnv, GymWrapper, ObservationNorm, RewardScaling,
                          RewardSum, StepCounter, TransformedEnv, UnsqueezeTransform)

from torchrl_asyncpool import AsyncEnvPool, StepType
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv, oracle_action
from torchrl_asyncpool.envs.adapters import make_adapter
from torchrl_asyncpool.envs.torchrl_adapters import TorchRLEnvAdapter
from torchrl_asyncpool.envs.env_attrs import FIRST_SEED_ATTR
from torchrl_asyncpool.envs.specs import slot_specs
from torchrl_asyncpool.envs.torchrl_fast import FAST_PATH_ATTR
from torchrl_asyncpool.envs.adapters import adapter_path, factory_path
from torchrl_asyncpool.envs.torchrl_vector_hosting import synchronous_vector_envs


class DriftEnv(gym.Env):
    """float64 observations (a 3-vector and a 2-vector, or with ``flat`` one 5-vector, as a
    MuJoCo env's), a float64 Box action, random terminations drawn from the env's seeded
    generator, rewards that are not float32-exact."""

    def __init__(self, obs_dtype=np.float64, action_dtype=np.float64, flat=False):
        if flat:
            self.observation_space = gym.spaces.Box(-np.inf, np.inf, (5,), obs_dtype)
        else:
            self.observation_space = gym.spaces.Dict({
                "position": gym.spaces.Box(-np.inf, np.inf, (3,), obs_dtype),
                "velocity": gym.spaces.Box(-np.inf, np.inf, (2,), obs_dtype),
            })
        self.action_space = gym.spaces.Box(-1, 1, (2,), action_dtype)
        self.dtype = obs_dtype
        self.flat = flat

    def _obs(self):
        if self.flat:
            return np.concatenate([self.x, self.v]).astype(self.dtype)
        return {"position": self.x.astype(self.dtype), "velocity": self.v.astype(self.dtype)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = self.np_random.normal(size=3)
        self.v = self.np_random.normal(size=2)
        return self._obs(), {}

    def step(self, action):
        assert np.asarray(action).dtype == self.action_space.dtype, np.asarray(action).dtype
        self.v = self.v + 0.1 * np.asarray(action, np.float64)
        self.x = self.x + np.concatenate([self.v, [0.01]]) / 3.0
        reward = float(np.tanh(self.x.sum()) / 3.0)
        return self._obs(), reward, bool(self.np_random.random() < 0.08), False, {}


def drift(max_steps=9, **kwargs):
    return GymWrapper(gym.wrappers.TimeLimit(DriftEnv(**kwargs), max_steps))


def cartpole(**kwargs):
    return GymEnv("CartPole-v1", max_episode_steps=kwargs.pop("max_episode_steps", 25), **kwargs)


def transformed(base, *transforms):
    return TransformedEnv(base(), Compose(*transforms) if len(transforms) > 1 else transforms[0])


FAST_CASES = {
    "gymenv_onehot": cartpole,
    "gymenv_categorical": functools.partial(cartpole, categorical_action_encoding=True),
    "gymenv_frame_skip": functools.partial(cartpole, frame_skip=3),
    "gymenv_box_action": lambda: GymEnv("Pendulum-v1", max_episode_steps=13),
    "gymwrapper_dict_obs": functools.partial(drift, obs_dtype=np.float32, action_dtype=np.float32),
    "gymwrapper_scalar_box_obs": lambda: GymWrapper(OracleGymEnv(env_id=1), categorical_action_encoding=True),
    "step_counter_reward_sum": lambda: transformed(cartpole, StepCounter(), RewardSum()),
    "step_counter_max_steps": lambda: transformed(functools.partial(cartpole, max_episode_steps=50),
                                                  StepCounter(max_steps=11)),
    "reward_scaling_then_sum": lambda: transformed(cartpole, RewardScaling(loc=0.3, scale=1.7), RewardSum()),
    "reward_scaling_standard_normal": lambda: transformed(
        lambda: GymEnv("Pendulum-v1", max_episode_steps=13), RewardScaling(loc=-3.1, scale=0.7, standard_normal=True)),
    "observation_norm": lambda: transformed(
        cartpole, ObservationNorm(loc=torch.tensor([0.1, -0.2, 0.3, 0.05]), scale=torch.tensor([1.3, 0.7, 3.0, 0.9]),
                                  in_keys=["observation"])),
    "observation_norm_standard_normal": lambda: transformed(
        cartpole, ObservationNorm(loc=0.25, scale=0.35, in_keys=["observation"], standard_normal=True)),
    "double_to_float": lambda: transformed(drift, DoubleToFloat()),
    "double_to_float_then_norm_cat": lambda: transformed(
        drift, DoubleToFloat(), ObservationNorm(loc=0.5, scale=3.0, in_keys=["position"]),
        CatTensors(in_keys=["position", "velocity"], out_key="observation_vector"), StepCounter(max_steps=7)),
    "unsqueeze": lambda: transformed(cartpole, UnsqueezeTransform(-1, in_keys=["observation"]), RewardSum()),
    "unsqueeze_positive_dim": lambda: transformed(
        cartpole, UnsqueezeTransform(0, allow_positive_dim=True, in_keys=["observation"])),
    "nested_transformed_env": lambda: TransformedEnv(transformed(cartpole, StepCounter()), RewardSum(),
                                                     auto_unwrap=False),
    # TorchRL's MuJoCo idiom (GymEnv("HalfCheetah-v5") + these three) on a float64 Box env
    "box_double_to_float_step_counter_reward_sum": lambda: transformed(
        functools.partial(drift, flat=True), DoubleToFloat(), StepCounter(), RewardSum()),
    "box_reward_sum_step_counter_max_steps_frame_skip": lambda: transformed(
        lambda: GymWrapper(gym.wrappers.TimeLimit(DriftEnv(flat=True), 40), frame_skip=2), RewardSum(),
        DoubleToFloat(), StepCounter(max_steps=6)),
}

#: how each case's step_into writes a record: the plain copy of the observation, the direct step
#: (observation cast into its row, a step count and a reward sum written) or the record path
STEP_INTO_PATHS = {"gymenv_onehot": "plain", "gymenv_categorical": "plain", "gymenv_box_action": "plain",
                   "gymenv_frame_skip": "direct",
                   "step_counter_reward_sum": "direct", "step_counter_max_steps": "direct",
                   "nested_transformed_env": "direct", "box_double_to_float_step_counter_reward_sum": "direct",
                   "box_reward_sum_step_counter_max_steps_frame_skip": "direct"}


def _actions(adapter):
    """A random action row (numpy) from the env's action spec (torch's seeded generator)."""
    return adapter.env.full_action_spec["action"].rand().numpy()


def _assert_same_entries(fast, ref, keys, what):
    for k in keys:
        x, y = np.asarray(fast[k]), ref.get(k).numpy()
        assert x.dtype == y.dtype, (what, k, x.dtype, y.dtype)
        assert x.shape == y.shape, (what, k, x.shape, y.shape)
        np.testing.assert_array_equal(x, y, err_msg=f"{what}: {k}")


def _step_into_path(adapter):
    return {"_plain_step_into": "plain", "_direct_step_into": "direct"}.get(adapter.step_into.__name__, "record")


def run_side_by_side(make, steps=300, seed=7, into=False):
    """Steps TorchRL's own env and the fast path with the same seed and actions; returns the
    (terminations, truncations) seen. Every record is compared. ``into``: the fast path steps
    with ``step_into`` (the worker's call), into rows of the slot's dtypes and shapes, its reward
    compared as the slot's float32 row stores it."""
    ref_env, fast_env = make(), make()
    setattr(ref_env, FIRST_SEED_ATTR, seed)
    setattr(fast_env, FIRST_SEED_ATTR, seed)
    ref, fast = TorchRLEnvAdapter(ref_env), make_adapter(fast_env)
    try:
        assert adapter_path(fast) == "torchrl-fast", fast.fast_path_reason
        assert fast.fields() == ref.fields()
        assert str(slot_specs(fast)) == str(slot_specs(ref))
        keys = ref.obs_keys
        _assert_same_entries(fast.reset(), ref.reset(), keys, "first reset")
        torch.manual_seed(seed)
        ends = [0, 0]
        request = fast.fields()[0]
        views = [(k, np.zeros(request[k][0], torch.empty((), dtype=request[k][1]).numpy().dtype)) for k in keys]
        for t in range(steps):
            action = _actions(fast)
            if into:
                f_rew, f_term, f_trunc = fast.step_into({"action": action}, views)
                f_obs, f_rew = dict(views), np.asarray(f_rew, np.float32).reshape(1)
            else:
                f_obs, f_rew, f_term, f_trunc = fast.step({"action": action})
            r_obs, r_rew, r_term, r_trunc = ref.step({"action": torch.from_numpy(np.array(action))})
            _assert_same_entries(f_obs, r_obs, keys, f"step {t}")
            _assert_same_entries({"reward": f_rew}, {"reward": r_rew}, ["reward"], f"step {t}")
            assert (f_term, f_trunc) == (r_term, r_trunc), t
            if f_term or f_trunc:
                ends[0 if f_term else 1] += 1
                _assert_same_entries(fast.reset(), ref.reset(), keys, f"reset after step {t}")
        return ends
    finally:
        fast.close()
        ref.close()


@pytest.mark.parametrize("case", list(FAST_CASES))
def test_fast_path_records_equal_torchrls(case):
    terminations, truncations = run_side_by_side(FAST_CASES[case])
    assert terminations + truncations >= 5, "too few episodes to compare resets"
    if "Pendulum" not in case and case not in ("reward_scaling_standard_normal", "gymenv_box_action"):
        assert terminations >= 1
    assert truncations >= 1


@pytest.mark.parametrize("case", list(FAST_CASES))
def test_step_into_records_equal_torchrls(case):
    """The worker's call (``step_into``: the record written into the slot's rows) against
    TorchRL's own stepping, on each path ``step_into`` takes."""
    adapter = make_adapter(FAST_CASES[case]())
    try:
        assert _step_into_path(adapter) == STEP_INTO_PATHS.get(case, "record")
    finally:
        adapter.close()
    terminations, truncations = run_side_by_side(FAST_CASES[case], into=True)
    assert terminations + truncations >= 5


FALLBACK_CASES = {
    "discrete_observations": (lambda: GymEnv("FrozenLake-v1"), "observation space Discrete"),
    "float64_reward_scaling": (lambda: transformed(cartpole, RewardScaling(loc=torch.tensor(0.5, dtype=torch.float64),
                                                                           scale=torch.tensor(2.0))),
                               "RewardScaling: loc/scale dtype"),
    "cat_of_mixed_dtypes": (lambda: transformed(cartpole, StepCounter(),
                                                CatTensors(in_keys=["observation", "step_count"])),
                            "different dtypes"),
    "unknown_transform": (lambda: transformed(cartpole, StepCounter(), __import__("torchrl.envs").envs.RenameTransform(
        ["observation"], ["obs"])), "transform RenameTransform"),
    "reward_sum_in_reward_spec": (lambda: transformed(cartpole, RewardSum(reward_spec=True)),
                                  "RewardSum(reward_spec=True)"),
    "opted_out": (lambda: _opted_out(cartpole()), FAST_PATH_ATTR),
}


def _opted_out(env):
    setattr(env, FAST_PATH_ATTR, False)
    return env


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_unsupported_envs_fall_back_to_torchrl_stepping_with_a_reason(case, caplog):
    make, reason = FALLBACK_CASES[case]
    with caplog.at_level("DEBUG", logger="torchrl_asyncpool.envs.torchrl_fast"):
        try:
            adapter = make_adapter(make(), 5)
        except ValueError as exc:  # the env is not hostable at all (two reward keys): TorchRL's own refusal
            assert case == "reward_sum_in_reward_spec", exc
            return
    try:
        assert adapter_path(adapter) == "torchrl"
        assert reason in adapter.fast_path_reason
        assert any("env 5" in r.message and reason in r.message for r in caplog.records)
    finally:
        adapter.close()


def test_fast_path_choice_is_logged_at_debug_level(caplog):
    with caplog.at_level("DEBUG", logger="torchrl_asyncpool.envs.torchrl_fast"):
        adapter = make_adapter(cartpole(), 3)
    adapter.close()
    assert [r.message for r in caplog.records] == ["env 3 (GymEnv): torchrl-fast path"]


# -- through a pool ----------------------------------------------------------------------------------
def _policy(td):
    """A deterministic one-hot action of the record (the same records give the same actions),
    erratic enough that episodes end by termination as well as by the 25-step limit."""
    obs = td["observation"].reshape(td.batch_size[0], -1)
    return torch.nn.functional.one_hot((obs[:, 0] * 1e4).floor().long() % 2, 2)


def _per_env_records(factories, length, seed=11, **pool_kwargs):
    """Every env's sequence of records (all entries as lists), at least ``length`` long."""
    seqs = {}
    with AsyncEnvPool(factories, seed=seed, **pool_kwargs) as pool:
        while len(seqs) < pool.num_envs or min(map(len, seqs.values())) < length:
            td = pool.recv()
            for row, i in enumerate(td.env_indices.tolist()):
                rec = td[row].exclude("env_index")
                seqs.setdefault(i, []).append({k: rec[k].tolist() for k in rec.keys(True, True)})
            pool.send(TensorDict({"action": _policy(td)}, td.batch_size), td.env_indices)
    return seqs


def _assert_same_sequences(fast, ref, min_len):
    assert fast.keys() == ref.keys()
    for i in ref:
        n = min(len(fast[i]), len(ref[i]))
        assert n >= min_len, (i, n)
        for t in range(n):
            assert fast[i][t] == ref[i][t], (i, t, fast[i][t], ref[i][t])


def _slow(make):
    return _opted_out(make())


@pytest.mark.parametrize("make", [cartpole, lambda: transformed(cartpole, StepCounter(), RewardSum())],
                         ids=["gymenv", "transformed"])
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (3, False), (3, True)])
def test_pool_records_on_the_fast_path_equal_torchrl_stepping(make, envs_per_worker, env_threads):
    n = 3 if envs_per_worker == 1 else 6
    kw = dict(envs_per_worker=envs_per_worker, env_threads=env_threads)
    fast = _per_env_records([make] * n, length=60, **kw)
    ref = _per_env_records([functools.partial(_slow, make)] * n, length=60, **kw)
    _assert_same_sequences(fast, ref, min_len=60)
    types = [r["step_type"] for seq in fast.values() for r in seq]
    assert types.count(StepType.TRUNCATION) and types.count(StepType.TERMINATION)


def test_evaluate_episodes_on_the_fast_path_equal_torchrl_stepping():
    """Episode plans (a TorchRL ``set_seed`` before each planned reset, step limits) give the
    same episodes on the fast path as through TorchRL."""
    from torchrl_asyncpool.evaluation import Episode, evaluate

    def policy(td):
        return td.set("action", _policy(td))

    episodes = [Episode(f"ep{i}", seed=s, max_steps=m) for i, (s, m) in enumerate([(5, None), (6, 9), (5, None),
                                                                                 (7, 4), (8, None), (6, 9)])]
    make = functools.partial(GymEnv, "CartPole-v1")
    fast = evaluate(make, policy, episodes, num_envs=2)
    slow = evaluate(functools.partial(_slow, make), policy, episodes, num_envs=2)
    assert [(r.status, r.length, r.episode_return) for r in fast] == [(r.status, r.length, r.episode_return)
                                                                       for r in slow]
    assert {r.status for r in fast} == {"completed", "timeout"}
    assert fast[0].length == fast[2].length and fast[1].length == fast[5].length and fast[3].length <= 4


def test_gymenv_num_envs_is_hosted_as_k_slots_with_each_sub_envs_torchrl_records():
    """Two ``GymEnv(..., num_envs=3)`` factories: six slots, sub-env ``j`` of factory ``i``
    making exactly the records of ``GymEnv(env_id)`` seeded ``seed + 3 i + j``."""
    vec = functools.partial(GymEnv, "CartPole-v1", num_envs=3, max_episode_steps=25)
    with synchronous_vector_envs():  # the pool's spec env: no 3 processes started only to read specs
        subs = make_adapter(vec()).split()
        # each sub-env steps in the workers' C pass loop (exchange "native"), straight into its row
        assert all(sub.c_step([("observation", np.zeros(4, np.float32))]) is not None for sub in subs)
        subs[0].parent.close()
        fast = _per_env_records([vec] * 2, length=60)
    ref = _per_env_records([functools.partial(_slow, cartpole)] * 6, length=60)
    _assert_same_sequences(fast, ref, min_len=60)
    types = [r["step_type"] for seq in fast.values() for r in seq]
    assert types.count(StepType.TRUNCATION) and types.count(StepType.TERMINATION)


def _vec_transforms():
    return [StepCounter(), RewardScaling(loc=0.25, scale=1.5), RewardSum(),
            ObservationNorm(loc=torch.tensor([0.1, -0.2, 0.3, 0.05]), scale=torch.tensor([1.3, 0.7, 3.0, 0.9]),
                            in_keys=["observation"]), UnsqueezeTransform(-2, in_keys=["observation"])]


def test_transformed_gymenv_num_envs_applies_each_sub_envs_transforms():
    """``TransformedEnv(GymEnv(..., num_envs=3), transforms)``: sub-env ``j`` of factory ``i``
    makes exactly the records of ``TransformedEnv(GymEnv(env_id), transforms)`` seeded
    ``seed + 3 i + j`` (transform state restarting at every autoreset)."""
    def vec():
        return TransformedEnv(GymEnv("CartPole-v1", num_envs=3, max_episode_steps=25), Compose(*_vec_transforms()))

    def single():
        return _opted_out(TransformedEnv(cartpole(), Compose(*_vec_transforms())))

    with synchronous_vector_envs():
        assert adapter_path(make_adapter(vec())) == "torchrl-fast-vector"
        fast = _per_env_records([vec] * 2, length=60)
    ref = _per_env_records([single] * 6, length=60)
    _assert_same_sequences(fast, ref, min_len=60)
    assert {"step_count", "episode_reward"} <= set(fast[0][0])


def test_gymenv_num_envs_with_unsupported_transforms_is_refused_with_a_clear_error():
    def make():
        return TransformedEnv(GymEnv("CartPole-v1", num_envs=2), StepCounter(max_steps=5))

    message = (r"env 0 returned TransformedEnv\(GymEnv\('CartPole-v1', num_envs=2\), \.\.\.\), which the pool "
               r"cannot host: StepCounter\(max_steps=\.\.\.\) over a vector env.*one GymEnv\(env_id\) factory per env")
    with synchronous_vector_envs(), pytest.raises(TypeError, match=message):
        make_adapter(make(), 0)


def test_synchronous_vector_envs_build_gymenv_without_processes():
    with synchronous_vector_envs():
        env = GymEnv("CartPole-v1", num_envs=2)
    try:
        assert isinstance(env.base_env._env, gym.vector.SyncVectorEnv)
        assert adapter_path(make_adapter(env)) == "torchrl-fast-vector"
    finally:
        env.close()


# -- the oracle: exactly once, in order, on the fast path ------------------------------------------
def oracle_torchrl(env_id, transforms=False):
    env = GymWrapper(OracleGymEnv(env_id=env_id), categorical_action_encoding=True)
    return TransformedEnv(env, Compose(StepCounter(), RewardSum())) if transforms else env


@pytest.mark.parametrize("transforms", [False, True], ids=["gymwrapper", "transformed"])
@pytest.mark.parametrize("num_envs,envs_per_worker", [(4, 1), (8, 4)])
def test_oracle_exactly_once_in_order_on_the_fast_path(num_envs, envs_per_worker, transforms, dev_shm_guard):
    assert adapter_path(make_adapter(oracle_torchrl(0, transforms))) == "torchrl-fast"
    checker = OracleChecker()
    factories = [functools.partial(oracle_torchrl, i, transforms) for i in range(num_envs)]
    with AsyncEnvPool(factories, envs_per_worker=envs_per_worker) as pool:
        for _ in range(200):
            td = pool.recv()
            checker.observe_batch(td)
            if transforms:  # the transforms' state: steps and summed rewards since the episode's start
                steps = td["tag"][:, 2]
                assert torch.equal(td["step_count"].squeeze(-1), steps)
                assert torch.equal(td["episode_reward"].squeeze(-1), (steps * (steps + 1) / 2).float())
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
    assert checker.records >= 200
    assert checker.episodes_done > num_envs


def oracle_gymwrapper_vector(base, k, mode):
    envs = [functools.partial(OracleGymEnv, env_id=base + j) for j in range(k)]
    return GymWrapper(gym.vector.SyncVectorEnv(envs, autoreset_mode=mode), categorical_action_encoding=True)


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "torchrl_stepping"])
def test_gymwrapper_over_a_vector_env_is_hosted_as_k_slots_exactly_once(fast):
    """``GymWrapper`` over a gymnasium vector env that does not autoreset (``DISABLED``, which
    TorchRL resets with reset masks) is hosted as ``k`` slots of one worker, on the fast path
    or through TorchRL's own batched stepping."""
    mode = gym.vector.AutoresetMode.DISABLED

    def make(base):
        env = oracle_gymwrapper_vector(base, 3, mode)
        return env if fast else _opted_out(env)

    adapter = make_adapter(make(0))
    assert adapter_path(adapter) == ("torchrl-fast-vector" if fast else "torchrl-batched")
    adapter.close()
    checker = OracleChecker()
    with AsyncEnvPool([functools.partial(make, 3 * i) for i in range(2)]) as pool:
        assert pool.num_envs == 6
        for _ in range(120):
            td = pool.recv()
            checker.observe_batch(td)
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
    assert checker.episodes_done > 6


def cartpole_gymwrapper_disabled(fast=True, k=3):
    env = GymWrapper(gym.vector.SyncVectorEnv([functools.partial(gym.make, "CartPole-v1", max_episode_steps=20)] * k,
                                              autoreset_mode=gym.vector.AutoresetMode.DISABLED))
    return env if fast else _opted_out(env)


def test_gymwrapper_over_a_disabled_vector_env_makes_torchrls_records_on_the_fast_path():
    """A vector env TorchRL resets with reset masks: the fast path's records (and its resets of
    the ended envs) equal TorchRL's batched stepping, env by env, from the same seeds."""
    fast = _per_env_records([cartpole_gymwrapper_disabled] * 2, length=60)
    ref = _per_env_records([functools.partial(cartpole_gymwrapper_disabled, False)] * 2, length=60)
    _assert_same_sequences(fast, ref, min_len=60)
    types = [r["step_type"] for seq in fast.values() for r in seq]
    assert types.count(StepType.TRUNCATION) and types.count(StepType.TERMINATION)


def cartpole_gymwrapper_same_step(k=3):
    return GymWrapper(gym.vector.SyncVectorEnv([functools.partial(gym.make, "CartPole-v1", max_episode_steps=20)] * k,
                                               autoreset_mode=gym.vector.AutoresetMode.SAME_STEP))


def test_gymwrapper_over_a_same_step_vector_env_is_hosted_as_k_slots():
    """``SAME_STEP`` autoreset: TorchRL's stepping (its VecGymEnvTransform swaps in the final
    observation); every ended episode is followed by a FIRST record of the same env."""
    adapter = make_adapter(cartpole_gymwrapper_same_step())
    assert adapter_path(adapter) == "torchrl-batched" and "SAME_STEP" in adapter.fast_path_reason
    adapter.close()
    last = {}
    with AsyncEnvPool([cartpole_gymwrapper_same_step] * 2, seed=0) as pool:
        assert pool.num_envs == 6
        for _ in range(150):
            td = pool.recv()
            for i, st in zip(td.env_indices.tolist(), td["step_type"].tolist()):
                if last.get(i) in (StepType.TERMINATION, StepType.TRUNCATION):
                    assert st == StepType.FIRST, (i, st)
                elif i in last:
                    assert st != StepType.FIRST, (i, st)
                last[i] = st
            pool.send(TensorDict({"action": _policy(td)}, td.batch_size), td.env_indices)
    assert len(last) == 6


def test_gymenv_num_envs_builds_a_sync_vector_env_only_where_async_cannot_start(monkeypatch):
    """In a daemonic process (a pool worker) GymEnv's AsyncVectorEnv becomes a SyncVectorEnv of
    the same factories; elsewhere TorchRL's own _async_env runs unchanged."""
    from torchrl_asyncpool.envs import torchrl_vector_hosting as hosting

    calls = []
    monkeypatch.setattr(gym.vector, "AsyncVectorEnv", lambda fns, **kw: calls.append(len(fns)) or "async")
    monkeypatch.setattr(hosting, "in_daemonic_process", lambda: False)
    assert GymEnv._async_env(None, [gym.make] * 3) == "async" and calls == [3]
    monkeypatch.setattr(hosting, "in_daemonic_process", lambda: True)
    venv = GymEnv._async_env(None, [functools.partial(gym.make, "CartPole-v1")] * 3)
    try:
        assert isinstance(venv, gym.vector.SyncVectorEnv) and venv.num_envs == 3 and calls == [3]
    finally:
        venv.close()


def test_factory_path_says_how_a_worker_steps_each_kind_of_factory():
    assert factory_path(cartpole) == ("torchrl-fast", None)
    assert factory_path(GymEnv, env_name="CartPole-v1", num_envs=2) == ("torchrl-fast-vector", None)
    assert factory_path(functools.partial(gym.make, "CartPole-v1")) == ("gymnasium", None)
    path, reason = factory_path(FALLBACK_CASES["unknown_transform"][0])
    assert path == "torchrl" and "RenameTransform" in reason


@pytest.mark.parametrize("backend", ["threading", "multiprocessing"])
def test_the_pool_reports_which_path_each_slot_steps_on(backend):
    """``pool.slot_paths`` and the ``slots_<path>`` metrics, as the workers report them."""
    import gymnasium as gym
    from torchrl.envs import GymEnv

    from torchrl_asyncpool import AsyncEnvPool
    from torchrl_asyncpool.testing import OracleEnv

    cases = [
        ([lambda: gym.make("CartPole-v1")] * 2, {}, "gymnasium"),
        ([lambda: GymEnv("CartPole-v1")] * 2, {}, "torchrl-fast"),
        ([lambda: OracleEnv(env_id=0), lambda: OracleEnv(env_id=1)], {"envs_per_worker": 2, "env_threads": True},
         "torchrl"),
    ]
    with synchronous_vector_envs():  # the spec env of GymEnv(num_envs=2) in this process
        # GymEnv(num_envs=k): in a worker process its SyncVectorEnv's sub-envs are stepped one by
        # one (a worker thread keeps TorchRL's AsyncVectorEnv, stepped in lockstep); with restarts,
        # the vector env is stepped in lockstep
        split = "torchrl-fast-split" if backend == "multiprocessing" else "torchrl-fast-vector"
        cases += [([lambda: GymEnv("CartPole-v1", num_envs=2)], {}, split),
                  ([lambda: GymEnv("CartPole-v1", num_envs=2)], {"on_env_failure": "restart"}, "torchrl-fast-vector")]
    for fns, kwargs, path in cases:
        with synchronous_vector_envs(), AsyncEnvPool(fns, backend=backend, **kwargs) as pool:
            assert pool.slot_paths == [path, path]
            metrics = pool.metrics()
            assert metrics["slots_" + path.replace("-", "_")] == 2
            assert not [k for k in metrics if k.startswith("slots_") and k != "slots_" + path.replace("-", "_")]
