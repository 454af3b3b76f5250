"""The checks of :class:`~torchrl_asyncpool.AsyncEnvPool`'s arguments that need no env: each fails
before anything is built or started (a bad value costs nothing)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from torchrl_asyncpool._sys.forkserver import START_METHODS
from torchrl_asyncpool._sys.affinity import resolve_worker_affinity
from torchrl_asyncpool.workers.restarts import RestartPolicy, check_restart_budget

#: where the workers run: processes, or threads of the pool's own process (TorchRL's names)
BACKENDS = ("multiprocessing", "threading")


def _check_start_options(idle_poll, cancel_start, backend) -> None:
    """``idle_poll``, ``cancel_start`` and ``backend``, alone and together."""
    if not (isinstance(idle_poll, bool) or idle_poll == "auto"):
        raise ValueError(f"idle_poll must be True, False or 'auto', got {idle_poll!r}.")
    if cancel_start is not None and not callable(cancel_start):
        raise TypeError(f"cancel_start must be a callable returning a bool, got {type(cancel_start).__name__}.")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "threading" and idle_poll is True:
        raise ValueError(
            "idle_poll=True parks the workers' waits for an idle poller of their own process; with "
            "backend='threading' the workers are threads of this process: leave idle_poll at 'auto' (off)."
        )


def _check_process_options(mp_start_method, pin_memory, worker_affinity) -> None:
    """``mp_start_method``, ``pin_memory`` and a named ``worker_affinity``."""
    if mp_start_method not in START_METHODS:
        raise ValueError(f"mp_start_method must be one of {START_METHODS}, got {mp_start_method!r}.")
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA, which is not available in this process.")
    if isinstance(worker_affinity, str):  # a bad name fails before any env is built
        resolve_worker_affinity(worker_affinity, 0)


def check_factories(create_env_fn) -> list:
    """``create_env_fn`` as a list, checked: TorchRL's list of factories, one callable per env (no
    single callable and count). The one check of the factories, for the pool and its collector.

    Examples:
        >>> from torchrl_asyncpool.pool.arguments import check_factories
        >>> from torchrl_asyncpool.testing import ZeroLatencyEnv
        >>> len(check_factories((ZeroLatencyEnv,) * 2))
        2
        >>> check_factories(ZeroLatencyEnv)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: create_env_fn must be a list of env factories (a list of callables, ... got class ZeroLatencyEnv.
    """
    if callable(create_env_fn) or isinstance(create_env_fn, (str, bytes)) or not isinstance(create_env_fn, Sequence):
        raise TypeError(
            "create_env_fn must be a list of env factories (a list of callables, one per env; for n copies of "
            f"one env: [make_env] * n), got {_kind(create_env_fn)}."
        )
    if not len(create_env_fn):
        raise TypeError("create_env_fn must be a non-empty list of env factories, got an empty one.")
    for i, fn in enumerate(create_env_fn):
        if not callable(fn):
            raise TypeError(f"create_env_fn[{i}] must be callable, got {type(fn).__name__}.")
    return list(create_env_fn)


def _kind(value) -> str:
    """What ``value`` is, for an error message (a class by its name: its type is a metaclass)."""
    return f"class {value.__name__}" if isinstance(value, type) else type(value).__name__


def _check_restart(on_env_failure, per_env, window_s, total):
    """The workers' :class:`~torchrl_asyncpool.workers.restarts.RestartPolicy`, or ``None`` for ``"raise"``."""
    if on_env_failure not in ("raise", "restart"):
        raise ValueError(f"on_env_failure must be 'raise' or 'restart', got {on_env_failure!r}.")
    check_restart_budget(per_env, window_s, total)
    return RestartPolicy(per_env, float(window_s), total) if on_env_failure == "restart" else None


def _check_step_timeout(step_timeout, threads: bool):
    if step_timeout is None:
        return
    if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not step_timeout > 0:
        raise ValueError(f"step_timeout must be None or a positive number of seconds, got {step_timeout!r}.")
    if threads:
        raise ValueError("step_timeout needs worker processes: a worker thread (backend='threading') stuck in a "
                         "step cannot be killed. Use backend='multiprocessing'.")


def _check_build_timeout(build_timeout):
    if build_timeout is None or build_timeout == "auto":
        return
    if isinstance(build_timeout, bool) or not isinstance(build_timeout, (int, float)) or not build_timeout > 0:
        raise ValueError(f"build_timeout must be 'auto', None or a positive number of seconds, got {build_timeout!r}.")


def check_kwargs(kwargs, n):
    if kwargs is None:
        return [{} for _ in range(n)]
    if isinstance(kwargs, Mapping):
        return [dict(kwargs) for _ in range(n)]
    kwargs = list(kwargs)
    if len(kwargs) != n or not all(isinstance(k, Mapping) for k in kwargs):
        raise ValueError(f"create_env_kwargs must be a dict or a list of {n} dicts, got {kwargs!r}.")
    return [dict(k) for k in kwargs]
