"""How :class:`~torchrl_asyncpool.AsyncEnvPool` groups its envs into workers: which slots each
worker hosts, and whether it steps them in threads (``envs_per_worker``, ``env_threads``, and the
``"auto"`` rules that time the spec env). Vector envs fill one worker each; remote env slots are
grouped by the address their worker listens on."""
from __future__ import annotations

import itertools
import math
import os
import time

import numpy as np

from torchrl_asyncpool.pool.layout import spec_env_phase
from torchrl_asyncpool.pool.seeding import _refuse_remote_seed
from torchrl_asyncpool.envs.adapters import make_adapter, remote_listener


def _group_envs(spec_adapter, envs_per_worker, env_threads, fns, kwargs, n, threads, *, seed, restart,
                measured=None, workers_per_core=None):
    """``(envs per worker, threaded, the slots of each worker)`` for ``n`` envs whose first factory
    built ``spec_adapter``. ``threads``: the workers are threads of the pool's process
    (``backend="threading"``); ``seed`` and ``restart`` (the pool's ``RestartPolicy`` or ``None``)
    are refused for remote env slots. ``measured`` (a dict, optional) receives what the timing of
    the spec env measured, when it was timed (see :func:`_probe_blocking`). ``workers_per_core``
    (callable, optional): ``(measured, n, cores) -> int``, the worker processes per core of
    CPU-bound envs under ``envs_per_worker="auto"`` (a collector's choice, weighing its policy's
    cost; default one a core)."""
    vector = hasattr(spec_adapter, "num_envs")
    remote = not vector and remote_listener(spec_adapter.env) is not None
    if restart is not None and remote:
        raise ValueError(
            "on_env_failure='restart' rebuilds envs in their workers; the factories return remote env "
            "slots, whose hosts reconnect by themselves after a failure. Use on_env_failure='raise'."
        )
    if vector:
        # a vector env hosts k envs, in k consecutive slots of one worker, stepped in lockstep
        k, threaded = _vector_grouping(envs_per_worker, env_threads, spec_adapter.num_envs)
    elif remote:
        _refuse_remote_seed(seed)
        groups = _remote_groups(envs_per_worker, env_threads, spec_adapter, fns, kwargs)
        return max(map(len, groups)), True, groups
    else:
        k, threaded = _resolve_grouping(envs_per_worker, env_threads, spec_adapter, n, threads, measured,
                                        workers_per_core)
    return k, threaded, [list(range(i, min(i + k, n))) for i in range(0, n, k)]


def _resolve_grouping(envs_per_worker, env_threads, adapter, n, threads=False, measured=None,
                      workers_per_core=None):
    """``(envs per worker, threaded)``; the spec env is timed only for ``envs_per_worker="auto"``.
    ``threads``: the workers are threads of the pool's process (``backend="threading"``);
    ``measured`` and ``workers_per_core``: as in :func:`_group_envs`."""
    if envs_per_worker != "auto" and (
        isinstance(envs_per_worker, bool) or not isinstance(envs_per_worker, int) or envs_per_worker < 1
    ):
        raise ValueError(f"envs_per_worker must be a positive int or 'auto', got {envs_per_worker!r}.")
    if not (env_threads is True or env_threads is False or env_threads == "auto"):
        raise ValueError(f"env_threads must be True, False or 'auto', got {env_threads!r}.")
    if envs_per_worker != "auto":
        k = min(envs_per_worker, n)
        return k, env_threads is True and k > 1
    measured = {} if measured is None else measured  # what a caller's workers_per_core weighs
    blocking = _probe_blocking(adapter, measured=measured)
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
    # CPU-bound envs: about one worker per core, or as the caller weighs it (a collector groups
    # mid-cost envs two a core where its policy leaves room on its core: collector/workload_plan.py);
    # blocking envs in threads: a few workers per core, so that one process's GIL-held work
    # (copies, the env's own Python) overlaps another's
    if blocking:
        per_core = _BLOCKING_WORKERS_PER_CORE
    else:
        per_core = 1 if workers_per_core is None else max(1, int(workers_per_core(measured, n, cores)))
    k = max(1, math.ceil(n / (cores * per_core)))
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


def _probe_blocking(adapter, probe_s: float = 0.2, probe_steps: int = 32, measured=None) -> bool:
    """Times a few steps of the spec env: True when it mostly waits (sleep, I/O) rather than computes
    (an env that raises meanwhile is reported as env 0's :class:`~torchrl_asyncpool.errors.EnvError`).
    ``measured`` (a dict, optional) receives ``probe_steps`` (steps timed), ``probe_step_s`` (their
    mean wall time), ``probe_step_cpu_s`` (their mean CPU time), ``probe_step_cpu_median_s`` (the
    median CPU time of one step), ``probe_cpu_ratio`` (the steps' CPU / wall at their 90th
    percentile) and ``blocking``.

    The first step of a fresh env costs 200-700 us of CPU whatever the env (code paths and caches
    still cold: measured for CartPole, Pendulum and HalfCheetah on 2 vCPUs of an AMD EPYC VM,
    2026-12-06), which moves the mean of ~32 steps by 6-20 us: CartPole's mean ranged 15-27 us
    and Pendulum's 20-37 over fresh processes, their medians 7.5-12 and 12-14. The median is what
    says how costly a step is; the mean, nearer a worker's warm step with the pool's own work in
    it, weighs it against the policy (``workload_plan.startup_workers_per_core``).

    Judged from the steps that computed the most for their wall time (the 90th percentile of
    CPU / wall): a busy machine preempts a CPU-bound env now and then (its wall time then exceeds
    its CPU time), but not in every step, while an env that waits does so in every step. (The
    ratio of the sums, which this rule replaced, took Atari on a loaded 2-core machine for a
    blocking env: a layout that then changed with the load of the moment. The single highest
    ratio, which replaced that, took the 2 ms sleeping pixel env for a CPU-bound one once in a CI
    run beside other jobs: one step of 32 had computed for half its wall time.)
    """
    with spec_env_phase("reset"):
        adapter.reset()
    wall = 0.0
    steps = 0
    step_cpus, ratios = [], []
    t_end = time.perf_counter() + probe_s
    while steps < probe_steps and time.perf_counter() < t_end:
        action = adapter.random_action()
        with spec_env_phase("step"):  # outside the timed span: it times the env alone
            w0, c0 = time.perf_counter(), time.thread_time()
            _, _, term, trunc = adapter.step(action)
            dw, dc = time.perf_counter() - w0, time.thread_time() - c0
        wall += dw
        step_cpus.append(dc)
        ratios.append(dc / dw if dw > 0 else 1.0)
        steps += 1
        if term or trunc:
            with spec_env_phase("reset"):
                adapter.reset()
    best = float(np.percentile(ratios, 90)) if ratios else 1.0
    blocking = best < 0.5 and wall / max(steps, 1) > 2e-4
    if measured is not None:
        measured.update(probe_steps=steps, probe_step_s=wall / max(steps, 1),
                        probe_step_cpu_s=sum(step_cpus) / max(steps, 1),
                        probe_step_cpu_median_s=float(np.median(step_cpus)) if step_cpus else 0.0,
                        probe_cpu_ratio=best, blocking=blocking)
    return blocking
