"""A worker's side of the chunk buffers (``AsyncEnvPool(delivery=...)``): each stepped record
becomes one transition row of its env's chunk, ``[T, ...]`` consecutive steps of one env.

A transition is written in two halves around the step: :meth:`_Delivery.write_root` copies the
record the action answered and the answer (before the step overwrites the slot's rows), and
:meth:`_Delivery.write_next` copies the record the step produced (after it is stored) as the
row's ``"next"``; a full chunk is handed to the driver (``FULL``) with one ring of its doorbell.
A slot without a free chunk waits (back-pressure, never loss). Used by every worker loop (the
pass loop, env threads, the lockstep loop of a vector env).
"""
from __future__ import annotations

import time

import numpy as np

from torchrl_asyncpool.delivery import chunks as C
from torchrl_asyncpool.exchange.arena import Arena
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool.exchange.native import row_copier

__all__ = []


def _np(t) -> np.ndarray:
    return t.numpy()


class _NumpyRows:
    """numpy's stores of chunk rows: the pure-Python engine of :class:`_Delivery`, with the
    interface of the C copier (``exchange.native.row_copier``) it stands in for.

    Args:
        pairs (list): ``(src, dst)`` numpy arrays, ``src`` a slot field ``[n, *row]`` and ``dst``
            the matching chunk field ``[chunks, T, *row]``.
        T (int): the chunk length; a flat chunk row ``r`` is ``dst[r // T, r % T]``.

    Examples:
        >>> import numpy as np
        >>> src, dst = np.arange(6.0).reshape(3, 2), np.zeros((2, 2, 2))
        >>> rows = _NumpyRows([(src, dst)], 2)
        >>> rows.copy(np.array([2, 0]), np.array([2, 1]))
        >>> dst[1, 0].tolist(), dst[0, 1].tolist()
        ([4.0, 5.0], [0.0, 1.0])
    """

    __slots__ = ("pairs", "T")

    def __init__(self, pairs, T):
        self.pairs, self.T = pairs, T

    def copy_one(self, i, row):
        """Slot ``i``'s row of every field into flat chunk row ``row``."""
        c, p = divmod(row, self.T)
        for src, dst in self.pairs:
            dst[c, p] = src[i]

    def copy(self, idx, rows):
        """Slots ``idx``'s rows into flat chunk rows ``rows`` (int64 arrays of one length)."""
        chunk, pos = np.divmod(rows, self.T)
        for src, dst in self.pairs:
            dst[chunk, pos] = src[idx]


def _row_engine(exchange, pairs, T):
    """The copier of ``pairs``' rows, chosen once: the C one (``exchange.native.row_copier``)
    where it runs and can copy every pair as raw rows, else :class:`_NumpyRows`; both have
    ``copy_one(i, row)`` and ``copy(idx, rows)``, so the writer never asks which."""
    rows = row_copier(exchange, pairs)
    return rows if rows is not None else _NumpyRows(pairs, T)


class _Delivery:
    """The worker's side of the chunk buffers: copies of (record, answer, next record) rows."""

    def __init__(self, handle, arena, exchange="python"):
        self.T = handle.chunk_size
        self.per_env = handle.chunks_per_env
        self.chunks = Arena.attach(handle.layout, handle.fd.fd)
        self.driver = Doorbell(handle.driver_bell.fd)
        self.state = self.chunks.state
        c = self.chunks.request
        req, resp = arena.request, arena.response
        # (slot source array, chunk destination array) pairs, all numpy, resolved once
        self.root = []
        self.next = []
        for f in arena.layout.request:
            k, name = f.key, f.key[0]
            if name == "step_type":
                continue
            if name in ("reward", "done", "terminated", "truncated"):
                self.next.append((_np(req.get(k)), _np(c.get(("next",) + k))))
            else:
                self.root.append((_np(req.get(k)), _np(c.get(k))))
                self.next.append((_np(req.get(k)), _np(c.get(("next",) + k))))
        self.root += [(_np(resp.get(f.key)), _np(c.get(f.key))) for f in arena.layout.response]
        # the copies of those pairs: one C call per group of slots, or numpy's stores (one engine
        # each, chosen here once, as the consumer chooses its engine)
        self._root_rows = _row_engine(exchange, self.root, self.T)
        self._next_rows = _row_engine(exchange, self.next, self.T)
        # watched workers: each chunk's length counts its complete transitions, for a replacement
        self.persist = False

    def claim(self, slot) -> bool:
        """Makes sure ``slot`` has a chunk to write into; False means back-pressure."""
        if slot.chunk >= 0:
            return True
        for c in slot.chunks:
            if self.state[c] == C.FREE:
                if self.persist:
                    self.chunks.length[c] = 0
                self.state[c] = C.FILLING
                self.chunks.seq[c] = slot.seq
                slot.seq += 1
                slot.chunk, slot.pos = c, 0
                return True
        return False

    def write_root(self, slot):
        """Row ``pos``: the record the action answered, and the answer (before publishing)."""
        self._root_rows.copy_one(slot.index, slot.chunk * self.T + slot.pos)

    def write_root_rows(self, slots, idx):
        """:meth:`write_root` for several claimed ``slots`` at once (``idx``: their indices);
        returns their chunk rows (``chunk * T + pos``, flat) for :meth:`write_next_rows`."""
        T = self.T
        rows = np.array([s.chunk * T + s.pos for s in slots], np.int64)
        self._root_rows.copy(idx, rows)
        return rows

    def write_next_rows(self, slots, idx, rows):
        """:meth:`write_next` for several slots at once (``rows``: from :meth:`write_root_rows`)."""
        T = self.T
        self._next_rows.copy(np.ascontiguousarray(idx), rows)
        full = 0
        length = self.chunks.length if self.persist else None
        for slot in slots:
            slot.pos += 1
            if length is not None:
                length[slot.chunk] = slot.pos  # after the data
            if slot.pos == T:
                self._close(slot)
                full += 1
        if full:
            self.driver.ring(full)

    def write_next(self, slot):
        """Row ``pos``: the record the step produced (after publishing); closes full chunks."""
        c = slot.chunk
        self._next_rows.copy_one(slot.index, c * self.T + slot.pos)
        slot.pos += 1
        if self.persist:
            self.chunks.length[c] = slot.pos  # after the data
        if slot.pos == self.T:
            self._close(slot)
            self.driver.ring()

    def resume(self, slot) -> None:
        """Takes over ``slot``'s chunks from a dead worker: the one it was filling goes on at its
        first incomplete row (closed if it was full)."""
        slot.seq = max(int(self.chunks.seq[c]) for c in slot.chunks) + 1
        for c in slot.chunks:
            if self.state[c] == C.FILLING:
                slot.chunk, slot.pos = c, int(self.chunks.length[c])
                if slot.pos >= self.T:
                    self._close(slot)
                    self.driver.ring()
                return

    def _close(self, slot):
        """Hands ``slot``'s filled chunk to the driver (``FULL``, after its data); the caller rings."""
        c = slot.chunk
        self.chunks.length[c] = self.T
        self.chunks.ready_time[c] = time.monotonic()
        self.state[c] = C.FULL  # after the data
        slot.chunk = -1

