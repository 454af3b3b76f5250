"""The consumer engine in pure Python: the executable specification of the C ``Engine``.

A consumer engine does the two hot operations of :class:`~torchrl_asyncpool.exchange.consumer.SlotConsumer`
over the arena, one call each, plus a count of the slot states:

* ``lease(cap, now, waited) -> (b, dwell_sum)``: take the ready slots (the ``cap`` that have
  waited longest, in slot order, if more are ready; equal ready times go by slot index), write
  their indices to the staging ``env_index[:b]`` and their records to the staging rows ``[:b]``,
  mark them ``LEASED`` with ``lease_time = now``; ``dwell_sum`` adds ``now - ready_time`` over the
  ``b`` slots. A batch (``b > 0``) is added to the consumer stats with ``waited`` seconds of
  waiting before it;
* ``answer(idx, values, now, lease_time=-1.0)``: write ``values[k]`` (``len(idx)`` rows of response
  field ``k``, or one row that every slot gets) into the response rows ``idx``, mark those slots
  ``ACTION_READY``, then ring each of their doorbells once, in the order of ``idx``. Every index
  and value is checked before the first byte is written. The answers are added to the stats
  with the time since their lease (``lease_time >= 0``: one lease time for every row);
* ``scan() -> (obs_ready, action_ready, errors, oldest_ready_time)``: the counts of three states
  and the earliest ``ready_time`` of the ready slots (``inf`` when none).

:class:`ReferenceEngine` does this with numpy (and torch for dtypes numpy lacks, such as
bfloat16); ``torchrl_asyncpool.exchange._native.Engine`` does it in C (``exchange/csrc/engine.c``).
:func:`~torchrl_asyncpool.exchange.native.build_engine` returns one or the other, and the consumer
calls them without knowing which. ``test/test_engine_equivalence.py`` drives both over the same
random sequences of slot states, ready times, caps and answers and requires the same leases,
staging rows, states, answers, rings and stats. A change of behaviour goes here first.

The one thing the two may not share is the last bit of a dwell sum: C adds ``now - t`` slot by
slot, numpy sums pairwise, so with ready times that are not exactly representable the sums may
differ by rounding (the equivalence test uses times where every order is exact).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.doorbell import Doorbell

__all__ = ["ReferenceEngine"]

_NUM_STATES = max(S.NAMES) + 1


class ReferenceEngine:
    """The consumer engine over the arena's buffers, in Python (see the module docstring).

    The arguments are those of the C ``Engine``, except that a field numpy cannot view
    (bfloat16, say) may be given as a torch tensor, which the C engine refuses.

    Args:
        state (np.ndarray): the arena's int32 ``[n]`` state words.
        ready_time (np.ndarray): float64 ``[n]``, written by the workers with ``OBS_READY``.
        lease_time (np.ndarray): float64 ``[n]``, written here at lease.
        env_index (np.ndarray): the staging buffer's int64 ``[n]`` env index.
        gathers (sequence): ``(src, dst, row_bytes)`` per request field a batch carries: the
            slot field and its staging field, ``[n, *row]`` arrays or tensors.
        responses (sequence): ``(dst, row_bytes)`` per response field, ``[n, *row]``.
        bell_fds (sequence of int): the workers' doorbell descriptors.
        slot_bell (np.ndarray): int64 ``[n]``, the doorbell of each slot.
        stats (np.ndarray): the arena's float64 ``consumer_stats``.
        stat_slots (sequence of int): the 8 positions in ``stats`` of
            :data:`~torchrl_asyncpool.exchange.metrics.STAT_SLOTS`.

    Examples:
        >>> import os, numpy as np
        >>> from torchrl_asyncpool.exchange.reference_engine import ReferenceEngine
        >>> from torchrl_asyncpool.exchange.metrics import STAT_SLOTS
        >>> n = 3
        >>> state, ready = np.array([1, 0, 1], np.int32), np.array([2.0, 0.0, 1.0])
        >>> obs, staging, action = np.arange(n * 2.0).reshape(n, 2), np.zeros((n, 2)), np.zeros(n, np.int64)
        >>> bell = os.eventfd(0, os.EFD_NONBLOCK)
        >>> engine = ReferenceEngine(state, ready, np.zeros(n), np.zeros(n, np.int64), [(obs, staging, 16)],
        ...                          [(action, 8)], [bell], np.zeros(n, np.int64), np.zeros(8), STAT_SLOTS)
        >>> engine.lease(1, 3.0, 0.0)  # one of the two ready slots: the older, slot 2
        (1, 2.0)
        >>> staging[0].tolist(), state.tolist()
        ([4.0, 5.0], [1, 0, 2])
        >>> engine.answer(np.array([2]), [np.array([7])], 4.0)
        >>> action.tolist(), state.tolist(), os.eventfd_read(bell)
        ([0, 0, 7], [1, 0, 3], 1)
        >>> engine.scan()
        (1, 1, 0, 2.0)
        >>> os.close(bell)
    """

    def __init__(self, state: np.ndarray, ready_time: np.ndarray, lease_time: np.ndarray, env_index: np.ndarray,
                 gathers: Sequence, responses: Sequence, bell_fds: Sequence[int], slot_bell: np.ndarray,
                 stats: np.ndarray, stat_slots: Sequence[int]):
        n = self._n = int(state.shape[0])
        if n < 1:
            raise ValueError("state: an int32 buffer of at least one slot was expected")
        self._state, self._ready_time, self._lease_time, self._env_index = state, ready_time, lease_time, env_index
        self._gathers = [(src, dst) for src, dst, _ in gathers]
        self._responses = [(dst, _row_elems(dst)) for dst, _ in responses]
        self._bells = [Doorbell(int(fd)) for fd in bell_fds]  # wrappers: the descriptors stay the caller's
        self._slot_bell = np.ascontiguousarray(slot_bell, dtype=np.int64)
        if self._slot_bell.shape != (n,) or (n and (self._slot_bell.min() < 0
                                                    or self._slot_bell.max() >= len(self._bells))):
            raise ValueError(f"slot_bell must hold a doorbell index in [0, {len(self._bells)}) for each of {n} slots")
        # a memoryview adds a Python float to an element in half the time numpy's scalar += takes
        self._stats = memoryview(stats)
        (self._frames, self._batches, self._partial, self._fill, self._obs_dwell, self._act_dwell, self._actions,
         self._wait) = (int(i) for i in stat_slots)

    # -- lease ------------------------------------------------------------------------------
    def lease(self, cap: int, now: float, waited: float):
        """Leases up to ``cap`` of the oldest ready slots; ``(b, dwell_sum)`` (see the module docstring)."""
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        ready = np.flatnonzero(self._state == S.OBS_READY)
        b = ready.size
        if b == 0:
            return 0, 0.0
        if b > cap:
            # a stable sort of slots in index order: equal ready times go by slot index
            ready = np.sort(ready[np.argsort(self._ready_time[ready], kind="stable")[:cap]])
            b = cap
        dwell = float((now - self._ready_time[ready]).sum())
        self._env_index[:b] = ready
        self._lease_time[ready] = now
        self._state[ready] = S.LEASED  # only consumers read LEASED: no order against the copies below
        for src, dst in self._gathers:
            if src.__class__ is np.ndarray:
                src.take(ready, 0, dst[:b], "clip")  # numpy's take: never starts threads (see gather.py)
            else:
                torch.index_select(src, 0, torch.from_numpy(ready), out=dst[:b])
        s = self._stats
        s[self._frames] += b
        s[self._batches] += 1.0
        s[self._partial] += 1.0 if b < cap else 0.0
        s[self._fill] += b / cap
        s[self._obs_dwell] += dwell
        s[self._wait] += waited
        return b, dwell

    # -- answer -----------------------------------------------------------------------------
    def answer(self, idx: np.ndarray, values: Sequence, now: float, lease_time: float = -1.0) -> None:
        """Writes the answers of the slots ``idx``, hands the slots back and rings their workers
        (see the module docstring). ``values[k]``: a C-contiguous buffer (numpy array, bytes) of
        ``len(idx)`` rows of response field ``k`` or of one row, or a tensor for a field numpy
        cannot view."""
        if not (idx.__class__ is np.ndarray and idx.dtype == np.int64 and idx.flags.c_contiguous):
            raise TypeError("idx must be a contiguous int64 buffer")
        b, n = idx.size, self._n
        if b and idx.view(np.uint64).max() >= n:  # one pass: a negative index is a huge unsigned one
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise IndexError(f"slot index {bad} out of [0, {n})")
        if len(values) != len(self._responses):
            raise ValueError(f"{len(values)} values given for {len(self._responses)} response fields")
        # every value is checked before the first byte is written
        rows = [self._rows_of(k, value, b) for k, value in enumerate(values)]
        for (dst, _), (value, whole) in zip(self._responses, rows):
            if dst.__class__ is np.ndarray:
                dst[idx] = value if whole else value[0]
            else:
                index = torch.from_numpy(idx)
                if whole:
                    dst.index_copy_(0, index, value)
                else:
                    dst[index] = value[0]
        if lease_time >= 0.0:
            dwell = b * (now - lease_time)
        else:
            dwell = float((now - self._lease_time[idx]).sum())
        self._state[idx] = S.ACTION_READY  # after the data
        for bell in dict.fromkeys(self._slot_bell[idx].tolist()):  # each doorbell once, in the order of idx
            self._bells[bell].ring()
        s = self._stats
        s[self._actions] += b
        s[self._act_dwell] += dwell

    def _rows_of(self, k: int, value, b: int):
        """``(rows, whole)``: ``value`` as ``[b or 1, *row]`` of field ``k``'s dtype and whether it
        holds ``b`` rows; ``ValueError`` when its size is neither ``b`` rows nor one."""
        dst, row = self._responses[k]
        if dst.__class__ is np.ndarray:
            if (value.__class__ is np.ndarray and value.dtype == dst.dtype and value.shape[1:] == dst.shape[1:]
                    and value.shape[:1] == (b,) and value.flags.c_contiguous):
                return value, True  # the consumer's usual answer: b rows as they are (checked as below)
            view = memoryview(value)
            if not view.c_contiguous:
                raise BufferError(f"response field {k}: the value is not C-contiguous")
            itemsize, nbytes = dst.dtype.itemsize, view.nbytes
        else:
            itemsize, nbytes = dst.element_size(), value.numel() * value.element_size()
        if nbytes != b * row * itemsize and nbytes != row * itemsize:
            raise ValueError(f"response field {k}: {nbytes} bytes given for {b} rows of {row * itemsize} bytes")
        whole = nbytes == b * row * itemsize
        shape = (b if whole else 1, *dst.shape[1:])
        if dst.__class__ is np.ndarray:
            return np.frombuffer(view.cast("B"), dtype=dst.dtype).reshape(shape), whole
        return value.reshape(shape), whole

    # -- scan -------------------------------------------------------------------------------
    def scan(self):
        """``(obs_ready, action_ready, errors, oldest_ready_time)`` (see the module docstring)."""
        state = self._state
        counts = np.bincount(state, minlength=_NUM_STATES)
        ready = int(counts[S.OBS_READY])
        oldest = math.inf
        if ready:
            # workers only add ready slots meanwhile, so this set holds at least one
            oldest = float(self._ready_time[state == S.OBS_READY].min())
        return ready, int(counts[S.ACTION_READY]), int(counts[S.ERROR]), oldest


def _row_elems(dst) -> int:
    """Elements of one row of an ``[n, *row]`` array or tensor."""
    return int(np.prod(dst.shape[1:], dtype=np.int64))
