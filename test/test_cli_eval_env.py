"""``torchrl-asyncpool eval``'s env options: ``--env-factory MODULE:FUNCTION`` and ``--env-kwargs
JSON``, and ``--validate-only`` running the policy once on a real observation (a float64
observation into a float32 policy is found there, with what to do about it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchrl_asyncpool import cli

_MODULE = '''
import gymnasium as gym
import numpy as np
import torch
from tensordict.nn import TensorDictModule


class Box3(gym.Env):
    """Observations of ``dtype``; never terminates, truncates itself after ``truncate_at`` steps."""

    action_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    def __init__(self, dtype=np.float64, truncate_at=None):
        self.observation_space = gym.spaces.Box(-1, 1, (3,), dtype)
        self.dtype, self.truncate_at, self.t = dtype, truncate_at, 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(3, self.dtype), {}

    def step(self, action):
        self.t += 1
        truncated = self.truncate_at is not None and self.t >= self.truncate_at
        return np.zeros(3, self.dtype), 1.0, False, truncated, {}


def make(truncate_at=None):
    return Box3(truncate_at=truncate_at)


def make_f32(truncate_at=None):
    return Box3(np.float32, truncate_at)


def linear():
    return TensorDictModule(torch.nn.Linear(3, 2), ["observation"], ["action"])


def no_action():
    return lambda td: td.set("act", torch.zeros(td.shape[0], 2))


NOT_CALLABLE = 3
'''


@pytest.fixture
def envs_module(tmp_path, monkeypatch):
    """``cli_eval_envs`` importable from ``tmp_path`` (also the current directory)."""
    (tmp_path / "cli_eval_envs.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("cli_eval_envs", None)
    yield tmp_path
    sys.modules.pop("cli_eval_envs", None)


def _eval(*args) -> int:
    return cli.main(["eval", "--episodes", "2", *args])


def test_a_factory_called_with_env_kwargs_runs_in_the_workers(envs_module):
    """The factory comes from a module in the current directory (the workers import it too), gets
    --env-kwargs, and its own truncation at the step of --max-steps completes the episodes."""
    out = envs_module / "results.json"
    cmd = [sys.executable, "-m", "torchrl_asyncpool.cli", "eval", "--env-factory", "cli_eval_envs:make_f32",
           "--env-kwargs", '{"truncate_at": 6}', "--policy", "cli_eval_envs:linear", "--episodes", "3",
           "--num-envs", "2", "--max-steps", "6", "--no-progress", "--output", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=envs_module, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    episodes = json.loads(out.read_text())["episodes"]
    assert [(e["episode_id"], e["status"], e["length"], e["truncated"]) for e in episodes] == [
        (f"make_f32-{i}", "completed", 6, True) for i in range(3)]


def test_validate_only_runs_the_policy_on_a_real_observation(envs_module, capsys):
    assert _eval("--env-factory", "cli_eval_envs:make_f32", "--policy", "cli_eval_envs:linear",
                 "--validate-only") == 0
    assert "acted on one real observation of the env ('action': (2,) float32)" in capsys.readouterr().out


def test_validate_only_finds_a_float64_observation_for_a_float32_policy(envs_module, capsys):
    assert _eval("--env-factory", "cli_eval_envs:make", "--policy", "cli_eval_envs:linear", "--validate-only") == 2
    err = capsys.readouterr().err
    assert "'observation': (3,) float64" in err and "RuntimeError" in err, err
    assert "observations are float64 ('observation') but the policy's parameters are float32" in err, err
    assert "DtypeObservation(env, numpy.float32)" in err and "policy.to(torch.float64)" in err, err


def test_validate_only_finds_a_policy_that_writes_no_action(envs_module, capsys):
    assert _eval("--env-factory", "cli_eval_envs:make", "--policy", "cli_eval_envs:no_action",
                 "--validate-only") == 2
    err = capsys.readouterr().err
    assert "the policy's output has no 'action'" in err and "'act'" in err, err


def test_env_kwargs_reach_gymnasium_make(capsys):
    assert _eval("--env-id", "CartPole-v1", "--env-kwargs", '{"no_such_option": 1}', "--validate-only") == 2
    err = capsys.readouterr().err
    assert "gymnasium.make('CartPole-v1') with --env-kwargs" in err and "no_such_option" in err, err
    assert _eval("--env-kwargs", '{"max_episode_steps": 7}', "--validate-only") == 0


@pytest.mark.parametrize("args,message", [
    (["--env-factory", "cli_eval_envs"], "--env-factory must be MODULE:FUNCTION (e.g. mypkg.envs:make_env), got "
                                         "'cli_eval_envs'"),
    (["--env-factory", ":make"], "--env-factory must be MODULE:FUNCTION"),
    (["--env-factory", "no_such_module_xyz:make"], "cannot import the module 'no_such_module_xyz'"),
    (["--env-factory", "cli_eval_envs:nope"], "the module 'cli_eval_envs' has no attribute 'nope' (its callables: "),
    (["--env-factory", "cli_eval_envs:NOT_CALLABLE"], "'NOT_CALLABLE' is a int, not a function"),
    (["--env-factory", "cli_eval_envs:make", "--env-kwargs", "{bad"], "--env-kwargs must be a JSON object, e.g. "),
    (["--env-factory", "cli_eval_envs:make", "--env-kwargs", "[1]"], "got a list: '[1]'"),
    (["--env-factory", "cli_eval_envs:make", "--env-kwargs", '{"x": 1}'],
     "--env-factory cli_eval_envs:make with --env-kwargs {\"x\": 1} failed: TypeError"),
    (["--policy", "cli_eval_envs"], "--policy must be 'random' or MODULE:FACTORY"),
])
def test_bad_env_options_are_usage_errors_naming_what_was_given(envs_module, capsys, args, message):
    assert _eval(*args, "--validate-only") == 2
    err = capsys.readouterr().err
    assert err.startswith("torchrl-asyncpool eval: ") and message in err, err


def test_env_id_and_env_factory_exclude_each_other(envs_module, capsys):
    with pytest.raises(SystemExit) as info:
        _eval("--env-id", "CartPole-v1", "--env-factory", "cli_eval_envs:make", "--validate-only")
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
