"""``evaluate``: runs a fixed set of episodes on an :class:`~torchrl_asyncpool.AsyncEnvPool`.

This module is the supervisor (pools one after another: retries, reruns, isolation, the restart
budget); one pool's share of the episodes, served as the collector serves its policy, is
:class:`~torchrl_asyncpool.evaluation.episode_run.EpisodeRun`.

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
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence

import torch
from torchrl.envs.utils import ExplorationType

from torchrl_asyncpool.collector.acting_policy import ActingPolicy
from torchrl_asyncpool.errors import EnvError, PoolStartCancelled, WorkerDiedError, error_summary
from torchrl_asyncpool.evaluation.episode_run import (
    EpisodeRun,
    PolicyFailure,
    PoolRestart,
    kill_workers_of,
    rebuilds_of,
)
from torchrl_asyncpool.evaluation.episodes import (
    Episode,
    EpisodeResult,
    PlannedEnvFactory,
    PlanProgress,
    check_episode_set,
    summarize,
)
from torchrl_asyncpool.pool.env_pool import AsyncEnvPool, close_noting
from torchrl_asyncpool.pool.layout import SPEC_ENV_WHERE
from torchrl_asyncpool.pool.plan import PoolPlan, restart_policy

__all__ = ["EvaluationError", "EvaluationInterrupted", "evaluate", "resolve_policy_device"]


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
        SetupRefused: ``create_env_fn`` returned a vector or batched env, or a remote env slot
            (a ``TypeError``).

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
    settings = _Settings(create_env_fn, create_env_kwargs, num_envs, episode_timeout_s, envs_per_worker, env_threads,
                         recurrent_state, policy_output_spec, stop, resolve_policy_device(policy, device),
                         close_timeout_s, on_env_failure, max_restarts_per_env, restart_window_s, max_restarts)
    import tqdm

    limits = [ep.max_steps if ep.max_steps is not None else max_steps for ep in episodes]
    with tqdm.tqdm(total=len(episodes), unit="episode", disable=not progress, dynamic_ncols=True) as bar:
        supervisor = _Supervisor(episodes, limits, ActingPolicy(policy, exploration_type), settings, bar, progress)
        return supervisor.run()


@dataclass(frozen=True)
class _Settings:
    """What :func:`evaluate` was asked, as its :class:`_Supervisor` builds each pool from it."""

    create_env_fn: Callable
    create_env_kwargs: Optional[dict]
    num_envs: int
    episode_timeout_s: Optional[float]
    envs_per_worker: int | str
    env_threads: bool | str
    recurrent_state: Optional[Mapping]
    policy_output_spec: Optional[Mapping]
    stop: Optional[threading.Event]
    device: torch.device
    close_timeout_s: float
    on_env_failure: str
    max_restarts_per_env: int
    restart_window_s: float
    max_restarts: Optional[int]


class _Supervisor:
    """Runs an evaluation's episodes on as many pools as it takes: each pool's share is an
    :class:`~torchrl_asyncpool.evaluation.episode_run.EpisodeRun`; between pools the supervisor
    keeps the results, spends the restart budget, reruns the episodes a closed pool cut and
    isolates envs (one per process) after a worker of several died.

    Args:
        episodes (list of Episode): the evaluation's episodes, in order.
        limits (list): each episode's step limit (``None``: none).
        acting (ActingPolicy): the policy as the episode runs call it.
        settings (_Settings): the rest of :func:`evaluate`'s arguments.
        bar (tqdm.tqdm): the progress bar (disabled without ``progress``).
        progress (bool): whether the bar is shown (its summary is drawn only then).
    """

    def __init__(self, episodes, limits, acting, settings: _Settings, bar, progress: bool):
        self.episodes, self.limits, self.acting, self.settings = episodes, limits, acting, settings
        self.bar, self.progress = bar, progress
        self.results: List[Optional[EpisodeResult]] = [None] * len(episodes)
        self.rebuilt = 0  # envs rebuilt in their workers so far (on_env_failure="restart"), all pools together
        self.run_: Optional[EpisodeRun] = None  # the current pool's share

    # -- results and the bar ----------------------------------------------------------------
    def show(self, done: int) -> None:
        """``done`` more results on the bar, and the summary of all of them, drawn once."""
        if not self.progress:
            self.bar.update(done)
            return
        s = summarize([r for r in self.results if r is not None])
        restarts = self.rebuilt + (self.run_.rebuilt if self.run_ is not None else 0)
        extra = {"restarts": restarts} if restarts else {}
        self.bar.set_postfix(mean_return=s["mean_return"], failed=s["failed"], timeout=s["timeout"], **extra,
                             refresh=False)
        self.bar.update(done)  # draws the bar (at most every 0.1 s: tqdm's mininterval)

    def finish(self, i: int, result: EpisodeResult) -> None:
        self.results[i] = result
        self.show(1)

    def fail_unstarted(self, error: str) -> None:
        """Every episode without a result fails with ``error`` (it never started). One update of
        the bar for all of them: thousands of redraws (and summaries) made a Ctrl-C's exit take
        seconds."""
        todo = [i for i, r in enumerate(self.results) if r is None]
        for i in todo:
            self.results[i] = EpisodeResult(self.episodes[i].episode_id, "failed", seed=self.episodes[i].seed,
                                            error=error)
        if todo:
            self.show(len(todo))
            self.bar.refresh()

    # -- the evaluation ---------------------------------------------------------------------
    def run(self) -> List[EpisodeResult]:
        """Runs pools until every episode has its result (or a drain leaves none to start)."""
        stop = self.settings.stop
        try:
            isolate = False  # after a worker died hosting several running episodes: one env per process
            # the episodes that were running when the last pool closed (a failure or timeout elsewhere):
            # a drain still owes them their end, so they run again from their start even once stopped
            rerun: List[int] = []
            while True:
                draining = stop is not None and stop.is_set()
                todo = [i for i in (rerun if draining else range(len(self.episodes))) if self.results[i] is None]
                if not todo:
                    break
                rerun, isolate = self._one_pool(todo, draining, isolate)
            self.fail_unstarted("not started: the evaluation was stopped")  # drained: these never started
        except KeyboardInterrupt as exc:  # an abort: the pool is closed already (finally), results are kept
            if isinstance(exc, EvaluationInterrupted):
                raise
            raise self._aborted(exc) from exc
        return self.results  # type: ignore[return-value]

    def _one_pool(self, todo: List[int], draining: bool, isolate: bool):
        """Runs the episodes ``todo`` on one pool (round robin over its slots); returns the
        episodes to run again (cut by the pool's close) and whether to isolate envs from now on."""
        st = self.settings
        n = min(st.num_envs, len(todo))
        queues = [deque(todo[s::n]) for s in range(n)]
        # restarts while the evaluation's budget lasts; past it, a failure closes the pool (as "new_pool")
        restarts_left = None if st.max_restarts is None else st.max_restarts - self.rebuilt
        restart = st.on_env_failure == "restart" and (restarts_left is None or restarts_left > 0)
        plan_progress = PlanProgress.create(n)
        fns = [PlannedEnvFactory(st.create_env_fn, [(self.episodes[i].seed, self.limits[i], self.episodes[i].options)
                                                    for i in q], progress=plan_progress.slot(s))
               for s, q in enumerate(queues)]
        run = self.run_ = EpisodeRun(self.episodes, self.limits, queues, self.acting, self.finish,
                                     st.episode_timeout_s, st.stop, st.device, committed=draining,
                                     progress=plan_progress, restarts=restart)
        run.begin(time.monotonic())
        restart_kw = dict(on_env_failure="restart", max_restarts_per_env=st.max_restarts_per_env,
                          restart_window_s=st.restart_window_s, max_restarts=restarts_left) if restart else {}
        pool = primary = None
        try:
            try:
                pool, isolate = self._start_pool(run, fns, isolate, restart_kw)
                if pool is not None:
                    isolate |= self._serve(run, pool, restart)
            except BaseException as exc:
                primary = exc
                if not isinstance(exc, Exception) or (pool is None and not any(r is not None for r in self.results)):
                    raise  # an abort (see run()), or the first pool could not be built: nothing ran
                primary = self._failed(exc, run)
                raise primary from (exc.__cause__ if isinstance(exc, PolicyFailure) else exc)
        finally:
            self._close(pool, plan_progress, primary, restart, run)
        # a dead worker of several envs: which one killed it is unknown
        return run.interrupted(), isolate or bool(run.deferred)

    def _start_pool(self, run: EpisodeRun, fns, isolate: bool, restart_kw: dict):
        """``(the pool, or None when its start failed in a way its episodes account for, isolate)``."""
        st = self.settings
        try:
            # the pool's own start-up plan (its checks and decisions), then the pool built from it
            plan = PoolPlan.build(fns, create_env_kwargs=st.create_env_kwargs,
                                  envs_per_worker=1 if isolate else st.envs_per_worker,
                                  env_threads=False if isolate else st.env_threads,
                                  recurrent_state=st.recurrent_state, policy_output_spec=st.policy_output_spec,
                                  pin_memory=st.device.type == "cuda", start_timeout=st.episode_timeout_s,
                                  **restart_kw)
            pool = AsyncEnvPool(plan=plan, cancel_start=run.start_abandoned)
        except PoolStartCancelled:  # drained while starting: its episodes did not start
            run.give_back_fresh()
        except EnvError as exc:
            if exc.where == SPEC_ENV_WHERE and exc.__cause__ is not None:
                # the env built here for the specs is no episode's: its own error is raised, as documented
                raise exc.__cause__ from None
            run.fail(exc, all_remaining=exc.phase == "construction")
        except WorkerDiedError as exc:
            isolate |= run.died(exc)
        except TimeoutError as exc:  # an env's creation or first reset outlasted episode_timeout_s
            isolate |= run.start_timed_out(exc, one_env_per_worker=isolate or st.envs_per_worker == 1)
        else:
            return pool, isolate
        return None, isolate

    @staticmethod
    def _serve(run: EpisodeRun, pool: AsyncEnvPool, restart: bool) -> bool:
        """Runs ``run`` on ``pool`` until it is done or an env's failure ends the pool; returns
        whether envs are to be isolated (a worker of several running episodes died)."""
        run.clock_from(pool.workers_started_at)  # the spec env built before is no episode's
        try:
            run.drive(pool)
        except EnvError as exc:
            run.fail(exc, pool=pool if restart else None)
        except WorkerDiedError as exc:
            return run.died(exc)
        except PoolRestart as exc:
            # a worker stuck in a step or reset never reads its life pipe: close() would spend its
            # whole grace on it, and the other workers' envs deserve that time
            kill_workers_of(pool, exc.slots)
        return False

    def _close(self, pool, plan_progress: PlanProgress, primary, restart: bool, run: EpisodeRun) -> None:
        """Closes ``pool`` (``primary``: the error propagating, if any) and counts its rebuilds."""
        self.rebuilt += rebuilds_of(pool) if restart else 0
        run.rebuilt = 0
        # an abort (a KeyboardInterrupt: a second Ctrl-C) is not the moment to wait for envs to close
        timeout = self.settings.close_timeout_s
        grace = timeout if primary is None or isinstance(primary, Exception) else 1.0
        try:
            close_noting(pool, min(grace, timeout), primary)
        finally:
            plan_progress.remove()

    def _failed(self, exc: Exception, run: EpisodeRun) -> "EvaluationError":
        """The evaluation itself failed with ``exc``: the running and unstarted episodes fail with
        its cause; returns the :class:`EvaluationError` that carries every result."""
        cause = _describe_failure(exc).rstrip(".")  # a sentence follows it
        done = sum(r is not None for r in self.results)
        run.abandon(f"did not finish: the evaluation failed: {cause}", f"not started: the evaluation failed: {cause}")
        self.fail_unstarted(f"not started: the evaluation failed: {cause}")
        return EvaluationError(
            f"evaluate(): the evaluation failed: {cause}. {done} of {len(self.episodes)} episodes had ended; every "
            "result (the others failed with this cause) is in this error's .results.", list(self.results))

    def _aborted(self, exc: KeyboardInterrupt) -> "EvaluationInterrupted":
        """A ``KeyboardInterrupt`` aborted the evaluation (its pool is closed): the running
        episodes fail (their return and length so far), the others are not started."""
        done = sum(r is not None for r in self.results)
        if self.run_ is not None:
            self.run_.abandon("did not finish: the evaluation was aborted", "not started: the evaluation was aborted",
                              ended=lambda i: self.results[i] is not None)
        self.fail_unstarted("not started: the evaluation was aborted")
        return EvaluationInterrupted(
            f"evaluate(): aborted by {type(exc).__name__}; {done} of {len(self.episodes)} episodes had ended; every "
            "result (the others failed: 'did not finish' or 'not started') is in this error's .results.",
            list(self.results))


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


def _describe_failure(exc: BaseException) -> str:
    """One line naming what made the evaluation fail (the policy's error, or ``exc``)."""
    if isinstance(exc, PolicyFailure):
        return f"the policy failed: {error_summary(exc.__cause__)}"
    return error_summary(exc)


def _check_restarts(on_env_failure, per_env, window_s, total) -> None:
    """Refuses (``ValueError``) bad values of evaluate()'s restart arguments before anything starts:
    its own ``on_env_failure`` words, and the budget by the pool's rule (the function each pool's
    plan checks it with)."""
    if on_env_failure not in ("restart", "new_pool"):
        raise ValueError(f"on_env_failure must be 'restart' or 'new_pool', got {on_env_failure!r}.")
    restart_policy("restart", per_env, window_s, total)


