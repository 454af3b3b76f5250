"""Side-by-side collector benchmark: frames/s delivered to the learner, same envs and policy, one run.

Implementations (each fed the same env factory and the same small MLP policy):

* ``asyncpool``     torchrl_asyncpool.AsyncPoolCollector, default settings (no hand tuning; the
                    exchange's C engine where it is built)
* ``asyncpool_py``  the same with ``exchange="python"`` (the pure-Python exchange)
* ``asyncpool_unpinned`` the default with ``worker_affinity=None, driver_affinity=None``
                    (nothing pinned: TorchRL's default, against the collector's CPU partition)
* ``asyncpool_no_idle`` the default with ``idle_poll=False`` (blocking waits everywhere, against
                    the default's automatic idle polling of CPU-bound workers)
* ``torchrl_async`` TorchRL 0.14.1 AsyncBatchedCollector in its documented fastest configuration
                    (process env workers, transport="auto", policy_factory, chunked delivery)
* ``torchrl_sync``  TorchRL's synchronous Collector over ParallelEnv
* ``gym_async``     a hand-written gymnasium.vector.AsyncVectorEnv(shared_memory=True) loop
* ``gym_sync``      a plain single-process gymnasium.vector.SyncVectorEnv loop
* ``envpool_async`` EnvPool's asynchronous mode (its C++ CartPole, ``num_envs=N``,
                    ``batch_size=N/2``, one thread per core): ``recv`` a batch, the same MLP on
                    the bare observations, ``send`` the actions to those env ids. CartPole only;
                    needs ``pip install envpool==1.1.1`` (skipped when it is not installed)
* ``env_only``      the ceiling, not a collector: one bare process per core stepping the same
                    envs with a fixed action, no policy and nothing exchanged or stored (the
                    pixel env's in one thread each, as its blocking step wants). ``x env_only``
                    is the share of it a collector reaches

Workloads: CartPole-v1 (8 and 32 envs) and an env whose step sleeps 2 ms and returns 84x84x3
uint8 pixels plus a 4-vector (16 and 64 envs). Also reports time from constructor to first
batch and shutdown time. Run with nothing else busy::

    python benchmarks/compare_collectors.py                # full table
    python benchmarks/compare_collectors.py --quick        # a short smoke run
    python benchmarks/compare_collectors.py --plot out.png --json out.json
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from tensordict.nn import TensorDictModule

IMPLS = ("asyncpool", "asyncpool_py", "asyncpool_unpinned", "asyncpool_no_idle", "torchrl_async", "torchrl_sync",
         "gym_async", "gym_sync", "envpool_async", "env_only")


# -- workloads ------------------------------------------------------------------------------
class SleepPixelGym(gym.Env):
    """A gymnasium env whose step sleeps ``step_s`` and returns 84x84x3 pixels and a 4-vector."""

    def __init__(self, step_s=0.002, episode_len=100):
        self.step_s, self.episode_len, self.t = step_s, episode_len, 0
        self.observation_space = gym.spaces.Dict(
            pixels=gym.spaces.Box(0, 255, (84, 84, 3), np.uint8),
            vector=gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
        )
        self.action_space = gym.spaces.Discrete(4)
        self._px = np.zeros((84, 84, 3), np.uint8)

    def _obs(self):
        self._px.fill(self.t % 256)
        return {"pixels": self._px.copy(), "vector": np.full(4, self.t, np.float32)}

    def reset(self, seed=None, options=None):
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        time.sleep(self.step_s)
        self.t += 1
        return self._obs(), 1.0, False, self.t >= self.episode_len, {}


def make_cartpole():
    return gym.make("CartPole-v1")


def make_sleep():
    return SleepPixelGym(0.002)


def make_torchrl_cartpole():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def make_torchrl_sleep():
    from torchrl.envs import GymWrapper

    return GymWrapper(SleepPixelGym(0.002))


WORKLOADS = {
    # name: (gym factory, torchrl factory, obs key, obs dim, n actions, envs)
    "cartpole": (make_cartpole, make_torchrl_cartpole, "observation", 4, 2, (8, 32)),
    "sleep2ms": (make_sleep, make_torchrl_sleep, "vector", 4, 4, (16, 64)),
}


class _Act(nn.Module):
    """obs -> MLP -> greedy discrete action, written as ``"action"``."""

    def __init__(self, key, dim, n, one_hot=False):
        super().__init__()
        self.key, self.n, self.one_hot = key, n, one_hot
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, n))

    def forward(self, td):
        a = self.net(td[self.key].float()).argmax(-1)
        if self.one_hot:
            a = torch.nn.functional.one_hot(a, self.n)
        return td.set("action", a)


def make_policy(key, dim, n, one_hot=False):
    torch.manual_seed(0)
    return _Act(key, dim, n, one_hot)


class _ActNet(nn.Module):
    """The same MLP as a plain obs -> one-hot action module, for a TensorDictModule."""

    def __init__(self, dim, n):
        super().__init__()
        self.n = n
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, n))

    def forward(self, obs):
        return torch.nn.functional.one_hot(self.net(obs.float()).argmax(-1), self.n)


def make_torchrl_policy(key, dim, n):
    """A TensorDictModule declaring in_keys/out_keys: what TorchRL's transport="auto" needs to pick
    its fastest configuration (a process server reached directly by the env workers)."""
    torch.manual_seed(0)
    return TensorDictModule(_ActNet(dim, n), in_keys=[key], out_keys=["action"])


# -- timing helpers ----------------------------------------------------------------------------
def _drive(it, seconds, fpb):
    t0 = time.perf_counter()
    frames = 0
    while time.perf_counter() - t0 < seconds:
        batch = next(it)
        frames += fpb if batch is None else batch.numel()
    return frames / (time.perf_counter() - t0)


class _ShieldedCell:
    """One benchmark cell: the worker processes it starts do not take Ctrl-C, and an interrupt
    (or any error) shuts down what was built at once.

    A terminal's Ctrl-C reaches every process of the command. ``torchrl_asyncpool``'s workers
    ignore it (they fork from a fork server that does); TorchRL's and gymnasium's do not: they
    are started here (``spawn`` for TorchRL, each re-importing this script for seconds), and a
    Ctrl-C printed one ``KeyboardInterrupt`` traceback per worker. While a cell runs, every
    ``multiprocessing`` process started in this process is started with ``SIGINT`` blocked and,
    from the main thread, ignored (both survive ``fork`` and ``exec``; the child never takes
    it), then both are restored here, so a Ctrl-C in that moment is delivered here once the start
    returns, not lost. This process alone stops the benchmark: on an interrupt the collector, if
    it was built, is shut down with a short timeout, and the processes the cell started that are
    still alive are terminated (killed if they linger), instead of TorchRL's default 5 s
    shutdown or, for a collector whose constructor was interrupted, garbage collection.
    The measured numbers are unchanged: the patch only wraps ``Process.start``.
    """

    def __init__(self):
        self.processes = []

    def __enter__(self):
        import multiprocessing.process
        import signal
        import threading

        cls = multiprocessing.process.BaseProcess
        self._cls, self._start = cls, cls.start
        cell, original_start = self, cls.start

        def start(process):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
            try:
                original_start(process)
            finally:
                cell.processes.append(process)  # before a pending Ctrl-C can be raised here
                if main:
                    signal.signal(signal.SIGINT, previous)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

        cls.start = start
        return self

    def __exit__(self, *exc):
        self._cls.start = self._start
        return False

    def stop_processes(self, grace_s=0.5):
        """Terminates the processes this cell started that are still running (kills them after
        ``grace_s``)."""
        alive = [p for p in self.processes if p.pid is not None and p.exitcode is None]
        for p in alive:
            try:
                p.terminate()
            except (OSError, ValueError, AttributeError):  # already gone or closed
                pass
        deadline = time.monotonic() + grace_s
        for p in alive:
            try:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    p.kill()
                    p.join(1.0)
            except (OSError, ValueError, AttributeError, AssertionError):
                pass


def _timed_collector(build, seconds, fpb):
    """(frames/s, constructor-to-first-batch s, shutdown s) of a TorchRL-style collector.

    An interrupt at any point (in the constructor too) shuts down what was built at once: see
    :class:`_ShieldedCell`."""
    with _ShieldedCell() as cell:
        c = None
        t0 = time.perf_counter()
        try:
            c = build()
            it = iter(c)
            next(it)
            startup = time.perf_counter() - t0
            fps = _drive(it, seconds, fpb)
        except BaseException:
            # the run is abandoned: its processes are stopped first, so that the collector's own
            # shutdown finds them gone instead of waiting for them (TorchRL's: up to 5 s)
            cell.stop_processes()
            if c is not None:
                try:
                    c.shutdown(timeout=0.5, raise_on_error=False)
                except Exception:  # noqa: BLE001 - its workers were stopped under it; the first error is raised
                    pass
            raise
        t1 = time.perf_counter()
        c.shutdown()
        close = time.perf_counter() - t1
    return fps, startup, close


# -- builders: one per implementation, shared with test_bench_collectors.py -----------------------
def build_asyncpool(w, n, fpb, **kwargs):
    from torchrl_asyncpool import AsyncPoolCollector

    gym_fn, _, key, dim, na, _ = WORKLOADS[w]
    return AsyncPoolCollector([gym_fn] * n, policy=make_policy(key, dim, na), frames_per_batch=fpb, **kwargs)


def build_asyncpool_py(w, n, fpb):
    return build_asyncpool(w, n, fpb, exchange="python")


def build_asyncpool_unpinned(w, n, fpb):
    return build_asyncpool(w, n, fpb, worker_affinity=None, driver_affinity=None)


def build_asyncpool_no_idle(w, n, fpb):
    return build_asyncpool(w, n, fpb, idle_poll=False)


def build_torchrl_async(w, n, fpb):
    from torchrl.collectors import AsyncBatchedCollector

    _, trl_fn, key, dim, na, _ = WORKLOADS[w]
    return AsyncBatchedCollector(
        create_env_fn=[trl_fn] * n,
        policy_factory=functools.partial(make_torchrl_policy, key, dim, na),
        frames_per_batch=fpb,
        env_backend="multiprocessing",
        transport="auto",
        transition_chunk_size="auto",
    )


def build_torchrl_sync(w, n, fpb):
    from torchrl.collectors import Collector
    from torchrl.envs import ParallelEnv

    _, trl_fn, key, dim, na, _ = WORKLOADS[w]
    return Collector(ParallelEnv(n, trl_fn), make_torchrl_policy(key, dim, na), frames_per_batch=fpb, total_frames=-1)


def build_gym_async(w, n):
    # "fork", gymnasium's own default on Linux, stated explicitly: importing torchrl (which the
    # other implementations do in this process) sets the global start method to "spawn", and
    # spawned workers re-import this script (tens of seconds of start-up for 32 envs on 2 cores).
    import multiprocessing as mp

    context = "fork" if "fork" in mp.get_all_start_methods() else None
    return gym.vector.AsyncVectorEnv([WORKLOADS[w][0]] * n, shared_memory=True, context=context)


def build_gym_sync(w, n):
    return gym.vector.SyncVectorEnv([WORKLOADS[w][0]] * n)


class GymLoop:
    """The hand-written gymnasium baseline: the policy's MLP called on the vector env's batch."""

    def __init__(self, venv, w):
        _, _, self.key, dim, na, _ = WORKLOADS[w]
        self.venv, self.policy = venv, make_policy(self.key, dim, na)
        self.obs, _ = venv.reset(seed=0)

    @torch.no_grad()
    def step(self) -> int:
        """One step of every env; returns the frames it made."""
        o = self.obs[self.key] if isinstance(self.obs, dict) else self.obs
        a = self.policy.net(torch.as_tensor(o, dtype=torch.float32)).argmax(-1).numpy()
        self.obs, *_ = self.venv.step(a)
        return self.venv.num_envs


class EnvPoolLoop:
    """EnvPool's documented asynchronous loop (``async_reset``, then ``recv``/``send`` of half the
    envs at a time) with the benchmark MLP called on each received batch."""

    def __init__(self, n):
        import os

        import envpool

        self.pool = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=n, batch_size=max(1, n // 2),
                                 num_threads=os.cpu_count() or 1, seed=0)
        self.policy = make_policy("observation", 4, 2)
        self.pool.async_reset()

    @torch.no_grad()
    def step(self) -> int:
        obs, _, _, _, info = self.pool.recv()
        a = self.policy.net(torch.as_tensor(obs, dtype=torch.float32)).argmax(-1).numpy()
        self.pool.send(a.astype(np.int32), info["env_id"])
        return len(obs)


def run_envpool_async(w, n, fpb, seconds):
    if w != "cartpole":
        raise _Skip("EnvPool has no counterpart of the pixel env")
    try:
        import envpool  # noqa: F401
    except ImportError:
        raise _Skip("envpool is not installed (pip install envpool==1.1.1)") from None
    t0 = time.perf_counter()
    loop = EnvPoolLoop(n)
    startup = time.perf_counter() - t0
    fps = _loop_fps(loop, seconds)
    t1 = time.perf_counter()
    loop.pool.close()
    return fps, startup, time.perf_counter() - t1


def _env_only_process(w: str, k: int, conn) -> None:
    """Steps ``k`` envs of workload ``w`` until told to stop; answers each ``"count"`` with the
    steps taken so far."""
    import threading

    envs = [WORKLOADS[w][0]() for _ in range(k)]
    counts = [0] * k
    stop = threading.Event()

    def run(ids):
        for i in ids:
            envs[i].reset(seed=i)
        while not stop.is_set():
            for i in ids:
                _, _, term, trunc, _ = envs[i].step(i % 2)
                counts[i] += 1
                if term or trunc:
                    envs[i].reset()

    # a blocking step (the pixel env sleeps) overlaps in threads; a CPU-bound one runs in one loop
    groups = [[i] for i in range(k)] if w == "sleep2ms" else [list(range(k))]
    threads = [threading.Thread(target=run, args=(g,), daemon=True) for g in groups]
    for t in threads:
        t.start()
    while conn.recv() == "count":
        conn.send(sum(counts))
    stop.set()
    for t in threads:
        t.join()


def run_env_only(w, n, fpb, seconds):
    import multiprocessing as mp
    import os

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    sizes = [len(range(i, n, min(n, cores))) for i in range(min(n, cores))]
    t0 = time.perf_counter()
    procs, conns = [], []
    try:
        for k in sizes:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_env_only_process, args=(w, k, child), daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        for c in conns:
            c.send("count")
        c0 = sum(c.recv() for c in conns)
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        time.sleep(seconds)
        for c in conns:
            c.send("count")
        frames = sum(c.recv() for c in conns) - c0
        fps = frames / (time.perf_counter() - t0)
        t1 = time.perf_counter()
        for c in conns:
            c.send("stop")
        for p in procs:
            p.join(5)
        return fps, startup, time.perf_counter() - t1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


class _Skip(Exception):
    """This implementation cannot run this cell here (reported, not fatal)."""


# -- runners: each returns (frames/s, startup s to first batch, shutdown s) -----------------------
def run_asyncpool(w, n, fpb, seconds):
    return _timed_collector(lambda: build_asyncpool(w, n, fpb), seconds, fpb)


def run_asyncpool_py(w, n, fpb, seconds):
    return _timed_collector(lambda: build_asyncpool_py(w, n, fpb), seconds, fpb)


def run_asyncpool_unpinned(w, n, fpb, seconds):
    return _timed_collector(lambda: build_asyncpool_unpinned(w, n, fpb), seconds, fpb)


def run_asyncpool_no_idle(w, n, fpb, seconds):
    return _timed_collector(lambda: build_asyncpool_no_idle(w, n, fpb), seconds, fpb)


def run_torchrl_async(w, n, fpb, seconds):
    return _timed_collector(lambda: build_torchrl_async(w, n, fpb), seconds, fpb)


def run_torchrl_sync(w, n, fpb, seconds):
    return _timed_collector(lambda: build_torchrl_sync(w, n, fpb), seconds, fpb)


def _loop_fps(loop, seconds: float) -> float:
    """Frames/s of ``loop.step()`` (which returns the frames it made) run for ``seconds``."""
    t0 = time.perf_counter()
    frames = 0
    while time.perf_counter() - t0 < seconds:
        frames += loop.step()
    return frames / (time.perf_counter() - t0)


def _timed_vector_env(build, w, n, seconds):
    with _ShieldedCell() as cell:  # gymnasium's AsyncVectorEnv workers: shielded from Ctrl-C as well
        venv = None
        t0 = time.perf_counter()
        try:
            venv = build(w, n)
            loop = GymLoop(venv, w)
            startup = time.perf_counter() - t0
            fps = _loop_fps(loop, seconds)
        except BaseException:
            try:
                if venv is not None:
                    venv.close(terminate=True)  # AsyncVectorEnv: its workers terminated, not asked
            finally:
                cell.stop_processes()
            raise
        t1 = time.perf_counter()
        venv.close()
        close = time.perf_counter() - t1
    return fps, startup, close


def run_gym_async(w, n, fpb, seconds):
    return _timed_vector_env(build_gym_async, w, n, seconds)


def run_gym_sync(w, n, fpb, seconds):
    return _timed_vector_env(build_gym_sync, w, n, seconds)


RUNNERS = {
    "asyncpool": run_asyncpool,
    "asyncpool_py": run_asyncpool_py,
    "asyncpool_unpinned": run_asyncpool_unpinned,
    "asyncpool_no_idle": run_asyncpool_no_idle,
    "torchrl_async": run_torchrl_async,
    "torchrl_sync": run_torchrl_sync,
    "gym_async": run_gym_async,
    "gym_sync": run_gym_sync,
    "envpool_async": run_envpool_async,
    "env_only": run_env_only,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--envs", nargs="+", type=int, default=None, help="override the env counts of every workload")
    p.add_argument("--seconds", type=float, default=8.0, help="measurement time per cell")
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every cell this many times, the implementations interleaved; the table shows the median "
                        "and the range (this machine's throughput drifts by +-20%% within minutes)")
    p.add_argument("--quick", action="store_true", help="2 s per cell, smallest env count only")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a frames/s vs number of envs PNG here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seconds = 2.0 if args.quick else args.seconds
    results = []
    for w in args.workloads:
        counts = args.envs or WORKLOADS[w][5]
        if args.quick:
            counts = counts[:1]
        for n in counts:
            for rep in range(args.repeats):
                for impl in args.impls:
                    try:
                        fps, startup, close = RUNNERS[impl](w, n, args.frames_per_batch, seconds)
                        row = dict(workload=w, envs=n, impl=impl, rep=rep, fps=fps, startup_s=startup, shutdown_s=close)
                    except _Skip as e:  # an optional baseline that cannot run here (envpool not installed)
                        row = dict(workload=w, envs=n, impl=impl, rep=rep, fps=float("nan"), startup_s=float("nan"),
                                   shutdown_s=float("nan"), skipped=str(e))
                    except Exception as e:  # noqa: BLE001 - one failing baseline must not hide the others
                        row = dict(workload=w, envs=n, impl=impl, rep=rep, fps=float("nan"), startup_s=float("nan"),
                                   shutdown_s=float("nan"), error=f"{type(e).__name__}: {e}"[:200])
                    results.append(row)
                    print(json.dumps(row), flush=True)
    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return results


def _median_rows(results):
    """One row per (workload, envs, impl): the median of its repeats, with their range."""
    cells = {}
    for r in results:
        cells.setdefault((r["workload"], r["envs"], r["impl"]), []).append(r)
    out = []
    for (w, n, impl), rows in cells.items():
        ok = sorted((x for x in rows if x["fps"] == x["fps"]), key=lambda x: x["fps"])
        if not ok:
            out.append(rows[0])
            continue
        mid = dict(ok[len(ok) // 2])
        mid["fps_range"] = (ok[0]["fps"], ok[-1]["fps"])
        mid["repeats"] = len(ok)
        out.append(mid)
    return out


def _print_table(results):
    results = _median_rows(results)
    print(f"\n{'workload':9} {'envs':>4} {'impl':14} {'frames/s':>10} {'range':>15} {'x torchrl_async':>15} "
          f"{'x gym_async':>11} {'x gym_sync':>10} {'x env_only':>10} {'% N/lat':>8} {'1st batch s':>11} "
          f"{'shutdown s':>10}")
    for r in results:
        same = {x["impl"]: x["fps"] for x in results if x["workload"] == r["workload"] and x["envs"] == r["envs"]}
        ratio = lambda k: r["fps"] / same[k] if same.get(k) and same[k] == same[k] else float("nan")  # noqa: E731
        limit = r["envs"] / 0.002 if r["workload"] == "sleep2ms" else float("nan")
        lo, hi = r.get("fps_range", (r["fps"], r["fps"]))
        print(f"{r['workload']:9} {r['envs']:>4} {r['impl']:14} {r['fps']:>10.0f} {f'{lo:.0f}-{hi:.0f}':>15} "
              f"{ratio('torchrl_async'):>15.1f} "
              f"{ratio('gym_async'):>11.2f} {ratio('gym_sync'):>10.2f} {ratio('env_only'):>10.2f} "
              f"{100 * r['fps'] / limit:>8.1f} "
              f"{r['startup_s']:>11.2f} {r['shutdown_s']:>10.2f}"
              + (f"  ERROR {r['error']}" if "error" in r else "")
              + (f"  skipped: {r['skipped']}" if "skipped" in r else ""))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = _median_rows(results)
    workloads = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for impl in IMPLS:
            pts = sorted((r["envs"], r["fps"]) for r in results if r["workload"] == w and r["impl"] == impl)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl, color=f"C{IMPLS.index(impl)}")  # same colour in every panel
        ax.set_title(w)
        ax.set_xlabel("number of envs")
        ax.set_ylabel("frames/s delivered to the learner")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
