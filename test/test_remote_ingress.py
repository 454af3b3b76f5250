"""Bounded ingress of remote env slots: a flood of silent connections that hold the token
neither grows the server's threads past its cap nor keeps a real host from its slot."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

grpc = pytest.importorskip("grpc")

from conftest import free_address  # noqa: E402
from torchrl_asyncpool import StepType  # noqa: E402
from torchrl_asyncpool.remote import EnvHost, RemoteEnvSlot, RemoteHostError  # noqa: E402
from torchrl_asyncpool.remote import protocol as P  # noqa: E402
from torchrl_asyncpool.remote import ingress as remote_ingress  # noqa: E402
from torchrl_asyncpool.testing import OracleGymEnv  # noqa: E402

TOKEN = "flood-token"


def _stream_threads():
    return [t for t in threading.enumerate() if t.name.startswith("env-host-stream")]


class _Flood:
    """``n`` silent streams with the right token, opened from an asyncio loop in a thread of
    its own (grpc.aio: no client thread per stream); :meth:`stop` cancels those still open."""

    def __init__(self, address: str, n: int):
        self.address, self.n = address, n
        self.opened = 0
        self.codes = {}
        self._loop = asyncio.new_event_loop()
        self._done = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self):
        self._done = asyncio.Event()
        channels = [grpc.aio.insecure_channel(self.address) for _ in range(max(1, self.n // 100))]
        calls = []
        for i in range(self.n):
            call = channels[i % len(channels)].stream_stream(P.METHOD)(metadata=((P.TOKEN_METADATA, TOKEN),))
            calls.append(call)
            self.opened += 1
            if i % 50 == 49:
                await asyncio.sleep(0)  # let the calls start
        await self._done.wait()
        for call in calls:
            if not call.done():
                call.cancel()
        for call in calls:
            code = await call.code()
            self.codes[code.name] = self.codes.get(code.name, 0) + 1
        for channel in channels:
            await channel.close()

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout=30.0):
        while self._done is None and self._thread.is_alive():
            time.sleep(0.01)
        if self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the flood's loop did not end"
        self._loop.close()


def _flood_and_host(monkeypatch, n):
    monkeypatch.setattr(remote_ingress, "_IDLE_THREAD_S", 0.5)
    address = free_address()
    slots = [RemoteEnvSlot.like(OracleGymEnv(0), address, token=TOKEN) for _ in range(2)]
    for i, slot in enumerate(slots):
        slot._pool_listen(i)
    ingress = slots[0]._ingress
    cap = ingress.max_streams + remote_ingress._SPARE_THREADS
    assert ingress.max_streams == 2 + remote_ingress.HELLO_MARGIN
    peak = [0]
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            peak[0] = max(peak[0], len(_stream_threads()))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    flood = _Flood(address, n).start()
    host = None
    try:
        deadline = time.monotonic() + 60
        while ingress.streams_evicted < n // 2 and time.monotonic() < deadline:  # the flood is on
            time.sleep(0.01)
        assert ingress.streams_evicted >= n // 2, f"only {ingress.streams_evicted} silent streams were evicted"
        host = EnvHost(OracleGymEnv(0), address, token=TOKEN)
        result = {}
        t0 = time.monotonic()
        runner = threading.Thread(target=lambda: result.setdefault("steps", host.run()), daemon=True)
        runner.start()
        while host.slot is None and runner.is_alive() and time.monotonic() - t0 < 30:
            time.sleep(0.002)
        waited = time.monotonic() - t0
        assert host.slot == 0, result
        obs, _ = slots[0].reset()  # the host's FIRST record reaches the slot
        assert obs["tag"].tolist() == [0, 0, 0]
        threads_in_flood = len(_stream_threads())
    finally:
        flood.stop()
        sampling.set()
        sampler.join(5)
        if host is not None:
            host.stop()
    assert peak[0] <= cap, f"{peak[0]} handler threads for a cap of {cap}"
    assert threads_in_flood <= cap
    # every silent stream ended: cancelled by a newer one, refused, or by the test at the end
    assert sum(flood.codes.values()) == n, flood.codes
    assert set(flood.codes) <= {"CANCELLED", "RESOURCE_EXHAUSTED"}, flood.codes
    deadline = time.monotonic() + 10  # the flood's threads go once idle (0.5 s here)
    while len(_stream_threads()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    left = len(_stream_threads())
    for slot in slots:
        slot.close()
    assert left <= 1, f"{left} handler threads stayed after the flood"  # at most the host's, ending
    return waited


def test_a_flood_of_silent_streams_keeps_threads_bounded_and_a_real_host_gets_its_slot(monkeypatch):
    waited = _flood_and_host(monkeypatch, 300)
    assert waited < 5.0, f"a real host waited {waited:.2f} s for its slot during the flood"


@pytest.mark.slow
def test_a_flood_of_1100_silent_streams(monkeypatch):
    waited = _flood_and_host(monkeypatch, 1100)
    assert waited < 5.0, f"a real host waited {waited:.2f} s for its slot during the flood"


def test_streams_beyond_the_cap_are_refused_with_resource_exhausted(monkeypatch):
    """Every slot held and the hello margin full of silent streams: a further stream is
    refused at once with RESOURCE_EXHAUSTED and a message (not queued, no thread kept)."""
    monkeypatch.setattr(remote_ingress, "HELLO_MARGIN", 2)
    address = free_address()
    slot = RemoteEnvSlot.like(OracleGymEnv(0), address, token=TOKEN)
    slot._pool_listen(0)
    host = EnvHost(OracleGymEnv(0), address, token=TOKEN)
    runner = threading.Thread(target=host.run, daemon=True)
    runner.start()
    flood = None
    try:
        assert int(StepType.FIRST) == 0
        slot.reset()  # the slot is held
        flood = _Flood(address, 2).start()
        deadline = time.monotonic() + 20
        while len(slot._ingress._handshakes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(slot._ingress._handshakes) == 2
        t0 = time.monotonic()
        with pytest.raises(RemoteHostError, match="RESOURCE_EXHAUSTED.*at most 3 streams at once") as err:
            EnvHost(OracleGymEnv(0), address, token=TOKEN).run()
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert time.monotonic() - t0 < 5
        assert slot._ingress.streams_refused == 1
    finally:
        if flood is not None:
            flood.stop()
        host.stop()
        runner.join(10)
        slot.close()


def test_many_real_hosts_connecting_at_once_all_get_their_slots():
    """Hellos may use every stream the held slots leave: 16 hosts connecting at the same moment
    to 16 free slots all get one, none is cancelled as silent (the hello margin is 8)."""
    address = free_address()
    n = 16
    slots = [RemoteEnvSlot.like(OracleGymEnv(0), address) for _ in range(n)]
    for i, slot in enumerate(slots):
        slot._pool_listen(i)
    hosts = [EnvHost(OracleGymEnv(0), address) for _ in range(n)]
    errors = []

    def run(host):
        try:
            host.run()
        except Exception as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in hosts]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(h.slot is not None for h in hosts) < n and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not errors, errors
        assert sorted(h.slot for h in hosts) == list(range(n))
        assert slots[0]._ingress.streams_evicted == 0
    finally:
        for h in hosts:
            h.stop()
        for t in threads:
            t.join(10)
        for slot in slots:
            slot.close()
