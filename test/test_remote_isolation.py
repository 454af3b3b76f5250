"""Remote slots isolate their hosts: a silent or lost host of a RemoteVectorSlot holds only its
own block of envs, records that answer no command are refused, and a silent host is reported."""
from __future__ import annotations

import functools
import logging
import threading
import time

import numpy as np
import pytest
from tensordict import TensorDict

grpc = pytest.importorskip("grpc")

from conftest import free_address  # noqa: E402
from test_remote_protocol2 import _Hanging, _RawHost, _Running, _sync_oracles  # noqa: E402
from torchrl_asyncpool import AsyncEnvPool, StepType  # noqa: E402
from torchrl_asyncpool.remote import RemoteVectorSlot, VectorEnvHost  # noqa: E402
from torchrl_asyncpool.remote import ingress  # noqa: E402
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv, oracle_action  # noqa: E402

K = 2  # envs per host


def _answer(pool, td):
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, [td.shape[0]]), td.env_indices)


def _wait_slot(running, timeout=30.0):
    deadline = time.monotonic() + timeout
    while running.host.slot is None:
        assert time.monotonic() < deadline and running.thread.is_alive(), "the host was not accepted"
        time.sleep(0.01)


def _gaps(times):
    return np.diff(np.asarray(times)) if len(times) > 1 else np.zeros(0)


def test_a_silent_host_holds_only_its_block_and_the_other_host_goes_on(dev_shm_guard):
    """Two hosts of K envs share one RemoteVectorSlot (``step_timeout=2``). One of them goes
    silent (an env hangs for 30 s): the healthy host's envs keep delivering, exactly once and in
    order, at no more than twice their normal interval, while the silent host holds its answer,
    after it is dropped, and while no host replaces it; the dropped block's open episodes end
    TRUNCATION, and a new host takes the block over."""
    address = free_address()
    slot = functools.partial(RemoteVectorSlot.like, OracleGymEnv(0), address, num_envs=2 * K, host_envs=K,
                             step_timeout=2.0)
    healthy = _Running(VectorEnvHost(functools.partial(_sync_oracles, K, 0), address))
    hosts = []

    def silent_host():  # once the healthy host holds envs 0..K-1 (the pool listens from its construction)
        _wait_slot(healthy)
        hosts.append(_Running(VectorEnvHost([functools.partial(_Hanging, K, 40, 30.0)]
                                            + [functools.partial(OracleGymEnv, K + j) for j in range(1, K)], address)))

    threading.Thread(target=silent_host, daemon=True).start()
    healthy_times, last_silent_record, truncated_at = [], None, None
    with AsyncEnvPool([slot], start_timeout=60) as pool:
        assert healthy.host.slot == 0 and hosts[0].host.slot == K
        checker = OracleChecker()
        t_end = None
        while t_end is None or time.monotonic() < t_end:
            td = pool.recv(min_get=1)
            now = time.monotonic()
            for n, env in enumerate(td.env_indices.tolist()):
                tag, st = td["tag"][n].tolist(), int(td["step_type"][n])
                if env >= K and st == StepType.TRUNCATION and tag == list(checker._last[env]):
                    assert float(td["reward"][n]) == 0.0  # the pool ended the episode: the host was dropped
                    truncated_at = now
                    t_end = now + 3.0  # the block stays without a host for 3 s
                    continue
                checker.observe(env, tag, st, reward=td["reward"][n], echo=td["echo"][n])
                if env == 0:
                    healthy_times.append(now)
                elif env >= K and truncated_at is None:
                    last_silent_record = now
            _answer(pool, td)
        assert truncated_at - last_silent_record > 1.5  # the host was silent until step_timeout dropped it
        times = np.asarray(healthy_times)
        normal = _gaps(times[times < last_silent_record])
        during = _gaps(times[times > last_silent_record])
        assert len(normal) > 10 and len(during) > 10, (len(normal), len(during))
        # the silent host and its loss hold nothing of the healthy block's (before per-block
        # progress, the healthy envs delivered nothing from the silence to the next host)
        assert during.mean() <= 2 * normal.mean() + 0.002, (during.mean(), normal.mean())
        assert during.max() < 1.0, during.max()
        replacement = _Running(VectorEnvHost(functools.partial(_sync_oracles, K, K), address))
        back = set()
        while back != set(range(K, 2 * K)):
            td = pool.recv(min_get=1)
            for n, env in enumerate(td.env_indices.tolist()):
                tag, st = td["tag"][n].tolist(), int(td["step_type"][n])
                if env >= K and env not in back:
                    assert st == StepType.FIRST and tag == [env, 0, 0], (env, tag, st)
                    checker._last.pop(env)  # the new host's envs start over at episode 0
                    back.add(env)
                checker.observe(env, tag, st, reward=td["reward"][n], echo=td["echo"][n])
            _answer(pool, td)
        replacement.stop()
    healthy.stop()
    hosts[0].stop(timeout=40)


def _premature(host):
    """After its FIRST records, a record batch that answers no command."""
    host.send(host.codec.pack_records([0, 1], [1, 1], [1.0, 1.0], host.obs))  # sent before any command
    host.receive()


@pytest.mark.parametrize("mode", ["lockstep", "per_env"])
def test_a_record_batch_sent_before_its_command_is_refused(dev_shm_guard, mode):
    """A host that sends records no command asked for is ended with INVALID_ARGUMENT (they are
    never taken as the answer to the next command), and its envs' open episodes end."""
    address = free_address()
    host = _RawHost(address, _premature)
    client, result = host.thread, host.result
    if mode == "lockstep":
        factories = [functools.partial(RemoteVectorSlot.like, OracleGymEnv(0), address, num_envs=2)]
    else:
        factories = RemoteVectorSlot.per_env(OracleGymEnv(0), address, num_envs=2)
    with AsyncEnvPool(factories, start_timeout=60) as pool:
        td = pool.recv(min_get=2, timeout=30)
        assert td["step_type"].tolist() == [0, 0]
        client.join(30)  # ended before the pool answers the FIRST records
        assert not client.is_alive()
        _answer(pool, td)
        td = pool.recv(min_get=2, timeout=30)  # the host is gone: both episodes end TRUNCATION
        assert [int(x) for x in td["step_type"]] == [StepType.TRUNCATION] * 2
    assert result.get("code") == grpc.StatusCode.INVALID_ARGUMENT, result
    assert "no command to answer" in result["details"], result["details"]


class _Context:
    def __init__(self):
        self.cancelled = False

    def peer(self):
        return "ipv4:10.0.0.7:5000"

    def cancel(self):
        self.cancelled = True


def test_a_host_that_owes_an_answer_for_long_is_reported_once_per_silence(caplog, monkeypatch):
    """Without a step_timeout nothing drops a silent host: the ingress's watchdog warns, once per
    silence, naming the host; with one, the host's call is cancelled instead."""
    monkeypatch.setattr(ingress, "SILENT_HOST_WARN_S", 5.0)
    stream = ingress._HostStream(iter(()), _Context())
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="torchrl_asyncpool.remote"):
        stream.expect(None)
        stream.check_deadline(t0 + 4.0)
        assert not caplog.records
        stream.check_deadline(t0 + 6.0)
        stream.check_deadline(t0 + 9.0)
        assert len(caplog.records) == 1 and "10.0.0.7:5000 has not answered" in caplog.text
        stream.answered()
        stream.expect(None)
        stream.check_deadline(time.monotonic() + 6.0)
        assert len(caplog.records) == 2  # a new silence
    assert not stream.context.cancelled
    stream.answered()
    stream.expect(1.0)
    stream.check_deadline(time.monotonic() + 2.0)
    assert stream.context.cancelled and stream.timed_out
