"""A worker whose main thread has exited while its process runs on (a crash whose teardown is
slow, or a thread the env left running): its death descriptor stays quiet, so the pool reads the
main thread's state from ``/proc`` (``torchrl_asyncpool._sys.exit_begun``). With
``on_env_failure="restart"`` it is replaced and the oracle proves nothing is lost or duplicated;
with ``"raise"`` the consumer raises :class:`WorkerDiedError` with its exit code instead of
waiting on it for good."""
import ctypes
import functools
import multiprocessing
import platform
import subprocess
import sys
import threading
import time

import pytest
from tensordict import TensorDict

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, InferenceServerError, WorkerDiedError
from torchrl_asyncpool._sys.exit_begun import exit_begun
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, oracle_action

#: exit(2), which ends the calling thread alone (exit_group(2) ends the process)
_SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(platform.machine())
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or _SYS_EXIT is None,
                                reason="needs Linux's /proc and exit(2) on x86_64 or aarch64")
_CODE = 7


class _MainThreadExits(OracleEnv):
    """An oracle env that ends its worker's main thread alone at global step ``exit_at``, with a
    thread of its own left running: the process lingers, its main thread a zombie."""

    def __init__(self, env_id, *, exit_at, **kwargs):
        super().__init__(env_id, **kwargs)
        self.exit_at = exit_at
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()

    def _step(self, tensordict):
        # in a worker only: a collector's start-up probe steps its spec env in this process
        if self.total_steps + 1 == self.exit_at and multiprocessing.parent_process() is not None:
            ctypes.CDLL(None).syscall(_SYS_EXIT, _CODE)
        return super()._step(tensordict)


def _envs(n, exit_at):
    return [functools.partial(_MainThreadExits, i, exit_at=exit_at) for i in range(n)]


def _oracle_policy():
    return lambda td: td.set("action", oracle_action(td["tag"]))


def _answer(pool, td):
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)


def test_exit_begun_reads_a_main_thread_that_exited_alone():
    code = (f"import ctypes, threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            f"time.sleep(0.2)\nctypes.CDLL(None).syscall({_SYS_EXIT}, 5)")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert exit_begun(p.pid) is None  # running
        deadline = time.monotonic() + 30
        while exit_begun(p.pid) is None:
            assert time.monotonic() < deadline, "the main thread's exit was not seen"
            time.sleep(0.02)
        assert exit_begun(p.pid) == 5 and p.poll() is None  # the process lingers
    finally:
        p.kill()
        p.wait()


def test_with_restart_a_lingering_worker_is_replaced_and_records_stay_exact(dev_shm_guard):
    checker = OracleChecker()
    with AsyncEnvPool(_envs(4, exit_at=30), envs_per_worker=2, on_env_failure="restart",
                      max_restarts_per_env=100, max_restarts=None) as pool:
        t0 = time.monotonic()
        while pool.worker_restarts < 4:  # each rebuilt env exits again 30 steps on
            td = pool.recv(min_get=1, timeout=10)
            checker.observe_batch(td)
            _answer(pool, td)
            assert time.monotonic() - t0 < 60, "the lingering workers were not replaced"
        info = pool.restart_info()
    assert checker.restarts >= 4
    assert all(cause.startswith("worker\n") and f"died (exit code {_CODE})" in cause for _, cause in info.values())


def test_with_raise_a_lingering_worker_is_a_worker_died_error_not_a_wait():
    with AsyncEnvPool(_envs(2, exit_at=5)) as pool:
        t0 = time.monotonic()
        died = rf"worker \d \(pid \d+, hosting envs \[\d\]\) died \(exit code {_CODE}\)"
        with pytest.raises(WorkerDiedError, match=died):
            for _ in range(100):  # both exit at their 5th step: no record comes after
                td = pool.recv(min_get=1, timeout=30)
                _answer(pool, td)
        assert time.monotonic() - t0 < 20  # seen within an exit check (0.25 s), not after recv's 30 s


def test_the_collector_delivers_exactly_through_lingering_workers(dev_shm_guard):
    checker = OracleChecker()
    collector = AsyncPoolCollector(_envs(4, exit_at=50), policy=_oracle_policy(), frames_per_batch=32,
                                   total_frames=640, envs_per_worker=2,
                                   on_env_failure="restart", max_restarts_per_env=100, max_restarts=None)
    try:
        frames = 0
        for batch in collector:
            checker.observe_transitions(batch)
            frames += batch.numel()
        assert frames == 640 and collector.env.worker_restarts >= 2
    finally:
        collector.shutdown()


@pytest.mark.parametrize("server,error,died", [
    ("thread", WorkerDiedError, rf"died \(exit code {_CODE}\)"),
    # the consumer in the server process watches the workers' main threads too; the server
    # process's failure carries the worker's death
    ("process", InferenceServerError, rf"worker \d .*died \(exit code {_CODE}\)"),
])
def test_the_collector_raises_a_lingering_worker_with_raise(server, error, died):
    policy = dict(policy=_oracle_policy()) if server == "thread" else dict(policy_factory=_oracle_policy)
    collector = AsyncPoolCollector(_envs(2, exit_at=5), frames_per_batch=4, total_frames=-1, **policy)
    t0 = time.monotonic()
    try:
        with pytest.raises(error, match=died):
            for _ in collector:
                assert time.monotonic() - t0 < 30, "the collector waited on a worker that runs no more"
    finally:
        collector.shutdown(raise_on_error=False)
