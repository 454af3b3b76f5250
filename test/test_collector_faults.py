"""AsyncPoolCollector faults: named errors or clean stops, promptly, with nothing left behind."""
import functools
import os
import signal
import threading
import time

import pytest
from torchrl.data import LazyTensorStorage, ReplayBuffer

from conftest import oracle_factories
from torchrl_asyncpool import AsyncPoolCollector, EnvError, InferenceServerError, WorkerDiedError
from torchrl_asyncpool.testing.policies import OracleTagPolicy
from torchrl_asyncpool.testing import OracleEnv, oracle_action


def oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def _gone(pids, within=5.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.parametrize("env_threads", [False, True])
def test_env_crash_reaches_the_iterating_learner(env_threads, dev_shm_guard):
    fns = oracle_factories(4)
    fns[2] = functools.partial(OracleEnv, env_id=2, fail_at_step=30)
    c = AsyncPoolCollector(fns, policy=oracle_policy, frames_per_batch=16, transition_chunk_size=4,
                           envs_per_worker=2, env_threads=env_threads)
    pids = c.env.worker_pids
    with pytest.raises(EnvError, match="env 2 raised during step") as info:
        for _ in c:
            pass
    assert "scripted failure" in str(info.value)
    c.shutdown(raise_on_error=False)
    assert _gone(pids)


@pytest.mark.parametrize("env_threads", [False, True])
def test_worker_sigkill_raises_within_two_seconds(env_threads):
    c = AsyncPoolCollector(oracle_factories(4, step_delay=0.001), policy=oracle_policy, frames_per_batch=8,
                           envs_per_worker=2, env_threads=env_threads, transition_chunk_size=2)
    try:
        it = iter(c)
        next(it)
        os.kill(c.env.worker_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker 1"):
            for _ in range(10_000):
                next(it)
        assert time.monotonic() - t0 < 6.0
    finally:
        c.shutdown(raise_on_error=False)


@pytest.mark.parametrize("env_threads", [False, True])
def test_shutdown_mid_iteration_from_another_thread_stops_cleanly(env_threads):
    c = AsyncPoolCollector(oracle_factories(4, step_delay=0.05), policy=oracle_policy, frames_per_batch=10_000,
                           transition_chunk_size=4, envs_per_worker=2, env_threads=env_threads)
    pids = c.env.worker_pids
    out = []
    t = threading.Thread(target=lambda: out.extend(iter(c)), daemon=True)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    c.shutdown()
    t.join(6)
    assert not t.is_alive(), "the iterating thread did not stop"
    assert time.monotonic() - t0 < 6.0
    assert out == []  # no partial batch is yielded
    assert _gone(pids)


def test_shutdown_while_start_writes():
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000))
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=32, replay_buffer=rb,
                           transition_chunk_size=8)
    pids = c.env.worker_pids
    c.start()
    deadline = time.monotonic() + 30
    while len(rb) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(rb) > 0
    t0 = time.monotonic()
    c.shutdown()
    assert time.monotonic() - t0 < 6.0
    assert len(rb) % 32 == 0  # whole batches only
    assert _gone(pids)


def test_policy_error_is_named():
    calls = {"n": 0}

    def flaky(td):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("policy exploded")
        return oracle_policy(td)

    c = AsyncPoolCollector(oracle_factories(2), policy=flaky, frames_per_batch=8, transition_chunk_size=2)
    try:
        with pytest.raises(InferenceServerError, match="policy 'policy'.*failed.*policy exploded"):
            for _ in c:
                pass
    finally:
        c.shutdown(raise_on_error=False)


def test_process_server_sigkill_raises_within_two_seconds():
    c = AsyncPoolCollector(oracle_factories(4), policy_factory=OracleTagPolicy, frames_per_batch=8,
                           transition_chunk_size=2)
    pids = c.env.worker_pids
    try:
        assert c.server_backend == "process"
        it = iter(c)
        next(it)
        server_pid = c.server.pid
        os.kill(server_pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(InferenceServerError):
            for _ in range(100_000):
                next(it)
        assert time.monotonic() - t0 < 6.0
    finally:
        c.shutdown(raise_on_error=False)
    assert _gone(pids + [server_pid])
