"""CPU affinity masks: TorchRL's ``worker_affinity`` / ``driver_affinity`` options.

A library cannot pick a CPU partition for its users (it does not know what else runs on the
machine), so nothing is pinned by default. When the user knows, pinning can pay on few cores:
with 32 CartPole envs on 2 cores, the policy thread pinned to one core and the env workers to
the other (by hand, fourth session) measured 68.5-68.9k frames/s against 59-66k unpinned in
two interleaved pairs; with these options on a noisier day the pairs were inconclusive
(``benchmarks/README.md``). Measure on your machine.
On Linux an affinity mask belongs to a thread and is inherited by the threads and processes
it starts; worker processes fork from the fork server, so they set theirs themselves.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

__all__ = ["check_cpu_mask", "resolve_worker_affinity", "pinned"]


def _available() -> set:
    if not hasattr(os, "sched_getaffinity"):
        raise OSError("CPU affinity masks need os.sched_setaffinity (Linux).")
    return os.sched_getaffinity(0)


def check_cpu_mask(mask, name: str) -> tuple:
    """Validates one mask (CPU indices this process may use); returns it as a sorted tuple.

    Examples:
        >>> from torchrl_asyncpool.affinity import check_cpu_mask
        >>> check_cpu_mask([0, 0], "driver_affinity")
        (0,)
    """
    if isinstance(mask, (str, bytes)) or not hasattr(mask, "__iter__"):
        raise TypeError(f"{name} must be a sequence of CPU indices, got {mask!r}.")
    cpus = list(mask)
    if not cpus or any(isinstance(c, bool) or not isinstance(c, int) for c in cpus):
        raise ValueError(f"{name} must be a non-empty sequence of int CPU indices, got {mask!r}.")
    available = _available()
    outside = sorted(c for c in set(cpus) if c not in available)
    if outside:
        raise ValueError(
            f"{name}={sorted(set(cpus))} names CPUs {outside} this process may not run on "
            f"(available: {sorted(available)})."
        )
    return tuple(sorted(set(cpus)))


def resolve_worker_affinity(spec: Sequence[Sequence[int]] | Callable[[int], Sequence[int]] | None,
                            num_workers: int) -> list | None:
    """One mask per worker process from ``worker_affinity`` (a sequence of masks, or a callable
    ``worker_index -> mask``); ``None`` leaves the workers unpinned."""
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
    return [check_cpu_mask(m, f"worker_affinity[{w}]") for w, m in enumerate(masks)]


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
