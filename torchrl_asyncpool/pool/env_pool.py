"""AsyncEnvPool v2: env worker processes around one shared-memory slot arena.

This module builds what the pool's start-up plan (:class:`~torchrl_asyncpool.pool.plan.PoolPlan`,
which holds every check and decision: the spec env, the slot layout, the grouping, seeding, CPU
masks) says, and is the pool's consumer side (:meth:`AsyncEnvPool.recv`,
:meth:`~AsyncEnvPool.send`, :meth:`~AsyncEnvPool.take_transitions`, metrics, close); the worker
processes' start-up and end live in :mod:`~torchrl_asyncpool.pool.processes`.
"""
from __future__ import annotations

import collections
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Composite

from torchrl_asyncpool._sys.affinity import resolve_worker_affinity, set_process_affinity
from torchrl_asyncpool.delivery.chunks import ChunkBuffers, ChunkReader
from torchrl_asyncpool.errors import PoolClosedError
from torchrl_asyncpool.exchange.arena import Arena, as_key, key_repr
from torchrl_asyncpool.exchange.consumer import ConsumerHandle, SlotConsumer
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool._sys.forkserver import death_fd
from torchrl_asyncpool.exchange.metrics import PoolMetrics, log_metrics
from torchrl_asyncpool._sys.descriptors import ensure_fd_capacity
from torchrl_asyncpool.pool.arguments import BACKENDS  # noqa: F401 - documented here (api.rst)
from torchrl_asyncpool.pool.plan import OPTIONS, PoolPlan
from torchrl_asyncpool.pool.watchdog import _PoolWatchdog
from torchrl_asyncpool.pool.processes import _PoolWorkers
from torchrl_asyncpool.pool.processes import kill_process_group  # noqa: F401 - its home until this split

__all__ = ["AsyncEnvPool"]

_log = logging.getLogger(__name__)


def close_noting(pool, timeout: float, primary: BaseException | None = None,
                  what: str = "closing the env pool failed") -> None:
    """Closes ``pool`` (``None``: nothing to do); a failure to close never hides ``primary``
    (the error being raised, if any): it is added to that error's notes, and reported as a
    ``RuntimeWarning`` (pointing at the caller's caller) in any case."""
    if pool is None:
        return
    try:
        pool.close(timeout)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the primary error or the results matter more
        msg = f"{what}: {type(exc).__name__}: {exc}"
        if primary is not None and hasattr(primary, "add_note"):  # Python >= 3.11
            primary.add_note(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _refuse_options_beside(plan, create_env_fn, options: dict) -> None:
    """``AsyncEnvPool(plan=...)`` builds the plan as it is: factories or options given next to it
    (other than their defaults) would be silently ignored, so they are refused."""
    if not isinstance(plan, PoolPlan):
        raise TypeError(f"plan must be a PoolPlan (PoolPlan.build(...)), got {type(plan).__name__}.")
    given = [name for name, value in options.items()
             if value is not OPTIONS[name] and not (type(value) is type(OPTIONS[name]) and value == OPTIONS[name])]
    if create_env_fn is not None:
        given.insert(0, "create_env_fn")
    if given:
        raise TypeError(f"AsyncEnvPool(plan=...) takes its factories and options from the plan; pass {given} to "
                        "PoolPlan.build() instead (cancel_start may go with plan=).")


def _leaf_if_single(spec: Composite, name: str):
    """``EnvBase``'s rule for its ``action_spec``/``reward_spec``/``done_spec`` shortcuts: the
    leaf when the group's only key is ``name``, else the whole group."""
    keys = list(spec.keys(True, True))
    return spec[name] if keys == [name] else spec


class AsyncEnvPool(_PoolWorkers, _PoolWatchdog):
    """A pool of env workers (processes, or threads of this process) exchanging records through
    shared memory.

    Each env owns one *slot* of a shared-memory arena. Workers publish records into their
    slots and ring a doorbell; :meth:`recv` gathers ready slots into a batch, :meth:`send`
    scatters actions back and rings the owning workers. Nothing is pickled after start-up
    and readiness costs one ``eventfd`` write, not a queue message.

    Episodes follow gymnasium's ``NEXT_STEP`` autoreset, owned by the workers: the record
    after a reset is :attr:`~torchrl_asyncpool.StepType.FIRST` (reward 0), a terminal record
    carries the real final observation and reward, the action sent for it is discarded and
    the next record is ``FIRST`` of the next episode. The consumer never sends a reset.

    Args:
        create_env_fn (list of callables): one factory per env, each returning a TorchRL
            :class:`~torchrl.envs.EnvBase` with an empty batch size or a
            :class:`gymnasium.Env`. Specs are read once from the first env (instantiated in
            the calling process) and fix the slot layout; every env must share them. A
            factory may instead return a :class:`gymnasium.vector.VectorEnv` of ``k`` envs
            (``NEXT_STEP`` autoreset) or a TorchRL env with ``batch_size=[k]`` (every factory
            the same ``k``): it then fills ``k`` consecutive slots of one worker, which steps
            all of them with one call once every one of them is answered (lockstep), for
            simulators that step many envs at once. A TorchRL batched env is reset with
            partial resets (``"_reset"``), one pass after its envs end, and must not reset
            itself. Factories may also return
            :class:`~torchrl_asyncpool.remote.RemoteEnvSlot` slots, stepped by env hosts that
            connect over gRPC (one listening worker per address; see :doc:`remote`).

    Keyword Args:
        create_env_kwargs (dict or list of dicts, optional): keyword arguments for the
            factories, one dict for all or one per env.
        envs_per_worker (int or "auto", optional): envs hosted by one worker process, each in
            its own slot and stepped as its action arrives (not in lockstep). ``"auto"``
            times a few steps of the spec env: cheap CPU-bound envs are grouped so that there
            is about one worker per core; envs that block (sleep, I/O) are grouped about two
            workers per core and stepped in threads (with ``env_threads=False``, one process
            each). Defaults to ``1`` (one process per env, as TorchRL's ``AsyncEnvPool``):
            each process carries its own interpreter, imports and descriptors, so for dozens
            of envs ``"auto"`` (the collector's default) costs a fraction of the memory. With
            vector env factories each worker hosts one vector env (``"auto"``, ``1`` or ``k``).
        env_threads (bool or "auto", optional): step each env of a worker in its own thread,
            each slot with its own doorbell, so that envs whose step blocks (sleep, I/O, a
            simulator that releases the GIL) overlap inside one process instead of needing a
            process each. Each env is built, reset, stepped and closed by its own thread, so
            thread-bound resources (an OpenGL context) stay valid. Their Python work still
            takes turns on the worker's GIL, which is why blocking envs are grouped a few
            workers per core. ``"auto"`` (default): with ``envs_per_worker="auto"``, threads
            when the timed spec env blocks (its step waits more than twice as long as it
            computes, and takes over 0.2 ms); with an explicit ``envs_per_worker``, no threads
            (the spec env is not stepped here). ``False``: a worker steps its envs one after
            the other.
        mp_start_method (str, optional): ``"forkserver"`` (default: workers fork from a
            server that has torch, tensordict and torchrl already imported) or ``"spawn"``.
            ``"fork"`` is refused: a forked child inherits the pipes that tell other pools'
            workers their parent died.
        worker_num_threads (int, optional): ``torch.set_num_threads`` in every worker.
            Defaults to ``1``: env stepping gains nothing from intra-op threads and several
            workers share few cores. ``None`` leaves torch's default.
        policy_output_spec (mapping, optional): extra per-env entries the consumer writes
            with every action (policy outputs such as log-probabilities, a policy version,
            a recurrent state): ``{key: (shape, dtype)}`` or a TorchRL ``Composite`` of
            unbatched specs, or a callable ``(request_fields, action_fields) -> mapping`` run
            once the env specs are known. :meth:`send` then requires them next to the actions.
        recurrent_state (mapping, optional): ``{hidden_in_key: hidden_out_key}``. Each
            ``hidden_out_key`` must be declared in ``policy_output_spec``; records gain a
            ``hidden_in_key`` entry of the same shape, which the worker fills with the
            ``hidden_out`` sent for the previous record of the same env, and with zeros on
            :attr:`~torchrl_asyncpool.StepType.FIRST`. The consumer stays pure-functional.
        transition_chunk_size (int, optional): when set, every worker also assembles its
            envs' transitions (record, answer, next record) into dense per-env chunks of
            this many consecutive steps in shared memory; read them with
            :meth:`take_transitions`; a callable ``layout -> int`` may choose it from the
            slot layout. Defaults to ``None`` (no transition delivery).
        worker_affinity (sequence of CPU index sequences, callable or "auto", optional): Linux
            CPU masks for the worker processes, one per worker (``num_workers`` follows
            ``envs_per_worker``) or a callable ``worker_index -> mask``; each worker pins
            itself (and each of its env threads) once its envs are built, so that building
            them uses every core. ``"auto"``: every worker on the CPUs after the first
            (:func:`~torchrl_asyncpool._sys.affinity.auto_partition`) when the workers step their
            envs without threads, unpinned otherwise (the collector's default). Defaults to
            ``None`` (not pinned): see :mod:`torchrl_asyncpool._sys.affinity` for when it pays.
            The resolved masks are in :attr:`worker_affinity`.
        chunks_per_env (int, optional): chunks per env (see
            :mod:`torchrl_asyncpool.delivery.chunks`). Defaults to ``2``.
        pin_memory (bool, optional): allocate the receive staging buffer in pinned memory
            (for a consumer that copies batches to CUDA). Defaults to ``False``.
        start_timeout (float, optional): seconds to wait for every worker to build its envs
            and publish its first record; past it, :class:`TimeoutError` whose ``env_indices``
            attribute lists the envs of the workers still starting. Defaults to ``None`` (no
            limit; a worker that dies or raises still ends the wait at once).
        seed (int, optional): seeds each env's first reset: env ``i`` (slot ``i``) with
            ``seed + i``. A gymnasium env is reset with ``seed=`` once, a TorchRL env gets
            ``set_seed`` before its first reset; later resets continue each env's own random
            stream, so a run is reproducible env by env (the order in which records reach the
            consumer still depends on timing). A vector or batched env of ``k`` envs gets the
            seed of its first slot and seeds its sub-envs from it (gymnasium: ``seed + j``).
            Defaults to ``None`` (unseeded). Refused for remote env slots, whose hosts own
            their envs.
        exchange (str, optional): who does the consumer's lease and answer (here, in
            :meth:`recv`/:meth:`send`, and in an inference server): ``"native"``, the C
            engine built with the package (one call each, see
            :mod:`torchrl_asyncpool.exchange.native`); ``"python"``, the pure-Python
            reference; ``"auto"`` (default), the C engine where it is built and can copy
            every field, else Python. Both give the same records and errors.
        idle_poll (bool or "auto"): whether the blocking waits of the workers and of an
            inference server serving the pool park for an idle poller instead of blocking in
            ``poll(2)`` (see :mod:`~torchrl_asyncpool.exchange.doorbell`): it saves the
            cross-core wake-up of every exchange, and keeps otherwise idle cores busy at the
            lowest priority. ``"auto"`` (default): the environment variable
            ``TORCHRL_ASYNCPOOL_IDLE_POLL`` (``1``/``0``) when set, else on for workers that
            step their envs in their own thread (not threaded workers) where idle cores wake
            slowly (a ~40 ms probe at start-up,
            :func:`~torchrl_asyncpool.exchange.doorbell.resolve_idle_poll`). The resolved value
            is :attr:`idle_poll`.
        backend (str, optional): ``"multiprocessing"`` (default): the workers are processes;
            ``"threading"``: they are threads of this process, running the same worker loop on
            the same arena, doorbells and chunk buffers (same records, same errors), with no
            process started, no pickling of the factories and a start-up of milliseconds. The
            GIL is the cost: use it for tests, for envs whose step releases the GIL, or for envs
            that cannot be pickled. ``envs_per_worker="auto"`` puts cheap CPU-bound envs in one
            worker thread and gives envs that block a thread each; ``worker_affinity="auto"``
            pins nothing, ``idle_poll`` is off (``True`` is refused), torch's thread count and
            signal handlers are left alone. A worker thread stuck in an env's step cannot be
            killed: :meth:`close` warns and leaves it (a daemon thread) to end with its step.
        on_env_failure (str, optional): ``"raise"`` (default): an env that raises in its step or
            reset fails the pool (:class:`~torchrl_asyncpool.EnvError`). ``"restart"``: its worker
            closes it and builds a new one from the same factory (seeded ``seed + i + r *
            num_envs`` for env ``i``'s ``r``-th rebuild when ``seed`` is given), and collection
            goes on: an episode cut by a failed step ends with a ``TRUNCATION`` record at its last
            observation (reward 0), the next record is the rebuilt env's ``FIRST``; both a cut
            truncation and the ``FIRST`` after a failed reset carry ``env_restarted=True`` (an
            entry every record has in this mode). Envs of the same worker lose nothing. A vector
            or batched env is rebuilt whole: each of its open episodes ends with a marked
            truncation, and an env whose episode had just ended gets a marked ``FIRST``
            instead. Not for remote slots. A worker *process* that dies (killed, out of memory,
            or killed by ``step_timeout``) is replaced by a new one, which builds its envs again
            (each as its next rebuild); the episodes it left open end the same way, and a
            record it had written but not published is published first. See :doc:`failures`.
        max_restarts_per_env (int, optional): rebuilds allowed per env within
            ``restart_window_s`` (default 3 in 60 s); one more failure raises the env's error,
            with its restart history, as ``"raise"`` would.
        restart_window_s (float, optional): the window of ``max_restarts_per_env``, in seconds.
        max_restarts (int or None, optional): rebuilds allowed over the pool's life, all envs
            together. Defaults to ``100``; ``None``: no overall cap. Each worker checks it against
            the count every worker has published, so failures in several workers at the same
            moment can overshoot it by less than one per worker.
        step_timeout (float, optional): seconds an env's step (or reset) may take. Past it, its
            worker process is killed (SIGKILL; the processes its envs started go with it), then
            replaced (``on_env_failure="restart"``, counted against each of its envs' budget) or
            reported as :class:`~torchrl_asyncpool.EnvError` naming the env (``"raise"``).
            ``None`` (default): no limit. Checked about every 20 ms while the pool's consumer
            waits, and by :meth:`check_workers` (a collector calls it about every 100 ms). Not
            with ``backend="threading"``.
        build_timeout (float, "auto" or None, optional): seconds a rebuild of an env from its
            factory may take once the pool has started (an env rebuilt after a failure, or the
            envs of a replacement worker). Past it, its worker process is killed and the hung
            build counts against the env's restart budget like a failure (phase ``"build"`` in
            :meth:`restart_info` and in the error); past the budget, an
            :class:`~torchrl_asyncpool.EnvError` says the factory hung. ``"auto"`` (default):
            ten times the workers' measured start-up (building and resetting every env), at
            least 60 s; ``None``: no limit. Only pools that rebuild envs
            (``on_env_failure="restart"``) build after start-up.
        plan (PoolPlan, optional): a start-up plan from
            :meth:`PoolPlan.build <torchrl_asyncpool.pool.plan.PoolPlan.build>` (which takes the
            arguments above): the pool then builds that plan, and ``create_env_fn`` and the
            options above must be left out (``cancel_start`` may be given). Defaults to ``None``:
            the pool builds its plan from its arguments.
        cancel_start (callable, optional): ``() -> bool``, asked before each worker is
            started and about every 0.1 s while they build and reset their envs (the fork
            server's own first start, once per process, is not cut short); when it
            returns true, the start-up is abandoned: the workers are stopped (killed after 1
            s) and :class:`~torchrl_asyncpool.PoolStartCancelled` is raised (a signal handler
            that sets a flag can stop a long start-up this way; ``evaluate()`` uses it).

    Attributes:
        num_envs (int): slots, i.e. envs: ``len(create_env_fn)`` times ``envs_per_factory``.
        envs_per_factory (int): envs one factory builds (``k`` for vector or batched envs, else ``1``).
        num_workers (int): worker processes.
        worker_restarts (int): worker processes replaced so far (``on_env_failure="restart"``).
        step_timeout (float or None): as given.
        build_timeout (float or None): the limit in force on a rebuild, in seconds (``"auto"``
            resolved once the workers started).
        idle_poll (bool): whether the workers' and the serving loop's waits idle-poll.
        batch_size (torch.Size): ``[num_envs]``.
        full_observation_spec, full_action_spec, full_reward_spec, full_done_spec (Composite):
            the envs' TorchRL specs with the batch size ``[num_envs]``, as an ``EnvBase`` of
            that batch size has them: a TorchRL env's own specs, a gymnasium env's spaces
            converted as ``GymEnv`` does (a ``Discrete`` action is a categorical integer, not
            one-hot). ``full_done_spec`` has ``done``, ``terminated`` and ``truncated``, which
            every record carries. :attr:`observation_spec`, :attr:`action_spec`,
            :attr:`reward_spec` and :attr:`done_spec` are TorchRL's shortcuts.
        observation_keys, action_keys (list): the keys of the observation and action fields.

    Lifetime of received data:
        The TensorDict returned by :meth:`recv` views a staging buffer owned by the pool, not
        the slots: workers never write there. It stays valid until the next :meth:`recv`
        call; clone it to keep it longer.

    Errors:
        An env that raises in construction, reset or step makes the next :meth:`recv` raise
        :class:`~torchrl_asyncpool.errors.EnvError` naming the env index, with the worker's
        traceback; a worker that dies raises
        :class:`~torchrl_asyncpool.errors.WorkerDiedError`. Both are sticky: the pool must
        then be closed. Wrong actions raise :class:`ValueError` before anything is written
        and leave the pool usable.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_asyncpool import AsyncEnvPool
        >>> from torchrl_asyncpool.testing import OracleEnv
        >>> with AsyncEnvPool([lambda: OracleEnv(env_id=0), lambda: OracleEnv(env_id=1)],
        ...                   envs_per_worker=2) as pool:
        ...     ready = pool.recv(min_get=2)
        ...     print(sorted(ready.env_indices.tolist()), ready["step_type"].tolist())
        ...     pool.send(TensorDict({"action": torch.zeros(2, dtype=torch.int64)}, [2]), ready.env_indices)
        ...     nxt = pool.recv(min_get=2)
        ...     print(nxt["step_type"].tolist())  # env 0's first oracle episode is one step long
        [0, 1] [0, 0]
        [3, 1]

        Seeded envs (``seed=``): env ``i``'s first observation is that of its env reset with
        ``seed + i``:

        >>> import gymnasium as gym
        >>> import numpy as np
        >>> with AsyncEnvPool([lambda: gym.make("CartPole-v1")] * 2, seed=7) as pool:
        ...     first = pool.recv(min_get=2)
        ...     obs = first["observation"][first.env_indices.argsort()]
        >>> expected = [gym.make("CartPole-v1").reset(seed=7 + i)[0] for i in range(2)]
        >>> torch.equal(obs, torch.as_tensor(np.stack(expected)))
        True
    """

    def __init__(
        self,
        create_env_fn: Sequence[Callable] | None = None,
        *,
        create_env_kwargs: Mapping | Sequence[Mapping] | None = None,
        envs_per_worker: int | str = 1,
        env_threads: bool | str = "auto",
        mp_start_method: str = "forkserver",
        worker_num_threads: int | None = 1,
        pin_memory: bool = False,
        start_timeout: float | None = None,
        policy_output_spec: Mapping | None = None,
        recurrent_state: Mapping | None = None,
        transition_chunk_size: int | None = None,
        chunks_per_env: int = 2,
        worker_affinity: Sequence[Sequence[int]] | Callable[[int], Sequence[int]] | str | None = None,
        exchange: str = "auto",
        seed: int | None = None,
        idle_poll: bool | str = "auto",
        cancel_start: Callable[[], bool] | None = None,
        backend: str = "multiprocessing",
        on_env_failure: str = "raise",
        max_restarts_per_env: int = 3,
        restart_window_s: float = 60.0,
        max_restarts: int | None = 100,
        step_timeout: float | None = None,
        build_timeout: float | str | None = "auto",
        plan: PoolPlan | None = None,
    ):
        options = {name: value for name, value in locals().items() if name in OPTIONS}
        self._closed = True  # until start-up completes, close() has little to undo
        self._procs = []
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # the creator's mask
        if cancel_start is not None and not callable(cancel_start):
            raise TypeError(f"cancel_start must be a callable returning a bool, got {type(cancel_start).__name__}.")
        # 1. the plan: every check and decision (the spec env built once, grouping, seeding, affinity)
        if plan is None:
            plan = PoolPlan.build(create_env_fn, **options)
        else:
            _refuse_options_beside(plan, create_env_fn, options)
        # 2. the building: what the plan says, nothing decided here
        self._build(plan, cancel_start)

    def _build(self, plan: PoolPlan, cancel_start) -> None:
        """Builds the arena, the doorbells, the chunk buffers and the workers of ``plan``."""
        self._plan = plan
        self.exchange = plan.exchange
        self._cancel_start = cancel_start
        self.backend = plan.backend
        threads = plan.backend == "threading"
        self._restart = plan.restart
        self.on_env_failure = plan.on_env_failure
        self.envs_per_factory = plan.envs_per_factory
        self.num_envs = n = plan.num_envs
        self.envs_per_worker, self.env_threads = plan.envs_per_worker, plan.env_threads
        self.idle_poll = plan.idle_poll
        self.observation_keys = list(plan.observation_keys)
        self.action_keys = list(plan.action_keys)
        self.batch_size = torch.Size([n])
        for name, spec in plan.specs.items():
            setattr(self, name, spec.clone())  # the pool's own: a plan may build several pools
        self.layout = plan.layout
        self.policy_output_keys = list(plan.policy_output_keys)
        self.recurrent_state = dict(plan.recurrent_state)
        groups = [list(g) for g in plan.groups]

        self._arena = Arena.create(self.layout)
        self._init_watchdog(plan.step_timeout, threads, plan.build_timeout)
        self._chunks = None
        if plan.transition_chunk_size is not None:
            self._chunks = ChunkBuffers(self.layout, plan.transition_chunk_size, plan.chunks_per_env)
        self._consumer = Doorbell()
        self._open_life_pipe()
        self.num_workers = len(groups)
        #: the CPU mask of each worker process (``None``: not pinned)
        self.worker_affinity = None if plan.worker_affinity is None else list(plan.worker_affinity)
        self._slot_worker = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        # a threaded worker's slots each wait on their own doorbell; otherwise one per worker
        self._slot_bell = np.arange(n) if self.env_threads else self._slot_worker
        # the bells, and a pipe, a sentinel, a pidfd and a data pipe per worker process (a worker thread owns
        # a duplicate of each of its descriptors instead): no limit of ours caps them (see
        # forkserver.ship_fds for how a worker or a server gets them), the soft RLIMIT_NOFILE is
        # raised where it would (before the fork server starts: it and the workers inherit it)
        bells = int(self._slot_bell.max()) + 1
        ensure_fd_capacity(2 * bells + 10 * self.num_workers if threads else bells + 5 * self.num_workers,
                           f"AsyncEnvPool ({n} envs, {self.num_workers} workers)")
        self._bells = [Doorbell() for _ in range(int(self._slot_bell.max()) + 1)]
        self._conns = []
        #: the path each slot's env is stepped on, as its worker reported it (``"gymnasium"``,
        #: ``"torchrl-fast"``, ``"torchrl"``, ...; see :mod:`torchrl_asyncpool.envs.torchrl_fast`)
        self.slot_paths = {}
        self._error = None
        self._start(plan, groups)

    def _start(self, plan: PoolPlan, groups) -> None:
        """Starts the workers of ``plan`` (hosting ``groups``), waits for their first records and
        makes the consumer's handle."""
        self._closed = False
        self._arm_shutdown()
        try:
            self._check_cancel()
            # nothing this pool's workers write in the arena's clock words can predate it: the
            # watchdog ignores what would (see _kill_hung_builds)
            self._arena_clock_floor = time.monotonic()
            self._start_workers(plan.mp_start_method, groups, list(plan.create_env_fn), list(plan.create_env_kwargs),
                                plan.worker_num_threads, self.worker_affinity)
            # when the workers began building their envs, as start_timeout counts (evaluate()
            # counts an episode's env creation and first reset in its wall-clock limit, but not
            # the spec env above, nor starting the fork server)
            self._workers_started_at = time.monotonic()
            self._await_ready(plan.start_timeout)
            self._set_build_timeout(time.monotonic() - self._workers_started_at)
        except BaseException as exc:
            close_noting(self, 1.0, exc, "closing the pool after its failed start-up failed too")
            raise
        if not self._watched:  # a watched pool's replacement workers need it
            self._life_r_close()
        self.slot_paths = [self.slot_paths.get(i, "unknown") for i in range(self.num_envs)]
        _log.debug("AsyncEnvPool: the envs step on %s", dict(collections.Counter(self.slot_paths)))

        self._handle = ConsumerHandle(
            layout=self.layout,
            arena_fd=InheritedFd(self._arena.fd),
            consumer_bell=self._consumer.inheritable(),
            bells=[bell.inheritable() for bell in self._bells],
            slot_bell=self._slot_bell.tolist(),
            # a watched pool's watchdog handles deaths: a consumer elsewhere must not fail on one
            worker_sentinels=[] if self._watched else [InheritedFd(death_fd(p)) for p in self._procs],
            slot_worker=self._slot_worker.tolist(),
            worker_pids=[p.pid for p in self._procs],
            action_keys=self.action_keys,
            exchange=self.exchange,
            idle_poll=self.idle_poll,
        )
        self._pin_memory = plan.pin_memory
        self._consumer_obj = None
        self._served_by = None  # weakref to the InferenceServer that serves this pool (set by its start)
        self._chunk_reader = None
        self._metrics = PoolMetrics(self._arena)

    # -- public API -------------------------------------------------------------------------
    def recv(self, min_get: int = 1, max_get: int | None = None, timeout: float | None = None) -> TensorDictBase:
        """Waits for ready records and returns them as one batch.

        Semantics are TorchRL's: the call waits until at least ``min_get`` envs are ready.
        With ``timeout=None`` it then returns everything ready (up to ``max_get``). With a
        timeout, the deadline bounds the whole call from entry: once ``min_get`` is met it
        returns as soon as ``max_get`` records are ready or at the deadline with whatever is
        ready; if fewer than ``min_get`` are ready at the deadline, :class:`TimeoutError` is
        raised and nothing is lost (the records stay ready for the next call). When more
        than ``max_get`` are ready, the ones that waited longest are taken.

        An env steps again only once :meth:`send` answers the record ``recv`` returned for it.
        A call that waits while fewer than ``min_get`` envs can publish (the others await
        their actions) can only be ended by another thread's :meth:`send`: after
        ``RECV_STALL_WARN_S`` (10 s, :mod:`torchrl_asyncpool.exchange.consumer`) it warns
        (:class:`RuntimeWarning`, once a call), and its :class:`TimeoutError` names that cause.

        Args:
            min_get (int, optional): minimum batch size. Defaults to ``1``.
            max_get (int, optional): maximum batch size. Defaults to ``None`` (no maximum).
            timeout (float, optional): deadline in seconds from call entry. ``0`` polls.
                Defaults to ``None`` (wait for ``min_get`` as long as it takes).

        Returns:
            TensorDict of batch size ``[B]`` with the observation keys, ``"reward"``,
            ``"step_type"``, ``"done"``, ``"terminated"``, ``"truncated"``, any declared
            recurrent-state input and ``"env_index"``; its ``env_indices`` attribute
            (``LongTensor [B]``) is what :meth:`send` expects. Valid until the next
            :meth:`recv`.

        Raises:
            RuntimeError: an :class:`~torchrl_asyncpool.InferenceServer` of this process serves
                the pool (two consumers would lease and answer the same records).
        """
        if self._served_by is not None:
            self._check_not_served("recv")
        return self._local_consumer().recv(min_get, max_get, timeout)

    def wait_ready(self, count: int = 1, timeout: float | None = None) -> int:
        """Blocks until ``count`` records are ready or ``timeout`` seconds pass; leases nothing.

        Returns how many records are ready (fewer than ``count`` after a timeout). With
        ``timeout=None`` a following ``recv(min_get=1)`` then returns at once with everything
        ready, so a caller that must look at a clock now and then (wall-clock limits) can wait
        in bounded steps without the deadline semantics of ``recv(timeout=...)`` (which waits
        for ``max_get`` records up to its deadline). Env errors and worker deaths raise as in
        :meth:`recv`.

        Args:
            count (int, optional): records to wait for, in ``[1, num_envs]``. Defaults to ``1``.
            timeout (float, optional): seconds to wait at most (``>= 0``); ``None`` (default)
                waits as long as it takes.

        Returns:
            the number of records ready (fewer than ``count`` after a timeout).

        Raises:
            ValueError: for a ``count`` or ``timeout`` out of range.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= self.num_envs:
            raise ValueError(f"count must be an int in [1, num_envs={self.num_envs}], got {count!r}.")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or >= 0, got {timeout!r}.")
        return self._local_consumer().wait_ready(count, timeout)

    def send(self, actions: TensorDictBase | Mapping, env_indices) -> None:
        """Writes actions into the leased slots ``env_indices`` and wakes their workers.

        Everything is validated before anything is written: on a :class:`ValueError` the
        pool is untouched and the slots stay leased, so a corrected ``send`` can follow.

        Args:
            actions (TensorDict or mapping): batch ``[B]`` holding every action key of the
                env spec (and every declared policy output) with its exact per-env shape and
                dtype; other entries (observations, ...) are ignored. A mapping may nest
                (``{"agent": {"action": t}}``) or name nested keys by tuple
                (``{("agent", "action"): t}``).
            env_indices (LongTensor or sequence of ints): ``[B]`` env indices, as returned in
                ``recv(...).env_indices``; each must be leased (received and not yet answered).
        """
        if self._served_by is not None:
            self._check_not_served("send")
        self._local_consumer().send(actions, env_indices)

    def _check_not_served(self, what: str) -> None:
        server = self._served_by()
        if server is not None and server._holds_pool():
            raise RuntimeError(
                f"{what}: this pool is served by {server!r}; its records are the server's to lease and answer "
                "(two consumers would answer the same records). stop() the server first, or drive the pool "
                "through the server only."
            )
        self._served_by = None  # the server has stopped: the pool is the caller's again

    def take_transitions(self, frames: int, timeout: float | None = None, check=None, reuse: bool = False):
        """Returns exactly ``frames`` transitions as one dense TensorDict (TorchRL layout).

        Requires ``transition_chunk_size``. Transitions of each env arrive in order and exactly
        once across calls; the chunks they came from are released to the workers before this
        returns. Returns ``None`` when ``timeout`` passes first (nothing consumed).

        Args:
            frames (int): number of transitions.
            timeout (float, optional): seconds to wait at most.
            check (callable, optional): called about every 100 ms while waiting.
            reuse (bool, optional): write over the batch the previous call returned instead of
                allocating one (see :meth:`~torchrl_asyncpool.delivery.chunks.ChunkReader.take`).
        """
        self._check_usable()
        if self._chunks is None:
            raise RuntimeError("take_transitions needs AsyncEnvPool(..., transition_chunk_size=T).")
        if self._chunk_reader is None:
            self._chunk_reader = ChunkReader(self._chunks, self._release_chunk, idle_poll=self.idle_poll)

        def _check():
            if check is not None:
                check()  # first: the caller may know the pool is being shut down
            self.check_workers()

        return self._chunk_reader.take(frames, timeout, _check, reuse)

    def check_workers(self) -> None:
        """Raises :class:`~torchrl_asyncpool.EnvError` or
        :class:`~torchrl_asyncpool.WorkerDiedError` if an env failed or a worker died (a
        pool that replaces dead or hung workers replaces them here, see ``step_timeout``)."""
        if self._watched and not self._closed:
            self._watchdog()
        self._local_consumer().raise_worker_errors()

    def _release_chunk(self, env_indices: np.ndarray) -> None:
        for bell in np.unique(self._slot_bell[env_indices]).tolist():  # one ring per worker (or slot)
            self._bells[bell].ring()

    def layout_dtype(self, key):
        """The dtype of slot field ``key`` (an action, observation or policy output).

        Args:
            key (NestedKey): the field's key, as in the pool's specs.

        Raises:
            KeyError: if ``key`` is not a field of this pool.
        """
        norm = as_key(key)
        fields = self.layout.request + self.layout.response
        for f in fields:
            if f.key == norm:
                return f.dtype
        raise KeyError(f"{key!r} is not a field of this pool (its fields: {sorted(key_repr(f.key) for f in fields)}).")

    def consumer_handle(self):
        """A picklable :class:`~torchrl_asyncpool.exchange.consumer.ConsumerHandle` for driving
        this pool from another process (an inference server); pass it as a process argument.

        Only one consumer may drive the pool at a time: once handed out, do not call
        :meth:`recv`/:meth:`send` here as well.
        """
        self._check_usable()
        return self._handle

    def metrics(self, reset: bool = False) -> dict:
        """Returns the pool's health metrics (keys in ``exchange.metrics.METRIC_KEYS``).

        Args:
            reset (bool, optional): start a new measurement window after reading.
        """
        self._check_usable_for_metrics()
        out = self._metrics.as_dict()
        if self._restart is not None:
            out["env_restarts"] = int(self._arena.restarts.sum())  # over the pool's life, not the window
            out["worker_restarts"] = self.worker_restarts  # dead or hung worker processes replaced
        for path, count in collections.Counter(self.slot_paths).items():  # e.g. slots_torchrl_fast
            out["slots_" + path.replace("-", "_")] = count
        # what the pool decided (with "auto", from measurements at start-up), and the plan's numbers
        out["num_workers"] = self.num_workers
        out["envs_per_worker"] = self.envs_per_worker
        out["env_threads"] = int(bool(self.env_threads))
        out["idle_poll"] = int(bool(self.idle_poll))
        out.update(self._plan.metrics())
        if reset:
            self._metrics.reset()
        return out

    def set_worker_affinity(self, masks) -> None:
        """Moves the running worker processes to other CPU masks: one mask per worker, or
        ``None`` (every CPU the pool's creator could use when it made the pool). Workers started
        later (replacements) take the same masks; :attr:`worker_affinity` says which are in
        force. Not with
        ``backend="threading"`` (the workers are threads of this process).

        Args:
            masks (sequence of sequences of int, or None): as ``worker_affinity`` takes them.
        """
        if self.backend == "threading":
            raise ValueError("set_worker_affinity needs worker processes (backend='multiprocessing').")
        # checked against the creator's CPUs: the caller may be pinned narrower (a collector's
        # iterating thread runs on the policy's CPU while it moves the workers)
        resolved = resolve_worker_affinity(masks, self.num_workers, available=self._cpus)
        for w, p in enumerate(self._procs):
            if p.pid is not None:
                set_process_affinity(p.pid, self._cpus if resolved is None else resolved[w])
        self.worker_affinity = resolved
        ctx, groups, fns, kwargs, num_threads, _ = self._worker_start
        self._worker_start = (ctx, groups, fns, kwargs, num_threads, resolved)

    def restart_info(self) -> dict:
        """``{env index: (rebuilds so far, the last failure's phase and traceback)}`` of the envs
        that were rebuilt (``on_env_failure="restart"``); empty when none was.

        Examples:
            >>> from torchrl_asyncpool import AsyncEnvPool
            >>> from torchrl_asyncpool.testing import OracleEnv
            >>> with AsyncEnvPool([lambda: OracleEnv(fail_at_step=1)], on_env_failure="restart") as pool:
            ...     td = pool.recv()
            ...     pool.send({"action": td["tag"][:, 0] * 0}, td.env_indices)
            ...     td = pool.recv()  # the failed step's truncation, at the last observation
            ...     print(td["step_type"].tolist(), td["env_restarted"].tolist(), td["tag"].tolist())
            ...     count, cause = pool.restart_info()[0]
            [3] [[True]] [[0, 0, 0]]
            >>> count, cause.splitlines()[0], cause.strip().splitlines()[-1]
            (1, 'step', 'RuntimeError: OracleEnv 0: scripted failure at step 1')
        """
        self._check_usable_for_metrics()
        arena = self._arena
        return {i: (int(arena.restarts[i]), arena.read_error(i)) for i in np.flatnonzero(arena.restarts).tolist()}

    def log_metrics(self, logger, step: int | None = None, *, reset: bool = False, prefix: str = "pool/") -> dict:
        """Logs :meth:`metrics` to a TorchRL logger, one scalar per key (``prefix`` + key); returns
        what it logged. See :func:`~torchrl_asyncpool.exchange.metrics.log_metrics`.

        Args:
            logger: a TorchRL logger (anything with ``log_scalar(name, value, step=...)``).
            step (int, optional): the step passed to the logger.

        Keyword Args:
            reset (bool, optional): start a new metrics window after reading. Defaults to
                ``False``.
            prefix (str, optional): prepended to each metric name. Defaults to ``"pool/"``.
        """
        return log_metrics(logger, self.metrics(reset=reset), step, prefix)

    def close(self, timeout: float = 1.0) -> None:
        """Stops the workers and frees the arena. Idempotent.

        Workers are told through their life pipe (they exit at their next wake-up, closing
        their envs); any worker still running after ``timeout`` seconds is killed. Their pipes
        and sentinels are closed here; the arena's mapping (one descriptor) goes with the last
        view of it, as batches handed out may still read it.

        Args:
            timeout (float, optional): seconds the workers get to exit. Defaults to ``1.0``.
        """
        if getattr(self, "_closed_for_good", False):
            return
        self._closed_for_good = True
        self._closed = True
        consumer = getattr(self, "_consumer_obj", None)
        if consumer is not None:  # a recv waiting in another thread sees its workers exit: say why
            consumer.closed_by_owner = True
        self._stop_workers(timeout)
        for b in getattr(self, "_bells", []):
            b.close()
        if hasattr(self, "_consumer"):
            self._consumer.close()
        if hasattr(self, "_arena"):
            self._arena.close()
        if getattr(self, "_chunks", None) is not None:
            self._chunks.close()
        self._close_watchdog()

    # -- TorchRL's spec shortcuts (EnvBase's rule: the leaf where "action"/"reward" is the only key)
    @property
    def observation_spec(self) -> Composite:
        """:attr:`full_observation_spec`."""
        return self.full_observation_spec

    @property
    def action_spec(self):
        """The action's spec when ``"action"`` is the only action key, else :attr:`full_action_spec`."""
        return _leaf_if_single(self.full_action_spec, "action")

    @property
    def reward_spec(self):
        """The reward's spec (``full_reward_spec["reward"]``)."""
        return _leaf_if_single(self.full_reward_spec, "reward")

    @property
    def done_spec(self) -> Composite:
        """:attr:`full_done_spec` (``done``, ``terminated``, ``truncated``)."""
        return self.full_done_spec

    @property
    def plan(self) -> PoolPlan:
        """The start-up plan this pool was built from (:class:`~torchrl_asyncpool.pool.plan.PoolPlan`):
        its decisions, which were given and which decided, and what start-up measured."""
        return self._plan

    @property
    def worker_pids(self) -> list:
        """Process ids of the worker processes (``None`` for each worker of ``backend="threading"``);
        after :meth:`close`, those the workers had."""
        closed = getattr(self, "_closed_pids", None)
        return list(closed) if closed is not None else [p.pid for p in self._procs]

    @property
    def slot_workers(self) -> list:
        """The worker process hosting each env: env ``i`` runs in the process
        ``worker_pids[slot_workers[i]]``."""
        return self._slot_worker.tolist()

    @property
    def workers_started_at(self) -> float:
        """``time.monotonic()`` when the workers began building their envs (after the env this
        process builds to learn the specs): the moment ``start_timeout`` counts from."""
        return self._workers_started_at

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        plan = getattr(self, "_plan", None)
        if plan is None:  # its start-up failed before the plan was made
            return f"{type(self).__name__}(closed={self._closed})"
        decided = plan.describe()
        auto = [name for name, how in decided["decided"].items() if how == "auto"]
        probe = plan.measured.get("probe_step_s")
        return (
            f"{type(self).__name__}(num_envs={plan.num_envs}, num_workers={plan.num_workers}, "
            f"envs_per_worker={self.envs_per_worker}, env_threads={self.env_threads}, "
            f"worker_affinity={'pinned' if plan.worker_affinity is not None else None}, "
            f"idle_poll={self.idle_poll}, backend={self.backend!r}, "
            + (f"probed_step_us={probe * 1e6:.0f}, blocking={plan.measured['blocking']}, " if probe is not None else "")
            + f"auto={auto}, closed={self._closed})"
        )

    # -- errors -----------------------------------------------------------------------------
    def _local_consumer(self) -> SlotConsumer:
        self._check_usable()
        c = self._consumer_obj
        if c is None:
            c = self._consumer_obj = SlotConsumer(
                self._handle, pin_memory=self._pin_memory, arena=self._arena, death_info=self.death_info,
                watchdog=self._watchdog if self._watched else None,
            )
        return c

    def _check_usable_for_metrics(self):
        if self._closed:
            raise PoolClosedError(f"{type(self).__name__} is closed.")

    def _check_usable(self):
        if self._closed:
            raise PoolClosedError(f"{type(self).__name__} is closed.")
        if self._error is not None:
            raise self._error
        if self._consumer_obj is not None and self._consumer_obj.error is not None:
            raise self._consumer_obj.error
