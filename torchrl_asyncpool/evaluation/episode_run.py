"""One pool's share of an evaluation: which episode each slot runs, served as the collector
serves its policy.

:class:`EpisodeRun` books the records of one :class:`~torchrl_asyncpool.AsyncEnvPool` (each
slot runs its planned episodes in order, the worker resetting its env for the next one) and
answers them with the policy, wrapped in the collector's
:class:`~torchrl_asyncpool.collector.acting_policy.ActingPolicy` (the exploration type, and the
actions checked and cast against the env's action spec as the collector's inference server
does, see :mod:`~torchrl_asyncpool.collector.action_checks`). What happens around one pool
(retries, isolation, the restart budget) is :func:`~torchrl_asyncpool.evaluation.evaluate`'s.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, List, Optional

import numpy as np
import torch
from tensordict import TensorDictBase

from torchrl_asyncpool.collector.action_checks import action_checks
from torchrl_asyncpool.errors import EnvError, WorkerDiedError
from torchrl_asyncpool.evaluation.episodes import EpisodeResult, PlanProgress
from torchrl_asyncpool.exchange.arena import unread_keys_error
from torchrl_asyncpool.pool.env_pool import AsyncEnvPool
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.workers.record_writer import RESTARTED_KEY

__all__ = ["EpisodeRun", "PolicyFailure", "PoolRestart", "kill_workers_of", "policy_answers", "rebuilds_of"]

_FIRST, _TERM, _TRUNC = int(StepType.FIRST), int(StepType.TERMINATION), int(StepType.TRUNCATION)
#: the phase ``pool.restart_info()`` gives the rebuilds that replaced a dead worker process
_WORKER_DIED = "worker"
#: how long one wait for records lasts before wall-clock limits are looked at again
_POLL_S = 0.1


class PoolRestart(Exception):
    """The pool must be rebuilt: the episodes of env ``slots`` timed out on the wall clock (their
    envs may hang in a step or reset)."""

    def __init__(self, slots):
        super().__init__(slots)
        self.slots = list(slots)


class PolicyFailure(Exception):
    """The policy raised, or its output could not be sent as the actions (``__cause__``)."""


class EpisodeRun:
    """One pool's share of an evaluation: which episode each slot runs, and their sums.

    A slot's episode is its ``current`` one from the moment its env starts being built or reset
    for it (the pool's start, or the terminal record of the slot's previous episode: the worker
    resets right after it) until its end, so that its wall-clock limit covers a reset that hangs.
    Until its first record arrives it is ``fresh``: a drain gives a fresh episode back (it is
    reported "not started"), unless the run is ``committed`` (a drain's rerun of episodes that
    were running when their pool had to close).
    """

    def __init__(self, episodes, limits, queues, acting, finish, timeout_s, stop=None, device=None,
                 committed=False, progress: Optional[PlanProgress] = None, restarts: bool = False):
        self.episodes, self.limits, self.queues = episodes, limits, queues
        # how far each slot's envs got through its plan, and which episodes the env itself ended
        # at their step limit; restarts: on_env_failure="restart" (a rebuilt env goes on with the plan)
        self.progress, self.restarts = progress, restarts
        self.plan_len = [len(q) for q in queues]
        self.position = {i: k for q in queues for k, i in enumerate(q)}  # manifest index -> place in its slot's plan
        self.acting, self.finish, self.timeout_s = acting, finish, timeout_s
        self.stop = stop
        self.committed = committed
        self.device = None if device is None or device.type == "cpu" else device
        n = len(queues)
        self.current: List[Optional[int]] = [None] * n  # manifest index each slot is running
        self.fresh = [False] * n  # its current episode has not published its first record yet
        self.ret = np.zeros(n)
        self.length = np.zeros(n, dtype=np.int64)
        self.started = np.zeros(n)
        # on_env_failure="restart": the rebuilds of each slot's env accounted for, all slots' together,
        # and the episodes a dead worker of several envs cut (run again later, one env per process)
        self.seen = [0] * n
        self.rebuilt = 0
        self.deferred: List[int] = []
        self.hosted = None  # envs of the worker of each slot (set by drive)

    def _result(self, s: int, status: str, **kw) -> EpisodeResult:
        i = self.current[s]
        return EpisodeResult(self.episodes[i].episode_id, status, float(self.ret[s]), int(self.length[s]),
                             seed=self.episodes[i].seed, env_index=s, **kw)

    def _unstarted(self, i: int, error: str, s: Optional[int] = None) -> EpisodeResult:
        """The failure of episode ``i`` before it took a step (slot ``s``, if it had one)."""
        return EpisodeResult(self.episodes[i].episode_id, "failed", seed=self.episodes[i].seed, env_index=s,
                             error=error)

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _next(self, s: int, now: float) -> None:
        """Slot ``s``'s next episode becomes its current one (its env is being reset for it)."""
        if self.queues[s]:
            self.current[s] = self.queues[s].popleft()
            self.fresh[s] = True
            self.ret[s], self.length[s], self.started[s] = 0.0, 0, now
        else:
            self.current[s] = None

    def begin(self, now: float) -> None:
        """Every slot's first episode is current (its env is about to be built and reset)."""
        for s in range(len(self.queues)):
            self._next(s, now)

    def clock_from(self, t: float) -> None:
        """The first episodes' wall clocks start at ``t`` (when the workers started building)."""
        for s, fresh in enumerate(self.fresh):
            if fresh:
                self.started[s] = t

    def start_abandoned(self) -> bool:
        """Whether the pool's start-up is to be abandoned: a drain began (a committed run's
        episodes were running before: their rerun starts anyway)."""
        return not self.committed and self._stopping()

    def give_back_fresh(self) -> None:
        """A drain: the episodes whose env is still being reset are not started after all."""
        if self.committed:
            return
        for s, i in enumerate(self.current):
            if i is not None and self.fresh[s]:
                self.queues[s].appendleft(i)
                self.current[s] = None

    def interrupted(self) -> List[int]:
        """The episodes still running (and, for a committed run, still owed) when the pool closed,
        and those a dead worker cut (to run again, one env per process)."""
        return [i for s, i in enumerate(self.current) if i is not None and (self.committed or not self.fresh[s])] \
            + self.deferred

    def drive(self, pool: AsyncEnvPool) -> None:
        """Runs until every slot has finished its episodes (or, once ``stop`` is set, its
        running episode)."""
        poll = None if self.timeout_s is None and self.stop is None else _POLL_S
        keys = pool.action_keys + pool.policy_output_keys
        workers = np.asarray(pool.slot_workers)
        self.hosted = np.bincount(workers)[workers].tolist()
        # the collector's checks of the actions against the env's action spec (dtype, finiteness,
        # discrete bounds), applied by the acting policy to every batch before anything is sent
        self.acting.action_checks = action_checks(pool.full_action_spec,
                                                  {k: pool.layout_dtype(k) for k in pool.action_keys})
        while True:
            if self._stopping():
                self.give_back_fresh()
            if all(i is None for i in self.current):
                return
            if pool.wait_ready(1, timeout=poll) == 0:
                self._check_clock()
                continue
            td = pool.recv(min_get=1)  # everything ready now, at once
            answer = self._observe(td, pool)
            self._check_clock()
            if answer.any():
                self._answer(td, answer, keys, pool)

    def _answer(self, td, answer: np.ndarray, keys: list, pool: AsyncEnvPool) -> None:
        """Runs the policy on the batch ``td`` and sends the actions of its rows ``answer``;
        :class:`PolicyFailure` when the policy raises or its actions cannot be sent."""
        idx = torch.from_numpy(np.flatnonzero(answer))
        try:
            with torch.no_grad():
                out = self.acting(td if self.device is None else td.to(self.device, non_blocking=True))
            actions = policy_answers(out, keys, idx, self.device)
            pool.send(actions, td.env_indices[idx])  # ValueError: wrong shapes or dtypes, nothing sent
        except (EnvError, WorkerDiedError):
            raise
        except Exception as exc:
            raise PolicyFailure() from _missing_inputs(self.acting, td, exc)

    def _observe(self, td, pool) -> np.ndarray:
        """Books the batch's records; returns which rows to answer (their slot has work left)."""
        slots = td.env_indices.tolist()
        step_types = td["step_type"].tolist()
        rewards = td["reward"].reshape(len(slots), -1).sum(-1).tolist()
        restarted = td.get(RESTARTED_KEY, None)  # on_env_failure="restart" only
        restarted = [False] * len(slots) if restarted is None else restarted.reshape(len(slots)).tolist()
        answer = np.zeros(len(slots), dtype=bool)
        now = time.monotonic()
        stopping = self._stopping()
        for row, (s, st, r, rebuilt) in enumerate(zip(slots, step_types, rewards, restarted)):
            i = self.current[s]
            if i is None:  # the slot's episodes are done, or a drain gave its next one back
                continue
            if rebuilt and st != _FIRST:  # the episode was cut: its env failed, or its worker died
                self._cut(s, pool, now, stopping)
                answer[row] = self.current[s] is not None
                continue
            if st == _FIRST and self.restarts:
                self._resets_failed(s, pool, now)  # before the episode this FIRST record starts
                i = self.current[s]
                if i is None:
                    continue
            if st == _FIRST:
                if stopping and not self.committed:  # drained: the slot's next episode does not start
                    self.queues[s].appendleft(i)
                    self.current[s] = None
                    continue
                self.fresh[s] = False
            else:
                self.ret[s] += r
                self.length[s] += 1
                if st >= _TERM:
                    limit = self.limits[i]
                    cut = st == _TRUNC and limit is not None and self.length[s] >= limit and not (
                        self.progress is not None and self.progress.ended_by_env(s, self.position[i]))
                    error = f"cut after max_steps={limit} steps" if cut else None
                    self.finish(i, self._result(s, "timeout" if cut else "completed", terminated=st == _TERM,
                                                truncated=st == _TRUNC and not cut, error=error))
                    # the worker resets its env for the next episode right after this record
                    # (answered below), or it is the slot's last one (not answered: no reset)
                    if stopping:
                        self.current[s] = None
                    else:
                        self._next(s, now)
            answer[row] = self.current[s] is not None
        return answer

    def _cut(self, s: int, pool: AsyncEnvPool, now: float, stopping: bool) -> None:
        """A ``TRUNCATION`` marked ``env_restarted`` (``on_env_failure="restart"``): slot ``s``'s
        env raised in a step of its running episode (or its worker died) and was rebuilt. The
        episode is lost; the slot goes on with its next one, which the rebuilt env starts with
        its own seed (see :class:`~torchrl_asyncpool.evaluation.episodes.PlanProgress`), unless a
        drain began."""
        self._lost(s, 1, "step", pool, now, stopping)

    def _resets_failed(self, s: int, pool: AsyncEnvPool, now: float) -> None:
        """A ``FIRST`` record of slot ``s`` (with restarts): the episodes of its plan before the
        one this record starts, from its current one on, had their reset fail (or their worker
        die during it), each followed by a rebuild; they are lost. The record starts the last
        planned episode whose reset began, or none when the slot's env was built after its plan
        had run out."""
        plan_len = self.plan_len[s]
        start = self.progress.built_from(s)
        first = plan_len if start >= plan_len else self.progress.taken(s) - 1
        failures = first - self.position[self.current[s]]
        if failures > 0:
            self._lost(s, failures, "reset", pool, now, stopping=False)

    def _lost(self, s: int, failures: int, what: str, pool: AsyncEnvPool, now: float, stopping: bool) -> None:
        """Slot ``s``'s next ``failures`` episodes, from its current one, were lost to failures
        in their ``what`` (``"step"`` or ``"reset"``) that rebuilt its env: each is ``"failed"``
        with the cause, or, when its worker died and hosted other envs (which one killed it is
        unknown), left to run again one env per process once this pool is done. The slot goes
        on with its next episode (none after a cut during a drain)."""
        try:
            count, cause = pool.restart_info().get(s, (self.seen[s] + failures, ""))
        except Exception:  # noqa: BLE001 - only the cause's text is missing
            count, cause = self.seen[s] + failures, ""
        phase, _, tb = cause.partition("\n")
        latest = count == self.seen[s] + failures  # no later rebuild overwrote the cause on record
        self.seen[s] += failures
        self.rebuilt += failures
        if phase == _WORKER_DIED:
            error = f"its worker died: {tb.strip()}"
        elif failures > 1:  # several resets in a row: one cause on record for all of them
            error = (f"env raised during reset (one of {failures} failed resets in a row, each followed by a rebuild "
                     f"of the env; the last failure on record, during {phase}:\n{tb})")
        elif latest and tb:
            error = f"env raised during {phase}:\n{tb}" if phase == what else \
                f"env raised during {what}; its rebuild then failed during {phase}:\n{tb}"
        else:  # the traceback on record is a later failure's
            error = f"env raised during {what} (its env was rebuilt; the traceback on record is a later failure's)"
        for _ in range(failures):
            i = self.current[s]
            if phase == _WORKER_DIED and self.hosted[s] > 1:
                self.deferred.append(i)
            else:
                self.finish(i, self._result(s, "failed", error=error))  # its steps so far
            if stopping:  # a drain: the cut episode was the slot's last one
                self.current[s] = None
            else:
                self._next(s, now)
            if self.current[s] is None:
                return

    def _check_clock(self) -> None:
        if self.timeout_s is None:
            return
        now = time.monotonic()
        late = [s for s, i in enumerate(self.current) if i is not None and now - self.started[s] > self.timeout_s]
        for s in late:
            how = " before its first record: its env's creation or reset did not return" if self.fresh[s] else ""
            self.finish(self.current[s], self._result(
                s, "timeout", error=f"ran longer than episode_timeout_s={self.timeout_s} s (wall clock){how}"))
            self.current[s] = None
        if late:  # the env may hang in its step or reset: only closing the pool gets it back
            raise PoolRestart(late)

    def start_timed_out(self, exc: TimeoutError, one_env_per_worker: bool) -> bool:
        """The pool's start-up outlasted ``episode_timeout_s`` (``exc`` names the envs of the
        workers still starting): times out their episodes; returns True, timing out none, when
        one of those workers hosts several envs (which one hangs is unknown: they run again one
        env per process)."""
        slots = [s for s in getattr(exc, "env_indices", range(len(self.current))) if s < len(self.current)]
        hung = [s for s in slots if self.current[s] is not None]
        if len(hung) > 1 and not one_env_per_worker:
            return True
        for s in hung:
            self.finish(self.current[s], self._result(
                s, "timeout", error=f"its env was not built and reset within episode_timeout_s={self.timeout_s} s "
                                    "(wall clock)"))
            self.current[s] = None
        return False

    def died(self, exc: WorkerDiedError) -> bool:
        """A worker died (killed, crashed in native code): fails the episode it was running if
        it ran one; returns True when it ran several, which are then run again one env per
        process (the next death names the culprit)."""
        running = [s for s in exc.env_indices if s < len(self.current) and self.current[s] is not None]
        if len(running) != 1:
            return len(running) > 1
        s = running[0]
        self.finish(self.current[s], self._result(s, "failed", error=f"its worker died: {exc}"))
        self.current[s] = None
        return False

    def fail(self, exc: EnvError, all_remaining: bool = False, pool: Optional[AsyncEnvPool] = None) -> None:
        """Marks the episode ``exc`` belongs to as failed (or every episode of this run, when
        the env cannot be built at all: that does not depend on the episode).

        With restarts (``pool`` given), ``exc`` is a failure past the restart budget; the resets
        of the slot's episodes that failed in a row before it (each followed by a rebuild, no
        record of them yet) fail those episodes first: ``exc`` belongs to the last one taken."""
        error = f"env raised during {exc.phase}:\n{exc.worker_traceback}"
        s = exc.env_index
        if self.restarts and pool is not None and not all_remaining and s is not None \
                and s < len(self.current) and self.current[s] is not None:
            try:  # the resets that failed in a row before this failure, each followed by a rebuild
                before = self.progress.taken(s) - 1 - self.position[self.current[s]]
            except OSError:
                before = 0
            if before > 0:
                self._lost(s, before, "reset", pool, time.monotonic(), stopping=False)
        if all_remaining:
            for s, i in enumerate(self.current):
                for j in ([] if i is None else [i]) + list(self.queues[s]):
                    self.finish(j, self._unstarted(j, error))
                self.current[s] = None
                self.queues[s].clear()
            return
        if self.current[s] is not None:  # stepping it, or resetting for it
            self.finish(self.current[s], self._result(s, "failed", error=error))
            self.current[s] = None

    def abandon(self, did_not_finish: str, not_started: str, ended: Callable[[int], bool] = lambda i: False) -> None:
        """The evaluation failed or was aborted: the running episodes fail with the error
        ``did_not_finish`` (their return and length so far), those whose env was still being
        built or reset with ``not_started``; episodes for which ``ended(i)`` (their result is in,
        an abort came right after it) are left alone."""
        for s, i in enumerate(self.current):
            if i is None or ended(i):
                continue
            if self.fresh[s]:
                self.finish(i, self._unstarted(i, not_started, s))
            else:
                self.finish(i, self._result(s, "failed", error=did_not_finish))
            self.current[s] = None

def policy_answers(out, keys, idx, device) -> dict:
    """The answered rows ``idx`` of the policy output ``out``, one tensor per key of ``keys``
    (on the CPU).

    Parameters
    ----------
    out : TensorDictBase
        What the policy returned (or its input, which it wrote into, when it returned ``None``).
    keys : list
        The action keys of the env and the declared policy outputs.
    idx : torch.Tensor
        Rows of the batch to answer.
    device : torch.device or None
        The policy's device (``None``: the CPU).

    Raises
    ------
    TypeError
        ``out`` is not a TensorDict.
    ValueError
        ``out`` lacks one of ``keys``; the message lists what it holds.
    """
    if not isinstance(out, TensorDictBase):
        raise TypeError(f"the policy must return a TensorDict (or None, having written into its input); it returned "
                        f"{type(out).__name__}.")
    missing = [k for k in keys if out.get(k, None) is None]
    if missing:
        raise ValueError(
            f"the policy's output has no {', '.join(map(repr, missing))}: it must write the env's action key(s) and "
            f"the declared policy outputs {keys}; it returned a {type(out).__name__} with the keys "
            f"{sorted(map(str, out.keys(True, True)))}."
        )
    if device is None:
        return {k: out.get(k)[idx] for k in keys}
    rows = idx.to(device)  # one copy back per key, of the rows that are answered
    return {k: out.get(k)[rows].cpu() for k in keys}

def rebuilds_of(pool: Optional[AsyncEnvPool]) -> int:
    """Envs ``pool`` rebuilt in its workers (0 when it never started or cannot tell)."""
    if pool is None:
        return 0
    try:
        return sum(count for count, _ in pool.restart_info().values())
    except Exception:  # noqa: BLE001 - a count for the budget, never a reason to fail
        return 0

def kill_workers_of(pool: AsyncEnvPool, slots) -> None:
    """SIGKILLs the worker processes hosting env ``slots`` of ``pool`` (ignores gone ones)."""
    for w in sorted({pool.slot_workers[s] for s in slots}):
        try:
            os.kill(pool.worker_pids[w], signal.SIGKILL)
        except ProcessLookupError:
            pass


def _missing_inputs(policy, td, exc: Exception) -> Exception:
    """``exc``, or, when ``policy`` declares ``in_keys`` the batch ``td`` lacks (a policy that
    reads a key the env does not have fails with whatever reading ``None`` raises), the
    ``ValueError`` naming them, caused by ``exc``."""
    error = unread_keys_error(policy, set(td.keys(True, True)))
    if error is None:
        return exc
    error.__cause__ = exc
    return error
