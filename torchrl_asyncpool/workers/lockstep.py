"""A vector env hosting all of a worker's slots, stepped in lockstep (:func:`run_lockstep`).

A pass waits until every slot is answered, then steps all of them with one call, and writes
their records as one block of adjacent slots (``RecordWriter.add_block``).

A gymnasium vector env autoresets in NEXT_STEP mode: an env that ended last pass ignores its
action and returns its reset observation, published as ``FIRST`` (no transition). A TorchRL
batched env does not reset itself (``adapter.autoresets`` is False): the pass after an env ended
resets only the ended envs and publishes their ``FIRST`` records; the others' answered actions
wait for the next pass.

With restarts on, a vector env that raises in a step or a reset is rebuilt whole (see
:meth:`_Lockstep.rebuild`): every open episode of its envs ends with a ``TRUNCATION`` (reward 0,
``env_restarted``) at its last observation, the envs whose episode had just ended publish
nothing, and the next pass publishes every env's ``FIRST`` from the new env's reset (marked
``env_restarted`` for the envs no truncation marked). A replacement worker (the one before it
died) first cuts the episodes its dead worker left open, one ``TRUNCATION`` each, then publishes
the new env's ``FIRST`` records the same way.

Each pass is one of four steps, chosen by the state the last pass left: :meth:`_Lockstep.cut`,
:meth:`_Lockstep.publish_reborn`, :meth:`_Lockstep.reset_ended`, :meth:`_Lockstep.step`. That
state, and every episode transition, is the stepper's state machine over masks
(:class:`~torchrl_asyncpool.workers.stepper._Block`, the rules of a single slot's); this loop
makes the vector env's calls and writes the records it names.
"""
from __future__ import annotations

import time
import traceback

import numpy as np

from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.doorbell import BellWait
from torchrl_asyncpool.exchange.native import copy_into, fit_rows
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.workers.hosted_envs import check_life, close_reporting
from torchrl_asyncpool.workers.stepper import _Block

__all__ = ["run_lockstep"]

_FIRST, _TRUNC = int(StepType.FIRST), int(StepType.TRUNCATION)


def run_lockstep(worker) -> None:
    """The loop of ``_Worker.run`` for one vector env (``worker.vector``) hosting all of
    ``worker``'s slots, until the life pipe hangs up (see the module docstring)."""
    _Lockstep(worker).run()


class _Lockstep:
    """One vector env's lockstep loop: its rows, views and the episode state of its envs (a
    :class:`~torchrl_asyncpool.workers.stepper._Block`)."""

    def __init__(self, worker):
        self.worker = worker
        self.slots, self.delivery = worker.slots, worker.delivery
        self.stepper = worker.stepper
        self.writer, self.watcher = self.stepper.writer, self.stepper.watcher
        self.k, self.lo = k, lo = len(self.slots), self.slots[0].index
        self.rows = rows = slice(lo, lo + k)
        req, resp = worker.arena.request, worker.arena.response
        self.obs_rows = [(key, req.get(key).numpy()[rows]) for key in worker.vector.obs_keys]
        self.actions = {key: resp.get(key).numpy()[rows] for key in worker.vector.action_keys}
        self.reward_shape = self.writer.reward[rows].shape
        self.state = worker.state[rows]
        self.idx = np.arange(lo, lo + k)
        self.first = np.full(k, _FIRST, np.int8)
        self.episodes = _Block(k)

    def run(self) -> None:
        if getattr(self.worker.vector, "partial", False):
            return self.run_partial()
        waiter = self.start()
        life_fd, state, episodes = self.worker.life_fd, self.state, self.episodes
        passes = {"cut": self.cut, "reborn": self.publish_reborn, "reset": self.reset_ended, "step": self.step}
        while True:
            # (a rebuild that published nothing goes on at once, once every env is answered)
            if not episodes.silent() or not (state == S.ACTION_READY).all():
                for fd in waiter.wait():
                    if fd == life_fd:
                        return
            if not (state == S.ACTION_READY).all():
                continue
            passes[episodes.next_pass(getattr(self.worker.vector, "autoresets", True))]()

    def run_partial(self) -> None:
        """The loop for a vector env of partial steps (see ``GymnasiumVectorAdapter``): each wake-up
        (an answer from the consumer, or records ready in the env) hands the env the new actions
        and publishes the records it has, whichever envs they are. A replacement worker's cuts
        and rebuilds go first, as in :meth:`run`."""
        worker, state, life_fd, episodes = self.worker, self.state, self.worker.life_fd, self.episodes
        bell_only = self.start()
        waiter = BellWait(worker.bells[0], (life_fd, worker.vector.fileno()))
        passes = {"cut": self.cut, "reborn": self.publish_reborn}
        while episodes.next_pass(True) in passes:
            if (not episodes.silent() or not (state == S.ACTION_READY).all()) and life_fd in bell_only.wait():
                return
            if (state == S.ACTION_READY).all():
                passes[episodes.next_pass(True)]()
        while True:
            # every open episode holds a chunk before the env may answer it (a lost host's
            # truncations come unasked); without one, only the driver's ring can help
            if self._claim(np.flatnonzero(~episodes.ended)):
                self.step_partial(state == S.ACTION_READY)
                fired = waiter.wait()
            else:
                fired = bell_only.wait()
            if life_fd in fired:
                return

    def step_partial(self, ready) -> None:
        """Gives the env the answers of the envs in ``ready`` (those it can use now) and publishes
        the records it has for them (their chunks are claimed): an env's root row is written once
        its record is there, from the request row its answer saw (ours until it is published)."""
        episodes, writer = self.episodes, self.writer
        ended = episodes.ended
        self.stepper.note("step", self.lo)
        t = time.perf_counter()
        obs, rew, term, trunc, answered = self.worker.vector.step_some(self.actions, ready)
        dt = time.perf_counter() - t
        if not answered.any():
            return
        st = episodes.step_types(self._flags(term, "terminated"), self._flags(trunc, "truncated"))
        rew = self._rewards(rew)
        rew[ended] = 0
        stepping = np.flatnonzero(answered & ~ended)
        moving, chunk_rows = self._write_roots(stepping)
        self.write_obs(obs, answered)
        writer.add_block(self.lo, st, rew, dt, answered)
        self._write_nexts(moving, stepping, chunk_rows)
        writer.publish()
        episodes.stepped_some(st, answered)

    def start(self):
        """Resets the env and publishes every env's ``FIRST``; a replacement worker instead takes
        the slots over (the dead worker's records stand) and holds the new env's reset for the
        pass after the cuts. Returns the worker's wait."""
        worker, stepper, writer = self.worker, self.stepper, self.writer
        stepper.note("reset", self.lo)
        t = time.perf_counter()
        obs = worker.vector.reset()
        if worker.resuming:  # the new env's reset waits (see _Stepper.resume_slot)
            for slot in self.slots:
                stepper.take_over(slot)
            self.episodes.taken_over(writer.step_type[self.rows], self._held(obs))
        else:
            self.write_obs(obs)
            writer.add_block(self.lo, self.first, None, time.perf_counter() - t)
            writer.publish()
        return worker.announce_ready()

    # -- the four steps of a pass ---------------------------------------------------------------
    def cut(self) -> None:
        """The truncations of the episodes the dead worker left open (no step)."""
        cutting = self.episodes.cut
        cut = np.flatnonzero(cutting)
        moving, chunk_rows = self._write_roots(cut)
        if moving is False:
            return  # back-pressure: the driver frees a chunk and rings this worker
        self._begin(cut, chunk_rows)  # this worker may die too: its own replacement reads it
        self.writer.add_block(self.lo, np.full(self.k, _TRUNC, np.int8), None, 0.0, cutting, restarted=True)
        self._write_nexts(moving, cut, chunk_rows)
        self.writer.publish()
        self.episodes.cut_done()

    def publish_reborn(self) -> None:
        """The pass after a rebuild: every env's ``FIRST`` from the new env's reset, no step."""
        writer, lo, episodes = self.writer, self.lo, self.episodes
        if self.watcher is not None:
            self.watcher.begin_block(self.rows)
        self.write_obs(episodes.held)
        writer.add_block(lo, self.first, None, 0.0, episodes.marked, restarted=True)
        writer.add_block(lo, self.first, None, 0.0, ~episodes.marked)
        writer.publish()
        episodes.reborn_done()

    def reset_ended(self) -> None:
        """An env that does not reset itself: resets the ended envs only, publishes their ``FIRST``."""
        ended = self.episodes.ended
        self.stepper.note("reset", self.lo + int(np.flatnonzero(ended)[0]))
        if self.watcher is not None:
            self.watcher.begin_block(self.rows)
        t = time.perf_counter()
        try:
            obs = self.worker.vector.reset_some(ended)
            self.write_obs(obs, ended)  # an observation its rows cannot hold is the env's failure too
        except Exception:
            if self.worker.restarts is None:
                raise
            self.rebuild("reset")
            return
        self.writer.add_block(self.lo, self.first, None, time.perf_counter() - t, ended)
        self.writer.publish()
        self.episodes.reset_done()

    def step(self) -> None:
        """Steps every env with one call; the envs that ended last pass publish ``FIRST``."""
        episodes, writer = self.episodes, self.writer
        ended = episodes.ended
        stepping = np.flatnonzero(~ended)
        moving, chunk_rows = self._write_roots(stepping)
        if moving is False:
            return  # back-pressure: the driver frees a chunk and rings this worker
        self._begin(stepping, chunk_rows)
        self.stepper.note("step", self.lo)
        t = time.perf_counter()
        try:
            obs, rew, term, trunc = self.worker.vector.step(self.actions)
            dt = time.perf_counter() - t
            # what the env returned is checked before anything is written, so that a restart's
            # truncations stand at the last observation: a reward or an observation that its rows
            # cannot hold is the env's failure, restarted like a raise
            st = episodes.step_types(self._flags(term, "terminated"), self._flags(trunc, "truncated"))
            rew = self._rewards(rew)
            rew[ended] = 0
            self.write_obs(obs)
        except Exception:
            if self.worker.restarts is None:
                raise
            self.rebuild("step")
            self._write_nexts(moving, stepping, chunk_rows)  # the cut episodes' truncations, as "next"
            writer.publish()
            return
        writer.add_block(self.lo, st, rew, dt)
        self._write_nexts(moving, stepping, chunk_rows)  # copied from the request rows, which are ours
        writer.publish()
        episodes.stepped(st)

    # -- rebuilding -----------------------------------------------------------------------------
    def rebuild(self, phase) -> None:
        """Replaces the vector env, which just raised in ``phase`` (called from the ``except``):
        counts the failure against the budget of its first env (raising past it), closes it,
        builds a new one from the same factory and resets it. Stores (unpublished) a
        ``TRUNCATION`` at the last observation for each env with an open episode and holds the
        new env's reset observation, every env's next ``FIRST`` (``_Block.rebuilt``). Failures
        to build or reset the new env count too."""
        tb = traceback.format_exc()
        worker, stepper, lo, k = self.worker, self.stepper, self.lo, self.k
        failed = worker.vector  # the env to close before the next build
        while True:
            check_life(worker.life_fd)
            r = worker.restarts.admit(lo, phase, tb)
            if failed is not None:
                close_reporting(failed, lo)
            failed = None
            try:
                failed = adapter = stepper.replacement(lo, worker.vector_factory, r, num_envs=k)
                stepper.note("reset", lo)
                t = time.perf_counter()
                held = self._held(adapter.reset())  # until the next pass
                dt = time.perf_counter() - t
            except Exception:  # noqa: BLE001 - a failed rebuild is one more failure of this env
                tb, phase = traceback.format_exc(), "construction"
                continue
            break
        worker.vector = adapter
        for slot in self.slots:
            slot.adapter = adapter
        stepper.note_restart(lo, phase, tb, r)
        truncated = self.episodes.rebuilt(held)
        self.writer.add_block(lo, np.full(k, _TRUNC, np.int8), None, dt, truncated, restarted=True)

    # -- rows ---------------------------------------------------------------------------------
    def write_obs(self, obs, mask=None) -> None:
        """Copies the vector env's observations (of the envs in ``mask``) into the slots' rows.
        Every entry's shape is checked before the first is written (``ValueError`` from
        ``fit_rows``), so that a refused observation leaves the rows as they were."""
        if len(self.obs_rows) > 1:
            for key, view in self.obs_rows:
                if np.shape(obs[key]) != view.shape:
                    fit_rows(np.empty_like(view), obs[key], key)  # raises, naming the entry
        for key, view in self.obs_rows:
            if mask is None:
                copy_into(view, obs[key], key)
            else:
                fit_rows(view, obs[key], key, rows=mask)

    def _held(self, obs) -> dict:
        """A reset's observations, copied (checked and cast as :meth:`write_obs` does) to be
        written by a later pass."""
        held = {}
        for key, view in self.obs_rows:
            held[key] = np.empty_like(view)
            copy_into(held[key], obs[key], key)
        return held

    def _rewards(self, rew) -> np.ndarray:
        """The step's rewards as a fresh array of the block's reward rows (FIRST rows are zeroed
        in it); ``ValueError`` for rewards of another count or not numbers."""
        dtype = self.writer.reward.dtype
        try:
            out = np.array(rew, dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the vector env returned the rewards {rew!r:.80}, which are not numbers "
                             f"({exc}).") from None
        if out.size != int(np.prod(self.reward_shape)):
            raise ValueError(f"the vector env returned rewards of shape {out.shape} for its {self.k} envs; their "
                             f"reward spec holds one number an env a step (shape {self.reward_shape}).")
        return out.reshape(self.reward_shape)

    def _flags(self, value, name) -> np.ndarray:
        """``terminated`` or ``truncated`` of a step as ``k`` bools; ``ValueError`` for another count."""
        flags = np.asarray(value, bool)
        if flags.shape != (self.k,):
            flags = flags.reshape(-1) if flags.size == self.k else None
        if flags is None:
            raise ValueError(f"the vector env returned {name} of shape {np.shape(value)} for its {self.k} envs; "
                             f"one flag an env was expected (shape ({self.k},)).")
        return flags

    def _write_roots(self, at):
        """Claims a chunk for each env at positions ``at`` and copies its answered record and
        action into it: ``(slots, chunk rows)``; ``(None, None)`` when nothing is delivered,
        ``(False, None)`` when an env has no free chunk (back-pressure: nothing is written)."""
        delivery = self.delivery
        if delivery is None or not len(at):
            return None, None
        if not self._claim(at):
            return False, None
        moving = [self.slots[j] for j in at]
        return moving, delivery.write_root_rows(moving, self.idx[at])

    def _claim(self, at):
        """Claims a chunk for each env at positions ``at``, writing nothing: False when one has no
        free chunk (back-pressure)."""
        delivery = self.delivery
        return delivery is None or all([delivery.claim(self.slots[j]) for j in at])

    def _write_nexts(self, moving, at, chunk_rows) -> None:
        """The transitions' ``"next"`` rows, after :meth:`_write_roots` (nothing when it wrote none)."""
        if moving is not None:
            self.delivery.write_next_rows(moving, self.idx[at], chunk_rows)

    def _begin(self, at, chunk_rows) -> None:
        """Tells the watcher (if any) that the block's step begins; ``chunk_rows``: the chunk rows
        of the envs at ``at`` (``None``: no chunk rows)."""
        if self.watcher is None:
            return
        pos = np.full(self.k, -1, np.int64)
        if chunk_rows is not None:
            pos[at] = chunk_rows
        self.watcher.begin_block(self.rows, pos)
