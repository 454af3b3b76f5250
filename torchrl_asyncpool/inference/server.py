"""InferenceServer: the consumer of an AsyncEnvPool's slots, ``recv -> stage -> policy -> send``."""
from __future__ import annotations

import contextlib

import functools
import os
import threading
import traceback
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Callable, Dict, Optional

import torch

from torchrl_asyncpool._sys.forkserver import START_METHODS
from torchrl_asyncpool._sys.affinity import check_cpu_mask, set_process_affinity
from torchrl_asyncpool.exchange.consumer import ConsumerHandle, SlotConsumer
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool.inference._common import (
    DEFAULT_POLICY_NAME,
    BatchKey,
    InferenceServerError,
    ServerSpec,
    check_positive_int,
)
from torchrl_asyncpool.inference._loop import ServingLoop
from torchrl_asyncpool.inference._runner import PolicyFailure, check_weights, flatten_weights, named_tensors
from torchrl_asyncpool.inference._setup import build_runners, make_plans, policy_reads, version_stamping
from torchrl_asyncpool.inference._shared import (
    STATE_FAILED,
    STATE_SERVING,
    STATE_STOPPED,
    LocalWeights,
    StatsBlock,
)
from torchrl_asyncpool.inference.transport import ProcessSlotTransport, _as_handle
from torchrl_asyncpool._sys.threads import start_daemon_thread

__all__ = ["InferenceServer"]

_MODES = ("thread", "process")

#: the server of this process that last started on each pool, by ``id`` of the pool's
#: ConsumerHandle (the pool hands out one handle object). Two consumers on one pool would lease
#: and answer the same records; see ``InferenceServer._claim_pool``.
_SERVERS = weakref.WeakValueDictionary()
_SERVERS_LOCK = threading.Lock()


def _delivers_errors(method):
    """Marks the server's error as delivered when ``method`` raises it (so ``stop`` won't raise it again)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if exc is self.error:
                self._delivered = True
            raise

    return wrapper


def _policies_by_name(policy, policy_factory, policies, policy_factories) -> tuple:
    """``({name: policy object}, {name: policy factory})`` from the four ways of giving policies;
    each name given once, at least one policy, each one callable."""
    objects: Dict[str, Callable] = {}
    factories: Dict[str, Callable] = {}
    if policy is not None:
        objects[DEFAULT_POLICY_NAME] = policy
    if policy_factory is not None:
        factories[DEFAULT_POLICY_NAME] = policy_factory
    for what, given, into in (("policies", policies, objects), ("policy_factories", policy_factories, factories)):
        if given is None:
            continue
        if not isinstance(given, Mapping) or not given:
            raise TypeError(f"{what} must be a non-empty dict {{name: ...}}, got {type(given).__name__}.")
        for name, value in given.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"{what} names must be non-empty strings, got {name!r}.")
            if name in into:  # policy= / policy_factory= took the default name already
                raise ValueError(
                    f"policy name {name!r} is given twice: by {what} and by "
                    f"{'policy=' if into is objects else 'policy_factory='}; give each policy one name."
                )
            into[name] = value
    clash = sorted(set(objects) & set(factories))
    if clash:
        raise ValueError(f"policy names given both as a policy and as a factory: {clash}.")
    if not objects and not factories:
        raise ValueError("give a policy: policy=, policy_factory=, policies= or policy_factories=.")
    for name, value in {**objects, **factories}.items():
        if not callable(value):
            raise TypeError(f"policy {name!r} must be callable, got {type(value).__name__}.")
    return objects, factories


def _serving_mode(mode, objects: dict) -> str:
    """``"thread"`` or ``"process"``: ``mode`` as given, else ``"thread"`` for policy objects and
    ``"process"`` for factories alone; process mode cannot take policy objects."""
    if mode is None:
        mode = "thread" if objects else "process"
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}.")
    if mode == "process" and objects:
        raise ValueError(
            f"mode='process' builds policies in the server process: give factories (policy_factory= or "
            f"policy_factories=) instead of policy objects {sorted(objects)}."
        )
    return mode


class InferenceServer:
    """A central policy server for the env slots of an :class:`~torchrl_asyncpool.AsyncEnvPool`.

    The server is the pool's consumer: it waits until a batch is due, leases the ready
    records, splits them by batch key, pads each sub-batch to a bucket size, runs the key's
    policy and sends the actions (and every declared policy output) back. Env workers never
    hold a policy. It runs in a thread of the caller (``mode="thread"``, for small CPU
    policies) or in its own process (``mode="process"``, the default when policies are given
    as factories), bound through a :class:`ProcessSlotTransport`.

    Policies are callables ``TensorDict -> TensorDict`` such as a
    :class:`~tensordict.nn.TensorDictModule`. A policy sees a batch of bucket size ``[B]``
    holding every request key of the pool (observations, ``"reward"``, ``"step_type"``, the
    done flags, any recurrent ``hidden_in``), ``"env_index"`` and ``"valid_mask"`` (``False``
    on padding rows, which repeat the first valid row and whose outputs are discarded). It
    must write every action key and every policy output the pool declares (``hidden_out`` for
    recurrent policies), except the policy version, which the server stamps.

    Args:
        policy (callable, optional): the one policy to serve (thread mode), named ``"policy"``.

    Keyword Args:
        policy_factory (callable, optional): a zero-argument constructor of the one policy;
            the policy is built where it runs (in the server process by default).
        policies (dict, optional): ``{name: policy}`` to serve several policies.
        policy_factories (dict, optional): ``{name: factory}`` to serve several policies.
        policy_configs (dict, optional): ``{name: JSON-able dict}`` describing each policy
            (checkpoint, sampling mode...); it enters the config hash of the batch key.
        slot_keys (list, optional): one entry per env slot: the policy name (or its
            :class:`BatchKey` / ``(name, config_hash)`` tuple) that serves it. Required with
            several policies.
        bucket_sizes ("auto", None, sequence or dict, optional): padded batch sizes.
            ``"auto"`` (default): powers of two up to the largest batch of the key plus that
            size; ``None``: no padding; a sequence: those sizes (larger batches are split); a
            dict: one of these per policy name.
        min_get (int, optional): never flush fewer records. Defaults to ``1``.
        max_get (int, optional): flush as soon as this many records are ready, and never
            take more. ``None`` (default) is self-sizing: flush when half of the slots in
            flight (ready or being stepped) are ready (``flush_fraction``), taking everything
            ready.
        timeout (float, optional): flush deadline in seconds, counted from when the oldest
            ready record became ready. A batch is flushed when full OR at the deadline.
            Defaults to ``0.002``. ``"auto"``: greedy (``0``) for cheap envs; for envs whose
            step costs as much as a batch, a deadline of three eighths of the steps a worker
            takes before it comes back to an env (at most 5 ms per env in turn,
            :func:`~torchrl_asyncpool.inference.auto_flush_timeout`) is tried against greedy
            and the one under which the envs stepped faster is kept, tried again every 15 s
            (:class:`~torchrl_asyncpool.inference.FlushDeadline`). While it waits, the deadline
            alone ends the wait (records that became ready meanwhile do not wake the loop).
        device (str or torch.device, optional): where policies run. Defaults to ``"cpu"``.
        cuda_graphs (bool, optional): capture one CUDA graph per bucket (CUDA only).
        double_buffer (bool, optional): form batch N+1 while batch N runs on the device.
            Defaults to ``True`` on CUDA, ``False`` on CPU (where the forward is synchronous).
        policy_version_key (NestedKey, optional): where the policy version is stamped, when
            the pool declares this key in its ``policy_output_spec`` (int64 ``[]``).
            Defaults to ``"policy_version"``.
        mode (str, optional): ``"thread"`` or ``"process"``. Defaults to ``"process"`` when
            policies are given as factories, ``"thread"`` otherwise.
        num_threads (int, optional): ``torch.set_num_threads`` where the policies run: the
            server process, or the serving thread in thread mode (OpenMP thread counts are
            per thread; the caller's own count is left as it is). Defaults to ``1``: the
            batches of an acting policy are small, and on a machine whose cores step envs an
            intra-op team mostly waits for cores (measured on 2 cores with a 4-64-2 MLP: ~20 %
            fewer frames/s with 2 threads). ``None`` keeps the caller's count (thread mode)
            or torch's default (process mode). Torch also records the last count set as the
            default of threads started later in the process.
        mp_start_method (str, optional): ``"forkserver"`` (default) or ``"spawn"``.
        start_timeout (float, optional): seconds allowed for the server process to start.
        on_batch (callable, optional): ``on_batch(name, request, response)`` called after
            each batch is answered, with the valid request rows and the response (including
            the stamped version). It runs where the server runs (the server process in
            process mode, so it must be picklable); the tensors are reused afterwards.
        flush_fraction (float, optional): the self-sizing fraction. Defaults to ``0.5``.
        cpu_affinity (sequence of int, optional): a Linux CPU mask for where the policies run:
            the serving thread (thread mode; the caller's threads keep theirs) or the server
            process. ``None`` (default) leaves the mask inherited.

    Errors:
        Start-up validates everything it can before serving: unknown keys in
        ``slot_keys``, a policy that does not write a declared action or output, wrong
        shapes or dtypes, a recurrent state that does not fit the policy. These raise
        :class:`ValueError` from :meth:`start`. Once serving, a policy that raises, a dead
        server process or a failed env worker stop the server; the error
        (:class:`~torchrl_asyncpool.inference.InferenceServerError`, naming the batch key when
        a policy failed) is raised by :meth:`check`, :meth:`wait`, :meth:`stats`,
        :meth:`update_policy_weights_` and :meth:`stop`.

    Examples:
        >>> import functools, time, torch
        >>> from torchrl_asyncpool import AsyncEnvPool, InferenceServer
        >>> from torchrl_asyncpool.testing.policies import OracleTagPolicy
        >>> from torchrl_asyncpool.testing import OracleEnv
        >>> envs = [functools.partial(OracleEnv, env_id=i) for i in range(4)]
        >>> with AsyncEnvPool(envs, envs_per_worker=4,
        ...                   policy_output_spec={"policy_version": ((), torch.int64)}) as pool:
        ...     with InferenceServer(OracleTagPolicy(), max_get=4, timeout=0.01).start(pool) as server:
        ...         while server.stats()["frames"] < 100:
        ...             time.sleep(0.01)
        ...         version = server.update_policy_weights_(OracleTagPolicy(offset=5), wait=True)
        ...         print(server.mode, server.bucket_sizes, version)
        thread {'policy': (1, 2, 4)} 1
    """

    def __init__(
        self,
        policy: Optional[Callable] = None,
        *,
        policy_factory: Optional[Callable] = None,
        policies: Optional[Mapping] = None,
        policy_factories: Optional[Mapping] = None,
        policy_configs: Optional[Mapping] = None,
        slot_keys: Optional[Sequence] = None,
        bucket_sizes="auto",
        min_get: int = 1,
        max_get: Optional[int] = None,
        timeout: float = 0.002,
        device="cpu",
        cuda_graphs: bool = False,
        double_buffer: Optional[bool] = None,
        policy_version_key="policy_version",
        mode: Optional[str] = None,
        num_threads: Optional[int] = 1,
        mp_start_method: str = "forkserver",
        start_timeout: Optional[float] = 120.0,
        on_batch: Optional[Callable] = None,
        flush_fraction: float = 0.5,
        cpu_affinity: Optional[Sequence[int]] = None,
    ):
        objects, factories = _policies_by_name(policy, policy_factory, policies, policy_factories)
        mode = _serving_mode(mode, objects)
        self.names = list(objects) + list(factories)
        self._objects, self._factories = objects, factories
        self.mode = mode
        self._adopt_routing(policy_configs, slot_keys, bucket_sizes)
        self._adopt_batching(min_get, max_get, timeout, flush_fraction)
        self._adopt_placement(cpu_affinity, device, cuda_graphs, double_buffer)
        self.policy_version_key = policy_version_key
        self._adopt_process_options(num_threads, mp_start_method, start_timeout, on_batch)
        self._init_serving_state()

    def _adopt_routing(self, policy_configs, slot_keys, bucket_sizes) -> None:
        """Which policy serves which slot, under which config: checked and kept."""
        if policy_configs is not None and not isinstance(policy_configs, Mapping):
            raise TypeError(
                f"policy_configs must be a dict {{policy name: JSON-able dict}}, got {type(policy_configs).__name__}."
            )
        self.policy_configs = dict(policy_configs or {})
        if slot_keys is not None and (isinstance(slot_keys, (str, bytes)) or not isinstance(slot_keys, Sequence)):
            raise ValueError(
                f"slot_keys must be a sequence with one entry per env slot, got {type(slot_keys).__name__}."
            )
        self.slot_keys = list(slot_keys) if slot_keys is not None else None
        self._bucket_sizes_arg = bucket_sizes

    def _adopt_batching(self, min_get, max_get, timeout, flush_fraction) -> None:
        """When a batch is due and how large it may be: checked and kept."""
        self.min_get = check_positive_int("min_get", min_get)
        self.max_get = check_positive_int("max_get", max_get, allow_none=True)
        if timeout != "auto" and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                  or not timeout >= 0):
            raise ValueError(
                f"timeout must be 'auto' or a number of seconds >= 0 (a flush happens when a batch is full OR at "
                f"this deadline), got {timeout!r}."
            )
        self.timeout = timeout if timeout == "auto" else float(timeout)
        if (isinstance(flush_fraction, bool) or not isinstance(flush_fraction, (int, float))
                or not 0.0 < flush_fraction <= 1.0):
            raise ValueError(
                f"flush_fraction must be a number in (0, 1] (the share of the slots in flight that makes a "
                f"batch due), got {flush_fraction!r}."
            )
        self.flush_fraction = float(flush_fraction)

    def _adopt_placement(self, cpu_affinity, device, cuda_graphs, double_buffer) -> None:
        """Where the policies run (CPUs, device) and how the device is driven: checked and kept."""
        self.cpu_affinity = None if cpu_affinity is None else check_cpu_mask(cpu_affinity, "cpu_affinity")
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # the creator's mask
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:  # torch's own text names neither the argument nor the value
            raise ValueError(f"device={device!r} is not a device this process can use: {exc}") from exc
        self.cuda_graphs = bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device.")
        self.double_buffer = (self.device.type == "cuda") if double_buffer is None else bool(double_buffer)

    def _adopt_process_options(self, num_threads, mp_start_method, start_timeout, on_batch) -> None:
        """Threads, the server process's start (method, time allowed) and the per-batch hook: checked and kept."""
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(f"num_threads must be None or a positive int, got {num_threads!r}.")
        self.num_threads = num_threads
        if mp_start_method not in START_METHODS:
            raise ValueError(f"mp_start_method must be one of {START_METHODS}, got {mp_start_method!r}.")
        self.mp_start_method = mp_start_method
        if start_timeout is not None and (
            isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0
        ):
            raise ValueError(f"start_timeout must be None or a number of seconds > 0, got {start_timeout!r}.")
        self.start_timeout = start_timeout
        if on_batch is not None and not callable(on_batch):
            raise TypeError(
                f"on_batch must be callable as on_batch(name, request, response), got {type(on_batch).__name__}."
            )
        self.on_batch = on_batch

    def _init_serving_state(self) -> None:
        """What start-up, serving and stopping fill in: versions, pending weights, the backend, flags."""
        self._versions = {n: 0 for n in self.names}
        self._pending_weights: Dict[str, tuple] = {}
        self._backend = None
        self._spec: Optional[ServerSpec] = None
        self.batch_keys: Dict[str, BatchKey] = {}
        self.bucket_sizes: Dict[str, Optional[tuple]] = {}
        self._lock = threading.Lock()
        self._delivered = False
        self._starting = False
        self._stopped = False
        self._handle = None

    # -- start-up ---------------------------------------------------------------------------
    def start(self, pool, *, hold: bool = False) -> "InferenceServer":
        """Validates the configuration against the pool and starts serving it.

        Weights given to :meth:`update_policy_weights_` before ``start`` act from the first batch.

        Args:
            pool (AsyncEnvPool, ConsumerHandle or ProcessSlotTransport): what to serve. A
                transport selects process mode with that transport's options. Once started,
                do not call ``pool.recv``/``pool.send`` yourself.

        Keyword Args:
            hold (bool, optional): build and validate everything (the server process included)
                but lease no record until :meth:`release`; weights published meanwhile act from
                the first batch. Defaults to ``False``.

        Returns:
            this server (so that ``with server.start(pool):`` works).

        Raises:
            ValueError: the configuration does not fit the pool (see the class docstring).
            RuntimeError: this server was started already, or another server of this process
                serves the pool and was not stopped (two consumers would answer the same records).
        """
        if self._backend is not None:
            raise RuntimeError("this InferenceServer was already started; create a new one.")
        transport = pool if isinstance(pool, ProcessSlotTransport) else None
        if transport is not None and self.mode != "process":
            raise ValueError("a ProcessSlotTransport needs mode='process' (give policy factories).")
        handle = transport.handle if transport is not None else _as_handle(pool)
        self._claim_pool(handle)
        if hasattr(pool, "_served_by"):  # an AsyncEnvPool: its own recv/send now refuse (see there)
            pool._served_by = weakref.ref(self)
        try:
            return self._start(pool, transport, handle, hold)
        finally:
            self._starting = False

    def _claim_pool(self, handle) -> None:
        """Refuses a pool that another server of this process serves (or is starting on).

        The exchange has one consumer by design: two would lease the same ready slots and
        answer them twice. The claim is looked up, not released: a server whose serving thread
        or process has ended (stopped, failed, killed) no longer holds its pool.
        """
        with _SERVERS_LOCK:
            other = _SERVERS.get(id(handle))
            if other is not None and other is not self and other._handle is handle and other._holds_pool():
                raise RuntimeError(
                    f"this pool is already served by {other!r}, started in this process; stop() it before "
                    "starting another server on the pool (two consumers would lease and answer the same records)."
                )
            _SERVERS[id(handle)] = self
            self._handle = handle
            self._starting = True

    def _holds_pool(self) -> bool:
        """Whether this server may still lease or answer records of its pool."""
        return self._starting or (self._backend is not None and self._backend._running)

    def _start(self, pool, transport, handle, hold):
        layout = handle.layout
        targets = {**self._objects, **self._factories}
        plans, slot_key, _ = make_plans(
            layout, names=self.names, targets=targets, configs=self.policy_configs, slot_keys=self.slot_keys,
            bucket_sizes=self._bucket_sizes_arg, min_get=self.min_get, max_get=self.max_get,
        )
        stamp = version_stamping(layout, self.policy_version_key)
        spec = ServerSpec(
            names=self.names, plans=plans, slot_key=slot_key, min_get=self.min_get, max_get=self.max_get,
            timeout=0.0 if self.timeout == "auto" else self.timeout, auto_timeout=self.timeout == "auto",
            device=str(self.device), cuda_graphs=self.cuda_graphs,
            policy_version_key=self.policy_version_key, stamp_version=stamp, overlap=self.double_buffer,
            num_threads=self.num_threads, factories=dict(self._factories), on_batch=self.on_batch,
            flush_fraction=self.flush_fraction, cpu_affinity=self.cpu_affinity,
            # weights already in the policy objects carry their version; pending ones are sent after start
            initial_versions={n: v for n, v in self._versions.items() if n not in self._pending_weights},
        )
        self._spec = spec
        self.batch_keys = {p.name: BatchKey(p.name, p.config_hash) for p in plans}
        self.bucket_sizes = {p.name: p.buckets for p in plans}
        self.stamps_version = stamp
        # the backend starts held: weights given before start are published before the first lease
        if self.mode == "thread":
            # a pool that replaces dead or hung workers has the serving thread run its watchdog too
            watchdog = getattr(pool, "_watchdog", None) if getattr(pool, "_watched", False) else None
            backend = _ThreadBackend(spec, handle, self._objects, self._factories, getattr(pool, "death_info", None),
                                     watchdog)
            backend.start()
        else:
            backend = transport or ProcessSlotTransport(
                handle, mp_start_method=self.mp_start_method, num_threads=self.num_threads,
                start_timeout=self.start_timeout,
            )
            backend.start(spec, self.names, hold=True)
        self._backend = backend
        try:
            for name, (flat, version) in list(self._pending_weights.items()):
                backend.publish_weights(name, flat, version)
        except BaseException:
            self._backend = None
            backend.close(1.0)
            raise
        self._pending_weights.clear()
        if not hold:
            backend.release()
        return self

    def release(self) -> None:
        """Lets a server started with ``hold=True`` serve; does nothing once it serves (or before start)."""
        if self._backend is not None:
            self._backend.release()

    def set_cpu_affinity(self, cpu_affinity: Optional[Sequence[int]]) -> None:
        """Moves the running server to another CPU mask (``None``: every CPU its creator could
        use when it made the server): the serving thread in thread mode, every thread of the server process in process
        mode. Does nothing before :meth:`start` or after :meth:`stop`.

        Args:
            cpu_affinity (sequence of int or None): the new mask.
        """
        mask = None if cpu_affinity is None else check_cpu_mask(cpu_affinity, "cpu_affinity")
        backend = self._backend
        if backend is None:
            return
        target = mask if mask is not None else self._cpus
        if self.mode == "process":
            if self.pid is not None:
                set_process_affinity(self.pid, target)
        else:
            thread = getattr(backend, "_thread", None)
            if thread is not None and thread.is_alive() and thread.native_id is not None:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(thread.native_id, target)
        self.cpu_affinity = mask

    # -- state ------------------------------------------------------------------------------
    @property
    def pid(self) -> Optional[int]:
        """The server process id in process mode (``None`` in thread mode or before start)."""
        return getattr(self._backend, "pid", None) if self.mode == "process" else None

    @property
    def serving_thread_id(self) -> Optional[int]:
        """The native id (Linux ``tid``) of the serving thread in thread mode while it runs;
        ``None`` in process mode, before start or after stop."""
        thread = getattr(self._backend, "_thread", None) if self.mode != "process" else None
        return thread.native_id if thread is not None and thread.is_alive() else None

    @property
    def _process(self):
        """The server's :class:`multiprocessing.Process` in process mode, ``None`` otherwise (where
        TorchRL's process inference server keeps it)."""
        return getattr(self._backend, "_proc", None) if self.mode == "process" else None

    @property
    def is_alive(self) -> bool:
        """Whether the server is serving (started, not stopped, no error)."""
        return self._backend is not None and self._backend.is_alive

    @property
    def error(self) -> Optional[BaseException]:
        """The error that stopped the server, if any (without raising it)."""
        return None if self._backend is None else self._backend.error

    def check(self) -> None:
        """Raises the error that stopped the server, if any. Cheap: call it from any polling loop."""
        if self._backend is not None:
            try:
                self._backend.check()
            except BaseException:
                self._delivered = True
                raise

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the server stops or ``timeout`` passes; raises its error if it failed.

        Returns:
            whether the server has stopped.
        """
        if self._backend is None:
            return True
        done = self._backend.wait(timeout)
        self.check()
        return done

    def policy_version(self, name: Optional[str] = None) -> int:
        """The latest version published for policy ``name`` (the one served once applied).

        Args:
            name (str, optional): the policy's name; may be omitted when one policy is served.

        Raises:
            ValueError: if ``name`` is omitted while several policies are served.
            KeyError: for a name that is not served.
        """
        return self._versions[self._name(name)]

    def _name(self, name):
        if name is None:
            if len(self.names) != 1:
                raise ValueError(f"several policies are served ({self.names}): pass name=.")
            return self.names[0]
        if name not in self._versions:
            raise KeyError(f"unknown policy {name!r}; served policies: {self.names}.")
        return name

    # -- weights ----------------------------------------------------------------------------
    @_delivers_errors
    def update_policy_weights_(self, weights_or_module=None, name: Optional[str] = None, *,
                               version: Optional[int] = None,
                               wait: bool = False, timeout: Optional[float] = 30.0) -> int:
        """Sends new weights to a policy without restarting the server; bumps its version.

        The server applies them between two batches (never in the middle of one), and every
        batch served after that is stamped with the new version.

        Args:
            weights_or_module (nn.Module, TensorDict or state dict, optional): the new
                parameters and buffers, by the policy's own names
                (``TensorDict.from_module(policy)`` layout, or a ``state_dict`` including
                every buffer). ``None`` only bumps the version (thread mode: for a policy whose
                parameters you updated in place yourself).
            name (str, optional): the policy to update (required with several policies).

        Keyword Args:
            version (int, optional): the new version; defaults to the current one plus one.
            wait (bool, optional): block until the server serves with these weights.
            timeout (float, optional): the most ``wait`` blocks, in seconds.

        Returns:
            the new version.

        Raises:
            RuntimeError: the server was stopped (its weights would never act again).
            KeyError, ValueError: the weights' names or shapes do not match the policy's.
        """
        name = self._name(name)
        self.check()
        new_version = self._versions[name] + 1 if version is None else int(version)
        flat = None
        if weights_or_module is not None:
            flat = {k: v.detach().clone() for k, v in flatten_weights(weights_or_module).items()}
        with self._lock:
            backend = self._backend
            if self._stopped:
                raise RuntimeError(
                    f"the server is stopped: policy {name!r} is served no more, so these weights would never "
                    "act. A stopped server does not start again; create a new one (weights given before its "
                    "start act from its first batch)."
                )
            if backend is None:
                if flat is not None and name in self._objects:
                    _copy_into(self._objects[name], flat, name)
                elif flat is not None:
                    self._pending_weights[name] = (flat, new_version)
                self._versions[name] = new_version
                return new_version
            if flat is None and self.mode == "process":
                if backend.weight_names(name):
                    raise ValueError(
                        f"policy {name!r} lives in the server process: pass its new weights (a version-only "
                        "update is for policies without parameters)."
                    )
                flat = {}
            backend.publish_weights(name, flat, new_version)
            self._versions[name] = new_version
        if wait:
            if self.mode == "thread":
                backend.wait_applied(name, new_version, timeout)
            else:
                _wait_version(self, name, new_version, timeout)
        return new_version

    # -- stats ------------------------------------------------------------------------------
    @_delivers_errors
    def stats(self, reset: bool = False) -> dict:
        """Server statistics (keys in ``torchrl_asyncpool.inference.STAT_KEYS``).

        Args:
            reset (bool, optional): start a new measurement window after reading.
        """
        if self._backend is None:
            raise RuntimeError("the server is not started.")
        self.check()
        block = self._backend.stats_block
        out = block.as_dict()
        out["mode"] = self.mode
        # TorchRL's: the latest version given (applied or not), of the first policy when there are several
        out["policy_version"] = next(iter(self._versions.values()), 0)
        if reset:
            block.reset_baseline()
        return out

    # -- shutdown ---------------------------------------------------------------------------
    def stop(self, timeout: Optional[float] = 5.0, *, raise_errors: bool = True) -> None:
        """Stops serving (the current batch is finished first) and releases everything. Idempotent.

        ``close`` and ``shutdown`` (TorchRL's name) are aliases.

        Args:
            timeout (float, optional): seconds to wait for the server to finish its batch;
                a server process still running then is killed. ``None`` waits as long as it takes.
            raise_errors (bool, optional): raise the error that stopped the server, if it was
                not raised to the caller already (by :meth:`check` and the like).
        """
        backend = self._backend
        if backend is None:
            return
        with self._lock:  # an update_policy_weights_ in flight finishes first; later ones are refused
            self._stopped = True
        backend.close(timeout)
        if raise_errors and backend.error is not None and not self._delivered:
            self._delivered = True
            raise backend.error

    close = stop
    shutdown = stop  # TorchRL's InferenceServer name

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.stop(raise_errors=exc_type is None)

    def __del__(self):
        backend = getattr(self, "_backend", None)
        if backend is not None:
            try:
                backend.close(1.0)
            except Exception:  # noqa: BLE001
                pass

    def __repr__(self):
        return (
            f"{type(self).__name__}(mode={self.mode!r}, policies={self.names}, device={str(self.device)!r}, "
            f"max_get={self.max_get}, timeout={self.timeout}, alive={self.is_alive})"
        )


def _copy_into(policy, flat, name):
    targets = named_tensors(policy)
    check_weights(targets, flat, name)
    with torch.no_grad():
        for k, dst in targets.items():
            dst.copy_(flat[k])


def _wait_version(server, name, version, timeout):
    import time

    k = server.names.index(name)
    deadline = None if timeout is None else time.monotonic() + timeout
    block = server._backend.stats_block
    while block.version(k) < version:
        server.check()
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"the server did not apply version {version} of policy {name!r} within {timeout}s.")
        time.sleep(0.002)


class _ThreadBackend:
    """Serves from a thread of the calling process."""

    def __init__(self, spec: ServerSpec, handle: ConsumerHandle, objects, factories, death_info, watchdog=None):
        self.spec = spec
        self.handle = handle
        self.objects = dict(objects)
        self.factories = dict(factories)
        self.death_info = death_info
        self.watchdog = watchdog
        self.error: Optional[BaseException] = None
        self._thread = None
        self._stop = None
        self._release = None
        self._closed = False

    def start(self):
        """Starts the serving thread held: it leases nothing until :meth:`release`."""
        policies = dict(self.objects)
        for name, factory in self.factories.items():
            policies[name] = factory()
        self.policies = policies
        keys = policy_reads(policies.values(), self.handle.layout, self.spec.on_batch)
        consumer = SlotConsumer(self.handle, death_info=self.death_info, keys=self.spec.lease_keys(keys),
                                watchdog=self.watchdog)
        self.runners = build_runners(self.spec, policies, self.handle.layout, consumer.arena.request, keys)
        self.stats_block = StatsBlock(self.spec.names)
        self.weights = LocalWeights(self.spec.names)
        self._stop = Doorbell()
        self._release = Doorbell()
        self.loop = ServingLoop(
            consumer, self.runners, self.spec, self.stats_block, self.weights, [self._stop.fd],
            on_batch=self.spec.on_batch, hold_fd=self._release.fd,
        )
        self.stats_block.set_state(STATE_SERVING)
        self._thread = start_daemon_thread(self._main, "torchrl_asyncpool-inference", self.spec.num_threads)

    def _main(self):
        try:
            if self.spec.cpu_affinity is not None:  # pid 0: this thread only
                os.sched_setaffinity(0, self.spec.cpu_affinity)
            self.loop.serve()  # at spec.num_threads: start_daemon_thread set it
            self.stats_block.set_state(STATE_STOPPED)
        except PolicyFailure as failure:
            self.error = InferenceServerError(failure.message, failure.key, failure.tb)
            self.error.__cause__ = failure.__cause__
            self.stats_block.set_state(STATE_FAILED)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.error = InferenceServerError(
                f"the inference server stopped: {type(exc).__name__}: {exc}", None, traceback.format_exc()
            )
            self.error.__cause__ = exc
            self.stats_block.set_state(STATE_FAILED)

    @property
    def is_alive(self):
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def _running(self):
        """Whether the serving thread still runs (it may touch the pool's slots)."""
        return self._thread is not None and self._thread.is_alive()

    def check(self):
        if self.error is not None:
            raise self.error

    def wait(self, timeout=None):
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def publish_weights(self, name, flat, version):
        self.check()
        k = self.spec.names.index(name)
        runner = self.runners[k]
        if flat is None:
            flat = {n: t.detach().clone() for n, t in named_tensors(runner.policy).items()}
        else:
            check_weights(named_tensors(runner.policy), flat, name)
        self.weights.publish(name, flat, version)

    def release(self):
        if self._release is not None and not self._closed:
            self._release.ring()

    def wait_applied(self, name, version, timeout):
        if not self.weights.wait_applied(name, version, timeout, lambda: self.is_alive):
            self.check()
            raise TimeoutError(f"the server did not apply version {version} of policy {name!r} within {timeout}s.")

    def weight_names(self, name):
        return list(named_tensors(self.runners[self.spec.names.index(name)].policy))

    def close(self, timeout=5.0):
        if self._closed:
            return
        self._closed = True
        if self._stop is not None:
            self._stop.ring()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                warnings.warn("the inference server thread did not stop within the timeout (a long policy call?).")
        if self._thread is None or not self._thread.is_alive():
            for bell in (self._stop, self._release):
                if bell is not None:
                    bell.close()
