"""evaluate(on_env_failure="restart"): an env that raises is rebuilt in its worker and its slot
goes on with its next planned episodes (their own seeds), on the same pool; the episode it
failed in is "failed", and every other result equals a run without the failure."""
import functools
import os

import gymnasium as gym
import numpy as np
import pytest

from torchrl_asyncpool.evaluation import Episode, evaluate
from torchrl_asyncpool.evaluation import runner as runner_module


def _balance(td):
    """Deterministic CartPole controller: push towards the side the pole leans to."""
    return td.set("action", (td["observation"][:, 2] > 0).long())


class _Flaky(gym.Env):
    """CartPole that raises on reset with a seed in ``bad_reset_seeds``, or at step 3 of an
    episode with a seed in ``bad_step_seeds``; every reset's pid and seed is logged to
    ``log_dir/resets`` when ``log_dir`` is given."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, bad_reset_seeds=(), bad_step_seeds=(), log_dir=None):
        self.env = gym.make("CartPole-v1")
        self.bad_reset_seeds, self.bad_step_seeds, self.log_dir = bad_reset_seeds, bad_step_seeds, log_dir
        self.seed, self.t = None, 0

    def reset(self, *, seed=None, options=None):
        if self.log_dir is not None:
            with open(f"{self.log_dir}/resets", "a") as f:
                f.write(f"{os.getpid()} {seed}\n")
        if seed is not None and seed in self.bad_reset_seeds:
            raise RuntimeError(f"reset refused for seed {seed}")
        self.seed, self.t = seed, 0
        return self.env.reset(seed=seed)

    def step(self, action):
        self.t += 1
        if self.seed is not None and self.seed in self.bad_step_seeds and self.t == 3:
            raise RuntimeError(f"step 3 of seed {self.seed} failed")
        return self.env.step(action)


@pytest.fixture
def pools(monkeypatch):
    """The pools evaluate() builds, in order (each records its restart_info before closing)."""
    built = []

    class Counted(runner_module.AsyncEnvPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen_restarts = {}
            built.append(self)

        def close(self, *args, **kwargs):
            if not self._closed and self.on_env_failure == "restart":
                self.seen_restarts = self.restart_info()
            return super().close(*args, **kwargs)

    monkeypatch.setattr(runner_module, "AsyncEnvPool", Counted)
    return built


def _outcome(r):
    return r.episode_id, r.status, r.episode_return, r.length, r.terminated, r.truncated, r.seed, r.env_index


_EPISODES = [Episode(f"ep{i}", seed=10 + i) for i in range(9)]


@pytest.fixture(scope="module")
def clean():
    """The results without any failure (slot s of 3 runs episodes s, s + 3, s + 6); module-scoped,
    so built before ``pools`` counts."""
    return evaluate(_Flaky, _balance, _EPISODES, num_envs=3, envs_per_worker=1)


def _check_against_clean_run(results, clean, failed, same_slots=True):
    """Every episode but ``failed`` ended as in the clean run (on the same slot, unless a pool
    was closed and its episodes planned again on a new one)."""
    assert [r.status for r in clean] == ["completed"] * len(clean)
    for r, c in zip(results, clean):
        if r.episode_id in failed:
            assert r.status == "failed" and (r.env_index == c.env_index or not same_slots), r
        else:
            assert _outcome(r)[:-1] == _outcome(c)[:-1], (r, c)
            assert r.env_index == c.env_index or not same_slots, (r, c)


@pytest.mark.parametrize("envs_per_worker", [1, 3])
def test_an_env_that_crashes_once_is_rebuilt_and_the_pool_keeps_its_size(clean, pools, envs_per_worker, tmp_path):
    """ep1 (slot 1's first episode) raises at its third step: it fails with its traceback, its
    env is rebuilt in its worker, slot 1 runs ep4 and ep7 with their own seeds on the same pool,
    and every other episode ends exactly as in a run without the failure."""
    make = functools.partial(_Flaky, bad_step_seeds=(11,), log_dir=str(tmp_path))
    results = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=envs_per_worker)
    ep1 = results[1]
    assert ep1.status == "failed" and "during step" in ep1.error and "step 3 of seed 11 failed" in ep1.error, ep1
    assert (ep1.length, ep1.episode_return, ep1.env_index) == (2, 2.0, 1)  # the steps before the failure
    _check_against_clean_run(results, clean, failed={"ep1"})
    assert len(pools) == 1  # never closed and rebuilt: the other running episodes went on
    assert {s: count for s, (count, _) in pools[0].seen_restarts.items()} == {1: 1}
    # one seeded reset per planned episode, in the workers (the rebuilt env started at ep4's seed)
    lines = [line.split() for line in (tmp_path / "resets").read_text().splitlines()]
    assert sorted(int(seed) for pid, seed in lines if int(pid) != os.getpid()) == [e.seed for e in _EPISODES]


class _Killing(_Flaky):
    """Its worker process dies (SIGKILL, as a native crash would) at step 2 of seed ``kill_seed``."""

    def __init__(self, kill_seed, log_dir=None):
        super().__init__(log_dir=log_dir)
        self.kill_seed = kill_seed

    def step(self, action):
        if self.seed == self.kill_seed and self.t == 1:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


def test_a_dead_worker_is_replaced_and_its_slot_goes_on_with_the_planned_seeds(clean, pools, tmp_path):
    """ep1's worker (one env) is killed: ep1 fails ("its worker died"), the replacement process
    builds the env again and runs ep4 and ep7 with their own seeds (it reads how far the slot
    got from the plan's progress file), and every other episode ends as without the death."""
    make = functools.partial(_Killing, kill_seed=11, log_dir=str(tmp_path))
    results = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=1)
    assert results[1].status == "failed" and results[1].error.startswith("its worker died"), results[1]
    assert "signal 9" in results[1].error
    _check_against_clean_run(results, clean, failed={"ep1"})
    assert len(pools) == 1 and pools[0].worker_restarts == 1  # the pool replaced the worker, kept its size
    lines = [line.split() for line in (tmp_path / "resets").read_text().splitlines()]
    assert sorted(int(seed) for pid, seed in lines if int(pid) != os.getpid()) == [e.seed for e in _EPISODES]


def test_a_failed_reset_fails_its_episode_and_the_slot_goes_on(clean, pools):
    make = functools.partial(_Flaky, bad_reset_seeds=(13,))  # ep3: slot 0's second episode
    results = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=1)
    ep3 = results[3]
    assert ep3.status == "failed" and "during reset" in ep3.error and "reset refused for seed 13" in ep3.error
    assert (ep3.length, ep3.env_index) == (0, 0)
    _check_against_clean_run(results, clean, failed={"ep3"})
    assert len(pools) == 1


def test_failed_resets_in_a_row_fail_one_episode_each(clean):
    """Slot 0's ep3 and ep6 both refuse their reset: the worker rebuilds its env twice before
    the next FIRST record (ep6's rebuilt env is reset for nothing: slot 0 has no episode left)."""
    make = functools.partial(_Flaky, bad_reset_seeds=(13, 16))
    results = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=1)
    assert results[3].status == results[6].status == "failed"
    for r in (results[3], results[6]):
        assert "during reset (one of 2 failed resets in a row" in r.error and "reset refused for seed" in r.error
    _check_against_clean_run(results, clean, failed={"ep3", "ep6"})

    # three in a row in the middle of a slot: its last episode still runs with its own seed
    episodes = [Episode(f"e{i}", seed=10 + i) for i in range(5)]
    make = functools.partial(_Flaky, bad_reset_seeds=(11, 12, 13))
    results = evaluate(make, _balance, episodes, num_envs=1, max_restarts_per_env=5)
    assert [r.status for r in results] == ["completed", "failed", "failed", "failed", "completed"]
    assert all("one of 3 failed resets in a row" in r.error for r in results[1:4])
    alone = evaluate(_Flaky, _balance, [episodes[4]], num_envs=1)[0]
    assert (results[4].episode_return, results[4].length) == (alone.episode_return, alone.length)


def test_a_failure_in_a_slots_last_episode_rebuilds_nothing_more_to_run(pools):
    episodes = _EPISODES[:4]  # slot 0 runs ep0, ep2; slot 1 runs ep1, ep3
    make = functools.partial(_Flaky, bad_reset_seeds=(12,), bad_step_seeds=(13,))
    results = evaluate(make, _balance, episodes, num_envs=2, envs_per_worker=1)
    assert [r.status for r in results] == ["completed", "completed", "failed", "failed"]
    assert "during reset" in results[2].error and "during step" in results[3].error
    assert len(pools) == 1


def test_past_the_restart_budget_a_failure_closes_the_pool_as_without_restarts(clean, pools):
    """max_restarts=1 over the evaluation: the first failure rebuilds its env, the second closes
    the pool and the running episodes run again on a new pool (without restarts: the budget is
    spent); results are the same."""
    make = functools.partial(_Flaky, bad_step_seeds=(11, 15))
    results = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=1, max_restarts=1)
    assert "step 3 of seed 11 failed" in results[1].error and "step 3 of seed 15 failed" in results[5].error
    _check_against_clean_run(results, clean, failed={"ep1", "ep5"}, same_slots=False)
    assert len(pools) == 2 and [p.on_env_failure for p in pools] == ["restart", "raise"]


def test_past_the_per_env_budget_the_failure_is_its_episodes_and_the_rest_run_again(clean, pools):
    """max_restarts_per_env=1: ep3's failed reset rebuilds slot 0's env, ep6's is one too many
    (the restart budget's error): both fail, each error naming its own cause (the cause on record
    for ep3 is the budget's text, whose history lists both failures)."""
    make = functools.partial(_Flaky, bad_reset_seeds=(13, 16))
    results = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=1, max_restarts_per_env=1)
    assert "reset refused for seed 13" in results[3].error
    assert "during reset" in results[6].error and "restart budget exhausted" in results[6].error
    _check_against_clean_run(results, clean, failed={"ep3", "ep6"}, same_slots=False)
    assert "reset refused for seed 16" in results[6].error  # its own traceback, not the first failure's


def test_new_pool_mode_gives_the_same_results():
    make = functools.partial(_Flaky, bad_reset_seeds=(13,), bad_step_seeds=(11,))
    restarted = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=1)
    new_pool = evaluate(make, _balance, _EPISODES, num_envs=3, envs_per_worker=1, on_env_failure="new_pool")
    # the same outcomes; the slots differ: after a failure, "new_pool" plans the episodes left again
    assert [_outcome(r)[:-1] for r in restarted] == [_outcome(r)[:-1] for r in new_pool]
    assert [r.error.splitlines()[0] for r in restarted if r.error] == [r.error.splitlines()[0]
                                                                         for r in new_pool if r.error]


@pytest.mark.parametrize("kwargs, match", [
    ({"on_env_failure": "raise"}, "on_env_failure must be 'restart' or 'new_pool'"),
    ({"max_restarts_per_env": 0}, "max_restarts_per_env"),
    ({"restart_window_s": 0}, "restart_window_s"),
    ({"max_restarts": -1}, "max_restarts must be None or an int >= 0"),
])
def test_bad_restart_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        evaluate(_Flaky, _balance, _EPISODES[:1], **kwargs)
