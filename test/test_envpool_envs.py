"""EnvPool's gymnasium-API envs (``envpool.make_gymnasium(task, num_envs=k)``) as factories: each
hosts ``k`` slots of one worker, stepped in lockstep.

EnvPool's C++ CartPole has the physics of gymnasium's, so every delivered transition is replayed
on a gymnasium CartPole: it proves the action of each row was the one stepped, that a terminal
observation is delivered as the episode's last ``("next", "observation")``, and that the next
transition of that env starts from a reset observation, with step counts that restart.
"""
import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

envpool = pytest.importorskip("envpool")  # the benchmarks extra; CI installs it

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, StepType  # noqa: E402
from torchrl_asyncpool.envs.adapters import factory_path, make_adapter  # noqa: E402

MAX_STEPS = 15  # short episodes: both terminations and truncations within a few hundred steps
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * np.pi / 360  # CartPole's termination thresholds


def cartpole(num_envs=4, **kwargs):
    return envpool.make_gymnasium("CartPole-v1", num_envs=num_envs, max_episode_steps=MAX_STEPS, **kwargs)


def random_policy(td):
    return td.set("action", torch.randint(0, 2, td.shape))


def per_env(batches):
    """The transitions of each env, in delivery order: ``{env: [(obs, action, next obs, reward,
    terminated, truncated, done)]}``."""
    rows = {}
    for b in batches:
        cols = (b["observation"], b["action"], b["next", "observation"], b["next", "reward"],
                b["next", "terminated"], b["next", "truncated"], b["next", "done"])
        for i, env in enumerate(b["env_index"].tolist()):
            rows.setdefault(env, []).append(tuple(c[i].numpy() for c in cols))
    return rows


def check_cartpole_episodes(transitions, sim):
    """Replays one env's transitions on ``sim`` (a gymnasium CartPole); returns (terminations,
    truncations)."""
    ends = [0, 0]
    t = 0  # steps into the current episode
    for n, (obs, action, nxt, reward, term, trunc, done) in enumerate(transitions):
        if t == 0:  # a reset observation: gymnasium's CartPole resets uniformly in [-0.05, 0.05]
            assert np.abs(obs).max() <= 0.05, f"transition {n} starts an episode from {obs}"
        else:
            assert np.array_equal(obs, transitions[n - 1][2]), f"transition {n} does not continue the last one"
        sim.state, sim.steps_beyond_terminated = obs.astype(np.float64), None
        expected, *_ = sim.step(int(action))
        assert np.allclose(expected, nxt, atol=1e-4), f"transition {n}: {nxt} after {obs}, {action}"
        t += 1
        # EnvPool's rule: an episode that reaches its step limit is truncated, even when its
        # last state is also out of bounds (gymnasium's TimeLimit would mark both)
        out = abs(nxt[0]) > X_LIMIT or abs(nxt[2]) > THETA_LIMIT
        assert bool(trunc[0]) == (t == MAX_STEPS), f"transition {n}: truncated={trunc} at step {t}"
        assert bool(term[0]) == (out and t < MAX_STEPS), f"transition {n}: terminated={term} at {nxt}, step {t}"
        assert bool(done[0]) == bool(term[0] or trunc[0]) and float(reward[0]) == 1.0
        if done[0]:
            ends[0 if term[0] else 1] += 1
            t = 0
    return ends


@pytest.mark.parametrize("batch_size", [None, 2], ids=["lockstep", "async"])
def test_collector_delivers_cartpole_transitions_that_follow_the_physics(batch_size, dev_shm_guard):
    # async: EnvPool's asynchronous mode (batch_size < num_envs), each env stepped once answered
    factory = cartpole if batch_size is None else functools.partial(cartpole, batch_size=batch_size)
    c = AsyncPoolCollector([factory] * 2, policy=random_policy, frames_per_batch=100, total_frames=800, seed=5)
    try:
        assert c.env.num_envs == 8 and c.env.envs_per_factory == 4
        assert c.env.slot_paths == ["envpool" if batch_size is None else "envpool-async"] * 8
        batches = []
        for batch in c:
            assert batch["observation"].shape == (100, 4) and batch["observation"].dtype == torch.float32
            assert batch["action"].shape == (100,) and batch["action"].dtype == torch.int64
            for key in ("done", "terminated", "truncated"):
                assert batch["next", key].shape == (100, 1) and batch["next", key].dtype == torch.bool
            assert batch["next", "reward"].shape == (100, 1)
            batches.append(batch)
    finally:
        c.shutdown()
    rows = per_env(batches)
    assert sorted(rows) == list(range(8))
    sim = gym.make("CartPole-v1").unwrapped
    sim.reset(seed=0)
    ends = np.sum([check_cartpole_episodes(rows[env], sim) for env in rows], axis=0)
    assert ends[0] > 0 and ends[1] > 0, f"(terminations, truncations) = {tuple(ends)}"


@pytest.mark.parametrize("batch_size", [None, 2], ids=["lockstep", "async"])
def test_pool_records_step_types_and_seeds_like_envpool_built_with_the_seed(batch_size):
    """Env ``i`` of a pool seeded 11 starts where EnvPool built with seed ``11 + i`` starts; the
    record after a terminal one is the env's ``FIRST``, with reward 0."""
    expected = [cartpole(num_envs=1, seed=11 + i).reset()[0][0] for i in range(8)]
    last = {}
    firsts = 0
    factory = cartpole if batch_size is None else functools.partial(cartpole, batch_size=batch_size)
    with AsyncEnvPool([factory] * 2, seed=11) as pool:
        assert pool.envs_per_factory == 4
        for _ in range(200):
            td = pool.recv(min_get=1)
            for i, env in enumerate(td.env_indices.tolist()):
                st = int(td["step_type"][i])
                if env not in last:
                    assert st == StepType.FIRST
                    assert np.array_equal(td["observation"][i].numpy(), expected[env])
                elif last[env] in (StepType.TERMINATION, StepType.TRUNCATION):
                    assert st == StepType.FIRST and float(td["reward"][i]) == 0.0
                    assert not td["done"][i].any()
                    firsts += 1
                else:
                    assert st != StepType.FIRST
                assert bool(td["done"][i]) == (st in (StepType.TERMINATION, StepType.TRUNCATION))
                last[env] = st
            pool.send(TensorDict({"action": torch.randint(0, 2, td.shape)}, td.batch_size), td.env_indices)
    assert len(last) == 8 and firsts >= 8


def test_envpool_env_is_recognized_and_bad_setups_raise():
    assert factory_path(cartpole) == ("envpool", None)
    adapter = make_adapter(cartpole(), 0)
    try:
        assert adapter.num_envs == 4
        request, response = adapter.fields()
        assert request["observation"] == ((4,), torch.float32) and response == {"action": ((), torch.int64)}
    finally:
        adapter.close()
    with pytest.raises(ValueError, match="num_envs=4 is not a multiple of batch_size=3"):
        AsyncEnvPool([functools.partial(cartpole, batch_size=3)])
    with pytest.raises(TypeError, match="make_gymnasium"):
        AsyncEnvPool([functools.partial(envpool.make_dm, "CartPole-v1", num_envs=2)])


def test_a_wrapped_envpool_env_that_cannot_be_reseeded_says_so():
    from torchrl_asyncpool.envs.env_attrs import FIRST_SEED_ATTR

    env = gym.wrappers.vector.RecordEpisodeStatistics(cartpole())
    setattr(env, FIRST_SEED_ATTR, 3)
    with pytest.raises(ValueError, match="inside gymnasium wrappers"):
        make_adapter(env, 0)


def _smoke(make, obs_shape, obs_dtype, action_shape, action_dtype, policy):
    c = AsyncPoolCollector([make] * 2, policy=policy, frames_per_batch=32, total_frames=96, seed=0)
    try:
        n = 0
        for batch in c:
            assert batch["observation"].shape == (32, *obs_shape) and batch["observation"].dtype == obs_dtype
            assert batch["next", "observation"].shape == (32, *obs_shape)
            assert batch["action"].shape == (32, *action_shape) and batch["action"].dtype == action_dtype
            assert batch["next", "done"].shape == (32, 1)
            n += 32
        assert n == 96
    finally:
        c.shutdown()


@pytest.mark.slow
def test_halfcheetah_envpool_smoke():
    def policy(td):
        return td.set("action", torch.rand(*td.shape, 6, dtype=torch.float64) * 2 - 1)

    _smoke(lambda: envpool.make_gymnasium("HalfCheetah-v4", num_envs=4), (17,), torch.float64, (6,),
           torch.float64, policy)


@pytest.mark.slow
def test_pong_envpool_smoke():
    def policy(td):
        return td.set("action", torch.randint(0, 6, td.shape))

    _smoke(lambda: envpool.make_gymnasium("Pong-v5", num_envs=2), (4, 84, 84), torch.uint8, (), torch.int64, policy)
