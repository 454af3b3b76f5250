"""``evaluate``: runs a fixed set of episodes on an :class:`~torchrl_asyncpool.AsyncEnvPool`.

Each slot of the pool gets a fixed share of the episodes (round robin over the manifest) and
runs them in order: the worker resets its env with the next episode's seed when the previous
episode ends (worker-owned autoreset, see :doc:`/episodes`), so consecutive episodes of a slot
never wait for the driver. The policy is called on whatever records are ready, as in training.

A failure is the failing episode's, not the run's: an env that raises while resetting for an
episode or stepping it marks that episode ``"failed"`` (with the worker's traceback). With
``on_env_failure="restart"`` (the default) the pool's restart machinery rebuilds that env in its
worker and its slot goes on with its next planned episodes, with their own seeds (each reset
notes in a :class:`~torchrl_asyncpool.evaluation.episodes.PlanProgress` file which planned
episode it starts; a rebuilt env gets the rest of its slot's plan), so nothing else stops;
past the restart budget, or with ``"new_pool"``, the pool is closed and the episodes that were
still running are run again from their start on a new pool (their seeds make the rerun
identical). An episode past ``episode_timeout_s`` (a hung simulator) is marked ``"timeout"``
and its pool closed the same way. A worker that dies (killed, a crash in native code) fails the
episode it was running; if it hosted several running episodes, they are run again with one env
per process (after the pool's other episodes, when the pool replaced the dead worker), so that a
second death names the culprit.

A failure of the evaluation itself (the policy raises) raises :class:`EvaluationError`, which
carries every result: the finished episodes' as they ended, the others failed with the cause.

Stopping: setting ``stop`` drains (the running episodes finish, no new one starts; a pool that
is still starting is abandoned at once, its episodes not started); a ``KeyboardInterrupt``
(Ctrl-C without a drain handler, or ``torchrl-asyncpool eval``'s second Ctrl-C) aborts: the pool
is closed at once and :class:`EvaluationInterrupted`, a ``KeyboardInterrupt``, carries every
result.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import deque
from typing import Callable, List, Mapping, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.envs.utils import ExplorationType

from torchrl_asyncpool.collector.acting_policy import ActingPolicy
from torchrl_asyncpool.errors import EnvError, PoolStartCancelled, WorkerDiedError
from torchrl_asyncpool.evaluation.episodes import (
    Episode,
    EpisodeResult,
    PlannedEnvFactory,
    PlanProgress,
    check_episode_set,
    summarize,
)
from torchrl_asyncpool.pool.env_pool import AsyncEnvPool, close_noting
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.workers.record_writer import RESTARTED_KEY
from torchrl_asyncpool.workers.restarts import check_restart_budget

__all__ = ["EvaluationError", "EvaluationInterrupted", "evaluate", "resolve_policy_device"]

_FIRST, _TERM, _TRUNC = int(StepType.FIRST), int(StepType.TERMINATION), int(StepType.TRUNCATION)
#: the phase ``pool.restart_info()`` gives the rebuilds that replaced a dead worker process
_WORKER_DIED = "worker"
#: how long one wait for records lasts before wall-clock limits are looked at again
_POLL_S = 0.1


class _Restart(Exception):
    """The pool must be rebuilt: the episodes of env ``slots`` timed out on the wall clock (their
    envs may hang in a step or reset)."""

    def __init__(self, slots):
        super().__init__(slots)
        self.slots = list(slots)


class _PolicyFailure(Exception):
    """The policy raised, or its output could not be sent as the actions (``__cause__``)."""


class _CarriesResults:
    """What the two exceptions of a failed or aborted evaluation share: every episode's result."""

    def __init__(self, message: str, results: Sequence[EpisodeResult]):
        super().__init__(message)
        self.results = list(results)


class EvaluationError(_CarriesResults, RuntimeError):
    """The evaluation itself failed, not one of its episodes: the policy raised or wrote no
    action, or the env pool could not be rebuilt after an episode's failure.

    Nothing that was finished is lost: :attr:`results` holds one result per episode, in order;
    those that ended before the failure as they ended, the others ``"failed"`` with the cause
    (``"did not finish: the evaluation failed: ..."`` for the running ones, ``"not started:
    the evaluation failed: ..."`` for the rest). The original error is ``__cause__``.

    Attributes
    ----------
    results : list of EpisodeResult
        One per episode, in the order given to :func:`evaluate`.
    """



class EvaluationInterrupted(_CarriesResults, KeyboardInterrupt):
    """The evaluation was aborted by a ``KeyboardInterrupt`` (a Ctrl-C; with
    ``torchrl-asyncpool eval``, the second one, the first drains): the pool was closed without
    waiting for the running episodes, and nothing that was finished is lost.

    It is a ``KeyboardInterrupt``, so code that catches that still does. :attr:`results` holds
    one result per episode, in order: those that ended before the abort as they ended, the
    running ones ``"failed"`` with the error ``"did not finish: the evaluation was aborted"``
    (their return and length so far), the others (a drain's unstarted ones too) ``"failed"``
    with ``"not started: the evaluation was aborted"``. The original ``KeyboardInterrupt`` is
    ``__cause__``.

    Attributes
    ----------
    results : list of EpisodeResult
        One per episode, in the order given to :func:`evaluate`.
    """


def evaluate(
    create_env_fn: Callable,
    policy: Callable,
    episodes: Sequence[Episode],
    *,
    num_envs: int = 8,
    max_steps: Optional[int] = None,
    episode_timeout_s: Optional[float] = None,
    envs_per_worker: int | str = "auto",
    env_threads: bool | str = "auto",
    exploration_type: ExplorationType = ExplorationType.DETERMINISTIC,
    create_env_kwargs: Optional[dict] = None,
    recurrent_state: Optional[Mapping] = None,
    policy_output_spec: Optional[Mapping] = None,
    stop: Optional[threading.Event] = None,
    progress: bool = False,
    device: torch.device | str | None = None,
    close_timeout_s: float = 10.0,
    on_env_failure: str = "restart",
    max_restarts_per_env: int = 3,
    restart_window_s: float = 60.0,
    max_restarts: Optional[int] = 100,
) -> List[EpisodeResult]:
    """Runs every episode once and returns their results in the order given.

    Args:
        create_env_fn (callable): builds one env (a TorchRL ``EnvBase`` with an empty batch
            size, or a ``gymnasium.Env``); called once per slot, in the workers.
        policy (callable): ``TensorDict -> TensorDict`` writing the action keys, called in this
            process on batches of ready records (on ``device``), under ``torch.no_grad()``.
        episodes (sequence of Episode): the set to run; ids must be unique.

    Keyword Args:
        num_envs (int): envs run at once (at most one per episode). Defaults to 8.
        max_steps (int, optional): step limit of episodes that set none: an episode still
            running after that many steps is cut (``"timeout"``); one the env ends itself at
            that very step (terminated, or truncated by its own time limit, e.g. HalfCheetah's
            1,000 steps with ``max_steps=1000``) is ``"completed"``.
        episode_timeout_s (float, optional): wall-clock limit per episode (``"timeout"``),
            counted from the moment its env starts being built (a slot's first episode) or
            reset for it (the next ones): a creation or reset that hangs times out too.
        envs_per_worker (int or "auto", optional): envs hosted by one worker process, as in
            :class:`~torchrl_asyncpool.AsyncEnvPool`. Defaults to ``"auto"``: chosen from the
            env's measured step cost and the cores.
        env_threads (bool or "auto", optional): step each env of a worker in its own thread,
            as in :class:`~torchrl_asyncpool.AsyncEnvPool`. Defaults to ``"auto"``.
        exploration_type (ExplorationType): under which the policy acts. Defaults to
            ``DETERMINISTIC``.
        create_env_kwargs (dict, optional): keyword arguments for ``create_env_fn``.
        recurrent_state (mapping, optional): ``{hidden_in_key: hidden_out_key}`` for a
            recurrent policy, as in :class:`~torchrl_asyncpool.AsyncEnvPool`: every record
            carries ``hidden_in_key`` (zeros at the start of each episode, then the
            ``hidden_out_key`` the policy wrote for the previous step of the same env), so the
            policy stays a pure function of the batch. ``hidden_out_key`` must be declared in
            ``policy_output_spec``.
        policy_output_spec (mapping, optional): ``{key: (shape, dtype)}`` of the policy outputs
            to carry besides the actions (the recurrent state out).
        stop (threading.Event, optional): a graceful drain: once it is set, the episodes
            already running finish, no new one starts, and every episode that did not start
            is reported ``"failed"`` with the error ``"not started: the evaluation was stopped"``
            (results stay one per episode, in order). An episode whose env is still being
            built or reset has not started: a pool that is starting when ``stop`` is set is
            abandoned within a tenth of a second (the spec env, built in this process first,
            and the fork server's first start, a few seconds once per process, are waited
            for), closed (its workers get a second, then are killed) and its
            episodes are reported not started. A running episode whose pool has to close during
            the drain (another slot's failure or timeout) runs again from its start on a new
            pool, as without a drain. Set it from another thread or a signal handler
            (``torchrl-asyncpool eval`` sets it on the first Ctrl-C or SIGTERM; the second one
            aborts, see :class:`~torchrl_asyncpool.evaluation.EvaluationInterrupted`).
        progress (bool): show a progress bar of finished episodes.
        device (str or torch.device, optional): where the policy runs: each batch is copied
            there (from pinned memory, without blocking, when it is a CUDA device) and the
            policy's outputs are copied back. Defaults to ``None``: the device of the policy's
            parameters when it is a ``torch.nn.Module`` that has any, else the CPU.
        close_timeout_s (float): seconds the workers get to close their envs each time a pool
            is closed, before they are killed (a worker whose env hung is killed at once).
            Defaults to ``10.0``: a simulator may take seconds to shut down its own processes.
        on_env_failure (str): what an env that raises (in a reset or a step) costs besides its
            episode, which is ``"failed"`` either way. ``"restart"`` (default): the env is
            rebuilt in its worker (:class:`~torchrl_asyncpool.AsyncEnvPool`'s
            ``on_env_failure="restart"``) and its slot goes on with its next planned episodes,
            with their own seeds; the other envs never stop, and a worker process that dies is
            replaced the same way. ``"new_pool"``: the pool is closed and the episodes that were
            running run again from their start on a new pool (what happens past the budget too).
            The results are the same (same seeds); only the time differs.
        max_restarts_per_env (int): env rebuilds allowed per env within ``restart_window_s``
            (default 3 in 60 s); one more failure is handled as with ``"new_pool"``.
        restart_window_s (float): the window of ``max_restarts_per_env``, in seconds.
        max_restarts (int or None): env rebuilds allowed over the whole evaluation, all envs
            and pools together. Defaults to ``100``; ``None``: no cap; ``0``: as ``"new_pool"``.
            Once spent, failures are handled as with ``"new_pool"``.

    Returns:
        list of :class:`~torchrl_asyncpool.evaluation.EpisodeResult`, one per episode, in order.

    Raises:
        EvaluationError: the evaluation itself failed (the policy raised, or its output lacks an
            action key; a pool could not be rebuilt): its ``results`` keep every episode that
            ended, the others failed with the cause.
        EvaluationInterrupted: a ``KeyboardInterrupt`` (Ctrl-C under Python's own handler, or
            ``torchrl-asyncpool eval``'s second Ctrl-C) aborted the evaluation: the pool was
            closed at once (a second of grace) and its ``results`` keep every episode that
            ended, the running ones failed with ``"did not finish: the evaluation was
            aborted"``, the others with ``"not started: the evaluation was aborted"``. It is a
            ``KeyboardInterrupt``.
        Exception: what ``create_env_fn`` raised when the pool built its first env, in this
            process, to learn the specs (before any episode ran; nothing to report), and the
            ``ValueError``/``TypeError`` of bad arguments (``on_env_failure`` other than
            ``"restart"`` or ``"new_pool"``, a restart budget that is not a positive count).

    Examples:
        >>> import gymnasium as gym, torch
        >>> from torchrl_asyncpool.evaluation import Episode, evaluate
        >>> def push_left(td):
        ...     return td.set("action", torch.zeros(td.batch_size[0], dtype=torch.int64))
        >>> episodes = [Episode(f"cartpole-{i}", seed=i) for i in range(4)]
        >>> results = evaluate(lambda: gym.make("CartPole-v1"), push_left, episodes, num_envs=2)
        >>> [(r.episode_id, r.status) for r in results][:2]
        [('cartpole-0', 'completed'), ('cartpole-1', 'completed')]
        >>> results[0].length < 20  # always pushing left drops the pole quickly
        True
    """
    if not callable(create_env_fn):
        raise TypeError(f"create_env_fn must be callable, got {type(create_env_fn).__name__}.")
    if not callable(policy):
        raise TypeError(f"policy must be callable (TensorDict -> TensorDict), got {type(policy).__name__}.")
    episodes = check_episode_set(episodes, num_envs, "evaluate")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}.")
    if episode_timeout_s is not None and not (isinstance(episode_timeout_s, (int, float)) and
                                              0 < episode_timeout_s < math.inf):
        raise ValueError(f"episode_timeout_s must be None or a finite number > 0, got {episode_timeout_s!r}.")
    if not (isinstance(close_timeout_s, (int, float)) and 0 <= close_timeout_s < math.inf):
        raise ValueError(f"close_timeout_s must be a finite number >= 0, got {close_timeout_s!r}.")
    _check_restarts(on_env_failure, max_restarts_per_env, restart_window_s, max_restarts)
    device = resolve_policy_device(policy, device)
    import tqdm

    acting = ActingPolicy(policy, exploration_type)
    results: List[Optional[EpisodeResult]] = [None] * len(episodes)
    limits = [ep.max_steps if ep.max_steps is not None else max_steps for ep in episodes]
    with tqdm.tqdm(total=len(episodes), unit="episode", disable=not progress, dynamic_ncols=True) as bar:

        rebuilt = [0]  # envs rebuilt in their workers so far (on_env_failure="restart"), all pools together

        def show(done: int) -> None:
            """``done`` more results on the bar, and the summary of all of them, drawn once."""
            if not progress:
                bar.update(done)
                return
            s = summarize([r for r in results if r is not None])
            restarts = rebuilt[0] + (run.rebuilt if run is not None else 0)
            extra = {"restarts": restarts} if restarts else {}
            bar.set_postfix(mean_return=s["mean_return"], failed=s["failed"], timeout=s["timeout"], **extra,
                            refresh=False)
            bar.update(done)  # draws the bar (at most every 0.1 s: tqdm's mininterval)

        def finish(i: int, result: EpisodeResult) -> None:
            results[i] = result
            show(1)

        def fail_unstarted(error: str) -> None:
            """Every episode without a result fails with ``error`` (it never started). One update
            of the bar for all of them: thousands of redraws (and summaries) made a Ctrl-C's exit
            take seconds."""
            todo = [i for i, r in enumerate(results) if r is None]
            for i in todo:
                results[i] = EpisodeResult(episodes[i].episode_id, "failed", seed=episodes[i].seed, error=error)
            if todo:
                show(len(todo))
                bar.refresh()

        run: Optional[_Run] = None
        try:
            isolate = False  # after a worker died hosting several running episodes: one env per process
            # the episodes that were running when the last pool closed (a failure or timeout elsewhere):
            # a drain still owes them their end, so they run again from their start even once stopped
            rerun: List[int] = []
            while True:
                draining = stop is not None and stop.is_set()
                todo = [i for i in (rerun if draining else range(len(episodes))) if results[i] is None]
                if not todo:
                    break
                n = min(num_envs, len(todo))
                queues = [deque(todo[s::n]) for s in range(n)]
                # restarts while the evaluation's budget lasts; past it, a failure closes the pool (as "new_pool")
                restarts_left = None if max_restarts is None else max_restarts - rebuilt[0]
                restart = on_env_failure == "restart" and (restarts_left is None or restarts_left > 0)
                plan_progress = PlanProgress.create(n)
                fns = [PlannedEnvFactory(create_env_fn, [(episodes[i].seed, limits[i], episodes[i].options) for i in q],
                                         progress=plan_progress.slot(s))
                       for s, q in enumerate(queues)]
                run = _Run(episodes, limits, queues, acting, finish, episode_timeout_s, stop, device,
                           committed=draining, progress=plan_progress, restarts=restart)
                run.begin(time.monotonic())
                pool = None
                primary: Optional[BaseException] = None
                restart_kw = dict(on_env_failure="restart", max_restarts_per_env=max_restarts_per_env,
                                  restart_window_s=restart_window_s, max_restarts=restarts_left) if restart else {}
                try:
                    try:
                        pool = AsyncEnvPool(fns, cancel_start=run.start_abandoned, create_env_kwargs=create_env_kwargs,
                                            envs_per_worker=1 if isolate else envs_per_worker,
                                            env_threads=False if isolate else env_threads,
                                            recurrent_state=recurrent_state, policy_output_spec=policy_output_spec,
                                            pin_memory=device.type == "cuda", start_timeout=episode_timeout_s,
                                            **restart_kw)
                    except PoolStartCancelled:  # drained while starting: its episodes did not start
                        run.give_back_fresh()
                    except EnvError as exc:
                        run.fail(exc, all_remaining=exc.phase == "construction")
                    except WorkerDiedError as exc:
                        isolate |= run.died(exc)
                    except TimeoutError as exc:  # an env's creation or first reset outlasted episode_timeout_s
                        isolate |= run.start_timed_out(exc, one_env_per_worker=isolate or envs_per_worker == 1)
                    else:
                        run.clock_from(pool._workers_started_at)  # the spec env built before is no episode's
                        try:
                            run.drive(pool)
                        except EnvError as exc:
                            run.fail(exc, pool=pool if restart else None)
                        except WorkerDiedError as exc:
                            isolate |= run.died(exc)
                        except _Restart as exc:
                            # a worker stuck in a step or reset never reads its life pipe: close() would
                            # spend its whole grace on it, and the other workers' envs deserve that time
                            _kill_workers_of(pool, exc.slots)
                except BaseException as exc:
                    primary = exc
                    if not isinstance(exc, Exception) or (pool is None and not any(r is not None for r in results)):
                        raise  # an abort (the outer except), or the first pool could not be built: nothing ran
                    cause = _describe_failure(exc)
                    done = sum(r is not None for r in results)
                    run.abandon(f"did not finish: the evaluation failed: {cause}",
                                f"not started: the evaluation failed: {cause}")
                    fail_unstarted(f"not started: the evaluation failed: {cause}")
                    primary = EvaluationError(
                        f"evaluate(): the evaluation failed: {cause}. {done} of {len(episodes)} episodes had ended; "
                        "every result (the others failed with this cause) is in this error's .results.", list(results))
                    raise primary from (exc.__cause__ if isinstance(exc, _PolicyFailure) else exc)
                finally:
                    rebuilt[0] += _rebuilds_of(pool) if restart else 0
                    run.rebuilt = 0
                    # an abort (a KeyboardInterrupt: a second Ctrl-C) is not the moment to wait for envs to close
                    grace = close_timeout_s if primary is None or isinstance(primary, Exception) else 1.0
                    try:
                        close_noting(pool, min(grace, close_timeout_s), primary)
                    finally:
                        plan_progress.remove()
                rerun = run.interrupted()
                isolate |= bool(run.deferred)  # a dead worker of several envs: which one killed it is unknown
            fail_unstarted("not started: the evaluation was stopped")  # drained: these never started
        except KeyboardInterrupt as exc:  # an abort: the pool is closed already (finally), results are kept
            if isinstance(exc, EvaluationInterrupted):
                raise
            done = sum(r is not None for r in results)
            if run is not None:  # the running episodes' return and length so far
                run.abandon("did not finish: the evaluation was aborted", "not started: the evaluation was aborted",
                            ended=lambda i: results[i] is not None)
            fail_unstarted("not started: the evaluation was aborted")
            raise EvaluationInterrupted(
                f"evaluate(): aborted by {type(exc).__name__}; {done} of {len(episodes)} episodes had ended; every "
                "result (the others failed: 'did not finish' or 'not started') is in this error's .results.",
                list(results)) from exc
    return results  # type: ignore[return-value]


def resolve_policy_device(policy, device=None) -> torch.device:
    """The device :func:`~torchrl_asyncpool.evaluation.evaluate` runs ``policy`` on: ``device``
    checked (``ValueError`` for a bad name, a device other than CPU or CUDA, or CUDA where there
    is none), or when ``None`` the device of the policy's first parameter (the CPU when it has
    none).

    Examples:
        >>> import torch
        >>> from torchrl_asyncpool.evaluation.runner import resolve_policy_device
        >>> resolve_policy_device(torch.nn.Linear(4, 2))
        device(type='cpu')
        >>> resolve_policy_device(lambda td: td, "cpu")
        device(type='cpu')
    """
    if device is None:
        first = next(policy.parameters(), None) if isinstance(policy, torch.nn.Module) else None
        return first.device if first is not None else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must name a torch device (e.g. 'cpu', 'cuda:0'), got {device!r}.") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but CUDA is not available in this process.")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {str(device)!r}.")
    return device


class _Run:
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
        workers = np.asarray(pool._slot_worker)
        self.hosted = np.bincount(workers)[workers].tolist()
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
            if not answer.any():
                continue
            idx = torch.from_numpy(np.flatnonzero(answer))
            try:
                with torch.no_grad():
                    out = self.acting(td if self.device is None else td.to(self.device, non_blocking=True))
                actions = _answers(out, keys, idx, self.device)
                pool.send(actions, td.env_indices[idx])  # ValueError: wrong shapes or dtypes, nothing sent
            except (EnvError, WorkerDiedError):
                raise
            except Exception as exc:
                raise _PolicyFailure() from exc

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
            raise _Restart(late)

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


def _answers(out, keys, idx, device) -> dict:
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


def _describe_failure(exc: BaseException) -> str:
    """One line naming what made the evaluation fail (the policy's error, or ``exc``)."""
    if isinstance(exc, _PolicyFailure):
        cause = exc.__cause__
        return f"the policy failed: {type(cause).__name__}: {_first_line(cause)}"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _check_restarts(on_env_failure, per_env, window_s, total) -> None:
    """Refuses (``ValueError``) bad values of evaluate()'s restart arguments before anything starts."""
    if on_env_failure not in ("restart", "new_pool"):
        raise ValueError(f"on_env_failure must be 'restart' or 'new_pool', got {on_env_failure!r}.")
    check_restart_budget(per_env, window_s, total)


def _rebuilds_of(pool: Optional[AsyncEnvPool]) -> int:
    """Envs ``pool`` rebuilt in its workers (0 when it never started or cannot tell)."""
    if pool is None:
        return 0
    try:
        return sum(count for count, _ in pool.restart_info().values())
    except Exception:  # noqa: BLE001 - a count for the budget, never a reason to fail
        return 0


def _kill_workers_of(pool: AsyncEnvPool, slots) -> None:
    """SIGKILLs the worker processes hosting env ``slots`` of ``pool`` (ignores gone ones)."""
    for w in sorted({int(pool._slot_worker[s]) for s in slots}):
        try:
            os.kill(pool.worker_pids[w], signal.SIGKILL)
        except ProcessLookupError:
            pass


