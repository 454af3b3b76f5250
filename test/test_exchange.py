"""Unit tests of the exchange building blocks and the step type."""
import multiprocessing as mp
import select
import statistics
import time

import torch

from torchrl_asyncpool import StepType, discount_from_step_type
from torchrl_asyncpool.exchange import Arena, ArenaLayout, Doorbell, InheritedFd, poll_for


def _child_writes(layout, fd, bell):
    arena = Arena.attach(layout, fd.fd)
    arena.request["obs"][2] = 42.0
    arena.state[2] = 1
    Doorbell(bell.fd).ring()


def test_arena_is_shared_with_a_forkserver_child_and_has_no_dev_shm_file(dev_shm_guard):
    layout = ArenaLayout(4, {"obs": ((3,), torch.float32)}, {("a", "b"): ((2,), torch.int64)})
    arena = Arena.create(layout)
    bell = Doorbell()
    ctx = mp.get_context("forkserver")
    p = ctx.Process(target=_child_writes, args=(layout, InheritedFd(arena.fd), bell.inheritable()))
    p.start()
    assert bell.wait(timeout=30)
    p.join(10)
    assert p.exitcode == 0
    assert arena.request["obs"][2].tolist() == [42.0] * 3
    assert arena.state.tolist() == [0, 0, 1, 0]
    assert arena.response["a", "b"].shape == (4, 2)
    arena.close()
    bell.close()


def test_doorbell_counts_and_times_out():
    bell = Doorbell()
    assert bell.drain() == 0
    assert not bell.wait(timeout=0.01)
    bell.ring(3)
    assert bell.wait(timeout=0)
    assert bell.drain() == 3
    bell.close()


def test_poll_for_honours_sub_millisecond_timeouts():
    # poll(2) counts whole milliseconds and CPython rounds up: a 200 us wait used to take >= 1 ms
    # every time (a 100 us flush deadline idled the envs a full millisecond). The median of many
    # tries keeps a descheduled try on a busy machine from failing the test.
    bell = Doorbell()
    p = select.poll()
    p.register(bell.fd, select.POLLIN)
    took = []
    for _ in range(31):
        t0 = time.monotonic()
        assert poll_for(p, 0.0002) == []
        took.append(time.monotonic() - t0)
    assert statistics.median(took) < 0.00095, took
    bell.ring()
    assert [fd for fd, _ in poll_for(p, 0.0002)] == [bell.fd]
    assert [fd for fd, _ in poll_for(p, 5.0)] == [bell.fd]  # ready: returns at once
    bell.drain()
    t0 = time.monotonic()
    assert poll_for(p, 0.0) == []
    assert not bell.wait(timeout=0.0015)
    assert time.monotonic() - t0 >= 0.0015  # waits of a millisecond or more still wait in full
    bell.close()


def test_layout_alignment():
    layout = ArenaLayout(3, {"x": ((5,), torch.uint8)}, {"y": ((), torch.float64)})
    assert all(off % 64 == 0 for off in layout.offsets.values())


def test_step_type_and_discount():
    assert [int(s) for s in StepType] == [0, 1, 2, 3]
    st = torch.tensor([0, 1, 2, 3], dtype=torch.int8)
    assert discount_from_step_type(st).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert StepType.TRUNCATION.is_last() and not StepType.MID.is_last()


def test_fresh_batch_tensordicts_share_rows_but_not_keys(monkeypatch):
    # the consumer hands each batch out as a new TensorDict over cached staging rows: a key a
    # policy adds to one batch must not appear in the next, nested entries included, with
    # tensordict's fast constructor and with the public fallback
    from tensordict import TensorDict

    from torchrl_asyncpool.exchange import consumer

    staging = TensorDict({"obs": torch.arange(8.0).view(4, 2), "nest": {"x": torch.zeros(4, 3)}}, [4])
    tree = consumer._leaf_tree(staging[:3])
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(consumer, "_NEW_UNSAFE", None)
        first = consumer._fresh_td(tree, 3)
        assert first.batch_size == (3,) and first["nest", "x"].shape == (3, 3)
        first.set("action", torch.ones(3))
        first.set(("nest", "y"), torch.ones(3))
        second = consumer._fresh_td(tree, 3)
        assert "action" not in second.keys() and ("nest", "y") not in second.keys(True)
        second["obs"][0, 0] = 42.0  # the rows themselves are shared with the staging buffer
        assert staging["obs"][0, 0] == 42.0
        staging["obs"][0, 0] = 0.0
