"""What a worker does to a hosted env outside its steps: checks its fields against the pool's
layout, builds it again after a failure (``on_env_failure="restart"``, with the seed of that
rebuild, watched for a hang through ``build_since``), and closes it, reporting what its
``close()`` raised. Shared by every worker loop (:mod:`~torchrl_asyncpool.workers.stepper`,
:mod:`~torchrl_asyncpool.workers.lockstep`, :mod:`~torchrl_asyncpool.workers.worker`).
"""
from __future__ import annotations

import os
import select
import sys
import time
import traceback

from torchrl_asyncpool.exchange.arena import as_key
from torchrl_asyncpool.envs.adapters import make_adapter
from torchrl_asyncpool.envs.env_attrs import FIRST_SEED_ATTR, own_attr
from torchrl_asyncpool.workers.record_writer import RESTARTED_KEY
from torchrl_asyncpool.workers.restarts import DeferredEnvError

__all__ = []


def expected_fields(layout) -> tuple:
    """The fields every env of ``layout`` must declare: ``(request, response)``, each
    ``{key: (shape, dtype)}`` (recurrent state and the restart flag are the pool's, not the env's)."""
    recurrent, actions = layout.recurrent, layout.action_keys
    return (
        {f.key: (f.shape, f.dtype) for f in layout.request if f.key not in recurrent and f.key != (RESTARTED_KEY,)},
        {f.key: (f.shape, f.dtype) for f in layout.response if actions is None or f.key in actions},
    )


def check_fields(expected, index, adapter) -> None:
    """Raises ``ValueError`` when env ``index``'s fields differ from ``expected`` (see
    :func:`expected_fields`)."""
    request, response = (_keyed(d) for d in adapter.fields())
    _check_fields(index, "observation/reward/done", expected[0], request)
    _check_fields(index, "action", expected[1], response)


def build_replacement(worker, index, factory, r, num_envs=None):
    """The adapter of env ``index``'s ``r``-th rebuild from ``factory`` (``(fn, kwargs)``), its
    first reset seeded ``seed + index + r * num_slots`` when the pool was seeded (never another
    env's seed), checked against the pool's layout; ``num_envs``: the vector env's size it must
    have. What it built is closed when it raises."""
    fn, kw = factory
    env = adapter = None
    build_since = worker.arena.build_since
    try:
        build_since[index] = time.monotonic()  # the pool's watchdog kills a build past build_timeout
        try:
            env = fn(**kw)
        finally:
            build_since[index] = 0.0
        seed = own_attr(env, FIRST_SEED_ATTR)
        if seed is not None:
            setattr(env, FIRST_SEED_ATTR, seed + r * worker.layout.num_slots)
        adapter = make_adapter(env, index)
        if num_envs is not None and getattr(adapter, "num_envs", None) != num_envs:
            raise ValueError(f"env {index}: the rebuilt vector env has {getattr(adapter, 'num_envs', 1)} "
                             f"envs; its first build had {num_envs}.")
        check_fields(worker.expected, index, adapter)
        return adapter
    except BaseException:
        if adapter is not None:
            close_reporting(adapter, index)
        elif env is not None:  # built, but no adapter took it
            try:
                env.close()
            except Exception:  # noqa: BLE001 - the failure being raised is the one that counts
                pass
        raise


def close_reporting(adapter, index) -> None:
    """Closes a hosted env; what its ``close()`` raises is written to this worker's standard
    error (the parent's, unless redirected) instead of vanishing: the worker is going away and
    its parent no longer listens, but a simulator that failed to shut down (and may have left
    processes behind) must not go unnoticed. Never raises."""
    env = getattr(adapter, "env", None)
    if getattr(env if env is not None else adapter, "is_closed", False) is True:
        return  # a TorchRL batched env that shut itself down on an error
    try:
        if env is None:
            adapter.close()
        else:  # the adapters' own close() swallows the env's errors (it also runs on error paths)
            env.close()
    except Exception:  # noqa: BLE001 - reported, not raised: the worker must still exit
        try:
            sys.stderr.write(f"torchrl_asyncpool: env {index} (worker pid {os.getpid()}): close() raised:\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - no standard error left to write to
            pass


def check_life(life_fd) -> None:
    """Raises if the pool is gone (its life pipe hung up): a loop of rebuilds that keep failing
    must not outlive the pool it rebuilds for."""
    p = select.poll()
    p.register(life_fd, select.POLLIN)
    if p.poll(0):
        raise DeferredEnvError("the pool closed while an env was being rebuilt")


def _keyed(fields):
    return {as_key(k): v for k, v in fields.items()}


def _check_fields(index, what, expected, got):
    if expected.keys() != got.keys():
        raise ValueError(
            f"env {index}: {what} keys {sorted(map(str, got))} differ from the pool layout "
            f"{sorted(map(str, expected))} (all envs of a pool must share their specs)."
        )
    for k, spec in expected.items():
        if tuple(got[k][0]) != tuple(spec[0]) or got[k][1] != spec[1]:
            raise ValueError(
                f"env {index}: {what} entry {k!r} has shape {tuple(got[k][0])} and dtype {got[k][1]}; "
                f"the pool layout expects shape {tuple(spec[0])} and dtype {spec[1]}."
            )
