"""on_env_failure="restart": a failing env is rebuilt in its worker and collection goes on, with
nothing lost or duplicated (the oracle env proves it), every cut episode ending in one marked
TRUNCATION, and a budget past which the env's error is raised as without restarts."""
import functools
import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, EnvError, StepType
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, OracleGymEnv, oracle_action

UNLIMITED = dict(on_env_failure="restart", max_restarts_per_env=10_000, max_restarts=None)


def failing(n, **kwargs):
    """OracleEnv factories; each env (and each rebuilt one) fails as ``kwargs`` say."""
    return [functools.partial(OracleEnv, env_id=i, **kwargs) for i in range(n)]


def oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def _drive(pool, checker, steps):
    for _ in range(steps):
        td = pool.recv(min_get=1, timeout=30)
        checker.observe_batch(td)
        pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)


def _collect_checked(collector, checker):
    """Iterates ``collector`` to its end through ``checker``, each restart's truncation checked
    (reward 0); returns the frames delivered."""
    frames = 0
    for batch in collector:
        checker.observe_transitions(batch)
        frames += batch.numel()
        cut = batch["next", "env_restarted"].reshape(-1)
        assert batch["next", "truncated"].reshape(-1)[cut].all()
        assert (batch["next", "reward"].reshape(-1)[cut] == 0).all()
    return frames


@pytest.mark.parametrize("backend", ["threading", "multiprocessing"])
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (3, False), (3, True)])
def test_pool_records_stay_exact_through_step_and_reset_failures(backend, envs_per_worker, env_threads,
                                                                  dev_shm_guard):
    checker = OracleChecker()
    with AsyncEnvPool(failing(6, fail_at_step=13, fail_on_reset=4), envs_per_worker=envs_per_worker,
                      env_threads=env_threads, backend=backend, **UNLIMITED) as pool:
        _drive(pool, checker, 300)
        restarts = pool.metrics()["env_restarts"]
        info = pool.restart_info()
    assert checker.records >= 300 and checker.restarts >= 10
    assert restarts >= checker.restarts
    assert set(info) <= set(range(6)) and all(count >= 1 for count, _ in info.values())
    assert any("scripted failure" in cause for _, cause in info.values())


def test_a_cut_episode_ends_in_one_marked_truncation_at_its_last_observation():
    with AsyncEnvPool(failing(1, fail_at_step=2), backend="threading", **UNLIMITED) as pool:
        seen = []
        for _ in range(6):
            td = pool.recv(min_get=1, timeout=30)
            seen.append((td["tag"][0].tolist(), int(td["step_type"][0]), bool(td["env_restarted"][0]),
                         float(td["reward"][0])))
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
    k = next(i for i, (_, _, flag, _) in enumerate(seen) if flag)  # the step that failed (the env's 2nd)
    before, cut, after = seen[k - 1], seen[k], seen[k + 1]
    assert before[1] in (StepType.FIRST, StepType.MID)  # the episode was open
    assert cut == (before[0], StepType.TRUNCATION, True, 0.0)  # ended at its last observation, reward 0
    assert after[:3] == ([0, 0, 0], StepType.FIRST, False)  # the rebuilt env's first episode, unmarked
    assert sum(flag for _, _, flag, _ in seen) == 1


def test_collector_delivers_total_frames_exactly_once_with_marked_truncations(dev_shm_guard):
    checker = OracleChecker()
    c = AsyncPoolCollector(failing(8, fail_at_step=17, fail_on_reset=5), policy=oracle_policy, frames_per_batch=100,
                           total_frames=2000, envs_per_worker=4, **UNLIMITED)
    try:
        frames = _collect_checked(c, checker)
        assert frames == checker.records == 2000 and checker.restarts >= 20
        assert c.pool_metrics()["env_restarts"] >= checker.restarts
    finally:
        c.shutdown()


@pytest.mark.parametrize("backend", ["threading", "multiprocessing"])
def test_past_the_budget_the_error_is_raised_with_its_history(backend):
    with AsyncEnvPool(failing(2, fail_at_step=3), backend=backend, on_env_failure="restart",
                      max_restarts_per_env=2, restart_window_s=600) as pool:
        with pytest.raises(EnvError, match="restart budget exhausted: env [01] was rebuilt 2 times") as info:
            _drive(pool, OracleChecker(), 200)
        assert "scripted failure at step 3" in str(info.value)
    with AsyncEnvPool(failing(4, fail_at_step=2), backend=backend, on_env_failure="restart",
                      max_restarts_per_env=100, max_restarts=5) as pool:
        with pytest.raises(EnvError, match=r"rebuilt (\d+) times \(max_restarts=5\)") as info:
            _drive(pool, OracleChecker(), 200)
        # each worker checks the count all of them published: concurrent failures overshoot by < one per worker
        import re

        assert 5 <= int(re.search(r"rebuilt (\d+) times \(max", str(info.value)).group(1)) < 5 + pool.num_workers


def test_a_factory_that_fails_when_rebuilt_counts_against_the_budget():
    built = []

    def flaky(env_id=0):
        built.append(env_id)
        if len(built) > 2:  # the spec env and the first build work, every rebuild fails
            raise RuntimeError("the simulator would not start")
        return OracleEnv(env_id=env_id, fail_at_step=2)

    with AsyncEnvPool([flaky], backend="threading", on_env_failure="restart", max_restarts_per_env=3) as pool:
        with pytest.raises(EnvError, match="would not start"):
            _drive(pool, OracleChecker(), 50)
    assert len(built) == 2 + 3  # three rebuilds tried, then the budget ran out


def test_restarted_envs_get_their_own_deterministic_seeds():
    import gymnasium as gym

    class Crashy(gym.Wrapper):
        def __init__(self):
            super().__init__(gym.make("CartPole-v1"))
            self.steps = 0

        def step(self, action):
            self.steps += 1
            if self.steps == 2:
                raise RuntimeError("crash")
            return self.env.step(action)

    def firsts(seed):
        out = []
        with AsyncEnvPool([Crashy] * 2, backend="threading", seed=seed, **UNLIMITED) as pool:
            while len(out) < 6:
                td = pool.recv(min_get=1, timeout=30)
                for i, st, obs in zip(td.env_indices.tolist(), td["step_type"].tolist(), td["observation"]):
                    if st == StepType.FIRST:
                        out.append((i, obs.tolist()))
                pool.send({"action": torch.zeros(len(td.env_indices), dtype=torch.int64)}, td.env_indices)
        return sorted(out)[:6]

    a, b = firsts(3), firsts(3)
    assert a == b  # the same seeds after the same failures
    expected_env0 = [gym.make("CartPole-v1").reset(seed=3 + 0 + r * 2)[0].tolist() for r in range(3)]
    got_env0 = [obs for i, obs in a if i == 0]
    assert all(any(torch.allclose(torch.tensor(g), torch.tensor(e)) for e in expected_env0) for g in got_env0)


def test_bad_restart_arguments_and_unsupported_envs_are_refused():
    with pytest.raises(ValueError, match="on_env_failure must be 'raise' or 'restart'"):
        AsyncEnvPool(failing(1), on_env_failure="ignore")
    with pytest.raises(ValueError, match="max_restarts_per_env must be a positive int"):
        AsyncEnvPool(failing(1), on_env_failure="restart", max_restarts_per_env=0)
    with pytest.raises(ValueError, match="restart_window_s"):
        AsyncEnvPool(failing(1), on_env_failure="restart", restart_window_s=-1)


def _vectors(kind, num_vectors, k, **kwargs):
    """Factories of vector (gymnasium ``SyncVectorEnv``) or batched (TorchRL ``SerialEnv``) oracle envs."""
    import gymnasium as gym
    from torchrl.envs import SerialEnv

    from torchrl_asyncpool.testing import OracleGymEnv

    def make(base):
        if kind == "gym":
            return gym.vector.SyncVectorEnv([functools.partial(OracleGymEnv, env_id=base + j, **kwargs)
                                             for j in range(k)])
        return SerialEnv(k, [functools.partial(OracleEnv, env_id=base + j, **kwargs) for j in range(k)])

    return [functools.partial(make, f * k) for f in range(num_vectors)]


@pytest.mark.parametrize("kind", ["gym", "torchrl"])
def test_a_failing_vector_env_is_rebuilt_whole_and_records_stay_exact(kind, dev_shm_guard):
    checker = OracleChecker()
    # a gymnasium vector env resets inside its step; a SerialEnv resets its envs twice while it is built
    resets = {} if kind == "gym" else {"fail_on_reset": 5}
    with AsyncEnvPool(_vectors(kind, 2, 3, fail_at_step=11, **resets), **UNLIMITED) as pool:
        for _ in range(300):  # no timeout: a recv with one waits for every env, and after a rebuild
            # an env whose episode had just ended publishes nothing until its vector env's next pass
            td = pool.recv(min_get=1)
            checker.observe_batch(td)
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
        restarts = pool.metrics()["env_restarts"]
        info = pool.restart_info()
    # every rebuild marks each of its envs once: a truncation for an open episode, else the FIRST
    assert checker.records >= 300 and checker.restarts >= 3 * 4
    # counted on each vector env's first slot (a restart elsewhere is a worker replaced: its cause says why)
    assert restarts >= 4 and set(info) <= {0, 3}, {i: cause[-400:] for i, (_, cause) in info.items()}
    assert all("scripted failure" in cause for _, cause in info.values())


@pytest.mark.parametrize("kind", ["gym", "torchrl"])
def test_collector_over_failing_vector_envs_delivers_total_frames_exactly_once(kind, dev_shm_guard):
    checker = OracleChecker()
    c = AsyncPoolCollector(_vectors(kind, 2, 4, fail_at_step=13), policy=oracle_policy, frames_per_batch=80,
                           total_frames=1600, **UNLIMITED)
    try:
        frames = _collect_checked(c, checker)
        assert frames == checker.records == 1600 and checker.restarts >= 8
    finally:
        c.shutdown()



class _BadOutput(OracleGymEnv):
    """An oracle env whose step number ``bad_at_step`` (counted in each build) returns what its
    rows cannot hold: a reward of two numbers, or an observation entry ``key`` one entry short."""

    def __init__(self, env_id, bad_at_step, what, key="tag"):
        super().__init__(env_id)
        self.bad_at_step, self.what, self.key = bad_at_step, what, key

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.total_steps == self.bad_at_step:
            if self.what == "reward":
                reward = np.array([reward, 0.0])
            else:
                obs[self.key] = obs[self.key][:-1]
        return obs, reward, terminated, truncated, info


_BAD_OUTPUT_CAUSES = {
    "reward": r"the env returned a reward of shape \(2,\); its reward spec holds one number a step",
    "tag": r"the env returned 'tag' of shape \(2,\) and dtype int64 where its observation spec declares shape "
           r"\(3,\)",
    "observation": r"the env returned 'observation' of shape \(1,\) and dtype float32 where its observation spec "
                   r"declares shape \(2,\)",
}


@pytest.mark.parametrize("what", list(_BAD_OUTPUT_CAUSES))
@pytest.mark.parametrize("backend,envs_per_worker,env_threads", [
    ("multiprocessing", 1, False), ("multiprocessing", 3, False), ("multiprocessing", 3, True), ("threading", 3, False),
])
def test_an_env_output_its_rows_cannot_hold_is_restarted_like_a_raise(what, backend, envs_per_worker, env_threads,
                                                                      dev_shm_guard):
    # a process worker puts the rows back from its watcher's shadow, a worker thread from its own copy
    # the reward is checked at the step, not when the pass's records are stored: with restarts on,
    # it is that env's failure like a raise, and the records stay exact (the oracle)
    checker = OracleChecker()
    factories = [functools.partial(_BadOutput, i, bad_at_step=9, what="reward" if what == "reward" else "obs",
                                   key=what) for i in range(6)]
    with AsyncEnvPool(factories, envs_per_worker=envs_per_worker, env_threads=env_threads, backend=backend,
                      **UNLIMITED) as pool:
        _drive(pool, checker, 200)
        info = pool.restart_info()
    assert checker.records >= 200 and checker.restarts >= 6
    assert set(info) == set(range(6))
    for _, cause in info.values():
        assert re.search(_BAD_OUTPUT_CAUSES[what], cause), cause[-400:]


class _BadVectorOutput(gym.vector.VectorWrapper):
    """A vector env whose step number ``bad_at_step`` (in each build) returns what its rows cannot
    hold: rewards of two numbers an env, an observation entry for its first env only, or one
    ``terminated`` flag for all its envs."""

    def __init__(self, env, bad_at_step, what):
        super().__init__(env)
        self.bad_at_step, self.what, self.steps = bad_at_step, what, 0

    def step(self, actions):
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        self.steps += 1
        if self.steps == self.bad_at_step:
            if self.what == "rewards":
                rewards = np.stack([rewards, rewards], axis=-1)
            elif self.what == "observation":
                obs = {**obs, "observation": obs["observation"][:1]}
            else:
                terminated = bool(terminated.any())
        return obs, rewards, terminated, truncated, info


@pytest.mark.parametrize("what, cause", [
    ("rewards", r"the vector env returned rewards of shape \(3, 2\) for its 3 envs; their reward spec holds one "
                r"number an env a step"),
    ("observation", r"the env returned 'observation' of shape \(1, 2\) and dtype float32 where its observation "
                    r"spec declares shape \(3, 2\)"),
    ("terminated", r"the vector env returned terminated of shape \(\) for its 3 envs; one flag an env was expected"),
])
def test_a_vector_env_output_its_rows_cannot_hold_is_rebuilt_whole(what, cause, dev_shm_guard):
    # checked before any row is written, so that the rebuild's truncations stand at the last
    # observation (the oracle checks them)
    def make(base):
        envs = [functools.partial(OracleGymEnv, env_id=base + j) for j in range(3)]
        return _BadVectorOutput(gym.vector.SyncVectorEnv(envs), bad_at_step=7, what=what)

    checker = OracleChecker()
    with AsyncEnvPool([functools.partial(make, 0), functools.partial(make, 3)], **UNLIMITED) as pool:
        for _ in range(200):
            td = pool.recv(min_get=1)
            checker.observe_batch(td)
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
        info = pool.restart_info()
    assert checker.records >= 200 and checker.restarts >= 2 * 3
    assert set(info) == {0, 3}
    for _, text in info.values():
        assert re.search(cause, text), text[-400:]


@pytest.mark.slow
def test_long_run_with_many_faults_is_exact():
    """>= 200k oracle-checked transitions and hundreds of faults (step and reset failures)."""
    checker = OracleChecker()
    c = AsyncPoolCollector(failing(16, fail_at_step=997, fail_on_reset=211), policy=oracle_policy,
                           frames_per_batch=4000, total_frames=200_000, **UNLIMITED)
    try:
        frames = 0
        for batch in c:
            checker.observe_transitions(batch)
            frames += batch.numel()
        assert frames == checker.records == 200_000 and checker.restarts >= 20
    finally:
        c.shutdown()


def _offset_policy():
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    return OracleTagPolicy()


def test_a_dead_server_process_is_replaced_with_the_last_weights_and_nothing_is_lost(dev_shm_guard):
    import os
    import signal

    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    c = AsyncPoolCollector(failing(6), policy_factory=_offset_policy, frames_per_batch=60, total_frames=1800,
                           envs_per_worker=3, on_env_failure="restart", max_restarts_per_env=5)
    try:
        learner = OracleTagPolicy(offset=7)
        c.update_policy_weights_(learner)  # version 1: actions are oracle_action(tag) + 7
        checker = OracleChecker(policy=lambda tag: (oracle_action(tag) + 7) % 1000)
        frames, pids = 0, set()
        for i, batch in enumerate(c):
            checker.observe_transitions(batch)
            frames += batch.numel()
            assert batch["policy_version"].eq(1).all()
            if i in (3, 12):  # kill the server process twice mid-run
                pids.add(c.server.pid)
                os.kill(c.server.pid, signal.SIGKILL)
        assert frames == checker.records == 1800
        assert c.server_stats()["server_restarts"] == 2 and c.server.pid not in pids
    finally:
        c.shutdown()


def test_server_replacements_have_a_budget():
    import os
    import signal

    c = AsyncPoolCollector(failing(2), policy_factory=_offset_policy, frames_per_batch=10, total_frames=-1,
                           on_env_failure="restart", max_restarts_per_env=1, restart_window_s=600)
    try:
        it = iter(c)
        next(it)
        os.kill(c.server.pid, signal.SIGKILL)
        for _ in range(3):
            next(it)
        assert c.server_stats()["server_restarts"] == 1
        os.kill(c.server.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="replaced 1 times within 600s"):
            for _ in range(200):
                next(it)
    finally:
        c.shutdown()


@pytest.mark.parametrize("script", ["ppo_cartpole", "impala_cartpole", "dqn_cartpole"])
def test_example_scripts_take_on_env_failure(script, capsys):
    from conftest import load_script

    module = load_script(script)
    assert module.parse_config([]).on_env_failure == "raise"
    assert module.parse_config(["--on-env-failure", "restart"]).on_env_failure == "restart"
    with pytest.raises(SystemExit) as info:
        module.parse_config(["--on-env-failure", "retry"])
    assert info.value.code == 2 and "--on-env-failure must be 'raise' or 'restart'" in capsys.readouterr().err
