"""The pass loop's steps of plain gymnasium envs (and TorchRL ``GymEnv`` factories on the fast
path) in C (``exchange.native.step_group``) against the Python loop: the same transitions,
exactly once and in order, and the same failures."""
import functools
import re
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

from conftest import served
from torchrl_asyncpool import AsyncEnvPool, EnvError
from torchrl_asyncpool.exchange.native import native_available, step_group
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv

EXCHANGES = ["python", pytest.param("native", marks=pytest.mark.skipif(
    not native_available(), reason="the C extension is not built"))]
_BIG = np.iinfo(np.int64).max


def _length(env_id: int, episode: int) -> int:
    return 1 + (3 * env_id + episode) % 5


class _FlatOracle(gym.Env):
    """Observation ``[env_id, episode, t, echoed action, 1 if env.step was called from C]``
    (one int64 Box: the C path takes it); episodes of :func:`_length` steps, terminated on even
    episodes and truncated on odd ones; reward ``t``."""

    metadata = {"render_modes": []}

    def __init__(self, env_id, fail_at_step=None, obs_dtype=np.int64, space_dtype=np.int64, action_type=np.integer):
        self.env_id, self.fail_at_step, self.obs_dtype = env_id, fail_at_step, obs_dtype
        self.action_type = action_type
        self.observation_space = gym.spaces.Box(-1, _BIG, (5,), space_dtype)
        self.action_space = gym.spaces.Discrete(1000)
        self.episode, self.t, self.steps = -1, 0, 0

    def _obs(self, echo, from_c):
        return np.array([self.env_id, self.episode, self.t, echo, from_c], self.obs_dtype)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(-1, 0), {}

    def step(self, action):
        # the Python loop calls this from GymnasiumEnvAdapter.step_into; C has no frame of its own
        from_c = int(sys._getframe(1).f_code.co_name == "step_pass")
        # np.integer: what gymnasium's vector envs pass; int: what TorchRL's GymWrapper passes
        assert isinstance(action, self.action_type), type(action)
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError(f"scripted failure of env {self.env_id}")
        self.t += 1
        length = _length(self.env_id, self.episode)
        end = self.t == length
        return self._obs(int(action), from_c), float(self.t), end and self.episode % 2 == 0, \
            end and self.episode % 2 == 1, {}


def _answer(obs: torch.Tensor) -> torch.Tensor:
    return (7 * obs[:, 2] + obs[:, 0] + 1) % 1000  # a function of the record answered


def _answer_td(td):
    return _answer(td["observation"])


def _collect(exchange, num_envs=8, envs_per_worker=4, batches=5, frames=60, **env_kwargs):
    factories = [functools.partial(_FlatOracle, i, **env_kwargs) for i in range(num_envs)]
    with AsyncEnvPool(factories, envs_per_worker=envs_per_worker, transition_chunk_size=4,
                      exchange=exchange) as pool, served(pool, _answer_td):
        return torch.cat([pool.take_transitions(frames, timeout=30, check=pool.check_workers)
                          for _ in range(batches)])


def _check(td, from_c, max_steps=None):
    """Every env's transitions in order, each exactly once, with the right step types (and,
    with ``max_steps``, a TorchRL ``StepCounter(max_steps)``'s truncations, counts and a
    ``RewardSum``'s sums)."""
    obs, nxt = td["observation"], td["next", "observation"]
    if from_c:  # a pass with one env to step takes the per-slot path (Python) instead
        assert (nxt[:, 4] == 1).float().mean() > 0.5, "the passes' steps did not run in C"
    else:
        assert (nxt[:, 4] == 0).all()
    for env in td["env_index"].unique().tolist():
        rows = td["env_index"] == env
        o, n = obs[rows], nxt[rows]
        assert (o[:, 0] == env).all() and (n[:, 0] == env).all()
        assert (n[:, 3] == _answer(o)).all()  # each transition's action is the one its record got
        assert (td["action"][rows] == _answer(o)).all()
        assert (n[:, 1] == o[:, 1]).all() and (n[:, 2] == o[:, 2] + 1).all()
        assert (td["next", "reward"][rows].squeeze(-1) == n[:, 2].float()).all()
        own_end = n[:, 2] == torch.tensor([_length(env, e) for e in n[:, 1].tolist()])
        ends = own_end if max_steps is None else own_end | (n[:, 2] == max_steps)
        term, trunc = td["next", "terminated"][rows].squeeze(-1), td["next", "truncated"][rows].squeeze(-1)
        assert (term == (own_end & (n[:, 1] % 2 == 0))).all() and (trunc == (ends & ~term)).all()
        if max_steps is not None:
            t = n[:, 2]
            assert torch.equal(td["next", "step_count"][rows].squeeze(-1), t.long())
            assert torch.equal(td["next", "episode_reward"][rows].squeeze(-1), (t * (t + 1) / 2).float())
        # consecutive: the next transition starts where this one ended, or at the next episode's start
        follow = torch.where(ends[:-1], (o[1:, 1] == n[:-1, 1] + 1) & (o[1:, 2] == 0),
                             (o[1:, 1] == n[:-1, 1]) & (o[1:, 2] == n[:-1, 2]))
        assert follow.all()
        assert o[0, 1] == 0 and o[0, 2] == 0  # nothing before the first transition was lost


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_pass_loop_steps_exactly_once_in_order(exchange, dev_shm_guard):
    td = _collect(exchange)
    _check(td, from_c=exchange == "native")
    assert td["next", "done"].any()  # episodes ended inside the groups


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_observation_of_another_dtype_is_converted(exchange, dev_shm_guard):
    # float64 observations for an int64 space: not one memcpy, numpy's converting assignment
    _check(_collect(exchange, num_envs=4, envs_per_worker=4, batches=2, frames=40, obs_dtype=np.float64),
           from_c=exchange == "native")


def _torchrl_oracle(env_id, max_steps, fail_at_step=None):
    """The oracle under TorchRL: ``GymWrapper`` of its float64 twin, ``DoubleToFloat``,
    ``StepCounter(max_steps)`` and ``RewardSum``, which the fast path steps directly."""
    from torchrl.envs import Compose, DoubleToFloat, GymWrapper, RewardSum, StepCounter, TransformedEnv

    base = _FlatOracle(env_id, fail_at_step, obs_dtype=np.float64, space_dtype=np.float64, action_type=int)
    return TransformedEnv(GymWrapper(base, categorical_action_encoding=True),
                          Compose(DoubleToFloat(), StepCounter(max_steps=max_steps), RewardSum()))


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_torchrl_gym_envs_step_in_c_exactly_once_in_order(exchange, dev_shm_guard):
    # a TorchRL GymEnv on the fast path steps in the C loop too (exchange "native"): its float64
    # observation cast into the float32 row, its StepCounter's count and truncation at max_steps,
    # its RewardSum's sum; the Python loop (exchange "python") makes the same records
    from torchrl_asyncpool.envs.adapters import adapter_path, make_adapter

    adapter = make_adapter(_torchrl_oracle(0, 3))
    assert adapter_path(adapter) == "torchrl-fast" and adapter.c_step(
        [(k, np.zeros(1, np.int64) if k == "step_count" else np.zeros(1 if k == "episode_reward" else 5, np.float32))
         for k in adapter.obs_keys]) is not None
    adapter.close()
    factories = [functools.partial(_torchrl_oracle, i, 3) for i in range(8)]
    with AsyncEnvPool(factories, envs_per_worker=4, transition_chunk_size=4, exchange=exchange) as pool, \
            served(pool, lambda td: _answer(td["observation"]).long()):
        td = torch.cat([pool.take_transitions(60, timeout=30, check=pool.check_workers) for _ in range(5)])
    assert td["next", "observation"].dtype == torch.float32
    _check(td, from_c=exchange == "native", max_steps=3)
    trunc = td["next", "truncated"].squeeze(-1)
    assert (trunc & (td["next", "observation"][:, 2] == 3)).any()  # StepCounter's own truncations


class _Tenths(gym.Env):
    """float64 observations ``[t, t / 3]`` and a reward of 0.1 a step (not a float32 number):
    what a float32 row and a float32 running sum must round as numpy rounds them."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(2), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t, self.t / 3]), 0.1, False, False, {}


@pytest.mark.skipif(not native_available(), reason="the C extension is not built")
def test_step_group_counts_sums_and_casts_as_the_python_step():
    # the TorchRL fields of a slot's tuple, stepped in C: StepCounter's count (truncating at
    # max_steps) and RewardSum's float32 sum in their state and row arrays, the float64
    # observation rounded into its float32 row
    run = step_group("native")
    env = _Tenths()
    env.reset()
    count, count_row = np.zeros(1, np.int64), np.zeros(1, np.int64)
    total, total_row = np.zeros(1, np.float32), np.zeros(1, np.float32)
    obs = np.zeros(2, np.float32)
    fast = [(5, env.step, np.zeros((), np.int64), None, obs, (count, count_row, 10), (total, total_row))]
    lists = [], [], [], []
    expected = np.float32(0)
    for t in range(1, 11):
        assert run(None, fast, 0, *lists, 1.0, 1.0) == (1, [0] if t == 10 else [])
        expected = expected + np.float32(0.1)
        assert count[0] == count_row[0] == t and total[0] == total_row[0] == expected
        assert obs.tolist() == np.array([t, t / 3], np.float32).tolist()
    assert lists[1] == [StepType.MID] * 9 + [StepType.TRUNCATION]  # max_steps=10 truncates
    assert expected != np.float32(sum([0.1] * 10))  # a float32 sum, as torch adds float32 rewards
    bad = [fast[0][:5] + ((count, count_row), None)]
    with pytest.raises(TypeError, match=r"step count is None or \(state, row, max_steps: int\)"):
        run(None, bad, 0, *lists, 1.0, 1.0)


@pytest.mark.parametrize("torchrl", [False, True], ids=["gymnasium", "torchrl"])
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_env_failure_in_a_pass_names_the_env(exchange, torchrl, dev_shm_guard):
    # env 6 (second of its worker's four) raises in its fifth step: the error names it, not the
    # last env its pass stepped before it (a gymnasium env, or one under TorchRL's GymWrapper)
    if torchrl:
        factories = [functools.partial(_torchrl_oracle, i, None, fail_at_step=5 if i == 6 else None)
                     for i in range(8)]
    else:
        factories = [functools.partial(_FlatOracle, i, fail_at_step=5 if i == 6 else None) for i in range(8)]
    with pytest.raises(EnvError, match=r"env 6 raised during step") as info:
        with AsyncEnvPool(factories, envs_per_worker=4, transition_chunk_size=4, exchange=exchange) as pool, \
                served(pool, lambda td: _answer(td["observation"]).long()):
            for _ in range(50):
                pool.take_transitions(16, timeout=30, check=pool.check_workers)
    assert "scripted failure of env 6" in str(info.value)


class _BoxAction(gym.Env):
    """A continuous-action env: its observation is the action it got (float32 [2]), and it
    fails if ``env.step`` ever gets the slot's own row instead of a fresh copy."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(-10, 10, (2,), np.float32)
        self.action_space = gym.spaces.Box(-10, 10, (2,), np.float32)
        self.kept, self.t = [], 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        assert isinstance(action, np.ndarray) and action.base is None and action.shape == (2,)
        self.kept.append((action, action.copy()))  # a later answer must not change what was given
        assert all((a == b).all() for a, b in self.kept[-8:])
        self.t += 1
        return action.astype(np.float32), 0.0, False, self.t == 9, {}


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_box_actions_are_fresh_copies(exchange, dev_shm_guard):
    def answer(td):
        return td.env_indices.float()[:, None] + torch.tensor([0.5, -0.5])

    with AsyncEnvPool([_BoxAction] * 4, envs_per_worker=4, transition_chunk_size=4, exchange=exchange) as pool, \
            served(pool, answer):
        td = pool.take_transitions(80, timeout=30, check=pool.check_workers)
    expected = td["env_index"].float()[:, None] + torch.tensor([0.5, -0.5])
    assert torch.equal(td["next", "observation"], expected) and torch.equal(td["action"], expected)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_dict_observations_exactly_once_in_order(exchange, dev_shm_guard):
    # the oracle as a plain gymnasium env with a Dict observation: each key into its own rows
    checker = OracleChecker()
    factories = [functools.partial(OracleGymEnv, env_id=i) for i in range(8)]
    with AsyncEnvPool(factories, envs_per_worker=4, transition_chunk_size=5, exchange=exchange) as pool, served(pool):
        for _ in range(5):
            checker.observe_transitions(pool.take_transitions(64, timeout=30, check=pool.check_workers))
    assert checker.records == 5 * 64 and checker.episodes_done > 0


class _BadObservation(_FlatOracle):
    """:class:`_FlatOracle` whose step number ``at`` returns ``bad`` as its observation (or, for
    a Dict space, as its ``"state"`` entry)."""

    def __init__(self, env_id, at, bad, dict_obs=False):
        super().__init__(env_id)
        self.at, self.bad, self.dict_obs = at, bad, dict_obs
        if dict_obs:
            self.observation_space = gym.spaces.Dict({"state": self.observation_space})

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed)
        return ({"state": obs} if self.dict_obs else obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.steps == self.at:
            obs = self.bad
        return ({"state": obs} if self.dict_obs else obs), reward, terminated, truncated, info


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("bad, given", [
    (np.zeros(6, np.int64), "of shape (6,) and dtype int64"),
    (np.zeros((1, 5), np.int64), "of shape (1, 5) and dtype int64"),  # numpy would broadcast it
    (3.0, "of shape () and dtype float64"),  # ... and a scalar, into every entry
    (None, "as None"),  # numpy would write NaN
    ("done", "of shape () and dtype <U4"),
], ids=["longer", "extra-dim", "scalar", "none", "string"])
@pytest.mark.parametrize("dict_obs", [False, True], ids=["box", "dict"])
def test_an_observation_that_does_not_fit_its_space_is_the_envs_error(exchange, bad, given, dict_obs,
                                                                      dev_shm_guard):
    # env 5 (the second of its worker's four) returns a bad observation at its seventh step;
    # nothing of it reaches a batch: the pool raises the env's error, naming env and layouts
    factories = [functools.partial(_BadObservation, i, at=7 if i == 5 else -1, bad=bad, dict_obs=dict_obs)
                 for i in range(8)]
    what = "'state'" if dict_obs else "an observation"
    expected = (f"the env returned {what} {given} where its observation spec declares shape (5,) and "
                "dtype int64.")
    with pytest.raises(EnvError, match=r"env 5 raised during step") as info:
        with AsyncEnvPool(factories, envs_per_worker=4, transition_chunk_size=4, exchange=exchange) as pool, \
                served(pool, lambda td: _answer(td["state"] if dict_obs else td["observation"])):
            for _ in range(50):
                pool.take_transitions(16, timeout=30, check=pool.check_workers)
    assert expected in str(info.value), str(info.value)


def test_an_observation_of_another_type_that_fits_is_converted(dev_shm_guard):
    # a list and numpy's float64 for an int64 Box of shape (5,): converted as before
    from torchrl_asyncpool.exchange.native import copy_into, fit_rows

    row = np.zeros(5, np.int64)
    copy_into(row, [1, 2, 3, 4, 5])
    fit_rows(row[::-1], np.arange(5.0))  # a strided row: numpy's assignment
    assert row.tolist() == [4, 3, 2, 1, 0]
    with pytest.raises(ValueError, match=r"'pixels' as a list \(\[1, None\]\)"):
        fit_rows(np.zeros(2), [1, None], key="pixels")


class _BadReward(_FlatOracle):
    """:class:`_FlatOracle` whose step number ``at`` returns ``bad`` as its reward."""

    def __init__(self, env_id, at, bad):
        super().__init__(env_id)
        self.at, self.bad = at, bad

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, (self.bad if self.steps == self.at else reward), terminated, truncated, info


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("bad, expected", [
    (np.array([1.0, 2.0]), r"the env returned a reward of shape \(2,\); its reward spec holds one number a step"),
    ("x", r"the env returned the reward 'x', which is not a number"),
], ids=["two-numbers", "string"])
def test_a_reward_that_is_not_one_number_names_its_env(exchange, bad, expected, dev_shm_guard):
    # rewards are stored for a whole group of steps after the group ran: the error must name the
    # env that returned the bad one (env 5, the second of its worker's four), not the group's last
    factories = [functools.partial(_BadReward, i, at=6 if i == 5 else -1, bad=bad) for i in range(8)]
    with pytest.raises(EnvError, match=r"env 5 raised during step") as info:
        with AsyncEnvPool(factories, envs_per_worker=4, transition_chunk_size=4, exchange=exchange) as pool, \
                served(pool, _answer_td):
            for _ in range(50):
                pool.take_transitions(16, timeout=30, check=pool.check_workers)
    assert info.value.env_index == 5
    assert re.search(expected, str(info.value)), str(info.value)


class _OldApi(_FlatOracle):
    """The gym < 0.26 API: ``reset`` returns the observation alone (``where="reset"``), or
    ``step`` returns ``(obs, reward, done, info)`` from its third step (``where="step"``)."""

    def __init__(self, env_id, where):
        super().__init__(env_id)
        self.where = where

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed)
        return obs if self.where == "reset" else (obs, info)

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.where == "step" and self.steps >= 3:
            return obs, reward, terminated or truncated, info
        return obs, reward, terminated, truncated, info


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("where, expected", [
    ("reset", r"(?s)raised during reset.*env\.reset must return \(observation, info\), as gymnasium envs do, "
              r"got array"),
    ("step", r"(?s)raised during step.*env\.step must return \(observation, reward, terminated, truncated, info\), "
             r"got \(array"),
], ids=["reset", "step"])
def test_an_env_of_the_old_gym_api_is_told_what_to_return(exchange, where, expected, dev_shm_guard):
    with pytest.raises(EnvError, match=expected):
        with AsyncEnvPool([functools.partial(_OldApi, i, where) for i in range(4)], envs_per_worker=4,
                          transition_chunk_size=4, exchange=exchange) as pool, served(pool, _answer_td):
            for _ in range(20):
                pool.take_transitions(16, timeout=30, check=pool.check_workers)
