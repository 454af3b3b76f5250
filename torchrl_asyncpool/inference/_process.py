"""Entry point of the inference server process (see :class:`~torchrl_asyncpool.ProcessSlotTransport`)."""
from __future__ import annotations

import json
import os
import signal
import traceback

import torch

from torchrl_asyncpool.exchange.consumer import SlotConsumer
from torchrl_asyncpool.inference._loop import ServingLoop
from torchrl_asyncpool.inference._runner import PolicyFailure, named_tensors
from torchrl_asyncpool.inference._setup import build_runners, policy_reads
from torchrl_asyncpool.inference._shared import STATE_FAILED, STATE_SERVING, STATE_STOPPED, SharedWeights, StatsBlock

__all__ = ["server_main"]


def server_main(handle, spec, weights_fd, stats_fd, life_fd, conn, release_fd=None):
    """Builds the policies, validates them, reports ``ready`` and serves until the life pipe closes
    (from when ``release_fd``, where given, becomes readable: see ``ServingLoop``'s ``hold_fd``)."""
    # The owner decides when this process ends (life pipe); a terminal's Ctrl-C is for the owner.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.cpu_affinity is not None:  # before torch starts its intra-op threads: they inherit it
        os.sched_setaffinity(0, spec.cpu_affinity)
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)

    def report(msg):
        try:
            conn.send_bytes(json.dumps(msg).encode("utf-8"))
        except (OSError, ValueError):
            pass  # the owner is gone

    stats = None
    code = 1
    try:
        try:
            stats = StatsBlock.from_fd(stats_fd.fd, [p.name for p in spec.plans])
            policies = {}
            for name, factory in spec.factories.items():
                policies[name] = factory()
            keys = policy_reads(policies.values(), handle.layout, spec.on_batch)
            consumer = SlotConsumer(handle, keys=spec.lease_keys(keys))  # none where the runners gather
            runners = build_runners(spec, policies, handle.layout, consumer.arena.request, keys)
            weights = SharedWeights.create(
                weights_fd.fd,
                {r.plan.name: {k: v.detach().cpu() for k, v in named_tensors(r.policy).items()} for r in runners},
            )
        except Exception as exc:  # noqa: BLE001 - reported as text to the owner
            report({
                "event": "error", "phase": "start-up", "etype": type(exc).__name__,
                "validation": isinstance(exc, (ValueError, TypeError, KeyError)),
                "message": str(exc) if not isinstance(exc, KeyError) else str(exc.args[0] if exc.args else exc),
                "traceback": traceback.format_exc(),
            })
            return
        report({"event": "ready", "pid": os.getpid(), "weights": weights.layout})
        stats.set_state(STATE_SERVING)
        loop = ServingLoop(consumer, runners, spec, stats, weights, [life_fd.fd], on_batch=spec.on_batch,
                           hold_fd=None if release_fd is None else release_fd.fd)
        try:
            loop.serve()
            stats.set_state(STATE_STOPPED)
            code = 0
        except PolicyFailure as failure:
            stats.set_state(STATE_FAILED)
            report({"event": "error", "phase": "serve", "key": list(failure.key), "message": failure.message,
                    "traceback": failure.tb})
        except BaseException as exc:  # noqa: BLE001
            stats.set_state(STATE_FAILED)
            report({"event": "error", "phase": "serve", "key": None,
                    "message": f"the inference server stopped: {type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()})
    finally:
        try:
            conn.close()
        finally:
            os._exit(code)
