"""AsyncPoolCollector: TorchRL's AsyncBatchedCollector over the v2 exchange."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence

import torch
from tensordict import TensorDictBase
from torchrl.collectors import AsyncBatchedCollector
from torchrl.collectors._base import BaseCollector
from torchrl.envs.utils import ExplorationType

from torchrl_asyncpool.collector.action_checks import action_checks
from torchrl_asyncpool.collector.acting_policy import WEIGHT_PREFIX, ActingPolicy, ActingPolicyFactory
from torchrl_asyncpool.collector.config import CollectorConfig, as_int, check_slot_transport, check_transport_keys
from torchrl_asyncpool.inference import FlushDeadline, InferenceServer, InferenceServerError, flatten_weights
from torchrl_asyncpool.errors import EnvError, PoolClosedError, WorkerDiedError, error_summary
from torchrl_asyncpool.exchange.metrics import log_metrics
from torchrl_asyncpool.collector.policy_cost import batch_gain, measure_policy_cost
from torchrl_asyncpool.collector.policy_layout import PolicyLayout
from torchrl_asyncpool.collector.traj_ids import MASK_KEY, TRAJ_IDS_KEY, TrajectoryIds, env_major
from torchrl_asyncpool.collector.workload_plan import (
    START_UNPINNED_PROBE_S, AffinityPlan, shared_split, shared_worker_masks, startup_workers_per_core,
)
from torchrl_asyncpool._sys.cpu_time import CpuMeter
from torchrl_asyncpool.pool.env_pool import AsyncEnvPool
from torchrl_asyncpool.pool.layout import SpecEnv
from torchrl_asyncpool.pool.plan import PoolPlan
from torchrl_asyncpool._sys.affinity import pinned
from torchrl_asyncpool._sys.threads import start_daemon_thread

__all__ = ["AsyncPoolCollector"]

_ENV_IDX_KEY = "env_index"
# Chunk memory ceiling for transition_chunk_size="auto": pixel envs would otherwise pin GBs.
_AUTO_CHUNK_BYTES = 256 * 2**20
# The flush deadline: greedy for cheap envs, where records that arrive while the policy runs
# form the next batch anyway and a deadline only idles envs (1 ms cost CartPole 25 % on 2 cores);
# for costly steps a deadline is tried against greedy (inference.FlushDeadline): it won Atari
# (batches of ~1 record when greedy) and lost 16 sleeping envs.
_DEFAULT_FLUSH_TIMEOUT = "auto"


class AsyncPoolCollector(AsyncBatchedCollector):
    """A drop-in :class:`~torchrl.collectors.AsyncBatchedCollector` on the v2 shared-memory exchange.

    Env workers (:class:`~torchrl_asyncpool.AsyncEnvPool`, worker-owned autoreset) publish
    records into slots; a central policy loop batches whatever is ready (deadline batch
    former) and answers; each worker assembles its envs' transitions into dense per-env
    chunks in shared memory, and the driver concatenates them into exactly
    ``frames_per_batch`` transitions in TorchRL's layout (root observation, ``"done"``,
    ``"terminated"`` and ``"truncated"`` (those of the record the action answered: ``False``,
    as in TorchRL's collectors), action, policy outputs, ``("next", obs..., "reward", "done",
    "terminated", "truncated")``, ``"env_index"``, ``"policy_version"`` and TorchRL's
    ``("collector", "traj_ids")`` (one id per episode of one env, carried across batches, as
    TorchRL's other collectors write it). Nothing crosses a pipe on the data path.

    A batch is a row of per-env chunks (one env's consecutive transitions each, in the order
    they completed), not a ``[num_envs, T]`` block. TorchRL's value estimators (``GAE``, ...) run
    along the last batch dim and cut only where an episode ends, so on such a row they would
    carry one env's advantages into the next env's chunk: for on-policy learning pass
    ``batch_layout="env_major"``, and every batch is ``[num_envs, T]`` as
    ``Collector(ParallelEnv)`` gives it (each row one env's consecutive transitions,
    left-padded, with ``("collector", "mask")``), on which ``GAE(...)(batch)`` is exact; then
    ``batch[batch["collector", "mask"]]`` holds the ``frames_per_batch`` real transitions. The
    flat default is the layout of TorchRL's ``AsyncBatchedCollector`` and what a replay buffer
    takes (:func:`~torchrl_asyncpool.collector.traj_ids.by_trajectory` and TorchRL's
    :func:`~torchrl.collectors.utils.split_trajectories` regroup it by trajectory).

    The envs are built and reset when the collector is constructed, and the inference server
    is started and validated then too, but no action is served before the first iteration
    (or :meth:`start`): weights given to :meth:`update_policy_weights_` before then act from
    the first transition, as TorchRL applies them before any request is served. Before the
    workers start, one env is built (and closed) in this process and the policy runs once on a
    zero record, to learn what the policy writes (see :mod:`torchrl_asyncpool.collector.policy_layout`).
    A policy that fails on it is reported there, as a ``ValueError`` that shows the record's
    entries, shapes and dtypes (the policy's own exception as ``__cause__``) and, where the
    env's float observations and the policy's parameters differ in dtype (gymnasium's MuJoCo
    envs observe float64), both dtypes and the fixes.

    Recurrent policies in TorchRL's setup (an ``LSTMModule``/``GRUModule`` whose
    ``make_tensordict_primer()`` is in the env, usually with ``InitTracker``) work as with
    TorchRL's collectors: the state the policy writes at ``("next", key)`` is the next step's
    ``key`` (zeros when an episode starts), carried by the env's worker in its slot, and
    batches hold the state the policy read at ``key`` and the one it wrote at
    ``("next", key)``. It applies to the policy's ``("next", key)`` outputs for which ``key``
    is a ``TensorDictPrimer`` entry of the env (read from the transforms of the env built in
    this process); any other ``("next", key)`` the env observes is the env's, as in TorchRL.

    Args:
        create_env_fn (list of callables): one factory per env (a list, as in TorchRL:
            ``[make_env] * n`` for ``n`` copies; a single callable raises :class:`TypeError`),
            returning a TorchRL :class:`~torchrl.envs.EnvBase` (batch size ``()``) or a plain
            :class:`gymnasium.Env` (fast path, no TensorDict work per step in the worker), or
            a :class:`gymnasium.vector.VectorEnv` or a TorchRL env with ``batch_size=[k]`` of
            ``k`` envs (every factory the same ``k``; its envs are stepped in lockstep by one
            worker and delivered as ``k`` envs with their own ``"env_index"``, see
            :class:`~torchrl_asyncpool.AsyncEnvPool`).

    Keyword Args:
        policy (callable, optional): a ``TensorDict -> TensorDict`` policy (e.g. a
            :class:`~tensordict.nn.TensorDictModule`) writing the action keys. Mutually
            exclusive with ``policy_factory``.
        policy_factory (callable, optional): zero-argument callable returning the policy.
        frames_per_batch (int): transitions per yielded batch (exact).
        total_frames (int, optional): total transitions over the collector's life; ``-1``
            (default) is endless.
        replay_buffer (ReplayBuffer, optional): each batch is written with one ``extend``
            and iteration yields ``None``; :meth:`start` collects in the background.
        postproc (callable, optional): applied to each batch before it is yielded/written.
        yield_completed_trajectories (bool, optional): yield one completed trajectory per
            iteration instead of fixed-size batches.
        return_same_td (bool, optional): TorchRL's option: every batch is written into the
            TensorDict the previous one was returned in, and that same object is yielded again,
            so nothing is allocated per batch. Without it a new batch is written into the memory
            of an earlier one that nothing references any more (no tensor, view, numpy array or
            autograd graph of it is alive), where there is one: a ``for`` loop that drops each
            batch gets its batches in two buffers in turn, without the first-touch page faults of
            fresh memory (on Atari, 2 x 28 KB observations a transition, they cost the learner's
            thread ~5 us of CPU a transition). With ``return_same_td`` a batch is valid only
            until the next one is requested: keep what you need with ``.clone()``. With
            ``replay_buffer=`` the batch is copied into the buffer's storage (a
            :class:`~torchrl.data.ListStorage`, which keeps references, is refused). Defaults to
            ``False``; not with ``yield_completed_trajectories``.
        max_batch_size (int, optional): largest inference batch (``max_get``). Defaults to
            ``None``: every ready record is taken, and the flush size sizes itself to half the
            envs in flight.
        min_batch_size (int, optional): smallest inference batch (``min_get``). Defaults to 1.
        server_timeout (float or "auto", optional): inference flush deadline in seconds: a
            batch is run when the flush size is reached OR the oldest ready record has waited
            this long. Defaults to ``"auto"``: greedy (``0``) for cheap envs such as CartPole,
            where records arriving while the policy runs form the next batch anyway and a
            deadline only idles envs; for envs whose step costs as much as a batch (Atari, a
            simulator), where a greedy loop answers batches of about one record, a deadline of
            three eighths of the steps a worker takes before it comes back to an env (at most 5 ms
            per env in turn, :func:`~torchrl_asyncpool.inference.auto_flush_timeout`) is tried against greedy
            and kept only if the envs step faster with it (it pays when the CPUs are the
            bottleneck, not when the envs sleep or wait; while it waits, the deadline alone
            ends the wait, not a flush size reached meanwhile), tried again every 15 s
            (:class:`~torchrl_asyncpool.inference.FlushDeadline`; :meth:`plan` shows the
            trials). Pass seconds to
            fix it (TorchRL's examples use ``0.001``); raise it for a GPU policy whose per-call
            cost dominates.
        server_config (InferenceServerConfig, optional): TorchRL's structured server
            configuration, mutually exclusive with the three keywords above. Its
            ``max_batch_size``, ``min_batch_size`` and ``timeout`` are used;
            ``static_batch_size`` pads every batch to that size (a CUDA graph is captured on
            CUDA); ``service_backend="process"`` requires ``policy_factory`` (``TypeError``, as
            in TorchRL), and ``"thread"`` (its default) leaves the choice to
            ``policy=``/``policy_factory=``; any ``max_inflight_per_env`` holds, as an env has one
            request in flight at a time. ``collect_stats=False``, a ``stats_window_size`` other
            than TorchRL's default and ``service_backend="ray"`` raise :class:`ValueError`.
        device (torch.device or str, optional): where the policy runs. A CUDA device without
            CUDA raises :class:`ValueError`. Mutually exclusive with ``device_config``
            (:class:`ValueError`).
        device_config (InferenceDeviceConfig, optional): TorchRL's structured device
            configuration: the policy runs on ``device_config.policy_device`` and batches are
            stored on CPU unless ``device_config.storing_device`` says otherwise. An
            ``output_device`` or ``env_device`` other than the CPU raises :class:`ValueError`:
            the envs step in worker processes on actions in shared CPU memory.
        policy_version_key (NestedKey, optional): key stamping every transition with the
            version of the policy that acted; ``None`` disables it. Defaults to
            ``"policy_version"``.
        policy_version (int, optional): initial version. Defaults to 0.
        exploration_type (ExplorationType, optional): under which the policy acts. Defaults to
            ``ExplorationType.RANDOM``.
        create_env_kwargs (dict or list of dicts, optional): factory keyword arguments.
        envs_per_worker (int or "auto", optional): envs hosted by one worker process.
            ``"auto"`` (default) times the env: CPU-bound envs are grouped about one worker per
            core, blocking envs (sleep, I/O) about two workers per core, each env stepped in its
            own thread (see ``env_threads``). Envs of a few tens of microseconds a step (MuJoCo)
            are grouped two workers per core where the policy, at the cost timed at start-up,
            is predicted to leave its CPU room for some of them (``worker_affinity``: the
            ``"shared"`` layout; a cheap policy does, PPO's ``TanhNormal`` actor does not; see
            :func:`~torchrl_asyncpool.collector.workload_plan.startup_workers_per_core` and the
            tuning guide).
        env_threads (bool or "auto", optional): step each env of a worker in its own thread, so
            that envs whose step blocks overlap inside one process. ``"auto"`` (default): when
            the timed env blocks. See :class:`~torchrl_asyncpool.AsyncEnvPool`.
        transition_chunk_size (int or "auto", optional): consecutive transitions per
            chunk. ``"auto"`` (default): ``frames_per_batch // (num_envs * chunks_per_env)``
            (at least 1), and small enough that the chunk buffers stay under 256 MiB. All the
            chunks the envs may fill ahead of the learner then hold about one batch, so after a
            weight update at most about one batch (plus the one action per env answered before
            it) was collected by the previous policy; with TorchRL's floor of 64 per chunk that
            was ``2 * 64 * num_envs`` transitions (8 whole batches for 4 envs and 64-frame
            batches). The cost is more chunks per batch: measured on 2 cores with CartPole and
            1024-frame batches, 32 envs (16 per chunk) collected as fast as with 64 per chunk,
            128 envs (4 per chunk) about 10 % slower (within this machine's drift), and the
            first batch came sooner. For off-policy training with many envs, where staleness
            matters less, pass ``transition_chunk_size=64``.
        chunks_per_env (int, optional): chunks each env may fill ahead of the learner
            (default 2). Envs stop (back-pressure) once all their chunks wait for the learner, so
            this bounds how stale on-policy data can get: ``1`` keeps batches closest to the
            current policy, more lets envs run ahead while the learner trains.
        policy_num_threads (int, optional): ``torch.set_num_threads`` where the policy runs
            (the serving thread with ``policy=``, the server process with ``policy_factory=``).
            Defaults to ``1``: an acting policy's batches are small and the cores step envs;
            ``None`` keeps your thread's count (``policy=``) or torch's default. Your own
            thread's count is not changed. See the tuning guide's "Torch threads".
        worker_affinity (sequence of CPU index sequences, callable, "auto" or None, optional):
            TorchRL's option: Linux CPU masks for the env worker processes, one per worker or a
            callable ``worker_index -> mask`` (see :class:`~torchrl_asyncpool.AsyncEnvPool`).
            ``"auto"`` (default): when the workers step their envs without threads (cheap,
            CPU-bound envs), every worker on the CPUs after the first one this process may use;
            none pinned with env threads (blocking envs), fewer than two CPUs or
            ``policy_num_threads`` other than ``1``. While the collector runs, the env step the
            workers measure moves that partition: a share of the workers joins the policy's CPU
            when a step costs a few tens of microseconds and the pool has two workers a CPU or
            more (``"shared"``), every process runs on every CPU when a step costs more (Atari); see
            :mod:`torchrl_asyncpool.collector.workload_plan` and :meth:`plan`. ``None``: not
            pinned (TorchRL's default).
        driver_affinity (sequence of int, "auto" or None, optional): TorchRL's option: a Linux CPU
            mask for where the policy runs (the serving thread with ``policy=``, the server
            process with ``policy_factory=``), for the background thread of :meth:`start`, and
            for the thread iterating the collector while it waits for and copies a batch (its
            own mask is back before the batch is yielded: your training code keeps it); the
            constructing thread keeps its own mask. ``"auto"`` (default): the policy alone,
            on the first CPU this process may use, when the workers took the ``"auto"``
            partition above; ``None``: nothing pinned. See :mod:`torchrl_asyncpool._sys.affinity`
            for the partition and what it measured; pass ``None`` to both when other work
            shares these cores.
        exchange (str, optional): ``"auto"`` (default), ``"native"`` or ``"python"``: who
            leases and answers the slots in the policy server, the C engine built with the
            package or the pure-Python reference (see :class:`~torchrl_asyncpool.AsyncEnvPool`).
        idle_poll (bool or "auto"): whether the workers' and the policy server's waits
            idle-poll (see :class:`~torchrl_asyncpool.AsyncEnvPool`); ``"auto"`` (default)
            turns it on for CPU-bound workers where idle cores wake slowly, or follows
            ``TORCHRL_ASYNCPOOL_IDLE_POLL`` when that is set. Off with ``env_backend="threading"``.
        env_backend (str, optional): TorchRL's option: ``"multiprocessing"`` (default, TorchRL
            0.15's default) runs the envs in worker processes; ``"threading"`` steps them in
            threads of this process on the same shared-memory exchange, policy loop and chunk
            delivery (every feature and guarantee holds the same): nothing is spawned (with
            ``policy_factory=`` too, the policy is then served from a thread here unless
            ``server_config`` asks for a process), start-up takes milliseconds and factories need
            not be picklable. It suits tests, envs that release the GIL while they step (most
            simulators written in C/C++, I/O-bound envs) and envs that cannot be pickled; its cost
            is the GIL: the envs' Python work, the policy's and your training loop's take turns
            on one core (cheap CPU-bound envs group into one worker thread). ``worker_affinity``
            masks and ``env_exchange="shm"`` are refused with it, as in TorchRL.
        backend (str, optional): TorchRL's option: the default of ``env_backend`` (and of
            ``policy_backend``) when those are not given.
        cast_actions (bool, optional): cast a float action with fractional values for an
            integer/boolean action spec, as ``Tensor.to`` does (truncation), instead of raising.
            Defaults to ``False``: the collector checks every action its policy writes before an
            env steps on it (see :mod:`torchrl_asyncpool.collector.action_checks`): dtype (whole-number
            floats are cast exactly), NaN/inf (always refused), and the bounds of discrete specs.
            A refused action raises :class:`ValueError` at construction (the server's first dry
            run) or :class:`~torchrl_asyncpool.InferenceServerError` while collecting, naming the
            policy, the key, what was given, what the spec expects and the envs.
        on_env_failure (str, optional): ``"raise"`` (default): an env that raises ends the
            collection with :class:`~torchrl_asyncpool.EnvError`. ``"restart"``: the env is rebuilt
            in its worker and collection goes on; the episode it cut ends with a truncation marked
            ``("next", "env_restarted")``. With ``policy_factory=``, a dead inference server
            process is replaced too (same factory, last weights and version; the records it had
            leased are answered by the new one), and so is a dead env worker process. See
            :doc:`failures`.
        max_restarts_per_env, restart_window_s, max_restarts: the restart budget of
            ``on_env_failure="restart"`` (see :class:`~torchrl_asyncpool.AsyncEnvPool`).
        step_timeout (float, optional): seconds an env's step (or reset) may take before its
            worker process is killed (and replaced with ``on_env_failure="restart"``); see
            :class:`~torchrl_asyncpool.AsyncEnvPool`. ``None`` (default): no limit.
        build_timeout (float, "auto" or None, optional): seconds a rebuild of an env from its
            factory may take (``on_env_failure="restart"``); a hung build is killed and counted
            against the env's budget. ``"auto"`` (default): ten times the workers' measured
            start-up, at least 60 s. See :class:`~torchrl_asyncpool.AsyncEnvPool`.
        track_traj_ids (bool, optional): TorchRL's ``Collector`` option: write
            ``("collector", "traj_ids")`` into every batch, one id per episode of one env, carried
            across batches (see :mod:`~torchrl_asyncpool.collector.traj_ids`). Defaults to
            ``True``, as TorchRL's ``Collector`` and multi-process collectors write them (its
            ``AsyncBatchedCollector`` does not: ``False`` gives its exact key set).
        batch_layout (str, optional): ``"flat"`` (default): ``[frames_per_batch]``, a row of
            per-env chunks (TorchRL's ``AsyncBatchedCollector`` layout, what a replay buffer
            takes). ``"env_major"``: ``[num_envs, T]`` with dims named ``[None, "time"]``, row
            ``e`` env ``e``'s transitions of the batch in time order, left-padded to the longest
            row, ``("collector", "mask")`` marking the ``frames_per_batch`` real ones (see
            :func:`~torchrl_asyncpool.collector.traj_ids.env_major`): TorchRL's value estimators
            are exact on it (``GAE(...)(batch)``), as on ``Collector(ParallelEnv)``'s batches;
            ``T`` varies from batch to batch, as envs step at their own pace. Not with
            ``replay_buffer=``, ``yield_completed_trajectories`` or ``return_same_td``
            (:class:`ValueError`).
        check_action_bounds (bool, optional): check that actions lie in a ``Categorical``,
            ``OneHot``, ``Binary`` or integer ``Bounded`` spec (and an integer dtype's range).
            Defaults to ``True``; ``False`` saves a few tensor reductions per batch.
        seed (int, optional): seeds env ``i``'s first reset with ``seed + i`` (see
            :class:`~torchrl_asyncpool.AsyncEnvPool`): each env's trajectory is then
            reproducible under a deterministic policy, though the order in which transitions
            of different envs fill a batch still depends on timing. The envs reset when the
            collector is built, so this is the way to seed them; :meth:`set_seed` cannot.
            Defaults to ``None``.
        post_collect_hook (callable, optional): called with each batch before it is yielded.
        verbose (bool, optional): print start-up and shutdown timings.

    With ``policy_factory`` the policy is served from a dedicated inference process (SEED
    style), with ``policy`` from a thread of this process; ``max_batch_size``,
    ``min_batch_size`` and ``server_timeout`` configure either.

    Every keyword of TorchRL 0.14.1's ``AsyncBatchedCollector`` is accepted with TorchRL's
    meaning or refused with TorchRL's exception type: ``transport="driver"`` serves the policy
    from this process (also with ``policy_factory``), ``transport="auto"`` leaves the choice to
    this collector; ``env_exchange`` (``"auto"``/``"shm"``: the exchange is always shared memory),
    ``policy_backend`` (``"threading"``/``"multiprocessing"``), ``reset_at_each_iter=False``,
    ``weight_sync=None`` and ``weight_sync_model_id="policy"`` take only the values that describe
    what this collector does, and any other value raises :class:`ValueError` instead of being
    ignored; a keyword that neither this collector nor TorchRL's takes raises
    :class:`TypeError`, as Python does. Giving both ``policy`` and ``policy_factory``, or
    neither, raises TorchRL's :class:`TypeError` (also a :class:`ValueError`). See
    :doc:`coming_from_torchrl` for what differs and why.
    ``transport=`` may also be a TorchRL
    :class:`~torchrl.modules.inference_server.ProcessSlotTransport` built by hand (as in TorchRL's
    own examples): it implies ``policy_factory=``, and its request/response keys are checked
    against the env's observations and the policy's outputs (a mismatch raises
    :class:`ValueError`), while the slots themselves always come from the shared-memory exchange.

    Examples:
        >>> import torch.nn as nn
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl_asyncpool import AsyncPoolCollector
        >>> from torchrl_asyncpool.testing import ZeroLatencyEnv
        >>> policy = TensorDictModule(nn.Linear(4, 1), in_keys=["observation"], out_keys=["score"])
        >>> def act(td):
        ...     policy(td)
        ...     return td.set("action", (td["score"].squeeze(-1) > 0).long())
        >>> collector = AsyncPoolCollector([ZeroLatencyEnv] * 4, policy=act, frames_per_batch=64, total_frames=128)
        >>> for batch in collector:
        ...     print(batch.shape, batch["next", "reward"].shape)
        torch.Size([64]) torch.Size([64, 1])
        torch.Size([64]) torch.Size([64, 1])
        >>> collector.shutdown()
    """

    def __init__(
        self,
        create_env_fn: Sequence[Callable],
        *,
        policy: Callable | None = None,
        policy_factory: Callable[[], Callable] | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        max_batch_size: int | None = None,
        min_batch_size: int | None = None,
        server_timeout: float | None = None,
        device: torch.device | str | None = None,
        postproc: Callable | None = None,
        exploration_type: ExplorationType = ExplorationType.RANDOM,
        replay_buffer=None,
        post_collect_hook: Callable | None = None,
        yield_completed_trajectories: bool = False,
        return_same_td: bool = False,
        verbose: bool = False,
        create_env_kwargs=None,
        server_config=None,
        device_config=None,
        policy_version: int = 0,
        policy_version_key="policy_version",
        envs_per_worker: int | str = "auto",
        env_threads: bool | str = "auto",
        transition_chunk_size: int | str = "auto",
        chunks_per_env: int = 2,
        policy_num_threads: int | None = 1,
        worker_affinity: Sequence[Sequence[int]] | Callable[[int], Sequence[int]] | str | None = "auto",
        driver_affinity: Sequence[int] | str | None = "auto",
        exchange: str = "auto",
        seed: int | None = None,
        idle_poll: bool | str = "auto",
        cast_actions: bool = False,
        check_action_bounds: bool = True,
        on_env_failure: str = "raise",
        max_restarts_per_env: int = 3,
        restart_window_s: float = 60.0,
        max_restarts: int | None = 100,
        step_timeout: float | None = None,
        build_timeout: float | str | None = "auto",
        track_traj_ids: bool = True,
        batch_layout: str = "flat",
        **torchrl_kwargs,
    ):
        BaseCollector.__init__(self, post_collect_hook=post_collect_hook)
        self._pool = None
        self._server = None
        self._respawn = None  # replaces a dead server process (on_env_failure="restart", policy_factory=)
        self._closed = False
        self._serving = False  # the server is held (no action served) until the first iteration
        with contextlib.suppress(TypeError):  # for the repr of a collector whose construction fails
            self._num_envs = len(create_env_fn)
        # 1. the arguments checked and translated, before any env is built or process started (the
        # pool checks those it alone takes)
        config = CollectorConfig.from_arguments(
            create_env_fn, create_env_kwargs, policy=policy, policy_factory=policy_factory,
            frames_per_batch=frames_per_batch,
            total_frames=total_frames, max_batch_size=max_batch_size, min_batch_size=min_batch_size,
            server_timeout=server_timeout, server_config=server_config, device=device, device_config=device_config,
            worker_affinity=worker_affinity, driver_affinity=driver_affinity, replay_buffer=replay_buffer,
            torchrl_kwargs=torchrl_kwargs,
            exploration_type=exploration_type, yield_completed_trajectories=yield_completed_trajectories,
            return_same_td=return_same_td, verbose=verbose, policy_version=policy_version,
            policy_version_key=policy_version_key, envs_per_worker=envs_per_worker, env_threads=env_threads,
            transition_chunk_size=transition_chunk_size, chunks_per_env=chunks_per_env,
            policy_num_threads=policy_num_threads, exchange=exchange, seed=seed, idle_poll=idle_poll,
            cast_actions=cast_actions, check_action_bounds=check_action_bounds, on_env_failure=on_env_failure,
            max_restarts_per_env=max_restarts_per_env, restart_window_s=restart_window_s, max_restarts=max_restarts,
            step_timeout=step_timeout, build_timeout=build_timeout, track_traj_ids=track_traj_ids,
            batch_layout=batch_layout,
        )
        self._adopt_config(config, policy, policy_factory, replay_buffer, postproc)
        t0 = time.monotonic()
        # 2. the start-up plan, from one env built here (see _plan_start_up)
        acting, plan = self._plan_start_up(config, policy, policy_factory)
        # 3. the assembly: env workers and their slots, then the inference server serving them
        self._assemble(config, plan, acting, policy_factory, policy_version)
        self.startup_time_s = time.monotonic() - t0
        self._affinity_plan = self._plan_affinity()
        if verbose:
            print(f"AsyncPoolCollector: {self._num_envs} envs in {self._pool.num_workers} workers, "
                  f"{self._server_backend} inference server, idle polling {'on' if self._pool.idle_poll else 'off'}, "
                  f"started in {self.startup_time_s:.2f}s")

    def _adopt_config(self, config: CollectorConfig, policy, policy_factory, replay_buffer, postproc) -> None:
        """The attributes the collector reads from its checked ``config`` (and the arguments kept as
        given), then the state iterating starts from."""
        self.batch_layout = config.batch_layout
        self.env_backend = config.env_backend
        self._policy = policy
        self._policy_factory = policy_factory
        #: read by TorchRL's ``BaseCollector.__len__`` and ``stats()``
        self.requested_frames_per_batch = config.frames_per_batch
        self.frames_per_batch = config.frames_per_batch
        self.total_frames = config.total_frames
        self.replay_buffer = replay_buffer
        self._postproc = postproc
        self.yield_completed_trajectories = config.yield_completed_trajectories
        self.return_same_td = config.return_same_td
        self.verbose = config.verbose
        self.policy_version_key = config.policy_version_key
        self.exploration_type = config.exploration_type
        self._server_backend = config.server_backend
        self._policy_device = config.policy_device
        self._storing_device = config.storing_device
        self._driver_affinity = config.driver_affinity
        self._init_collection_state()

    def _plan_start_up(self, config: CollectorConfig, policy, policy_factory) -> tuple[ActingPolicy, PoolPlan]:
        """``(acting policy, the pool's plan)``, from one env built here.

        What the policy writes and which recurrent states the workers carry for it (one acting
        policy in this process: the thread server's, or, built once from the factory as TorchRL
        does, a probe of the process server's policy), then the pool's plan from the same env
        (grouping, seeding, CPU masks, ...).
        """
        acting = ActingPolicy(policy if policy is not None else policy_factory(), config.exploration_type)
        self._acting = None if config.process_server else acting
        with SpecEnv(config.create_env_fn, config.create_env_kwargs) as spec_env:
            layout = PolicyLayout.from_spec_env(acting, spec_env, version_key=config.policy_version_key,
                                                device=config.policy_device)
            # the policy's cost per batch size (reported by plan(): why fuller batches pay or not;
            # and whether it leaves its CPU room for env workers); a module's forward only: a plain
            # callable may count its calls (a schedule, a test)
            num_envs = len(config.create_env_fn) * getattr(spec_env.adapter, "num_envs", 1)
            self._policy_cost = (measure_policy_cost(acting, dict(spec_env.adapter.fields()[0]),
                                                     num_envs=num_envs, device=config.policy_device)
                                 if isinstance(getattr(acting, "policy", None), torch.nn.Module) else {})
            # mid-cost envs two workers a core where the policy leaves room for some on its CPU
            # (the default partition with the thread server only: the plan that shares runs there)
            share = (config.envs_per_worker == "auto" and config.auto_policy_affinity is not None
                     and not config.process_server and bool(self._policy_cost))
            plan = self._plan_pool(config, layout, spec_env,
                                   startup_workers_per_core(self._policy_cost) if share else None)
        #: ``{key: slot key}`` of the recurrent states carried in TorchRL's convention
        self.recurrent_keys = layout.recurrent_keys
        return acting, plan

    def _assemble(self, config: CollectorConfig, plan: PoolPlan, acting: ActingPolicy, policy_factory,
                  policy_version) -> None:
        """The env workers and their slots (the pool of ``plan``), then the inference server serving
        them, built, validated and held until the first iteration; the pool is closed if the
        server fails."""
        self._pool = AsyncEnvPool(plan=plan)
        self._num_envs = self._pool.num_envs  # a vector env factory contributes several envs
        # TorchRL's ("collector", "traj_ids") of each batch, when asked for
        self._traj_ids = TrajectoryIds(self._num_envs) if config.track_traj_ids else None
        try:
            self._server = self._build_server(config, acting, policy_factory)
            if policy_version:
                self._server.update_policy_weights_(None, version=int(policy_version))
            # built and validated now, serving from the first iteration (or start()): weights given
            # to update_policy_weights_ before then act from the first transition
            self._server.start(self._pool, hold=True)
        except BaseException:
            self._pool.close()
            raise

    def _init_collection_state(self) -> None:
        """What iterating, :meth:`start` and :meth:`pause` keep: counts, locks, the background writer."""
        self._frames = 0
        self._iter = -1
        self._iteration_started = False
        self._iteration_lock = threading.Lock()
        self._replay_lock = threading.Lock()
        self._server_lock = threading.Lock()  # a weight update never lands on a server being replaced
        self._pause_lock = threading.Lock()
        self._pausing_thread = None  # the thread inside pause(): it may not wait for a batch
        self._shutdown_event = threading.Event()
        self._replay_thread = None
        self._replay_error = None
        self._traj_parts: dict[int, list] = {}
        self._trajectories: deque = deque()

    @staticmethod
    def _plan_pool(config: CollectorConfig, layout: PolicyLayout, spec_env: SpecEnv,
                   workers_per_core=None) -> PoolPlan:
        """The pool's start-up plan, from the spec env ``layout`` was read from (its factories
        included): the env workers, their slots (the env's records with the policy's ``layout``)
        and the chunk buffers that deliver their transitions; ``workers_per_core``: the grouping
        rule of :meth:`PoolPlan.build <torchrl_asyncpool.pool.plan.PoolPlan.build>`."""
        return PoolPlan.build(
            spec_env=spec_env,
            workers_per_core=workers_per_core,
            envs_per_worker=config.envs_per_worker,
            env_threads=config.env_threads,
            policy_output_spec=layout.outputs,
            recurrent_state=layout.recurrent,
            # "auto" is sized from the slot layout, which the plan knows once it read the env's specs
            transition_chunk_size=functools.partial(_auto_chunk, config.transition_chunk_size,
                                                    frames_per_batch=config.frames_per_batch,
                                                    chunks_per_env=config.chunks_per_env),
            chunks_per_env=config.chunks_per_env,
            worker_affinity=config.worker_affinity,
            exchange=config.exchange,
            seed=config.seed,
            idle_poll=config.idle_poll,
            backend=config.env_backend,
            on_env_failure=config.on_env_failure,
            max_restarts_per_env=config.max_restarts_per_env,
            restart_window_s=config.restart_window_s,
            max_restarts=config.max_restarts,
            step_timeout=config.step_timeout,
            build_timeout=config.build_timeout,
            # recorded as given: the serving loop decides its flush deadline while it runs (plan())
            batching={"min_batch_size": config.min_batch_size, "max_batch_size": config.max_batch_size,
                      "server_timeout": config.server_timeout, "bucket_sizes": config.bucket_sizes},
        )

    def _build_server(self, config: CollectorConfig, acting: ActingPolicy, policy_factory) -> InferenceServer:
        """The inference server for the pool: ``acting`` served from a thread of this process, or
        ``policy_factory``'s policy from a process of its own; not started."""
        pool = self._pool
        if config.slot_transport is not None:
            check_slot_transport(config.slot_transport, policy_factory, pool.num_envs)
            check_transport_keys(config.slot_transport, pool.layout, config.policy_version_key)
        policy_affinity = config.driver_affinity
        if config.auto_policy_affinity is not None and pool.worker_affinity is not None:
            policy_affinity = config.auto_policy_affinity  # the workers were partitioned off this CPU
        # the iterating thread waits for and copies each batch on the policy's CPUs too: its wake-up
        # (rung by a worker when a chunk fills) otherwise tends to land on the ringing worker's CPU
        # and preempt it there (measured on 2 cores: a worker's ring of a sleeping learner thread
        # took 90-100 us, against 2-3 us for rings that wake nothing on the workers' CPU)
        self._take_affinity = self._policy_affinity = policy_affinity
        # the default partition, kept, shared or lifted while running by the measured env step (workload_plan)
        self._auto_partition = None
        if (config.auto_policy_affinity is not None and pool.worker_affinity is not None
                and policy_affinity == config.auto_policy_affinity):
            masks = list(pool.worker_affinity)
            self._auto_partition = (policy_affinity, masks, shared_worker_masks(policy_affinity, masks))
        dtypes = {k: pool.layout_dtype(k) for k in pool.action_keys}
        checks = action_checks(pool.full_action_spec, dtypes, cast=config.cast_actions,
                               bounds=config.check_action_bounds)
        on_cuda = config.policy_device.type == "cuda"
        buckets = config.bucket_sizes
        server_kwargs = dict(
            max_get=config.max_batch_size,
            min_get=config.min_batch_size or 1,
            timeout=_DEFAULT_FLUSH_TIMEOUT if config.server_timeout is None else config.server_timeout,
            device=config.policy_device,
            policy_version_key=config.policy_version_key,
            # padding buys fixed shapes for CUDA graphs; on CPU it only costs compute and a copy
            bucket_sizes=buckets if buckets is not None else ("auto" if on_cuda else None),
            cuda_graphs=buckets is not None and on_cuda,  # server_config.static_batch_size
            num_threads=config.policy_num_threads,
            cpu_affinity=policy_affinity,
        )
        if not config.process_server:
            acting.action_checks = checks
            acting.carry = self.recurrent_keys
            return InferenceServer(acting, mode="thread", **server_kwargs)
        factory = ActingPolicyFactory(policy_factory, config.exploration_type, checks, self.recurrent_keys)
        server = InferenceServer(policy_factory=factory, mode="process", **server_kwargs)
        if config.on_env_failure == "restart":  # what a replacement of a dead server process needs
            self._respawn = _ServerRespawn(factory, server_kwargs, config.max_restarts_per_env,
                                           config.restart_window_s)
        return server

    # -- TorchRL collector surface ----------------------------------------------------------
    @property
    def env(self) -> AsyncEnvPool:
        """The underlying :class:`~torchrl_asyncpool.AsyncEnvPool`, with the envs' TorchRL specs at
        batch size ``[num_envs]`` (``collector.env.action_spec``, ``.observation_spec``, ...)."""
        return self._pool

    @property
    def _workers(self) -> list:
        """The env workers (TorchRL's collector keeps its coordinator threads here): the pool's
        worker processes, or its worker threads with ``env_backend="threading"``; each has
        ``is_alive()`` and ``join(timeout)``. Empty once the pool is closed."""
        pool = self._pool
        return [] if pool is None or pool._closed else list(pool._procs)

    @property
    def server_backend(self) -> str:
        """Where the policy runs: ``"thread"`` (``policy=``) or ``"process"`` (``policy_factory=``)."""
        return self._server_backend

    @property
    def server(self) -> InferenceServer:
        """The :class:`~torchrl_asyncpool.InferenceServer` serving the envs."""
        return self._server

    @property
    def policy(self) -> Callable:
        """The policy (or ``policy_factory`` when one was given)."""
        return self._policy if self._policy is not None else self._policy_factory

    @property
    def policy_version(self) -> int:
        """The version stamped on new transitions (bumped by :meth:`update_policy_weights_`)."""
        return self._server.policy_version()

    def server_stats(self, *, reset: bool = False) -> dict:
        """Inference statistics: batches/s, mean batch size, padding, inference and queueing time.

        Args:
            reset (bool, optional): start a new measurement window after reading. Defaults
                to ``False``.

        Returns:
            the dict of :meth:`InferenceServer.stats <torchrl_asyncpool.InferenceServer.stats>`
            (keys in ``torchrl_asyncpool.inference.STAT_KEYS``).
        """
        stats = self._server.stats(reset=reset)
        if self._respawn is not None:
            stats["server_restarts"] = self._respawn.count  # dead server processes replaced so far
        return stats

    def _plan_affinity(self) -> AffinityPlan | None:
        """The plan that keeps or lifts the default partition (``None`` when none is in force)."""
        if getattr(self, "_auto_partition", None) is None:
            return None
        arena, pool = self._pool._arena, self._pool
        policy_mask, worker_masks, shared_masks = self._auto_partition
        if shared_masks is None:  # the steps' wall time, as the lines of the two-layout plan were measured
            measure = lambda: (float(arena.step_time.sum()), int(arena.step_count.sum()))  # noqa: E731
            # a costly step by the start-up probe: unpinned from the start, not a second later
            probe = pool.plan.measured.get("probe_step_s")
            layout = "unpinned" if probe is not None and probe >= START_UNPINNED_PROBE_S else "partitioned"
            if layout == "unpinned":
                self._apply_partition(layout)
            return AffinityPlan(measure, self._apply_partition, layout=layout)
        # the workers' CPU an env step: the shared layout changes who shares a core, and the
        # steps' wall time counts the turns of whatever does; the serving thread's CPU says how
        # much room the policy's core has (a thread server's: a server process is not weighed)
        workers, serving = CpuMeter(), CpuMeter()
        measure = lambda: (workers(pool.worker_pids), int(arena.step_count.sum()))  # noqa: E731
        weigh_serving = self._server.mode != "process"
        moved_fraction, cpus = shared_split(policy_mask, worker_masks)
        return AffinityPlan(measure, self._apply_partition, layout="partitioned", can_share=True, first_look_opens=True,
                            serving=self._serving_cpu(serving) if weigh_serving else None,
                            moved_fraction=moved_fraction, cpus=cpus)

    def _serving_cpu(self, meter: CpuMeter):
        """``() -> seconds``: the CPU the thread inference server's serving thread has run (a
        replaced thread's count carries on)."""
        pid = os.getpid()

        def serving_cpu_s() -> float:
            tid = self._server.serving_thread_id
            return meter([] if tid is None else [(pid, tid)])

        return serving_cpu_s

    def _apply_partition(self, layout: str) -> None:
        policy_mask, worker_masks, shared_masks = self._auto_partition
        kept = layout != "unpinned"
        self._pool.set_worker_affinity({"partitioned": worker_masks, "shared": shared_masks}.get(layout))
        with self._server_lock:
            self._server.set_cpu_affinity(policy_mask if kept else None)
        self._take_affinity = policy_mask if kept else None

    def plan(self) -> dict:
        """What the collector decided at start-up and from what it measured while running:
        ``startup``, the pool's start-up plan (:meth:`PoolPlan.describe
        <torchrl_asyncpool.pool.plan.PoolPlan.describe>`: grouping, CPU masks, seeding, restart
        policy, what was given and what decided, what the spec env's timing measured, the
        batching options as given) with the policy's CPU mask at start (``policy_affinity``);
        whether the default CPU partition is in force now (``partitioned``; ``None`` with
        explicit or no masks) and in which layout (``cpu_layout``: ``"partitioned"``,
        ``"shared"`` or ``"unpinned"``, see :mod:`~torchrl_asyncpool.collector.workload_plan`),
        the mean env step behind that decision (``measured_env_step_s``) and the serving
        thread's CPU a step where the plan weighs it (``measured_serving_s``), how often it changed, and
        the serving loop's flush deadline with the env step it follows (thread server with
        ``server_timeout="auto"``).

        Examples:
            >>> import torch
            >>> from torchrl_asyncpool import AsyncPoolCollector
            >>> from torchrl_asyncpool.testing import ZeroLatencyEnv
            >>> act = lambda td: td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))
            >>> collector = AsyncPoolCollector([ZeroLatencyEnv] * 2, policy=act, frames_per_batch=8, total_frames=8)
            >>> plan = collector.plan()
            >>> sorted(k for k in plan if not k.startswith("flush_"))  # doctest: +NORMALIZE_WHITESPACE
            ['cpu_layout', 'measured_env_step_s', 'measured_serving_s', 'partition_changes',
             'partitioned', 'server_measured_env_step_s', 'startup']
            >>> sorted(k for k in plan if k.startswith("flush_"))  # doctest: +NORMALIZE_WHITESPACE
            ['flush_candidate_s', 'flush_choice', 'flush_timeout_s', 'flush_trial_rates',
             'flush_trial_reason', 'flush_trial_rounds', 'flush_trial_sure']
            >>> plan["startup"]["num_workers"] == collector.env.num_workers
            True
            >>> collector.shutdown()
        """
        out = ({"partitioned": None, "cpu_layout": None, "measured_env_step_s": None, "measured_serving_s": None,
                "partition_changes": 0}
               if self._affinity_plan is None else self._affinity_plan.describe())
        loop = getattr(getattr(self._server, "_backend", None), "loop", None)
        timeout = self._server.timeout
        out["flush_timeout_s"] = loop.timeout if loop is not None else (None if timeout == "auto" else timeout)
        out["server_measured_env_step_s"] = getattr(loop, "measured_step_s", None)
        deadline = getattr(loop, "deadline", None)
        out.update(deadline.describe() if deadline is not None else dict.fromkeys(FlushDeadline.REPORTED))
        startup = self._pool.plan.describe()
        startup["policy_affinity"] = None if self._policy_affinity is None else list(self._policy_affinity)
        startup["policy_cost_s"] = dict(self._policy_cost)
        startup["policy_batch_gain"] = batch_gain(self._policy_cost)
        out["startup"] = startup
        return out

    def pool_metrics(self, reset: bool = False) -> dict:
        """The exchange's health metrics (see :meth:`AsyncEnvPool.metrics
        <torchrl_asyncpool.AsyncEnvPool.metrics>`).

        Args:
            reset (bool, optional): start a new measurement window after reading. Defaults
                to ``False``.
        """
        return self._pool.metrics(reset=reset)

    def log_metrics(self, logger, step: int | None = None, *, reset: bool = False, prefix: str = "collector/") -> dict:
        """Logs :meth:`pool_metrics` (as ``{prefix}pool/...``) and :meth:`server_stats` (as
        ``{prefix}server/...``) to a TorchRL logger, one scalar each; returns what it logged.

        Args:
            logger: a TorchRL :class:`~torchrl.record.loggers.Logger` (CSV, TensorBoard, W&B, ...).
            step (int, optional): the step to log at, e.g. the frames collected so far.

        Keyword Args:
            reset (bool, optional): start new measurement windows after reading both.
            prefix (str, optional): prepended to every name. Defaults to ``"collector/"``.
        """
        metrics = {"pool": self._pool.metrics(reset=reset), "server": self._server.stats(reset=reset)}
        return log_metrics(logger, metrics, step, prefix)  # nested dicts become pool/... and server/...

    def update_policy_weights_(self, policy_or_weights=None, *, weights=None, policy=None, **kwargs) -> None:
        """Makes the acting policy use new weights and bumps the policy version.

        Accepts a module, a TensorDict of parameters (``TensorDict.from_module``) or a state
        dict. With no argument and ``policy=``, the acting policy is assumed to be the trained
        module itself (updated in place) and only the version is bumped: the call to make when
        ``policy=`` is a plain function calling a module you train (given weights then raise
        :class:`ValueError` saying so). With ``policy_factory=`` the weights must be given,
        since the policy lives in the server process. Weights given before the first
        iteration act from the first transition. Raises :class:`RuntimeError` once the
        collector was shut down.

        Args:
            policy_or_weights (nn.Module, TensorDict or dict, optional): the new weights.
            weights (optional): the same, as a keyword (TorchRL's name); used when
                ``policy_or_weights`` is ``None``.
            policy (optional): the same, as a keyword; used when both of the above are
                ``None``.
            **kwargs: accepted for TorchRL compatibility and ignored.
        """
        self._ensure_started()
        source = policy_or_weights if policy_or_weights is not None else (weights if weights is not None else policy)
        if source is not None:
            if self._acting is not None and source is getattr(self._acting, "policy", None):
                source = None  # the acting module itself: already up to date
            elif self._acting is not None and "policy" not in self._acting._modules:
                raise ValueError(
                    f"policy= is a plain callable ({type(self._acting._target()).__name__}), not an nn.Module, so the "
                    "collector holds no parameters to copy weights into. If it calls a module that you train in "
                    "place (as the docstring's `act` function does), call update_policy_weights_() with no "
                    "argument: the policy already acts with the new weights and only the version is bumped. "
                    "Otherwise pass the module itself as policy=."
                )
            else:
                source = {WEIGHT_PREFIX + k: v for k, v in flatten_weights(source).items()}
        with self._server_lock:
            self._server.update_policy_weights_(source)
            if self._respawn is not None and source is not None:
                # a replacement server starts from them (a copy: the learner goes on training its own)
                self._respawn.weights = {k: v.detach().clone() for k, v in source.items()}

    def _serve(self) -> None:
        """Lets the server (held since construction) answer the envs: at the first batch request."""
        if not self._serving:
            self._serving = True
            self._server.release()

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("AsyncPoolCollector was shut down.")

    @contextlib.contextmanager
    def pause(self, timeout: float | None = 30.0) -> Iterator[None]:
        """A quiescent boundary: while the context is open, no batch is written and (with a
        thread server) the policy does not run, so modules can be compiled or swapped. With a
        process server the server keeps answering until the envs fill their chunks and stop
        (back-pressure). Another thread's ``next()`` waits for the batch until the block ends;
        the thread inside the block gets :class:`RuntimeError` if it asks for one (``next()``,
        :attr:`rollout`), which nothing would ever deliver (out of iteration, the error ends the
        collector, as any error out of a TorchRL collector's iteration does).

        Args:
            timeout (float, optional): seconds to wait for a running policy call to finish
                (thread server); then :class:`TimeoutError` and nothing is paused. ``None``
                waits as long as it takes. Defaults to ``30.0``.

        Raises:
            RuntimeError: once the collector was shut down, or when it is already paused.
        """
        self._ensure_started()
        if not self._pause_lock.acquire(blocking=False):
            raise RuntimeError("AsyncPoolCollector is already paused.")
        try:
            with self._replay_lock:
                if self._acting is not None:
                    self._acting.pause(timeout)
                self._pausing_thread = threading.get_ident()
                try:
                    yield None
                finally:
                    self._pausing_thread = None
                    if self._acting is not None:
                        self._acting.resume()
        finally:
            self._pause_lock.release()

    def _begin_batch(self) -> None:
        """What every batch request (:attr:`rollout`, from :meth:`iterator` or by hand) does first:
        refuses one after :meth:`shutdown` and one asked for by the thread inside :meth:`pause`
        (it would wait forever: nothing steps until that thread leaves the block; another
        thread's request waits for the resume), then lets the server answer the envs."""
        self._ensure_started()
        if self._pausing_thread == threading.get_ident():
            raise RuntimeError(
                "a batch was asked for inside `with collector.pause():` by the thread that paused the collector: "
                "nothing steps until the block ends. Take batches after it (another thread's iteration waits for "
                "the resume)."
            )
        self._serve()

    # -- data path --------------------------------------------------------------------------
    def _check(self) -> None:
        if self._shutdown_event.is_set():
            raise _Stopped()
        # env and worker failures first, by their own names; the server reports them too
        # (it stops serving), but wrapped as the reason it stopped.
        self._pool.check_workers()
        try:
            self._server.check()
        except InferenceServerError as exc:
            if self._respawn is not None and self._respawn.died(self._server):
                with self._server_lock:
                    self._server = self._respawn.replace(self._server, self._pool, exc)
                return
            # the server may have seen a worker die after the check above: name that first
            self._pool.check_workers()
            if isinstance(exc.__cause__, (EnvError, WorkerDiedError)):
                # the pool's own error as the serving thread met it (the pool's check above can
                # still miss a death the serving thread saw a moment earlier)
                raise exc.__cause__ from None
            raise

    def _take(self, frames: int) -> TensorDictBase:
        with pinned(self._take_affinity):  # your code between batches keeps your thread's mask
            while True:
                try:
                    td = self._pool.take_transitions(frames, timeout=0.1, check=self._check,
                                                     reuse=self.return_same_td)
                except PoolClosedError:
                    if self._shutdown_event.is_set():
                        raise _Stopped() from None
                    raise
                if td is not None:
                    if self._affinity_plan is not None:  # a clock check, and a look about once a second
                        self._affinity_plan.update()
                    return td
                self._check()

    def _rollout_frames(self) -> TensorDictBase:
        self._begin_batch()
        frames = self.frames_per_batch
        if self.total_frames >= 0:
            frames = min(frames, self.total_frames - self._frames)
        td = self._take(frames)
        if self._traj_ids is not None:
            done = td.get(("next", "done")).reshape(td.shape[0], -1).any(-1)
            td.set(TRAJ_IDS_KEY, self._traj_ids(td.get(_ENV_IDX_KEY), done))
        if self.batch_layout == "env_major":
            td = env_major(td, self._num_envs, _ENV_IDX_KEY)
        return td

    def _rollout_yield_trajs(self) -> TensorDictBase:
        self._begin_batch()
        piece = max(1, min(self.frames_per_batch, self._pool._chunks.chunk_size))
        while not self._trajectories:
            td = self._take(piece)
            env_index = td.get(_ENV_IDX_KEY)
            done = td.get(("next", "done")).reshape(piece, -1).any(-1)
            for e in torch.unique(env_index).tolist():
                rows = (env_index == e).nonzero().squeeze(-1)
                part, ends = td[rows], done[rows].nonzero().squeeze(-1).tolist()
                start = 0
                for end in ends:
                    self._traj_parts.setdefault(e, []).append(part[start : end + 1])
                    self._trajectories.append(torch.cat(self._traj_parts.pop(e), 0))
                    start = end + 1
                if start < part.shape[0]:
                    self._traj_parts.setdefault(e, []).append(part[start:])
        return self._trajectories.popleft()

    @property
    def rollout(self) -> Callable[[], TensorDictBase]:
        """The callable that :meth:`iterator` calls for each batch (TorchRL's ``rollout``): the next
        ``frames_per_batch`` transitions, or the next completed trajectory with
        ``yield_completed_trajectories=True``. Called by hand (``collector.rollout()``) it
        returns the same, without counting the frames against ``total_frames`` or running
        ``postproc``, ``post_collect_hook`` and the replay buffer's write, as in TorchRL;
        :class:`RuntimeError` after :meth:`shutdown`."""
        return self._rollout_yield_trajs if self.yield_completed_trajectories else self._rollout_frames

    def start(self) -> None:
        """Collects into ``replay_buffer`` in a background thread until ``total_frames``."""
        if self.replay_buffer is None:
            raise RuntimeError("Background collection requires a replay_buffer.")
        self._ensure_started()  # first: after shutdown() the old writer thread is still recorded
        if self._replay_thread is not None or self._iteration_lock.locked():
            raise RuntimeError("The collector is already collecting.")
        self._replay_error = None
        with pinned(self._driver_affinity):
            self._replay_thread = start_daemon_thread(self._run_replay, "AsyncPoolCollector-replay", 1)

    def _run_replay(self) -> None:
        try:
            for _ in self.iterator():
                pass
        except Exception as exc:  # noqa: BLE001 - surfaced by shutdown()/check_errors()
            self._replay_error = exc

    def check_errors(self) -> None:
        """Raises the background writer's error, if :meth:`start` collection failed: a
        ``RuntimeError`` whose message names the cause (its type and first line), chained to it."""
        if self._replay_error is not None:
            raise RuntimeError(f"Background replay collection failed: {error_summary(self._replay_error)}") \
                from self._replay_error

    def iterator(self) -> Iterator[TensorDictBase | None]:
        """Iterates over collected batches (``None`` per batch with a replay buffer)."""
        if self._replay_thread is not None and threading.current_thread() is not self._replay_thread:
            raise RuntimeError("Background collection owns the collector iterator.")
        self._ensure_started()
        if not self._iteration_lock.acquire(blocking=False):
            raise RuntimeError("The collector is already collecting.")
        try:
            total = self.total_frames
            while (total < 0 or self._frames < total) and not self._shutdown_event.is_set():
                self._iter += 1
                try:
                    td = self.rollout()
                except _Stopped:
                    return
                with self._replay_lock:
                    if self._storing_device is not None:
                        td = td.to(self._storing_device)
                    # real transitions only: an env-major batch is padded
                    self._frames += td.numel() if self.batch_layout == "flat" else int(td.get(MASK_KEY).sum())
                    if self._postproc is not None:
                        td = self._postproc(td)
                    if self.post_collect_hook is not None:
                        self.post_collect_hook(td)
                    if self.replay_buffer is not None:
                        self.replay_buffer.extend(td)
                        td = None
                yield td
        finally:
            self._iteration_lock.release()

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stops the background writer, the policy loop and the env workers. Idempotent.

        Args:
            timeout (float, optional): seconds allowed for the whole shutdown; ``None``
                (default) means 5 seconds.
            close_env (bool, optional): also close the pool and its env workers. Defaults to
                ``True``.
            raise_on_error (bool, optional): raise :class:`TimeoutError` if the background
                writer of :meth:`start` did not stop in time, and the error it failed with (see
                :meth:`check_errors`). Defaults to ``True``.
        """
        if self._closed:
            return
        self._closed = True
        self._shutdown_event.set()
        t0 = time.monotonic()
        timeout = 5.0 if timeout is None else timeout
        thread = self._replay_thread
        if thread is not None:
            thread.join(timeout)
        if self._acting is not None:
            self._acting.resume()  # a paused policy would hold the server thread
        if self._server is not None:
            self._server.stop(timeout=max(0.1, timeout - (time.monotonic() - t0)), raise_errors=False)
        if close_env and self._pool is not None:
            self._pool.close(timeout=max(0.1, min(1.0, timeout - (time.monotonic() - t0))))
        self.shutdown_time_s = time.monotonic() - t0
        if self.verbose:
            print(f"AsyncPoolCollector: shut down in {self.shutdown_time_s:.2f}s")
        if raise_on_error:
            if thread is not None and thread.is_alive():
                raise TimeoutError("The replay writer did not stop before shutdown timed out.")
            self.check_errors()

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Returns ``seed`` and changes nothing, as TorchRL's ``AsyncBatchedCollector`` does, but
        says so with a ``UserWarning``: the envs were built and reset when the collector was
        constructed, so pass ``seed=`` to the constructor to seed them."""
        warnings.warn(
            f"AsyncPoolCollector.set_seed({seed!r}) does not seed anything: the envs reset when the collector was "
            "built. Pass seed= to AsyncPoolCollector(...) instead (env i's first reset gets seed + i).",
            UserWarning,
            stacklevel=2,
        )
        return seed

    def state_dict(self) -> OrderedDict:
        """``{"frames": transitions delivered so far, "policy_version": the serving policy's version}``.

        ``frames`` counts against ``total_frames``, so a collector resumed with
        :meth:`load_state_dict` delivers only what is left. (TorchRL's ``AsyncBatchedCollector``
        returns an empty dict; its keys here are a superset.)
        """
        return OrderedDict(frames=self._frames, policy_version=self.policy_version)

    def load_state_dict(self, state_dict: OrderedDict) -> None:
        """Resumes the frame count of :meth:`state_dict` (``policy_version`` is informational: the
        version follows the weights, see :meth:`update_policy_weights_`). A dict without
        ``"frames"`` (TorchRL's empty one) changes nothing."""
        if "frames" not in state_dict:
            return
        given = state_dict["frames"]
        frames = as_int(given)  # an int, or a numpy / 0-d tensor integer from a saved checkpoint
        if frames is None or frames < 0:
            raise ValueError(f"state_dict['frames'] must be a non-negative integer, got {given!r}.")
        self._frames = frames

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None and not getattr(self, "_closed", True):
            try:
                self.shutdown(timeout=2.0, raise_on_error=False)
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass

    def __repr__(self) -> str:
        # also on a collector whose __init__ raised part-way (a debugger or a traceback shows it)
        fields = [(name, getattr(self, attr, None)) for name, attr in (
            ("num_envs", "_num_envs"), ("env_backend", "env_backend"), ("frames_per_batch", "frames_per_batch"),
            ("total_frames", "total_frames"), ("frames", "_frames"))]
        state = ("closed" if getattr(self, "_closed", False)
                 else "open" if getattr(self, "_server", None) is not None else "not started")
        return (f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in fields if v is not None)
                + f", {state})")


class _Stopped(Exception):
    """Internal: shutdown interrupted a blocked rollout."""


def _auto_chunk(value, layout, frames_per_batch, chunks_per_env=2) -> int:
    """The chunk size for ``transition_chunk_size=value`` once the slot layout is known; refuses a
    batch of ``frames_per_batch`` transitions that this machine's memory cannot hold."""
    from torchrl_asyncpool.delivery.chunks import check_fits, transition_bytes

    n = layout.num_slots
    per_transition = max(transition_bytes(layout), 1)
    check_fits(frames_per_batch * per_transition,
               f"frames_per_batch={frames_per_batch} (a batch of transitions of {per_transition:,} bytes)")
    if value != "auto":
        return value
    memory_cap = max(1, _AUTO_CHUNK_BYTES // (chunks_per_env * n * per_transition))
    # every env may fill chunks_per_env chunks ahead of the learner: at this size all of them
    # together hold about one batch, so a batch is at most about one batch behind the policy
    lag_cap = frames_per_batch // (n * chunks_per_env)
    return max(1, min(lag_cap, memory_cap))


class _ServerRespawn:
    """Replaces a dead inference server process (``on_env_failure="restart"`` with
    ``policy_factory=``): the slots it had leased are handed back to the exchange as ready, and a
    new server from the same factory starts with the last weights and version, within the same
    budget as env restarts (``per_env`` replacements within ``window_s``)."""

    def __init__(self, factory, server_kwargs, per_env, window_s):
        self.factory, self.server_kwargs = factory, server_kwargs
        self.per_env, self.window_s = per_env, window_s
        self.weights = None  # the last weights given to update_policy_weights_ (flat, prefixed)
        self.times: deque = deque()
        self.count = 0

    @staticmethod
    def died(server) -> bool:
        """Whether ``server``'s process has ended (as opposed to a policy error, which is raised)."""
        from torchrl_asyncpool._sys.forkserver import exit_code

        proc = server._process
        return proc is not None and exit_code(proc) is not None

    def replace(self, server, pool, error):
        """The new server, serving ``pool``; raises ``error`` past the budget."""
        from torchrl_asyncpool.exchange import slot_states as S

        now = time.monotonic()
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.per_env:
            raise InferenceServerError(
                f"{error} The server process was replaced {len(self.times)} times within {self.window_s:g}s "
                f"(max_restarts_per_env={self.per_env}): not again."
            ) from error
        self.times.append(now)
        version = server.policy_version()
        server.stop(timeout=1.0, raise_errors=False)
        # the records the dead server had leased are ready again: the new server answers them
        state = pool._arena.state
        leased = state == S.LEASED
        state[leased] = S.OBS_READY
        new = InferenceServer(policy_factory=self.factory, mode="process", **self.server_kwargs)
        new.update_policy_weights_(self.weights, version=version)
        new.start(pool)
        pool._consumer.ring(max(1, int(leased.sum())))
        self.count += 1
        return new
