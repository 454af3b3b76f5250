"""Stopping an evaluation: a drain that begins while the pool is starting abandons the start-up at
once, and an abort (a second Ctrl-C of ``torchrl-asyncpool eval``, a ``KeyboardInterrupt`` of
``evaluate()``) still keeps every finished result. The CLI tests run the real command in a fresh
session and signal it with ``os.kill``/``os.killpg``, as a terminal or a supervisor would."""
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

from torchrl_asyncpool.evaluation import Episode, EvaluationInterrupted, evaluate


def _zeros(td):
    return td.set("action", torch.zeros(td.shape[0], dtype=torch.int64))


def _gone(pids, within=10.0) -> list:
    """The processes of ``pids`` still alive (not zombies) after waiting up to ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _ours_in_dev_shm() -> set:
    return {f for f in os.listdir("/dev/shm") if "torchrl_asyncpool" in f}


class _StartHang(gym.Env):
    """Its seeded reset (the workers' first one: the pool's start-up) leaves a file named by its
    pid in ``log_dir``, then sleeps for a minute; the spec env's unseeded reset returns at once."""

    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            open(os.path.join(self.log_dir, f"resetting-{os.getpid()}"), "w").close()
            time.sleep(60)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 1.0, True, False, {}


def _wait_for(folder, prefix, count=1, timeout=120.0, proc=None) -> list:
    deadline = time.monotonic() + timeout
    while True:
        found = [p.name for p in folder.iterdir() if p.name.startswith(prefix)]
        if len(found) >= count:
            return found
        assert proc is None or proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {prefix!r} file within {timeout} s"
        time.sleep(0.05)


def test_a_stop_while_the_pool_starts_abandons_the_start_up(tmp_path):
    """The drain flag is looked at while the workers build and reset their envs: a stop set then
    ends the start-up within a few seconds (the reset sleeps a minute), closes the pool (its
    workers are gone) and reports every episode not started."""
    stop = threading.Event()
    worker_pids, stopped_at = [], []

    def stop_once_resetting():
        names = _wait_for(tmp_path, "resetting-", count=2)
        worker_pids.extend(int(n.split("-")[1]) for n in names)
        stopped_at.append(time.monotonic())
        stop.set()

    watcher = threading.Thread(target=stop_once_resetting, daemon=True)
    watcher.start()
    episodes = [Episode(f"e{i}", seed=i) for i in range(4)]
    results = evaluate(functools.partial(_StartHang, str(tmp_path)), _zeros, episodes, num_envs=2,
                       envs_per_worker=1, stop=stop)
    took = time.monotonic() - stopped_at[0]
    watcher.join(1)
    assert len(worker_pids) == 2
    assert took < 10, f"evaluate() returned {took:.1f} s after the stop (the resets sleep 60 s)"
    assert [r.episode_id for r in results] == ["e0", "e1", "e2", "e3"]
    assert all(r.status == "failed" and r.error == "not started: the evaluation was stopped" for r in results), results
    assert not _gone(worker_pids, within=5.0), "a worker of the abandoned pool is still alive"


@pytest.mark.timeout(120)
def test_a_keyboard_interrupt_keeps_the_finished_results():
    """``evaluate()`` under Python's own SIGINT handler (no drain): the Ctrl-C at the 25th policy
    call raises ``EvaluationInterrupted`` (a ``KeyboardInterrupt``) with one result per episode:
    the finished ones as they ended, the running ones cut ("did not finish", their steps so far),
    the rest not started."""
    calls = []

    def policy(td):
        calls.append(1)
        if len(calls) == 25:
            os.kill(os.getpid(), signal.SIGINT)
        return _zeros(td)

    # CartPole always pushed left: episodes of 8-10 steps; two slots
    episodes = [Episode(f"e{i}", seed=i) for i in range(20)]
    try:  # not pytest.raises: a plain KeyboardInterrupt must fail this test, not end the test run
        evaluate(lambda: gym.make("CartPole-v1"), policy, episodes, num_envs=2, envs_per_worker=1)
    except KeyboardInterrupt as exc:
        caught = exc
    else:
        pytest.fail("the Ctrl-C was lost")
    assert isinstance(caught, EvaluationInterrupted), repr(caught)
    assert isinstance(caught.__cause__, KeyboardInterrupt)
    results = caught.results
    assert [r.episode_id for r in results] == [e.episode_id for e in episodes]
    completed = [r for r in results if r.status == "completed"]
    cut = [r for r in results if r.error == "did not finish: the evaluation was aborted"]
    unstarted = [r for r in results if r.error == "not started: the evaluation was aborted"]
    assert completed and unstarted and len(completed) + len(cut) + len(unstarted) == 20, results
    assert all(r.status == "failed" for r in cut + unstarted)
    assert all(r.length == 0 and r.episode_return == 0 for r in unstarted)
    # a cut episode keeps its steps so far (0 when it was cut right after its reset's record)
    assert all(0 <= r.length < 12 and r.episode_return == r.length for r in cut), cut


# ----------------------------------------------------------------------------------------------
# The CLI in a subprocess of its own session (every process it starts stays in that session)
# ----------------------------------------------------------------------------------------------
_ENV_MODULE = '''
import os, time
import numpy as np
import gymnasium as gym
from gymnasium.envs.registration import register

HERE = os.path.dirname(__file__)

def mark(name):
    open(os.path.join(HERE, name), "w").close()

class StartHang(gym.Env):
    """The workers' first (seeded) reset leaves resetting-<pid> and sleeps for a minute."""
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            mark(f"resetting-{os.getpid()}")
            time.sleep(60)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 1.0, True, False, {}

class Long(gym.Env):
    """Steps of 20 ms; the episode of seed 0 lasts 5 steps, the others 3000 (a minute). Each
    episode's first step leaves stepped-<seed>, its end ended-<seed>."""
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.seed, self.t = seed, 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        if self.t == 0 and self.seed is not None:
            mark(f"stepped-{self.seed}")
        self.t += 1
        time.sleep(0.02)
        done = self.t >= (5 if self.seed == 0 else 3000)
        if done and self.seed is not None:
            mark(f"ended-{self.seed}")
        return np.zeros(2, np.float32), 1.0, done, False, {}

register(id="StartHang-v0", entry_point="sigenvs:StartHang")
register(id="Long-v0", entry_point="sigenvs:Long")
'''


@contextlib.contextmanager
def _running_cli(tmp_path, env_id, episodes, num_envs=2):
    """``torchrl-asyncpool eval`` over the signal test envs, in a session of its own; its whole
    session is killed on the way out if it is still running (a failed assertion)."""
    (tmp_path / "sigenvs.py").write_text(_ENV_MODULE)
    exe = shutil.which("torchrl-asyncpool", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "torchrl_asyncpool.cli"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([*cmd, "eval", "--env-id", f"sigenvs:{env_id}", "--episodes", str(episodes),
                             "--num-envs", str(num_envs), "--output", str(tmp_path / "results.json"),
                             "--no-progress"], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _session(sid) -> list:
    """Processes of session ``sid`` (the CLI's, started with ``start_new_session``), zombies aside."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return found


def _finish(proc, within):
    """Output of ``proc`` once it exited (``within`` s at most); kills its session otherwise."""
    try:
        output, _ = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the CLI did not exit within {within} s of the signal:\n{output[-3000:]}")
    return output


def _no_leftovers(proc, descendants, shm_before):
    """Nothing the CLI started outlives it: no process of its session or seen as its descendant,
    no new /dev/shm file of ours."""
    left = _gone(set(descendants) | set(_session(proc.pid)), within=5.0)
    assert not left, f"processes left behind: {[(p, psutil.Process(p).cmdline()) for p in left]}"
    assert _ours_in_dev_shm() <= shm_before, sorted(_ours_in_dev_shm() - shm_before)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_cli_eval_a_signal_during_the_pool_start_up_abandons_it(tmp_path, signum):
    """The workers' first resets sleep a minute. Ctrl-C (to the whole process group, as a
    terminal sends it) or SIGTERM (to the CLI) then drains at once: the start-up is abandoned, the
    pool closed, every episode written as not started, exit status 130 or 143, nothing left."""
    shm_before = _ours_in_dev_shm()
    with _running_cli(tmp_path, "StartHang-v0", episodes=4) as proc:
        _wait_for(tmp_path, "resetting-", count=2, timeout=240, proc=proc)
        descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        t0 = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        output = _finish(proc, within=60)
        took = time.monotonic() - t0
    assert proc.returncode == 128 + signum, output[-3000:]
    assert took < 15, f"the start-up was not abandoned promptly: exit {took:.1f} s after the signal"
    episodes = json.loads((tmp_path / "results.json").read_text())["episodes"]
    assert [e["episode_id"] for e in episodes] == [f"sigenvs:StartHang-v0-{i}" for i in range(4)]
    assert all(e["status"] == "failed" and e["error"] == "not started: the evaluation was stopped"
               for e in episodes), episodes
    _no_leftovers(proc, descendants, shm_before)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_eval_a_second_ctrl_c_aborts_and_still_writes_the_results(tmp_path):
    """Slot 0 runs seed 0 (5 steps), then seed 2; slot 1 seed 1; seed 3 waits (all but seed 0
    last a minute). The first Ctrl-C drains (seeds 1 and 2 would run on), the second aborts: the
    results file is still written, valid JSON: seed 0 completed, seeds 1 and 2 cut ("did not
    finish", their steps so far), seed 3 not started; exit status 130, nothing left."""
    shm_before = _ours_in_dev_shm()
    (tmp_path / "results.json").write_text("previous")
    with _running_cli(tmp_path, "Long-v0", episodes=4) as proc:
        _wait_for(tmp_path, "ended-0", timeout=240, proc=proc)
        _wait_for(tmp_path, "stepped-2", timeout=60, proc=proc)
        _wait_for(tmp_path, "stepped-1", timeout=60, proc=proc)
        descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1.0)  # the drain runs: seeds 1 and 2 have ~55 s left
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        output = _finish(proc, within=60)
        took = time.monotonic() - t0
    assert proc.returncode == 130, output[-3000:]
    assert took < 15, f"the abort took {took:.1f} s"
    assert "aborting" in output and "no results written" not in output, output[-3000:]

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    data = json.loads((tmp_path / "results.json").read_text(), parse_constant=refuse)
    e0, e1, e2, e3 = data["episodes"]
    assert (e0["status"], e0["length"]) == ("completed", 5), e0
    for e in (e1, e2):
        assert e["status"] == "failed" and e["error"] == "did not finish: the evaluation was aborted", e
        assert 0 < e["length"] < 3000, e
    assert e3["status"] == "failed" and e3["error"] == "not started: the evaluation was aborted", e3
    assert data["summary"]["completed"] == 1 and data["summary"]["failed"] == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".results")) == []  # no temporary file
    _no_leftovers(proc, descendants, shm_before)
