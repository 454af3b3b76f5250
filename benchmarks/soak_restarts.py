"""Soak test of ``on_env_failure="restart"``: a long collection with an env failure every
``--fault-every`` transitions, against the same run without faults.

Every transition is checked with the oracle (exactly once, in order, cut episodes marked), and
the script reports frames/s of both runs (and their ratio), the restarts, the resident memory
of the driver and of the workers at the start and at the end, and whether anything was left in
``/dev/shm`` or in the process table (worker processes) after ``shutdown()``.

Usage::

    python benchmarks/soak_restarts.py                              # 1 M transitions, a fault every ~20k
    python benchmarks/soak_restarts.py --frames 200000 --json soak.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.inference.examples import OracleTagPolicy
from torchrl_asyncpool.testing import OracleChecker, OracleEnv


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, reaped later, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run(num_envs: int, frames: int, fault_every: int | None, batch: int) -> dict:
    """One collection of ``frames`` oracle-checked transitions. ``fault_every``: each env (and
    each rebuilt one) fails on every ``fault_every``-th of its own steps, so the pool sees one
    failure per ``fault_every`` transitions on average, in bursts of about ``num_envs`` failures
    every ``num_envs * fault_every`` transitions; ``None``: no faults."""
    shm_before = set(os.listdir("/dev/shm"))
    fail = {} if fault_every is None else {"fail_at_step": max(1, fault_every)}
    factories = [functools.partial(OracleEnv, env_id=i, **fail) for i in range(num_envs)]
    checker = OracleChecker()
    collector = AsyncPoolCollector(factories, policy=OracleTagPolicy(), frames_per_batch=batch, total_frames=frames,
                                   on_env_failure="restart", max_restarts_per_env=10_000, max_restarts=None)
    workers = list(collector.env.worker_pids)
    it = iter(collector)
    first = next(it)  # start-up excluded from the rate
    checker.observe_transitions(first)
    rss0 = {"driver": _rss_mb(os.getpid()), "workers": sum(_rss_mb(p) for p in workers)}
    t0, done = time.perf_counter(), first.numel()
    for b in it:
        checker.observe_transitions(b)
        done += b.numel()
    elapsed = time.perf_counter() - t0
    rss1 = {"driver": _rss_mb(os.getpid()), "workers": sum(_rss_mb(p) for p in workers)}
    restarts = collector.pool_metrics()["env_restarts"]
    collector.shutdown()
    time.sleep(0.5)
    return {
        "faults": fault_every is not None, "frames": done, "fps": (done - first.numel()) / elapsed,
        "restarts": restarts, "restarts_delivered": checker.restarts, "rss_start_mb": rss0, "rss_end_mb": rss1,
        "shm_left": sorted(set(os.listdir("/dev/shm")) - shm_before - {f for f in os.listdir("/dev/shm")
                                                                      if f.startswith("sem.mp-")}),
        "processes_left": [p for p in workers if _alive(p)],  # the worker processes, after shutdown
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=1_000_000, help="transitions per run")
    p.add_argument("--fault-every", type=int, default=20_000,
                   help="transitions per env failure, on average (each env fails every this many of its steps)")
    p.add_argument("--envs", type=int, default=16, help="oracle envs")
    p.add_argument("--batch", type=int, default=4096, help="frames_per_batch")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    rows = [run(args.envs, args.frames, None, args.batch), run(args.envs, args.frames, args.fault_every, args.batch)]
    for r in rows:
        print(f"{'faults' if r['faults'] else 'clean '}: {r['frames']} frames at {r['fps']:,.0f}/s, "
              f"{r['restarts']} restarts ({r['restarts_delivered']} cut episodes delivered), RSS driver "
              f"{r['rss_start_mb']['driver']:.0f} -> {r['rss_end_mb']['driver']:.0f} MB, workers "
              f"{r['rss_start_mb']['workers']:.0f} -> {r['rss_end_mb']['workers']:.0f} MB, /dev/shm left "
              f"{r['shm_left']}, processes left {r['processes_left']}")
    print(f"with faults / without: {rows[1]['fps'] / rows[0]['fps']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
