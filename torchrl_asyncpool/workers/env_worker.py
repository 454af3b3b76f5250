"""The env worker process: hosts one or more env slots and owns their autoreset.

Loop (per wake-up of the worker's doorbell)::

    drain doorbell -> the hosted slots in ACTION_READY, in slot order:
        if the last record was terminal: discard the action, stage the (already reset) FIRST
        else: [copy the answered record and its action into the env's chunk], step, stage
              MID / TERMINATION / TRUNCATION, [copy it into the chunk as "next"]
    -> publish what the pass staged: ready times, then state words, one store each; one ring
    -> reset the envs that just ended (eagerly, while the consumer computes the discarded action)
    -> block in poll(doorbell, parent life pipe)

Every record is written by one :class:`~torchrl_asyncpool.workers.record_writer.RecordWriter`
(step types, end flags, rewards, timers, recurrent inputs, restart flags, state words, the
ring); the env's own step writes only the observation, straight into the slot's rows. A pass
publishes its records together so that the consumer leases them as one batch (see ``_HOLD_S``
for the bounds); slots hosted by the same worker are otherwise stepped as their actions
arrive, not in lockstep. Nothing here allocates shared memory or pickles a tensor.

A worker whose factory returned a vector env (``k`` slots, one adapter) runs
:meth:`_Worker._run_lockstep` instead: it waits until all ``k`` slots are answered, steps them
with one call and writes their records as one block of adjacent slots.

Threaded workers (``threaded=True``, for envs that block: sleep, I/O, a simulator that releases
the GIL) run the same per-slot logic in one thread per hosted slot, each slot with its own
doorbell, so the slots' blocking steps overlap inside one process. The per-slot logic is a
:class:`_Stepper` (with its own writer and its own note of what it is doing): the pass loop
has one, each env thread its own; the :class:`_Worker` holds what they share.
"""
from __future__ import annotations

import functools
import os
import select
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch

from torchrl_asyncpool.delivery import chunks as C
from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.arena import Arena, as_key
from torchrl_asyncpool.exchange.doorbell import BellWait, Doorbell, set_process_idle_poll
from torchrl_asyncpool.exchange.native import copy_into, row_copier, step_group
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.envs.adapters import make_adapter, remote_listener
from torchrl_asyncpool.envs.env_attrs import own_attr
from torchrl_asyncpool.envs.gymnasium_adapters import GymnasiumEnvAdapter
from torchrl_asyncpool.envs.env_attrs import FIRST_SEED_ATTR
from torchrl_asyncpool.workers.record_writer import RESTARTED_KEY, RecordWriter
from torchrl_asyncpool.workers.restarts import DeferredEnvError
from torchrl_asyncpool.workers.watch import Watcher

__all__ = ["worker_main", "run_worker", "RESTARTED_KEY"]

# A worker hosting several cheap envs publishes a whole pass at once (one ring, one store per
# array), so the consumer sees them as one batch: it pays ~100 us per batch whatever its size,
# and records trickling out one by one (each leased as it appears) make batches small. A record
# is held back at most _HOLD_S, and a step slower than _SLOW_STEP_S publishes its group at once:
# for such envs the consumer answering the first record while the worker steps the next one is
# worth more than a bigger batch. (0.2 ms keeps TorchRL-wrapped cheap envs, ~0.13 ms a step
# with their TensorDict work, in the held regime: +8-10 % on GymEnv CartPole with 32 envs on 2
# cores, where 0.1 ms changed nothing; 0.3 ms CPU-bound envs, 2 per worker, are unaffected.)
_HOLD_S = 1e-3
_SLOW_STEP_S = 200e-6

_FIRST, _MID, _TERM, _TRUNC = (
    int(StepType.FIRST), int(StepType.MID), int(StepType.TERMINATION), int(StepType.TRUNCATION)
)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


class _Slot:
    """Everything one hosted env needs on the hot path, resolved once."""

    __slots__ = ("index", "adapter", "obs", "actions", "step_into", "fast", "ended", "pending_first", "pending_error",
                 "reset_dt", "chunks", "chunk", "pos", "seq", "factory", "reborn", "cut")

    def __init__(self, index, adapter, arena):
        self.index = index
        self.bind(adapter, arena)
        # restarts (on_env_failure="restart"): (factory, kwargs) to rebuild the env, and whether
        # the next FIRST record is the rebuilt env's first after a failed reset
        self.factory = None
        self.reborn = False
        # a replacement worker's slot whose episode its dead worker left open: the next answer
        # gets the cutting TRUNCATION (no step), see _Stepper.resume_slot
        self.cut = False
        self.ended = False
        self.pending_first = None
        self.pending_error = None  # traceback of a failed eager reset, raised when the slot is ours again
        self.reset_dt = 0.0  # seconds of resets not yet counted in a published record
        self.chunks = []  # chunk ids owned by this env
        self.chunk = -1  # chunk being filled, -1 when none
        self.pos = 0
        self.seq = 0

    def bind(self, adapter, arena):
        """Points the hot-path views at ``adapter`` (at start, and for an env rebuilt after a failure)."""
        index = self.index
        self.adapter = adapter
        req, resp = arena.request, arena.response
        self.obs = [(k, _np(req.get(k)[index])) for k in adapter.obs_keys]
        self.actions = {k: resp.get(k)[index] for k in adapter.action_keys}
        if getattr(adapter, "takes_numpy", False):
            self.actions = {k: _np(v) for k, v in self.actions.items()}
        # step_into(actions, obs views) -> (reward, terminated, truncated), the observation written
        self.step_into = getattr(adapter, "step_into", None) or functools.partial(_step_into, adapter)
        self.fast = _fast_step(index, adapter, self.obs, self.actions)

    def write_obs(self, obs):
        """Copies an observation (as the adapter's ``step``/``reset`` return it) into the slot's rows."""
        as_np = self.adapter.as_numpy
        for key, view in self.obs:
            copy_into(view, as_np(obs.get(key)))  # keeps the GIL (see copy_into)


def _fast_step(index, adapter, obs, actions):
    """The slot's tuple for the C steps of a pass (``exchange/csrc/step_loop.c``): ``(index,
    env.step, action row, action maker or None, observation row or ((key, row), ...))``, what
    ``GymnasiumEnvAdapter.step_into`` uses; ``None`` where the env takes the Python path (any
    other adapter, an env with planned episodes)."""
    if (type(adapter) is not GymnasiumEnvAdapter or adapter._plan is not None
            or not isinstance(actions.get("action"), np.ndarray)):
        return None
    # GymnasiumEnvAdapter._action_value: row[()] (None here), the space's scalar type, or a copy
    make = adapter._discrete_scalar if adapter._discrete else np.ndarray.copy
    rows = tuple(obs) if adapter._dict_obs else obs[0][1]
    return index, adapter.env.step, actions["action"], make, rows


def _step_into(adapter, actions, views):
    """``step_into`` of an adapter that only has ``step``: the same contract, generically."""
    obs, reward, terminated, truncated = adapter.step(actions)
    as_np = adapter.as_numpy
    for key, view in views:
        copy_into(view, as_np(obs.get(key)))
    return as_np(reward), terminated, truncated


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
        # the same copies in one C call per group of slots (None: numpy's stores above)
        self._root_rows = row_copier(exchange, self.root)
        self._next_rows = row_copier(exchange, self.next)
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
        i, c, p = slot.index, slot.chunk, slot.pos
        if self._root_rows is not None:
            self._root_rows.copy_one(i, c * self.T + p)
            return
        for src, dst in self.root:
            dst[c, p] = src[i]

    def write_root_rows(self, slots, idx):
        """:meth:`write_root` for several claimed ``slots`` at once (``idx``: their indices);
        returns their chunk rows (``chunk * T + pos``, flat) for :meth:`write_next_rows`."""
        T = self.T
        rows = np.array([s.chunk * T + s.pos for s in slots], np.int64)
        if self._root_rows is not None:
            self._root_rows.copy(idx, rows)
        else:
            chunk, pos = np.divmod(rows, T)
            for src, dst in self.root:
                dst[chunk, pos] = src[idx]
        return rows

    def write_next_rows(self, slots, idx, rows):
        """:meth:`write_next` for several slots at once (``rows``: from :meth:`write_root_rows`)."""
        T = self.T
        if self._next_rows is not None:
            self._next_rows.copy(np.ascontiguousarray(idx), rows)
        else:
            chunk, pos = np.divmod(rows, T)
            for src, dst in self.next:
                dst[chunk, pos] = src[idx]
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
        i, c, p = slot.index, slot.chunk, slot.pos
        if self._next_rows is not None:
            self._next_rows.copy_one(i, c * self.T + p)
        else:
            for src, dst in self.next:
                dst[c, p] = src[i]
        slot.pos = p + 1
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


class _Worker:
    """What a worker's slots share: the arena, the doorbells, the chunk buffers, the hosted slots
    and the restart budget. The per-slot work (stepping, resetting, rebuilding, writing records)
    is a :class:`_Stepper`'s: the pass loop has one for all the slots, each env thread of a
    threaded worker its own."""

    def __init__(self, worker_id, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn, delivery, threaded=False,
                 exchange="python", affinity=None, restart=None, watch=None):
        self.worker_id = worker_id
        self.threaded = threaded
        self.affinity = affinity
        self.layout = layout
        self.exchange = exchange
        self.started = False
        self.conn = conn
        self.arena = a = Arena.attach(layout, arena_fd)
        self.bells = [Doorbell(fd) for fd in bell_fds]  # one, or one per slot when threaded
        self.consumer_fd = consumer_fd
        self.consumer = Doorbell(consumer_fd)
        self.life_fd = life_fd
        self.state = a.state
        self.delivery = _Delivery(delivery, a, exchange) if delivery is not None else None
        # on_env_failure="restart": the budget of env rebuilds (None: a failing env fails the worker)
        self.restarts = None if restart is None else restart.budget(a, layout.num_slots)
        # watched by the pool (worker restarts, step_timeout): see workers/watch.py
        self.watch = watch
        self.resuming = watch is not None and watch.resume
        if self.resuming:  # a failure is reported through the slots at once: the pool does not wait for a start
            self.started = True
        recurrent, actions = layout.recurrent, layout.action_keys
        self.expected = (  # the fields every env must declare: (request, response) {key: (shape, dtype)}
            {f.key: (f.shape, f.dtype) for f in layout.request if f.key not in recurrent and f.key != (RESTARTED_KEY,)},
            {f.key: (f.shape, f.dtype) for f in layout.response if actions is None or f.key in actions},
        )
        self.stepper = _Stepper(self)  # the pass loop's (and the start-up's)
        self.slots = []  # hosted slots (empty when threaded: each thread holds its own)
        self._specs = []
        self._threads = []
        self._stop_w = -1
        self.vector = None  # the adapter of a vector env hosting all the slots (stepped in lockstep)
        self.vector_factory = None  # (factory, kwargs) that built it, to rebuild it after a failure
        self.slot_paths = {}  # slot index -> the path its env is stepped on (threaded workers)

    # where the worker is, for its failure report: the pass loop's stepper's (threads report their own)
    @property
    def _phase(self):
        return self.stepper.phase

    @property
    def _current(self):
        return self.stepper.current

    def build(self, slot_ids, env_fns, env_kwargs):
        stepper = self.stepper
        if self.delivery is not None and self.watch is not None:
            self.delivery.persist = True  # a replacement worker goes on filling the chunks where this one stops
        if len(env_fns) == 1 and not self.threaded:
            if self.resuming:  # the replacement of a worker that died: its env's next rebuild
                adapter = stepper.rebuilt_adapter(slot_ids[0], (env_fns[0], env_kwargs[0]),
                                                  num_envs=len(slot_ids) if len(slot_ids) > 1 else None)
            else:
                stepper.note("construction", slot_ids[0])
                adapter = make_adapter(env_fns[0](**env_kwargs[0]), slot_ids[0])
            if hasattr(adapter, "num_envs") or len(slot_ids) > 1:  # a vector env: all the slots, one adapter
                self._build_vector(slot_ids, adapter)
                self.vector_factory = (env_fns[0], env_kwargs[0])
                # sub-envs that make the same records stepped on their own, in slots of the pass
                # loop: no pass waits for the slowest answer (not with restarts: a sub-env's
                # failure must rebuild the whole vector env, which the lockstep loop does)
                subs = adapter.split() if hasattr(adapter, "split") and self.restarts is None else None
                if subs is not None:
                    self.slots = [stepper.add_slot(index, sub) for index, sub in zip(slot_ids, subs)]
                    self.vector = None
                return
            slot = stepper.add_slot(slot_ids[0], adapter)
            slot.factory = (env_fns[0], env_kwargs[0])
            self.slots.append(slot)
            return
        specs = list(zip(slot_ids, env_fns, env_kwargs))
        if self.threaded:
            # each env is built, stepped and closed by its own thread: envs holding thread-bound
            # resources (an OpenGL context, a simulator handle) never see another thread
            self._specs = specs
            return
        for spec in specs:
            self.slots.append(stepper.build_slot(*spec))

    def _first_records(self, stepper, slots):
        """A new worker resets its envs and publishes their FIRST records; a replacement takes
        over its slots as its dead worker left them (see :meth:`_Stepper.resume_slot`) and
        publishes nothing until they are answered."""
        if self.resuming:
            for slot in slots:
                stepper.resume_slot(slot)
            return
        for slot in slots:
            stepper.record_first(slot, stepper.timed_reset(slot))
        stepper.writer.publish()

    def _build_vector(self, slot_ids, adapter):
        if not hasattr(adapter, "num_envs"):
            adapter.close()
            raise ValueError(
                f"env {slot_ids[0]}: the factory returned a single env, but the first factory returned a gymnasium "
                f"vector env of {len(slot_ids)} envs (all factories must return the same kind)."
            )
        if adapter.num_envs != len(slot_ids):
            adapter.close()
            raise ValueError(
                f"env {slot_ids[0]}: the factory returned a vector env of {adapter.num_envs} envs; the pool "
                f"expects {len(slot_ids)} (slots {slot_ids[0]}..{slot_ids[-1]}), as the first factory returned "
                "(every factory must return the same number of envs)."
            )
        for index in slot_ids:
            self.slots.append(self.stepper.add_slot(index, adapter))
        self.vector = adapter

    def close_envs(self, timeout: float = 30.0):
        """Closes the hosted envs; a threaded worker's threads close their own (waited for at
        most ``timeout`` seconds in all: a thread may be inside a long step). The pool's
        ``close(timeout)`` kills the worker sooner when it asks for less; this bound only
        keeps a worker whose parent is gone from waiting forever on a hung thread, and leaves
        an env's own close (a simulator stopping its processes) the time it needs."""
        if not self.threaded:
            for slot in {id(slot.adapter): slot for slot in self.slots}.values():
                _close_reporting(slot.adapter, slot.index)
            return
        if self._stop_w >= 0:
            os.close(self._stop_w)  # every slot thread's poll sees the hang-up
            self._stop_w = -1
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _paths(self) -> dict:
        """``{slot index: the path its env is stepped on}`` (``adapter.path``: ``"torchrl-fast"``,
        ``"torchrl"``, ``"gymnasium"``, ...), reported to the pool with the worker's first records."""
        return {slot.index: getattr(slot.adapter, "path", "unknown") for slot in self.slots}

    def pin(self):
        """Applies the worker's CPU mask to the calling thread (pid 0: this thread only).

        Called once the envs are built, not at process start: building envs (imports,
        simulators loading assets) then runs on every core, which matters when the default
        partition puts every worker on one core of two."""
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)

    # -- main loop ----------------------------------------------------------------------------
    def _started(self):
        """Tells the parent the first records are out; returns the :class:`BellWait` to wait on."""
        self.conn.send(("ready", self.worker_id, self._paths(), None))
        self.started = True
        if self.resuming:  # the answers its dead worker left unserved rang a bell nobody drains now
            self.bells[0].ring()
        # drains the bell in the wait, before the scan: a ring after that wakes the next wait
        return BellWait(self.bells[0], (self.life_fd,))

    def run(self):
        if self.threaded:
            return self._run_threaded()
        if self.vector is not None:
            return self._run_lockstep()
        stepper, writer = self.stepper, self.stepper.writer
        self._first_records(stepper, self.slots)
        waiter = self._started()
        state, slots, delivery = self.state, self.slots, self.delivery
        while True:
            for fd in waiter.wait():
                if fd == self.life_fd:
                    return
            ready = [slot for slot in slots if state[slot.index] == S.ACTION_READY]
            if not ready:
                continue
            stepping = []
            cut = []
            for slot in ready:
                if slot.ended:
                    stepper.serve(slot)  # a FIRST record: no step, nothing to deliver
                elif slot.cut:  # a dead worker's open episode: its truncation, no step
                    if stepper.serve(slot):
                        cut.append(slot)
                elif delivery is None or delivery.claim(slot):
                    stepping.append(slot)
                # else back-pressure: the driver holds every chunk of this env; the action waits
            if len(stepping) > 1:
                ended = stepper.step_pass(stepping)
            else:  # one env to step (a slow env's usual pass): the per-slot path costs less
                ended = [slot for slot in stepping if stepper.serve(slot)]
            writer.publish()  # what is left of the pass: its last group, the FIRST records
            for slot in ended + cut:
                stepper.eager_reset(slot)

    # -- vector env, stepped in lockstep -------------------------------------------------------
    def _run_lockstep(self):
        """The loop of :meth:`run` for one vector env hosting all the worker's slots: a pass
        waits until every slot is answered, then steps all of them with one call, and writes
        their records as one block.

        A gymnasium vector env autoresets in NEXT_STEP mode: an env that ended last pass
        ignores its action and returns its reset observation, published as ``FIRST`` (no
        transition). A TorchRL batched env does not reset itself (``adapter.autoresets`` is
        False): the pass after an env ended resets only the ended envs and publishes their
        ``FIRST`` records; the others' answered actions wait for the next pass.

        With restarts on, a vector env that raises in a step or a reset is rebuilt whole (see
        :meth:`_rebuild_vector`): every open episode of its envs ends with a ``TRUNCATION``
        (reward 0, ``env_restarted``) at its last observation, the envs whose episode had just
        ended publish nothing, and the next pass publishes every env's ``FIRST`` from the new
        env's reset (marked ``env_restarted`` for the envs no truncation marked)."""
        slots, delivery = self.slots, self.delivery
        stepper, writer = self.stepper, self.stepper.writer
        k, lo = len(slots), slots[0].index
        rows = slice(lo, lo + k)
        req, resp = self.arena.request, self.arena.response
        obs_rows = [(key, _np(req.get(key))[rows]) for key in self.vector.obs_keys]
        actions = {key: _np(resp.get(key))[rows] for key in self.vector.action_keys}
        reward_shape = writer.reward[rows].shape
        state = self.state[rows]
        idx = np.arange(lo, lo + k)
        first = np.full(k, _FIRST, np.int8)

        def write_obs(obs, mask=None):
            for key, view in obs_rows:
                if mask is None:
                    view[...] = obs[key]
                else:
                    view[mask] = obs[key][mask]

        watcher = stepper.watcher
        reborn = None  # a rebuilt vector env's reset observation, every env's next FIRST
        unmarked = None  # the envs whose rebuild no truncation marked: their FIRST is marked instead
        cutting = None  # a replacement worker's envs whose episode its dead worker left open
        stepper.note("reset", lo)
        t = time.perf_counter()
        obs = self.vector.reset()
        if self.resuming:  # the dead worker's records stand; the new env's reset waits (see resume_slot)
            for slot in slots:
                stepper.resume_slot(slot)
            cutting = np.array([slot.cut for slot in slots])
            for slot in slots:
                slot.cut = slot.ended = slot.reborn = False
            reborn = {key: np.array(obs[key]) for key, _ in obs_rows}
            unmarked = ~cutting
            cutting = cutting if cutting.any() else None
        else:
            write_obs(obs)
            writer.add_block(lo, first, None, time.perf_counter() - t)
            writer.publish()
        waiter = self._started()
        ended = np.zeros(k, bool)  # the env's last record was terminal: its next one is FIRST
        while True:
            # (a rebuild that published nothing goes on at once, once every env is answered)
            if reborn is None or not unmarked.all() or not (state == S.ACTION_READY).all():
                for fd in waiter.wait():
                    if fd == self.life_fd:
                        return
            if not (state == S.ACTION_READY).all():
                continue
            vec = self.vector
            if cutting is not None:  # the truncations of the episodes the dead worker left open
                cut = np.flatnonzero(cutting)
                moving = None
                if delivery is not None:
                    if not all([delivery.claim(slots[j]) for j in cut]):
                        continue  # back-pressure: the driver frees a chunk and rings this worker
                    moving = [slots[j] for j in cut]
                    chunk_rows = delivery.write_root_rows(moving, idx[cut])
                at = np.full(k, -1, np.int64)
                if moving is not None:
                    at[cut] = chunk_rows
                watcher.begin_block(rows, at)  # this worker may die too: its own replacement reads it
                writer.add_block(lo, np.full(k, _TRUNC, np.int8), None, 0.0, cutting, restarted=True)
                if moving is not None:
                    delivery.write_next_rows(moving, idx[cut], chunk_rows)
                writer.publish()
                cutting = None
                continue
            if reborn is not None:  # the pass after a rebuild: every env's FIRST, no step
                if watcher is not None:
                    watcher.begin_block(rows)
                write_obs(reborn)
                writer.add_block(lo, first, None, 0.0, unmarked, restarted=True)
                writer.add_block(lo, first, None, 0.0, ~unmarked)
                writer.publish()
                reborn, ended = None, np.zeros(k, bool)
                continue
            if not getattr(vec, "autoresets", True) and ended.any():  # reset the ended envs only
                stepper.note("reset", lo + int(np.flatnonzero(ended)[0]))
                if watcher is not None:
                    watcher.begin_block(rows)
                t = time.perf_counter()
                try:
                    obs = vec.reset_some(ended)
                except Exception:
                    if self.restarts is None:
                        raise
                    reborn, unmarked = self._rebuild_vector("reset", ~ended, writer, obs_rows), ended.copy()
                    continue
                write_obs(obs, ended)
                writer.add_block(lo, first, None, time.perf_counter() - t, ended)
                writer.publish()
                ended = np.zeros(k, bool)
                continue
            stepping = np.flatnonzero(~ended)
            moving = None
            if delivery is not None and len(stepping):
                if not all([delivery.claim(slots[j]) for j in stepping]):
                    continue  # back-pressure: the driver frees a chunk and rings this worker
                moving = [slots[j] for j in stepping]
                chunk_rows = delivery.write_root_rows(moving, idx[stepping])
            if watcher is not None:
                at = np.full(k, -1, np.int64)
                if moving is not None:
                    at[stepping] = chunk_rows
                watcher.begin_block(rows, at)
            stepper.note("step", lo)
            t = time.perf_counter()
            try:
                obs, rew, term, trunc = vec.step(actions)
            except Exception:
                if self.restarts is None:
                    raise
                reborn, unmarked = self._rebuild_vector("step", ~ended, writer, obs_rows), ended.copy()
                if moving is not None:  # the cut episodes' truncations, as their transitions' "next"
                    delivery.write_next_rows(moving, idx[stepping], chunk_rows)
                writer.publish()
                continue
            dt = time.perf_counter() - t
            term, trunc = np.asarray(term, bool), np.asarray(trunc, bool)
            st = np.where(ended, _FIRST, np.where(term, _TERM, np.where(trunc, _TRUNC, _MID))).astype(np.int8)
            rew = np.array(rew, writer.reward.dtype).reshape(reward_shape)  # a copy: FIRST rows are zeroed
            rew[ended] = 0
            write_obs(obs)
            writer.add_block(lo, st, rew, dt)
            if moving is not None:  # copied from the request rows, which are ours
                delivery.write_next_rows(moving, idx[stepping], chunk_rows)
            writer.publish()
            ended = (st == _TERM) | (st == _TRUNC)

    def _rebuild_vector(self, phase, open_episodes, writer, obs_rows):
        """Replaces the vector env, which just raised in ``phase`` (called from the ``except``):
        counts the failure against the budget of its first env (raising past it), closes it,
        builds a new one from the same factory and resets it. Stores (unpublished) a
        ``TRUNCATION`` at the last observation for each env with an open episode
        (``open_episodes``, a mask) and returns the new env's reset observation, every env's
        next ``FIRST``. Failures to build or reset the new env count too."""
        tb = traceback.format_exc()
        lo, k = self.slots[0].index, len(self.slots)
        stepper = self.stepper
        failed = self.vector  # the env to close before the next build
        while True:
            _check_life(self.life_fd)
            r = self.restarts.admit(lo, phase, tb)
            if failed is not None:
                _close_reporting(failed, lo)
            failed = None
            try:
                failed = adapter = stepper.replacement(lo, self.vector_factory, r, num_envs=k)
                stepper.note("reset", lo)
                t = time.perf_counter()
                obs = adapter.reset()
                dt = time.perf_counter() - t
            except Exception:  # noqa: BLE001 - a failed rebuild is one more failure of this env
                tb, phase = traceback.format_exc(), "construction"
                continue
            break
        self.vector = adapter
        for slot in self.slots:
            slot.adapter = adapter
        stepper.note_restart(lo, phase, tb, r)
        obs = {key: np.array(obs[key]) for key, _ in obs_rows}  # held until the next pass: a copy
        writer.add_block(lo, np.full(k, _TRUNC, np.int8), None, dt, open_episodes, restarted=True)
        return obs

    # -- threaded worker ----------------------------------------------------------------------
    def _run_threaded(self):
        failed_r, failed_w = os.pipe()
        stop_r, self._stop_w = os.pipe()
        failures = []  # (phase, env index, traceback) of the threads that raised
        firsts = []
        for spec, bell in zip(self._specs, self.bells):
            first = threading.Event()
            t = threading.Thread(target=self._slot_thread, args=(spec, bell, stop_r, first, failures, failed_w),
                                 name=f"env-{spec[0]}", daemon=True)
            t.start()
            self._threads.append(t)
            firsts.append(first)
        for first in firsts:
            first.wait()
        self.pin()
        self._raise_thread_failure(failures)
        self.conn.send(("ready", self.worker_id, dict(self.slot_paths), None))
        self.started = True
        poller = select.poll()
        poller.register(self.life_fd, select.POLLIN)
        poller.register(failed_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self.life_fd:
                    return
                self._raise_thread_failure(failures)

    def _raise_thread_failure(self, failures):
        if failures:
            phase, current, tb = failures[0]
            self.stepper.note(phase, current)
            raise DeferredEnvError(tb)

    def _slot_thread(self, spec, bell, stop_fd, first, failures, failed_w):
        """One hosted env, start to end, with its own stepper: build, reset, the loop of
        :meth:`run` for its slot, close."""
        slot = None
        stepper = _Stepper(self)
        writer = stepper.writer
        try:
            slot = stepper.build_slot(*spec)
            self.slot_paths[slot.index] = getattr(slot.adapter, "path", "unknown")  # a dict all threads share
            self.pin()
            listen = remote_listener(slot.adapter.env)
            if listen is not None:  # a remote slot: its first record waits for a host to connect
                listen(slot.index, stop_fd)
                first.set()
            self._first_records(stepper, [slot])
            first.set()
            if self.resuming:  # the answer its dead worker left unserved rang a bell nobody drains now
                bell.ring()
            waiter = BellWait(bell, (self.life_fd, stop_fd))  # one GIL hand-over per wait, drain included
            state, i = self.state, slot.index
            while True:
                for fd in waiter.wait():
                    if fd != bell.fd:
                        return
                if state[i] != S.ACTION_READY:
                    continue
                ended = stepper.serve(slot)  # (a cut episode's truncation ends it too)
                writer.publish()
                if ended:
                    stepper.eager_reset(slot)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which reports it
            tb = exc.tb if isinstance(exc, DeferredEnvError) else traceback.format_exc()
            failures.append((stepper.phase, stepper.current if stepper.current is not None else spec[0], tb))
            first.set()
            os.write(failed_w, b"x")
        finally:
            if slot is not None:
                _close_reporting(slot.adapter, slot.index)


class _Stepper:
    """Serves slots of a worker: steps, resets and rebuilds their envs, and writes their records
    through its own :class:`~torchrl_asyncpool.workers.record_writer.RecordWriter`. It also notes
    what it is doing (phase and slot), which a failure report names."""

    def __init__(self, worker):
        self.worker = worker
        self.writer = RecordWriter(worker.arena, worker.consumer_fd, worker.exchange)
        self.fast_steps = step_group(worker.exchange)  # None: every step in Python
        self.delivery = worker.delivery
        self.restarts = worker.restarts
        # what the pool's watchdog reads (None: the pool does not watch this worker)
        self.watcher = Watcher(worker.watch, worker.arena, worker.exchange) if worker.watch is not None else None
        self.phase, self.current = "construction", None

    def note(self, phase, current):
        self.phase, self.current = phase, current

    # -- building -----------------------------------------------------------------------------
    def build_slot(self, index, fn, kw):
        self.note("construction", index)
        if self.worker.resuming:
            adapter = self.rebuilt_adapter(index, (fn, kw))
        else:
            adapter = make_adapter(fn(**kw), index)
        if hasattr(adapter, "num_envs"):
            adapter.close()
            raise ValueError(
                f"env {index}: the factory returned a gymnasium vector env, but the first factory returned a "
                "single env (all factories must return the same kind)."
            )
        slot = self.add_slot(index, adapter)
        slot.factory = (fn, kw)
        return slot

    def add_slot(self, index, adapter):
        self.note("construction", index)
        self.check_fields(index, adapter)
        slot = _Slot(index, adapter, self.worker.arena)
        if self.delivery is not None:
            per = self.delivery.per_env
            slot.chunks = list(range(index * per, (index + 1) * per))
        return slot

    def check_fields(self, index, adapter):
        expected = self.worker.expected
        request, response = (_keyed(d) for d in adapter.fields())
        _check_fields(index, "observation/reward/done", expected[0], request)
        _check_fields(index, "action", expected[1], response)

    # -- records ------------------------------------------------------------------------------
    def record_first(self, slot, obs):
        """Stages ``slot``'s FIRST record: ``obs`` (a reset's) into its rows, with the seconds its
        resets took since its last record; marked as a restart's after a rebuilt env's reset."""
        slot.write_obs(obs)
        self.writer.add(slot.index, _FIRST, None, slot.reset_dt, slot.reborn)
        slot.reset_dt = 0.0
        slot.reborn = False

    def timed_reset(self, slot):
        self.note("reset", slot.index)
        t = time.perf_counter()
        obs = slot.adapter.reset()
        slot.reset_dt += time.perf_counter() - t
        return obs

    def serve(self, slot):
        """Answers one ACTION_READY slot; returns None (blocked), False, or True (episode ended).
        Its record is staged (and stored, when the chunk buffers copy it); the caller publishes."""
        watcher = self.watcher
        if slot.ended:
            if slot.pending_error is not None:
                self.note("reset", slot.index)
                raise DeferredEnvError(slot.pending_error)
            if watcher is not None:
                self._begin(slot)
            # NEXT_STEP autoreset: the action answering a terminal record is discarded.
            obs = slot.pending_first if slot.pending_first is not None else self._reset_or_restart(slot)
            slot.pending_first = None
            slot.ended = False
            self.record_first(slot, obs)
            return False
        delivery = self.delivery
        if delivery is not None:
            if not delivery.claim(slot):
                return None  # back-pressure: the driver holds every chunk of this env
            delivery.write_root(slot)
        if watcher is not None:
            self._begin(slot)
        if slot.cut:  # see resume_slot: the truncation at the last leased observation, no step
            slot.cut = False
            self.writer.add(slot.index, _TRUNC, None, 0.0, True)
            if delivery is not None:
                self.writer.store()
                delivery.write_next(slot)
            slot.ended = True
            return True
        self.note("step", slot.index)
        t = time.perf_counter()
        reward, st, restarted = self._step(slot)
        self.writer.add(slot.index, st, reward, time.perf_counter() - t, restarted)
        if delivery is not None:
            self.writer.store()  # the chunk copy reads the stored rows
            delivery.write_next(slot)
        slot.ended = st != _MID
        return slot.ended

    def _step(self, slot):
        """Steps ``slot``'s env into its rows: ``(reward, step type, restarted)``. With restarts on,
        an env that raises is rebuilt and its episode ends as a truncation (reward 0, marked as a
        restart's) at its last observation, which the failed step did not touch."""
        try:
            reward, terminated, truncated = slot.step_into(slot.actions, slot.obs)
        except Exception:
            if self.restarts is None:
                raise
            self._rebuild(slot, "step")
            self.note("step", slot.index)
            return None, _TRUNC, True
        return reward, (_TERM if terminated else (_TRUNC if truncated else _MID)), False

    def step_pass(self, stepping):
        """Steps ``stepping`` (claimed, ACTION_READY, not ended) in order; returns those whose
        episode ended. Per slot only the step (with its observation copy) and the staging of
        its record run per slot, in C for plain gymnasium envs (``exchange.native.step_group``:
        the env's step is the only Python then) and in Python otherwise; the records are stored
        one store per array for a group of slots, published together; a group closes early after
        a slow step or once its first record has waited :data:`_HOLD_S` (see there). The last
        group is left unpublished, for the caller's publish of the pass."""
        delivery, writer = self.delivery, self.writer
        n = len(stepping)
        idx = np.array([s.index for s in stepping], np.int64)
        if delivery is not None:  # the answered records, before any step overwrites them
            rows = delivery.write_root_rows(stepping, idx)
        ended = []
        start = 0
        add = writer.add
        plain = self.restarts is None and self.watcher is None  # the step inline, one call less per record
        fast = None
        if plain and self.fast_steps is not None and not writer.recurrent and writer.restarted is None:
            fast = [slot.fast for slot in stepping]  # every env of the pass in C, or none
            if any(f is None for f in fast):
                fast = None
        self.phase = "step"
        while start < n:
            if fast is not None:
                k, ended_at = self.fast_steps(self, fast, start, writer._idx, writer._sts, writer._rewards,
                                              writer._times, _SLOW_STEP_S, _HOLD_S)
                self.current = stepping[start + k - 1].index
                for j in ended_at:
                    stepping[j].ended = True
                    ended.append(stepping[j])
            else:
                k = self._step_group_py(stepping, start, plain, add, ended)
            if delivery is not None:
                writer.store()  # the chunk copies read the stored rows
                if k == 1:
                    delivery.write_next(stepping[start])
                else:
                    delivery.write_next_rows(stepping[start:start + k], idx[start:start + k], rows[start:start + k])
            start += k
            if start < n:
                writer.publish()
        return ended

    def _step_group_py(self, stepping, start, plain, add, ended):
        """:meth:`step_pass`'s group in Python (``exchange.native.step_group`` does the same in C
        for plain gymnasium envs): steps ``stepping[start:]`` in order until a slow step or the
        hold time, stages their records, adds the ended ones to ``ended``; returns how many."""
        k = 0
        clock = time.perf_counter
        watcher = self.watcher
        t_group = t = clock()
        for slot in stepping[start:]:
            self.current = slot.index
            if plain:
                reward, terminated, truncated = slot.step_into(slot.actions, slot.obs)
                st, restarted = (_TERM if terminated else (_TRUNC if truncated else _MID)), False
            else:
                if watcher is not None:
                    self._begin(slot)
                reward, st, restarted = self._step(slot)
            t_end = clock()
            dt = t_end - t
            t = t_end
            add(slot.index, st, reward, dt, restarted)
            k += 1
            if st != _MID:
                slot.ended = True
                ended.append(slot)
            if dt > _SLOW_STEP_S or t_end - t_group > _HOLD_S:
                break
        return k

    # -- resets and restarts ------------------------------------------------------------------
    def _reset_or_restart(self, slot):
        try:
            return self.timed_reset(slot)
        except Exception:
            if self.restarts is None:
                raise
            return self._restarted_reset(slot)

    def eager_reset(self, slot):
        # Eager reset hides reset latency behind the consumer's (discarded) answer. The slot
        # belongs to the consumer meanwhile, so a failure waits for its answer.
        if _plan_done(slot.adapter):
            # the env's planned episodes are all run (evaluate()): a reset now would be an extra,
            # unseeded one that nobody asked for (and whose hang or crash would be blamed on no
            # episode); if the consumer answers the terminal record anyway, serve resets then
            return
        if slot.pending_first is None and self.worker.state[slot.index] != S.ACTION_READY:
            watcher = self.watcher
            if watcher is not None:
                watcher.begin_eager_reset(slot.index)
            try:
                slot.pending_first = self.timed_reset(slot)
            except Exception:  # noqa: BLE001 - re-raised by serve once the slot is ours
                if self.restarts is None:
                    slot.pending_error = traceback.format_exc()
                    return
                try:
                    slot.pending_first = self._restarted_reset(slot)
                except DeferredEnvError as exc:  # past the budget: raised once the slot is ours
                    slot.pending_error = exc.tb
            finally:
                if watcher is not None:
                    watcher.end_eager_reset(slot.index)

    def _rebuild(self, slot, phase, tb=None):
        """Replaces ``slot``'s env, which just raised in ``phase`` (called from the ``except``):
        counts the failure against the budget (raising past it), closes the env and builds a new
        one from the same factory, with the seed of its rebuild. Failures to build count too."""
        tb = traceback.format_exc() if tb is None else tb
        failed = slot.adapter  # the env to close before the next build
        while True:
            _check_life(self.worker.life_fd)
            r = self.restarts.admit(slot.index, phase, tb)
            if failed is not None:
                _close_reporting(failed, slot.index)
            try:
                adapter = self.replacement(slot.index, slot.factory, r)
            except Exception:  # noqa: BLE001 - a failed rebuild is one more failure of this env
                tb, phase, failed = traceback.format_exc(), "construction", None
                continue
            slot.bind(adapter, self.worker.arena)
            self.note_restart(slot.index, phase, tb, r)
            slot.pending_first = slot.pending_error = None
            return

    def replacement(self, index, factory, r, num_envs=None):
        """The adapter of env ``index``'s ``r``-th rebuild from ``factory`` (``(fn, kwargs)``), its
        first reset seeded ``seed + index + r * num_slots`` when the pool was seeded (never another
        env's seed), checked against the pool's layout; ``num_envs``: the vector env's size it must
        have. What it built is closed when it raises."""
        fn, kw = factory
        self.note("construction", index)
        env = adapter = None
        build_since = self.worker.arena.build_since
        try:
            build_since[index] = time.monotonic()  # the pool's watchdog kills a build past build_timeout
            try:
                env = fn(**kw)
            finally:
                build_since[index] = 0.0
            seed = own_attr(env, FIRST_SEED_ATTR)
            if seed is not None:
                setattr(env, FIRST_SEED_ATTR, seed + r * self.worker.layout.num_slots)
            adapter = make_adapter(env, index)
            if num_envs is not None and getattr(adapter, "num_envs", None) != num_envs:
                raise ValueError(f"env {index}: the rebuilt vector env has {getattr(adapter, 'num_envs', 1)} "
                                 f"envs; its first build had {num_envs}.")
            self.check_fields(index, adapter)
            return adapter
        except BaseException:
            if adapter is not None:
                _close_reporting(adapter, index)
            elif env is not None:  # built, but no adapter took it
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - the failure being raised is the one that counts
                    pass
            raise

    def rebuilt_adapter(self, index, factory, num_envs=None):
        """The env of a replacement worker's slot ``index``: its next rebuild (the pool counted
        the dead worker in ``restarts``), built again, within the budget, while it fails."""
        r = int(self.worker.arena.restarts[index])
        while True:
            try:
                return self.replacement(index, factory, r, num_envs)
            except Exception:  # noqa: BLE001 - a failed build is one more failure of this env
                tb = traceback.format_exc()
                if self.restarts is None:
                    raise
                _check_life(self.worker.life_fd)
                r = self.restarts.admit(index, "construction", tb)
                self.note_restart(index, "construction", tb, r)

    def _begin(self, slot):
        """Tells the watcher that ``slot``'s step (or its FIRST record's reset) begins."""
        self.watcher.begin(slot.index, -1 if slot.chunk < 0 else slot.chunk * self.delivery.T + slot.pos)

    def resume_slot(self, slot):
        """Takes over ``slot`` from a worker that died (see :mod:`~torchrl_asyncpool.workers.watch`):
        a whole record that worker did not publish is published now; an episode the slot's last
        record left open is cut when the slot is next answered (a ``TRUNCATION`` at that
        record's observation, marked ``env_restarted``); after a terminal record, the answer gets
        the new env's ``FIRST``, marked instead. Returns whether it published a record."""
        i = slot.index
        delivery = self.delivery
        if delivery is None:
            pending = self.watcher.takeover(i)
        else:
            pending = self.watcher.takeover(i, delivery.chunks.length, delivery.T)
            delivery.resume(slot)
        if pending:
            self.writer.publish_stored(i)
        if int(self.writer.step_type[i]) in (_TERM, _TRUNC):
            slot.ended, slot.reborn = True, True
        else:
            slot.cut = True
        return pending

    def note_restart(self, index, phase, tb, r):
        """Leaves the cause of env ``index``'s ``r``-th rebuild for ``pool.restart_info()``."""
        arena = self.worker.arena
        arena.write_error(index, f"{phase}\n{tb}")
        arena.restarts[index] = r  # after the text

    def _restarted_reset(self, slot):
        """The reset of a slot whose reset failed: rebuild and reset until one works (or the
        budget runs out); its FIRST record is marked as a restart's."""
        tb = traceback.format_exc()  # the failed reset's (called from its except)
        while True:
            self._rebuild(slot, "reset", tb)
            try:
                obs = self.timed_reset(slot)
            except Exception:  # noqa: BLE001 - counted by the next _rebuild
                tb = traceback.format_exc()  # here: _rebuild runs outside this except
                continue
            slot.reborn = True
            return obs


def _close_reporting(adapter, index) -> None:
    """Closes a hosted env; what its ``close()`` raises is written to this worker's standard
    error (the parent's, unless redirected) instead of vanishing: the worker is going away and
    its parent no longer listens, but a simulator that failed to shut down (and may have left
    processes behind) must not go unnoticed. Never raises."""
    env = getattr(adapter, "env", None)
    if getattr(env if env is not None else adapter, "is_closed", False) is True:
        return  # a TorchRL batched env that shut itself down on an error
    try:
        if env is None:
            adapter.close()
        else:  # the adapters' own close() swallows the env's errors (it also runs on error paths)
            env.close()
    except Exception:  # noqa: BLE001 - reported, not raised: the worker must still exit
        try:
            sys.stderr.write(f"torchrl_asyncpool: env {index} (worker pid {os.getpid()}): close() raised:\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - no standard error left to write to
            pass


def _check_life(life_fd) -> None:
    """Raises if the pool is gone (its life pipe hung up): a loop of rebuilds that keep failing
    must not outlive the pool it rebuilds for."""
    p = select.poll()
    p.register(life_fd, select.POLLIN)
    if p.poll(0):
        raise DeferredEnvError("the pool closed while an env was being rebuilt")


def _plan_done(adapter) -> bool:
    """True when ``adapter``'s env carries an episode plan (``EPISODE_PLAN_ATTR``) whose last
    episode is the one running or just ended."""
    plan = getattr(adapter, "_plan", None)
    return plan is not None and plan.episode + 1 >= len(plan.plan)


def _keyed(fields):
    return {as_key(k): v for k, v in fields.items()}


def _check_fields(index, what, expected, got):
    if expected.keys() != got.keys():
        raise ValueError(
            f"env {index}: {what} keys {sorted(map(str, got))} differ from the pool layout "
            f"{sorted(map(str, expected))} (all envs of a pool must share their specs)."
        )
    for k, spec in expected.items():
        if tuple(got[k][0]) != tuple(spec[0]) or got[k][1] != spec[1]:
            raise ValueError(
                f"env {index}: {what} entry {k!r} has shape {tuple(got[k][0])} and dtype {got[k][1]}; "
                f"the pool layout expects shape {tuple(spec[0])} and dtype {spec[1]}."
            )


def _end_own_group():
    """SIGTERMs what the envs started and left in this worker's process group (it leads one, see
    ``worker_main``): a parent that died without closing the pool, by a signal's default action
    or a hang-up, never kills the group itself. The worker ignores the signal; its own group only
    (never the parent's, if it could not lead one)."""
    try:
        if os.getpgrp() != os.getpid():
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
    except (OSError, ValueError):  # nothing left to signal, or not the main thread
        pass


def _batch_scheduling():
    """SCHED_BATCH: a worker woken by the consumer's doorbell does not preempt the consumer.

    Without it, on few cores every ``send`` costs the consumer a context switch per worker it
    wakes (the woken worker has slept, so the scheduler runs it at once), which is exactly the
    "waker waits for the woken" cost the doorbell exists to avoid.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not permitted: plain scheduling
        pass


def worker_main(worker_id, slot_ids, env_fns, env_kwargs, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn,
                num_threads, delivery=None, threaded=False, affinity=None, exchange="python", idle_poll=False,
                restart=None, watch=None):
    """Entry point of a worker process (see the module docstring)."""
    # The parent owns shutdown (the life pipe; a dead parent closes it too): a terminal's Ctrl-C
    # reaches the whole process group, and it is the parent's to handle (evaluate() drains on it,
    # the collector shuts down). As the inference server process does, a worker ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A process group of its own, which the processes its envs start (a simulator, a browser)
    # join: the pool kills the whole group when it kills or reaps this worker, so they are not
    # orphaned, and a terminal's Ctrl-C no longer reaches them behind the parent's back.
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover - already a group leader (or not allowed): the pool kills the pid
        pass
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    set_process_idle_poll(idle_poll)  # every wait of this worker follows its pool's choice
    _batch_scheduling()
    try:
        run_worker(worker_id, slot_ids, env_fns, env_kwargs, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn,
                   delivery, threaded, affinity, exchange, restart, watch)
    finally:
        _end_own_group()
        os._exit(0)


def run_worker(worker_id, slot_ids, env_fns, env_kwargs, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn,
               delivery=None, threaded=False, affinity=None, exchange="python", restart=None, watch=None):
    """One worker's life, in whatever runs it: builds its envs, serves their slots until the life
    pipe hangs up, reports a failure to the consumer (through the pipe ``conn`` before the first
    records, through the slot's error block after), and closes the envs. Never raises.

    A worker process runs it from :func:`worker_main`; a pool with ``backend="threading"`` runs it
    in a thread of the pool's own process (:class:`~torchrl_asyncpool.workers.thread_worker.ThreadWorker`).
    """
    worker = None
    try:
        env_fns = [getattr(fn, "fn", fn) for fn in env_fns]
        worker = _Worker(worker_id, layout, arena_fd.fd, [b.fd for b in bell_fds], consumer_fd.fd, life_fd.fd, conn,
                         delivery, threaded, exchange, affinity, restart, watch)
        worker.build(slot_ids, env_fns, env_kwargs)
        if not threaded:  # a threaded worker's env threads pin themselves once built
            worker.pin()
        worker.run()
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the consumer, then we exit
        tb = exc.tb if isinstance(exc, DeferredEnvError) else traceback.format_exc()
        phase = worker._phase if worker is not None else "start-up"
        index = worker._current if worker is not None and worker._current is not None else slot_ids[0]
        try:
            if worker is not None and worker.started:
                worker.arena.write_error(index, f"{phase}\n{tb}")
                worker.state[index] = S.ERROR  # after the text
            else:
                conn.send(("error", worker_id, index, (phase, tb)))
            Doorbell(consumer_fd.fd).ring()
        except BaseException:  # noqa: BLE001 - the parent may be gone already
            pass
    finally:
        try:
            if worker is not None:
                worker.close_envs()
        except BaseException:  # noqa: BLE001 - an env failing to close must not keep the worker alive
            pass
