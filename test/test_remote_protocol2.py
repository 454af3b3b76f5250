"""Protocol 2: one env host serves k envs over one stream to a pool's RemoteVectorSlot."""
from __future__ import annotations

import functools
import sys
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from tensordict import TensorDict

grpc = pytest.importorskip("grpc")

from conftest import free_address, host_running, wait_for_a_host_that_never_comes  # noqa: E402
from torchrl_asyncpool import AsyncEnvPool, StepType  # noqa: E402
from torchrl_asyncpool.remote import EnvHost, RemoteEnvSlot, RemoteHostError, RemoteVectorSlot, VectorEnvHost  # noqa: E402
from torchrl_asyncpool.remote import protocol as P  # noqa: E402
from torchrl_asyncpool.remote.ingress import Ingress  # noqa: E402
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv, oracle_action  # noqa: E402
from torchrl_asyncpool.testing.oracle_env import oracle_episode  # noqa: E402

K = 4


def _sync_oracles(k=K, offset=0):
    return gym.vector.SyncVectorEnv([functools.partial(OracleGymEnv, offset + j) for j in range(k)])


def _vector_slot(address, k=K, **kwargs):
    return functools.partial(RemoteVectorSlot.like, OracleGymEnv(0), address, num_envs=k, **kwargs)


class _Running:
    """A host running in a thread (``run``'s result or error in ``result``)."""

    def __init__(self, host, **run_kwargs):
        self.host = host
        self.thread, self.result = host_running(host, **run_kwargs)

    def stop(self, timeout=10):
        self.host.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive()


def _answer(pool, td):
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, [td.shape[0]]), td.env_indices)


class _RawHost:
    """A hand-written protocol-2 client of 2 oracle envs, for tests that break the protocol on
    purpose: in a thread it connects to ``address``, says hello, keeps the accepted slot in
    ``result["slot"]``, sends both envs' FIRST records, then runs ``script(self)`` (which talks
    through :meth:`send` and :meth:`receive`); the status it is ended with lands in
    ``result["code"]`` and ``result["details"]``."""

    def __init__(self, address: str, script):
        env = OracleGymEnv(0)
        self.spec = P.spec_of_spaces(env.observation_space, env.action_space)
        self.codec = P.BatchCodec(self.spec, 2)
        self.obs = {"tag": np.array([[0, 0, 0], [1, 0, 0]]), "echo": np.array([-1, -1]),
                    "observation": np.zeros((2, 2), np.float32)}
        self.address, self._script, self.result = address, script, {}
        self._out, self._responses = None, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def send(self, message: bytes) -> None:
        self._out.put(message)

    def receive(self) -> bytes:
        return next(self._responses)

    def _run(self) -> None:
        import queue

        channel = grpc.insecure_channel(self.address)
        self._out = queue.SimpleQueue()
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
            self._responses = channel.stream_stream(P.METHOD)(iter(self._out.get, None))
            self.send(P.encode_hello(self.spec, 2))
            self.result["slot"] = P.decode_accept(self.receive())
            self.send(self.codec.pack_records([0, 1], [0, 0], [0.0, 0.0], self.obs))
            self._script(self)
        except grpc.RpcError as exc:
            self.result["code"], self.result["details"] = exc.code(), exc.details()
        finally:
            self._out.put(None)
            channel.close()


def _drive(pool, checker, records, timeout=30.0):
    n = 0
    while n < records:
        td = pool.recv(min_get=1, timeout=timeout)
        checker.observe_batch(td)
        _answer(pool, td)
        n += td.shape[0]
    return n


@pytest.mark.parametrize("kind", ["gym-vector", "threads", "torchrl-batched"])
def test_a_host_of_k_envs_feeds_exact_records_over_one_stream(dev_shm_guard, kind):
    """Every record of every env arrives exactly once, in order (the oracle checks tags, step
    types, rewards and the echoed actions), whichever kind of host steps the k envs."""
    address = free_address()
    if kind == "gym-vector":
        envs = _sync_oracles
    elif kind == "threads":
        envs = [functools.partial(OracleGymEnv, j) for j in range(K)]
    else:
        from torchrl.envs import SerialEnv

        from torchrl_asyncpool.testing import OracleEnv

        def envs():
            return SerialEnv(K, [functools.partial(OracleEnv, env_id=j) for j in range(K)])
    running = _Running(VectorEnvHost(envs, address))
    with AsyncEnvPool([_vector_slot(address)], start_timeout=60) as pool:
        checker = OracleChecker()
        _drive(pool, checker, 300)
        assert set(checker._last) == set(range(K))
        assert checker.episodes_done >= K
    running.thread.join(20)
    assert "error" not in running.result, running.result
    assert running.host.steps > 0


def test_several_hosts_feed_one_pool_each_on_its_address(dev_shm_guard):
    addresses = [free_address() for _ in range(2)]
    running = [_Running(VectorEnvHost(functools.partial(_sync_oracles, K, K * i), a)) for i, a in enumerate(addresses)]
    with AsyncEnvPool([_vector_slot(a) for a in addresses], start_timeout=60) as pool:
        checker = OracleChecker()
        _drive(pool, checker, 400)
        assert set(checker._last) == set(range(2 * K))
    for r in running:
        r.thread.join(20)
        assert "error" not in r.result, r.result


def _resume(checker, env, episode):
    """Lets ``checker`` take env ``env`` up again at the start of ``episode`` (a new host)."""
    if episode == 0:
        checker._last.pop(env, None)
    else:
        length, _ = oracle_episode(env, episode - 1, checker.max_episode_len)
        checker._last[env] = (env, episode - 1, length)


@pytest.mark.parametrize("at", ["some-envs-ended", "all-episodes-open"])
def test_a_dropped_host_ends_its_open_episodes_truncated_and_the_next_host_takes_over(dev_shm_guard, at):
    """The host drops while the pool holds a pass of its k records: envs in an open episode get
    TRUNCATION at once (their last observation, reward 0), without waiting for another host;
    envs whose record was terminal deliver nothing until the next host connects. Then every
    env of the block starts over with the new host's FIRST records and goes on exactly once, in
    order. ``at``: the held pass has terminal records next to open ones, or none."""
    address = free_address()
    first = _Running(VectorEnvHost(_sync_oracles, address))
    with AsyncEnvPool([_vector_slot(address)], start_timeout=60) as pool:
        checker = OracleChecker()
        _drive(pool, checker, 20)
        for _ in range(500):  # hold a pass of all k records of the kind asked for
            td = pool.recv(min_get=K, timeout=30)
            checker.observe_batch(td)
            ends = [StepType(int(x)).is_last() for x in td["step_type"]]
            if (any(ends) and not all(ends)) if at == "some-envs-ended" else not any(ends):
                break
            _answer(pool, td)
        else:
            pytest.fail(f"no pass with {at}")
        last = {int(i): (td["tag"][n].tolist(), int(td["step_type"][n])) for n, i in enumerate(td.env_indices)}
        assert set(last) == set(range(K))
        open_envs = {i for i, (_, st) in last.items() if st not in (StepType.TERMINATION, StepType.TRUNCATION)}
        first.stop()
        _answer(pool, td)
        td = pool.recv(min_get=len(open_envs), timeout=30)  # no host: the open episodes end at once
        assert set(td.env_indices.tolist()) == open_envs
        for n, i in enumerate(td.env_indices.tolist()):
            assert int(td["step_type"][n]) == StepType.TRUNCATION and td["tag"][n].tolist() == last[i][0]
            assert float(td["reward"][n]) == 0.0 and bool(td["truncated"][n])
        _answer(pool, td)
        with pytest.raises(TimeoutError):  # nothing more until a host takes the block
            pool.recv(min_get=1, timeout=1.0)
        second = _Running(VectorEnvHost(_sync_oracles, address))
        td = pool.recv(min_get=K, timeout=30)  # every env starts over with the new host's episode 0
        assert sorted(td.env_indices.tolist()) == list(range(K))
        for n, i in enumerate(td.env_indices.tolist()):
            assert int(td["step_type"][n]) == StepType.FIRST and td["tag"][n].tolist() == [i, 0, 0]
            _resume(checker, i, 0)
            checker.observe(i, td["tag"][n], td["step_type"][n], reward=td["reward"][n], echo=td["echo"][n])
        _answer(pool, td)
        _drive(pool, checker, 200)
    second.thread.join(20)
    assert "error" not in second.result, second.result


def test_a_vector_slot_whose_hosts_never_connect_warns_once(monkeypatch, caplog):
    """A RemoteVectorSlot's reset waiting for a host that never connects logs one warning naming
    its address, goes on waiting, and ends when the slot is closed."""
    slot = RemoteVectorSlot.like(OracleGymEnv(0), free_address(), num_envs=K)
    slot._ingress = Ingress.join(slot)  # listening, as its first reset does
    warned, raised = wait_for_a_host_that_never_comes(monkeypatch, caplog, slot, slot.reset)
    assert len(warned) == 1 and slot.address in warned[0], warned
    assert len(raised) == 1 and "closed while waiting" in str(raised[0]), raised


def test_refusals_name_the_protocol_and_the_number_of_envs():
    address = free_address()
    slot = RemoteVectorSlot.like(OracleGymEnv(0), address, num_envs=K)
    slot._ingress = Ingress.join(slot)  # listening, as its first reset does
    try:
        with pytest.raises(RemoteHostError, match="INVALID_ARGUMENT.*4 envs over one stream.*one env"):
            EnvHost(OracleGymEnv(0), address).run()
        with pytest.raises(RemoteHostError, match="INVALID_ARGUMENT.*4 envs over one stream.*declared 2 envs"):
            VectorEnvHost(functools.partial(_sync_oracles, 2), address).run()
    finally:
        slot.close()
    address = free_address()
    single = RemoteEnvSlot.like(OracleGymEnv(0), address)
    single._pool_listen(0)
    try:
        with pytest.raises(RemoteHostError, match="INVALID_ARGUMENT.*one env per stream.*declared 4 envs"):
            VectorEnvHost(_sync_oracles, address).run()
    finally:
        single.close()


def test_batch_codec_round_trips_and_refuses_malformed_batches():
    env = OracleGymEnv(0)
    spec = P.spec_of_spaces(env.observation_space, env.action_space)
    codec = P.BatchCodec(spec, 3)
    obs = {"tag": np.arange(6).reshape(2, 3), "echo": np.array([5, 6]), "observation": np.ones((2, 2), np.float32)}
    data = codec.pack_records([2, 0], [1, 2], [0.5, 1.5], obs)
    envs, sts, rewards, got = codec.unpack_records(data)
    assert envs.tolist() == [2, 0] and sts.tolist() == [1, 2] and rewards.tolist() == [0.5, 1.5]
    assert got["tag"].tolist() == obs["tag"].tolist() and got["echo"].tolist() == [5, 6]
    envs, resets, actions = codec.unpack_commands(codec.pack_commands([1, 2], [True, False], np.array([3, 4])))
    assert envs.tolist() == [1, 2] and resets.tolist() == [True, False] and actions.tolist() == [3, 4]
    with pytest.raises(ValueError, match="env 3"):
        codec.unpack_records(codec.pack_records([3], [1], [0.0], {k: v[:1] for k, v in obs.items()}))
    with pytest.raises(ValueError, match="step type 7"):
        codec.unpack_records(codec.pack_records([0], [7], [0.0], {k: v[:1] for k, v in obs.items()}))
    for reward in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="env 2 with reward .*must be finite"):
            codec.unpack_records(codec.pack_records([0, 2], [1, 1], [0.0, reward], obs))
    one = P.RecordCodec(spec)
    with pytest.raises(ValueError, match="reward nan; rewards must be finite"):
        one.unpack_record(one.pack_record(1, float("nan"), {k: v[0] for k, v in obs.items()}))
    bad = P.BatchCodec({"observation": {**spec["observation"], "tag": [[4], "int64"]}, "action": spec["action"]}, 3)
    with pytest.raises(ValueError, match="observation 'tag'"):
        codec.unpack_records(bad.pack_records([0], [1], [0.0], {**{k: v[:1] for k, v in obs.items()},
                                                                "tag": np.zeros((1, 4), np.int64)}))
    with pytest.raises(ValueError, match="num_envs"):
        P.decode_hello(P.encode_hello(spec, 0))
    assert P.decode_hello(P.encode_hello(spec, 3)) == {**spec, "num_envs": 3}


def test_batched_messages_match_protoc_generated_code(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    import importlib
    import shutil

    shutil.copy(P.PROTO_FILE, tmp_path / "env_host.proto")
    assert protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", "env_host.proto"]) == 0
    sys.path.insert(0, str(tmp_path))
    try:
        sys.modules.pop("env_host_pb2", None)
        pb = importlib.import_module("env_host_pb2")
    finally:
        sys.path.remove(str(tmp_path))
    env = OracleGymEnv(0)
    spec = P.spec_of_spaces(env.observation_space, env.action_space)
    codec = P.BatchCodec(spec, 3)
    obs = {"tag": np.arange(9).reshape(3, 3), "echo": np.array([5, 6, 7]), "observation": np.ones((3, 2), np.float32)}
    msg = pb.HostMessage.FromString(codec.pack_records([0, 1, 2], [0, 1, 3], [0.0, 1.0, 2.0], obs))
    assert msg.WhichOneof("message") == "records"
    assert list(msg.records.env) == [0, 1, 2] and list(msg.records.reward) == [0.0, 1.0, 2.0]
    assert list(msg.records.step_type) == [0, 1, 3]
    tag_entry = list(spec["observation"]).index("tag")
    assert np.frombuffer(msg.records.observation[tag_entry], np.int64).tolist() == list(range(9))
    # protoc -> ours: a FIRST batch (all rewards 0, all step types 0)
    entries = [np.ascontiguousarray(obs[k]).tobytes() for k in spec["observation"]]
    theirs = pb.HostMessage(records=pb.RecordBatch(env=[2, 1, 0], step_type=bytes(3), reward=[0.0] * 3,
                                                   observation=entries))
    envs, sts, rewards, got = codec.unpack_records(theirs.SerializeToString())
    assert envs.tolist() == [2, 1, 0] and sts.tolist() == [0, 0, 0] and got["echo"].tolist() == [5, 6, 7]
    cmd = pb.PoolMessage.FromString(codec.pack_commands([0, 2], [False, True], np.array([9, 0])))
    assert list(cmd.commands.env) == [0, 2] and cmd.commands.reset == b"\x00\x01"
    assert np.frombuffer(cmd.commands.action, np.int64).tolist() == [9, 0]
    ours = codec.unpack_commands(pb.PoolMessage(commands=pb.CommandBatch(
        env=[1], reset=b"\x00", action=np.int64(4).tobytes())).SerializeToString())
    assert ours[0].tolist() == [1] and ours[2].tolist() == [4]
    assert '"num_envs": 3' in pb.HostMessage.FromString(P.encode_hello(spec, 3)).hello_json


def test_env_host_command_serves_k_envs_over_one_stream(dev_shm_guard):
    """``env-host --protocol 2 --num-envs 3``: one stream, three envs stepped by threads."""
    import subprocess

    address = free_address()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrl_asyncpool.cli", "env-host", "--protocol", "2", "--num-envs", "3",
         "--env-id", "CartPole-v1", "--address", address, "--no-progress", "--max-steps", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        slot = functools.partial(RemoteVectorSlot.like, gym.make("CartPole-v1"), address, num_envs=3)
        with AsyncEnvPool([slot], start_timeout=60) as pool:
            n = 0
            t0 = time.monotonic()
            while n < 150 and time.monotonic() - t0 < 60:
                td = pool.recv(min_get=1, timeout=30)
                pool.send(TensorDict({"action": td["observation"][:, 2:3].gt(0).long().squeeze(-1)}, [td.shape[0]]),
                          td.env_indices)
                n += td.shape[0]
            assert n >= 150
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "3 envs" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_through_a_drop(pool, checker, dropped, records, deadline_s=60):
    """Checks ``records`` more records: envs of ``dropped`` may end their open episode with a
    TRUNCATION repeating their last record (reward 0) and then start over with a new host's
    FIRST (its episode 0, or 1 after a reset); every other record must follow exactly.
    Returns the envs of ``dropped`` that came back."""
    state = {j: "open" for j in dropped}
    n, t0 = 0, time.monotonic()
    while n < records or any(s != "back" for s in state.values()):
        assert time.monotonic() - t0 < deadline_s, f"the dropped envs did not come back: {state}"
        td = pool.recv(min_get=1, timeout=30)
        for i, env in enumerate(td.env_indices.tolist()):
            tag, st, reward = td["tag"][i].tolist(), int(td["step_type"][i]), float(td["reward"][i])
            last = list(checker._last[env])
            if env in state and state[env] == "open" and st == StepType.TRUNCATION and tag == last:
                assert reward == 0.0
                state[env] = "truncated"
                continue
            if env in state and state[env] != "back" and st == StepType.FIRST and tag[1] != last[1] + 1:
                assert tag[2] == 0 and tag[1] in (0, 1), (env, tag)
                assert state[env] == "truncated" or tag[1] == 0, (env, tag, state[env])
                _resume(checker, env, tag[1])
                state[env] = "back"
            checker.observe(env, tag, st, reward=td["reward"][i], echo=td["echo"][i])
        _answer(pool, td)
        n += td.shape[0]
    return state


def test_two_hosts_share_one_vector_slot_and_one_of_them_drops(dev_shm_guard):
    """``host_envs``: one RemoteVectorSlot (one ingress worker) of 2k envs fed by two hosts of k;
    both blocks deliver exactly once, in order; when one host drops, its block's open episodes
    end TRUNCATION and a new host takes that block over while the other block goes on."""
    address = free_address()
    slot = functools.partial(RemoteVectorSlot.like, OracleGymEnv(0), address, num_envs=2 * K, host_envs=K)
    hosts = [_Running(VectorEnvHost(functools.partial(_sync_oracles, K, 0), address))]

    def second():  # once the first host holds envs 0..K-1 (the pool listens from its construction)
        while hosts[0].host.slot is None and hosts[0].thread.is_alive():
            time.sleep(0.01)
        hosts.append(_Running(VectorEnvHost(functools.partial(_sync_oracles, K, K), address)))

    threading.Thread(target=second, daemon=True).start()
    with AsyncEnvPool([slot], start_timeout=60) as pool:
        assert hosts[0].host.slot == 0 and hosts[1].host.slot == K
        checker = OracleChecker()
        _drive(pool, checker, 200)
        assert set(checker._last) == set(range(2 * K))
        hosts[1].stop()
        hosts.append(_Running(VectorEnvHost(functools.partial(_sync_oracles, K, K), address)))
        state = _check_through_a_drop(pool, checker, range(K, 2 * K), 300)
        assert all(s == "back" for s in state.values())
    for r in (hosts[0], hosts[2]):
        r.thread.join(20)
        assert "error" not in r.result, r.result


@pytest.mark.parametrize("breakage", ["short observation", "nan reward"])
def test_a_malformed_record_batch_ends_the_host_with_invalid_argument_and_truncates(dev_shm_guard, breakage):
    """A protocol-2 client that sends a batch whose observation bytes do not fit the spec, or a
    reward that is not a finite number, is ended with INVALID_ARGUMENT (the reason in the
    details) and its envs' open episodes end TRUNCATION; nothing it sent is unpickled."""
    def script(host):
        envs, resets, _ = host.codec.unpack_commands(host.receive())
        host.result["commands"] = (envs.tolist(), resets.tolist())
        if breakage == "nan reward":
            host.send(host.codec.pack_records([0, 1], [1, 1], [1.0, float("nan")], host.obs))
        else:
            bad = host.codec.pack_records([0, 1], [1, 1], [1.0, 1.0], host.obs)
            host.send(bad[:-4])  # the last observation entry 4 bytes short (its length prefix says more)
        host.receive()

    address = free_address()
    client = _RawHost(address, script)
    t, result = client.thread, client.result
    slot = functools.partial(RemoteVectorSlot.like, OracleGymEnv(0), address, num_envs=2)
    with AsyncEnvPool([slot], start_timeout=60) as pool:
        td = pool.recv(min_get=2, timeout=30)
        assert td["step_type"].tolist() == [0, 0]
        _answer(pool, td)
        td = pool.recv(min_get=2, timeout=30)  # the host broke the protocol: both episodes end TRUNCATION
        assert [int(x) for x in td["step_type"]] == [StepType.TRUNCATION] * 2
        assert td["tag"].tolist() == [[0, 0, 0], [1, 0, 0]] and td["reward"].sum() == 0
        t.join(20)  # before the pool (and its server) goes: the client hears why it was ended
    assert result["slot"] == 0 and result["commands"] == ([0, 1], [False, False])
    assert result["code"] == grpc.StatusCode.INVALID_ARGUMENT, result
    if breakage == "nan reward":
        assert "reward nan; rewards must be finite" in result["details"], result["details"]
    else:
        assert "truncated" in result["details"] or "observation" in result["details"], result["details"]


class _Hanging(OracleGymEnv):
    """Hangs ``hang_s`` in its ``hang_at``-th step."""

    def __init__(self, env_id, hang_at=0, hang_s=0.0):
        super().__init__(env_id)
        self.hang_at, self.hang_s = hang_at, hang_s

    def step(self, action):
        if self.total_steps + 1 == self.hang_at:
            time.sleep(self.hang_s)
        return super().step(action)


def test_a_host_past_step_timeout_is_dropped_and_its_open_episodes_truncated(dev_shm_guard):
    """``step_timeout`` bounds a host's whole pass: one env of a threaded host hanging for 5 s
    gets the host dropped after 1 s (well before the env wakes), its envs' open episodes
    truncated, and the next host takes over."""
    address = free_address()
    hanging = [functools.partial(_Hanging, 0, 5, 5.0), functools.partial(_Hanging, 1)]
    first = _Running(VectorEnvHost(hanging, address))
    slot = functools.partial(RemoteVectorSlot.like, OracleGymEnv(0), address, num_envs=2, step_timeout=1.0)
    with AsyncEnvPool([slot], start_timeout=60) as pool:
        checker = OracleChecker()
        truncated = set()
        t0 = time.monotonic()
        while len(truncated) < 2:
            td = pool.recv(min_get=1, timeout=30)
            for i, env in enumerate(td.env_indices.tolist()):
                tag, st = td["tag"][i].tolist(), int(td["step_type"][i])
                if st == StepType.TRUNCATION and env in checker._last and tag == list(checker._last[env]):
                    truncated.add(env)  # ended by the pool: the host was dropped
                else:
                    checker.observe(env, tag, st, reward=td["reward"][i], echo=td["echo"][i])
            _answer(pool, td)
        assert time.monotonic() - t0 < 5, "the hanging host was not dropped before its env woke"
        second = _Running(VectorEnvHost([functools.partial(OracleGymEnv, 0), functools.partial(OracleGymEnv, 1)],
                                        address))
        td = pool.recv(min_get=2, timeout=30)
        assert [int(x) for x in td["step_type"]] == [StepType.FIRST] * 2
        assert sorted(tag[0] for tag in td["tag"].tolist()) == [0, 1]
        _answer(pool, td)
        second.stop()
    first.stop(timeout=20)


def test_a_pool_of_vector_slots_refuses_a_seed_and_times_out_without_hosts(dev_shm_guard):
    from torchrl_asyncpool import EnvError

    slot = _vector_slot(free_address())
    with pytest.raises((EnvError, ValueError), match="owns its envs"):
        AsyncEnvPool([slot], seed=0, start_timeout=30)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="start_timeout"):  # its first reset waits for a host
        AsyncEnvPool([_vector_slot(free_address())], start_timeout=1.0)
    assert time.monotonic() - t0 < 15
