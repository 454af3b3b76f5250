"""What an :class:`~torchrl_asyncpool.AsyncPoolCollector` was asked for, checked and translated.

The collector takes TorchRL's ``AsyncBatchedCollector`` keywords (``transport``, ``backend``,
``server_config``, ``device_config``, ...) next to its own. :meth:`CollectorConfig.from_arguments`
checks them before any env is built or any process starts, and translates them into one frozen
:class:`CollectorConfig` in this collector's terms: where the envs and the policy run, how
inference batches are formed, where batches are stored, which CPUs are used. The collector then
builds its pool and its inference server from that config alone. The keywords the collector only
passes on to its :class:`~torchrl_asyncpool.AsyncEnvPool` (``envs_per_worker``, ``seed``,
``exchange``, ``idle_poll``, the restart budget, ...) are kept as given and checked by the pool's
start-up plan (:class:`~torchrl_asyncpool.pool.plan.PoolPlan`).
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import torch
from torchrl.envs.utils import ExplorationType
from torchrl.modules.inference_server import ProcessSlotTransport as TorchRLProcessSlotTransport

from torchrl_asyncpool._sys.affinity import resolve_collector_affinity
from torchrl_asyncpool.exchange.arena import as_key
from torchrl_asyncpool.pool.arguments import check_factories, check_kwargs

__all__ = ["CollectorConfig"]

#: TorchRL's default ``InferenceServerConfig.stats_window_size``
_TORCHRL_STATS_WINDOW = 1024

# TorchRL keywords whose only meaningful values are what this collector always does.
_ACCEPTED_AS_IS = {
    "env_exchange": ("auto", "shm"),
    "policy_backend": (None, "threading", "multiprocessing"),
    "reset_at_each_iter": (False,),
    "weight_sync": (None,),
    "weight_sync_model_id": ("policy",),
}
#: TorchRL's env backends: worker processes, or threads of the collector's process
_ENV_BACKENDS = ("threading", "multiprocessing")


@dataclasses.dataclass(frozen=True)
class CollectorConfig:
    """The collector's options, checked, in this collector's terms (see :meth:`from_arguments`).

    The first group is what TorchRL's keywords translate into; the rest are the collector's own
    keywords as given (documented on :class:`~torchrl_asyncpool.AsyncPoolCollector`).
    """

    # -- translated from TorchRL's keywords ------------------------------------------------------
    #: the env factories and their keyword arguments, checked (one dict per factory)
    create_env_fn: tuple
    create_env_kwargs: tuple
    #: ``"multiprocessing"`` (envs in worker processes) or ``"threading"`` (threads of this process)
    env_backend: str
    #: the policy is served from a process of its own (else from a thread of this process)
    process_server: bool
    #: a hand-built TorchRL ``ProcessSlotTransport`` whose keys are checked against the layout
    slot_transport: TorchRLProcessSlotTransport | None
    frames_per_batch: int
    total_frames: int
    max_batch_size: int | None
    min_batch_size: int | None
    server_timeout: float | None
    #: every batch padded to one of these sizes (``server_config.static_batch_size``), or ``None``
    bucket_sizes: tuple | None
    policy_device: torch.device
    #: where yielded batches are moved, or ``None`` (they stay on the CPU)
    storing_device: torch.device | None
    #: the pool's ``worker_affinity`` (``"auto"`` is resolved by the pool)
    worker_affinity: object
    #: an explicit CPU mask for the policy and the thread of ``start()``, or ``None``
    driver_affinity: tuple | None
    #: the policy's CPU when the pool partitioned its workers off it (``"auto"``), or ``None``
    auto_policy_affinity: tuple | None
    # -- the collector's own keywords, as given --------------------------------------------------
    exploration_type: ExplorationType = ExplorationType.RANDOM
    yield_completed_trajectories: bool = False
    return_same_td: bool = False
    verbose: bool = False
    policy_version: int = 0
    policy_version_key: object = "policy_version"
    envs_per_worker: int | str = "auto"
    env_threads: bool | str = "auto"
    transition_chunk_size: int | str = "auto"
    chunks_per_env: int = 2
    policy_num_threads: int | None = 1
    exchange: str = "auto"
    seed: int | None = None
    idle_poll: bool | str = "auto"
    cast_actions: bool = False
    check_action_bounds: bool = True
    on_env_failure: str = "raise"
    max_restarts_per_env: int = 3
    restart_window_s: float = 60.0
    max_restarts: int | None = 100
    step_timeout: float | None = None
    build_timeout: float | str | None = "auto"
    track_traj_ids: bool = True
    batch_layout: str = "flat"

    @property
    def server_backend(self) -> str:
        """``"process"`` or ``"thread"``: where the policy is served."""
        return "process" if self.process_server else "thread"

    @classmethod
    def from_arguments(
        cls,
        create_env_fn: Sequence[Callable],
        create_env_kwargs=None,
        *,
        policy,
        policy_factory,
        frames_per_batch,
        total_frames,
        max_batch_size,
        min_batch_size,
        server_timeout,
        server_config,
        device,
        device_config,
        worker_affinity,
        driver_affinity,
        replay_buffer,
        torchrl_kwargs: dict,
        **options,
    ) -> CollectorConfig:
        """Checks the collector's arguments and translates them; nothing is built or started.

        The keywords up to ``replay_buffer`` are checked and translated; ``torchrl_kwargs`` are
        the keywords only TorchRL's collector has (``transport``, ``backend``, ``env_backend``,
        ``env_exchange``, ...), each honoured or refused with TorchRL's exception type; the
        ``options`` are the collector's other keywords, checked where the collector (rather than
        its pool) owns them and kept as given. The factories and their keyword arguments are
        checked by the pool's own rules (:func:`~torchrl_asyncpool.pool.arguments.check_factories`),
        once: the collector's spec env and plan take them from here.
        """
        _check_policy_args(policy, policy_factory)
        fns = check_factories(create_env_fn)
        env_kwargs = check_kwargs(create_env_kwargs, len(fns))
        options = _options_with_defaults(cls, options)
        env_backend, slot_transport, in_driver = _translate_torchrl_kwargs(
            dict(torchrl_kwargs), policy_factory, len(fns), worker_affinity
        )
        threads = env_backend == "threading"
        _check_policies_callable(policy, policy_factory)
        frames_per_batch, total_frames = _check_delivery(frames_per_batch, total_frames, options)
        max_batch_size, min_batch_size, server_timeout, bucket_sizes, process_server = _batching_from(
            server_config, max_batch_size, min_batch_size, server_timeout,
            process_server=policy_factory is not None and not in_driver and not threads,
            policy_factory=policy_factory, in_driver=in_driver,
        )
        policy_device, storing_device = _devices(device, device_config)
        worker_affinity, driver_affinity, auto_policy_affinity = resolve_collector_affinity(
            worker_affinity, driver_affinity, options["policy_num_threads"]
        )
        _check_return_same_td(options, replay_buffer)
        _check_batch_layout(options, replay_buffer)
        return cls(
            create_env_fn=tuple(fns),
            create_env_kwargs=tuple(env_kwargs),
            env_backend=env_backend,
            process_server=process_server,
            slot_transport=slot_transport,
            frames_per_batch=frames_per_batch,
            total_frames=total_frames,
            max_batch_size=max_batch_size,
            min_batch_size=min_batch_size,
            server_timeout=server_timeout,
            bucket_sizes=bucket_sizes,
            policy_device=policy_device,
            storing_device=storing_device,
            worker_affinity=worker_affinity,
            driver_affinity=driver_affinity,
            auto_policy_affinity=auto_policy_affinity,
            **options,
        )


class _PolicyArgumentsError(TypeError, ValueError):
    """``policy``/``policy_factory`` given both or neither: a :class:`TypeError` as in TorchRL, and a
    :class:`ValueError` as this collector raised before."""


def _check_policy_args(policy, policy_factory) -> None:
    """Exactly one of ``policy`` and ``policy_factory`` is given."""
    if policy is not None and policy_factory is not None:
        raise _PolicyArgumentsError(
            "policy and policy_factory are mutually exclusive: pass exactly one of policy= or policy_factory=."
        )
    if policy is None and policy_factory is None:
        raise _PolicyArgumentsError(
            "One of policy or policy_factory must be provided (pass exactly one of policy= or policy_factory=)."
        )


def _options_with_defaults(cls, options: dict) -> dict:
    """The collector's own keywords, completed with the config's defaults; the bool flags checked."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    options = {**defaults, **options}
    for name in ("cast_actions", "check_action_bounds", "track_traj_ids"):
        value = options[name]
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}.")
    return options


def _translate_torchrl_kwargs(torchrl_kwargs: dict, policy_factory, num_envs: int, worker_affinity):
    """``(env_backend, slot_transport or None, in_driver)`` from TorchRL's own keywords (a copy,
    emptied of what is translated); the rest must be values this collector always honours."""
    env_backend = _env_backend(torchrl_kwargs)
    threads = env_backend == "threading"
    # TorchRL's transport: a hand-built ProcessSlotTransport, "auto" (this collector's choice),
    # or "driver" (the policy served from this process, also with policy_factory)
    slot_transport = torchrl_kwargs.pop("transport", None)
    in_driver = slot_transport == "driver"
    if slot_transport is None or isinstance(slot_transport, str):
        if slot_transport not in (None, "auto", "driver"):
            raise ValueError(
                f"transport must be a ProcessSlotTransport, 'auto', 'driver' or None, got {slot_transport!r}."
            )
        slot_transport = None
    else:
        check_slot_transport(slot_transport, policy_factory, num_envs)
        if threads:
            raise ValueError("ProcessSlotTransport requires both a process inference server and "
                             "env_backend='multiprocessing'.")
    if threads and torchrl_kwargs.get("env_exchange") == "shm":
        raise ValueError("env_exchange='shm' requires env_backend='multiprocessing'.")
    if threads and worker_affinity not in ("auto", None):
        raise ValueError("worker_affinity is only supported with env_backend='multiprocessing'.")
    _check_accepted_as_is(torchrl_kwargs)
    return env_backend, slot_transport, in_driver


def _check_accepted_as_is(torchrl_kwargs: dict) -> None:
    """TorchRL's remaining keywords: known, and with a value that is what this collector always does."""
    for name, value in torchrl_kwargs.items():
        if name not in _ACCEPTED_AS_IS:
            raise TypeError(f"AsyncPoolCollector() got an unexpected keyword argument {name!r}.")
        if value not in _ACCEPTED_AS_IS[name]:
            raise ValueError(
                f"AsyncPoolCollector does not support {name}={value!r}: env workers are always processes on "
                f"the shared-memory exchange with a central policy loop (accepted: {_ACCEPTED_AS_IS[name]})."
            )


def _check_policies_callable(policy, policy_factory) -> None:
    """The given ``policy`` or ``policy_factory`` is callable."""
    for what, value in (("policy", policy), ("policy_factory", policy_factory)):
        if value is not None and not callable(value):
            raise TypeError(
                f"{what} must be callable ("
                + ("a TensorDict -> TensorDict policy such as a TensorDictModule" if what == "policy"
                   else "a zero-argument callable returning the policy")
                + f"), got {type(value).__name__}."
            )


def _check_delivery(frames_per_batch, total_frames, options: dict) -> tuple:
    """``(frames_per_batch, total_frames)`` as ints; those and the chunk options checked."""
    given = frames_per_batch, total_frames
    frames_per_batch, total_frames = as_int(frames_per_batch), as_int(total_frames)
    if frames_per_batch is None or frames_per_batch < 1:
        raise ValueError(f"frames_per_batch must be a positive int, got {given[0]!r}.")
    if total_frames is None or (total_frames < 1 and total_frames != -1):
        raise ValueError(f"total_frames must be -1 (endless) or a positive int, got {given[1]!r}.")
    chunk_size, chunks_per_env = options.get("transition_chunk_size", "auto"), options.get("chunks_per_env", 2)
    if chunk_size != "auto" and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"transition_chunk_size must be a positive int or 'auto', got {chunk_size!r}.")
    if isinstance(chunks_per_env, bool) or not isinstance(chunks_per_env, int) or chunks_per_env < 1:
        raise ValueError(f"chunks_per_env must be a positive int, got {chunks_per_env!r}.")
    return frames_per_batch, total_frames


def _batching_from(server_config, max_batch_size, min_batch_size, server_timeout, *, process_server: bool,
                   policy_factory, in_driver: bool) -> tuple:
    """``(max_batch_size, min_batch_size, server_timeout, bucket_sizes, process_server)``: from
    ``server_config`` when given (else the keywords as given), checked; ``process_server`` is the
    choice without a ``server_config``, which its ``service_backend`` may override."""
    if server_config is not None and any(v is not None for v in (max_batch_size, min_batch_size, server_timeout)):
        raise ValueError(
            "server_config is mutually exclusive with max_batch_size, min_batch_size and server_timeout."
        )
    bucket_sizes = None
    if server_config is not None:
        max_batch_size, min_batch_size, server_timeout, bucket_sizes = _server_config(server_config, policy_factory)
        backend = getattr(server_config, "service_backend", "thread")
        process_server = process_server if backend == "thread" else backend == "process"
    if in_driver and process_server:
        raise ValueError("transport='driver' serves the policy from this process; it cannot be combined with "
                         "server_config=InferenceServerConfig(service_backend='process').")
    _check_batching(max_batch_size, min_batch_size, server_timeout)
    return max_batch_size, min_batch_size, server_timeout, bucket_sizes, process_server


def _check_return_same_td(options: dict, replay_buffer) -> None:
    """``return_same_td=True`` is refused where one reused TensorDict per batch would be wrong."""
    return_same_td = options["return_same_td"]
    if not isinstance(return_same_td, bool):
        raise TypeError(f"return_same_td must be a bool, got {return_same_td!r}.")
    if return_same_td and options["yield_completed_trajectories"]:
        raise ValueError(
            "return_same_td=True does not apply with yield_completed_trajectories=True: each trajectory is a "
            "new TensorDict of its own length."
        )
    if return_same_td and replay_buffer is not None and _keeps_references(replay_buffer):
        raise ValueError(
            "return_same_td=True with a replay buffer whose storage keeps references "
            f"({type(replay_buffer.storage).__name__}): every stored batch would be the same reused tensors. "
            "Use a LazyTensorStorage or LazyMemmapStorage, or return_same_td=False."
        )


def as_int(value):
    """``value`` as an int when it is an integer (a Python, numpy or 0-d tensor one, as
    :func:`operator.index` accepts; not a bool), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _env_backend(torchrl_kwargs) -> str:
    """TorchRL's rule: ``env_backend``, else ``backend``, else (unlike TorchRL 0.14, whose default
    is about to change) ``"multiprocessing"``, TorchRL 0.15's default."""
    env_backend, backend = torchrl_kwargs.pop("env_backend", None), torchrl_kwargs.pop("backend", None)
    if backend is not None and torchrl_kwargs.get("policy_backend") is None and backend in _ENV_BACKENDS:
        torchrl_kwargs["policy_backend"] = backend  # TorchRL's backend= sets both
    chosen = env_backend if env_backend is not None else backend if backend is not None else "multiprocessing"
    if chosen not in _ENV_BACKENDS:
        raise ValueError(f"env_backend={chosen!r} is not supported. Expected one of {_ENV_BACKENDS}.")
    return chosen


def _keeps_references(replay_buffer) -> bool:
    """Whether ``replay_buffer`` stores the TensorDicts it is given rather than copies of them."""
    from torchrl.data import ListStorage

    return isinstance(getattr(replay_buffer, "storage", None), ListStorage)


def check_slot_transport(transport, policy_factory, num_envs: int) -> None:
    """Validates a TorchRL ``ProcessSlotTransport`` given as ``transport=``.

    TorchRL's hand-built slot layouts select its process inference server; here the slot
    layouts are always derived from the env and one policy pass, so the transport's specs are
    only checked against them (:func:`check_transport_keys`) and its own slots stay unused.
    """
    if not isinstance(transport, TorchRLProcessSlotTransport):
        raise ValueError(
            f"AsyncPoolCollector accepts transport=None, 'auto' or a torchrl ProcessSlotTransport, got "
            f"{type(transport).__name__}: env workers always reach the inference server through the "
            "shared-memory exchange."
        )
    if policy_factory is None:
        raise ValueError("transport=ProcessSlotTransport(...) implies the process inference server: pass "
                         "policy_factory= instead of policy=.")
    num_slots = getattr(transport, "_num_slots", num_envs)
    if num_slots < num_envs:
        raise ValueError(f"transport has {num_slots} slots but create_env_fn has {num_envs} envs; "
                         "a ProcessSlotTransport needs one slot per env.")


def check_transport_keys(transport, layout, policy_version_key) -> None:
    """The request keys of a ``transport`` given to the collector must be env observations, its
    response keys policy outputs (``layout``: the pool's slot layout)."""

    def keys(name):
        return {as_key(k) for k in getattr(transport, name, ()) if not str(as_key(k)[-1]).startswith("_")}

    observed = {f.key for f in layout.request}
    answered = {f.key for f in layout.response} | (
        {as_key(policy_version_key)} if policy_version_key is not None else set()
    )
    for what, given, have in (
        ("request", keys("_request_keys"), observed),
        ("response", keys("_response_keys"), answered),
    ):
        missing = sorted(given - have)
        if missing:
            raise ValueError(
                f"transport {what}_spec has keys {missing} that the "
                f"{'env does not observe' if what == 'request' else 'policy does not return'} "
                f"(available: {sorted(have)})."
            )


def _check_batching(max_batch_size, min_batch_size, server_timeout) -> None:
    """The inference batching options, checked before any process starts."""
    sizes = {}
    for name, value in (("max_batch_size", max_batch_size), ("min_batch_size", min_batch_size)):
        if value is None:
            continue
        n = as_int(value)
        if n is None or n < 1:
            raise ValueError(f"{name} must be None or a positive int, got {value!r}.")
        sizes[name] = n
    if len(sizes) == 2 and sizes["min_batch_size"] > sizes["max_batch_size"]:
        raise ValueError(
            f"min_batch_size={sizes['min_batch_size']} must not exceed max_batch_size={sizes['max_batch_size']}."
        )
    if server_timeout is not None and server_timeout != "auto" and (
        isinstance(server_timeout, bool) or not isinstance(server_timeout, (int, float)) or not server_timeout >= 0
    ):
        raise ValueError(f"server_timeout must be None, 'auto' or a number of seconds >= 0, got {server_timeout!r}.")


def _server_config(config, policy_factory):
    """``(max_batch_size, min_batch_size, server_timeout, bucket_sizes)`` from TorchRL's
    ``InferenceServerConfig``; every field is honoured or refused by name."""
    backend = getattr(config, "service_backend", "thread")
    if backend == "process" and policy_factory is None:
        raise TypeError(  # TorchRL's own error for this combination
            "InferenceServerConfig(service_backend='process') requires policy_factory so the policy can be "
            "constructed inside the server process."
        )
    if backend not in ("thread", "process"):
        raise ValueError(
            f"server_config.service_backend={backend!r} is not supported: the policy is served from a thread of this "
            "process (policy=) or from a dedicated server process (policy_factory=)."
        )
    if getattr(config, "collect_stats", True) is not True:
        raise ValueError(
            "server_config.collect_stats=False is not supported: this server always keeps its statistics (a few "
            "additions per batch, see server_stats()); leave collect_stats=True."
        )
    window = getattr(config, "stats_window_size", _TORCHRL_STATS_WINDOW)
    if window != _TORCHRL_STATS_WINDOW:
        raise ValueError(
            f"server_config.stats_window_size={window!r} is not supported: this server keeps sums over a window "
            "that server_stats(reset=True) restarts, not percentiles over recent samples; leave it at "
            f"{_TORCHRL_STATS_WINDOW}."
        )
    inflight = getattr(config, "max_inflight_per_env", None)
    if inflight is not None and (as_int(inflight) is None or inflight < 1):
        raise ValueError(f"server_config.max_inflight_per_env must be None or a positive int, got {inflight!r}.")
    # any bound holds here: an env has one request in flight (it waits for its action to step)
    static = getattr(config, "static_batch_size", None)
    buckets = None
    if static is not None:
        size = as_int(static)
        if size is None or size < 1 or size < config.max_batch_size:
            raise ValueError(
                f"server_config.static_batch_size must be a positive int >= max_batch_size={config.max_batch_size}, "
                f"got {static!r}."
            )
        buckets = (size,)  # every batch padded to it (a CUDA graph per size on CUDA)
    return config.max_batch_size, config.min_batch_size, config.timeout, buckets


def _devices(device, device_config):
    """``(policy device, storing device or None)``; devices this collector cannot honour are refused."""
    if device_config is not None and device is not None:
        raise ValueError("device is mutually exclusive with device_config.")
    if device_config is not None:
        policy_device = getattr(device_config, "policy_device", None)
        storing = getattr(device_config, "storing_device", None)
        for name in ("output_device", "env_device"):
            value = getattr(device_config, name, None)
            if value is not None and torch.device(value).type != "cpu":
                raise ValueError(
                    f"device_config.{name}={str(value)!r} is not supported: the envs step in worker processes on "
                    "actions in shared CPU memory, and the policy outputs travel with them; leave it None or 'cpu' "
                    "(storing_device moves the batches)."
                )
        names = ("device_config.policy_device", "device_config.storing_device")
    else:
        policy_device, storing = device, None
        names = ("device", "storing_device")
    policy_device = torch.device("cpu") if policy_device is None else torch.device(policy_device)
    storing = None if storing is None else torch.device(storing)
    for name, value in zip(names, (policy_device, storing)):
        if value is not None and value.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{name}={str(value)!r}, but CUDA is not available in this process.")
    return policy_device, storing


#: the values of ``batch_layout``
BATCH_LAYOUTS = ("flat", "env_major")


def _check_batch_layout(options: dict, replay_buffer) -> None:
    """``batch_layout="env_major"`` pads (see :func:`~torchrl_asyncpool.collector.traj_ids.env_major`):
    refused where padding or a new TensorDict per batch would be wrong."""
    layout = options["batch_layout"]
    if layout not in BATCH_LAYOUTS:
        raise ValueError(f"batch_layout must be one of {BATCH_LAYOUTS}, got {layout!r}.")
    if layout == "flat":
        return
    clashes = {"replay_buffer": replay_buffer is not None,
               "yield_completed_trajectories=True": options["yield_completed_trajectories"],
               "return_same_td=True": options["return_same_td"]}
    for name, given in clashes.items():
        if given:
            raise ValueError(
                f"batch_layout='env_major' cannot be combined with {name}: its batches are padded "
                "[num_envs, T] TensorDicts made anew for each batch; use batch_layout='flat' (the default)."
            )
