"""The C consumer engine against its specification, the pure-Python ReferenceEngine.

Two identical arenas, one engine each, driven through the same random sequence of worker
publishes (with ties in ready time), errors, leases of random caps, answers of random subsets in
random order (rows or one row for all, one lease time or each slot's own) and scans. After every
step both sides must hold the same bytes: lease results, staging rows and env indices, slot
states, lease times, response rows, doorbell rings and consumer stats. Times are multiples of
1/8 below 2**20, so that every dwell sum is exact whatever the order of its additions (the one
thing the engines may do differently, see reference_engine.py).
"""
import os

import numpy as np
import pytest
import torch

from torchrl_asyncpool.exchange import Arena, ArenaLayout, Doorbell
from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.native import build_engine, native_available
from torchrl_asyncpool.exchange.reference_engine import ReferenceEngine

needs_native = pytest.mark.skipif(not native_available(), reason="the C engine is not built in this install")

REQUEST = {
    "obs": ((3,), torch.float32),
    ("nested", "pixels"): ((2, 2, 3), torch.uint8),
    "reward": ((1,), torch.float32),
    "step_type": ((), torch.int8),
    "done": ((1,), torch.bool),
}
RESPONSE = {"action": ((2,), torch.int64), "policy_version": ((), torch.int64), "flag": ((1,), torch.bool)}


class _Side:
    """An arena, its doorbells, a staging buffer and one engine over them; the test plays the workers."""

    def __init__(self, exchange, n, slot_bell, request=REQUEST, response=RESPONSE):
        self.n = n
        self.arena = Arena.create(ArenaLayout(n, request, response))
        self.bells = [Doorbell() for _ in range(max(slot_bell) + 1)]
        self.keys = list(self.arena.request.keys(True, True))
        self.staging = {k: torch.zeros_like(self.arena.request.get(k)) for k in self.keys}
        self.env_index = np.zeros(n, np.int64)
        self.response_keys = [k if len(k) > 1 else k[0] for k in
                              (tuple(k) if isinstance(k, tuple) else (k,) for k in response)]
        self.engine = build_engine(
            exchange, self.arena, self.env_index,
            [(k, self.arena.request.get(k), self.staging[k]) for k in self.keys],
            [(k, self.arena.response.get(k)) for k in self.response_keys],
            [b.fd for b in self.bells], np.asarray(slot_bell),
        )

    def snapshot(self):
        """Every byte the engine may write, and what the workers would see rung."""
        a = self.arena
        return {
            "state": a.state.copy(), "lease_time": a.lease_time.copy(), "stats": a.consumer_stats.copy(),
            "env_index": self.env_index.copy(),
            **{("staging", k): v.clone() for k, v in self.staging.items()},
            **{("response", k): a.response.get(k).clone() for k in self.response_keys},
            "rings": [b.drain() for b in self.bells],
        }

    def close(self):
        self.engine = None
        for b in self.bells:
            b.close()
        self.arena.close()


def _assert_same(x, y, what):
    assert x.keys() == y.keys()
    for k in x:
        a, b = x[k], y[k]
        if isinstance(a, torch.Tensor):  # as bytes: random float bytes may be NaN, which equals nothing
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (what, k)
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: {k}")


def _publish(sides, rng, slot, t):
    """A worker's record: random field bytes, then the ready time, then OBS_READY."""
    values = {k: torch.from_numpy(rng.integers(0, 256, sides[0].arena.request.get(k)[slot].numel() *
                                               sides[0].arena.request.get(k).element_size(), dtype=np.uint8))
              for k in sides[0].keys}
    for side in sides:
        for k, raw in values.items():
            field = side.arena.request.get(k)
            if field.dtype == torch.bool:
                raw = raw % 2  # a bool byte must be 0 or 1
            field[slot].view(-1).view(torch.uint8).copy_(raw)
        side.arena.ready_time[slot] = t
        side.arena.state[slot] = S.OBS_READY


def _answer_values(rng, side, b):
    """Random answers: per field, b rows (a numpy array) or one row for every slot (bytes)."""
    out = []
    for k in side.response_keys:
        dst = side.arena.response.get(k).numpy()
        high = 2 if dst.dtype == np.bool_ else 1000
        if rng.random() < 0.7:
            out.append(rng.integers(0, high, (b, *dst.shape[1:])).astype(dst.dtype))
        else:
            out.append(rng.integers(0, high, dst.shape[1:]).astype(dst.dtype).tobytes())
    return out


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_the_c_engine_does_what_the_reference_does(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    slot_bell = np.sort(rng.integers(0, max(1, n // 3), n)).tolist()  # workers of a few slots each
    slot_bell = [b for b in np.unique(slot_bell, return_inverse=True)[1].tolist()]  # no bell without slots
    sides = [_Side("python", n, slot_bell), _Side("native", n, slot_bell)]
    assert isinstance(sides[0].engine, ReferenceEngine) and not isinstance(sides[1].engine, ReferenceEngine)
    clock = 8.0  # in 1/8 steps: exact sums
    leased, steps, nonempty = [], 0, 0
    try:
        for step in range(300):
            clock += int(rng.integers(0, 3)) / 8
            op = rng.random()
            state = sides[0].arena.state
            if op < 0.4:  # workers publish some free or answered slots, often with equal times
                free = (state == S.FREE) | (state == S.ACTION_READY)
                if rng.random() < 0.5:  # a block: every waiting slot of a window, one ready time
                    a = int(rng.integers(0, n))
                    window = np.zeros(n, bool)
                    window[a:a + int(rng.integers(1, n + 1))] = True
                    for slot in np.flatnonzero(free & window):
                        _publish(sides, rng, int(slot), clock)
                else:
                    for slot in np.flatnonzero(free):
                        if rng.random() < 0.5:
                            _publish(sides, rng, int(slot), clock - int(rng.integers(0, 4)) / 8)
            elif op < 0.43 and (state == S.FREE).any():  # an env error in a free slot
                slot = int(rng.choice(np.flatnonzero(state == S.FREE)))
                for side in sides:
                    side.arena.state[slot] = S.ERROR
            elif op < 0.75:
                cap = int(rng.integers(1, n + 3))
                waited = int(rng.integers(0, 5)) / 8
                got = [side.engine.lease(cap, clock, waited) for side in sides]
                assert got[0] == got[1], (step, got)
                b = got[0][0]
                assert b == min(cap, b) and isinstance(b, int)
                if b:
                    nonempty += 1
                    leased.extend(sides[0].env_index[:b].tolist())
            elif leased:  # answer a random subset of the leased slots, in random order
                k = int(rng.integers(1, len(leased) + 1))
                pick = rng.permutation(leased)[:k].astype(np.int64)
                leased = [s for s in leased if s not in set(pick.tolist())]
                values = _answer_values(rng, sides[0], k)
                lease_t = -1.0 if rng.random() < 0.5 else clock - 1.0
                for side in sides:
                    assert side.engine.answer(pick, values, clock, lease_t) is None
            scans = [side.engine.scan() for side in sides]
            assert scans[0] == scans[1], (step, scans)
            snaps = [side.snapshot() for side in sides]
            _assert_same(*snaps, f"step {step}")
            steps += 1
        assert nonempty > 20 and sides[0].arena.consumer_stats[1] == nonempty  # the sequence did lease
    finally:
        for side in sides:
            side.close()
    assert steps == 300


@needs_native
def test_both_engines_refuse_the_same_bad_calls_before_writing():
    n = 4
    sides = [_Side("python", n, [0, 0, 1, 1]), _Side("native", n, [0, 0, 1, 1])]
    rng = np.random.default_rng(0)
    try:
        for slot in range(n):
            _publish(sides, rng, slot, 1.0)
        for side in sides:
            assert side.engine.lease(n, 2.0, 0.0) == (n, 4.0)
        before = [side.snapshot() for side in sides]
        ok = [np.zeros((2, 2), np.int64), np.zeros(2, np.int64), np.zeros((2, 1), bool)]
        bad_calls = [
            ((np.array([0, n], np.int64), ok, 3.0), IndexError, "out of"),
            ((np.array([0, 1], np.int32), ok, 3.0), TypeError, "int64"),
            ((np.array([0, 1], np.int64), ok[:2], 3.0), ValueError, "2 values given for 3 response fields"),
            ((np.array([0, 1], np.int64), [np.zeros(3, np.int64), *ok[1:]], 3.0), ValueError,
             "response field 0: 24 bytes given for 2 rows of 16 bytes"),
            # a bad last field: nothing of the good first ones is written either
            ((np.array([0, 1], np.int64), [*ok[:2], np.zeros(3, bool)], 3.0), ValueError, "response field 2"),
        ]
        for args, exc, match in bad_calls:
            for side in sides:
                with pytest.raises(exc, match=match):
                    side.engine.answer(*args)
        for side in sides:
            with pytest.raises(ValueError, match="cap must be >= 1"):
                side.engine.lease(0, 3.0, 0.0)
        after = [side.snapshot() for side in sides]
        for b, a in zip(before, after):
            _assert_same(b, a, "after refused calls")
        _assert_same(*after, "both sides")
    finally:
        for side in sides:
            side.close()


def test_the_reference_serves_fields_numpy_cannot_view():
    # bfloat16 fields only run on the reference (torch's gathers and stores): the same sequence
    # on a float32 layout, with values bfloat16 holds exactly, must give the same numbers
    n = 5
    sides = []
    for dtype in (torch.bfloat16, torch.float32):
        side = _Side("python", n, [0] * n, request={"obs": ((2,), dtype)},
                     response={"action": ((2,), dtype), "version": ((), torch.int64)})
        assert isinstance(side.engine, ReferenceEngine)
        sides.append(side)
    try:
        for side in sides:
            side.arena.request.get("obs").copy_(torch.arange(2.0 * n).view(n, 2))
            side.arena.ready_time[:] = [5.0, 1.0, 4.0, 2.0, 3.0]
            side.arena.state[:] = S.OBS_READY
            assert side.engine.lease(3, 6.0, 0.0) == (3, 12.0)  # slots 1, 3, 4
            assert side.env_index[:3].tolist() == [1, 3, 4]
            dtype = side.arena.response.get("action").dtype
            # what the consumer hands each field: a tensor where numpy has no view, else numpy or bytes
            act = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=dtype)
            one_row = torch.tensor([8.0, -8.0], dtype=dtype)
            if dtype != torch.bfloat16:
                act, one_row = act.numpy(), one_row.numpy().tobytes()
            side.engine.answer(np.array([4, 1], np.int64), [act, np.full(2, 9, np.int64)], 7.0)
            side.engine.answer(np.array([3], np.int64), [one_row, np.full(1, 3, np.int64).tobytes()], 7.0)
        bf, f32 = sides
        assert bf.staging["obs"][:3].float().tolist() == f32.staging["obs"][:3].tolist() == [[2, 3], [6, 7], [8, 9]]
        for key in ("action", "version"):
            assert bf.arena.response.get(key).float().tolist() == f32.arena.response.get(key).float().tolist()
        assert f32.arena.response.get("action")[[4, 1, 3]].tolist() == [[1, 2], [3, 4], [8, -8]]
        assert bf.arena.state.tolist() == f32.arena.state.tolist() == [S.OBS_READY, S.ACTION_READY, S.OBS_READY,
                                                                       S.ACTION_READY, S.ACTION_READY]
        assert [b.drain() for b in bf.bells] == [2]  # one ring per answer
        with pytest.raises(ValueError, match="bytes given"):
            bf.engine.answer(np.array([0], np.int64), [torch.zeros(3, dtype=torch.bfloat16), b"\0" * 8], 8.0)
    finally:
        for side in sides:
            side.close()


def test_a_closed_native_consumer_keeps_working_on_the_reference():
    # SlotConsumer.close() lets go of the C engine's buffer exports and swaps in the Python
    # engine, so that a serving thread that finishes a batch after close still answers it
    from torchrl_asyncpool._sys.descriptors import InheritedFd
    from torchrl_asyncpool.exchange.consumer import ConsumerHandle, SlotConsumer

    layout = ArenaLayout(2, {"obs": ((2,), torch.float32)}, {"action": ((), torch.int64)})
    arena = Arena.create(layout)
    bell, cbell = Doorbell(), Doorbell()
    r, w = os.pipe()
    try:
        handle = ConsumerHandle(layout=layout, arena_fd=InheritedFd(arena.fd), consumer_bell=cbell.inheritable(),
                                bells=[bell.inheritable()], slot_bell=[0, 0], worker_sentinels=[InheritedFd(r)],
                                slot_worker=[0, 0], worker_pids=[0], action_keys=["action"], exchange="auto")
        consumer = SlotConsumer(handle, arena=arena)
        arena.state[:] = S.OBS_READY
        td = consumer.lease_ready(2)
        consumer.close()
        assert isinstance(consumer._engine, ReferenceEngine)
        consumer.send({"action": torch.tensor([4, 5])}, td.env_indices)
        assert arena.response.get("action").tolist() == [4, 5] and arena.state.tolist() == [S.ACTION_READY] * 2
        assert bell.drain() == 1
    finally:
        bell.close(), cbell.close(), os.close(r), os.close(w), arena.close()


@needs_native
def test_the_c_engine_refuses_a_second_thread_during_a_gil_free_gather():
    # a lease of large records lets the GIL go while it copies; another thread calling into the
    # same Engine then gets a RuntimeError instead of sharing its scratch arrays
    import threading

    n = 16
    side = _Side("native", n, [0] * n, request={"pixels": ((512, 1024), torch.uint8)},
                 response={"action": ((), torch.int64)})
    refused, stop = [], []

    def intruder():
        empty = np.empty(0, np.int64)
        while not stop:
            try:
                side.engine.answer(empty, [np.zeros(1, np.int64)], 0.0)  # answers nothing
            except RuntimeError as exc:
                refused.append(str(exc))

    thread = threading.Thread(target=intruder)
    try:
        thread.start()
        pixels = side.arena.request.get("pixels")
        for k in range(20):
            pixels[:, 0, 0] = torch.arange(n, dtype=torch.uint8) + k
            side.arena.state[:] = S.OBS_READY
            assert side.engine.lease(n, 1.0, 0.0)[0] == n  # 8 MiB gathered without the GIL
            assert side.staging["pixels"][:, 0, 0].tolist() == [(i + k) % 256 for i in range(n)]
            if refused:
                break
    finally:
        stop.append(True)
        thread.join()
        side.close()
    assert refused and "two threads" in refused[0]
