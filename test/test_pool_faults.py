"""Fault injection for AsyncEnvPool: bad sends, failing envs, dead workers, timeouts, close and leaks.

Every test owns its pool through a context manager (or try/finally), so a failing assertion
never leaves worker processes behind. Timing bounds are generous: the machine running the
suite may be small and busy. Where the intent is "within 2 s" the assertion allows ~6 s.
"""
from __future__ import annotations

import functools
import json
import multiprocessing as mp
import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from tensordict import TensorDict

from torchrl_asyncpool import AsyncEnvPool, EnvError, PoolClosedError, StepType, WorkerDiedError
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, oracle_action

# "within 2 s" is the requirement; the assertion allows this much on a loaded machine.
_PROMPT_S = 6.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- helpers ------------------------------------------------------------------------------------
def _factories(n, per_env=None, **kwargs):
    """One OracleEnv factory per slot (env id == slot index); ``per_env[i]`` adds kwargs to env i."""
    per_env = per_env or {}
    return [functools.partial(OracleEnv, env_id=i, **{**kwargs, **per_env.get(i, {})}) for i in range(n)]


def _answer(pool, td, checker=None):
    """Checks a received batch and answers it with the oracle policy."""
    if checker is not None:
        checker.observe_batch(td)
    b = td.batch_size[0]
    indices = td.env_indices if hasattr(td, "env_indices") else td["env_index"]  # sub-batches lose it
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, [b]), indices)


def _drive(pool, checker, rounds, min_get=1):
    for _ in range(rounds):
        _answer(pool, pool.recv(min_get=min_get), checker)


def _proc_state(pid):
    """The one-letter state of ``pid`` from /proc, or ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _wait_until(predicate, timeout, interval=0.02):
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _assert_reaped(pids, timeout=3.0):
    """After close(): every worker process is gone, reaped (no /proc entry) and not a child."""
    ok = _wait_until(lambda: all(_proc_state(p) is None for p in pids), timeout)
    assert ok, f"worker processes still exist after close: {[(p, _proc_state(p)) for p in pids if _proc_state(p)]}"
    alive_children = {c.pid for c in mp.active_children()}
    assert not alive_children & set(pids), f"multiprocessing still lists workers {alive_children & set(pids)}"


def _assert_dead_or_zombie(pids, timeout, what="process"):
    """Processes orphaned to an init that may not reap them: a zombie ('Z') counts as gone."""
    ok = _wait_until(lambda: all(_proc_state(p) in (None, "Z", "X") for p in pids), timeout)
    assert ok, (
        f"{what} still running: "
        f"{[(p, _proc_state(p), _cmdline(p)) for p in pids if _proc_state(p) not in (None, 'Z', 'X')]}"
    )


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _children(pid):
    out = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.update(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _cpu_seconds(pids):
    """utime + stime (all threads) of ``pids``, in seconds."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)
    return total / _CLK_TCK


def _shm_users(names, exclude_pids):
    """Entries of /dev/shm in ``names`` that some process outside ``exclude_pids`` maps or opens."""
    used = set()
    paths = {f"/dev/shm/{n}": n for n in names}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude_pids:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                maps = f.read()
            for path, name in paths.items():
                if path in maps:
                    used.add(name)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target in paths:
                    used.add(paths[target])
        except OSError:
            continue
    return used


def _new_shm_entries(before, ours=()):
    """Entries that appeared in /dev/shm since ``before`` and that belong to no other process.

    Other programs share the machine (and its /dev/shm) with the test run, so the diff is
    filtered: an entry that another live process maps or holds open is theirs, short-lived
    entries (created and unlinked at once) get a moment to vanish, and multiprocessing
    semaphores (``sem.mp-*``, which other programs leak in bulk when killed) are left to
    :func:`_shm_files_used_by`: a semaphore is mapped for as long as it exists in its
    process, so one of ours would have shown up there while the pool was alive.
    """
    new = {e for e in set(os.listdir("/dev/shm")) - before if not e.startswith("sem.mp-")}
    if new:
        time.sleep(0.3)
        new &= set(os.listdir("/dev/shm"))
        new -= _shm_users(new, exclude_pids={os.getpid(), *ours})
    return sorted(new)


def _shm_files_used_by(pids):
    """/dev/shm files that ``pids`` map or hold open, as ``{pid: [paths]}`` (exact attribution)."""
    out = {}
    for pid in pids:
        paths = set()
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    paths.add(target)
        except OSError:
            continue
        if paths:
            out[pid] = sorted(paths)
    return out


def _bad(td, shift=1):
    """Actions that differ from the oracle policy: if any leaked into a slot, the echo check fails."""
    return (oracle_action(td["tag"]) + shift) % 1000


# -- wrong actions and indices: ValueError, nothing written, pool still usable -------------------
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_send_wrong_action_raises_value_error_and_pool_stays_usable(envs_per_worker, env_threads):
    n = 4
    checker = OracleChecker()
    with AsyncEnvPool(_factories(n), envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        _drive(pool, checker, rounds=5, min_get=n)
        td = pool.recv(min_get=n)
        checker.observe_batch(td)
        idx = td.env_indices
        b = int(idx.numel())
        wrong = _bad(td)
        cases = [
            # (actions, substrings the message must contain)
            (TensorDict({"act": wrong}, [b]), ["'action'", "'act'"]),
            ({"not_action": wrong}, ["'action'", "'not_action'"]),
            (TensorDict({"action": wrong.unsqueeze(-1)}, [b]), ["'action'", f"({b},)", f"({b}, 1)"]),
            ({"action": wrong.to(torch.float32)}, ["'action'", "torch.int64", "torch.float32"]),
            ({"action": wrong.to(torch.int32)}, ["'action'", "torch.int64", "torch.int32"]),
            ({"action": wrong[:-1]}, ["'action'", f"({b},)", f"({b - 1},)"]),
            ({"action": wrong.tolist()}, ["'action'", f"({b},)", "list"]),
        ]
        for actions, needles in cases:
            with pytest.raises(ValueError) as info:
                pool.send(actions, idx)
            msg = str(info.value)
            for needle in needles:
                assert needle in msg, f"ValueError message {msg!r} lacks {needle!r}"
        # nothing was written and the slots are still leased: the right answer goes through...
        pool.send({"action": oracle_action(td["tag"])}, idx)
        # ...and every env received exactly that action (echo), in an exact record stream
        _drive(pool, checker, rounds=30)
    assert checker.records >= n * 6 + 30


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_send_bad_indices_raise_value_error_and_pool_stays_usable(envs_per_worker, env_threads):
    n = 4
    checker = OracleChecker()
    with AsyncEnvPool(_factories(n), envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        # nothing has been received yet: no index is awaiting an action
        with pytest.raises(ValueError, match="not awaiting an action"):
            pool.send({"action": torch.zeros(1, dtype=torch.int64)}, [0])
        td = pool.recv(min_get=n)
        checker.observe_batch(td)
        tags = {int(i): td["tag"][k] for k, i in enumerate(td.env_indices.tolist())}

        def act(indices, shift=1):
            tag = torch.stack([tags[i % n] for i in indices])  # out-of-range indices get some tag
            return {"action": (oracle_action(tag) + shift) % 1000}

        bad_cases = [
            ([0, 0], "repeat"),
            ([1, 2, 1], "repeat"),
            ([n], "lie in"),
            ([0, n + 5], "lie in"),
            ([-1], "lie in"),
            ([], "no env indices"),
        ]
        for indices, match in bad_cases:
            with pytest.raises(ValueError, match=match):
                pool.send(act(indices) if indices else {"action": torch.zeros(0, dtype=torch.int64)}, indices)
            with pytest.raises(ValueError, match=match):  # the same as a tensor
                pool.send(act(indices) if indices else {"action": torch.zeros(0, dtype=torch.int64)},
                          torch.tensor(indices, dtype=torch.int64))
        with pytest.raises(ValueError, match="integer"):
            pool.send(act([0]), torch.tensor([0.0]))
        # answer env 3 correctly; answering it again, alone or with a leased index, is refused
        pool.send(act([3], shift=0), torch.tensor([3]))
        with pytest.raises(ValueError, match=r"not awaiting an action"):
            pool.send(act([3]), [3])
        with pytest.raises(ValueError, match=r"\[3\]"):
            pool.send(act([0, 3]), [0, 3])  # 0 is leased, 3 is not: nothing may be written to 0
        # the remaining leased envs (0, 1, 2) take their right answers: nothing leaked before
        pool.send(act([0, 1, 2], shift=0), torch.tensor([0, 1, 2]))
        _drive(pool, checker, rounds=30)
    assert checker.records >= n + 30


# -- an env raising in step / reset / construction -----------------------------------------------
def _drive_until_error(pool, checker, n, max_rounds=60, reset_failing_env=None):
    """Lockstep rounds until the pool raises; returns (error, per-env count of step records).

    The terminal record of ``reset_failing_env`` (whose autoreset raises) is answered on its
    own: its worker may already have failed, and then that answer must raise the EnvError.
    """
    steps = [0] * n
    for _ in range(max_rounds):
        try:
            td = pool.recv(min_get=n)
        except EnvError as err:
            return err, steps
        checker.observe_batch(td)
        idx, st = td.env_indices.tolist(), td["step_type"].tolist()
        for i, s in zip(idx, st):
            steps[i] += s != int(StepType.FIRST)
        alone = [
            k for k, (i, s) in enumerate(zip(idx, st)) if i == reset_failing_env and s >= int(StepType.TERMINATION)
        ]
        rest = [k for k in range(len(idx)) if k not in alone]
        try:
            _answer(pool, td[torch.tensor(rest)] if alone else td)
            if alone:
                _answer(pool, td[torch.tensor(alone)])
        except EnvError as err:
            return err, steps
    raise AssertionError(f"no EnvError after {max_rounds} rounds")


def _assert_env_error(err, index, phase, needle):
    msg = str(err)
    assert err.env_index == index
    assert err.phase == phase
    assert f"env {index}" in msg, msg
    assert needle in msg, f"the worker traceback is missing from {msg!r}"
    assert "Traceback (most recent call last)" in msg
    assert needle in err.worker_traceback


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_env_raising_in_step_raises_env_error(envs_per_worker, env_threads):
    n = 4
    checker = OracleChecker()
    with AsyncEnvPool(_factories(n, per_env={1: {"fail_at_step": 3}}),
                      envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        pids = pool.worker_pids
        err, steps = _drive_until_error(pool, checker, n)
        _assert_env_error(err, 1, "step", "scripted failure at step 3")
        assert steps[1] == 2, f"env 1 delivered {steps[1]} step records before its 3rd step failed"
        # the error is sticky: the pool must be closed
        with pytest.raises(EnvError):
            pool.recv(timeout=0)
        with pytest.raises(EnvError):
            pool.send({"action": torch.zeros(1, dtype=torch.int64)}, [0])
    _assert_reaped(pids)


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_env_raising_in_autoreset_raises_env_error(envs_per_worker, env_threads):
    """Reset count 1 is the initial reset; 2 is the first autoreset (after env 1's first episode)."""
    n = 4
    checker = OracleChecker()
    with AsyncEnvPool(_factories(n, per_env={1: {"fail_on_reset": 2}}),
                      envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        pids = pool.worker_pids
        err, steps = _drive_until_error(pool, checker, n, reset_failing_env=1)
        _assert_env_error(err, 1, "reset", "scripted failure on reset 2")
        # env 1's first episode has 4 steps; its terminal record may or may not have been delivered
        assert steps[1] in (3, 4)
        with pytest.raises(EnvError):
            pool.recv(timeout=0)
    _assert_reaped(pids)


_EAGER_RESET_BUG = (
    "library bug: a worker's eager autoreset that raises overwrites the consumer's LEASED state word "
    "with ERROR, and send() then reports ValueError 'not awaiting an action' instead of the EnvError "
    "(consumer.py send checks lease state before slot errors)"
)


def _slow_failing_reset_factory(fail_on_reset, delay):
    def make(env_id):
        class SlowResetOracle(OracleEnv):
            def _reset(self, tensordict=None, **kwargs):
                if self.resets >= 1:  # not the initial reset
                    time.sleep(delay)
                return OracleEnv._reset(self, tensordict, **kwargs)

        return SlowResetOracle(env_id=env_id, fail_on_reset=fail_on_reset)

    return make


def test_send_after_failed_eager_autoreset_raises_env_error():
    """The worker resets eagerly right after a terminal record; if that reset raises while the
    consumer holds the terminal record, the answer is accepted (the slot is the consumer's, the
    worker may not touch it) and the next recv raises the EnvError of the reset.

    The autoreset sleeps 0.3 s before raising, so the consumer surely leases the terminal record
    first and answers it after the failure."""
    make = _slow_failing_reset_factory(fail_on_reset=2, delay=0.3)
    with AsyncEnvPool([functools.partial(make, env_id=0)]) as pool:
        td = pool.recv()
        _answer(pool, td)
        td = pool.recv()  # env 0's first episode is one step long: this record is terminal
        assert td["step_type"].tolist() == [int(StepType.TRUNCATION)]
        time.sleep(0.8)  # the eager autoreset fails meanwhile
        _answer(pool, td)
        with pytest.raises(EnvError) as info:
            pool.recv(timeout=10)
        _assert_env_error(info.value, 0, "reset", "scripted failure on reset 2")


@pytest.mark.parametrize("fault", ["env_error", "sigkill"])
def test_fault_is_raised_even_while_other_envs_are_ready(fault):
    """Docs: a failure makes the *next* recv raise, also when other records are ready."""
    per_env = {1: {"fail_at_step": 1}} if fault == "env_error" else {}
    with AsyncEnvPool(_factories(2, per_env=per_env)) as pool:
        td = pool.recv(min_get=2)
        if fault == "env_error":
            _answer(pool, td)  # env 0 steps, env 1 fails
        else:
            _answer(pool, td[torch.tensor([0])])  # env 0 steps, env 1 stays leased
            assert pool.death_info(1) == "exit code None"  # still running
            os.kill(pool.worker_pids[1], signal.SIGKILL)
        time.sleep(1.0)  # env 0 has published its next record; env 1 has failed / died
        expected = EnvError if fault == "env_error" else WorkerDiedError
        with pytest.raises(expected) as info:
            pool.recv()
        if fault == "sigkill":
            assert pool.death_info(1) == "killed by signal 9" and "killed by signal 9" in str(info.value)


def test_consumer_raises_a_workers_env_error_once_asked_and_again_after():
    """``SlotConsumer.raise_worker_errors``: the health check a driver thread runs between
    batches (the collector's ``check_errors``) raises the env's error, and keeps raising it."""
    with AsyncEnvPool(_factories(2, per_env={1: {"fail_at_step": 1}})) as pool:
        consumer = pool._local_consumer()  # the SlotConsumer that recv/send drive
        consumer.raise_worker_errors()  # nothing wrong yet: returns
        _answer(pool, pool.recv(min_get=2))  # env 1 fails on this step
        assert _wait_until(lambda: _raises(consumer.raise_worker_errors), 10)
        for _ in range(2):
            with pytest.raises(EnvError) as info:
                consumer.raise_worker_errors()
            _assert_env_error(info.value, 1, "step", "OracleEnv 1: scripted failure at step 1")


def _raises(fn) -> bool:
    try:
        fn()
    except Exception:  # noqa: BLE001 - any error counts
        return True
    return False


def _raising_factory_for(bad_index):
    def make(env_id):
        if env_id == bad_index:
            raise RuntimeError(f"scripted failure constructing env {env_id}")
        return OracleEnv(env_id=env_id)

    return make


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_env_raising_in_constructor_makes_pool_constructor_raise(envs_per_worker, env_threads):
    make = _raising_factory_for(2)  # a closure: cloudpickled by value into the workers
    fns = [functools.partial(make, env_id=i) for i in range(4)]
    before = {p.pid for p in mp.active_children()}
    pool = None
    try:
        with pytest.raises(EnvError) as info:
            pool = AsyncEnvPool(fns, envs_per_worker=envs_per_worker, env_threads=env_threads)
    finally:
        if pool is not None:
            pool.close()
    _assert_env_error(info.value, 2, "construction", "scripted failure constructing env 2")
    _assert_no_new_children(before)


def _assert_no_new_children(before):
    """The workers that did start were stopped (and reaped) by the failed constructor."""
    _wait_until(lambda: not ({p.pid for p in mp.active_children()} - before), 3.0)
    leftover = {p.pid for p in mp.active_children()} - before
    assert not leftover, f"worker processes left after a failed start: {leftover}"
    assert all(_proc_state(p) is None for p in leftover)


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_env_raising_in_initial_reset_makes_pool_constructor_raise(envs_per_worker, env_threads):
    """Reset count 1 is the initial reset, done by the worker during start-up."""
    before = {p.pid for p in mp.active_children()}
    pool = None
    try:
        with pytest.raises(EnvError) as info:
            pool = AsyncEnvPool(_factories(4, per_env={3: {"fail_on_reset": 1}}),
                                envs_per_worker=envs_per_worker, env_threads=env_threads)
    finally:
        if pool is not None:
            pool.close()
    _assert_env_error(info.value, 3, "reset", "scripted failure on reset 1")
    _assert_no_new_children(before)


def _dying_factory_for(bad_index):
    def make(env_id):
        if env_id == bad_index and os.environ.get("_FAULTS_PARENT_PID") != str(os.getpid()):
            os.kill(os.getpid(), signal.SIGKILL)  # only in the worker, not in the spec env
        return OracleEnv(env_id=env_id)

    return make


def test_worker_dying_during_start_up_makes_pool_constructor_raise(monkeypatch):
    monkeypatch.setenv("_FAULTS_PARENT_PID", str(os.getpid()))
    make = _dying_factory_for(0)
    before = {p.pid for p in mp.active_children()}
    pool = None
    try:
        with pytest.raises(WorkerDiedError) as info:
            pool = AsyncEnvPool([functools.partial(make, env_id=i) for i in range(2)])
    finally:
        if pool is not None:
            pool.close()
    msg = str(info.value)
    assert "worker 0" in msg and "[0]" in msg and "signal 9" in msg, msg
    _assert_no_new_children(before)


# -- a worker killed with SIGKILL ----------------------------------------------------------------
def _kill_message_ok(err, worker, pid, envs):
    msg = str(err)
    assert f"worker {worker}" in msg, msg
    assert str(pid) in msg, msg
    assert str(envs) in msg, msg
    assert "signal 9" in msg or "SIGKILL" in msg, msg
    assert err.env_indices == tuple(envs)  # for callers that recover per env (evaluation)
    clone = pickle.loads(pickle.dumps(err))  # crosses processes (an inference server's errors)
    assert (str(clone), clone.env_indices) == (msg, err.env_indices)


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_sigkilled_worker_raises_worker_died_in_blocked_recv(envs_per_worker, env_threads):
    n = 4
    with AsyncEnvPool(_factories(n), envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        pids = pool.worker_pids
        pool.recv(min_get=n)  # every env is now leased: nothing will become ready
        victim = 1
        envs = [i for i in range(n) if i // envs_per_worker == victim]
        os.kill(pids[victim], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            pool.recv()  # timeout=None: only the death can end this call
        elapsed = time.monotonic() - t0
        assert elapsed < _PROMPT_S, f"WorkerDiedError took {elapsed:.2f}s"
        _kill_message_ok(info.value, victim, pids[victim], envs)
        # sticky
        with pytest.raises(WorkerDiedError):
            pool.recv(timeout=0)
        with pytest.raises(WorkerDiedError):
            pool.send({"action": torch.zeros(1, dtype=torch.int64)}, [0])
    _assert_reaped(pids)


def test_sigkilled_worker_wakes_recv_blocked_in_another_thread():
    n = 4
    with AsyncEnvPool(_factories(n), envs_per_worker=2) as pool:
        pids = pool.worker_pids
        pool.recv(min_get=n)
        outcome = {}

        def consumer():
            try:
                outcome["result"] = pool.recv()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                outcome["error"] = e
            outcome["t"] = time.monotonic()

        th = threading.Thread(target=consumer, daemon=True)
        th.start()
        time.sleep(0.3)
        assert th.is_alive() and not outcome, f"recv returned before the kill: {outcome}"
        t_kill = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        th.join(_PROMPT_S)
        assert not th.is_alive(), "recv blocked in another thread was not woken by the worker's death"
        assert "error" in outcome, f"recv returned {outcome.get('result')} instead of raising"
        if not isinstance(outcome["error"], WorkerDiedError):
            raise outcome["error"]
        assert outcome["t"] - t_kill < _PROMPT_S
        _kill_message_ok(outcome["error"], 0, pids[0], [0, 1])
    _assert_reaped(pids)


def _sleep_forever():
    time.sleep(600)


def test_a_killed_childs_exit_status_reads_the_same_from_many_threads():
    """A fork server's child reports its status once on its sentinel pipe; ``Popen.poll`` from
    two threads at once let the second record exit code 255 (EOF), which a script whose worker
    was SIGKILLed once printed instead of "killed by signal 9". ``exit_code`` serializes it."""
    from torchrl_asyncpool._sys.forkserver import exit_code, forkserver_context

    ctx = forkserver_context()
    for _ in range(10):  # a raw ``p.join(); p.exitcode`` read 255 in 7 of 20 such rounds
        p = ctx.Process(target=_sleep_forever, daemon=True)
        p.start()
        os.kill(p.pid, signal.SIGKILL)
        barrier = threading.Barrier(8)
        codes = []

        def read():
            barrier.wait()
            codes.append(exit_code(p, 10.0))

        threads = [threading.Thread(target=read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert codes == [-signal.SIGKILL] * 8, codes
        assert p.exitcode == -signal.SIGKILL


# -- recv timeout: TimeoutError, nothing lost --------------------------------------------------
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_recv_timeout_loses_nothing(envs_per_worker, env_threads):
    n = 4
    checker = OracleChecker()
    # first steps sleep 0, 0.1, 0.2 and 0.3 s (delay factor (env_id % 4) / 2 at t=0, episode 0)
    with AsyncEnvPool(_factories(n, step_delay=0.2), envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        _answer(pool, pool.recv(min_get=n), checker)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            pool.recv(min_get=n, timeout=0.05)  # env 3 cannot be ready before 0.3 s
        elapsed = time.monotonic() - t0
        assert 0.045 <= elapsed < _PROMPT_S
        td = pool.recv(min_get=n, max_get=n, timeout=30.0)
        assert sorted(td.env_indices.tolist()) == list(range(n)), "records were lost by the timed-out call"
        _answer(pool, td, checker)
        # a poll (timeout=0) that cannot be met raises at once and consumes nothing either
        with pytest.raises(TimeoutError):
            pool.recv(min_get=n, timeout=0)
        _drive(pool, checker, rounds=4, min_get=n)
    assert checker.records == n * 6


def test_recv_with_timeout_returns_once_every_env_is_ready():
    n = 2
    with AsyncEnvPool(_factories(n)) as pool:
        t0 = time.monotonic()
        td = pool.recv(min_get=n, timeout=2.0)  # the constructor waited for every first record
        elapsed = time.monotonic() - t0
        assert td.batch_size[0] == n
        assert elapsed < 1.0, f"recv waited {elapsed:.2f}s for records that cannot exist"


# -- close ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_close_under_load_is_prompt_and_reaps_workers(envs_per_worker, env_threads):
    n = 4
    pool = AsyncEnvPool(_factories(n, step_delay=0.5), envs_per_worker=envs_per_worker, env_threads=env_threads)
    try:
        pids = pool.worker_pids
        td = pool.recv(min_get=n)
        # answer the first records until most envs are mid-step (delays up to 0.75 s per step)
        _answer(pool, td)
        td = pool.recv(min_get=1)  # env 0 steps instantly; the others are still sleeping
        _answer(pool, td)
        time.sleep(0.05)
    finally:
        t0 = time.monotonic()
        pool.close()
        elapsed = time.monotonic() - t0
    assert elapsed < _PROMPT_S, f"close() took {elapsed:.2f}s with envs mid-step"
    _assert_reaped(pids)


def test_close_is_idempotent_and_closed_pool_refuses_use():
    n = 2
    with AsyncEnvPool(_factories(n)) as pool:
        pids = pool.worker_pids
        td = pool.recv(min_get=n)
    # the context manager closed it
    _assert_reaped(pids)
    with pytest.raises(PoolClosedError):
        pool.recv()
    with pytest.raises(PoolClosedError):
        pool.recv(timeout=0)
    with pytest.raises(PoolClosedError):
        pool.send({"action": oracle_action(td["tag"])}, td.env_indices)
    pool.close()
    pool.close()

    pool = AsyncEnvPool(_factories(n))
    try:
        pids = pool.worker_pids
    finally:
        pool.close()
    pool.close()
    _assert_reaped(pids)
    with pytest.raises(PoolClosedError):
        pool.recv()


def _open_fds():
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed already
            pass
    return fds


def test_a_closed_pool_still_referenced_holds_only_its_arena_mapping():
    """close() frees each worker process's pipes and sentinel at once, not when the pool object
    is garbage collected; what stays while the object lives is the arena's mapping (one
    descriptor: batches already handed out may still view it). worker_pids still answers."""
    AsyncEnvPool(_factories(1)).close()  # the fork server's pipes (started once) are not the pool's
    before = _open_fds()
    pool = AsyncEnvPool(_factories(8), envs_per_worker=1)
    pids = pool.worker_pids
    assert len(_open_fds()) > len(before) + 8
    pool.close()
    left = {fd: what for fd, what in _open_fds().items() if before.get(fd) != what}
    assert list(left.values()) in ([], ["/memfd:torchrl_asyncpool_arena (deleted)"]), left
    assert pool.worker_pids == pids


def test_threaded_workers_of_the_threading_backend_leave_no_pipe_open():
    """backend="threading" runs the workers in this process: a worker stepping its envs in
    threads closes its own pipes once those threads are done (closed pools add no descriptor
    but, at most, the arena mapping of the one still referenced)."""
    before = _open_fds()
    for _ in range(3):
        pool = AsyncEnvPool(_factories(4), backend="threading", envs_per_worker=2, env_threads=True)
        pool.close()
        del pool
    gc.collect()
    left = {fd: what for fd, what in _open_fds().items() if before.get(fd) != what}
    assert [what for what in left.values() if "arena" not in what] == [], left


# -- no /dev/shm segment ----------------------------------------------------------------------------
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_no_dev_shm_entry_during_or_after_pool_lifetime(envs_per_worker, env_threads):
    n = 4
    before = set(os.listdir("/dev/shm"))
    parent_before = set(_shm_files_used_by([os.getpid()]).get(os.getpid(), []))
    checker = OracleChecker()
    with AsyncEnvPool(_factories(n), envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        pids = pool.worker_pids
        _drive(pool, checker, rounds=20)
        assert _new_shm_entries(before, pids) == [], "the pool created /dev/shm entries while open"
        assert _shm_files_used_by(pids) == {}, "workers map or hold /dev/shm files"
        parent_now = set(_shm_files_used_by([os.getpid()]).get(os.getpid(), []))
        assert parent_now <= parent_before, f"the pool made this process map {sorted(parent_now - parent_before)}"
        for pid in pids:
            with open(f"/proc/{pid}/maps") as f:
                assert "memfd:" in f.read(), f"worker {pid} does not map the memfd arena"
    assert _new_shm_entries(before, pids) == [], "the pool left /dev/shm entries behind"
    _assert_reaped(pids)


# -- parent SIGKILLed -------------------------------------------------------------------------------
_PARENT_SCRIPT = r"""
import functools, json, sys, time
from torchrl_asyncpool import AsyncEnvPool
from torchrl_asyncpool.testing import OracleEnv

if __name__ == "__main__":
    epw, threads = int(sys.argv[1]), sys.argv[2] == "True"
    pool = AsyncEnvPool([functools.partial(OracleEnv, env_id=i, step_delay=0.01) for i in range(4)],
                        envs_per_worker=epw, env_threads=threads)
    td = pool.recv(min_get=4)
    # leave half the envs leased and half mid-answer so workers are in different states
    pool.send({"action": td["tag"][:2, 0].clone()}, td.env_indices[:2])
    print(json.dumps(pool.worker_pids), flush=True)
    print("READY", flush=True)
    while True:
        time.sleep(1000)
"""


@pytest.mark.slow
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_parent_sigkill_takes_workers_and_forkserver_down(envs_per_worker, env_threads):
    before = set(os.listdir("/dev/shm"))
    child = subprocess.Popen(
        [sys.executable, "-c", _PARENT_SCRIPT, str(envs_per_worker), str(env_threads)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    helpers = set()
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip() == "READY":
                break
        assert lines and lines[-1] == "READY", (
            f"child did not start a pool: {lines}\n{child.stderr.read() if child.poll() is not None else ''}"
        )
        pids = json.loads(lines[-2])
        assert len(pids) == 4 // envs_per_worker
        assert all(_proc_state(p) not in (None, "Z") for p in pids)
        helpers = _children(child.pid)  # the fork server (workers' parent) and the resource tracker
        forkservers = {p for p in helpers if "forkserver" in _cmdline(p)}
        assert forkservers, f"no fork server among the children {[(p, _cmdline(p)) for p in helpers]}"
        used = _shm_files_used_by([child.pid, *pids, *helpers])
        assert used == {}, f"pool processes map or hold /dev/shm files: {used}"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        t0 = time.monotonic()
        _assert_dead_or_zombie(pids, timeout=5.0, what="workers of the killed parent")
        assert time.monotonic() - t0 < 6.0
        # The fork server exits by itself once it sees its parent gone; tearing down an
        # interpreter with torch loaded can take seconds on a loaded 2-core machine.
        _assert_dead_or_zombie(forkservers, timeout=30.0, what="fork server of the killed parent")
        _assert_dead_or_zombie(helpers, timeout=30.0, what="helper processes of the killed parent")
        assert _new_shm_entries(before, pids) == [], "a /dev/shm entry survived the killed parent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        child.stdout.close()
        child.stderr.close()


# -- an idle pool costs nothing ---------------------------------------------------------------------
def _idle_cpu(pool, min_get):
    """(worker CPU seconds, consumer thread CPU seconds, wall) over one recv that times out."""
    pids = pool.worker_pids
    w0, c0, t0 = _cpu_seconds(pids), time.thread_time(), time.monotonic()
    with pytest.raises(TimeoutError):
        pool.recv(min_get=min_get, timeout=1.0)
    return _cpu_seconds(pids) - w0, time.thread_time() - c0, time.monotonic() - t0


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_idle_pool_uses_almost_no_cpu(envs_per_worker, env_threads):
    n = 4
    with AsyncEnvPool(_factories(n), envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        td = pool.recv(min_get=n)
        # 1) every record received, no action sent: workers wait for actions, consumer for records
        workers, consumer, wall = _idle_cpu(pool, min_get=1)
        assert wall >= 0.95
        assert workers < 0.1, f"idle workers burned {workers:.3f}s CPU in {wall:.2f}s"
        assert consumer < 0.1, f"a consumer blocked in recv burned {consumer:.3f}s CPU in {wall:.2f}s"
        # 2) three records ready, min_get=4 unreachable: the consumer must sleep, not spin
        keep = td.env_indices == 3
        pool.send({"action": oracle_action(td["tag"][~keep])}, td.env_indices[~keep])
        with pytest.raises(TimeoutError):
            pool.recv(min_get=n, timeout=0.5)  # the three steps complete meanwhile
        workers, consumer, wall = _idle_cpu(pool, min_get=n)
        assert wall >= 0.95
        assert workers < 0.1, f"idle workers burned {workers:.3f}s CPU in {wall:.2f}s"
        assert consumer < 0.1, f"a consumer blocked in recv burned {consumer:.3f}s CPU in {wall:.2f}s"
        # and nothing was lost: all four records are there
        assert pool.recv(min_get=3, max_get=3, timeout=5.0).batch_size[0] == 3


class _EnvWithAChild(OracleEnv):
    """An oracle env that starts a child process (a simulator, say) and writes its pid to a file;
    ``hang_at`` makes its step hang forever at that step, as a stuck simulator would."""

    def __init__(self, pid_file, hang_at=None, **kwargs):
        super().__init__(**kwargs)
        self._child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pid_file, "w") as f:
            f.write(str(self._child.pid))
        self._hang_at, self._steps = hang_at, 0

    def _step(self, td):
        self._steps += 1
        if self._steps == self._hang_at:
            time.sleep(600)
        return super()._step(td)

    def close(self, *args, **kwargs):  # a well-behaved env ends its child (the pool's spec env is closed)
        self._child.kill()
        self._child.wait()
        return super().close(*args, **kwargs)


def _gone_within(pid, seconds):
    import psutil

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["worker SIGKILL", "hung step at close"])
def test_processes_an_env_started_do_not_outlive_a_killed_worker(tmp_path, how):
    """A worker leads a process group that its envs' children join: when the worker is killed
    (by anyone) or killed by close() because its env hangs, close() kills the group."""
    pid_file = tmp_path / "child.pid"
    hang_at = 2 if how == "hung step at close" else None
    fns = [functools.partial(_EnvWithAChild, str(pid_file), hang_at=hang_at, env_id=0)]
    pool = AsyncEnvPool(fns)
    try:
        child = int(pid_file.read_text())
        worker = pool.worker_pids[0]
        assert os.getpgid(child) == worker == os.getpgid(worker)  # the env's child is in the worker's group
        td = pool.recv()
        _answer(pool, td)
        if how == "worker SIGKILL":
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(WorkerDiedError):
                for _ in range(20):
                    _answer(pool, pool.recv(timeout=5.0))
            assert not _gone_within(child, 0.5)  # killing the worker alone orphans its env's child
        else:
            with pytest.raises(TimeoutError):  # answers until step 2 hangs (autoresets take no step)
                for _ in range(5):
                    _answer(pool, pool.recv(timeout=0.5))
    finally:
        t0 = time.monotonic()
        pool.close(timeout=0.5)
        closed_in = time.monotonic() - t0
    assert _gone_within(child, _PROMPT_S), f"the env's child {child} outlived the pool"
    assert closed_in < _PROMPT_S


class _SlowFirstReset(OracleEnv):
    """An oracle env whose first reset takes a minute (a simulator that boots slowly)."""

    def _reset(self, td=None, **kwargs):
        if not getattr(self, "_booted", False):
            self._booted = True
            time.sleep(60)
        return super()._reset(td, **kwargs)


def test_cancel_start_abandons_a_slow_start_up_promptly_and_leaves_nothing():
    import psutil

    from torchrl_asyncpool import PoolStartCancelled

    def workers():  # the fork server's children (the fork server and the resource tracker stay)
        alive = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.ppid() != os.getpid() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return set(alive)

    before = workers()
    t0 = time.monotonic()
    asked = []

    def cancel():  # true at the fourth question: the start-up wait asks again and again (every 0.1 s)
        asked.append(time.monotonic() - t0)
        return len(asked) >= 4

    with pytest.raises(PoolStartCancelled, match="cancel_start returned true"):
        AsyncEnvPool([functools.partial(_SlowFirstReset, env_id=i) for i in range(2)], cancel_start=cancel)
    took = time.monotonic() - t0
    assert took < _PROMPT_S + 1.0, f"the cancelled start-up took {took:.1f}s (its resets take 60 s)"
    assert len(asked) == 4 and asked[-1] - asked[1] < 2.0, asked  # the asks in the wait come 0.1 s apart
    deadline = time.monotonic() + _PROMPT_S
    while workers() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workers() - before, "the cancelled pool's workers outlived it"
    # cancelled before the workers start: none is started, at once
    t0 = time.monotonic()
    with pytest.raises(PoolStartCancelled):
        AsyncEnvPool([functools.partial(_SlowFirstReset, env_id=0)], cancel_start=lambda: True)
    assert time.monotonic() - t0 < _PROMPT_S
    with pytest.raises(TypeError, match="cancel_start must be a callable"):
        AsyncEnvPool(_factories(1), cancel_start=True)


_ORPHAN_SCRIPT = r"""
import os, subprocess, sys, time
import gymnasium as gym
import numpy as np
from torchrl_asyncpool import AsyncEnvPool


class WithChild(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, pid_file, owner):
        self.owner = owner
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pid_file, "w") as f:
            f.write(str(self.child.pid))

    def reset(self, seed=None, options=None):
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(2, dtype=np.float32), 0.0, False, False, {}

    def close(self):  # only the pool's spec env, built in the owner, ends its child: a worker's
        if os.getpid() == self.owner:  # env leaves it to the worker's exit (what the test checks)
            self.child.kill()
            self.child.wait()


if __name__ == "__main__":
    files = sys.argv[1:]
    owner = os.getpid()
    pool = AsyncEnvPool([lambda f=f: WithChild(f, owner) for f in files], envs_per_worker=1)
    pool.recv(min_get=len(files))
    print("READY", flush=True)
    time.sleep(600)
"""


def test_a_parent_killed_without_closing_its_pool_leaves_no_env_children(tmp_path):
    """SIGKILL of the process that owns a pool runs no finalizer: the workers see their life
    pipe close and exit, and each signals what its envs started (its process group) on the way
    out, so the envs' children do not outlive them."""
    script = tmp_path / "owner.py"
    script.write_text(_ORPHAN_SCRIPT)
    files = [str(tmp_path / f"child{i}.pid") for i in range(2)]
    owner = subprocess.Popen([sys.executable, str(script), *files], stdout=subprocess.PIPE, text=True)
    children = []
    try:
        assert owner.stdout.readline().strip() == "READY"
        children = [int(open(f).read()) for f in files]
        assert not any(_gone_within(c, 0.2) for c in children)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(30)
        for c in children:
            assert _gone_within(c, 15.0), f"env child {c} outlived the killed pool owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(30)
        owner.stdout.close()
        for c in children:
            try:
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_traceback_from_an_env_class_of_the_users_script_names_its_file_and_line(tmp_path):
    """A class defined in the script that builds the pool crosses to the workers by reference
    (the fork server imports the script), not by value, whose code says ``<dynamic-code>``."""
    import textwrap

    script = tmp_path / "my_training.py"
    script.write_text(textwrap.dedent('''
        import torch
        from tensordict import TensorDict
        from torchrl_asyncpool import AsyncEnvPool
        from torchrl_asyncpool.testing import OracleEnv


        class Broken(OracleEnv):
            def _step(self, td):
                raise RuntimeError("boom in my env")


        if __name__ == "__main__":
            with AsyncEnvPool([Broken]) as pool:
                td = pool.recv()
                pool.send(TensorDict({"action": torch.zeros(1, dtype=torch.int64)}, [1]), td.env_indices)
                try:
                    pool.recv(timeout=60)
                except Exception as exc:
                    print(exc)
    '''))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "boom in my env" in proc.stdout, proc.stdout + proc.stderr
    assert f'File "{script}", line 10, in _step' in proc.stdout
    assert "<dynamic-code>" not in proc.stdout


def test_a_recv_no_env_can_answer_warns_and_its_timeout_says_why(monkeypatch):
    """A ``recv`` that waits while fewer than ``min_get`` envs can publish (the others await the
    actions of records recv returned, never sent) would wait forever: it warns once past
    ``RECV_STALL_WARN_S``, and its ``TimeoutError`` names the cause. A recv that waits for slow
    envs that do step gets neither."""
    from torchrl_asyncpool.exchange import consumer

    monkeypatch.setattr(consumer, "RECV_STALL_WARN_S", 0.2)
    with AsyncEnvPool(_factories(2)) as pool:
        td = pool.recv(min_get=2)
        with pytest.warns(RuntimeWarning, match=r"recv\(min_get=1\) has waited .* 2 of the pool's 2 envs await"):
            with pytest.raises(TimeoutError, match="2 of the 2 envs await their actions"):
                pool.recv(min_get=1, timeout=1.0)
        _answer(pool, td[torch.tensor([0])])  # env 0 steps again; env 1 still awaits its action
        with pytest.warns(RuntimeWarning, match=r"recv\(min_get=2\) has waited"):
            with pytest.raises(TimeoutError, match="1 of the 2 envs await"):
                pool.recv(min_get=2, timeout=1.0)
        assert pool.recv(min_get=1).env_indices.tolist() == [0]
    with AsyncEnvPool([functools.partial(OracleEnv, env_id=0, step_delay=1.0)]) as pool:
        _answer(pool, pool.recv())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning: the env is stepping
            assert pool.recv(timeout=10).numel() == 1


@pytest.mark.parametrize("backend", ["multiprocessing", "threading"])
def test_close_from_another_thread_ends_a_waiting_recv_with_pool_closed_error(backend):
    """``close()`` while another thread waits in ``recv``: that recv raises
    :class:`PoolClosedError`, not a :class:`WorkerDiedError` for workers that exit because they
    were told to (``exit code 0``), nor an error about the descriptors closed under it."""
    pool = AsyncEnvPool(_factories(2), backend=backend)
    pool.recv(min_get=2)  # every env awaits its action: the next recv waits
    out = []

    def waiting_recv():
        try:
            pool.recv(min_get=1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=waiting_recv, daemon=True)
    thread.start()
    time.sleep(0.3)
    pool.close()
    thread.join(10)
    assert not thread.is_alive() and len(out) == 1
    assert isinstance(out[0], PoolClosedError) and "closed while this call waited" in str(out[0]), out[0]
