"""The one writer of a worker's records into the arena, and their publisher.

Every worker loop (envs stepped one by one in a pass, a vector env stepped in lockstep, one env
per thread) writes its records through a :class:`RecordWriter`; nothing else in a worker stores
a step type, an end flag, a reward, a step timer, a recurrent input or a slot state. A record's
life on the worker side::

    the env's step writes the observation into the slot's request rows (the adapter's step_into)
    writer.add(i, ...)       stages slot i's step type, reward and step time (and, at once, its
                             recurrent inputs and restart flag): the one way in for a row
    writer.add_block(...)    the same for a block of adjacent slots (a vector env), stored at
                             once: the one way in for a block
    writer.store()           writes the staged records' fields: one store per array for a group
    [the chunk copy of the record (``delivery``) reads the rows here]
    writer.publish()         ready times, then OBS_READY (after the data), then one ring of the
                             consumer's doorbell for the whole lot

A record is visible to the consumer only after :meth:`RecordWriter.publish`; until then its rows
are the worker's. The C steps of a pass (:func:`~torchrl_asyncpool.exchange.native.step_group`)
stage their rows without calling :meth:`~RecordWriter.add` once per record: they append to
the lists :meth:`~RecordWriter.plain_staging` hands out, which it does only while ``add`` is
nothing but those appends (no recurrent inputs, no restart flags: :attr:`~RecordWriter.plain`).

The C stores of :func:`~torchrl_asyncpool.exchange.native.pass_stores` do the
stores and the publish when the engine is built; numpy's stores (the reference) otherwise, with
the same result.
"""
from __future__ import annotations

import time

import numpy as np

from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool.exchange.native import pass_stores
from torchrl_asyncpool.step_type import StepType

__all__ = ["RecordWriter", "RESTARTED_KEY", "RewardError"]

_FIRST, _TERM, _TRUNC = int(StepType.FIRST), int(StepType.TERMINATION), int(StepType.TRUNCATION)
#: the request entry that marks a record produced by an env restart (``on_env_failure="restart"``)
RESTARTED_KEY = "env_restarted"


class RecordWriter:
    """Stages, stores and publishes one worker's (or one env thread's) records.

    Args:
        arena (Arena): the worker's mapping of the pool's arena.
        consumer_fd (int): the consumer's doorbell.
        exchange (str): the pool's resolved exchange (``"python"``: numpy's stores only).

    Not thread-safe: each thread that publishes records has its own writer (they share the
    arena, never a slot).
    """

    def __init__(self, arena, consumer_fd: int, exchange: str = "python"):
        req = arena.request
        self.state, self.ready_time = arena.state, arena.ready_time
        self.step_time, self.step_count = arena.step_time, arena.step_count
        self.reward = req.get("reward").numpy()
        self.step_type = req.get("step_type").numpy()
        self.done = req.get("done").numpy()
        self.terminated = req.get("terminated").numpy()
        self.truncated = req.get("truncated").numpy()
        n = self.state.shape[0]
        # one (k, 1, ...) reshape broadcasts a step type over each slot's flag row
        self._flag_dims = (1,) * (self.done.ndim - 1)
        # (hidden_in, hidden_out) rows: a record's recurrent input is its env's last answered
        # state, zeros on FIRST (see AsyncEnvPool's recurrent_state)
        self.recurrent = [(req.get(i).numpy(), arena.response.get(o).numpy())
                          for i, o in arena.layout.recurrent.items()]
        # on_env_failure="restart": the "env_restarted" rows, and what each slot's row holds now
        self.restarted = req.get(RESTARTED_KEY).numpy() if RESTARTED_KEY in req.keys() else None
        # (read from the rows: a replacement worker takes over the flags its dead worker left)
        self._restarted_now = [] if self.restarted is None else [bool(v) for v in self.restarted.reshape(n, -1)[:, 0]]
        self.consumer = Doorbell(consumer_fd)
        self._c = pass_stores(exchange, arena, self.reward, self.step_type, self.done, self.terminated,
                              self.truncated, consumer_fd)
        # staged single records, not yet stored: slot, step type, reward, step seconds
        self._idx, self._sts, self._rewards, self._times = [], [], [], []
        self._idx_buf = np.empty(n, np.int64)  # the staged slots as the int64 buffer the C stores take
        # add() writes nothing but the four staging lists: no recurrent inputs to feed back, no
        # restart flags to keep (the one condition under which plain_staging hands them out)
        self.plain = not self.recurrent and self.restarted is None
        self._staging = (self._idx, self._sts, self._rewards, self._times)
        self._stored = []  # stored single records awaiting publish (slot indices)
        self._blocks = []  # stored blocks awaiting publish (a slice or an index array each)
        self._block_records = 0

    def add(self, i: int, step_type: int, reward, dt: float, restarted: bool = False) -> None:
        """Stages slot ``i``'s record, whose observation is already in its rows.

        ``reward``: a number or a numpy array of the reward's shape (``None``: 0); ``dt``: the
        seconds its step (or reset) took, added to the slot's step timer with one step counted;
        ``restarted``: the record is a restart's (its ``env_restarted`` row is set).
        """
        if not self.plain:
            self._add_extras(i, step_type, restarted)
        self._idx.append(i)
        self._sts.append(step_type)
        self._rewards.append(0.0 if reward is None else reward)
        self._times.append(dt)

    def _add_extras(self, i: int, step_type: int, restarted: bool) -> None:
        """What :meth:`add` writes besides staging, at once: slot ``i``'s recurrent inputs (its
        last answered state, zeros on ``FIRST``) and its restart flag."""
        if self.recurrent:
            for hidden_in, hidden_out in self.recurrent:
                hidden_in[i] = 0 if step_type == _FIRST else hidden_out[i]
        if self.restarted is not None and self._restarted_now[i] != restarted:
            self.restarted[i] = restarted
            self._restarted_now[i] = restarted

    def plain_staging(self):
        """The four lists :meth:`add` appends a record to (slot index, int step type, reward,
        seconds), for a stager that appends records itself, with :meth:`add`'s contract (a
        reward of ``None`` staged as ``0.0``, no restart flag): the C steps of a pass
        (:func:`~torchrl_asyncpool.exchange.native.step_group`). ``None`` unless the writer is
        :attr:`plain` (``add`` then also writes recurrent inputs or restart flags, and every
        record must go through it). The records staged there are stored and published with the
        others (:meth:`store`, :meth:`publish`)."""
        return self._staging if self.plain else None

    def add_block(self, lo: int, step_types: np.ndarray, rewards, dt: float, mask=None,
                  restarted: bool = False) -> None:
        """Stores the records of the adjacent slots ``lo .. lo + len(step_types) - 1`` (or those
        of them where ``mask`` is true), whose observations are already in their rows.

        ``step_types``: int8 ``[k]``; ``rewards``: ``[k, ...]`` (``None``: zeros); ``dt``: the
        seconds the whole block's step took, shared among the records written; ``restarted``:
        the records are a restart's (their ``env_restarted`` rows are set).
        """
        k = len(step_types)
        if mask is None:
            rows, st = slice(lo, lo + k), step_types
        else:
            rows = lo + np.flatnonzero(mask)
            st = step_types[mask]
            rewards = None if rewards is None else rewards[mask]
        m = k if mask is None else len(rows)
        if m == 0:
            return
        self.reward[rows] = 0 if rewards is None else rewards
        self._store_step_types(rows, st)
        if self.recurrent:
            first = (st == _FIRST).reshape((m,) + (1,) * (self.recurrent[0][0].ndim - 1))
            for hidden_in, hidden_out in self.recurrent:
                hidden_in[rows] = np.where(first, 0, hidden_out[rows])
        if self.restarted is not None:
            self.restarted[rows] = restarted
            for i in range(lo, lo + k) if mask is None else rows.tolist():
                self._restarted_now[i] = restarted
        self.step_time[rows] += dt / m
        self.step_count[rows] += 1
        self._blocks.append(rows)
        self._block_records += m

    @property
    def pending(self) -> int:
        """Records staged or stored and not yet published."""
        return len(self._idx) + len(self._stored) + self._block_records

    def store(self) -> None:
        """Writes the staged records' fields (step types, end flags, rewards, step timers) into
        their rows; they stay unpublished until :meth:`publish`."""
        k = len(self._idx)
        if k == 0:
            return
        idx = self._idx
        c = self._c
        if c is not None:
            buf = self._idx_buf[:k]
            buf[:] = idx
            stored = c.store(buf, self._sts, self._rewards, self._times)
        else:
            stored = False
        if not stored:  # the reference stores (also a reward that is not one number)
            try:
                self._store_reference(k, idx)
            except (TypeError, ValueError):  # a reward the row cannot hold: name its env
                for i, r in zip(idx, self._rewards):
                    self.check_reward(i, r)
                raise
        self._stored.extend(idx)
        idx.clear()
        self._sts.clear()
        self._rewards.clear()
        self._times.clear()

    def _store_reference(self, k, idx) -> None:
        if k == 1:  # scalar stores cost less than fancy indexing
            i = idx[0]
            self.reward[i] = self._rewards[0]
            self._store_step_types(i, self._sts[0])
            self.step_time[i] += self._times[0]
            self.step_count[i] += 1
            return
        rows = np.array(idx, np.int64)
        try:
            self.reward[rows] = np.asarray(self._rewards, self.reward.dtype).reshape((k, *self.reward.shape[1:]))
        except ValueError:  # rewards of mixed shapes (a float here, a [1] array there): one by one
            for i, r in zip(idx, self._rewards):
                self.reward[i] = r
        self._store_step_types(rows, np.array(self._sts, np.int8))
        self.step_time[rows] += self._times
        self.step_count[rows] += 1

    def check_reward(self, i: int, reward) -> None:
        """Raises :class:`RewardError` for slot ``i`` if ``reward`` is not a number its row holds."""
        shape = self.reward.shape[1:]
        try:
            value = np.asarray(reward, self.reward.dtype)
        except (TypeError, ValueError) as exc:
            raise RewardError(i, f"the env returned the reward {reward!r:.60}, which is not a number "
                                 f"({exc}).") from None
        if value.size != int(np.prod(shape)):
            raise RewardError(i, f"the env returned a reward of shape {value.shape}; its reward spec holds one "
                                 f"number a step (shape {tuple(shape)}).")

    def publish(self) -> None:
        """Publishes every record staged or stored since the last publish: ready times, then
        ``OBS_READY`` (after the data), then one ring of the consumer's doorbell."""
        c = self._c
        if c is not None and len(self._idx) == 1 and not self._stored and not self._blocks:
            # one record (a slow env's, a thread's): stored, published and rung in one call
            if c.record(self._idx[0], self._sts[0], self._rewards[0], self._times[0], time.monotonic()):
                self._idx.clear()
                self._sts.clear()
                self._rewards.clear()
                self._times.clear()
                return
        self.store()
        rows = self._stored
        if not rows and not self._blocks:
            return
        now = time.monotonic()
        if rows:
            if c is not None:
                c.publish(rows, now)  # rings the consumer by len(rows)
            else:
                target = rows[0] if len(rows) == 1 else rows
                self.ready_time[target] = now
                self.state[target] = S.OBS_READY  # after the data
                self.consumer.ring(len(rows))
            rows.clear()
        if self._blocks:
            for block in self._blocks:
                self.ready_time[block] = now
                self.state[block] = S.OBS_READY  # after the data
            self.consumer.ring(self._block_records)
            self._blocks.clear()
            self._block_records = 0

    def publish_stored(self, i: int) -> None:
        """Publishes slot ``i``'s record as its rows hold it, whole (a replacement worker takes
        over a record its dead worker wrote but did not publish, see ``workers/watch.py``)."""
        self.ready_time[i] = time.monotonic()
        self.state[i] = S.OBS_READY  # after the data
        self.consumer.ring()

    def _store_step_types(self, target, st) -> None:
        """``step_type`` and the three end flags of ``target``: one index and an int step type,
        or rows (a slice or an index array) and an int8 array of step types."""
        self.step_type[target] = st
        flag = st if np.ndim(st) == 0 else st.reshape((len(st), *self._flag_dims))
        self.terminated[target] = flag == _TERM
        self.truncated[target] = flag == _TRUNC
        self.done[target] = flag >= _TERM


class RewardError(ValueError):
    """A reward the env returned that its slot cannot hold (not a number, or too many). Raised
    while records are stored, after the step that returned it (with restarts on, at the step:
    :meth:`RecordWriter.check_reward`), so it carries the slot of the env that did
    (``env_slot``) for the worker to name instead of the last env it stepped."""

    def __init__(self, env_slot: int, message: str):
        super().__init__(message)
        self.env_slot = env_slot
