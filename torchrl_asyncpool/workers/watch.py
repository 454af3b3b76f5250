"""What a watched worker leaves in shared memory so that the pool can kill and replace it.

A pool watches its workers when it may have to replace one: ``on_env_failure="restart"`` (a
worker process that died is started again) or ``step_timeout`` (a worker stuck in a step is
killed). A watched worker writes, besides its records:

* ``busy_since[i]`` (an arena control word): when its current step or reset of slot ``i``
  began, on ``time.monotonic()``'s clock, which every process of the machine shares. Positive
  for a step (or the reset of an answered slot) that writes the slot's rows, negative for an
  eager reset, which does not (see ``_Stepper.eager_reset``), 0 after an eager reset. The step
  is still running while ``|busy_since[i]| > ready_time[i]``: a record's publication writes a
  later ``ready_time``. The pool's watchdog reads it to find a hung step (:func:`hung_slots`).
* ``busy_pos[i]``, written just before ``busy_since[i]``: the chunk row that step's transition
  goes to (-1 without chunks). The chunk's ``length`` counts its complete transitions (written
  after each), so a replacement can tell whether the dead worker finished that transition.
* with restarts on, a **shadow copy** of slot ``i``'s observation rows and step type, taken
  just before the step starts writing them (and before ``busy_since``).

A replacement worker takes each of its slots over (:meth:`Watcher.takeover`) from these words
alone. A slot in ``ACTION_READY`` whose dead worker

* had written a whole new record without publishing it (a ``ready_time`` later than the
  slot's ``lease_time``, or its transition complete in the chunk) gets that record published:
  nothing the env did is lost;
* was in the middle of its step (``busy_since`` positive and later than ``ready_time``) gets
  its rows back from the shadow: they are again the record the consumer last leased.

Any other slot's rows hold its last published record. The replacement then cuts the episode
that record left open with a ``TRUNCATION`` at its observation when the slot is next answered
(after a terminal record, the answer gets the new env's ``FIRST``, marked instead).
"""
from __future__ import annotations

import time

import numpy as np

from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.arena import Arena
from torchrl_asyncpool.exchange.native import row_copier

__all__ = ["WorkerWatch", "Watcher", "shadow_keys", "hung_slots"]

#: request fields a record rewrites whole (the records' own scalars), not shadowed
_RECORD_FIELDS = ("reward", "done", "terminated", "truncated", "env_restarted")


def shadow_keys(layout) -> list:
    """The request fields a shadow copy holds: the observations and the step type (which
    tells a replacement whether the slot's last record ended its episode)."""
    recurrent = set(layout.recurrent)
    return [f.key for f in layout.request if f.key[0] not in _RECORD_FIELDS and f.key not in recurrent]


class WorkerWatch:
    """A worker's instructions for being watched (picklable, sent with its start).

    Args:
        shadow_fd (InheritedFd, optional): the shadow arena (same layout as the pool's), for
            pools that replace dead workers; ``None`` when only hung steps are watched.
        resume (bool): the worker replaces one that died: its slots keep their states and
            records, and it publishes no first records of its own (see :meth:`Watcher.takeover`).
    """

    __slots__ = ("shadow_fd", "resume")

    def __init__(self, shadow_fd=None, resume: bool = False):
        self.shadow_fd, self.resume = shadow_fd, bool(resume)

    def __getstate__(self):
        return (self.shadow_fd, self.resume)

    def __setstate__(self, state):
        self.shadow_fd, self.resume = state

    def resumed(self) -> "WorkerWatch":
        """The same watch for a replacement worker."""
        return WorkerWatch(self.shadow_fd, resume=True)


class Watcher:
    """A worker's (or one env thread's) side of :class:`WorkerWatch`, over its arena."""

    def __init__(self, watch: WorkerWatch, arena: Arena, exchange: str = "python"):
        self.busy, self.busy_pos = arena.busy_since, arena.busy_pos
        self.ready_time, self.lease_time, self.state = arena.ready_time, arena.lease_time, arena.state
        self.shadow = None
        self.pairs = []  # (slot rows, shadow rows) numpy arrays per shadowed field
        if watch.shadow_fd is not None:
            self.shadow = Arena.attach(arena.layout, watch.shadow_fd.fd)
            self.pairs = [(arena.request.get(k).numpy(), self.shadow.request.get(k).numpy())
                          for k in shadow_keys(arena.layout)]
        # the shadow copy of a slot in one C call (None: numpy's stores, one per field)
        self._rows = row_copier(exchange, self.pairs) if self.pairs else None

    def begin(self, i: int, chunk_row: int = -1) -> None:
        """Slot ``i``'s step (or the reset whose record it is about to write) begins; its
        transition goes to chunk row ``chunk_row`` (-1: none)."""
        if self._rows is not None:
            self._rows.copy_one(i, i)
        else:
            for rows, shadow in self.pairs:
                shadow[i] = rows[i]
        self.busy_pos[i] = chunk_row
        self.busy[i] = time.monotonic()  # last: see the module docstring

    def begin_block(self, rows: slice, chunk_rows=-1) -> None:
        """:meth:`begin` for adjacent slots stepped by one call (a vector env)."""
        for src, shadow in self.pairs:
            shadow[rows] = src[rows]
        self.busy_pos[rows] = chunk_rows
        self.busy[rows] = time.monotonic()

    def begin_eager_reset(self, i: int) -> None:
        """An eager reset of slot ``i`` begins: it writes no rows (its record waits for the answer)."""
        self.busy[i] = -time.monotonic()

    def end_eager_reset(self, i: int) -> None:
        """The eager reset of slot ``i`` is over (done, or failed and handled)."""
        self.busy[i] = 0.0

    def takeover(self, i: int, chunk_lengths=None, chunk_size: int = 0) -> bool:
        """Takes slot ``i`` over from a dead worker (see the module docstring); ``chunk_lengths``:
        the chunks' ``length`` words (``None`` without chunks), of ``chunk_size`` rows each.
        Returns True when the slot holds a whole record its dead worker did not publish (the
        caller publishes it); otherwise its rows are the last record the consumer leased
        (restored if needed)."""
        b = float(self.busy[i])
        ready, pos = float(self.ready_time[i]), int(self.busy_pos[i])
        self.busy[i] = 0.0
        if self.state[i] != S.ACTION_READY:
            return False
        if ready > float(self.lease_time[i]):  # died publishing it: ready_time is written first
            return True
        if b > 0 and b > ready:  # died in the step
            if pos >= 0 and chunk_lengths is not None and chunk_lengths[pos // chunk_size] > pos % chunk_size:
                # its transition is complete in the chunk (written from the stored record): so is the record
                return True
            self.restore(i)
        return False

    def restore(self, i: int) -> None:
        """Puts slot ``i``'s shadowed rows back as :meth:`begin` copied them (a step that failed
        after writing part of them, or a dead worker's step)."""
        for rows, shadow in self.pairs:
            rows[i] = shadow[i]


def hung_slots(arena: Arena, timeout: float, now: float) -> np.ndarray:
    """Slots whose current step or reset began more than ``timeout`` seconds before ``now``."""
    b = np.abs(arena.busy_since)
    return np.flatnonzero((b > arena.ready_time) & (now - b > timeout))
