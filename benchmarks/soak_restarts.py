"""Soak test of ``on_env_failure="restart"``: a long collection with a fault every
``--fault-every`` transitions (envs that raise, steps that hang past ``step_timeout``, worker
processes SIGKILLed), against the same run without faults.

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
import random
import signal
import time

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.testing.policies import OracleTagPolicy
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


def run(num_envs: int, frames: int, fault_every: int | None, batch: int, step_timeout: float) -> dict:
    """One collection of ``frames`` oracle-checked transitions, one env per worker process.
    ``fault_every``: about one fault per ``fault_every`` transitions, a third of each kind: an
    env of the first quarter raises in its step, one of the second quarter hangs until
    ``step_timeout`` kills its worker (each every ``12 * fault_every / num_envs`` of its own
    steps), and this script SIGKILLs the worker of an env of the second half every ``3 *
    fault_every`` delivered transitions; ``None``: no faults."""
    shm_before = set(os.listdir("/dev/shm"))
    period = None if fault_every is None else max(1, 12 * fault_every // num_envs)
    quarter = max(1, num_envs // 4)

    def faults(i):
        if period is None or i >= 2 * quarter:
            return {}
        return {"fail_at_step": period} if i < quarter else {"hang_at_step": period}

    factories = [functools.partial(OracleEnv, env_id=i, **faults(i)) for i in range(num_envs)]
    checker = OracleChecker()
    collector = AsyncPoolCollector(factories, policy=OracleTagPolicy(), frames_per_batch=batch, total_frames=frames,
                                   envs_per_worker=1, on_env_failure="restart", max_restarts_per_env=10_000,
                                   max_restarts=None, step_timeout=step_timeout)
    pool = collector.env
    seen = set(pool.worker_pids)
    rng = random.Random(0)
    it = iter(collector)
    first = next(it)  # start-up excluded from the rate
    checker.observe_transitions(first)
    rss0 = {"driver": _rss_mb(os.getpid()), "workers": sum(_rss_mb(p) for p in pool.worker_pids)}
    t0, done, kills = time.perf_counter(), first.numel(), 0
    next_kill = None if fault_every is None else 3 * fault_every
    for b in it:
        checker.observe_transitions(b)
        done += b.numel()
        if next_kill is not None and done >= next_kill:
            next_kill += 3 * fault_every
            pid = pool.worker_pids[rng.randrange(2 * quarter, num_envs)]
            try:
                os.kill(pid, signal.SIGKILL)
                kills += 1
            except ProcessLookupError:  # already dead (a hung step's kill), not yet replaced
                pass
        seen.update(pool.worker_pids)
    elapsed = time.perf_counter() - t0
    rss1 = {"driver": _rss_mb(os.getpid()), "workers": sum(_rss_mb(p) for p in pool.worker_pids)}
    metrics = collector.pool_metrics()
    collector.shutdown()
    time.sleep(0.5)
    return {
        "faults": fault_every is not None, "frames": done, "fps": (done - first.numel()) / elapsed,
        "env_restarts": metrics["env_restarts"], "worker_restarts": metrics["worker_restarts"],
        "workers_killed": kills, "restarts_delivered": checker.restarts, "rss_start_mb": rss0, "rss_end_mb": rss1,
        "shm_left": sorted(set(os.listdir("/dev/shm")) - shm_before - {f for f in os.listdir("/dev/shm")
                                                                      if f.startswith("sem.mp-")}),
        "processes_left": sorted(p for p in seen if _alive(p)),  # every worker process, after shutdown
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=1_000_000, help="transitions per run")
    p.add_argument("--fault-every", type=int, default=20_000,
                   help="transitions per fault, on average (env failures, hung steps and killed workers)")
    p.add_argument("--envs", type=int, default=16, help="oracle envs")
    p.add_argument("--batch", type=int, default=4096, help="frames_per_batch")
    p.add_argument("--step-timeout", type=float, default=0.5, help="seconds before a hung step's worker is killed")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    rows = [run(args.envs, args.frames, fault, args.batch, args.step_timeout) for fault in (None, args.fault_every)]
    for r in rows:
        print(f"{'faults' if r['faults'] else 'clean '}: {r['frames']} frames at {r['fps']:,.0f}/s, "
              f"{r['env_restarts']} env rebuilds, {r['worker_restarts']} workers replaced ({r['workers_killed']} "
              f"killed by this script), {r['restarts_delivered']} cut episodes delivered, RSS driver "
              f"{r['rss_start_mb']['driver']:.0f} -> {r['rss_end_mb']['driver']:.0f} MB, workers "
              f"{r['rss_start_mb']['workers']:.0f} -> {r['rss_end_mb']['workers']:.0f} MB, /dev/shm left "
              f"{r['shm_left']}, processes left {r['processes_left']}")
    print(f"with faults / without: {rows[1]['fps'] / rows[0]['fps']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
