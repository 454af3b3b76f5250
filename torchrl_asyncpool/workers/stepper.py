"""The per-slot episode state machine of a worker: :class:`_Stepper` serves its slots
(:class:`_Slot`, one hosted env each) and owns their autoreset.

A slot in ``ACTION_READY`` is served by the state its last record left::

    ended (the last record was terminal)  the action is discarded; the (already reset) FIRST
                                          record is staged (no step, nothing to deliver)
    cut (a dead worker left it open)      a TRUNCATION at the last observation, marked
                                          env_restarted (no step)
    otherwise                             [the answered record and its action into the env's
                                          chunk], step, stage MID / TERMINATION / TRUNCATION,
                                          [the record into the chunk as "next"]

then the envs that just ended are reset eagerly (:meth:`_Stepper.eager_reset`), while the
consumer computes the discarded action. With restarts on, an env that raises is rebuilt and its
episode ends as a truncation marked as a restart's. Every record goes through the stepper's own
:class:`~torchrl_asyncpool.workers.record_writer.RecordWriter`; the env's own step writes only
the observation, straight into the slot's rows. The pass loop of a worker has one stepper for
all its slots (:mod:`~torchrl_asyncpool.workers.worker`), each env thread its own
(:mod:`~torchrl_asyncpool.workers.env_threads`); a vector env stepped in lockstep
(:mod:`~torchrl_asyncpool.workers.lockstep`) uses one for its notes, rebuilds and takeovers, and
a :class:`_Block`, the same state machine over masks, for its envs' episodes.

The episode transitions are decided here only, by three rules that hold for one slot (Python
bools and ints) and for a block of envs (numpy masks) alike: :func:`_ends` (a terminal record's
next answer gets ``FIRST``), :func:`_on_rebuild` (a rebuilt env truncates the open episodes and
marks the next ``FIRST`` of the ended ones) and :func:`_on_takeover` (a replacement worker
resumes an ended episode with a marked ``FIRST`` and cuts an open one). A slot keeps its state
in attributes (one read per record on the hot path), a block in masks (one store per pass).
"""
from __future__ import annotations

import functools
import time
import traceback

import numpy as np

from torchrl_asyncpool.exchange.native import copy_into, step_group
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.envs.adapters import make_adapter
from torchrl_asyncpool.envs.gymnasium_adapters import GymnasiumEnvAdapter
from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.workers.hosted_envs import build_replacement, check_fields, check_life, close_reporting
from torchrl_asyncpool.workers.record_writer import RecordWriter
from torchrl_asyncpool.workers.restarts import DeferredEnvError
from torchrl_asyncpool.workers.watch import Watcher

__all__ = []

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
#: rewards that are one number as they stand (anything else is checked against its row with restarts on)
_NUMBERS = frozenset({float, int, np.float64, np.float32})


def _ends(st):
    """Whether a record of step type ``st`` (an int, or an int8 array of a block) ends its
    episode: the answer to it is discarded and the env's next record is its ``FIRST``."""
    return (st == _TERM) | (st == _TRUNC)


def _on_rebuild(ended):
    """What rebuilding an env does to its episodes, given ``ended`` (the last record was
    terminal; a bool, or a block's mask): ``(truncated, marked)``, the open episodes end with a
    ``TRUNCATION`` marked ``env_restarted`` at their last observation, and the ended ones' next
    ``FIRST`` is marked instead (no truncation marked them). Every episode has ended after it."""
    return ended ^ True, ended


def _on_takeover(last_st):
    """A replacement worker's state of a slot (or a block's mask of them) whose last published
    record has step type ``last_st``: ``(ended, marked, cut)``, an ended episode's next record
    is the new env's ``FIRST``, marked ``env_restarted``; an open one is cut first, by a
    ``TRUNCATION`` at that record's observation (marked, no step)."""
    ended = _ends(last_st)
    return ended, ended, ended ^ True


class _Block:
    """The episode state machine of the adjacent slots of one vector env stepped in lockstep
    (:mod:`~torchrl_asyncpool.workers.lockstep`), as masks over its ``k`` envs: the rules of a
    single slot's (:func:`_ends`, :func:`_on_rebuild`, :func:`_on_takeover`), one store per
    pass. The lockstep loop does the env's calls and writes the records this state names.

    Args:
        k (int): the number of envs.

    Examples:
        >>> import numpy as np
        >>> block = _Block(3)
        >>> block.next_pass(autoresets=True)
        'step'
        >>> st = block.step_types(np.array([True, False, False]), np.array([False, True, False]))
        >>> block.stepped(st)
        >>> block.ended.tolist(), block.step_types(np.zeros(3, bool), np.zeros(3, bool)).tolist()
        ([True, True, False], [0, 0, 1])
    """

    def __init__(self, k):
        self.k = k
        self.ended = np.zeros(k, bool)  # the env's last record was terminal: its next one is FIRST
        self.cut = np.zeros(k, bool)  # a dead worker's open episode: its TRUNCATION comes first, no step
        self.marked = np.zeros(k, bool)  # the env's next FIRST is marked env_restarted
        self.held = None  # a rebuilt (or replacement's) env's reset observation: every env's next FIRST

    def next_pass(self, autoresets) -> str:
        """What the next pass (every env answered) does: ``"cut"`` the open episodes a dead
        worker left, publish the ``"reborn"`` env's ``FIRST`` records, ``"reset"`` the ended envs
        of an env that does not reset itself (``autoresets`` False), or ``"step"`` every env
        (the ended ones' ``FIRST``, NEXT_STEP autoreset)."""
        if self.cut.any():
            return "cut"
        if self.held is not None:
            return "reborn"
        if not autoresets and self.ended.any():
            return "reset"
        return "step"

    def silent(self) -> bool:
        """Whether a rebuild published nothing (every env had ended): its ``FIRST`` records go
        out without waiting for another answer."""
        return self.held is not None and bool(self.marked.all())

    def step_types(self, terminated, truncated) -> np.ndarray:
        """The step types of a step's records (int8 ``[k]``): ``FIRST`` where the episode had ended
        (the action was discarded), else ``TERMINATION``, ``TRUNCATION`` or ``MID``."""
        st = np.where(terminated, _TERM, np.where(truncated, _TRUNC, _MID))
        return np.where(self.ended, _FIRST, st).astype(np.int8)

    def stepped(self, st) -> None:
        """A step's records (``st``, from :meth:`step_types`) are written."""
        self.ended = _ends(st)

    def stepped_some(self, st, answered) -> None:
        """A partial step's records (``st``) are written for the envs in ``answered``."""
        self.ended = np.where(answered, _ends(st), self.ended)

    def reset_done(self) -> None:
        """The ended envs' ``FIRST`` records (their own resets) are written."""
        self.ended = np.zeros(self.k, bool)

    def cut_done(self) -> None:
        """The cut episodes' ``TRUNCATION`` records are written: those episodes have ended."""
        self.ended = self.ended | self.cut
        self.cut = np.zeros(self.k, bool)

    def rebuilt(self, held) -> np.ndarray:
        """The env was rebuilt, its reset observation ``held`` for the next pass: returns the
        mask of the episodes to end with a marked ``TRUNCATION`` (see :func:`_on_rebuild`)."""
        truncated, marked = _on_rebuild(self.ended)
        self.marked = marked.copy()
        self.ended = np.ones(self.k, bool)
        self.held = held
        return truncated

    def taken_over(self, last_st, held) -> None:
        """A replacement worker's block, whose last published records have step types
        ``last_st`` (see :func:`_on_takeover`); ``held``: its new env's reset observation."""
        self.ended, self.marked, self.cut = _on_takeover(np.asarray(last_st))
        self.held = held

    def reborn_done(self) -> None:
        """Every env's ``FIRST`` from the held reset observation is written."""
        self.held = None
        self.ended = np.zeros(self.k, bool)
        self.marked = np.zeros(self.k, bool)


def _np(t) -> np.ndarray:
    return t.numpy()


class _Slot:
    """Everything one hosted env needs on the hot path, resolved once."""

    __slots__ = ("index", "adapter", "obs", "actions", "step_into", "fast", "ended", "pending_first", "pending_error",
                 "reset_dt", "chunks", "chunk", "pos", "seq", "factory", "reborn", "cut", "saved_obs")

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
        # with restarts on and no watcher's shadow: a copy of the observation rows taken before
        # each step, put back when the step fails (allocated by the stepper at the first step)
        self.saved_obs = None

    def write_obs(self, obs):
        """Copies an observation (as the adapter's ``step``/``reset`` return it) into the slot's rows."""
        as_np = self.adapter.as_numpy
        for key, view in self.obs:
            copy_into(view, as_np(obs.get(key)), key)  # keeps the GIL (see copy_into)


def _fast_step(index, adapter, obs, actions):
    """The slot's tuple for the C steps of a pass (``exchange/csrc/step_loop.c``): ``(index,
    env.step, action row, action maker or None, observation row or ((key, row), ...), step count
    or None, reward sum or None)``: what ``GymnasiumEnvAdapter.step_into`` uses, or for a TorchRL
    ``GymEnv`` on the fast path what its ``c_step`` says (the count and the sum its
    ``StepCounter``/``RewardSum`` keep); ``None`` where the env takes the Python path (any other
    adapter, an env with planned episodes)."""
    if getattr(adapter, "_plan", None) is not None or not isinstance(actions.get("action"), np.ndarray):
        return None
    if type(adapter) is GymnasiumEnvAdapter:
        # GymnasiumEnvAdapter._action_value: row[()] (None here), the space's scalar type, or a copy
        make = adapter._discrete_scalar if adapter._discrete else np.ndarray.copy
        rows = tuple(obs) if adapter._dict_obs else obs[0][1]
        return index, adapter.env.step, actions["action"], make, rows, None, None
    c_step = getattr(adapter, "c_step", None)
    fields = c_step(obs) if c_step is not None else None
    if fields is None:
        return None
    step, make, row, count, total = fields
    return index, step, actions["action"], make, row, count, total


def _step_into(adapter, actions, views):
    """``step_into`` of an adapter that only has ``step``: the same contract, generically."""
    obs, reward, terminated, truncated = adapter.step(actions)
    as_np = adapter.as_numpy
    for key, view in views:
        copy_into(view, as_np(obs.get(key)), key)
    return as_np(reward), terminated, truncated


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
        check_fields(self.worker.expected, index, adapter)

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
        an env that raises (or returns what its rows cannot hold) is rebuilt and its episode ends as
        a truncation (reward 0, marked as a restart's) at its last observation: the rows the failed
        step wrote are put back."""
        restarts = self.restarts is not None
        # the step may write part of its observation before it fails (an entry of another shape
        # refused after the others, a bad reward after all of them): with restarts on, the
        # truncation must stand at the last observation, so the rows are put back from a copy
        # taken as the step began: the watcher's shadow (a process worker's, taken by _begin)
        # or, without one (an env thread of backend="threading"), the slot's own
        saved = slot.saved_obs
        if saved is None and restarts and not (self.watcher is not None and self.watcher.pairs):
            saved = slot.saved_obs = [(view, np.empty_like(view)) for _, view in slot.obs]
        try:
            if saved is not None:
                for view, copy in saved:
                    np.copyto(copy, view)
            reward, terminated, truncated = slot.step_into(slot.actions, slot.obs)
            if restarts and reward.__class__ not in _NUMBERS:
                # checked here, not when the pass's records are stored, so that a reward its row
                # cannot hold is this env's failure, restarted like a raise
                self.writer.check_reward(slot.index, reward)
        except Exception:
            if not restarts:
                raise
            if saved is not None:
                for view, copy in saved:
                    np.copyto(view, copy)
            else:
                self.watcher.restore(slot.index)
            self._rebuild(slot, "step")
            self.note("step", slot.index)
            return None, _TRUNC, True
        return reward, (_TERM if terminated else (_TRUNC if truncated else _MID)), False

    def step_pass(self, stepping):
        """Steps ``stepping`` (claimed, ACTION_READY, not ended) in order; returns those whose
        episode ended. Per slot only the step (with its observation copy) and the staging of
        its record run per slot, in C for plain gymnasium envs and TorchRL ``GymEnv`` factories
        on the fast path (``exchange.native.step_group``: the env's step is the only Python
        then) and in Python otherwise; the records are stored
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
        # the C steps stage their records in the writer's lists, which it hands out only while
        # add() would do nothing more (no recurrent inputs, no restart flags)
        staging = writer.plain_staging() if plain and self.fast_steps is not None else None
        if staging is not None:
            fast = [slot.fast for slot in stepping]  # every env of the pass in C, or none
            if any(f is None for f in fast):
                fast = None
        self.phase = "step"
        while start < n:
            if fast is not None:
                k, ended_at = self.fast_steps(self, fast, start, *staging, _SLOW_STEP_S, _HOLD_S)
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
        for plain gymnasium envs and TorchRL's fast path): steps ``stepping[start:]`` in order
        until a slow step or the hold time, stages their records, adds the ended ones to
        ``ended``; returns how many."""
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
            check_life(self.worker.life_fd)
            r = self.restarts.admit(slot.index, phase, tb)
            if failed is not None:
                close_reporting(failed, slot.index)
            try:
                adapter = self.replacement(slot.index, slot.factory, r)
            except Exception:  # noqa: BLE001 - a failed rebuild is one more failure of this env
                tb, phase, failed = traceback.format_exc(), "construction", None
                continue
            slot.bind(adapter, self.worker.arena)
            self.note_restart(slot.index, phase, tb, r)
            slot.pending_first = slot.pending_error = None
            # a step's failure (open episode): its caller stages the marked TRUNCATION; a reset's
            # (ended): the next FIRST is marked
            _, slot.reborn = _on_rebuild(slot.ended)
            slot.ended = True
            return

    def replacement(self, index, factory, r, num_envs=None):
        """The adapter of env ``index``'s ``r``-th rebuild from ``factory`` (see
        :func:`~torchrl_asyncpool.workers.hosted_envs.build_replacement`)."""
        self.note("construction", index)
        return build_replacement(self.worker, index, factory, r, num_envs)

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
                check_life(self.worker.life_fd)
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
        the new env's ``FIRST``, marked instead (see :func:`_on_takeover`). Returns whether it
        published a record."""
        pending = self.take_over(slot)
        slot.ended, slot.reborn, slot.cut = _on_takeover(int(self.writer.step_type[slot.index]))
        return pending

    def take_over(self, slot) -> bool:
        """:meth:`resume_slot`'s rows: the watcher's and the chunk buffers' state of ``slot`` as its
        dead worker left them, and its whole unpublished record published now (then True); the
        episode state is the caller's (a slot's attributes, or a :class:`_Block`'s masks)."""
        i = slot.index
        delivery = self.delivery
        if delivery is None:
            pending = self.watcher.takeover(i)
        else:
            pending = self.watcher.takeover(i, delivery.chunks.length, delivery.T)
            delivery.resume(slot)
        if pending:
            self.writer.publish_stored(i)
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
            return obs  # marked as a restart's by _rebuild's rule


def _plan_done(adapter) -> bool:
    """True when ``adapter``'s env carries an episode plan (``EPISODE_PLAN_ATTR``) whose last
    episode is the one running or just ended."""
    plan = getattr(adapter, "_plan", None)
    return plan is not None and plan.episode + 1 >= len(plan.plan)


