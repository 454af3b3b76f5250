"""Builds after start-up are watched like steps: a factory that hangs while rebuilding an env (in
its worker, or in the worker that replaces a killed one) is killed after ``build_timeout``,
counted against the env's restart budget, and ends in a named error past it, or the env is back."""
import functools
import os
import signal
import time

import numpy as np
import pytest
from tensordict import TensorDict

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, EnvError
from torchrl_asyncpool.testing import OracleEnv, oracle_action


class _HangingFactory:
    """Env 1's factory: its first build (at start-up) returns an OracleEnv (failing at its 5th
    step with ``fail_first``); the next ``hangs`` builds hang for an hour (counted in a file, so
    replacement processes count too); later builds return an OracleEnv that does not fail."""

    def __init__(self, path, hangs, fail_first):
        self.path, self.hangs, self.fail_first = path, hangs, fail_first

    def __call__(self):
        count = int(open(self.path).read()) if os.path.exists(self.path) else 0
        with open(self.path, "w") as f:
            f.write(str(count + 1))
        if 1 <= count <= self.hangs:
            time.sleep(3600)
        return OracleEnv(env_id=1, fail_at_step=5 if count == 0 and self.fail_first else None)


def _factories(tmp_path, hangs, fail_first=True):
    return [lambda: OracleEnv(env_id=0), _HangingFactory(str(tmp_path / "builds"), hangs, fail_first)]


def _serve(pool, seconds, kill_worker_of=None):
    """Answers every record for ``seconds``; returns the env indices that delivered, in order."""
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            td = pool.recv(min_get=1, timeout=0.2)
        except TimeoutError:
            continue
        seen.extend(td.env_indices.tolist())
        pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
        if kill_worker_of is not None and len(seen) > 20:
            os.kill(pool.worker_pids[int(pool._slot_worker[kill_worker_of])], signal.SIGKILL)
            kill_worker_of = None
    return seen


@pytest.mark.parametrize("how", ["env-failure", "worker-killed"])
def test_a_factory_that_always_hangs_on_rebuild_ends_in_a_named_error(tmp_path, how):
    budget, build_timeout = 2, 1.0
    t0 = time.monotonic()
    with pytest.raises(EnvError) as info:
        with AsyncEnvPool(_factories(tmp_path, hangs=100, fail_first=how == "env-failure"), on_env_failure="restart",
                          max_restarts_per_env=budget, build_timeout=build_timeout) as pool:
            _serve(pool, 60, kill_worker_of=1 if how == "worker-killed" else None)
    elapsed = time.monotonic() - t0
    assert info.value.env_index == 1 and info.value.phase == "build", str(info.value)
    assert "factory hung" in str(info.value) and "build_timeout=1s" in str(info.value)
    assert "restart budget exhausted" in str(info.value)
    assert elapsed < build_timeout * budget + 30, elapsed  # a few seconds over the builds' limit, not 60


def test_a_factory_that_hangs_once_gets_its_env_back(tmp_path):
    with AsyncEnvPool(_factories(tmp_path, hangs=1), on_env_failure="restart",
                      max_restarts_per_env=5, build_timeout=1.0) as pool:
        seen = _serve(pool, 8)
        info = pool.restart_info()
    after = seen[len(seen) // 2:]
    assert 1 in after, "env 1 never came back after its hung rebuild"
    count, cause = info[1]  # the hung build is the last failure on record (its worker died mid-rebuild)
    assert count >= 1 and cause.splitlines()[0] == "build" and "factory hung" in cause, (count, cause)


def test_build_timeout_auto_resolves_from_the_measured_start_up():
    with AsyncEnvPool([lambda: OracleEnv(env_id=0)], on_env_failure="restart") as pool:
        assert isinstance(pool.build_timeout, float) and pool.build_timeout >= 60.0


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_bad_build_timeouts_are_refused(value):
    with pytest.raises(ValueError, match="build_timeout must be 'auto', None or a positive number of seconds"):
        AsyncEnvPool([lambda: OracleEnv(env_id=0)], build_timeout=value)


def test_the_collector_takes_build_timeout(tmp_path):
    # endless: env 0 alone keeps delivering while env 1's rebuild hangs (a fixed frame count could
    # be reached before the hang is found); the error must come within a minute
    collector = AsyncPoolCollector(_factories(tmp_path, hangs=100),
                                   policy=lambda td: td.set("action", oracle_action(td["tag"])),
                                   frames_per_batch=8, total_frames=-1, on_env_failure="restart",
                                   max_restarts_per_env=1, build_timeout=1.0)
    try:
        end = time.monotonic() + 60
        with pytest.raises(EnvError, match="factory hung"):
            for _ in collector:
                assert time.monotonic() < end, "env 1's hung rebuild was not reported within 60 s"
    finally:
        collector.shutdown()


def test_a_build_mark_older_than_the_workers_is_not_a_hung_build():
    """Every mark a worker writes is a ``time.monotonic()`` taken after the pool started it; a
    smaller positive value in ``build_since`` is no build of this pool and kills no worker."""
    with AsyncEnvPool([lambda: OracleEnv(env_id=0), lambda: OracleEnv(env_id=1)], on_env_failure="restart",
                      build_timeout=1.0) as pool:
        pool._arena.build_since[1] = 1.0  # "a build that began at 1 s of uptime"
        pool._watchdog()
        pool._arena.build_since[1] = 0.0
        assert pool.worker_restarts == 0 and all(p.is_alive() for p in pool._procs)
        mark = pool._arena_clock_floor + 0.01  # a mark a worker could have written, past build_timeout
        while time.monotonic() - mark < 1.5:
            time.sleep(0.1)
        pool._arena.build_since[1] = mark
        deadline = time.monotonic() + 30
        while pool.worker_restarts == 0 and time.monotonic() < deadline:
            pool._watchdog()
            time.sleep(0.05)
        assert pool.worker_restarts == 1 and "factory hung" in pool.restart_info()[1][1]


class _EndsOnReread(np.ndarray):
    """``build_since`` (or ``busy_since``) as a watchdog sees it when the build or step it found
    over its limit ends before it reads the entry again: the worker has written 0 meanwhile."""

    def __getitem__(self, key):
        if isinstance(key, int):
            return np.float64(0.0)
        return super().__getitem__(key)


def _watchdog_over(marks, monkeypatch, step=False):
    """A watchdog (the pool's methods on a stand-in) over one worker of two slots whose slot 1
    carries ``marks[1]``; ``exit_code`` says the worker has exited (nothing to kill). No clock floor:
    the re-read alone must tell an ended build or step."""
    from types import SimpleNamespace

    from torchrl_asyncpool.pool import watchdog

    monkeypatch.setattr(watchdog, "exit_code", lambda p, timeout=0.0: 0)
    arena = SimpleNamespace(build_since=np.zeros(2), busy_since=np.zeros(2), ready_time=np.zeros(2))
    setattr(arena, "busy_since" if step else "build_since", marks)
    dog = SimpleNamespace(_arena=arena, _slot_worker=np.zeros(2, np.int64), _timed_out={}, _started_at={},
                          build_timeout=1.0, step_timeout=1.0, _procs=[None], _arena_clock_floor=0.0,
                          _killed_at={}, _cls=watchdog._PoolWatchdog)
    dog._kill = functools.partial(watchdog._PoolWatchdog._kill, dog)
    return dog


def test_a_killed_worker_whose_exit_lingers_is_replaced_all_the_same(monkeypatch):
    """A worker the watchdog killed runs none of its own code after the kill, but its exit may
    take long (the kernel's teardown of its memory, in its SCHED_IDLE idle poller on a busy
    core, took over a minute): it is replaced once the kill is _KILLED_GRACE_S old, without
    waiting for its death descriptor; a worker it did not kill waits for that descriptor."""
    import threading
    from types import SimpleNamespace

    from torchrl_asyncpool.pool import watchdog

    replaced = []
    dog = SimpleNamespace(_watched=True, _closed=False, _watch_lock=threading.Lock(), step_timeout=None,
                          build_timeout=None, _sentinel_poll=SimpleNamespace(poll=lambda timeout: []),
                          _sentinel_fds={}, _exiting=[], _replace=replaced.append, _last_exit_check=time.monotonic(),
                          _killed_at={0: time.monotonic() - 5 * watchdog._KILLED_GRACE_S, 1: time.monotonic()})
    watchdog._PoolWatchdog._watchdog(dog)
    assert replaced == [0]  # worker 1's kill is too recent, and nothing else is dead


@pytest.mark.parametrize("ends", [True, False])
def test_a_build_that_ends_while_the_watchdog_looks_is_not_hung(ends, monkeypatch):
    """The worker writes ``build_since`` while the watchdog reads it: a build found past
    ``build_timeout`` that is over when its entry is read again kills nothing (a CI run once
    killed a worker for a build that "had run" the machine's uptime: now - 0)."""
    marks = np.array([0.0, 20.0])
    dog = _watchdog_over(marks.view(_EndsOnReread) if ends else marks, monkeypatch)
    dog._cls._kill_hung_builds(dog, now=30.0)
    assert dog._timed_out == ({} if ends else {0: (1, "build", 10.0)})


@pytest.mark.parametrize("ends", [True, False])
def test_a_step_that_ends_while_the_watchdog_looks_is_not_hung(ends, monkeypatch):
    marks = np.array([0.0, 20.0])
    dog = _watchdog_over(marks.view(_EndsOnReread) if ends else marks, monkeypatch, step=True)
    dog._arena.request = {"step_type": np.zeros(2, np.uint8)}
    dog._cls._kill_hung(dog, now=30.0)
    assert dog._timed_out == ({} if ends else {0: (1, "step", 10.0)})
