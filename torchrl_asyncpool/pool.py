"""AsyncEnvPool v2: env worker processes around one shared-memory slot arena."""
from __future__ import annotations

import collections
import itertools
import logging
import math
import numbers
import multiprocessing as mp
import os
import signal
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Composite

from torchrl_asyncpool.acting_policy import CARRY_KEY
from torchrl_asyncpool.affinity import resolve_worker_affinity
from torchrl_asyncpool.delivery.chunks import ChunkBuffers, ChunkReader
from torchrl_asyncpool.errors import EnvError, PoolClosedError, PoolStartCancelled, WorkerDiedError
from torchrl_asyncpool.exchange.arena import Arena, ArenaLayout, as_key
from torchrl_asyncpool.exchange.consumer import ConsumerHandle, SlotConsumer
from torchrl_asyncpool.exchange.doorbell import Doorbell, InheritedFd, resolve_idle_poll
from torchrl_asyncpool.exchange.metrics import PoolMetrics, log_metrics
from torchrl_asyncpool.exchange.native import resolve_exchange
from torchrl_asyncpool.forkserver import ensure_fd_capacity, exit_code, forkserver_context, picklable, ship_fds
from torchrl_asyncpool.workers.env_adapter import FIRST_SEED_ATTR, make_adapter, remote_listener
from torchrl_asyncpool.workers.env_specs import batched_specs, slot_specs
from torchrl_asyncpool.workers.env_worker import RESTARTED_KEY, RestartPolicy, run_worker, worker_main
from torchrl_asyncpool.workers.thread_worker import ThreadWorker
from torchrl_asyncpool.workers.torchrl_vector_hosting import synchronous_vector_envs

__all__ = ["AsyncEnvPool"]

_log = logging.getLogger(__name__)

_START_METHODS = ("forkserver", "spawn")
#: where the workers run: processes, or threads of the pool's own process (TorchRL's names)
BACKENDS = ("multiprocessing", "threading")
#: how often a start-up with ``cancel_start`` asks it
_CANCEL_POLL_S = 0.1


def _close_noting(pool, timeout: float, primary: BaseException | None = None,
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


def _leaf_if_single(spec: Composite, name: str):
    """``EnvBase``'s rule for its ``action_spec``/``reward_spec``/``done_spec`` shortcuts: the
    leaf when the group's only key is ``name``, else the whole group."""
    keys = list(spec.keys(True, True))
    return spec[name] if keys == [name] else spec


class AsyncEnvPool:
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
            each). Defaults to ``1``. With vector env factories each worker hosts one vector
            env (``"auto"``, ``1`` or ``k``).
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
            (:func:`~torchrl_asyncpool.affinity.auto_partition`) when the workers step their
            envs without threads, unpinned otherwise (the collector's default). Defaults to
            ``None`` (not pinned): see :mod:`torchrl_asyncpool.affinity` for when it pays.
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
            instead. Not for remote slots. See :doc:`failures`.
        max_restarts_per_env (int, optional): rebuilds allowed per env within
            ``restart_window_s`` (default 3 in 60 s); one more failure raises the env's error,
            with its restart history, as ``"raise"`` would.
        restart_window_s (float, optional): the window of ``max_restarts_per_env``, in seconds.
        max_restarts (int or None, optional): rebuilds allowed over the pool's life, all envs
            together. Defaults to ``100``; ``None``: no overall cap. Each worker checks it against
            the count every worker has published, so failures in several workers at the same
            moment can overshoot it by less than one per worker.
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
        create_env_fn: Sequence[Callable],
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
    ):
        self._closed = True  # until start-up completes, close() has little to undo
        self._procs = []
        self.exchange = resolve_exchange(exchange)  # before anything starts: a bad name costs nothing
        if not (isinstance(idle_poll, bool) or idle_poll == "auto"):
            raise ValueError(f"idle_poll must be True, False or 'auto', got {idle_poll!r}.")
        if cancel_start is not None and not callable(cancel_start):
            raise TypeError(f"cancel_start must be a callable returning a bool, got {type(cancel_start).__name__}.")
        self._cancel_start = cancel_start
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
        self.backend = backend
        threads = backend == "threading"
        if threads and idle_poll is True:
            raise ValueError(
                "idle_poll=True parks the workers' waits for an idle poller of their own process; with "
                "backend='threading' the workers are threads of this process: leave idle_poll at 'auto' (off)."
            )
        self._restart = _check_restart(on_env_failure, max_restarts_per_env, restart_window_s, max_restarts)
        self.on_env_failure = on_env_failure
        fns = _check_factories(create_env_fn)
        kwargs = _check_kwargs(create_env_kwargs, len(fns))
        if mp_start_method not in _START_METHODS:
            raise ValueError(f"mp_start_method must be one of {_START_METHODS}, got {mp_start_method!r}.")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA, which is not available in this process.")
        if isinstance(worker_affinity, str):  # a bad name fails before any env is built
            resolve_worker_affinity(worker_affinity, 0)
        _check_seed(seed)

        # a GymEnv(num_envs=k) built only to read specs steps in this process, not in k new ones
        with synchronous_vector_envs():
            spec_adapter = make_adapter(fns[0](**kwargs[0]), 0)
        try:
            request, response = spec_adapter.fields()
            specs = slot_specs(spec_adapter)
            # a vector env hosts k envs, in k consecutive slots of one worker, stepped in lockstep
            self.envs_per_factory = k_vec = getattr(spec_adapter, "num_envs", 1)
            self.num_envs = n = len(fns) * k_vec
            groups = None  # contiguous runs of envs_per_worker slots, unless set here
            if (self._restart is not None and not hasattr(spec_adapter, "num_envs")
                    and remote_listener(spec_adapter.env) is not None):
                raise ValueError(
                    "on_env_failure='restart' rebuilds envs in their workers; the factories return remote env "
                    "slots, whose hosts reconnect by themselves after a failure. Use on_env_failure='raise'."
                )
            if hasattr(spec_adapter, "num_envs"):
                self.envs_per_worker, self.env_threads = _vector_grouping(envs_per_worker, env_threads, k_vec)
            elif remote_listener(spec_adapter.env) is not None:
                if seed is not None:
                    raise ValueError(
                        "seed= seeds the envs that the workers build; a remote env slot's host owns its env and its "
                        "resets. Seed the envs on the host side."
                    )
                groups = _remote_groups(envs_per_worker, env_threads, spec_adapter, fns, kwargs)
                self.envs_per_worker, self.env_threads = max(map(len, groups)), True
            else:
                self.envs_per_worker, self.env_threads = _resolve_grouping(
                    envs_per_worker, env_threads, spec_adapter, n, threads
                )
        finally:
            spec_adapter.close()
        # worker threads share this process's GIL and cores with the caller: no idle poller
        self.idle_poll = False if threads else resolve_idle_poll(idle_poll, cpu_bound=not self.env_threads)
        if seed is not None:  # after the spec env: only the workers' envs are seeded
            fns = [_SeededFactory(fn, seed + i * k_vec) for i, fn in enumerate(fns)]
        self.observation_keys = list(spec_adapter.obs_keys)
        self.action_keys = list(response)
        self.batch_size = torch.Size([n])
        for name, spec in batched_specs(specs, n).items():
            setattr(self, name, spec)
        if callable(policy_output_spec):
            policy_output_spec = policy_output_spec(dict(request), dict(response))
        outputs = _check_policy_outputs(policy_output_spec, request, response)
        recurrent = _check_recurrent(recurrent_state, outputs, request)
        if transition_chunk_size is not None:
            _check_next_outputs(outputs, recurrent, request)
        for hidden_in, hidden_out in recurrent.items():
            request[hidden_in] = outputs[hidden_out]
        if self._restart is not None:
            if RESTARTED_KEY in request:
                raise ValueError(f"the env observes {RESTARTED_KEY!r}, which on_env_failure='restart' reserves.")
            request[RESTARTED_KEY] = ((1,), torch.bool)  # set on the records an env restart produced
        self.policy_output_keys = list(outputs)
        self.recurrent_state = dict(recurrent)
        self.layout = ArenaLayout(
            n, request, {**response, **outputs}, action_keys=self.action_keys, recurrent=recurrent
        )

        self._arena = Arena.create(self.layout)
        self._chunks = None
        if callable(transition_chunk_size):
            transition_chunk_size = transition_chunk_size(self.layout)
        if transition_chunk_size is not None:
            self._chunks = ChunkBuffers(self.layout, transition_chunk_size, chunks_per_env)
        self._consumer = Doorbell()
        self._life_r, self._life_w = os.pipe()
        if groups is None:
            k = self.envs_per_worker
            groups = [list(range(i, min(i + k, n))) for i in range(0, n, k)]
        self.num_workers = len(groups)
        # "auto" partitions cores between processes; threads of this process are left unpinned
        affinity = resolve_worker_affinity(worker_affinity, self.num_workers, threaded=self.env_threads or threads)
        #: the CPU mask of each worker process (``None``: not pinned)
        self.worker_affinity = affinity
        self._slot_worker = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        # a threaded worker's slots each wait on their own doorbell; otherwise one per worker
        self._slot_bell = np.arange(n) if self.env_threads else self._slot_worker
        # the bells, and a pipe, a sentinel and a data pipe per worker process (a worker thread owns
        # a duplicate of each of its descriptors instead): no limit of ours caps them (see
        # forkserver.ship_fds for how a worker or a server gets them), the soft RLIMIT_NOFILE is
        # raised where it would (before the fork server starts: it and the workers inherit it)
        bells = int(self._slot_bell.max()) + 1
        ensure_fd_capacity(2 * bells + 10 * self.num_workers if threads else bells + 4 * self.num_workers,
                           f"AsyncEnvPool ({n} envs, {self.num_workers} workers)")
        self._bells = [Doorbell() for _ in range(int(self._slot_bell.max()) + 1)]
        self._conns = []
        #: the path each slot's env is stepped on, as its worker reported it (``"gymnasium"``,
        #: ``"torchrl-fast"``, ``"torchrl"``, ...; see :mod:`torchrl_asyncpool.workers.torchrl_fast`)
        self.slot_paths = {}
        self._error = None
        self._closed = False
        self._life_box = [self._life_w]
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._life_box, 0.0)
        try:
            self._check_cancel()
            self._start_workers(mp_start_method, groups, fns, kwargs, worker_num_threads, affinity)
            # when the workers began building their envs, as start_timeout counts (evaluate()
            # counts an episode's env creation and first reset in its wall-clock limit, but not
            # the spec env above, nor starting the fork server)
            self._workers_started_at = time.monotonic()
            self._await_ready(start_timeout)
        except BaseException as exc:
            _close_noting(self, 1.0, exc, "closing the pool after its failed start-up failed too")
            raise
        self._life_r_close()
        self.slot_paths = [self.slot_paths.get(i, "unknown") for i in range(n)]
        _log.debug("AsyncEnvPool: the envs step on %s", dict(collections.Counter(self.slot_paths)))

        self._handle = ConsumerHandle(
            layout=self.layout,
            arena_fd=InheritedFd(self._arena.fd),
            consumer_bell=self._consumer.inheritable(),
            bells=[bell.inheritable() for bell in self._bells],
            slot_bell=self._slot_bell.tolist(),
            worker_sentinels=[InheritedFd(p.sentinel) for p in self._procs],
            slot_worker=self._slot_worker.tolist(),
            worker_pids=[p.pid for p in self._procs],
            action_keys=self.action_keys,
            exchange=self.exchange,
            idle_poll=self.idle_poll,
        )
        self._pin_memory = pin_memory
        self._consumer_obj = None
        self._served_by = None  # weakref to the InferenceServer that serves this pool (set by its start)
        self._chunk_reader = None
        self._metrics = PoolMetrics(self._arena)

    # -- start-up ---------------------------------------------------------------------------
    def _life_r_close(self):
        if self._life_r >= 0:
            os.close(self._life_r)
            self._life_r = -1

    def _start_workers(self, method, groups, fns, kwargs, num_threads, affinity=None):
        threads = self.backend == "threading"
        ctx = (mp if threads else forkserver_context("AsyncEnvPool") if method == "forkserver"
               else mp.get_context(method))
        arena_fd, consumer_fd, life_fd = (
            InheritedFd(self._arena.fd), self._consumer.inheritable(), InheritedFd(self._life_r)
        )
        for w, slots in enumerate(groups):
            parent_conn, child_conn = ctx.Pipe()
            # the factories it builds: one per slot, or the one vector env of its slots
            made = sorted({i // self.envs_per_factory for i in slots})
            bells = [self._bells[b].inheritable() for b in sorted(set(self._slot_bell[slots].tolist()))]
            delivery = self._chunks.handle() if self._chunks is not None else None
            mask = None if affinity is None else affinity[w]
            if threads:  # the same worker loop, in a thread of this process (nothing to pickle)
                p = ThreadWorker(
                    run_worker,
                    (w, slots, [fns[i] for i in made], [kwargs[i] for i in made], self.layout, arena_fd, bells,
                     consumer_fd, life_fd, child_conn, delivery, self.env_threads, mask, self.exchange, self._restart),
                    name=f"torchrl_asyncpool-worker-{w}",
                )
                self._check_cancel()
                p.start()
                self._procs.append(p)
                self._conns.append(parent_conn)
                continue
            p = ctx.Process(
                target=worker_main,
                args=(
                    w, slots, [picklable(fns[i]) for i in made], [kwargs[i] for i in made], self.layout,
                    arena_fd, bells, consumer_fd, life_fd, child_conn, num_threads, delivery, self.env_threads,
                    mask, self.exchange, self.idle_poll, self._restart,
                ),
                name=f"torchrl_asyncpool-worker-{w}",
                daemon=True,
            )
            self._check_cancel()  # between starts (the fork server's own first start is not cut short)
            with ship_fds():  # the bells (one per env for threaded workers) go after the start message
                p.start()
            child_conn.close()
            self._procs.append(p)
            self._conns.append(parent_conn)

    def _check_cancel(self):
        if self._cancel_start is not None and self._cancel_start():
            raise PoolStartCancelled("the pool's start-up was cancelled (cancel_start returned true).")

    def _await_ready(self, timeout):
        from multiprocessing.connection import wait

        deadline = None if timeout is None else time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                slots = np.flatnonzero(np.isin(self._slot_worker, sorted(pending))).tolist()
                err = TimeoutError(
                    f"workers {sorted(pending)} (hosting envs {slots}) did not finish start-up within "
                    f"start_timeout={timeout}s."
                )
                err.env_indices = slots  # which envs may hang (evaluate() times out their episodes)
                raise err
            sentinels = {self._procs[w].sentinel: w for w in pending}
            if self._cancel_start is not None:  # looked at again every 0.1 s
                remaining = _CANCEL_POLL_S if remaining is None else min(remaining, _CANCEL_POLL_S)
            for obj in wait(list(pending.values()) + list(sentinels), remaining):
                w = sentinels[obj] if obj in sentinels else self._conns.index(obj)
                if w not in pending:
                    continue
                try:
                    if obj in sentinels and not pending[w].poll():
                        raise EOFError
                    msg = pending[w].recv()
                except (EOFError, OSError):
                    raise self._start_death(w) from None
                if msg[0] == "error":
                    raise self._start_error(msg)
                self.slot_paths.update(msg[2] or {})
                pending.pop(w, None)
            if pending:
                self._check_cancel()  # after what arrived was read: a worker's error is not hidden by it

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
            self._chunk_reader = ChunkReader(self._chunks, self._release_chunk)

        def _check():
            if check is not None:
                check()  # first: the caller may know the pool is being shut down
            self.check_workers()

        return self._chunk_reader.take(frames, timeout, _check, reuse)

    def check_workers(self) -> None:
        """Raises :class:`~torchrl_asyncpool.EnvError` or
        :class:`~torchrl_asyncpool.WorkerDiedError` if an env failed or a worker died."""
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
        key = as_key(key)
        for f in self.layout.request + self.layout.response:
            if f.key == key:
                return f.dtype
        raise KeyError(f"{key!r} is not a field of this pool.")

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
        for path, count in collections.Counter(self.slot_paths).items():  # e.g. slots_torchrl_fast
            out["slots_" + path.replace("-", "_")] = count
        # what the pool decided (with "auto", from measurements at start-up)
        out["num_workers"] = self.num_workers
        out["envs_per_worker"] = self.envs_per_worker
        out["env_threads"] = int(bool(self.env_threads))
        out["idle_poll"] = int(bool(self.idle_poll))
        if reset:
            self._metrics.reset()
        return out

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
        their envs); any worker still running after ``timeout`` seconds is killed.

        Args:
            timeout (float, optional): seconds the workers get to exit. Defaults to ``1.0``.
        """
        if getattr(self, "_closed_for_good", False):
            return
        self._closed_for_good = True
        self._closed = True
        if hasattr(self, "_life_box"):
            _shutdown(self._procs, self._life_box, timeout)
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        self._life_r_close()
        for c in getattr(self, "_conns", []):
            c.close()
        for p in self._procs:
            if isinstance(p, ThreadWorker):
                p.close()
        for b in getattr(self, "_bells", []):
            b.close()
        if hasattr(self, "_consumer"):
            self._consumer.close()
        if hasattr(self, "_arena"):
            self._arena.close()
        if getattr(self, "_chunks", None) is not None:
            self._chunks.close()

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
    def worker_pids(self) -> list:
        """Process ids of the worker processes (``None`` for each worker of ``backend="threading"``)."""
        return [p.pid for p in self._procs]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (
            f"{type(self).__name__}(num_envs={self.num_envs}, num_workers={getattr(self, 'num_workers', 0)}, "
            f"envs_per_worker={getattr(self, 'envs_per_worker', None)}, "
            f"env_threads={getattr(self, 'env_threads', None)}, closed={self._closed})"
        )

    # -- errors -----------------------------------------------------------------------------
    def _local_consumer(self) -> SlotConsumer:
        self._check_usable()
        c = self._consumer_obj
        if c is None:
            c = self._consumer_obj = SlotConsumer(
                self._handle, pin_memory=self._pin_memory, arena=self._arena, death_info=self.death_info
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

    def death_info(self, w) -> str:
        """How worker ``w`` (a worker index) ended, for error messages: ``"killed by signal N"``
        or ``"exit code N"`` (``"exit code None"`` while it still runs)."""
        code = exit_code(self._procs[w], 0.05)
        return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"

    def _start_error(self, msg):
        _, _, index, (phase, tb) = msg
        self._error = EnvError(index, phase, tb)
        return self._error

    def _start_death(self, w):
        slots = np.flatnonzero(self._slot_worker == w).tolist()
        self._error = WorkerDiedError(
            f"worker {w} (pid {self._procs[w].pid}, hosting envs {slots}) died during start-up ({self.death_info(w)}). "
            "Workers start from a fork server that re-imports the main module: a script that builds a pool "
            "outside an `if __name__ == \"__main__\":` guard fails this way, and so does one read from standard "
            "input (`python - <<EOF`), which cannot be re-imported: save it to a file.",
            slots,
        )
        return self._error


def _shutdown(procs, life_w_box, timeout):
    """Closes the life pipe (workers exit at their next wake-up), then kills stragglers."""
    if life_w_box[0] >= 0:
        os.close(life_w_box[0])
        life_w_box[0] = -1
    deadline = time.monotonic() + timeout
    for p in procs:
        exit_code(p, max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if isinstance(p, ThreadWorker) and exit_code(p) is None]
    if hung and timeout > 0:  # a thread cannot be killed: it is left to end with its step (or with the process)
        warnings.warn(
            f"AsyncEnvPool(backend='threading'): worker threads {[p.name for p in hung]} did not stop within "
            f"{timeout}s (an env step that does not return?); they are daemon threads and keep running until "
            "their step returns or the process exits.",
            RuntimeWarning,
            stacklevel=3,
        )
    procs = [p for p in procs if not isinstance(p, ThreadWorker)]
    for p in procs:
        if exit_code(p) is None:
            p.kill()
    for p in procs:
        exit_code(p, 1.0)
    # what the envs started and left behind, a killed worker's above all
    killed = [p.pid for p in procs if kill_process_group(p.pid, alive=exit_code(p) is None)]
    until = time.monotonic() + 0.5  # gone (or zombies) before close() returns, ports and devices freed
    while killed and time.monotonic() < until:
        killed = [g for g in killed if _group_alive(g)]
        if killed:
            time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True


def kill_process_group(pid: int | None, *, alive: bool) -> bool:
    """SIGKILLs what is left of worker ``pid``'s process group (a worker leads one, which the
    processes its envs start join; see ``worker_main``); True if there was a group to kill.

    ``alive``: the worker process has not been seen to end. A process group id is never given to
    a new process while the group exists, so for a worker that ended, a live process with its
    pid is someone else (the pid was reused) and nothing is killed; with no such process, a
    group of that id is the worker's. A live worker that does not lead a group (it could not
    make one) is not killed here either."""
    if pid is None:
        return False
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:  # no process with that pid: a group of that id is the worker's
        pgid = pid
    except OSError:
        return False
    else:
        if not alive or pgid != pid:
            return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _check_factories(create_env_fn):
    if callable(create_env_fn) or not isinstance(create_env_fn, Sequence) or not len(create_env_fn):
        raise TypeError(
            "create_env_fn must be a non-empty list of callables returning EnvBase instances, "
            f"got {type(create_env_fn).__name__}."
        )
    for i, fn in enumerate(create_env_fn):
        if not callable(fn):
            raise TypeError(f"create_env_fn[{i}] must be callable, got {type(fn).__name__}.")
    return list(create_env_fn)


def _check_restart(on_env_failure, per_env, window_s, total):
    """The workers' :class:`~torchrl_asyncpool.workers.env_worker.RestartPolicy`, or ``None`` for ``"raise"``."""
    if on_env_failure not in ("raise", "restart"):
        raise ValueError(f"on_env_failure must be 'raise' or 'restart', got {on_env_failure!r}.")
    if isinstance(per_env, bool) or not isinstance(per_env, int) or per_env < 1:
        raise ValueError(f"max_restarts_per_env must be a positive int, got {per_env!r}.")
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0:
        raise ValueError(f"restart_window_s must be a positive number of seconds, got {window_s!r}.")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ValueError(f"max_restarts must be None or a positive int, got {total!r}.")
    return RestartPolicy(per_env, float(window_s), total) if on_env_failure == "restart" else None


def _check_seed(seed):
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise ValueError(f"seed must be None or a non-negative int (gymnasium refuses negative seeds), got {seed!r}.")


class _SeededFactory:
    """Builds the user's env and marks its first reset's seed (read by the worker's env adapter).
    Picklable when the wrapped factory is."""

    def __init__(self, create_env_fn, seed: int):
        self.create_env_fn = create_env_fn
        self.seed = int(seed)

    def __call__(self, **kwargs):
        env = self.create_env_fn(**kwargs)
        setattr(env, FIRST_SEED_ATTR, self.seed)
        return env


def _check_kwargs(kwargs, n):
    if kwargs is None:
        return [{} for _ in range(n)]
    if isinstance(kwargs, Mapping):
        return [dict(kwargs) for _ in range(n)]
    kwargs = list(kwargs)
    if len(kwargs) != n or not all(isinstance(k, Mapping) for k in kwargs):
        raise ValueError(f"create_env_kwargs must be a dict or a list of {n} dicts, got {kwargs!r}.")
    return [dict(k) for k in kwargs]



def _resolve_grouping(envs_per_worker, env_threads, adapter, n, threads=False):
    """``(envs per worker, threaded)``; the spec env is timed only for ``envs_per_worker="auto"``.
    ``threads``: the workers are threads of the pool's process (``backend="threading"``)."""
    if envs_per_worker != "auto" and (
        isinstance(envs_per_worker, bool) or not isinstance(envs_per_worker, int) or envs_per_worker < 1
    ):
        raise ValueError(f"envs_per_worker must be a positive int or 'auto', got {envs_per_worker!r}.")
    if not (env_threads is True or env_threads is False or env_threads == "auto"):
        raise ValueError(f"env_threads must be True, False or 'auto', got {env_threads!r}.")
    if envs_per_worker != "auto":
        k = min(envs_per_worker, n)
        return k, env_threads is True and k > 1
    blocking = _probe_blocking(adapter)
    if threads:
        # one GIL for every worker thread: CPU-bound envs gain nothing from more threads than one
        # (each would only add switches), envs that block each want a thread of their own
        if blocking and env_threads is not False:
            return 1, False
        return (1, False) if blocking else (n, env_threads is True and n > 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threaded = blocking if env_threads == "auto" else env_threads
    if blocking and not threaded:
        return 1, False  # stepped one after the other, blocking envs must not share a process
    # cheap envs: about one worker per core; blocking envs in threads: a few workers per core,
    # so that one process's GIL-held work (copies, the env's own Python) overlaps another's
    k = max(1, math.ceil(n / (cores * (_BLOCKING_WORKERS_PER_CORE if blocking else 1))))
    return k, threaded and k > 1


def _remote_groups(envs_per_worker, env_threads, first, fns, kwargs):
    """The slots of each worker for remote env slots: one worker per listening address (one
    port, one gRPC server), each slot waiting for its host in its own thread. ``first`` is the
    spec adapter (factory 0); the other factories are called here to read their addresses (a
    remote slot binds nothing until its worker listens). ``envs_per_worker`` may be left at
    the pool's default (1) or ``"auto"``: the addresses decide."""
    if envs_per_worker not in ("auto", 1) or isinstance(envs_per_worker, bool) or env_threads is False:
        raise ValueError(
            f"envs_per_worker={envs_per_worker!r}, env_threads={env_threads!r}: remote env slots are grouped by "
            "address (one worker listens on each address and steps its slots in threads); leave envs_per_worker "
            "and env_threads at their defaults (or 'auto'). Spread slots over several addresses to use more workers."
        )
    addresses = [first.env.unwrapped.address]
    for i in range(1, len(fns)):
        adapter = make_adapter(fns[i](**kwargs[i]), i)
        try:
            if remote_listener(adapter.env) is None:
                raise ValueError(f"create_env_fn[{i}] returned a local env, but the first factory returned a remote "
                                 "env slot; a pool hosts remote slots or local envs, not both.")
            addresses.append(adapter.env.unwrapped.address)
        finally:
            adapter.close()
    groups, seen = [], set()
    for address, run in itertools.groupby(range(len(addresses)), key=addresses.__getitem__):
        run = list(run)
        if address in seen:
            raise ValueError(f"the remote slots listening on {address} must come from consecutive factories "
                             f"(slot {run[0]} is apart from the others).")
        seen.add(address)
        groups.append(run)
    return groups


def _vector_grouping(envs_per_worker, env_threads, k):
    """``(envs per worker, threaded)`` for vector env factories: one vector env per worker."""
    if envs_per_worker not in ("auto", 1, k) or isinstance(envs_per_worker, bool):
        raise ValueError(
            f"envs_per_worker={envs_per_worker!r}: the factories return vector envs (gymnasium) or batched envs "
            f"(TorchRL) of {k} envs, and each is hosted by one worker; pass envs_per_worker='auto' (or {k})."
        )
    if env_threads is True:
        raise ValueError("env_threads=True: a vector env is stepped with one call for all its envs, not per thread.")
    if not (env_threads is False or env_threads == "auto"):
        raise ValueError(f"env_threads must be True, False or 'auto', got {env_threads!r}.")
    return k, False


#: workers per core for blocking envs stepped in threads. 2 cores, 64 envs sleeping 2 ms: 16 envs
#: per worker (2 per core) 68 % of N/latency, 32 (1 per core) 62 %, 8 (4 per core) 65 %, a
#: process per env 51 % (benchmarks/README.md)
_BLOCKING_WORKERS_PER_CORE = 2


def _probe_blocking(adapter, probe_s: float = 0.2, probe_steps: int = 32) -> bool:
    """Times a few steps of the spec env: True when it mostly waits (sleep, I/O) rather than computes."""
    adapter.reset()
    wall = cpu = 0.0
    steps = 0
    t_end = time.perf_counter() + probe_s
    while steps < probe_steps and time.perf_counter() < t_end:
        action = adapter.random_action()
        w0, c0 = time.perf_counter(), time.thread_time()
        _, _, term, trunc = adapter.step(action)
        wall += time.perf_counter() - w0
        cpu += time.thread_time() - c0
        steps += 1
        if term or trunc:
            adapter.reset()
    return wall > 2.0 * cpu and wall / max(steps, 1) > 2e-4


def _check_policy_outputs(spec, request, response) -> dict:
    if spec is None:
        return {}
    if hasattr(spec, "keys") and hasattr(spec, "shape") and not isinstance(spec, Mapping):
        spec = {k: (tuple(spec[k].shape), spec[k].dtype) for k in spec.keys(True, True)}
    if not isinstance(spec, Mapping):
        raise TypeError(f"policy_output_spec must be a mapping or a Composite spec, got {type(spec).__name__}.")
    out = {}
    for key, value in spec.items():
        if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, tuple):
            value = (tuple(value.shape), value.dtype)
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype)):
            raise ValueError(f"policy_output_spec[{key!r}] must be (shape, dtype) or a spec, got {value!r}.")
        if key in request or key in response:
            raise ValueError(f"policy_output_spec key {key!r} collides with an env observation/action key.")
        out[key] = (tuple(int(s) for s in value[0]), value[1])
    return out


def _shadowing_outputs(outputs, recurrent, request) -> list:
    """The policy outputs ``("next", *key)`` for a record entry ``key`` (an observation, the
    reward, a flag): in a transition, ``("next", *key)`` is the env's own next entry, which such
    an output would silently replace. The one exception is TorchRL's recurrent convention as the
    collector maps it (``{(CARRY_KEY, *key): ("next", *key)}`` for a primer key, see
    :func:`~torchrl_asyncpool.acting_policy.torchrl_recurrent_state`): the primer's entry is
    the policy's state, which the transitions deliver in its place. The pool refuses these
    outputs (``_check_next_outputs``); the collector leaves them out (the env's entry wins)."""
    observed = {as_key(k) for k in request}
    carried = {as_key(v) for h, v in recurrent.items() if as_key(h) == (CARRY_KEY, *as_key(v)[1:])}
    return [key for key in outputs
            if len(k := as_key(key)) > 1 and k[0] == "next" and k[1:] in observed and k not in carried]


def _check_next_outputs(outputs, recurrent, request) -> None:
    """Refuses the outputs of :func:`_shadowing_outputs`."""
    for key in _shadowing_outputs(outputs, recurrent, request):
        k = as_key(key)
        raise ValueError(
            f"policy_output_spec key {key!r} is where the transitions hold the env's own next "
            f"{k[1:] if len(k) > 2 else k[1]!r}; rename the output."
        )


def _check_recurrent(recurrent, outputs, request) -> dict:
    if not recurrent:
        return {}
    if not isinstance(recurrent, Mapping):
        raise TypeError(f"recurrent_state must map hidden_in keys to hidden_out keys, got {type(recurrent).__name__}.")
    for hidden_in, hidden_out in recurrent.items():
        if hidden_out not in outputs:
            raise ValueError(
                f"recurrent_state maps {hidden_in!r} -> {hidden_out!r}, but {hidden_out!r} is not declared in "
                f"policy_output_spec (declared: {list(outputs)})."
            )
        if hidden_in in request or hidden_in in outputs:
            raise ValueError(f"recurrent_state input key {hidden_in!r} collides with an existing key.")
    return dict(recurrent)
