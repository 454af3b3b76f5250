"""Protocol 2, pool side one env at a time: RemoteVectorSlot.per_env slots (one thread per env in
the address's worker), each record published as soon as its host sent it."""
from __future__ import annotations

import functools
import threading
import time

import gymnasium as gym
import pytest
from tensordict import TensorDict

grpc = pytest.importorskip("grpc")

from conftest import free_address  # noqa: E402
from torchrl_asyncpool import AsyncEnvPool, StepType  # noqa: E402
from torchrl_asyncpool.remote import RemoteVectorSlot, VectorEnvHost  # noqa: E402
from torchrl_asyncpool.remote.env_of_host import RemoteEnvOfHost  # noqa: E402
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv, oracle_action  # noqa: E402

K = 4


def _threaded(offset=0, k=K):
    return [functools.partial(OracleGymEnv, offset + j) for j in range(k)]


def _vector(offset=0, k=K):
    return gym.vector.SyncVectorEnv(_threaded(offset, k))


class _Serving:
    """A host serving pool after pool in a thread (``run_forever``), errors kept."""

    def __init__(self, host):
        self.host, self.error = host, None

        def run():
            try:
                host.run_forever(retry_s=0.05)
            except BaseException as exc:  # noqa: BLE001 - checked by the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self):
        self.host.stop()
        self.thread.join(20)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


def _round(pool, timeout=30.0):
    """Whatever is ready (at least one record), answered with the oracle's actions."""
    assert pool.wait_ready(1, timeout) >= 1
    td = pool.recv(min_get=1)
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, [td.shape[0]]), td.env_indices)
    return td


def _wait_slot(host, timeout=30.0):
    deadline = time.monotonic() + timeout
    while host.slot is None:
        assert time.monotonic() < deadline, "the host was not accepted"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["threads", "gym-vector"])
def test_per_env_slots_deliver_exact_records_from_two_hosts(dev_shm_guard, kind):
    """Two hosts of K envs on one address, the pool's side K * 2 single envs in one worker: every
    record exactly once, in order (oracle), whether the hosts step their envs one by one or a
    vector env gathers a command for each of its envs first."""
    address = free_address()
    make = _threaded if kind == "threads" else (lambda offset: functools.partial(_vector, offset))
    factories = RemoteVectorSlot.per_env(OracleGymEnv(0), address, num_envs=2 * K, host_envs=K)
    with AsyncEnvPool(factories, start_timeout=60) as pool:
        assert pool.num_workers == 1 and pool.num_envs == 2 * K
        hosts = []
        for i in range(2):  # one after the other: host i takes envs K*i .. K*i + K - 1
            hosts.append(_Serving(VectorEnvHost(make(K * i), address)))
            _wait_slot(hosts[-1].host)
        checker, n, batches = OracleChecker(), 0, []
        while n < 800:
            td = _round(pool)
            checker.observe_batch(td)
            n += td.shape[0]
            batches.append(td.shape[0])
        assert set(checker._last) == set(range(2 * K))
        assert checker.episodes_done >= 2 * K
    for h in hosts:
        h.stop()
    assert all(h.host.steps > 0 for h in hosts)


def test_a_dropped_host_truncates_each_open_episode_and_the_next_host_takes_over(dev_shm_guard):
    """The host stops mid-run: each env in an open episode gets one TRUNCATION record (its last
    observation, reward 0), then every env starts over with the next host's FIRST record, and
    the oracle checks everything before and after."""
    address = free_address()
    factories = RemoteVectorSlot.per_env(OracleGymEnv(0), address, num_envs=K, step_timeout=30)
    with AsyncEnvPool(factories, start_timeout=60) as pool:
        first = _Serving(VectorEnvHost(_threaded(), address))
        checker, last, n = OracleChecker(), {}, 0
        while n < 60:
            td = _round(pool)
            checker.observe_batch(td)
            for row, i in enumerate(td.env_indices.tolist()):
                last[i] = (td["tag"][row].tolist(), int(td["step_type"][row]))
            n += td.shape[0]
        first.stop()
        second = _Serving(VectorEnvHost(_threaded(), address))
        state = {i: "old" for i in range(K)}  # old -> [truncated] -> back
        deadline = time.monotonic() + 30
        while any(s != "back" for s in state.values()):
            assert time.monotonic() < deadline, state
            td = _round(pool)
            for row, i in enumerate(td.env_indices.tolist()):
                tag, st = td["tag"][row].tolist(), int(td["step_type"][row])
                if state[i] == "back":
                    checker.observe(i, tag, st, reward=td["reward"][row], echo=td["echo"][row])
                elif st == StepType.TRUNCATION and tag == last[i][0]:  # the host's loss
                    assert state[i] == "old" and float(td["reward"][row]) == 0.0
                    assert last[i][1] not in (StepType.TERMINATION, StepType.TRUNCATION)
                    state[i] = "truncated"
                elif st == StepType.FIRST and tag == [i, 0, 0] and (
                        state[i] == "truncated" or last[i][1] in (StepType.TERMINATION, StepType.TRUNCATION)):
                    checker._last.pop(i, None)  # the new host's env i starts at its episode 0
                    checker.observe(i, tag, st)
                    state[i] = "back"
                else:  # a record of the old host that was on its way: exact as before
                    assert state[i] == "old", (i, tag, st, state[i])
                    checker.observe(i, tag, st, reward=td["reward"][row], echo=td["echo"][row])
                    last[i] = (tag, st)
        n = 0
        while n < 200:
            td = _round(pool)
            checker.observe_batch(td)
            n += td.shape[0]
        second.stop()
    assert RemoteEnvOfHost  # the class behind the factories


def test_per_env_arguments_are_checked_where_the_factories_are_made():
    env = OracleGymEnv(0)
    with pytest.raises(ValueError, match="host_envs"):
        RemoteVectorSlot.per_env(env, "localhost:1", num_envs=6, host_envs=4)
    with pytest.raises(ValueError, match="token=''"):
        RemoteVectorSlot.per_env(env, "localhost:1", num_envs=4, token="")
    made = RemoteVectorSlot.per_env(env, "localhost:1", num_envs=4, host_envs=2)
    slot = made[3]()
    assert (slot.position, slot.num_envs, slot.host_envs, slot._j) == (3, 4, 2, 1)
    with pytest.raises(RuntimeError, match="pool worker"):
        slot.reset()
