"""Throughput of torchrl_asyncpool.AsyncEnvPool against TorchRL's own AsyncEnvPool.

One process, one run: every (workload, num_envs, implementation) cell builds its pool, warms
it up, measures transitions/s for ``--seconds`` of a SEED-style consumer loop, and closes it.
Construction and closing are timed separately and never count towards throughput.

Implementations
    ours          torchrl_asyncpool.AsyncEnvPool(fns)                       (envs_per_worker=1)
    ours-auto     torchrl_asyncpool.AsyncEnvPool(fns, envs_per_worker="auto")
    ours-auto-py  the same with exchange="python" (the pure-Python exchange; the two above use
                  the exchange's C engine where it is built)
    torchrl-shm   torchrl.envs.AsyncEnvPool(fns, backend="multiprocessing", exchange="shm")
    torchrl-queue torchrl.envs.AsyncEnvPool(fns, backend="multiprocessing", exchange="queue")
    env-only      no pool: N forked processes step their env in a loop with random actions and
                  report how many steps they did. Not a competitor: it is the ceiling the
                  machine allows for these envs (env cost + sleeps, no exchange, no consumer),
                  reported as "% env-only" for every pool.

Consumer loops (one "transition" = one env step handed to the consumer)
    ours:     td = pool.recv(min_get=1); a = randint(B); pool.send(TensorDict({"action": a}, [B]), td.env_indices)
    torchrl:  res, nxt = pool.async_step_and_maybe_reset_recv(min_get=1)
              nxt["action"] = randint(B); pool.async_step_and_maybe_reset_send(nxt, env_index=idx)
    TorchRL is driven through its autoreset ``step_and_maybe_reset`` path, which is its
    fastest correct asynchronous loop: ``nxt`` is the (reset where needed) root of the next
    step, so the consumer never issues a separate reset round trip. Sending only
    ``{"action": a}`` instead of ``nxt`` is *not* correct with ``exchange="shm"``: a batch
    mixing those records with the initial full records fails to stack (different key sets).
    TorchRL's default ``stack="dense"`` is used (results own their memory); ``--torchrl-stack
    lazy`` measures the lazy stack of shared-slot views instead.

Workloads
    zero      torchrl_asyncpool.testing.ZeroLatencyEnv   (pure exchange overhead)
    sleep2ms  torchrl_asyncpool.testing.SleepPixelEnv(step_s=0.002), 84x84x3 uint8 pixels;
              its ideal throughput is N / 0.002 transitions/s, reported as "% N/latency".

Start-up and close
    start-up: constructor until the first batch can be received (TorchRL: constructor, reset()
    and the first send of every env). TorchRL's import sets the global start method to
    "spawn", so its start-up includes one interpreter + torch import per env; ours forks its
    workers from a fork server that has torch/torchrl imported (booted once per process and
    reported separately). close: ``close()`` until it returns; worker processes still alive
    3 s after that are killed and reported as leaked.

The consumer process keeps torch's default intra-op thread count (what a user gets);
``--consumer-threads 1`` sets it, which matters on few cores (see benchmarks/README.md).

Usage::

    python benchmarks/compare_pool.py --quick
    python benchmarks/compare_pool.py --envs 8 32 --seconds 5 --json results.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import statistics
import sys
import time
import warnings

import torch
from tensordict import TensorDict

IMPLS = ("ours", "ours-auto", "ours-auto-py", "torchrl-shm", "torchrl-queue", "env-only")
WORKLOADS = ("zero", "sleep2ms")
SLEEP_STEP_S = 0.002


# -- workloads --------------------------------------------------------------------------------
def env_factories(workload: str, n: int) -> list:
    """``n`` picklable env factories (module-level class + partial: works with fork, forkserver, spawn)."""
    from torchrl_asyncpool.testing import SleepPixelEnv, ZeroLatencyEnv

    if workload == "zero":
        return [functools.partial(ZeroLatencyEnv) for _ in range(n)]
    if workload == "sleep2ms":
        return [functools.partial(SleepPixelEnv, step_s=SLEEP_STEP_S) for _ in range(n)]
    raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")


def latency_limit(workload: str, n: int) -> float | None:
    """Ideal transitions/s of ``n`` envs whose step blocks for a fixed time (None: CPU-bound)."""
    return n / SLEEP_STEP_S if workload == "sleep2ms" else None


def action_sampler(factory):
    """``sample(B)`` returning random valid actions ``[B, *shape]`` of the env's action dtype."""
    env = factory()
    try:
        spec = env.action_spec
        n, shape, dtype = int(spec.n), tuple(spec.shape), spec.dtype
    finally:
        env.close()

    def sample(b: int) -> torch.Tensor:
        return torch.randint(0, n, (b, *shape), dtype=dtype)

    return sample


# -- drivers: one per implementation, same small interface ------------------------------------
class OursDriver:
    """torchrl_asyncpool.AsyncEnvPool: ``recv(min_get=1)`` then ``send`` the whole batch."""

    def __init__(self, factories, sample, envs_per_worker=1, exchange="auto"):
        self.factories, self.sample, self.envs_per_worker = factories, sample, envs_per_worker
        self.exchange = exchange
        self.pool, self.pids, self.info = None, [], {}

    def start(self):
        from torchrl_asyncpool import AsyncEnvPool

        self.pool = AsyncEnvPool(self.factories, envs_per_worker=self.envs_per_worker, exchange=self.exchange)
        self.pids = list(self.pool.worker_pids)
        self.info = {"num_workers": self.pool.num_workers, "envs_per_worker": self.pool.envs_per_worker}

    def round_trip(self) -> int:
        td = self.pool.recv(min_get=1)
        b = td.batch_size[0]
        self.pool.send(TensorDict({"action": self.sample(b)}, [b]), td.env_indices)
        return b

    def reset_stats(self):
        self.pool.metrics(reset=True)

    def stats(self) -> dict:
        return self.pool.metrics()

    def close(self):
        if self.pool is not None:
            self.pool.close()


class TorchRLDriver:
    """torchrl.envs.AsyncEnvPool (multiprocessing backend) through ``step_and_maybe_reset``."""

    def __init__(self, factories, sample, exchange, stack="dense"):
        self.factories, self.sample, self.exchange, self.stack = factories, sample, exchange, stack
        self.pool, self.pids, self.info = None, [], {}

    def start(self):
        """Builds the pool, resets every env and sends the first actions (all counted as start-up)."""
        from torchrl.envs import AsyncEnvPool

        self.pool = AsyncEnvPool(self.factories, backend="multiprocessing", exchange=self.exchange, stack=self.stack)
        self.pids = [p.pid for p in self.pool.threads]
        self.info = {"num_workers": self.pool.num_workers, "exchange": self.pool.resolved_exchange, "stack": self.stack}
        td = self.pool.reset()
        td.set("action", self.sample(td.batch_size[0]))
        self.pool.async_step_and_maybe_reset_send(td)

    def round_trip(self) -> int:
        _result, nxt = self.pool.async_step_and_maybe_reset_recv(min_get=1)
        b = nxt.batch_size[0]
        idx = nxt.get("env_index").tolist()
        nxt.set("action", self.sample(b))
        self.pool.async_step_and_maybe_reset_send(nxt, env_index=idx)
        return b

    def reset_stats(self):
        self.pool.stats(reset=True)

    def stats(self) -> dict:
        return self.pool.stats()

    def close(self):
        if self.pool is not None:
            self.pool.close()


def _env_only_worker(factory, sample, barrier, warmup, seconds, out):
    """Child of :func:`measure_env_only`: steps one env as fast as it can, counts steps."""
    torch.set_num_threads(1)
    env = factory()
    td = env.reset()
    barrier.wait()
    count, t0 = 0, time.monotonic()
    start, end = t0 + warmup, t0 + warmup + seconds
    now = t0
    while now < end:
        # The cheapest correct TorchRL loop (what a pool worker must at least do): step, take
        # "next", reset at episode end.
        td.set("action", sample(1)[0])
        td = env.step(td).get("next")
        if td.get("done").any():
            td = env.reset()
        now = time.monotonic()
        count += start <= now < end
    out.put(count)
    env.close()


def measure_env_only(factories, sample, seconds, warmup) -> dict:
    """Steps of N envs per second, each alone in a process, measured over the same window."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # children only step a small env; start-up is not the point here
    barrier, out = ctx.Barrier(len(factories) + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_env_only_worker, args=(f, sample, barrier, warmup, seconds, out), daemon=True)
        for f in factories
    ]
    try:
        for p in procs:
            p.start()
        barrier.wait(timeout=120)
        counts = [out.get(timeout=warmup + seconds + 60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=5)
        leaked = reap([p.pid for p in procs if p.pid is not None], grace_s=0.0)
        for p in procs:
            p.join(timeout=1)
    return {
        "tps": sum(counts) / seconds,
        "windows": [{"transitions": sum(counts), "elapsed_s": seconds}],
        "leaked_pids": leaked,
    }


def make_driver(impl: str, factories, sample, torchrl_stack: str = "dense"):
    if impl == "ours":
        return OursDriver(factories, sample, envs_per_worker=1)
    if impl == "ours-auto":
        return OursDriver(factories, sample, envs_per_worker="auto")
    if impl == "ours-auto-py":
        return OursDriver(factories, sample, envs_per_worker="auto", exchange="python")
    if impl == "torchrl-shm":
        return TorchRLDriver(factories, sample, "shm", torchrl_stack)
    if impl == "torchrl-queue":
        return TorchRLDriver(factories, sample, "queue", torchrl_stack)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


# -- process hygiene --------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (workers may be grandchildren: no waitpid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def reap(pids, grace_s: float = 3.0) -> list:
    """Waits up to ``grace_s`` for ``pids`` to exit, SIGKILLs the rest; returns the ones killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.02)
    leaked = [p for p in pids if _alive(p)]
    for p in leaked:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return leaked


def stop_children(grace_s: float = 2.0) -> list:
    """Stops this process's own multiprocessing children that are still alive (e.g. TorchRL
    workers spawned by a constructor that an interrupt cut short: TorchRL only cleans those up
    on ``Exception``); returns their pids. Our pool's workers are fork-server grandchildren and
    are handled by :func:`reap` per cell."""
    import multiprocessing

    procs = multiprocessing.active_children()
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)
    return [p.pid for p in procs]


# -- one measurement cell ---------------------------------------------------------------------
def drive_for(driver, seconds: float) -> tuple:
    """Runs round trips for ``seconds``; returns (transitions, round trips, elapsed)."""
    frames = trips = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    now = t0
    while now < end:
        frames += driver.round_trip()
        trips += 1
        now = time.perf_counter()
    return frames, trips, now - t0


def measure(impl, workload, n, seconds, warmup, repeats=1, torchrl_stack="dense") -> dict:
    factories = env_factories(workload, n)
    sample = action_sampler(factories[0])
    rec = {"workload": workload, "num_envs": n, "impl": impl, "error": None}
    if impl == "env-only":
        try:
            rec.update(measure_env_only(factories, sample, seconds, warmup))
        except Exception as err:  # noqa: BLE001
            rec["error"] = f"{type(err).__name__}: {err}"
        limit = latency_limit(workload, n)
        rec["limit_tps"] = limit
        if limit and rec.get("tps"):
            rec["pct_of_limit"] = 100.0 * rec["tps"] / limit
        return rec
    driver = make_driver(impl, factories, sample, torchrl_stack)
    t0 = time.perf_counter()
    try:
        driver.start()
        rec["startup_s"] = time.perf_counter() - t0
        rec.update(driver.info)
        drive_for(driver, warmup)
        windows = []
        for _ in range(repeats):
            driver.reset_stats()
            frames, trips, dt = drive_for(driver, seconds)
            windows.append({"transitions": frames, "round_trips": trips, "elapsed_s": dt, "tps": frames / dt})
        rec["windows"] = windows
        rec["tps"] = statistics.median(w["tps"] for w in windows)
        rec["mean_batch"] = sum(w["transitions"] for w in windows) / max(1, sum(w["round_trips"] for w in windows))
        rec["pool_stats"] = driver.stats()
    except Exception as err:  # noqa: BLE001 - one broken cell must not stop the others
        rec["error"] = f"{type(err).__name__}: {err}"
    finally:
        if driver.pool is not None:
            t1 = time.perf_counter()
            try:
                driver.close()
            except Exception as err:  # noqa: BLE001
                rec["error"] = rec["error"] or f"close: {type(err).__name__}: {err}"
            rec["close_s"] = time.perf_counter() - t1
            rec["leaked_pids"] = reap(driver.pids)
    limit = latency_limit(workload, n)
    rec["limit_tps"] = limit
    if limit and rec.get("tps"):
        rec["pct_of_limit"] = 100.0 * rec["tps"] / limit
    return rec


def boot_forkserver() -> float:
    """Starts our pool's fork server once (it imports torch/torchrl) so that the first cell's
    start-up time is comparable to the others; returns how long that took."""
    from torchrl_asyncpool import AsyncEnvPool

    t0 = time.perf_counter()
    pool = AsyncEnvPool(env_factories("zero", 1))
    pids = pool.worker_pids
    pool.close()
    reap(pids)
    return time.perf_counter() - t0


# -- reporting --------------------------------------------------------------------------------
def add_ratios(records):
    best, ceiling = {}, {}
    for r in records:
        key = (r["workload"], r["num_envs"])
        if r["impl"].startswith("torchrl") and r.get("tps"):
            best[key] = max(best.get(key, 0.0), r["tps"])
        if r["impl"] == "env-only" and r.get("tps"):
            ceiling[key] = r["tps"]
    for r in records:
        key = (r["workload"], r["num_envs"])
        b, c = best.get(key), ceiling.get(key)
        pool = r["impl"] != "env-only"
        r["vs_best_torchrl"] = r["tps"] / b if pool and b and r.get("tps") else None
        r["pct_of_env_only"] = 100.0 * r["tps"] / c if pool and c and r.get("tps") else None


def format_table(records) -> str:
    head = (
        "workload", "N", "impl", "transitions/s", "vs best TorchRL",
        "% N/latency", "% env-only", "mean batch", "startup s", "close s",
    )
    rows = []
    for r in records:
        if r.get("error"):
            rows.append((r["workload"], str(r["num_envs"]), r["impl"], "ERROR", r["error"][:60], "", "", "", "", ""))
            continue
        rows.append(
            (
                r["workload"],
                str(r["num_envs"]),
                r["impl"],
                f"{r['tps']:,.0f}",
                f"{r['vs_best_torchrl']:.2f}x" if r.get("vs_best_torchrl") else "-",
                f"{r['pct_of_limit']:.1f}%" if r.get("pct_of_limit") is not None else "-",
                f"{r['pct_of_env_only']:.0f}%" if r.get("pct_of_env_only") is not None else "-",
                f"{r['mean_batch']:.1f}" if "mean_batch" in r else "-",
                f"{r['startup_s']:.2f}" if "startup_s" in r else "-",
                f"{r['close_s']:.2f}" if "close_s" in r else "-",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in rows]
    return "\n".join(out)


def machine_info() -> dict:
    import tensordict
    import torchrl

    import torchrl_asyncpool

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": cores,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "torchrl": torchrl.__version__,
        "torchrl_asyncpool": torchrl_asyncpool.__version__,
        "loadavg_start": os.getloadavg(),
        "git": _git_revision(),
    }


def _git_revision() -> str | None:
    """``<commit>[+dirty]`` of the checkout the library was imported from (None outside git)."""
    import subprocess

    import torchrl_asyncpool

    root = os.path.dirname(os.path.dirname(os.path.abspath(torchrl_asyncpool.__file__)))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--envs", type=int, nargs="+", default=[8, 32], help="pool sizes (default: 8 32)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell (default: 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per cell, not measured (default: 1)")
    p.add_argument("--repeats", type=int, default=1, help="measurement windows per cell; the median is reported")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument(
        "--consumer-threads",
        type=int,
        default=None,
        help="torch.set_num_threads in the consumer (default: leave torch's default, as a user would)",
    )
    p.add_argument(
        "--torchrl-stack", default="dense", choices=("dense", "lazy"), help="TorchRL pool stack= (default dense)"
    )
    p.add_argument("--quick", action="store_true", help="validation run: 1 s per cell, 0.25 s warm-up")
    p.add_argument("--json", metavar="PATH", help="also write every record (and machine info) as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.repeats = min(args.seconds, 1.0), min(args.warmup, 0.25), 1
    return args


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that close the pools


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.consumer_threads is not None:
        torch.set_num_threads(args.consumer_threads)
    info = machine_info()
    info["consumer_torch_threads"] = torch.get_num_threads()
    print(
        f"# {info['cores']} cores, consumer torch threads {info['consumer_torch_threads']}, "
        f"python {info['python']}, torch {info['torch']}, torchrl {info['torchrl']}, git {info['git']}, "
        f"loadavg {tuple(round(x, 2) for x in info['loadavg_start'])}",
        flush=True,
    )
    info["forkserver_boot_s"] = boot_forkserver()
    print(
        f"# our fork server booted in {info['forkserver_boot_s']:.2f}s (once per process, not in start-up below)",
        flush=True,
    )
    records = []
    t_all = time.perf_counter()
    try:
        for workload in args.workloads:
            for n in args.envs:
                for impl in args.impls:
                    rec = measure(impl, workload, n, args.seconds, args.warmup, args.repeats, args.torchrl_stack)
                    records.append(rec)
                    msg = f"{rec['tps']:,.0f} transitions/s" if rec.get("tps") else f"ERROR {rec['error']}"
                    times = (
                        f"  (start-up {rec['startup_s']:.2f}s, close {rec['close_s']:.2f}s)"
                        if "startup_s" in rec and "close_s" in rec
                        else ""
                    )
                    print(f"  {workload:8s} N={n:<3d} {impl:13s} {msg}{times}", flush=True)
                    if rec.get("leaked_pids"):
                        print(f"  WARNING: {impl} left worker processes {rec['leaked_pids']} (killed)", flush=True)
    finally:
        info["loadavg_end"] = os.getloadavg()
        info["total_s"] = time.perf_counter() - t_all
        add_ratios(records)
        print()
        print(format_table(records))
        print(
            f"\n# loadavg start {tuple(round(x, 2) for x in info['loadavg_start'])}, "
            f"end {tuple(round(x, 2) for x in info['loadavg_end'])}; total {info['total_s']:.0f}s",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "args": vars(args), "records": records}, f, indent=2, default=str)
        left = stop_children()
        if left:
            print(f"# WARNING: child processes still alive at exit were stopped: {left}", flush=True)
    return 1 if any(r.get("error") or r.get("leaked_pids") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
