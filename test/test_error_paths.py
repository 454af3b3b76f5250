"""One error path: an env's failure reaches the user with its own exception text and traceback,
whatever the mix of ``step_timeout``, restart mode, worker layout and entry point (pool or
collector); a worker that exits because its env failed fatally is not replaced."""
import functools

import pytest
from tensordict import TensorDict

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, EnvError
from torchrl_asyncpool.testing import OracleEnv, oracle_action

_FAILURE = "OracleEnv 1: scripted failure at step 5"


def _factories():
    # env 1 (and every rebuild of it) raises at its 5th step; env 0 never fails
    return [functools.partial(OracleEnv, env_id=0),
            functools.partial(OracleEnv, env_id=1, fail_at_step=5)]


def _oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def _options(mode, step_timeout, envs_per_worker):
    kwargs = dict(on_env_failure=mode, envs_per_worker=envs_per_worker)
    if step_timeout:
        kwargs["step_timeout"] = 30.0
    if mode == "restart":
        kwargs["max_restarts_per_env"] = 1  # the rebuilt env fails again: past the budget
    return kwargs


def _through_pool(**kwargs):
    with AsyncEnvPool(_factories(), **kwargs) as pool:
        for _ in range(200):
            td = pool.recv(min_get=1, timeout=60)
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
            pool.check_workers()


def _through_collector(**kwargs):
    collector = AsyncPoolCollector(_factories(), policy=_oracle_policy, frames_per_batch=8, total_frames=4_000,
                                   **kwargs)
    try:
        for _ in collector:
            pass
    finally:
        collector.shutdown()


@pytest.mark.parametrize("entry", [_through_pool, _through_collector], ids=["pool", "collector"])
@pytest.mark.parametrize("envs_per_worker", [1, 2])
@pytest.mark.parametrize("step_timeout", [False, True], ids=["no-timeout", "step-timeout"])
@pytest.mark.parametrize("mode", ["raise", "restart"])
def test_the_envs_own_error_and_traceback_reach_the_user(entry, envs_per_worker, step_timeout, mode):
    with pytest.raises(EnvError) as info:
        entry(**_options(mode, step_timeout, envs_per_worker))
    text = str(info.value)
    assert info.value.env_index == 1, text
    assert _FAILURE in text and "Traceback (most recent call last)" in text, text
    assert "died" not in text.splitlines()[0], text  # never a worker's exit code in its place
    if mode == "restart":
        assert "restart budget exhausted" in text, text


# -- env 0's first instance fails in this process (the spec env) ----------------------------
def _no_licence():
    raise RuntimeError("no simulator licence")


@pytest.mark.parametrize("entry", ["pool", "collector"])
def test_a_factory_failing_in_this_process_is_env_0s_env_error(entry):
    """The first factory is called here, before any worker, to read the specs: its failure is
    reported as the workers' are (an EnvError naming env 0, the phase and the traceback), chained
    to the factory's own exception."""
    with pytest.raises(EnvError) as info:
        if entry == "pool":
            AsyncEnvPool([_no_licence] * 2)
        else:
            AsyncPoolCollector([_no_licence] * 2, policy=_oracle_policy, frames_per_batch=8)
    err = info.value
    assert (err.env_index, err.phase, err.where) == (0, "construction", "this process (env 0 is first built here, "
                                                                        "to read the specs)")
    text = str(err)
    assert text.startswith("env 0 raised during construction in this process"), text
    assert "no simulator licence" in text and "Traceback (most recent call last)" in text, text
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == "no simulator licence"


def test_an_env_failing_while_its_steps_are_timed_in_this_process_is_env_0s_env_error():
    """``envs_per_worker="auto"`` times a few steps of the first env here: an env that raises
    there is reported as env 0's step failure."""
    with pytest.raises(EnvError) as info:
        AsyncEnvPool([functools.partial(OracleEnv, env_id=0, fail_at_step=3)] * 2, envs_per_worker="auto")
    err = info.value
    assert (err.env_index, err.phase) == (0, "step"), str(err)
    assert "OracleEnv 0: scripted failure at step 3" in str(err)


def test_env_errors_keep_where_they_raised_through_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(EnvError(3, "reset", "tb", where="this process")))
    assert (err.env_index, err.phase, err.worker_traceback, err.where) == (3, "reset", "tb", "this process")
    assert str(err).startswith("env 3 raised during reset in this process;")
    assert EnvError(1, "step", "tb").where == "its worker process"
