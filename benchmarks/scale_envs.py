"""How the collector scales with the number of envs: the 2 ms + 84x84x3 pixel env at 16 to 1,024 envs.

For each number of envs ``N``, in one run and one after the other:

* **floor**: the env-only throughput of the same ``N`` envs on this machine, bare processes stepping
  them with random actions and nothing else (no exchange, no policy, no transitions): as many
  processes as the collector's default grouping uses for blocking envs (two per core, fewer when
  ``N`` is small), each stepping its envs in one thread per env, as the collector's threaded
  workers do. It is what the envs can produce here, so the collector's share of it is the cost of
  everything the collector adds; ``N / step_s`` is printed too (the sleeps alone).
* **collector**: ``AsyncPoolCollector`` with its defaults (gymnasium factories of the pixel env of
  ``compare_collectors.py``, its MLP policy), ``frames_per_batch = max(1024, N)``: frames/s
  delivered to the loop, the time from the constructor to the first batch, the PSS of the driver
  and the workers (``/proc/<pid>/smaps_rollup``, shared memory split between its mappers) per env,
  and the CPU seconds per frame of the driver process (all its threads) and of the workers. A flat
  driver CPU per frame means the driver's work does not grow with ``N``.

Run it::

    python benchmarks/scale_envs.py                             # N = 16 64 128 256 1024, 4 s each
    python benchmarks/scale_envs.py --envs 16 256 --seconds 2
    python benchmarks/scale_envs.py --json benchmarks/results_scale_envs.json --cold 16 1024

Linux only (``/proc``). Results depend on what else runs: the report records the load average.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import subprocess
import threading
import time

from compare_collectors import make_policy, make_sleep  # run as a script: this folder is sys.path[0]

STEP_S = 0.002
#: processes per core the collector's "auto" grouping gives blocking envs (pool.grouping._BLOCKING_WORKERS_PER_CORE)
_WORKERS_PER_CORE = 2


def _pss_kb(pid: int) -> int:
    """Proportional set size of ``pid`` in kB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- floor: bare processes stepping the envs -------------------------------------------------------
def _floor_process(k: int, conn) -> None:
    """Steps ``k`` envs, one thread each, until told to stop; answers each ``"count"`` with the
    steps taken so far."""
    envs = [make_sleep() for _ in range(k)]
    counts = [0] * k
    stop = threading.Event()

    def run(i):
        env, rng = envs[i], random.Random(i)
        env.reset(seed=i)
        while not stop.is_set():
            _, _, term, trunc, _ = env.step(rng.randrange(4))
            counts[i] += 1
            if term or trunc:
                env.reset()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "count":
            conn.send(sum(counts))
        else:
            break
    stop.set()
    for t in threads:
        t.join()
    conn.send("done")


def measure_floor(n: int, seconds: float, warmup: float = 0.5) -> dict:
    from torchrl_asyncpool._sys.forkserver import forkserver_context

    ctx = forkserver_context("scale_envs")
    cores = len(os.sched_getaffinity(0))
    procs_n = min(n, cores * _WORKERS_PER_CORE)
    k = math.ceil(n / procs_n)
    sizes = [min(k, n - i) for i in range(0, n, k)]
    procs, conns = [], []
    for size in sizes:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_floor_process, args=(size, child), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    try:
        for c in conns:
            assert c.recv() == "ready"
        time.sleep(warmup)
        cpu0 = sum(_cpu_s(p.pid) for p in procs)
        for c in conns:
            c.send("count")
        t0 = time.perf_counter()
        c0 = sum(c.recv() for c in conns)
        time.sleep(seconds)
        for c in conns:
            c.send("count")
        t1 = time.perf_counter()
        c1 = sum(c.recv() for c in conns)
        cpu1 = sum(_cpu_s(p.pid) for p in procs)
        for c in conns:
            c.send("stop")
        for c in conns:
            c.recv()
    finally:
        for p in procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
    fps = (c1 - c0) / (t1 - t0)
    return {"frames_per_s": fps, "processes": len(sizes), "envs_per_process": k,
            "cpu_s_per_frame": (cpu1 - cpu0) / max(c1 - c0, 1)}


# -- the collector ---------------------------------------------------------------------------------
def measure_collector(n: int, seconds: float) -> dict:
    from torchrl_asyncpool import AsyncPoolCollector

    fpb = max(1024, n)
    t0 = time.perf_counter()
    c = AsyncPoolCollector([make_sleep] * n, policy=make_policy("vector", 4, 4), frames_per_batch=fpb)
    try:
        it = iter(c)
        next(it)
        startup = time.perf_counter() - t0
        pool = c._pool
        workers = [pid for pid in pool.worker_pids if pid is not None]
        next(it)  # one more batch before timing: every env has stepped
        w_cpu0, d_cpu0 = sum(_cpu_s(p) for p in workers), _self_cpu_s()
        frames, t1 = 0, time.perf_counter()
        while time.perf_counter() - t1 < seconds:
            frames += next(it).numel()
        elapsed = time.perf_counter() - t1
        d_cpu, w_cpu = _self_cpu_s() - d_cpu0, sum(_cpu_s(p) for p in workers) - w_cpu0
        pss_kb = _pss_kb(os.getpid()) + sum(_pss_kb(p) for p in workers)
        info = {"num_workers": pool.num_workers, "envs_per_worker": pool.envs_per_worker,
                "env_threads": pool.env_threads, "chunk_size": pool._chunks.chunk_size if pool._chunks else None}
    finally:
        t2 = time.perf_counter()
        c.shutdown()
        close = time.perf_counter() - t2
    return {
        "frames_per_s": frames / elapsed, "frames_per_batch": fpb, "startup_s": startup, "shutdown_s": close,
        "pss_mb_per_env": pss_kb / 1024 / n, "pss_mb_total": pss_kb / 1024,
        "driver_cpu_us_per_frame": 1e6 * d_cpu / max(frames, 1),
        "workers_cpu_us_per_frame": 1e6 * w_cpu / max(frames, 1),
        **info,
    }


def measure_cold_start(n: int) -> dict:
    """Constructor to first batch (and the pool's own part) in a fresh interpreter, fork server included."""
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale_envs.py")
    out = subprocess.run([sys.executable, script, "--cold-child", str(n)], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"cold start of {n} envs failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cold_child(n: int) -> None:
    from torchrl_asyncpool import AsyncPoolCollector

    t0 = time.perf_counter()
    c = AsyncPoolCollector([make_sleep] * n, policy=make_policy("vector", 4, 4), frames_per_batch=max(1024, n))
    try:
        built = time.perf_counter() - t0
        next(iter(c))
        first = time.perf_counter() - t0
    finally:
        c.shutdown()
    print(json.dumps({"num_envs": n, "constructor_s": built, "startup_s": first}))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--envs", type=int, nargs="+", default=[16, 64, 128, 256, 1024])
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per N, floor and collector each")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cold", type=int, nargs="*", default=[], help="N to start in a fresh interpreter too")
    ap.add_argument("--cold-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cold_child is not None:
        return _cold_child(args.cold_child)
    out = {"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "cpus": len(os.sched_getaffinity(0)), "machine": platform.platform(), "step_s": STEP_S,
           "seconds": args.seconds, "runs": []}
    print(f"{'N':>5} {'floor f/s':>10} {'N/step':>8} {'coll f/s':>9} {'% floor':>8} {'start s':>8} "
          f"{'PSS MB/env':>10} {'drv us/f':>9} {'wrk us/f':>9} {'load':>5}")
    for n in args.envs:
        load0 = os.getloadavg()[0]
        floor = measure_floor(n, args.seconds)
        coll = measure_collector(n, args.seconds)
        row = {"num_envs": n, "ideal_frames_per_s": n / STEP_S, "floor": floor, "collector": coll,
               "pct_of_floor": 100.0 * coll["frames_per_s"] / floor["frames_per_s"],
               "loadavg_1min": [load0, os.getloadavg()[0]]}
        out["runs"].append(row)
        print(f"{n:>5} {floor['frames_per_s']:>10.0f} {n / STEP_S:>8.0f} {coll['frames_per_s']:>9.0f} "
              f"{row['pct_of_floor']:>7.1f}% {coll['startup_s']:>8.2f} {coll['pss_mb_per_env']:>10.2f} "
              f"{coll['driver_cpu_us_per_frame']:>9.1f} {coll['workers_cpu_us_per_frame']:>9.1f} "
              f"{os.getloadavg()[0]:>5.1f}", flush=True)
        if args.json:  # after every N: a long run that is stopped keeps what it measured
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    out["cold_starts"] = []
    for n in args.cold:
        load0 = os.getloadavg()[0]
        cold = {**measure_cold_start(n), "loadavg_1min": [load0, os.getloadavg()[0]]}
        out["cold_starts"].append(cold)
        print(f"cold start, {n} envs: {cold['startup_s']:.2f} s to the first batch (constructor "
              f"{cold['constructor_s']:.2f} s), load {os.getloadavg()[0]:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
