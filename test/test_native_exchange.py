"""The C engine of the exchange against the pure-Python reference.

The differential tests drive two consumers over two identical arenas (no processes: the
test plays the workers) through the same leases and answers, and require the same batches,
slot states, response rows, doorbell rings and metric sums. The oracle tests run real pools
on each exchange.
"""
import os
import re

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from conftest import oracle_factories
from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool.exchange import Arena, ArenaLayout, Doorbell
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.consumer import ConsumerHandle, SlotConsumer
from torchrl_asyncpool.exchange.native import native_available, pass_stores, resolve_exchange, row_copier
from torchrl_asyncpool.exchange.reference_engine import ReferenceEngine
from torchrl_asyncpool.testing import OracleChecker, OracleGymEnv, oracle_action

try:
    from torchrl_asyncpool.exchange import _native
except ImportError:
    _native = None

needs_native = pytest.mark.skipif(not native_available(), reason="the C engine is not built in this install")

N = 6
REQUEST = {
    "obs": ((3,), torch.float32),
    ("nested", "pixels"): ((2, 2, 3), torch.uint8),
    "reward": ((1,), torch.float32),
    "step_type": ((), torch.int8),
    "done": ((1,), torch.bool),
}
RESPONSE = {"action": ((2,), torch.int64), "policy_version": ((), torch.int64), "flag": ((1,), torch.bool)}
#: slot -> doorbell: slots 0-2 share worker bell 0, slots 3-5 bell 1
SLOT_BELL = [0, 0, 0, 1, 1, 1]


class _Side:
    """One arena, its doorbells and a consumer on the given exchange; the test is the worker."""

    def __init__(self, exchange):
        self.layout = ArenaLayout(N, REQUEST, RESPONSE, action_keys=["action"])
        self.arena = Arena.create(self.layout)
        self.bells = [Doorbell(), Doorbell()]
        self.consumer_bell = Doorbell()
        # sentinels that never become readable: pipes whose write ends stay open
        self.pipes = [os.pipe(), os.pipe()]
        handle = ConsumerHandle(
            layout=self.layout, arena_fd=InheritedFd(self.arena.fd), consumer_bell=self.consumer_bell.inheritable(),
            bells=[b.inheritable() for b in self.bells], slot_bell=SLOT_BELL,
            worker_sentinels=[InheritedFd(r) for r, _ in self.pipes], slot_worker=SLOT_BELL,
            worker_pids=[0, 0], action_keys=["action"], exchange=exchange,
        )
        self.consumer = SlotConsumer(handle, arena=self.arena)

    def publish(self, slot, value, ready_time):
        a = self.arena
        a.request["obs"][slot] = float(value)
        a.request["nested", "pixels"][slot] = value % 256
        a.request["reward"][slot] = value / 2
        a.request["step_type"][slot] = value % 4
        a.request["done"][slot] = bool(value % 2)
        a.ready_time[slot] = ready_time
        a.state[slot] = S.OBS_READY

    def rings(self):
        return [b.drain() for b in self.bells]

    def close(self):
        self.consumer.close()
        for b in [*self.bells, self.consumer_bell]:
            b.close()
        for r, w in self.pipes:
            os.close(r)
            os.close(w)
        self.arena.close()


@pytest.fixture
def sides():
    pair = [_Side("python"), _Side("native")]
    yield pair
    for side in pair:
        side.close()


@needs_native
def test_the_engine_runs_where_asked(sides):
    py, nat = sides
    assert isinstance(py.consumer._engine, ReferenceEngine)
    assert isinstance(nat.consumer._engine, _native.Engine)


@needs_native
def test_lease_and_answer_match_the_python_reference(sides):
    checks = 0
    for rnd in range(5):
        for side in sides:
            # slots 1, 2, 4, 5 ready, slot 4 the oldest, then 2, then 5, then 1; slot 3 busy in its worker
            for slot, age in [(1, 1.0), (2, 3.0), (4, 9.0), (5, 2.0)]:
                side.publish(slot, 10 * rnd + slot, ready_time=100.0 * rnd - age)
            side.arena.state[3] = S.FREE if rnd == 0 else S.ACTION_READY
        batches = [side.consumer.lease_ready(3) for side in sides]  # cap 3 of 4 ready: the 3 oldest
        for td in batches:
            assert td.env_indices.tolist() == [2, 4, 5]  # oldest three, in slot order
        a, b = batches
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), key
        assert a["obs"][:, 0].tolist() == [10 * rnd + 2, 10 * rnd + 4, 10 * rnd + 5]
        for side in sides:
            assert side.arena.state.tolist()[1:] == [S.OBS_READY, S.LEASED, 3 * (rnd > 0), S.LEASED, S.LEASED]
            assert side.arena.lease_time[2] == side.consumer.last_lease_time
        # answer: a tensor action, an int policy version (one row for all), a bool flag
        action = torch.tensor([[1, 2], [3, 4], [5, 6]]) + rnd
        flag = torch.tensor([[True], [False], [True]])
        for side in sides:
            side.consumer.send_rows([action, 7 + rnd, flag], np.array([2, 4, 5]), side.consumer.last_lease_time)
            assert side.rings() == [1, 1]  # slot 2 rings bell 0, slots 4 and 5 ring bell 1 once
            assert side.arena.state.tolist()[2] == S.ACTION_READY
            assert side.arena.response["action"][[2, 4, 5]].tolist() == action.tolist()
            assert side.arena.response["policy_version"][[2, 4, 5]].tolist() == [7 + rnd] * 3
            assert side.arena.response["flag"][[2, 4, 5]].tolist() == flag.tolist()
        # the last ready slot, through recv/send (the validated path)
        got = [side.consumer.recv(min_get=1, timeout=0) for side in sides]
        assert [td.env_indices.tolist() for td in got] == [[1], [1]]
        for side, td in zip(sides, got):
            side.consumer.send({"action": torch.tensor([[9, 9]]), "policy_version": torch.tensor([1]),
                                "flag": torch.tensor([[False]])}, td.env_indices)
            assert side.rings() == [1, 0]
        for key in RESPONSE:
            assert torch.equal(sides[0].arena.response[key], sides[1].arena.response[key]), key
        checks += 1
    s_py, s_nat = (side.arena.consumer_stats for side in sides)
    # frames, batches, partial batches, fill, actions: exactly equal; dwell sums: same order
    for i in (0, 1, 2, 3, 6):
        assert s_py[i] == s_nat[i], i
    assert s_py[0] == 5 * 4 and s_py[1] == 10 and s_py[6] == 5 * 4
    np.testing.assert_allclose(s_py[4], s_nat[4], rtol=0.05)  # obs dwell: ready_time is the test's
    assert checks == 5


@needs_native
def test_bad_answers_raise_before_anything_is_written(sides):
    for side in sides:
        for slot in range(N):
            side.publish(slot, slot, ready_time=0.0)
        assert side.consumer.lease_ready(N).env_indices.tolist() == list(range(N))
        before = side.arena.response.clone()
        idx = np.arange(2)
        bad = [
            ([torch.zeros(2, 3, dtype=torch.int64), 0, torch.zeros(2, 1, dtype=torch.bool)], "'action' must be"),
            ([torch.zeros(2, 2, dtype=torch.int32), 0, torch.zeros(2, 1, dtype=torch.bool)], "dtype torch.int64"),
            ([torch.zeros(3, 2, dtype=torch.int64), 0, torch.zeros(2, 1, dtype=torch.bool)], "shape"),
            ([torch.zeros(2, 2, dtype=torch.int64), 0, [[True], [False]]], "'flag' must be a tensor"),
        ]
        for values, match in bad:
            with pytest.raises(ValueError, match=match):
                side.consumer.send_rows(values, idx)
        assert (side.arena.response == before).all()
        assert side.arena.state.tolist() == [S.LEASED] * N
        assert side.rings() == [0, 0]
        # a non-contiguous tensor is taken (copied contiguous first)
        action = torch.zeros(2, 2, dtype=torch.int64)
        flag = torch.tensor([[True], [True], [False], [False]])[::2]  # a non-contiguous [2, 1] view
        assert not flag.is_contiguous()
        side.consumer.send_rows([action, 3, flag], idx)
        assert side.arena.response["flag"][:2].tolist() == [[True], [False]]
        assert side.arena.state.tolist()[:2] == [S.ACTION_READY] * 2


@needs_native
def test_engine_refuses_out_of_range_slots_and_bad_buffers(sides):
    engine = sides[1].consumer._engine
    with pytest.raises(IndexError, match="out of"):
        engine.answer(np.array([N], dtype=np.int64), [None, None, None], 0.0)
    with pytest.raises(TypeError, match="int64"):
        engine.answer(np.array([0], dtype=np.int32), [None, None, None], 0.0)
    with pytest.raises(ValueError, match="3 response fields"):
        engine.answer(np.array([0], dtype=np.int64), [None], 0.0)
    with pytest.raises(ValueError, match="bytes given"):
        engine.answer(np.array([0, 1], dtype=np.int64), [np.zeros(3, np.int64), b"\0" * 8, b"\0"], 0.0)
    with pytest.raises(ValueError, match="cap must be"):
        engine.lease(0, 0.0, 0.0)
    assert sides[1].arena.state.tolist() == [S.FREE] * N


def test_exchange_names_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="exchange must be one of"):
        AsyncEnvPool(oracle_factories(1), exchange="shm")
    monkeypatch.setenv("TORCHRL_ASYNCPOOL_EXCHANGE", "python")
    assert resolve_exchange("auto") == "python"
    assert resolve_exchange("native" if native_available() else "python") in ("native", "python")
    monkeypatch.setenv("TORCHRL_ASYNCPOOL_EXCHANGE", "fast")
    with pytest.raises(ValueError, match="TORCHRL_ASYNCPOOL_EXCHANGE must be one of"):
        resolve_exchange("auto")


def test_native_without_the_extension_says_how_to_get_it(monkeypatch):
    from torchrl_asyncpool.exchange import native

    monkeypatch.delenv("TORCHRL_ASYNCPOOL_EXCHANGE", raising=False)
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(native, "_IMPORT_ERROR", "No module named 'torchrl_asyncpool.exchange._native'")
    with pytest.raises(ImportError, match="C compiler and the Python headers"):
        resolve_exchange("native")
    assert resolve_exchange("auto") == "auto"


@pytest.mark.skipif(os.environ.get("TORCHRL_ASYNCPOOL_REQUIRE_NATIVE") != "1",
                    reason="set TORCHRL_ASYNCPOOL_REQUIRE_NATIVE=1 (CI does) to require the C engine")
def test_the_c_engine_was_built():
    assert native_available(), "the package was installed without its C engine (see setup.py)"


def test_bfloat16_fields_fall_back_to_python_or_are_refused():
    layout = ArenaLayout(2, {"obs": ((2,), torch.bfloat16)}, {"action": ((), torch.int64)})
    arena = Arena.create(layout)
    bell, cbell = Doorbell(), Doorbell()
    r, w = os.pipe()
    try:
        def handle(exchange):
            return ConsumerHandle(layout=layout, arena_fd=InheritedFd(arena.fd), consumer_bell=cbell.inheritable(),
                                  bells=[bell.inheritable()], slot_bell=[0, 0], worker_sentinels=[InheritedFd(r)],
                                  slot_worker=[0, 0], worker_pids=[0], exchange=exchange)

        assert isinstance(SlotConsumer(handle("auto"), arena=arena)._engine, ReferenceEngine)
        if native_available():
            with pytest.raises(ValueError, match=r"\['obs'\]"):
                SlotConsumer(handle("native"), arena=arena)
    finally:
        bell.close(), cbell.close(), os.close(r), os.close(w), arena.close()


def _gym_oracles(n):
    # gymnasium envs return Python float rewards: the workers' C stores take them (TorchRL envs'
    # tensors take numpy's path)
    import functools

    return [functools.partial(OracleGymEnv, env_id=i) for i in range(n)]


FACTORIES = {"torchrl": oracle_factories, "gymnasium": _gym_oracles}


@pytest.mark.parametrize("exchange", ["python", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("kind", ["torchrl", "gymnasium"])
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (4, False), (4, True)])
def test_oracle_through_each_exchange(exchange, kind, envs_per_worker, env_threads, dev_shm_guard):
    checker = OracleChecker()
    with AsyncEnvPool(FACTORIES[kind](8), envs_per_worker=envs_per_worker, env_threads=env_threads,
                      exchange=exchange) as pool:
        assert isinstance(pool._local_consumer()._engine, ReferenceEngine) == (exchange == "python")
        for i in range(200):
            td = pool.recv(min_get=1, max_get=None if i % 2 else 3)
            checker.observe_batch(td)
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
        m = pool.metrics()
        assert m["frames"] == checker.records and m["batches"] == 200
    assert checker.episodes_done > 8


@pytest.mark.parametrize("exchange", ["python", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("kind", ["torchrl", "gymnasium"])
def test_collector_transitions_through_each_exchange(exchange, kind):
    collector = AsyncPoolCollector(FACTORIES[kind](8), policy=_oracle_policy, frames_per_batch=200,
                                   total_frames=1000, envs_per_worker=4, exchange=exchange)
    checker = OracleChecker()
    frames = 0
    for batch in collector:
        checker.observe_transitions(batch)
        frames += batch.numel()
    collector.shutdown()
    assert frames == 1000


def _oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


@needs_native
def test_row_copies_match_numpy_stores():
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 100, (5, 3)).astype(np.int64), rng.random((5,)).astype(np.float32),
           rng.integers(0, 2, (5, 2, 2)).astype(bool)]
    dst = [np.zeros((3, 4, 3), np.int64), np.zeros((3, 4), np.float32), np.zeros((3, 4, 2, 2), bool)]
    ref = [d.copy() for d in dst]
    rows = row_copier("native", list(zip(src, dst)))
    s_idx, chunk, pos = np.array([4, 0, 2]), np.array([2, 0, 1]), np.array([3, 1, 0])
    rows.copy(s_idx, chunk * 4 + pos)
    rows.copy_one(1, 2 * 4 + 0)
    for a, r in zip(src, ref):
        r[chunk, pos] = a[s_idx]
        r[2, 0] = a[1]
    for d, r in zip(dst, ref):
        np.testing.assert_array_equal(d, r)
    with pytest.raises(IndexError, match="outside"):
        rows.copy(np.array([0, 5]), np.array([0, 1]))  # slot 5 of 5: nothing is copied
    with pytest.raises(IndexError, match="outside"):
        rows.copy_one(0, 12)
    with pytest.raises(TypeError, match="int64"):
        rows.copy(np.array([0], np.int32), np.array([0]))
    for d, r in zip(dst, ref):
        np.testing.assert_array_equal(d, r)
    assert row_copier("python", list(zip(src, dst))) is None
    assert row_copier("native", [(src[0], np.zeros((3, 4, 3), np.int32))]) is None  # dtypes differ: numpy's path


@needs_native
def test_pass_stores_and_publish_match_the_workers_numpy_path():
    layout = ArenaLayout(4, {"obs": ((2,), torch.float32), "reward": ((1,), torch.float32),
                             "step_type": ((), torch.int8), "done": ((1,), torch.bool),
                             "terminated": ((1,), torch.bool), "truncated": ((1,), torch.bool)},
                         {"action": ((), torch.int64)})
    arena = Arena.create(layout)
    bell = Doorbell()
    try:
        req = {k: arena.request.get(k).numpy() for k in ("reward", "step_type", "done", "terminated", "truncated")}
        p = pass_stores("native", arena, req["reward"], req["step_type"], req["done"], req["terminated"],
                        req["truncated"], bell.fd)
        assert p is not None
        slots = np.array([3, 1, 2])
        assert p.store(slots, [1, 2, 3], [0.5, 2.0, np.float64(-1.0)], [0.001, 0.002, 0.003]) is True
        assert req["step_type"].tolist() == [0, 2, 3, 1]
        assert req["terminated"][:, 0].tolist() == [False, True, False, False]
        assert req["truncated"][:, 0].tolist() == [False, False, True, False]
        assert req["done"][:, 0].tolist() == [False, True, True, False]
        assert req["reward"][:, 0].tolist() == [0.0, 2.0, -1.0, 0.5]
        np.testing.assert_allclose(arena.step_time, [0, 0.002, 0.003, 0.001])
        assert arena.step_count.tolist() == [0, 1, 1, 1]
        assert arena.state.tolist() == [S.FREE] * 4  # stored, not published yet
        # a reward numpy's path must store (not one number): nothing written, False
        before = req["step_type"].copy()
        assert p.store(np.array([0]), [2], [np.zeros(2, np.float32)], [0.0]) is False
        assert req["step_type"].tolist() == before.tolist() and arena.step_count[0] == 0
        with pytest.raises(IndexError):
            p.store(np.array([4]), [1], [1.0], [0.0])
        with pytest.raises(ValueError, match="3 step types"):
            p.store(np.array([0]), [1, 1, 1], [1.0], [0.0])
        p.publish([3, 1], 12.5)
        assert arena.state.tolist() == [S.FREE, S.OBS_READY, S.FREE, S.OBS_READY]
        assert arena.ready_time[[1, 3]].tolist() == [12.5, 12.5]
        assert bell.drain() == 2  # one ring, by the count
        with pytest.raises(IndexError):
            p.publish([9], 0.0)
        # one slot, stored and published at once (the per-slot path of threaded workers)
        assert p.record(0, 3, 1.5, 0.25, 20.0) is True
        assert (req["step_type"][0], req["truncated"][0, 0], req["done"][0, 0], req["terminated"][0, 0]) == \
            (3, True, True, False)
        assert (req["reward"][0, 0], arena.step_time[0], arena.step_count[0]) == (1.5, 0.25, 1)
        assert (arena.state[0], arena.ready_time[0], bell.drain()) == (S.OBS_READY, 20.0, 1)
        assert p.record(2, 0, 0, -1.0, 21.0) is True  # a FIRST record: reward 0, timers untouched
        assert (req["reward"][2, 0], arena.step_count[2], req["done"][2, 0]) == (0.0, 1, False)
        assert p.record(1, 1, np.full(1, 4.0, np.float32), 0.1, 22.0) is True  # one float32 (a TorchRL env's)
        assert req["reward"][1, 0] == 4.0 and bell.drain() == 2  # this ring and the FIRST record's
        assert p.record(1, 1, np.ones(2, np.float32), 0.1, 22.0) is False  # two numbers: numpy's path
        assert arena.ready_time[1] == 22.0 and bell.drain() == 0
        with pytest.raises(ValueError, match="step type 7"):
            p.record(0, 7, 0.0, -1.0, 0.0)
        assert pass_stores("python", arena, req["reward"], req["step_type"], req["done"], req["terminated"],
                           req["truncated"], bell.fd) is None
    finally:
        bell.close()
        arena.close()


def test_copy_into_matches_numpy_assignment_for_every_source_of_the_rows_shape():
    from torchrl_asyncpool.exchange.native import copy_into

    dst = np.zeros((84, 84, 3), np.uint8)
    sources = [
        np.random.default_rng(0).integers(0, 255, (84, 84, 3), dtype=np.uint8),  # the plain copy
        np.arange(84 * 84 * 3, dtype=np.int64).reshape(84, 84, 3) % 251,  # another dtype: numpy casts
        np.ones((3, 84, 84), np.uint8).transpose(1, 2, 0),  # not C-contiguous
        torch.full((84, 84, 3), 5, dtype=torch.uint8),  # a tensor
        np.full((84, 84, 3), 3, np.uint8).tolist(),  # nested lists
    ]
    for src in sources:
        want = np.zeros_like(dst)
        want[...] = src
        copy_into(dst, src)
        assert np.array_equal(dst, want), type(src)
    flag = np.zeros((1,), bool)
    copy_into(flag, np.array([True]))
    assert flag.tolist() == [True]
    big = np.zeros(300_000, np.uint8)  # above 256 KiB: copied without the GIL
    copy_into(big, np.full(300_000, 3, np.uint8))
    assert int(big.sum()) == 900_000
    # what numpy would broadcast (or refuse) is refused with both layouts, nothing written
    dst[...] = 1
    for src, given in [(np.full((84, 1, 3), 9, np.uint8), "of shape (84, 1, 3) and dtype uint8"),
                       (7, "of shape () and dtype int64"),
                       (np.zeros((2, 2), np.uint8), "of shape (2, 2) and dtype uint8")]:
        with pytest.raises(ValueError, match=rf"observation {re.escape(given)} where its observation spec "
                                             r"declares shape \(84, 84, 3\) and dtype uint8"):
            copy_into(dst, src)
    assert (dst == 1).all()


@needs_native
def test_copy_into_keeps_the_gil_where_numpy_lets_it_go():
    # with a long switch interval another Python thread runs only when this one lets the GIL go
    import sys
    import threading
    import time

    from torchrl_asyncpool.exchange.native import copy_into

    src, dst = np.ones((84, 84, 3), np.uint8), np.zeros((84, 84, 3), np.uint8)
    count, stop = [0], []

    def spin():
        while not stop:
            count[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)  # lets it start; the GIL comes back at the latest after one interval
        before = count[0]
        for _ in range(200):
            copy_into(dst, src)
        kept = count[0] - before
        before = count[0]
        deadline = time.monotonic() + 10.0  # on a busy machine the spinner may wait for a core
        while time.monotonic() < deadline:  # until the other thread got the GIL once
            dst[...] = src  # numpy lets the GIL go for a copy this size
            if count[0] != before:
                break
        let_go = count[0] - before
    finally:
        stop.append(True)
        spinner.join()
        sys.setswitchinterval(interval)
    assert kept == 0 and let_go > 0, (kept, let_go)


@needs_native
def test_the_c_enums_match_the_python_ones():
    # the C sources compare slot states and step types through enums in csrc/native.h; the module
    # exports them so that a renumbering on either side fails here instead of corrupting records
    from torchrl_asyncpool import StepType

    for value, name in S.NAMES.items():
        assert getattr(_native, f"SLOT_{name}") == value, name
    for step in StepType:
        assert getattr(_native, f"STEP_{step.name}") == int(step), step.name


@pytest.mark.parametrize("exchange", ["python", pytest.param("native", marks=needs_native)])
def test_a_batch_lives_until_the_next_lease_and_send_does_not_touch_it(exchange):
    # the rule recv's docstring and design.rst state: a fresh TensorDict over staging rows, which
    # the next recv/lease_ready overwrites; workers and send never write them
    side = _Side(exchange)
    try:
        for slot in (1, 3):
            side.publish(slot, 10 + slot, ready_time=float(slot))
        first = side.consumer.recv(min_get=2, timeout=0)
        assert first.env_indices.tolist() == [1, 3] and first["obs"][:, 0].tolist() == [11.0, 13.0]
        first.set("added_by_policy", torch.ones(2))
        answer = {"action": torch.zeros(2, 2, dtype=torch.int64), "policy_version": torch.zeros(2, dtype=torch.int64),
                  "flag": torch.zeros(2, 1, dtype=torch.bool)}
        side.consumer.send(answer, first.env_indices)
        side.publish(1, 21, ready_time=5.0)  # the worker writes slot 1's next record
        assert first["obs"][:, 0].tolist() == [11.0, 13.0]  # answered, slot rewritten: the batch holds
        side.publish(4, 24, ready_time=6.0)
        second = side.consumer.recv(min_get=2, timeout=0)
        assert second.env_indices.tolist() == [1, 4] and "added_by_policy" not in second.keys()
        # the next lease reused the staging rows: the first batch's tensors now show the second's
        assert first["obs"][:, 0].tolist() == [21.0, 24.0]
        assert first["obs"].data_ptr() == second["obs"].data_ptr()
    finally:
        side.close()


@pytest.mark.parametrize("exchange", ["python", pytest.param("native", marks=needs_native)])
def test_a_consumer_of_no_keys_leases_without_copying_records(exchange):
    # keys=(): batches carry only env indices, and neither engine copies a record (for a serving
    # loop whose policy runners gather from the slots themselves)
    side = _Side(exchange)
    try:
        bare = SlotConsumer(side.consumer.handle, arena=side.arena, keys=())
        assert list(bare._staging.keys()) == ["env_index"]
        for slot in (0, 5):
            side.publish(slot, slot, ready_time=1.0)
        td = bare.lease_ready(4)
        assert td.env_indices.tolist() == [0, 5] and list(td.keys()) == ["env_index"]
        assert side.arena.state.tolist() == [S.LEASED, 0, 0, 0, 0, S.LEASED]
        bare.send_rows([torch.ones(2, 2, dtype=torch.int64), 1, torch.ones(2, 1, dtype=torch.bool)], td.env_indices)
        assert side.rings() == [1, 1]
        bare.close()
    finally:
        side.close()
