"""A host's stream driven by the thread that uses it (remote/host_call.py), against a real gRPC
server; and hosts over grpcio's public stream, where the single-threaded call is unavailable."""
from __future__ import annotations

import functools
import threading
import time
from concurrent import futures

import gymnasium as gym
import pytest
from tensordict import TensorDict

grpc = pytest.importorskip("grpc")

from conftest import free_address, host_running  # noqa: E402
from torchrl_asyncpool import AsyncEnvPool  # noqa: E402
from torchrl_asyncpool.remote import EnvHost, RemoteEnvSlot, RemoteHostError, RemoteVectorSlot, VectorEnvHost  # noqa: E402
from torchrl_asyncpool.remote import host as host_module  # noqa: E402
from torchrl_asyncpool.remote.host_call import HostCall, HostCallEnded, open_host_call  # noqa: E402
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv, oracle_action  # noqa: E402

METHOD = "/probe.Echo/Stream"


class _Server:
    """A gRPC server of one stream-stream method: ``handler(request_iterator, context)``."""

    def __init__(self, handler):
        self.address = free_address()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "probe.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(handler)})])
        self.server.add_insecure_port(self.address)
        self.server.start()
        self.channel = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(self.channel).result(timeout=10)

    def call(self, metadata=None) -> HostCall:
        call = open_host_call(self.channel, METHOD, metadata)
        assert isinstance(call, HostCall), "grpcio's single-threaded call is unavailable"
        return call

    def close(self):
        self.channel.close()
        self.server.stop(0)


@pytest.fixture
def serving():
    servers = []

    def start(handler):
        servers.append(_Server(handler))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _echo(requests, context):
    for message in requests:
        if message == b"bye":
            return  # ends the stream with OK
        yield message + b"!"


def test_round_trips_arrive_in_order_and_a_normal_end_reads_none(serving):
    server = serving(_echo)
    call = server.call()
    for i in range(200):
        call.send(b"m%d" % i)
        assert call.recv() == b"m%d!" % i
    call.send(b"bye")
    assert call.recv() is None
    assert list(call) == []  # stays ended
    call.close()


def test_messages_sent_ahead_come_back_in_order(serving):
    server = serving(_echo)
    call = server.call()
    for i in range(20):  # each send waits only for gRPC to take the one before
        call.send(b"%d" % i)
    assert [call.recv() for _ in range(20)] == [b"%d!" % i for i in range(20)]
    call.close()


def test_the_metadata_reaches_the_server(serving):
    seen = []

    def handler(requests, context):
        seen.append(dict(context.invocation_metadata()).get("x-token"))
        for message in requests:
            yield message

    call = serving(handler).call(metadata=(("x-token", "abc"),))
    call.send(b"x")
    assert call.recv() == b"x"
    call.close()
    assert seen == ["abc"]


def test_an_error_status_is_raised_with_its_code_and_details(serving):
    def refuse(requests, context):
        next(requests)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not this host")

    call = serving(refuse).call()
    call.send(b"hello")
    with pytest.raises(HostCallEnded) as err:
        call.recv()
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details() == "not this host"
    with pytest.raises(HostCallEnded):  # sending on the ended stream says why, too
        call.send(b"more")
    call.close()


def test_cancel_from_another_thread_ends_a_waiting_recv(serving):
    release = threading.Event()

    def silent(requests, context):
        next(requests)
        release.wait(30)
        return iter(())

    call = serving(silent).call()
    call.send(b"hello")
    threading.Timer(0.2, call.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(HostCallEnded) as err:
        call.recv()
    assert err.value.code == grpc.StatusCode.CANCELLED
    assert time.monotonic() - t0 < 10  # ~0.2 s
    call.close()
    release.set()


def test_close_of_an_open_stream_cancels_it_and_returns(serving):
    ended = threading.Event()

    def handler(requests, context):
        context.add_callback(ended.set)
        for message in requests:
            yield message

    call = serving(handler).call()
    call.send(b"a")
    assert call.recv() == b"a"
    call.close()
    assert ended.wait(10), "the server still holds the stream"


def test_items_posted_from_threads_arrive_once_each_in_order_packed_together(serving):
    """Threads post while the main thread waits in recv (a threaded host's envs): every item
    goes out exactly once, each thread's in the order posted, those posted while a message was
    in flight packed into the next one."""
    server = serving(_echo)
    call = server.call()
    call.send(b"hello")
    assert call.recv() == b"hello!"
    call.posting(lambda items: b"|".join(items))
    n_threads, per_thread = 4, 300

    def post(t):
        for i in range(per_thread):
            call.post(b"%d.%d" % (t, i))

    threads = [threading.Thread(target=post, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    got, messages = [], 0
    while len(got) < n_threads * per_thread:
        got += call.recv()[:-1].split(b"|")
        messages += 1
    for t in threads:
        t.join()
    assert sorted(got) == sorted(b"%d.%d" % (t, i) for t in range(n_threads) for i in range(per_thread))
    for t in range(n_threads):
        mine = [int(x.split(b".")[1]) for x in got if x.startswith(b"%d." % t)]
        assert mine == list(range(per_thread))
    assert messages < n_threads * per_thread  # some were packed together
    call.close()


def test_a_post_after_the_stream_ended_is_dropped(serving):
    call = serving(_echo).call()
    call.posting(lambda items: b"".join(items))
    call.post(b"bye")
    assert call.recv() is None
    call.post(b"late")  # no error, nothing sent: the stream is over
    call.close()


def test_close_while_threads_post_returns_and_leaves_nothing_due(serving):
    """An env thread may post while the host closes its stream (a stop, the pool gone): the
    close neither hangs nor polls a queue grpcio has freed, whatever the interleaving."""
    server = serving(_echo)
    for _ in range(20):
        call = server.call()
        call.posting(lambda items: b"|".join(items))
        stop = threading.Event()

        def post():
            while not stop.is_set():
                call.post(b"x")

        threads = [threading.Thread(target=post) for _ in range(3)]
        for t in threads:
            t.start()
        call.recv()  # some records went out and came back
        t0 = time.monotonic()
        call.close()
        assert time.monotonic() - t0 < 10
        assert not call._due
        stop.set()
        for t in threads:
            t.join(10)
            assert not t.is_alive()


def test_the_installed_grpcio_gives_hosts_their_single_threaded_call():
    """The hosts' fast path is what the other remote tests exercise: a grpcio that dropped the
    single-threaded call would silently move every host to the public stream."""
    channel = grpc.insecure_channel(free_address())
    try:
        call = open_host_call(channel, METHOD)
        assert isinstance(call, HostCall)
        call.close()  # nothing listens: the call ends UNAVAILABLE, collected here
    finally:
        channel.close()


@pytest.fixture
def public_stream(monkeypatch):
    """Hosts as on a grpcio without the single-threaded call."""
    monkeypatch.setattr(host_module, "open_host_call", lambda *args, **kwargs: None)


def _drive(pool, checker, records):
    n = 0
    while n < records:
        td = pool.recv(min_get=1, timeout=30)
        checker.observe_batch(td)
        pool.send(TensorDict({"action": oracle_action(td["tag"])}, [td.shape[0]]), td.env_indices)
        n += td.shape[0]


@pytest.mark.parametrize("host_kind", ["protocol 1", "vector env", "env threads"])
def test_hosts_over_the_public_stream_deliver_exactly_once(dev_shm_guard, public_stream, host_kind):
    address = free_address()
    if host_kind == "protocol 1":
        slots = [functools.partial(RemoteEnvSlot.like, OracleGymEnv(0), address)]
        host = EnvHost(functools.partial(OracleGymEnv, 0), address)
    else:
        slots = [functools.partial(RemoteVectorSlot.like, OracleGymEnv(0), address, num_envs=3)]
        envs = [functools.partial(OracleGymEnv, j) for j in range(3)]
        host = VectorEnvHost(envs if host_kind == "env threads" else lambda: gym.vector.SyncVectorEnv(envs), address)
    t, result = host_running(host)
    with AsyncEnvPool(slots, start_timeout=60) as pool:
        checker = OracleChecker()
        _drive(pool, checker, 200)
        assert checker.episodes_done >= 1
    t.join(20)
    assert not t.is_alive() and "error" not in result, result
    assert result["steps"] > 0


def test_a_refusal_over_the_public_stream_names_its_code(dev_shm_guard, public_stream):
    address = free_address()
    with AsyncEnvPool([functools.partial(RemoteEnvSlot.like, OracleGymEnv(0), address, token="right")]):
        with pytest.raises(RemoteHostError, match="UNAUTHENTICATED"):
            EnvHost(OracleGymEnv(0), address, token="wrong").run()
