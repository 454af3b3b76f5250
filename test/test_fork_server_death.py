"""multiprocessing's fork server ending (killed, or its own crash) while a pool runs: every worker
and the inference server process it forked run on, so none may be taken for dead. A pool that
watched the fork server's connection instead of the processes replaced live workers, and the old
and the new worker then stepped the same slots (the oracle env saw duplicated records)."""
import functools
import os
import signal
import time

import psutil
import pytest
from tensordict import TensorDict

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, oracle_action
from torchrl_asyncpool.testing.policies import OracleTagPolicy

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux 5.3+, Python 3.9+)")


def _kill_fork_server():
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # gone (a zombie multiprocessing reaps when it next needs a fork server, then starts another)
    assert _gone([pid])
    return pid


def _gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _drive(pool, checker, steps):
    for _ in range(steps):
        td = pool.recv(min_get=1, timeout=30)
        checker.observe_batch(td)
        pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)


@pytest.mark.parametrize("restart", [False, True])
def test_workers_outlive_their_fork_server_and_are_not_taken_for_dead(restart, dev_shm_guard):
    checker = OracleChecker()
    kwargs = dict(on_env_failure="restart") if restart else {}
    factories = [functools.partial(OracleEnv, env_id=i) for i in range(4)]
    with AsyncEnvPool(factories, envs_per_worker=2, mp_start_method="forkserver", **kwargs) as pool:
        _drive(pool, checker, 20)
        pids = list(pool.worker_pids)
        _kill_fork_server()
        _drive(pool, checker, 200)  # a watched pool looks at its workers every few ms meanwhile
        assert pool.worker_pids == pids
        assert pool.restart_info() == {} and pool.metrics().get("env_restarts", 0) == 0
    assert checker.records >= 220 and checker.restarts == 0
    assert _gone(pids)  # the life pipe still ends them: orphans of the dead fork server exit too


def test_a_worker_killed_after_its_fork_server_died_is_still_replaced(dev_shm_guard):
    checker = OracleChecker()
    factories = [functools.partial(OracleEnv, env_id=i) for i in range(4)]
    with AsyncEnvPool(factories, envs_per_worker=2, on_env_failure="restart") as pool:
        _drive(pool, checker, 20)
        _kill_fork_server()
        victim = pool.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        _drive(pool, checker, 200)
        assert pool.worker_pids[0] != victim and pool.worker_pids[1] != victim
        info = pool.restart_info()
        assert set(info) == {2, 3} and all("died" in cause for _, cause in info.values())
    assert checker.restarts >= 2  # each of its envs' episodes cut once (or a FIRST marked)


def test_an_inference_server_process_outlives_the_fork_server(dev_shm_guard):
    factories = [functools.partial(OracleEnv, env_id=i) for i in range(4)]
    c = AsyncPoolCollector(factories, policy_factory=OracleTagPolicy, frames_per_batch=16, total_frames=320)
    try:
        batches = iter(c)
        checker = OracleChecker()
        checker.observe_transitions(next(batches))
        _kill_fork_server()
        for batch in batches:  # the server's monitor watches the process, not the fork server
            checker.observe_transitions(batch)
        assert checker.records == 320
    finally:
        c.shutdown()
