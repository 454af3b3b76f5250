"""CPU affinity masks: TorchRL's ``worker_affinity`` / ``driver_affinity`` options, and the
collector's default partition.

:class:`~torchrl_asyncpool.AsyncPoolCollector` pins by default (``"auto"``, as Sample Factory
pins its rollout workers and EnvPool its threads) when its env workers are CPU-bound (they step
their envs without threads): the policy-serving thread (or server process) runs on the first
CPU this process may use and the env workers share the others (:func:`auto_partition`). On few
cores this keeps the policy's code and weights hot in one core's caches and the envs' in the
other's, and keeps the workers from preempting the policy. Measured on 2 cores (interleaved
in one sitting): 32 CartPole envs 46.9-48.7k frames/s partitioned against
40.6-43.4k unpinned in three pairs, 44.5k against 43.8k in a fourth; 8 CartPole envs +4-7 %;
pinning only the policy and not the workers was worse than nothing (33-34k). Workers that run
their envs in threads (blocking envs: sleep, I/O) are left unpinned: for the 2 ms pixel env the
partition measured 74 / 48 % of N/latency with 16 / 64 envs against 77 / 52 % unpinned, since
those workers' copies want whichever core is free. Nothing is pinned with fewer than two CPUs,
with ``policy_num_threads`` other than ``1`` (a multi-threaded policy wants several cores), or
where Linux masks are unavailable. Pass ``worker_affinity=None, driver_affinity=None`` (or set
``TORCHRL_ASYNCPOOL_AFFINITY=none``) when something else shares the machine's cores (another
collector, a learner with its own pinning): the masks are then left as they are.
The thread that iterates the collector takes each batch on the policy's CPU as well (its own
mask is restored before the batch is yielded): a worker that fills a transition chunk rings that
thread awake, and the kernel tends to wake it on the ringing worker's CPU, where it preempts the
worker. Measured on 2 cores with 32 CartPole envs, such a ring took the worker 90-100 us against
2 us once the taking ran on the policy's CPU (with its waits idle-polled, see
:class:`~torchrl_asyncpool.delivery.chunks.ChunkReader`), and frames/s rose 1.32x (median of 5
interleaved pairs).
On Linux an affinity mask belongs to a thread and is inherited by the threads and processes
it starts; worker processes fork from the fork server, so they set theirs themselves.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

__all__ = [
    "AUTO", "auto_partition", "check_cpu_mask", "resolve_worker_affinity", "resolve_collector_affinity", "pinned",
    "set_process_affinity",
]

#: the collector's default for ``worker_affinity`` / ``driver_affinity`` (see the module docstring)
AUTO = "auto"


def _available() -> set:
    if not hasattr(os, "sched_getaffinity"):
        raise OSError("CPU affinity masks need os.sched_setaffinity (Linux).")
    return os.sched_getaffinity(0)


def auto_partition() -> tuple:
    """``(policy mask, worker mask)`` of the default partition: the first CPU the calling thread
    may run on for the policy, the others for the env workers; ``(None, None)`` (leave
    everything unpinned) with fewer than two CPUs, without Linux affinity masks, or with the
    environment variable ``TORCHRL_ASYNCPOOL_AFFINITY=none`` (for scripts you do not edit).

    Examples:
        >>> import os
        >>> from torchrl_asyncpool._sys.affinity import auto_partition
        >>> policy, workers = auto_partition()
        >>> policy is None or (len(policy) == 1 and set(policy) | set(workers) == os.sched_getaffinity(0))
        True
    """
    setting = os.environ.get("TORCHRL_ASYNCPOOL_AFFINITY", "auto").strip().lower()
    if setting not in ("auto", "none", ""):
        raise ValueError(f"TORCHRL_ASYNCPOOL_AFFINITY must be 'auto' or 'none', got {setting!r}.")
    if setting == "none" or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return (cpus[0],), tuple(cpus[1:])


def check_cpu_mask(mask, name: str, available=None) -> tuple:
    """Validates one mask (CPU indices this process may use, or ``available`` when given: the
    CPUs of the thread that created what the mask is for); returns it as a sorted tuple.

    Examples:
        >>> from torchrl_asyncpool._sys.affinity import check_cpu_mask
        >>> check_cpu_mask([0, 0], "driver_affinity")
        (0,)
    """
    if isinstance(mask, (str, bytes)) or not hasattr(mask, "__iter__"):
        raise TypeError(f"{name} must be a sequence of CPU indices, got {mask!r}.")
    cpus = list(mask)
    if not cpus or any(isinstance(c, bool) or not isinstance(c, int) for c in cpus):
        raise ValueError(f"{name} must be a non-empty sequence of int CPU indices, got {mask!r}.")
    available = _available() if available is None else set(available)
    outside = sorted(c for c in set(cpus) if c not in available)
    if outside:
        raise ValueError(
            f"{name}={sorted(set(cpus))} names CPUs {outside} this process may not run on "
            f"(available: {sorted(available)})."
        )
    return tuple(sorted(set(cpus)))


def resolve_worker_affinity(spec: Sequence[Sequence[int]] | Callable[[int], Sequence[int]] | str | None,
                            num_workers: int, threaded: bool = False, available=None) -> list | None:
    """One mask per worker process from ``worker_affinity`` (a sequence of masks, or a callable
    ``worker_index -> mask``); ``None`` leaves the workers unpinned. ``"auto"``: the worker side
    of :func:`auto_partition` for every worker, unless the workers step their envs in threads
    (``threaded``: env threads waiting on I/O want every core) or there is no partition.
    ``available``: the CPUs the masks may name (default: the calling thread's)."""
    if isinstance(spec, str):
        if spec != AUTO:
            raise ValueError(f"worker_affinity must be {AUTO!r}, None or CPU masks, got {spec!r}.")
        mask = None if threaded else auto_partition()[1]
        spec = None if mask is None else (lambda worker: mask)
    if spec is None:
        return None
    if callable(spec):
        masks = [spec(w) for w in range(num_workers)]
    else:
        masks = list(spec)
        if len(masks) != num_workers:
            raise ValueError(
                f"worker_affinity has {len(masks)} masks for {num_workers} worker processes; give one per worker, "
                "or a callable worker_index -> mask (the number of workers follows envs_per_worker)."
            )
    return [check_cpu_mask(m, f"worker_affinity[{w}]", available) for w, m in enumerate(masks)]


@contextlib.contextmanager
def pinned(mask: tuple | None):
    """Runs the block with the calling thread pinned to ``mask`` (threads it starts inherit it),
    then restores the thread's previous mask; ``None`` does nothing."""
    if mask is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, mask)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def resolve_collector_affinity(worker_affinity, driver_affinity, policy_num_threads) -> tuple:
    """The collector's masks from its ``worker_affinity`` / ``driver_affinity`` arguments.

    Returns ``(worker_affinity for the pool, explicit driver mask, auto policy mask)``. The
    pool resolves ``"auto"`` itself (it partitions only workers that step without threads);
    the auto policy mask (the first CPU, only with ``"auto"`` on both sides and
    ``policy_num_threads == 1``) applies when the pool did partition its workers. An explicit
    ``driver_affinity`` pins the policy and the thread of
    :meth:`~torchrl_asyncpool.AsyncPoolCollector.start`; ``None`` pins nothing.
    """
    for name, value in (("worker_affinity", worker_affinity), ("driver_affinity", driver_affinity)):
        if isinstance(value, str) and value != AUTO:
            raise ValueError(f"{name} must be {AUTO!r}, None or CPU indices, got {value!r}.")
    policy_mask, worker_mask = auto_partition() if policy_num_threads == 1 else (None, None)
    auto_workers = isinstance(worker_affinity, str)
    if auto_workers and worker_mask is None:
        worker_affinity, auto_workers = None, False
    if not auto_workers:
        policy_mask = None  # the policy's CPU is kept for it only when the workers stay off it
    if isinstance(driver_affinity, str):
        return worker_affinity, None, policy_mask
    driver = None if driver_affinity is None else check_cpu_mask(driver_affinity, "driver_affinity")
    return worker_affinity, driver, None


def set_process_affinity(pid: int, mask) -> None:
    """Sets the CPU mask of every thread of process ``pid`` (an affinity belongs to a thread, and
    ``sched_setaffinity(pid)`` alone changes only the main one); ``mask=None``: every CPU this
    process may use. Threads that end meanwhile, or a process that is gone, are skipped.

    Examples:
        >>> import os, subprocess
        >>> from torchrl_asyncpool._sys.affinity import set_process_affinity
        >>> child = subprocess.Popen(["sleep", "5"])
        >>> set_process_affinity(child.pid, [min(os.sched_getaffinity(0))])
        >>> os.sched_getaffinity(child.pid) == {min(os.sched_getaffinity(0))}
        True
        >>> child.kill(); child.wait()
        -9
    """
    mask = set(_available()) if mask is None else set(mask)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError, OSError):
            pass
