"""Evaluation over fixed episode sets: results in manifest order, identical to running each
episode alone with its seed, and one status per episode when an env fails, hangs or runs long."""
import functools
import json
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from torchrl_asyncpool.evaluation import (
    Episode,
    EpisodeResult,
    check_capacity,
    evaluate,
    load_manifest,
    summarize,
    write_results,
)


def _balance(td):
    """Deterministic CartPole controller: push towards the side the pole leans to."""
    return td.set("action", (td["observation"][:, 2] > 0).long())


def _alone(seed, limit=None, make=lambda: gym.make("CartPole-v1")):
    """(return, length, terminated, truncated) of one episode run in this process."""
    env = make()
    obs, _ = env.reset(seed=seed)
    ret, t = 0.0, 0
    while True:
        obs, r, term, trunc, _ = env.step(int(obs[2] > 0))
        ret, t = ret + float(r), t + 1
        if term or trunc or (limit is not None and t >= limit):
            return ret, t, bool(term), bool(trunc)


class _Faulty(gym.Env):
    """CartPole that raises on reset with ``bad_reset_seed`` or at step 3 with ``bad_step_seed``,
    and sleeps for a minute at step 2 with ``hang_seed``."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, bad_reset_seed=None, bad_step_seed=None, hang_seed=None):
        self.env = gym.make("CartPole-v1")
        self.bad_reset_seed, self.bad_step_seed, self.hang_seed = bad_reset_seed, bad_step_seed, hang_seed
        self.seed, self.t = None, 0

    def reset(self, *, seed=None, options=None):
        if seed is not None and seed == self.bad_reset_seed:
            raise RuntimeError(f"reset refused for seed {seed}")
        self.seed, self.t = seed, 0
        return self.env.reset(seed=seed)

    def step(self, action):
        self.t += 1
        seeded = self.seed is not None  # the pool's unseeded spec env (timed in the driver) behaves
        if seeded and self.seed == self.bad_step_seed and self.t == 3:
            raise RuntimeError(f"step 3 of seed {self.seed} failed")
        if seeded and self.seed == self.hang_seed and self.t == 2:
            time.sleep(60)
        return self.env.step(action)


def test_results_are_in_manifest_order_and_match_running_each_episode_alone():
    episodes = [Episode(f"ep{i}", seed=100 + i) for i in range(7)]
    results = evaluate(functools.partial(gym.make, "CartPole-v1"), _balance, episodes, num_envs=3, envs_per_worker=2)
    assert [r.episode_id for r in results] == [e.episode_id for e in episodes]
    for ep, r in zip(episodes, results):
        ret, length, term, trunc = _alone(ep.seed)
        assert (r.status, r.episode_return, r.length, r.terminated, r.truncated) == ("completed", ret, length, term,
                                                                                     trunc), ep
        assert r.seed == ep.seed and r.error is None
    # round robin over 3 slots: slot s runs episodes s, s+3, ...
    assert [r.env_index for r in results] == [0, 1, 2, 0, 1, 2, 0]
    assert len({r.length for r in results}) > 1  # the seeds matter


def test_step_limits_cut_episodes_as_timeouts():
    episodes = [Episode("a", seed=1), Episode("b", seed=2, max_steps=5), Episode("c", seed=3, max_steps=10_000)]
    results = evaluate(functools.partial(gym.make, "CartPole-v1"), _balance, episodes, num_envs=2, max_steps=20)
    a, b, c = results
    assert (a.status, a.length, a.truncated) == ("timeout", 20, False) and "max_steps=20" in a.error
    assert (b.status, b.length) == ("timeout", 5)
    assert b.episode_return == 5.0  # CartPole pays 1 per step, up to the cut
    assert c.status == "completed" and c.length == _alone(3)[1]


class _Endless(gym.Env):
    """Never terminates; truncates itself after ``truncate_at`` steps (``None``: never)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, truncate_at=None):
        self.truncate_at, self.t = truncate_at, 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        truncated = self.truncate_at is not None and self.t >= self.truncate_at
        return np.full(1, self.t, np.float32), 1.0, False, truncated, {}


def _push_left(td):
    return td.set("action", torch.zeros(td.shape[0], dtype=torch.int64))


@pytest.mark.parametrize("on_env_failure", ["restart", "new_pool"])
def test_an_env_that_truncates_itself_at_max_steps_completes_and_one_cut_by_it_times_out(on_env_failure):
    """The env's own truncation at step N is the episode's end even when max_steps is N too
    (HalfCheetah's 1,000 steps with max_steps=1000); only the plan's cut is a timeout."""
    episodes = [Episode("own", seed=0, max_steps=7), Episode("cut", seed=1, max_steps=5), Episode("short", seed=2)]
    results = evaluate(functools.partial(_Endless, truncate_at=7), _push_left, episodes, num_envs=2, max_steps=9,
                       on_env_failure=on_env_failure)
    own, cut, short = results
    assert (own.status, own.length, own.truncated, own.error) == ("completed", 7, True, None)
    assert (cut.status, cut.length, cut.truncated) == ("timeout", 5, False) and "max_steps=5" in cut.error
    assert (short.status, short.length, short.truncated) == ("completed", 7, True)
    never = evaluate(_Endless, _push_left, episodes[:2], num_envs=2, on_env_failure=on_env_failure)
    assert [(r.status, r.length) for r in never] == [("timeout", 7), ("timeout", 5)]


def test_a_torchrl_env_truncated_by_its_own_time_limit_at_max_steps_completes():
    from torchrl.envs import GymEnv

    def one_hot_balance(td):
        return td.set("action", torch.nn.functional.one_hot((td["observation"][:, 2] > 0).long(), 2))

    make = functools.partial(GymEnv, "CartPole-v1", max_episode_steps=30)
    results = evaluate(make, one_hot_balance, [Episode(f"e{i}", seed=i) for i in range(2)], num_envs=2,
                       max_steps=30)
    assert [(r.status, r.length, r.truncated) for r in results] == [("completed", 30, True)] * 2


@pytest.mark.parametrize("on_env_failure", ["restart", "new_pool"])
def test_a_failing_env_fails_only_its_episode(on_env_failure):
    """Reset and step failures mark their own episode; the others end exactly as they would
    alone: the failed env is rebuilt in its worker and its slot goes on ("restart"), or the pool
    is closed and the episodes that were running on it run again from their start ("new_pool")."""
    make = functools.partial(_Faulty, bad_reset_seed=12, bad_step_seed=15)
    episodes = [Episode(f"ep{i}", seed=10 + i) for i in range(8)]
    results = evaluate(make, _balance, episodes, num_envs=3, envs_per_worker=1, on_env_failure=on_env_failure)
    by_id = {r.episode_id: r for r in results}
    assert by_id["ep2"].status == "failed" and "reset refused for seed 12" in by_id["ep2"].error
    assert by_id["ep5"].status == "failed" and "step 3 of seed 15 failed" in by_id["ep5"].error
    assert "during step" in by_id["ep5"].error and "during reset" in by_id["ep2"].error
    for i in (0, 1, 3, 4, 6, 7):
        r = by_id[f"ep{i}"]
        assert r.status == "completed", r
        assert (r.episode_return, r.length) == _alone(10 + i, make=make)[:2]
    assert summarize(results)["failed"] == 2 and summarize(results)["completed"] == 6


def test_a_hung_env_times_out_on_the_wall_clock():
    make = functools.partial(_Faulty, hang_seed=21)
    episodes = [Episode(f"ep{i}", seed=20 + i) for i in range(4)]
    t0 = time.monotonic()
    # 5 s: room for a healthy episode's worker start-up on a busy machine; the hung step sleeps 60 s
    results = evaluate(make, _balance, episodes, num_envs=4, envs_per_worker=1, episode_timeout_s=5.0)
    assert time.monotonic() - t0 < 45  # well short of waiting the hang out
    assert results[1].status == "timeout" and "wall clock" in results[1].error
    assert [r.status for r in results] == ["completed", "timeout", "completed", "completed"]


def test_an_env_that_cannot_be_built_fails_every_episode():
    calls = []

    def make():
        calls.append(1)
        if len(calls) > 1:  # the first build (in this process) learns the specs; workers fail
            raise RuntimeError("no simulator licence")
        return gym.make("CartPole-v1")

    results = evaluate(make, _balance, [Episode("a", seed=0), Episode("b", seed=1)], num_envs=2,
                       envs_per_worker=1, env_threads=False)
    assert [r.status for r in results] == ["failed", "failed"]
    assert all("no simulator licence" in r.error for r in results)


def test_torchrl_envs_take_their_seed_at_each_reset():
    from torchrl.envs import GymEnv

    def one_hot_balance(td):  # TorchRL's CartPole takes one-hot actions
        return td.set("action", torch.nn.functional.one_hot((td["observation"][:, 2] > 0).long(), 2))

    episodes = [Episode(f"ep{i}", seed=s) for i, s in enumerate([5, 6, 5, 6])]
    results = evaluate(functools.partial(GymEnv, "CartPole-v1"), one_hot_balance, episodes, num_envs=2)
    assert [r.status for r in results] == ["completed"] * 4
    assert (results[0].length, results[1].length) == (results[2].length, results[3].length)
    assert results[0].length != results[1].length


def test_manifest_round_trip_and_errors(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"episodes": [{"episode_id": "a", "seed": 1}, {"episode_id": "b", "max_steps": 3}]}))
    assert load_manifest(path) == [Episode("a", seed=1), Episode("b", max_steps=3)]
    for bad, match in [([], "non-empty"), ([{"seed": 1}], "episode_id"), ([{"episode_id": "a", "sed": 1}], "unknown"),
                       ([{"episode_id": "a"}, {"episode_id": "a"}], "unique"),
                       ([{"episode_id": "a", "seed": -1}], "seed")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_manifest(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_manifest(path)
    out = tmp_path / "r.json"
    write_results([EpisodeResult("a", "completed", 3.0, 3), EpisodeResult("b", "failed", error="x")], out)
    data = json.loads(out.read_text())
    assert data["summary"] == {"episodes": 2, "completed": 1, "timeout": 0, "failed": 1, "mean_return": 3.0,
                               "mean_length": 3.0}
    assert [e["status"] for e in data["episodes"]] == ["completed", "failed"]


def test_bad_arguments_are_refused():
    make = functools.partial(gym.make, "CartPole-v1")
    ep = [Episode("a")]
    for kwargs, match in [(dict(num_envs=0), "num_envs"), (dict(max_steps=0), "max_steps"),
                          (dict(episode_timeout_s=0), "episode_timeout_s")]:
        with pytest.raises(ValueError, match=match):
            evaluate(make, _balance, ep, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        evaluate(make, _balance, [])
    with pytest.raises(TypeError, match="Episode"):
        evaluate(make, _balance, [{"episode_id": "a"}])
    with pytest.raises(ValueError, match="unique"):
        evaluate(make, _balance, [Episode("a"), Episode("a")])
    with pytest.raises(ValueError, match="max_steps"):
        Episode("a", max_steps=0)


class _Start(gym.Env):
    """Starts at ``options["start"]`` (default 0) and counts up; terminates at 10."""

    observation_space = gym.spaces.Box(-100, 100, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        self.x = float((options or {}).get("start", 0))
        return np.array([self.x], np.float32), {}

    def step(self, action):
        self.x += 1
        return np.array([self.x], np.float32), 1.0, self.x >= 10, False, {}


def test_reset_options_reach_gymnasium_envs_and_are_refused_by_torchrl_envs():
    def act(td):
        return td.set("action", torch.zeros(td.batch_size[0], dtype=torch.int64))

    episodes = [Episode("a", options={"start": 7}), Episode("b"), Episode("c", options={"start": 4})]
    results = evaluate(_Start, act, episodes, num_envs=2)
    assert [(r.status, r.length) for r in results] == [("completed", 3), ("completed", 10), ("completed", 6)]

    from torchrl.envs import GymEnv

    def one_hot(td):
        return td.set("action", torch.nn.functional.one_hot(torch.zeros(td.batch_size[0], dtype=torch.int64), 2))

    results = evaluate(functools.partial(GymEnv, "CartPole-v1"), one_hot,
                       [Episode("x", seed=1), Episode("y", seed=2, options={"start": 1})], num_envs=1)
    assert results[0].status == "completed"
    assert results[1].status == "failed" and "need a gymnasium env" in results[1].error


class _Crashing(_Faulty):
    """Its worker process dies (SIGKILL, as a native crash would) at step 3 of seed ``crash_seed``."""

    def __init__(self, crash_seed):
        super().__init__()
        self.crash_seed = crash_seed

    def step(self, action):
        if self.seed == self.crash_seed and self.t == 2:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


@pytest.mark.parametrize("envs_per_worker", [1, 3])
def test_a_worker_death_fails_only_its_episode(envs_per_worker):
    """With several envs in the dying worker, their episodes run again one env per process and
    only the culprit's fails."""
    make = functools.partial(_Crashing, crash_seed=33)
    episodes = [Episode(f"ep{i}", seed=30 + i) for i in range(6)]
    results = evaluate(make, _balance, episodes, num_envs=6, envs_per_worker=envs_per_worker)
    assert results[3].status == "failed" and "died" in results[3].error and "signal 9" in results[3].error
    for i in (0, 1, 2, 4, 5):
        assert results[i].status == "completed", results[i]
        assert (results[i].episode_return, results[i].length) == _alone(30 + i, make=make)[:2]


def test_a_vector_env_factory_is_refused_with_a_clear_error():
    make = functools.partial(gym.make_vec, "CartPole-v1", num_envs=2, vectorization_mode="vector_entry_point")
    with pytest.raises(TypeError, match="needs single envs; create_env_fn returned a CartPoleVectorEnv"):
        evaluate(make, lambda td: td.set("action", torch.zeros(td.shape[0], dtype=torch.int64)),
                 [Episode("a", seed=1, max_steps=10)], num_envs=1, progress=False)


def test_a_batched_torchrl_env_factory_is_refused_with_a_clear_error():
    from torchrl.envs import SerialEnv

    from torchrl_asyncpool.testing import OracleEnv

    make = functools.partial(SerialEnv, 2, OracleEnv)
    with pytest.raises(TypeError, match="needs single envs; create_env_fn returned a SerialEnv"):
        evaluate(make, lambda td: td.set("action", torch.zeros(td.shape[0], dtype=torch.int64)),
                 [Episode("a", seed=1, max_steps=10)], num_envs=1, progress=False)


class _Counter(gym.Env):
    """Reward = the action; episodes of ``seed % 4 + 3`` steps. A policy that acts with its step
    count inside the episode earns 0 + 1 + ... + (length - 1)."""

    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(100)

    def reset(self, *, seed=None, options=None):
        self.length, self.t = (seed or 0) % 4 + 3, 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), float(action), self.t >= self.length, False, {}


def test_a_recurrent_policy_carries_its_state_per_env_and_starts_each_episode_from_zeros():
    def count_steps(td):  # hidden_out = hidden_in + 1: the action is the step count so far
        hidden = td["hidden_in"]
        return td.set("hidden_out", hidden + 1).set("action", hidden[:, 0].long())

    episodes = [Episode(f"e{s}", seed=s) for s in range(10)]
    results = evaluate(_Counter, count_steps, episodes, num_envs=3, envs_per_worker=2,
                       recurrent_state={"hidden_in": "hidden_out"},
                       policy_output_spec={"hidden_out": ((1,), torch.float32)})
    for s, r in enumerate(results):
        length = s % 4 + 3
        assert (r.status, r.length, r.episode_return) == ("completed", length, float(sum(range(length)))), r
    with pytest.raises(ValueError, match="not declared in policy_output_spec"):
        evaluate(_Counter, count_steps, episodes[:1], recurrent_state={"hidden_in": "hidden_out"})


class _SeedRecorder(gym.Env):
    """Records every reset seed and every step in files under ``log_dir`` (one line each)."""

    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def reset(self, *, seed=None, options=None):
        with open(f"{self.log_dir}/resets", "a") as f:
            f.write(f"{seed}\n")
        return np.zeros(1, np.float32), {}

    def step(self, action):
        with open(f"{self.log_dir}/steps", "a") as f:
            f.write("step\n")
        return np.zeros(1, np.float32), 0.0, True, False, {}


def test_check_capacity_builds_and_resets_every_env_at_once_and_steps_none(tmp_path):
    episodes = [Episode(f"e{s}", seed=100 + s) for s in range(6)]
    report = check_capacity(functools.partial(_SeedRecorder, str(tmp_path)), episodes, num_envs=4,
                            envs_per_worker=2)
    assert (report["envs"], report["workers"]) == (4, 2)
    assert report["start_s"] > 0 and report["close_s"] >= 0
    # the spec env of the calling process resets unseeded; the four workers with their episodes' seeds
    seeds = sorted((tmp_path / "resets").read_text().split())
    assert [s for s in seeds if s != "None"] == ["100", "101", "102", "103"]
    assert not (tmp_path / "steps").exists()  # nothing stepped (no probe either: envs_per_worker is explicit)
    from torchrl_asyncpool import EnvError

    with pytest.raises(EnvError, match="reset refused for seed 7"):
        check_capacity(functools.partial(_Faulty, bad_reset_seed=7), [Episode("bad", seed=7)], num_envs=1)


class _Slow(gym.Env):
    """Episodes of 10 steps of 20 ms each."""

    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        time.sleep(0.02)
        self.t += 1
        return np.zeros(1, np.float32), 1.0, self.t >= 10, False, {}


def test_stop_drains_running_episodes_and_starts_no_new_one():
    import threading

    stop = threading.Event()
    calls = []

    def policy(td):  # stops the evaluation once ~1.5 episodes per slot ran
        calls.append(td.shape[0])
        if sum(calls) >= 30:
            stop.set()
        return td.set("action", torch.zeros(td.shape[0], dtype=torch.int64))

    episodes = [Episode(f"e{i}", seed=i) for i in range(40)]
    results = evaluate(_Slow, policy, episodes, num_envs=2, envs_per_worker=1, stop=stop)
    assert [r.episode_id for r in results] == [e.episode_id for e in episodes]
    done = [r for r in results if r.status == "completed"]
    skipped = [r for r in results if r.status == "failed"]
    assert len(done) + len(skipped) == 40, [r.status for r in results]  # nothing cut half-way
    assert all(r.length == 10 and r.episode_return == 10.0 for r in done)  # a running episode finished
    assert all(r.error == "not started: the evaluation was stopped" for r in skipped)
    assert 2 <= len(done) <= 6 and skipped


class _BalanceNet(torch.nn.Module):
    """The ``_balance`` controller as a module with a parameter, recording where it ran."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.devices = set()

    def forward(self, td):
        self.devices.add(td["observation"].device.type)
        return td.set("action", (self.scale * td["observation"][:, 2] > 0).long())


def test_the_policy_runs_on_its_device_and_results_do_not_depend_on_it():
    episodes = [Episode(f"e{s}", seed=s) for s in range(4)]
    make = functools.partial(gym.make, "CartPole-v1")
    net = _BalanceNet()
    auto = evaluate(make, net, episodes, num_envs=2)  # device=None: the parameter's device, the CPU
    explicit = evaluate(make, net, episodes, num_envs=2, device="cpu")
    assert net.devices == {"cpu"}
    assert [(r.episode_id, r.length, r.episode_return) for r in auto] == \
        [(r.episode_id, r.length, r.episode_return) for r in explicit] == \
        [(f"e{s}", _alone(s)[1], _alone(s)[0]) for s in range(4)]


def test_bad_devices_are_refused_before_anything_starts():
    episodes = [Episode("e0", seed=0)]
    make = functools.partial(gym.make, "CartPole-v1")
    with pytest.raises(ValueError, match="must name a torch device"):
        evaluate(make, _balance, episodes, device="gpu0")
    with pytest.raises(ValueError, match="CPU or CUDA"):
        evaluate(make, _balance, episodes, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            evaluate(make, _balance, episodes, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_policy_gets_cuda_batches_and_the_same_results():
    episodes = [Episode(f"e{s}", seed=s) for s in range(4)]
    make = functools.partial(gym.make, "CartPole-v1")
    net = _BalanceNet().cuda()
    results = evaluate(make, net, episodes, num_envs=2)  # device=None: the parameter's, CUDA
    assert net.devices == {"cuda"}
    assert [(r.length, r.episode_return) for r in results] == [(_alone(s)[1], _alone(s)[0]) for s in range(4)]


# ----------------------------------------------------------------------------------------------
# Failures of the evaluation machinery itself (review of 2026-12-01): hangs in reset, signals,
# drains, policy errors, the results file, cleanup.
# ----------------------------------------------------------------------------------------------
class _Hanging(_Faulty):
    """``_Faulty`` that sleeps for a minute in the reset for ``hang_reset_seed``."""

    def __init__(self, hang_reset_seed=None, **kwargs):
        super().__init__(**kwargs)
        self.hang_reset_seed = hang_reset_seed

    def reset(self, *, seed=None, options=None):
        if seed is not None and seed == self.hang_reset_seed:
            time.sleep(60)
        return super().reset(seed=seed, options=options)


@pytest.mark.parametrize("which", ["first", "later"])
def test_a_reset_that_hangs_times_out_its_episode_and_the_others_complete(which):
    """The wall clock covers an episode's env creation and reset: a hang in the first reset (the
    pool's start-up) or in a later one (the worker's reset after the slot's previous episode)
    times out that episode instead of blocking the run."""
    seeds = [40, 41, 42, 43] if which == "first" else [42, 43, 40, 41]  # seed 41: slot 1's 1st or 2nd
    make = functools.partial(_Hanging, hang_reset_seed=41)
    episodes = [Episode(f"s{s}", seed=s) for s in seeds]
    t0 = time.monotonic()
    # 5 s: room for a healthy episode's worker start-up on a busy machine; the hung reset sleeps 60 s
    results = evaluate(make, _balance, episodes, num_envs=2, envs_per_worker=1, episode_timeout_s=5.0)
    assert time.monotonic() - t0 < 50  # well short of waiting the hang out
    by_id = {r.episode_id: r for r in results}
    assert by_id["s41"].status == "timeout" and by_id["s41"].length == 0, by_id["s41"]
    assert "episode_timeout_s=5.0" in by_id["s41"].error
    for s in (40, 42, 43):
        r = by_id[f"s{s}"]
        assert r.status == "completed" and (r.episode_return, r.length) == _alone(s)[:2], r


def test_a_start_up_hang_in_a_worker_of_several_envs_is_found_by_isolating_them():
    make = functools.partial(_Hanging, hang_reset_seed=51)
    episodes = [Episode(f"s{s}", seed=s) for s in (50, 51, 52)]
    t0 = time.monotonic()
    results = evaluate(make, _balance, episodes, num_envs=3, envs_per_worker=3, env_threads=False,
                       episode_timeout_s=5.0)  # room for the healthy episodes on a busy machine
    assert time.monotonic() - t0 < 50  # the hung reset sleeps 60 s
    assert [r.status for r in results] == ["completed", "timeout", "completed"], results


class _SelfInterrupting(_Slow):
    """``_Slow`` whose worker gets a SIGINT at step 3 of seed 1: what a terminal's Ctrl-C does
    to every process of the foreground group, the env workers included."""

    def reset(self, *, seed=None, options=None):
        self.seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.seed == 1 and self.t == 2:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGINT)
        return super().step(action)


def test_env_workers_ignore_sigint_the_parent_owns_shutdown():
    results = evaluate(_SelfInterrupting, _zeros, [Episode(f"e{i}", seed=i) for i in range(3)], num_envs=3,
                       envs_per_worker=1)
    assert [(r.status, r.length) for r in results] == [("completed", 10)] * 3, results


def _zeros(td):
    return td.set("action", torch.zeros(td.shape[0], dtype=torch.int64))


class _Paced(gym.Env):
    """Steps of 50 ms; episodes of ``seed`` steps, except seed 3 that hangs at step 2 and seed 4
    that raises at step 70 (both would last 100 steps)."""

    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        self.seed, self.t = seed, 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t == 2 and self.seed == 3:
            time.sleep(60)
        if self.t == 70 and self.seed == 4:
            raise RuntimeError("step 70 of seed 4 failed")
        time.sleep(0.05)
        return np.zeros(1, np.float32), 1.0, self.t >= {3: 100, 4: 100}.get(self.seed, self.seed), False, {}


@pytest.mark.parametrize("fault", ["hang", "crash"])
def test_a_drain_still_finishes_episodes_whose_pool_closed_for_another_slot(fault):
    """Slot 0 runs 'x' (50 steps, 2.5 s) then 'a' (60 steps, 3 s), slot 1 'bad' then 'b'. The
    drain starts as 'a' starts; then 'bad' hangs past its 5 s (or raises at step 70, 3.5 s, with
    on_env_failure="new_pool") while 'a' runs, and its pool closes: 'a' runs again on a new pool
    and completes instead of being reported 'not started'. (Each episode has 2 s or more of
    margin on the timeout: a loaded 2-core machine slows the 50 ms steps.)"""
    import threading

    stop = threading.Event()
    firsts = []

    def policy(td):
        firsts.extend(td["env_index"][td["step_type"] == 0].tolist())
        if firsts.count(0) == 2:  # slot 0's second episode, 'a', has started
            stop.set()
        return _zeros(td)

    seed = 3 if fault == "hang" else 4
    episodes = [Episode("x", seed=50), Episode("bad", seed=seed), Episode("a", seed=60), Episode("b", seed=7)]
    results = evaluate(_Paced, policy, episodes, num_envs=2, envs_per_worker=1, episode_timeout_s=5.0, stop=stop,
                       on_env_failure="new_pool")
    x, bad, a, b = results
    assert (x.status, x.length) == ("completed", 50), x
    assert (a.status, a.length) == ("completed", 60), a
    assert bad.status == ("timeout" if fault == "hang" else "failed"), bad
    assert b.status == "failed" and b.error == "not started: the evaluation was stopped", b


def _raising_after(n):
    calls = []

    def policy(td):
        calls.append(1)
        if len(calls) > n:
            raise RuntimeError("policy boom")
        return _zeros(td)

    return policy


def test_a_policy_reading_a_key_the_env_lacks_is_told_which():
    """A TensorDictModule reading "obs" from CartPole's records (they hold "observation") fails on
    the None it is handed; the error names the key and the keys the records hold instead."""
    from tensordict.nn import TensorDictModule

    from torchrl_asyncpool.evaluation import EvaluationError

    policy = TensorDictModule(lambda obs: (obs[:, 2] > 0).long(), in_keys=["obs"], out_keys=["action"])
    with pytest.raises(EvaluationError, match=r"the policy reads \['obs'\], which the env's records do not provide; "
                                              r"they hold \[.*'observation'") as info:
        evaluate(functools.partial(gym.make, "CartPole-v1"), policy, [Episode("e0", seed=0)], num_envs=1)
    assert isinstance(info.value.__cause__, ValueError)
    assert isinstance(info.value.__cause__.__cause__, TypeError)  # what reading None raised
    assert "'truncated']. 0 of 1 episodes had ended" in str(info.value)  # one full stop between sentences


def test_a_policy_that_raises_keeps_every_finished_result():
    from torchrl_asyncpool.evaluation import EvaluationError

    # CartPole pushed left ends in ~10 steps: two slots finish a few episodes in 40 calls
    episodes = [Episode(f"e{i}", seed=i) for i in range(12)]
    with pytest.raises(EvaluationError, match="the policy failed: RuntimeError: policy boom") as info:
        evaluate(functools.partial(gym.make, "CartPole-v1"), _raising_after(40), episodes, num_envs=2,
                 envs_per_worker=1)
    assert isinstance(info.value.__cause__, RuntimeError)
    results = info.value.results
    assert [r.episode_id for r in results] == [e.episode_id for e in episodes]
    done = [r for r in results if r.status == "completed"]
    assert done and all(r.error is None for r in done)
    others = [r for r in results if r.status != "completed"]
    assert others and all(r.status == "failed" and "policy boom" in r.error for r in others)
    # the running ones with their steps so far, the others never started
    assert all(r.error.startswith(("did not finish: the evaluation failed", "not started: the evaluation failed"))
               for r in others)
    assert any(r.error.startswith("not started") for r in others)


def test_a_policy_that_writes_no_action_gets_a_clear_error():
    from torchrl_asyncpool.evaluation import EvaluationError

    def wrong_key(td):
        return td.set("act", torch.zeros(td.shape[0], dtype=torch.int64))

    with pytest.raises(EvaluationError) as info:
        evaluate(functools.partial(gym.make, "CartPole-v1"), wrong_key, [Episode("a", seed=0)], num_envs=1)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError)
    assert "has no 'action'" in str(cause) and "'act'" in str(cause) and "'observation'" in str(cause)
    assert info.value.results[0].status == "failed" and "has no 'action'" in info.value.results[0].error


def test_results_files_are_valid_json_and_written_whole(tmp_path):
    out = tmp_path / "r.json"
    out.write_text("previous")
    write_results([EpisodeResult("a", "completed", float("nan"), 3), EpisodeResult("b", "completed", 2.0, 1)], out)

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    data = json.loads(out.read_text(), parse_constant=refuse)
    assert data["episodes"][0]["episode_return"] is None and data["summary"]["mean_return"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left
    with pytest.raises(FileNotFoundError):
        write_results([EpisodeResult("a", "completed")], tmp_path / "nodir" / "r.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_cli_eval_refuses_a_bad_output_or_bad_numbers_before_running(tmp_path, capsys):
    from torchrl_asyncpool import cli

    missing = str(tmp_path / "nodir" / "x.json")
    for extra in ([], ["--validate-only"]):
        t0 = time.monotonic()
        assert cli.main(["eval", "--episodes", "2", "--output", missing, "--no-progress", *extra]) == 2
        assert "does not exist" in capsys.readouterr().err and time.monotonic() - t0 < 10
    assert cli.main(["eval", "--validate-only", "--output", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    for args, match in [(["--num-envs", "0"], "--num-envs must be >= 1, got 0"),
                        (["--max-steps", "0"], "--max-steps must be >= 1"),
                        (["--episode-timeout-s", "-1"], "--episode-timeout-s must be a number of seconds > 0"),
                        (["--episode-timeout-s", "nan"], "--episode-timeout-s must be")]:
        assert cli.main(["eval", "--validate-only", *args]) == 2
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["eval", "--validate-only", "--capacity-smoke"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def _signalling_policy(signum, after):
    """Zero actions; sends ``signum`` to this process at call ``after`` (once the CLI's handlers
    are certainly installed: a signal before that would end the test run)."""
    import os

    calls = []

    def policy(td):
        calls.append(1)
        if len(calls) == after:
            os.kill(os.getpid(), signum)
        return _zeros(td)

    return policy


def sigterm_policy():
    import signal

    return _signalling_policy(signal.SIGTERM, 20)


def raising_policy():
    return _raising_after(40)


def test_cli_eval_drains_on_sigterm_and_writes_every_result(tmp_path, capsys):
    from torchrl_asyncpool import cli

    out = tmp_path / "results.json"
    code = cli.main(["eval", "--episodes", "200", "--num-envs", "2", "--output", str(out), "--no-progress",
                     "--policy", "test_evaluation:sigterm_policy"])
    assert code == 143
    assert "SIGTERM: stopping: the running episodes finish" in capsys.readouterr().err
    episodes = json.loads(out.read_text())["episodes"]
    assert len(episodes) == 200
    assert any(e["status"] == "completed" for e in episodes)
    assert any(e["error"] == "not started: the evaluation was stopped" for e in episodes)


def test_cli_eval_writes_the_finished_results_when_the_policy_raises(tmp_path, capsys):
    from torchrl_asyncpool import cli

    out = tmp_path / "results.json"
    code = cli.main(["eval", "--episodes", "12", "--num-envs", "2", "--output", str(out), "--no-progress",
                     "--policy", "test_evaluation:raising_policy"])
    assert code == 3
    err = capsys.readouterr().err
    assert "RuntimeError: policy boom" in err and "the evaluation failed" in err
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] >= 1 and data["summary"]["failed"] >= 1
    assert all("policy boom" in e["error"] for e in data["episodes"] if e["status"] == "failed")


def test_a_failure_to_close_the_pool_does_not_hide_the_primary_error(monkeypatch):
    """Fault injection: the real close runs, then raises (as a failing cleanup would)."""
    from torchrl_asyncpool import AsyncEnvPool
    from torchrl_asyncpool.evaluation import EvaluationError

    real_close = AsyncEnvPool.close

    def failing_close(self, *args, **kwargs):
        real_close(self, *args, **kwargs)
        raise OSError("simulated cleanup failure")

    monkeypatch.setattr(AsyncEnvPool, "close", failing_close)
    make = functools.partial(gym.make, "CartPole-v1")
    with pytest.warns(RuntimeWarning, match="closing the env pool failed: OSError: simulated cleanup failure"):
        with pytest.raises(EvaluationError, match="policy boom") as info:
            evaluate(make, _raising_after(5), [Episode(f"e{i}", seed=i) for i in range(4)], num_envs=2)
    assert any("simulated cleanup failure" in note for note in info.value.__notes__)
    from torchrl_asyncpool import EnvError

    with pytest.warns(RuntimeWarning, match="simulated cleanup failure"):
        with pytest.raises(EnvError, match="reset refused for seed 7"):
            check_capacity(functools.partial(_Faulty, bad_reset_seed=7), [Episode("a", seed=6), Episode("b", seed=7)],
                           num_envs=2, envs_per_worker=1)
    # without another error, the results are returned and the failure to close is warned about
    with pytest.warns(RuntimeWarning, match="simulated cleanup failure"):
        results = evaluate(make, _balance, [Episode("a", seed=1)], num_envs=1)
    assert results[0].status == "completed"


def test_a_factory_that_fails_in_this_process_raises_and_later_keeps_the_results():
    """The pool builds one env here first (specs): when that fails before anything ran,
    evaluate raises the factory's error; when it fails on the pool rebuilt after an episode's
    failure (on_env_failure="new_pool"), the finished results are kept in an EvaluationError."""
    import os

    from torchrl_asyncpool.evaluation import EvaluationError

    def never(**kwargs):
        raise RuntimeError("no simulator licence")

    with pytest.raises(RuntimeError, match="no simulator licence"):
        evaluate(never, _balance, [Episode("a", seed=0)], num_envs=1)

    here, calls = os.getpid(), []

    def second_spec_env_fails():
        if os.getpid() == here:
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("licence server gone")
        return _Faulty(bad_step_seed=15)

    episodes = [Episode(f"e{s}", seed=s) for s in (15, 16, 17, 18)]
    with pytest.raises(EvaluationError, match="licence server gone") as info:
        evaluate(second_spec_env_fails, _balance, episodes, num_envs=2, envs_per_worker=1, on_env_failure="new_pool")
    first, *others = info.value.results
    assert first.status == "failed" and "step 3 of seed 15 failed" in first.error
    assert len(others) == 3 and all(r.status == "failed" and "licence server gone" in r.error for r in others)


class _SlowClose(_Slow):
    """``_Slow`` whose ``close()`` takes 2 s (a simulator shutting down) and then leaves a file."""

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def close(self):
        import os

        time.sleep(2.0)
        with open(f"{self.log_dir}/closed-{os.getpid()}", "w"):
            pass


def test_envs_get_a_grace_to_close(tmp_path):
    import os

    make = functools.partial(_SlowClose, str(tmp_path))
    results = evaluate(make, _zeros, [Episode(f"e{i}", seed=i) for i in range(2)], num_envs=2, envs_per_worker=1)
    assert [r.status for r in results] == ["completed"] * 2
    closed = [p.name for p in tmp_path.iterdir() if p.name.startswith("closed-")]
    assert len([c for c in closed if c != f"closed-{os.getpid()}"]) == 2, closed  # both workers' envs


class _ResetLogger(_Slow):
    """``_Slow`` that logs the pid and seed of every reset."""

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def reset(self, *, seed=None, options=None):
        import os

        with open(f"{self.log_dir}/resets", "a") as f:
            f.write(f"{os.getpid()} {seed}\n")
        return super().reset(seed=seed, options=options)


def test_no_env_is_reset_after_its_last_planned_episode(tmp_path):
    import os

    make = functools.partial(_ResetLogger, str(tmp_path))
    results = evaluate(make, _zeros, [Episode(f"e{i}", seed=i) for i in range(4)], num_envs=2, envs_per_worker=1)
    assert [r.status for r in results] == ["completed"] * 4
    lines = [line.split() for line in (tmp_path / "resets").read_text().splitlines()]
    worker_seeds = sorted(seed for pid, seed in lines if int(pid) != os.getpid())
    assert worker_seeds == ["0", "1", "2", "3"]  # one seeded reset per episode, no unseeded extra one


_SLOW_ENV_MODULE = '''
import os, time
import numpy as np
import gymnasium as gym
from gymnasium.envs.registration import register

class Slow(gym.Env):
    """Episodes of 40 steps of 50 ms; the first step in each process leaves a file named by its pid."""
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        if self.t == 0:
            open(os.path.join(os.path.dirname(__file__), f"stepped-{os.getpid()}"), "w").close()
        self.t += 1
        time.sleep(0.05)
        return np.zeros(2, np.float32), 1.0, self.t >= 40, False, {}

register(id="Slow-v0", entry_point="slowenv:Slow")
'''


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_eval_drains_on_a_terminal_ctrl_c_sent_to_the_whole_process_group(tmp_path):
    """A terminal's Ctrl-C signals every process of the foreground group, the env workers too:
    the running episodes still finish (the workers ignore it) and the results are written."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    (tmp_path / "slowenv.py").write_text(_SLOW_ENV_MODULE)
    out = tmp_path / "results.json"
    exe = shutil.which("torchrl-asyncpool", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "torchrl_asyncpool.cli"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([*cmd, "eval", "--env-id", "slowenv:Slow-v0", "--episodes", "8", "--num-envs", "2",
                             "--output", str(out), "--no-progress"], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not any(p.name.startswith("stepped-") and p.name != f"stepped-{proc.pid}" for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "no worker stepped an env"
            time.sleep(0.2)
        time.sleep(0.5)  # both slots in their first episode (40 steps: 2 s)
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, output[-3000:]
    episodes = json.loads(out.read_text())["episodes"]
    assert len(episodes) == 8 and not any("KeyboardInterrupt" in (e["error"] or "") for e in episodes), episodes
    completed = [e for e in episodes if e["status"] == "completed"]
    assert len(completed) >= 2 and all(e["length"] == 40 for e in completed)
    assert all(e["error"] == "not started: the evaluation was stopped" for e in episodes if e["status"] != "completed")


_CLOSE_CRASH_SCRIPT = '''
import numpy as np, torch, gymnasium as gym
from torchrl_asyncpool.evaluation import Episode, evaluate

class CloseCrash(gym.Env):
    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)
    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(1, np.float32), {}
    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), 1.0, self.t >= 3, False, {}
    def close(self):
        raise RuntimeError("the simulator refused to shut down")

if __name__ == "__main__":
    results = evaluate(CloseCrash, lambda td: td.set("action", torch.zeros(td.shape[0], dtype=torch.int64)),
                       [Episode("a", seed=0), Episode("b", seed=1)], num_envs=2, envs_per_worker=1)
    print([r.status for r in results])
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_env_close_that_raises_in_a_worker_is_reported(tmp_path):
    """Runs in a fresh interpreter: the workers write to the standard error of the fork server,
    which is the one of the process that started it."""
    import subprocess
    import sys

    script = tmp_path / "close_crash.py"
    script.write_text(_CLOSE_CRASH_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0 and "['completed', 'completed']" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count("close() raised") == 2, proc.stderr[-3000:]
    assert "RuntimeError: the simulator refused to shut down" in proc.stderr
