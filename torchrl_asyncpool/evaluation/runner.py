"""``evaluate``: runs a fixed set of episodes on an :class:`~torchrl_asyncpool.AsyncEnvPool`.

Each slot of the pool gets a fixed share of the episodes (round robin over the manifest) and
runs them in order: the worker resets its env with the next episode's seed when the previous
episode ends (worker-owned autoreset, see :doc:`/episodes`), so consecutive episodes of a slot
never wait for the driver. The policy is called on whatever records are ready, as in training.

A failure is the failing episode's, not the run's: an env that raises while resetting for an
episode or stepping it marks that episode ``"failed"`` (with the worker's traceback), the pool
is closed, and the episodes that were still running are run again from their start on a new
pool (their seeds make the rerun identical). An episode past ``episode_timeout_s`` (a hung
simulator) is marked ``"timeout"`` the same way. A worker that dies (killed, a crash in native
code) fails the episode it was running; if it hosted several running episodes, they are run
again with one env per process from then on, so that a second death names the culprit.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, List, Mapping, Optional, Sequence

import numpy as np
import torch
from torchrl.envs.utils import ExplorationType

from torchrl_asyncpool.acting_policy import ActingPolicy
from torchrl_asyncpool.errors import EnvError, WorkerDiedError
from torchrl_asyncpool.evaluation.episodes import (
    Episode,
    EpisodeResult,
    PlannedEnvFactory,
    check_episode_set,
    summarize,
)
from torchrl_asyncpool.pool import AsyncEnvPool
from torchrl_asyncpool.step_type import StepType

__all__ = ["evaluate", "resolve_policy_device"]

_FIRST, _TERM, _TRUNC = int(StepType.FIRST), int(StepType.TERMINATION), int(StepType.TRUNCATION)
#: how long one wait for records lasts before wall-clock limits are looked at again
_POLL_S = 0.1


class _Restart(Exception):
    """The pool must be rebuilt (an episode timed out on the wall clock: its env may hang)."""


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
        max_steps (int, optional): step limit of episodes that set none (``"timeout"``).
        episode_timeout_s (float, optional): wall-clock limit per episode (``"timeout"``).
        envs_per_worker, env_threads: grouping of the envs in worker processes, as in
            :class:`~torchrl_asyncpool.AsyncEnvPool` (``"auto"``: chosen from the env's
            measured step cost and the cores).
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
            (results stay one per episode, in order). Set it from another thread or a signal
            handler (``torchrl-asyncpool eval`` sets it on the first Ctrl-C).
        progress (bool): show a progress bar of finished episodes.
        device (str or torch.device, optional): where the policy runs: each batch is copied
            there (from pinned memory, without blocking, when it is a CUDA device) and the
            policy's outputs are copied back. Defaults to ``None``: the device of the policy's
            parameters when it is a ``torch.nn.Module`` that has any, else the CPU.

    Returns:
        list of :class:`~torchrl_asyncpool.evaluation.EpisodeResult`, one per episode, in order.

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
    if episode_timeout_s is not None and not episode_timeout_s > 0:
        raise ValueError(f"episode_timeout_s must be None or > 0, got {episode_timeout_s!r}.")
    device = resolve_policy_device(policy, device)
    import tqdm

    acting = ActingPolicy(policy, exploration_type)
    results: List[Optional[EpisodeResult]] = [None] * len(episodes)
    limits = [ep.max_steps if ep.max_steps is not None else max_steps for ep in episodes]
    with tqdm.tqdm(total=len(episodes), unit="episode", disable=not progress, dynamic_ncols=True) as bar:

        def finish(i: int, result: EpisodeResult) -> None:
            results[i] = result
            bar.update(1)
            if progress:
                s = summarize([r for r in results if r is not None])
                bar.set_postfix(mean_return=s["mean_return"], failed=s["failed"], timeout=s["timeout"])

        todo = list(range(len(episodes)))
        isolate = False  # after a worker died hosting several running episodes: one env per process
        while todo and not (stop is not None and stop.is_set()):
            n = min(num_envs, len(todo))
            queues = [deque(todo[s::n]) for s in range(n)]
            fns = [PlannedEnvFactory(create_env_fn, [(episodes[i].seed, limits[i], episodes[i].options) for i in q])
                   for q in queues]
            run = _Run(episodes, limits, queues, acting, finish, episode_timeout_s, stop, device)
            try:
                pool = AsyncEnvPool(fns, create_env_kwargs=create_env_kwargs,
                                    envs_per_worker=1 if isolate else envs_per_worker,
                                    env_threads=False if isolate else env_threads,
                                    recurrent_state=recurrent_state, policy_output_spec=policy_output_spec,
                                    pin_memory=device.type == "cuda")
            except EnvError as exc:
                run.fail(exc, all_remaining=exc.phase == "construction", todo=todo)
            except WorkerDiedError as exc:
                isolate |= run.died(exc)
            else:
                try:
                    run.drive(pool)
                except EnvError as exc:
                    run.fail(exc)
                except WorkerDiedError as exc:
                    isolate |= run.died(exc)
                except _Restart:
                    pass
                finally:
                    pool.close()
            todo = [i for i in todo if results[i] is None]
        for i in todo:  # drained: these never started
            finish(i, EpisodeResult(episodes[i].episode_id, "failed", seed=episodes[i].seed,
                                    error="not started: the evaluation was stopped"))
    return results  # type: ignore[return-value]


def resolve_policy_device(policy, device=None) -> torch.device:
    """The device :func:`evaluate` runs ``policy`` on: ``device`` checked (``ValueError`` for
    a bad name, a device other than CPU or CUDA, or CUDA where there is none), or when ``None``
    the device of the policy's first parameter (the CPU when it has none).

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
    """One pool's share of an evaluation: which episode each slot runs, and their sums."""

    def __init__(self, episodes, limits, queues, acting, finish, timeout_s, stop=None, device=None):
        self.episodes, self.limits, self.queues = episodes, limits, queues
        self.acting, self.finish, self.timeout_s = acting, finish, timeout_s
        self.stop = stop
        self.device = None if device is None or device.type == "cpu" else device
        n = len(queues)
        self.current: List[Optional[int]] = [None] * n  # manifest index each slot is running
        self.ret = np.zeros(n)
        self.length = np.zeros(n, dtype=np.int64)
        self.started = np.zeros(n)

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

    def drive(self, pool: AsyncEnvPool) -> None:
        """Runs until every slot has finished its episodes (or, once ``stop`` is set, its
        running episode)."""
        poll = None if self.timeout_s is None and self.stop is None else _POLL_S
        while any(c is not None for c in self.current) or (any(self.queues) and not self._stopping()):
            if pool.wait_ready(1, timeout=poll) == 0:
                self._check_clock()
                continue
            td = pool.recv(min_get=1)  # everything ready now, at once
            answer = self._observe(td)
            self._check_clock()
            if answer.any():
                with torch.no_grad():
                    out = self.acting(td if self.device is None else td.to(self.device, non_blocking=True))
                idx = torch.from_numpy(np.flatnonzero(answer))
                keys = pool.action_keys + pool.policy_output_keys
                if self.device is None:
                    actions = {k: out.get(k)[idx] for k in keys}
                else:  # one copy back per key, of the rows that are answered
                    rows = idx.to(self.device)
                    actions = {k: out.get(k)[rows].cpu() for k in keys}
                pool.send(actions, td.env_indices[idx])

    def _observe(self, td) -> np.ndarray:
        """Books the batch's records; returns which rows to answer (their slot has work left)."""
        slots = td.env_indices.tolist()
        step_types = td["step_type"].tolist()
        rewards = td["reward"].reshape(len(slots), -1).sum(-1).tolist()
        answer = np.zeros(len(slots), dtype=bool)
        now = time.monotonic()
        stopping = self._stopping()
        for row, (s, st, r) in enumerate(zip(slots, step_types, rewards)):
            if st == _FIRST:
                if stopping:  # drained: the slot's next episode does not start
                    continue
                self.current[s] = self.queues[s].popleft()
                self.ret[s], self.length[s], self.started[s] = 0.0, 0, now
            elif self.current[s] is not None:
                self.ret[s] += r
                self.length[s] += 1
                if st >= _TERM:
                    limit = self.limits[self.current[s]]
                    cut = st == _TRUNC and limit is not None and self.length[s] >= limit
                    error = f"cut after max_steps={limit} steps" if cut else None
                    self.finish(self.current[s], self._result(
                        s, "timeout" if cut else "completed", terminated=st == _TERM,
                        truncated=st == _TRUNC and not cut, error=error))
                    self.current[s] = None
            # a terminal record is answered only to start the slot's next episode
            answer[row] = self.current[s] is not None or (bool(self.queues[s]) and not stopping)
        return answer

    def _check_clock(self) -> None:
        if self.timeout_s is None:
            return
        now = time.monotonic()
        late = [s for s, i in enumerate(self.current) if i is not None and now - self.started[s] > self.timeout_s]
        for s in late:
            self.finish(self.current[s], self._result(
                s, "timeout", error=f"ran longer than episode_timeout_s={self.timeout_s} s (wall clock)"))
            self.current[s] = None
        if late:  # the env may hang in its step: only closing the pool gets it back
            raise _Restart

    def died(self, exc: WorkerDiedError) -> bool:
        """A worker died (killed, crashed in native code): fails the episode it was running if
        it ran one; returns True when it ran several, which are then run again one env per
        process (the next death names the culprit)."""
        running = [(s, self.current[s]) for s in exc.env_indices if self.current[s] is not None]
        running += [(s, self.queues[s][0]) for s in exc.env_indices if self.current[s] is None and self.queues[s]]
        if len(running) != 1:
            return len(running) > 1
        s, i = running[0]
        error = f"its worker died: {exc}"
        self.finish(i, self._result(s, "failed", error=error) if self.current[s] == i else self._unstarted(i, error, s))
        return False

    def fail(self, exc: EnvError, all_remaining: bool = False, todo=()) -> None:
        """Marks the episode ``exc`` belongs to as failed (or every remaining one, when the env
        cannot be built at all: that does not depend on the episode)."""
        s = exc.env_index
        error = f"env raised during {exc.phase}:\n{exc.worker_traceback}"
        if all_remaining:
            for i in todo:
                self.finish(i, self._unstarted(i, error))
            return
        if exc.phase == "step" and self.current[s] is not None:
            self.finish(self.current[s], self._result(s, "failed", error=error))
            self.current[s] = None
        elif self.queues[s]:  # the reset that starts the slot's next episode failed
            i = self.queues[s][0]
            self.finish(i, self._unstarted(i, error, s))
