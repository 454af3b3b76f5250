"""Remote env hosts over gRPC: exactly-once delivery, dropped and killed hosts, refusals, bad input."""
from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

grpc = pytest.importorskip("grpc")

from conftest import free_address, host_running, wait_for_a_host_that_never_comes  # noqa: E402
from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, EnvError, StepType  # noqa: E402
from torchrl_asyncpool.remote import EnvHost, RemoteEnvSlot, RemoteHostError  # noqa: E402
from torchrl_asyncpool.remote import protocol as P  # noqa: E402
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv, oracle_action  # noqa: E402


def _slots(address, n, **kwargs):
    return [functools.partial(RemoteEnvSlot.like, OracleGymEnv(0), address, **kwargs)] * n


def _start_host(address, env_id, make=OracleGymEnv, **kwargs):
    """An in-process host of ``make(env_id)`` for slot ``env_id`` (hosts are started one at a
    time, so the host for env ``i`` takes the lowest free slot, ``i``); returns ``(host,
    thread, result)`` once the host holds its slot."""
    host = EnvHost(functools.partial(make, env_id), address, **kwargs)
    t, result = host_running(host)
    deadline = time.monotonic() + 30
    while host.slot is None and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return host, t, result


def _answer(pool, td):
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, [td.shape[0]]), td.env_indices)


def _drive(pool, checker, records, timeout=30.0):
    n = 0
    while n < records:
        td = pool.recv(min_get=1, timeout=timeout)
        checker.observe_batch(td)
        _answer(pool, td)
        n += td.shape[0]


def test_remote_hosts_feed_a_pool_exactly_once_and_end_with_it(dev_shm_guard):
    address = free_address()
    pool = AsyncEnvPool(_slots(address, 3, token="s3cret"))
    try:
        assert (pool.num_workers, pool.env_threads) == (1, True)  # one listener, a thread per slot
        hosts = [_start_host(address, i, token="s3cret") for i in range(3)]
        assert [h.slot for h, _, _ in hosts] == [0, 1, 2]
        checker = OracleChecker()
        _drive(pool, checker, 600)
        assert checker.episodes_done > 50
    finally:
        pool.close()
    for host, t, result in hosts:
        t.join(10)
        assert not t.is_alive(), "the host did not notice that the pool went away"
        assert "error" not in result, result.get("error")
        assert result["steps"] > 100


def test_pool_without_hosts_starts_and_closes_promptly(dev_shm_guard):
    """Slots waiting for a host must not hold the pool's start-up (it returns once the worker
    listens) or its shutdown (the waiting threads are woken, not waited out)."""
    closes = []
    for _ in range(3):  # a busy machine may slow one close; the 1 s wait of the old code slowed every one
        address = free_address()
        pool = AsyncEnvPool(_slots(address, 4))
        pids = pool.worker_pids
        with pytest.raises(TimeoutError):
            pool.recv(min_get=1, timeout=0.2)
        t0 = time.monotonic()
        pool.close(timeout=30)  # the worker exits by itself: it is not killed at a deadline
        closes.append(time.monotonic() - t0)
        deadline = time.monotonic() + 5
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(os.path.exists(f"/proc/{p}") for p in pids), "the listening worker outlived the pool"
        if closes[-1] < 0.75:
            break
    # ~0.02 s; the waiting threads were joined with a 1 s budget before the fix (close: 1.01 s)
    assert min(closes) < 0.75, closes


def test_a_slot_waiting_for_a_host_warns_once_that_none_connected(monkeypatch, caplog):
    """A remote slot whose host never comes (not started, or connecting elsewhere) logs one
    warning naming the address and how to start hosts, then goes on waiting; closing the slot
    ends the wait. The same helper serves the per-env slots of protocol 2."""
    slot = RemoteEnvSlot(free_address(), gym.spaces.Box(-1.0, 1.0, (2,)), gym.spaces.Discrete(2))
    warned, raised = wait_for_a_host_that_never_comes(monkeypatch, caplog, slot, slot._wait_host)
    assert len(warned) == 1 and slot.address in warned[0] and "torchrl-asyncpool env-host --address" in warned[0]
    assert len(raised) == 1 and "closed while waiting for a host" in str(raised[0])


def test_each_address_gets_its_own_worker(dev_shm_guard):
    a, b = free_address(), free_address()
    with AsyncEnvPool(_slots(a, 2) + _slots(b, 1)) as pool:
        assert pool.num_workers == 2 and pool.envs_per_worker == 2
        hosts = [_start_host(a, 0), _start_host(a, 1), _start_host(b, 2)]
        assert [h.slot for h, _, _ in hosts] == [0, 1, 2]  # slot indices are the pool's
        checker = OracleChecker()
        _drive(pool, checker, 200)
        assert {e for e in range(3) if checker.last_step(e) is not None} == {0, 1, 2}


def test_an_env_class_is_a_factory():
    """``EnvHost(MyEnv, address)``: the class is called, not taken for an env (it has a ``step``
    attribute; the host failed with "type object has no attribute 'observation_space'")."""
    from torchrl_asyncpool.remote.torchrl_env import TorchRLEnvView
    from torchrl_asyncpool.testing import OracleEnv

    assert type(EnvHost(OracleGymEnv, "localhost:1").env) is OracleGymEnv
    assert isinstance(EnvHost(OracleEnv, "localhost:1").env, TorchRLEnvView)
    env = OracleGymEnv(0)
    assert EnvHost(env, "localhost:1").env is env  # an env instance is served as is
    for bad in ("localhost", "localhost:0", "localhost:http", None):  # refused at once, not after connect_timeout
        with pytest.raises(ValueError, match="address"):
            EnvHost(env, bad)


def test_torchrl_envs_on_both_sides(dev_shm_guard):
    """Slots laid out from a TorchRL env's specs, hosts serving TorchRL envs: the oracle holds."""
    from torchrl_asyncpool.testing import OracleEnv

    address = free_address()
    with AsyncEnvPool([functools.partial(RemoteEnvSlot.like, OracleEnv(0), address)] * 2) as pool:
        fields = {f.key: (f.shape, f.dtype) for f in pool.layout.request + pool.layout.response}
        assert fields[("tag",)] == ((3,), torch.int64) and fields[("action",)] == ((), torch.int64)
        for i in range(2):
            _start_host(address, i, make=OracleEnv)
        checker = OracleChecker()
        _drive(pool, checker, 300)
        assert checker.episodes_done > 30


def test_a_one_hot_torchrl_env_keeps_its_one_hot_action(dev_shm_guard):
    from torchrl.envs import GymEnv

    address = free_address()
    with AsyncEnvPool([functools.partial(RemoteEnvSlot.like, GymEnv("CartPole-v1"), address)]) as pool:
        host = EnvHost(functools.partial(GymEnv, "CartPole-v1"), address)
        t = threading.Thread(target=host.run, daemon=True)
        t.start()
        first = pool.recv(min_get=1, timeout=30)
        assert first["observation"].shape == (1, 4)
        for _ in range(40):
            td = first if _ == 0 else pool.recv(min_get=1, timeout=30)
            pool.send(TensorDict({"action": torch.tensor([[0, 1]])}, [1]), td.env_indices)  # always right
        assert host.steps >= 30  # pushing right ends CartPole episodes after ~10 steps, and it resets
    t.join(10)
    with pytest.raises(ValueError, match="a remote env must have batch_size"):
        from torchrl.envs import SerialEnv

        from torchrl_asyncpool.testing import OracleEnv

        RemoteEnvSlot.like(SerialEnv(2, OracleEnv), address)


def test_collector_over_remote_hosts_delivers_exact_transitions(dev_shm_guard):
    address = free_address()
    c = AsyncPoolCollector(_slots(address, 2), policy=lambda td: td.set("action", oracle_action(td["tag"])),
                           frames_per_batch=40, total_frames=200, transition_chunk_size=5)
    hosts = [_start_host(address, i) for i in range(2)]
    try:
        checker = OracleChecker()
        sizes = []
        for batch in c:
            sizes.append(batch.shape[0])
            checker.observe_transitions(batch)
        assert sizes == [40] * 5 and checker.records == 200
    finally:
        c.shutdown()
    for _, t, _ in hosts:
        t.join(10)


def test_collector_start_over_remote_hosts_fills_a_replay_buffer_and_shuts_down(dev_shm_guard):
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from conftest import start_and_check

    address = free_address()
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = AsyncPoolCollector(_slots(address, 2), policy=lambda td: td.set("action", oracle_action(td["tag"])),
                           frames_per_batch=32, total_frames=320, replay_buffer=rb, transition_chunk_size=8)
    hosts = [_start_host(address, i) for i in range(2)]
    start_and_check(c, rb, 320)  # shuts the collector down
    for _, t, result in hosts:
        t.join(10)
        assert not t.is_alive() and "error" not in result


def _until_mid(pool, checker):
    """Answers records until env 0's latest one is MID (an episode in progress); returns it."""
    while True:
        td = pool.recv(min_get=1, timeout=30)
        checker.observe_batch(td)
        if td.shape[0] == 1 and int(td["step_type"][0]) == StepType.MID:
            return td
        _answer(pool, td)


def _expect_truncation(pool, last_tag, td):
    """Answers ``td``: the dropped host's episode must end as TRUNCATION on its last observation."""
    _answer(pool, td)
    nxt = pool.recv(min_get=1, timeout=20)
    assert int(nxt["step_type"][0]) == StepType.TRUNCATION, nxt["step_type"]
    assert nxt["tag"][0].tolist() == last_tag and bool(nxt["truncated"][0].all()) and float(nxt["reward"][0]) == 0
    _answer(pool, nxt)  # discarded, as after any terminal record


def test_dropped_host_truncates_its_episode_and_frees_the_slot(dev_shm_guard):
    address = free_address()
    with AsyncEnvPool(_slots(address, 1)) as pool:
        host, t, _ = _start_host(address, 0)
        td = _until_mid(pool, OracleChecker())
        last = td["tag"][0].tolist()
        host.stop()  # the host goes away while its record is with the consumer
        t.join(10)
        _expect_truncation(pool, last, td)
        host2, t2, _ = _start_host(address, 0)
        assert host2.slot == 0
        first = pool.recv(min_get=1, timeout=20)
        assert int(first["step_type"][0]) == StepType.FIRST and first["tag"][0].tolist() == [0, 0, 0]
        checker = OracleChecker()
        checker.observe_batch(first)
        _answer(pool, first)
        _drive(pool, checker, 50)


class _HangingOracle(OracleGymEnv):
    """Hangs (for ``hang_s``, or until ``release`` is set) in its ``hang_at``-th step."""

    def __init__(self, env_id, hang_at, hang_s, release=None):
        super().__init__(env_id)
        self.hang_at, self.hang_s = hang_at, hang_s
        self.release = release if release is not None else threading.Event()

    def step(self, action):
        if self.total_steps + 1 == self.hang_at:
            self.release.wait(self.hang_s)
        return super().step(action)


def test_host_that_hangs_past_step_timeout_is_dropped_and_its_episode_truncated(dev_shm_guard):
    address = free_address()
    slot = functools.partial(RemoteEnvSlot.like, OracleGymEnv(0), address, step_timeout=0.5)
    release = threading.Event()
    with AsyncEnvPool([slot]) as pool:
        host = EnvHost(_HangingOracle(0, hang_at=1, hang_s=60.0, release=release), address)
        t = threading.Thread(target=host.run, daemon=True)
        t.start()
        first = pool.recv(min_get=1, timeout=30)
        assert int(first["step_type"][0]) == StepType.FIRST
        _answer(pool, first)  # the host hangs a minute in this step
        t0 = time.monotonic()
        nxt = pool.recv(min_get=1, timeout=50)
        waited = time.monotonic() - t0
        assert int(nxt["step_type"][0]) == StepType.TRUNCATION and nxt["tag"][0].tolist() == [0, 0, 0]
        # 20x the 0.5 s step_timeout; waiting the hang out would take the minute
        assert waited < 10.0, f"a host past step_timeout=0.5 s was dropped after {waited:.2f} s"
        _answer(pool, nxt)
        _start_host(address, 0)  # the slot is free again
        assert int(pool.recv(min_get=1, timeout=30)["step_type"][0]) == StepType.FIRST
        release.set()
    t.join(10)
    with pytest.raises(ValueError, match="step_timeout must be a positive"):
        RemoteEnvSlot.like(OracleGymEnv(0), address, step_timeout=0)


_HOST_SCRIPT = """
import sys
from torchrl_asyncpool.remote import EnvHost
from torchrl_asyncpool.testing import OracleGymEnv
EnvHost(OracleGymEnv(0), sys.argv[1]).run()
"""


def test_sigkilled_host_process_truncates_its_episode_and_the_pool_goes_on(dev_shm_guard):
    address = free_address()
    with AsyncEnvPool(_slots(address, 1)) as pool:
        proc = subprocess.Popen([sys.executable, "-c", _HOST_SCRIPT, address])
        try:
            td = _until_mid(pool, OracleChecker())
            last = td["tag"][0].tolist()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            t0 = time.monotonic()
            _expect_truncation(pool, last, td)
            assert time.monotonic() - t0 < 10, "the pool took too long to notice the dead host"
        finally:
            proc.kill()
            proc.wait()
        _, t, _ = _start_host(address, 0)  # the slot is free again
        first = pool.recv(min_get=1, timeout=20)
        assert int(first["step_type"][0]) == StepType.FIRST


def test_run_forever_serves_pool_after_pool_on_the_same_address(dev_shm_guard):
    address = free_address()
    host = EnvHost(functools.partial(OracleGymEnv, 0), address)
    t = threading.Thread(target=host.run_forever, kwargs={"retry_s": 0.1}, daemon=True)
    t.start()
    try:
        with AsyncEnvPool(_slots(address, 1)) as pool:
            _drive(pool, OracleChecker(), 30)
        with AsyncEnvPool(_slots(address, 1)) as pool:  # listens where the first pool did
            td = pool.recv(min_get=1, timeout=30)
            # the host's env lives on: a new episode of it, reset for this pool
            assert int(td["step_type"][0]) == StepType.FIRST and td["tag"][0, 1] > 0 and td["tag"][0, 2] == 0
            for _ in range(20):
                _answer(pool, td)
                td = pool.recv(min_get=1, timeout=30)
    finally:
        host.stop()
        t.join(10)
    assert not t.is_alive()


def test_stop_ends_a_host_waiting_for_a_pool_to_listen():
    """A host between pools waits in the connect (30 s here); stop() must end that wait, not only
    a stream, or a process that stops its hosts after closing the pool hangs for the timeout."""
    host = EnvHost(functools.partial(OracleGymEnv, 0), free_address(), connect_timeout=30)
    t = threading.Thread(target=host.run_forever, kwargs={"retry_s": 0.05}, daemon=True)
    t.start()
    time.sleep(0.5)  # in the connect wait: nothing listens on the address
    t0 = time.monotonic()
    host.stop()
    t.join(20)
    assert not t.is_alive() and time.monotonic() - t0 < 10


def test_pool_refuses_wrong_token_wrong_spec_and_hosts_beyond_its_slots():
    address = free_address()
    with AsyncEnvPool(_slots(address, 1, token="right")) as pool:
        with pytest.raises(RemoteHostError, match="UNAUTHENTICATED") as err:
            EnvHost(OracleGymEnv(0), address, token="wrong").run()
        assert err.value.code == "UNAUTHENTICATED"
        with pytest.raises(RemoteHostError, match="INVALID_ARGUMENT.*observation keys"):
            EnvHost(gym.make("CartPole-v1"), address, token="right").run()
        _, t, result = _start_host(address, 0, token="right")
        with pytest.raises(RemoteHostError, match="RESOURCE_EXHAUSTED.*taken") as err:
            EnvHost(OracleGymEnv(0), address, token="right").run()
        assert err.value.code == "RESOURCE_EXHAUSTED"
        td = pool.recv(min_get=1, timeout=20)  # the accepted host is unaffected
        assert td["tag"][0].tolist() == [0, 0, 0]
    t.join(10)
    assert "error" not in result


def test_a_host_run_again_reports_only_the_slot_it_holds_now(dev_shm_guard):
    """``slot`` is the slot held by the current run: a host that left (``max_steps``) and is
    refused on its next run (the slot was taken meanwhile) holds none (it still said 0)."""
    address = free_address()
    with AsyncEnvPool(_slots(address, 1)) as pool:
        host = EnvHost(OracleGymEnv(0), address)
        t = threading.Thread(target=host.run, kwargs={"max_steps": 2}, daemon=True)
        t.start()
        while True:  # answer until the host has left and its slot waits for the next one
            try:
                td = pool.recv(min_get=1, timeout=0.5)
            except TimeoutError:
                if not t.is_alive():
                    break
                continue
            _answer(pool, td)
        assert host.slot == 0 and host.steps == 2
        _, t2, _ = _start_host(address, 0)  # takes the freed slot
        with pytest.raises(RemoteHostError, match="RESOURCE_EXHAUSTED"):
            host.run()
        assert host.slot is None
    t2.join(10)


def test_malformed_record_ends_the_host_stream_and_truncates_the_episode():
    address = free_address()
    with AsyncEnvPool(_slots(address, 1)) as pool:
        codec = P.RecordCodec(P.spec_of_spaces(OracleGymEnv(0).observation_space, OracleGymEnv(0).action_space))
        env = OracleGymEnv(0)
        channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(channel).result(timeout=20)
        import queue

        out = queue.SimpleQueue()
        out.put(P.encode_hello(P.spec_of_spaces(env.observation_space, env.action_space)))
        responses = channel.stream_stream(P.METHOD)(iter(out.get, None))
        assert P.decode_accept(next(responses)) == 0
        obs, _ = env.reset()
        out.put(codec.pack_record(StepType.FIRST, 0.0, obs))
        td = pool.recv(min_get=1, timeout=20)
        _answer(pool, td)
        assert codec.unpack_command(next(responses)) == int(oracle_action(td["tag"])[0])
        wider = P.RecordCodec(P.spec_of_spaces(OracleGymEnv(0, obs_dim=3).observation_space, env.action_space))
        obs, *_ = env.step(0)
        out.put(wider.pack_record(StepType.MID, 1.0, {**obs, "observation": np.zeros(3, np.float32)}))
        with pytest.raises(grpc.RpcError) as err:
            next(responses)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "observation 'observation' of 12 bytes; the negotiated (2,) float32 makes 8" in err.value.details()
        nxt = pool.recv(min_get=1, timeout=20)
        assert int(nxt["step_type"][0]) == StepType.TRUNCATION and nxt["tag"][0].tolist() == [0, 0, 0]
        out.put(None)
        channel.close()


def test_bad_configurations_raise_clear_errors():
    space = gym.spaces.Box(-1, 1, (3,), np.float32)
    with pytest.raises(ValueError, match="host:port"):
        RemoteEnvSlot("localhost", space, gym.spaces.Discrete(2))
    with pytest.raises(ValueError, match="port must be a number"):
        RemoteEnvSlot("localhost:0", space, gym.spaces.Discrete(2))
    with pytest.raises(ValueError, match="token='' would accept hosts that send no token"):
        RemoteEnvSlot("localhost:5000", space, gym.spaces.Discrete(2), token="")
    with pytest.raises(TypeError, match="unsupported gymnasium action space"):
        RemoteEnvSlot("localhost:5000", space, gym.spaces.Tuple([gym.spaces.Discrete(2)]))
    with pytest.raises(RuntimeError, match="stepped by a pool worker"):
        RemoteEnvSlot("localhost:5000", space, gym.spaces.Discrete(2)).reset()
    address = free_address()
    with pytest.raises(ValueError, match="grouped by address"):
        AsyncEnvPool(_slots(address, 3), envs_per_worker=2)
    with pytest.raises(ValueError, match="local envs, not both"):
        AsyncEnvPool(_slots(address, 1) + [functools.partial(OracleGymEnv, 1)])
    other = free_address()
    with pytest.raises(ValueError, match="consecutive factories"):
        AsyncEnvPool(_slots(address, 1) + _slots(other, 1) + _slots(address, 1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EnvError, match="cannot listen on 127.0.0.1"):  # names the env and the cause
            AsyncEnvPool(_slots(f"127.0.0.1:{port}", 2))


def test_env_host_command_serves_a_gymnasium_env(dev_shm_guard):
    address = free_address()
    fns = [functools.partial(RemoteEnvSlot.like, gym.make("CartPole-v1"), address)]
    with AsyncEnvPool(fns) as pool:
        env = dict(os.environ, TORCHRL_ASYNCPOOL_TOKEN="")
        env.pop("TORCHRL_ASYNCPOOL_TOKEN")
        proc = subprocess.Popen([sys.executable, "-m", "torchrl_asyncpool.cli", "env-host", "--env-id", "CartPole-v1",
                                 "--address", address, "--max-steps", "30"], stdout=subprocess.PIPE, text=True, env=env)
        try:
            steps = 0
            while True:
                td = pool.recv(min_get=1, timeout=60)
                assert td["observation"].shape == (1, 4) and td["observation"].dtype == torch.float32
                st = int(td["step_type"][0])
                if st == StepType.TRUNCATION and steps == 30:
                    break  # the host left after --max-steps (CartPole itself truncates at 500)
                steps += st != StepType.FIRST
                pool.send(TensorDict({"action": torch.ones(1, dtype=torch.int64)}, [1]), td.env_indices)
            out, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "30 steps of CartPole-v1 served to slot 0" in out


def _compiled_proto(tmp_path):
    """``env_host_pb2`` generated by protoc from the shipped .proto (an independent protobuf
    implementation, as a host in another language would use)."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    import importlib
    import shutil

    shutil.copy(P.PROTO_FILE, tmp_path / "env_host.proto")
    assert protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", "env_host.proto"]) == 0
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("env_host_pb2")
    finally:
        sys.path.remove(str(tmp_path))


def test_hand_written_codec_matches_protoc_generated_messages(tmp_path):
    pb = _compiled_proto(tmp_path)
    env = OracleGymEnv(0)
    spec = P.spec_of_spaces(env.observation_space, env.action_space)
    codec = P.RecordCodec(spec)
    obs, _ = env.reset()
    # ours -> protobuf
    msg = pb.HostMessage.FromString(codec.pack_record(StepType.TERMINATION, 2.5, obs))
    assert msg.WhichOneof("message") == "record"
    assert (msg.record.step_type, msg.record.reward) == (2, 2.5)
    tag_entry = list(spec["observation"]).index("tag")  # entries follow the spec's key order
    assert np.frombuffer(msg.record.observation[tag_entry], np.int64).tolist() == obs["tag"].tolist()
    assert pb.HostMessage.FromString(P.encode_hello(spec)).hello_json.startswith('{"protocol": 1')
    assert pb.PoolMessage.FromString(P.RESET_COMMAND).reset is True
    assert np.frombuffer(pb.PoolMessage.FromString(codec.pack_action(7)).action, np.int64).tolist() == [7]
    assert '"slot": 3' in pb.PoolMessage.FromString(P.encode_accept(3)).accept_json
    # protobuf -> ours (proto3 omits default fields: a FIRST record with reward 0 has neither)
    entries = [np.ascontiguousarray(obs[k]).tobytes() for k in spec["observation"]]
    first = pb.HostMessage(record=pb.Record(observation=entries))
    st, reward, got = codec.unpack_record(first.SerializeToString())
    assert (st, reward) == (0, 0.0) and got["tag"].tolist() == obs["tag"].tolist()
    assert codec.unpack_command(pb.PoolMessage(reset=True).SerializeToString()) is None
    assert codec.unpack_command(pb.PoolMessage(action=np.int64(5).tobytes()).SerializeToString()) == 5
    assert P.decode_accept(pb.PoolMessage(accept_json='{"protocol": 1, "slot": 4}').SerializeToString()) == 4
    hello = json.dumps({"protocol": 1, **spec})
    assert P.decode_hello(pb.HostMessage(hello_json=hello).SerializeToString()) == spec


def test_a_host_built_from_the_proto_file_drives_a_slot(tmp_path):
    """A client that knows nothing of this package but the .proto and the docs (as a host in
    another language would) is accepted, stepped and checked by the oracle."""
    pb = _compiled_proto(tmp_path)
    import queue

    address = free_address()
    with AsyncEnvPool(_slots(address, 1, token="t")) as pool:
        env = OracleGymEnv(0)
        keys = list(env.observation_space.spaces)
        out = queue.SimpleQueue()
        spec = {"protocol": 1, "observation": {k: [list(s.shape), s.dtype.name]
                                                for k, s in env.observation_space.spaces.items()},
                "action": [[], "int64"]}
        out.put(pb.HostMessage(hello_json=json.dumps(spec)))
        channel = grpc.insecure_channel(address)
        call = channel.stream_stream(P.METHOD, request_serializer=pb.HostMessage.SerializeToString,
                                     response_deserializer=pb.PoolMessage.FromString)
        responses = call(iter(out.get, None), metadata=(("x-torchrl-asyncpool-token", "t"),))

        def record(st, reward, obs):
            out.put(pb.HostMessage(record=pb.Record(step_type=st, reward=reward, observation=[
                np.ascontiguousarray(obs[k]).tobytes() for k in keys])))

        ended = []

        def serve():
            assert json.loads(next(responses).accept_json)["slot"] == 0
            record(0, 0.0, env.reset()[0])
            try:
                for cmd in responses:
                    if cmd.WhichOneof("message") == "reset":
                        record(0, 0.0, env.reset()[0])
                    else:
                        obs, r, term, trunc, _ = env.step(int(np.frombuffer(cmd.action, np.int64)[0]))
                        record(2 if term else 3 if trunc else 1, r, obs)
                ended.append("stream ended")  # the pool closed its slots and ended the call
            except grpc.RpcError as exc:  # the pool's process went away first
                ended.append(exc.code())

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        checker = OracleChecker()
        _drive(pool, checker, 100)
        assert checker.episodes_done > 10
    t.join(10)
    assert not t.is_alive() and ended[0] in ("stream ended", grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    out.put(None)
    channel.close()


def test_evaluate_refuses_remote_env_slots():
    from torchrl_asyncpool.evaluation import Episode, evaluate

    with pytest.raises(TypeError, match="fixed episode sets need local envs"):
        evaluate(_slots(free_address(), 1)[0], lambda td: td.set("action", oracle_action(td["tag"])),
                 [Episode("a", seed=1, max_steps=10)], num_envs=1, progress=False)


@pytest.mark.slow
def test_a_client_that_never_says_hello_is_dropped():
    """A connection that sends nothing must not hold a server thread forever (10 s to say hello)."""
    import queue

    address = free_address()
    with AsyncEnvPool(_slots(address, 1)) as pool:
        channel = grpc.insecure_channel(address)
        out = queue.SimpleQueue()
        responses = channel.stream_stream(P.METHOD)(iter(out.get, None))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(responses)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert 9 < time.monotonic() - t0 < 20
        _, t, _ = _start_host(address, 0)  # the slot was never taken
        assert int(pool.recv(min_get=1, timeout=20)["step_type"][0]) == StepType.FIRST
        out.put(None)
        channel.close()


def test_seed_is_refused_for_remote_slots():
    with pytest.raises(ValueError, match="remote env slot's host owns its env"):
        AsyncEnvPool(_slots(free_address(), 2), seed=0)


def test_hello_deadline_holds_whatever_the_step_timeout(monkeypatch):
    """The watchdog that enforces the hello deadline wakes at least once a second: a long
    ``step_timeout`` (checked a tenth of it at a time) must not stretch it (it did: 10 s late
    with step_timeout=100). The ingress runs in this process, so the deadline can be short."""
    import queue

    from torchrl_asyncpool.remote import ingress as remote_ingress

    monkeypatch.setattr(remote_ingress, "_HELLO_TIMEOUT_S", 0.2)
    address = free_address()
    slot = RemoteEnvSlot.like(OracleGymEnv(0), address, step_timeout=100.0)
    slot._pool_listen(0)
    channel = grpc.insecure_channel(address)
    out = queue.SimpleQueue()
    try:
        responses = channel.stream_stream(P.METHOD)(iter(out.get, None))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(responses)  # says nothing: cancelled once the hello deadline has passed
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - t0 < 3, f"a silent client was cancelled after {time.monotonic() - t0:.1f} s"
    finally:
        out.put(None)
        channel.close()
        slot.close()


def test_a_malformed_hello_is_refused_with_a_reason():
    """Bad hellos are refused as INVALID_ARGUMENT with a message, not ended silently: a deeply
    nested JSON (a RecursionError, which ended the call with status OK and no word) and a dtype
    numpy rejects with ValueError (whose message did not say which entry)."""
    spec = {"observation": {"a": [[1], "float32"]}, "action": [[], "int64"]}
    deep = P._len_field(1, b"[" * 30000 + b"]" * 30000)  # within MAX_HELLO_BYTES
    with pytest.raises(ValueError, match="nested too deeply"):
        P.decode_hello(deep)
    big = {**spec, "observation": {"a": [[1], "(1000000000000000,)f8"]}}
    with pytest.raises(ValueError, match="observation 'a' must be"):
        P.decode_hello(P.encode_hello(big))
    assert P.decode_hello(P.encode_hello(spec)) == spec
    # the same, end to end: the host's call ends with the reason
    import queue

    address = free_address()
    slot = RemoteEnvSlot.like(OracleGymEnv(0), address)
    slot._pool_listen(0)
    channel = grpc.insecure_channel(address)
    out = queue.SimpleQueue()
    try:
        out.put(deep)
        with pytest.raises(grpc.RpcError) as err:
            next(channel.stream_stream(P.METHOD)(iter(out.get, None)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nested too deeply" in err.value.details()
    finally:
        out.put(None)
        channel.close()
        slot.close()


def test_a_hello_while_the_pool_closes_is_told_to_try_again():
    """A host whose hello lands after the last slot left, before the server stops, is told
    RESOURCE_EXHAUSTED (``run_forever`` retries), not "the host's spec does not fit: None"."""
    import queue

    address = free_address()
    slot = RemoteEnvSlot.like(OracleGymEnv(0), address)
    slot._pool_listen(0)
    ingress = slot._ingress
    with ingress._lock:
        ingress.slots.remove(slot)  # the window: the slot has left, the server still answers
    channel = grpc.insecure_channel(address)
    out = queue.SimpleQueue()
    try:
        out.put(P.encode_hello(slot._spec))
        with pytest.raises(grpc.RpcError) as err:
            next(channel.stream_stream(P.METHOD)(iter(out.get, None)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert "is closing" in err.value.details()
    finally:
        out.put(None)
        channel.close()
        with ingress._lock:
            ingress.slots.append(slot)
        slot.close()
