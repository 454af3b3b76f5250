"""The start-up plan of an :class:`~torchrl_asyncpool.AsyncEnvPool`: every decision the pool takes
before it builds anything, taken once, in one place.

:meth:`PoolPlan.build` checks the options (one function per concern, in
:mod:`~torchrl_asyncpool.pool.arguments`, :mod:`~torchrl_asyncpool.pool.seeding` and
:mod:`~torchrl_asyncpool.workers.restarts`), builds the spec env once
(:class:`~torchrl_asyncpool.pool.layout.SpecEnv`) to read the slot layout and, for
``envs_per_worker="auto"``, to time a few of its steps, then decides the grouping of envs into
workers (:mod:`~torchrl_asyncpool.pool.grouping`), the seeded factories, the workers' CPU masks
(:mod:`~torchrl_asyncpool._sys.affinity`), idle polling and the restart policy. The pool then only
builds what the plan says (arena, doorbells, workers). Start-up runs in one direction::

    options -> checks -> spec env -> layout, grouping (timed), seeding, affinity, idle poll -> PoolPlan
    PoolPlan -> AsyncEnvPool: arena, doorbells, chunk buffers, worker processes

A collector builds the spec env first (its policy's outputs are read from the same env) and hands
it to :meth:`PoolPlan.build`; :func:`~torchrl_asyncpool.evaluation.evaluate` builds each of its pools from a
plan as well, so the three share one set of rules. The plan says which values were given and which
were decided (``"auto"``), and what the start-up measured: ``repr``, :meth:`PoolPlan.describe`, a
debug log line (logger ``torchrl_asyncpool.pool.plan``), :attr:`AsyncEnvPool.plan
<torchrl_asyncpool.AsyncEnvPool.plan>` and the ``plan_*`` entries of
:meth:`AsyncEnvPool.metrics <torchrl_asyncpool.AsyncEnvPool.metrics>`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from torchrl_asyncpool._sys.affinity import resolve_worker_affinity
from torchrl_asyncpool.envs.specs import batched_specs, slot_specs
from torchrl_asyncpool.exchange.doorbell import resolve_idle_poll
from torchrl_asyncpool.exchange.native import resolve_exchange
from torchrl_asyncpool.pool.arguments import (
    _check_build_timeout,
    _check_process_options,
    _check_restart,
    _check_start_options,
    _check_step_timeout,
    check_factories,
    check_kwargs,
)
from torchrl_asyncpool.pool.grouping import _group_envs
from torchrl_asyncpool.pool.layout import SpecEnv, _slot_layout
from torchrl_asyncpool.pool.seeding import _check_seed, _seeded_factories

__all__ = ["PoolPlan", "OPTIONS", "restart_policy"]

_log = logging.getLogger(__name__)

#: the options whose ``"auto"`` (or callable) value the plan decides; :meth:`PoolPlan.describe`
#: says for each whether it was given or decided
_DECIDED = ("envs_per_worker", "env_threads", "worker_affinity", "idle_poll", "exchange",
            "transition_chunk_size", "build_timeout")

#: the options :meth:`PoolPlan.build` takes, with their defaults (those of
#: :class:`~torchrl_asyncpool.AsyncEnvPool`)
OPTIONS = {
    "create_env_kwargs": None, "envs_per_worker": 1, "env_threads": "auto", "mp_start_method": "forkserver",
    "worker_num_threads": 1, "pin_memory": False, "start_timeout": None, "policy_output_spec": None,
    "recurrent_state": None, "transition_chunk_size": None, "chunks_per_env": 2, "worker_affinity": None,
    "exchange": "auto", "seed": None, "idle_poll": "auto", "backend": "multiprocessing", "on_env_failure": "raise",
    "max_restarts_per_env": 3, "restart_window_s": 60.0, "max_restarts": 100, "step_timeout": None,
    "build_timeout": "auto",
}


def restart_policy(on_env_failure, max_restarts_per_env, restart_window_s, max_restarts):
    """The workers' :class:`~torchrl_asyncpool.workers.restarts.RestartPolicy` for
    ``on_env_failure="restart"``, ``None`` for ``"raise"``; a bad value raises ``ValueError``
    naming it. The one check of the restart options, shared by the pool and
    :func:`~torchrl_asyncpool.evaluation.evaluate`.

    Examples:
        >>> from torchrl_asyncpool.pool.plan import restart_policy
        >>> restart_policy("raise", 3, 60.0, 100) is None
        True
        >>> restart_policy("restart", 3, float("inf"), 0).total
        0
    """
    return _check_restart(on_env_failure, max_restarts_per_env, restart_window_s, max_restarts)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class PoolPlan:
    """What an :class:`~torchrl_asyncpool.AsyncEnvPool` decided at start-up, before building
    anything; built by :meth:`build` (see :mod:`~torchrl_asyncpool.pool.plan`).

    Pass it as ``AsyncEnvPool(plan=plan)``: the pool then builds exactly this (a plan may build
    several pools). Read it back with :attr:`AsyncEnvPool.plan <torchrl_asyncpool.AsyncEnvPool.plan>`.

    Attributes:
        create_env_fn (tuple): the factories the workers call (seeded when ``seed`` was given).
        create_env_kwargs (tuple): their keyword arguments, one dict per factory.
        num_envs (int): slots: factories times ``envs_per_factory``.
        envs_per_factory (int): envs one factory builds (``k`` for vector envs, else 1).
        groups (tuple): the slots of each worker.
        envs_per_worker (int): the most slots one worker hosts.
        env_threads (bool): whether each env of a worker steps in its own thread.
        worker_affinity (list or None): one CPU mask per worker, ``None``: not pinned.
        idle_poll (bool): whether the blocking waits idle-poll.
        exchange (str): ``"auto"``, ``"native"`` or ``"python"``.
        restart (RestartPolicy or None): the workers' restart budget (``on_env_failure="restart"``).
        layout (ArenaLayout): the slot layout.
        specs (dict): the envs' TorchRL specs (``full_*_spec``) at batch size ``[num_envs]``.
        transition_chunk_size (int or None): transitions per chunk, resolved (``None``: no delivery).
        measured (dict): what the start-up measured: ``spec_env_build_s``, ``record_bytes``, and,
            when the spec env was timed, ``probe_steps``, ``probe_step_s``, ``probe_step_cpu_s``,
            ``probe_step_cpu_median_s``, ``probe_cpu_ratio`` and ``blocking``; what a ``workers_per_core`` rule weighed
            (a collector's: ``predicted_serving_s``, ``predicted_share_ratio``).
        decided (dict): for each option that may be left to ``"auto"``, ``"given"`` or ``"auto"``.
        batching (dict): a collector's inference batching options, recorded as given.
    """

    create_env_fn: tuple
    create_env_kwargs: tuple
    num_envs: int
    envs_per_factory: int
    groups: tuple
    envs_per_worker: int
    env_threads: bool
    backend: str
    mp_start_method: str
    worker_num_threads: int | None
    worker_affinity: list | None
    idle_poll: bool
    exchange: str
    seed: int | None
    on_env_failure: str
    restart: object
    step_timeout: float | None
    build_timeout: float | str | None
    start_timeout: float | None
    pin_memory: bool
    layout: object
    observation_keys: list
    action_keys: list
    policy_output_keys: list
    recurrent_state: dict
    specs: dict
    transition_chunk_size: int | None
    chunks_per_env: int
    measured: dict
    decided: dict
    batching: dict

    @property
    def num_workers(self) -> int:
        """Workers: processes, or threads with ``backend="threading"``."""
        return len(self.groups)

    @classmethod
    def build(cls, create_env_fn: Sequence[Callable] | None = None, *, spec_env: SpecEnv | None = None,
              batching: Mapping | None = None, workers_per_core: Callable | None = None, **options) -> PoolPlan:
        """Checks the options, builds the spec env (unless ``spec_env`` is given) and decides.

        Args:
            create_env_fn (list of callables): as :class:`~torchrl_asyncpool.AsyncEnvPool` takes
                it; left out with ``spec_env``, which holds them (checked).

        Keyword Args:
            **options: :class:`~torchrl_asyncpool.AsyncEnvPool`'s keyword arguments (but
                ``cancel_start``, which belongs to the building), with the same defaults
                (:data:`OPTIONS`) and the same errors.
            spec_env (SpecEnv, optional): the spec env, already built by the caller (a collector,
                which read its policy's layout from it) from factories and keyword arguments
                checked by :func:`~torchrl_asyncpool.pool.arguments.check_factories` and
                ``check_kwargs``: the plan takes them from it (``create_env_fn`` and
                ``create_env_kwargs`` are then left out). The caller closes it. Defaults to
                ``None``: built here and closed before this returns.
            batching (mapping, optional): inference batching options to record as given
                (``min_batch_size``, ``max_batch_size``, ``server_timeout``); the pool does not
                use them.
            workers_per_core (callable, optional): ``(measured, num_envs, cores) -> int``: how
                many worker processes a core hosts for CPU-bound envs under
                ``envs_per_worker="auto"``, from what the spec env's timing measured (it may add
                what it weighed to ``measured``). Defaults to ``None``: one a core. A collector
                passes its own rule (:func:`~torchrl_asyncpool.collector.workload_plan.startup_workers_per_core`).

        Examples:
            >>> from torchrl_asyncpool import AsyncEnvPool
            >>> from torchrl_asyncpool.pool.plan import PoolPlan
            >>> from torchrl_asyncpool.testing import ZeroLatencyEnv
            >>> plan = PoolPlan.build([ZeroLatencyEnv] * 4, envs_per_worker=2)
            >>> plan.num_workers, plan.envs_per_worker, plan.decided["envs_per_worker"]
            (2, 2, 'given')
            >>> with AsyncEnvPool(plan=plan) as pool:
            ...     pool.plan is plan, pool.num_workers
            (True, 2)
        """
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"PoolPlan.build() got an unexpected keyword argument {unknown[0]!r}.")
        if spec_env is not None and (create_env_fn is not None or "create_env_kwargs" in options):
            raise TypeError("PoolPlan.build(spec_env=...) takes the factories and their keyword arguments from the "
                            "spec env; leave create_env_fn and create_env_kwargs out.")
        o = dict(OPTIONS, **options)
        exchange, restart, fns, kwargs = _check_options(create_env_fn, o, spec_env)
        threads = o["backend"] == "threading"
        measured: dict = {}
        spec = SpecEnv(fns, kwargs) if spec_env is None else spec_env
        try:  # the spec env: its fields fix the slot layout, its step (timed for "auto") the grouping
            request, response, specs, obs_keys, k_vec, (per_worker, threaded, groups) = _read_spec_env(
                spec, fns, kwargs, o, restart, measured, workers_per_core)
        finally:
            if spec_env is None:
                spec.close()
        n = len(fns) * k_vec
        chunk_size = o["transition_chunk_size"]
        layout, outputs, recurrent = _slot_layout(
            n, request, response, list(response), o["policy_output_spec"], o["recurrent_state"],
            restart=restart, transitions=chunk_size is not None,
        )
        measured["record_bytes"] = _slot_bytes(layout)
        decided = {name: "auto" if isinstance(o[name], str) and o[name] == "auto" else "given" for name in _DECIDED}
        if callable(chunk_size):  # a callable sizes the chunks from the slot layout
            chunk_size, decided["transition_chunk_size"] = chunk_size(layout), "auto"
        plan = cls(
            create_env_fn=tuple(_seeded_factories(fns, o["seed"], k_vec)),  # only the workers' envs are seeded
            create_env_kwargs=tuple(kwargs), num_envs=n, envs_per_factory=k_vec,
            groups=tuple(tuple(g) for g in groups), envs_per_worker=per_worker, env_threads=threaded,
            backend=o["backend"], mp_start_method=o["mp_start_method"], worker_num_threads=o["worker_num_threads"],
            # worker threads share this process's GIL and cores with the caller: no idle poller
            idle_poll=False if threads else resolve_idle_poll(o["idle_poll"], cpu_bound=not threaded),
            # "auto" partitions cores between processes; threads of this process are left unpinned
            worker_affinity=resolve_worker_affinity(o["worker_affinity"], len(groups), threaded=threaded or threads),
            exchange=exchange, seed=o["seed"], on_env_failure=o["on_env_failure"], restart=restart,
            step_timeout=o["step_timeout"], build_timeout=o["build_timeout"], start_timeout=o["start_timeout"],
            pin_memory=o["pin_memory"], layout=layout, observation_keys=obs_keys, action_keys=list(response),
            policy_output_keys=list(outputs), recurrent_state=dict(recurrent), specs=batched_specs(specs, n),
            transition_chunk_size=chunk_size, chunks_per_env=o["chunks_per_env"], measured=measured,
            decided=decided, batching=dict(batching or {}),
        )
        _log.debug("%r", plan)
        return plan

    def describe(self) -> dict:
        """The plan as plain values (for logs, metrics and a collector's
        :meth:`~torchrl_asyncpool.AsyncPoolCollector.plan`): the decisions, ``measured`` and
        ``decided`` (``"given"`` or ``"auto"`` per option)."""
        restart = self.restart
        return {
            "num_envs": self.num_envs,
            "envs_per_factory": self.envs_per_factory,
            "num_workers": self.num_workers,
            "envs_per_worker": self.envs_per_worker,
            "env_threads": self.env_threads,
            "backend": self.backend,
            "worker_affinity": None if self.worker_affinity is None else [list(m) for m in self.worker_affinity],
            "idle_poll": self.idle_poll,
            "exchange": self.exchange,
            "seed": self.seed,
            "on_env_failure": self.on_env_failure,
            "max_restarts_per_env": None if restart is None else restart.per_env,
            "restart_window_s": None if restart is None else restart.window_s,
            "max_restarts": None if restart is None else restart.total,
            "step_timeout": self.step_timeout,
            "build_timeout": self.build_timeout,
            "transition_chunk_size": self.transition_chunk_size,
            "batching": dict(self.batching),
            "measured": dict(self.measured),
            "decided": dict(self.decided),
        }

    def metrics(self) -> dict:
        """The plan's numbers for :meth:`AsyncEnvPool.metrics
        <torchrl_asyncpool.AsyncEnvPool.metrics>` (``plan_*``; ``nan`` where the spec env was not
        timed)."""
        m = self.measured
        return {
            "plan_probe_step_s": float(m.get("probe_step_s", math.nan)),
            "plan_blocking": float(m["blocking"]) if "blocking" in m else math.nan,
            "plan_record_bytes": int(m["record_bytes"]),
            "plan_pinned_workers": 0 if self.worker_affinity is None else len(self.worker_affinity),
        }

    def __repr__(self) -> str:
        def value(name):
            v = getattr(self, name)
            if name == "worker_affinity" and v is not None:
                v = sorted({tuple(mask) for mask in v})  # one mask each, usually the same
            how = self.decided.get(name)
            return f"{name}={v!r}" + (" (auto)" if how == "auto" else "")

        m = self.measured
        probe = (f"probe: {m['probe_steps']} steps of {m['probe_step_s'] * 1e6:.0f} us "
                 f"(median CPU {m['probe_step_cpu_median_s'] * 1e6:.0f} us), blocking={m['blocking']}"
                 if "probe_step_s" in m else "probe: not timed")
        parts = [f"num_envs={self.num_envs}", f"num_workers={self.num_workers}",
                 *map(value, ("envs_per_worker", "env_threads", "worker_affinity", "idle_poll", "exchange")),
                 f"backend={self.backend!r}", f"seed={self.seed!r}", f"on_env_failure={self.on_env_failure!r}",
                 f"record_bytes={m['record_bytes']}", probe]
        return f"{type(self).__name__}({', '.join(parts)})"


def _slot_bytes(layout) -> int:
    """Bytes of one slot's record and answer (the fields a step moves)."""
    return sum(f.numel * torch.empty((), dtype=f.dtype).element_size() for f in layout.request + layout.response)


def _read_spec_env(spec: SpecEnv, fns, kwargs, o: dict, restart, measured: dict, workers_per_core=None):
    """``(request fields, response fields, slot specs, observation keys, envs per factory,
    (envs per worker, threaded, groups))`` read from the spec env; ``measured`` receives what its
    timing measured and how long it took to build."""
    adapter = spec.adapter
    request, response = adapter.fields()
    # a vector env hosts k envs, in k consecutive slots of one worker, stepped in lockstep
    k_vec = getattr(adapter, "num_envs", 1)
    grouping = _group_envs(adapter, o["envs_per_worker"], o["env_threads"], fns, kwargs, len(fns) * k_vec,
                           o["backend"] == "threading", seed=o["seed"], restart=restart, measured=measured,
                           workers_per_core=workers_per_core)
    measured["spec_env_build_s"] = spec.build_s
    return request, response, slot_specs(adapter), list(adapter.obs_keys), k_vec, grouping


def _check_options(create_env_fn, o: dict, spec_env=None):
    """``(exchange, restart policy, factories, their kwargs)``: the checks that need no env, one
    function per concern, each before anything is built (a bad value costs nothing); the
    factories of a ``spec_env`` were checked when it was opened."""
    exchange = resolve_exchange(o["exchange"])
    _check_start_options(o["idle_poll"], None, o["backend"])
    restart = restart_policy(o["on_env_failure"], o["max_restarts_per_env"], o["restart_window_s"],
                             o["max_restarts"])
    _check_step_timeout(o["step_timeout"], o["backend"] == "threading")
    _check_build_timeout(o["build_timeout"])
    if spec_env is None:
        fns = check_factories(create_env_fn)
        kwargs = check_kwargs(o["create_env_kwargs"], len(fns))
    else:
        fns, kwargs = spec_env.create_env_fn, spec_env.create_env_kwargs
    _check_process_options(o["mp_start_method"], o["pin_memory"], o["worker_affinity"])
    _check_seed(o["seed"])
    return exchange, restart, fns, kwargs
