"""TorchRL env factories against plain gymnasium factories, side by side, in one run.

The same ``AsyncPoolCollector`` (default settings) and the same small MLP policy, fed:

cartpole, 32 envs:

* ``gym``            ``gymnasium.make("CartPole-v1")`` factories (the reference)
* ``gymenv``         TorchRL ``GymEnv("CartPole-v1")`` factories (the fast path)
* ``gymenv_cat``     ``GymEnv("CartPole-v1", categorical_action_encoding=True)`` (integer actions,
                     the sota scripts' factory)
* ``transformed``    ``TransformedEnv(GymEnv("CartPole-v1"), Compose(StepCounter(), RewardSum()))``
* ``gymenv_vec``     two factories of ``GymEnv("CartPole-v1", num_envs=16)``
* ``gym_vec``        two factories of ``gymnasium.vector.SyncVectorEnv`` of 16 CartPoles (what
                     ``gymenv_vec`` steps underneath: the cost of lockstep hosting itself)
* ``gymenv_slow``    ``GymEnv`` factories kept on TorchRL's own stepping (``FAST_PATH_ATTR=False``),
                     what every TorchRL factory cost before the fast path

sleep2ms, 16 envs (a step sleeps 2 ms and returns 84x84x3 uint8 pixels and a 4-vector):

* ``gym``            the gymnasium env as the factory
* ``gymwrapper``     ``GymWrapper`` of it (the fast path)
* ``torchrl_env``    the same env written as a TorchRL ``EnvBase``
                     (``torchrl_asyncpool.testing.SleepPixelEnv``), stepped through its ``_step``

Cells run interleaved (every implementation once per repeat), and each is reported as a ratio
to the ``gym`` cell of the same repeat: this machine's throughput drifts within minutes, and a
ratio of neighbours drifts less than either. Each cell also reports frames per CPU second of
the whole process tree (driver, fork server, workers), as a ratio to ``gym`` too: on a machine
others keep busy, frames/s mostly measures the cores they left, the CPU cost per frame much
less so. Run with nothing else busy::

    python benchmarks/compare_torchrl_factories.py                   # 3 repeats, 6 s cells
    python benchmarks/compare_torchrl_factories.py --quick           # one 2 s repeat
    python benchmarks/compare_torchrl_factories.py --json out.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_collectors import SleepPixelGym, make_policy  # noqa: E402

# target ratios to the gymnasium factories (issue 22)
TARGETS = {("cartpole", "gymenv"): 0.80, ("cartpole", "transformed"): 0.50, ("cartpole", "gymenv_vec"): 0.80,
           ("sleep2ms", "gymwrapper"): 0.95, ("sleep2ms", "torchrl_env"): 0.95}


def _gym_cartpole():
    import gymnasium as gym

    return gym.make("CartPole-v1")


def _gymenv_cartpole():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def _gymenv_cartpole_categorical():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1", categorical_action_encoding=True)


def _gymenv_cartpole_slow():
    from torchrl_asyncpool.envs.torchrl_fast import FAST_PATH_ATTR

    env = _gymenv_cartpole()
    setattr(env, FAST_PATH_ATTR, False)
    return env


def _transformed_cartpole():
    from torchrl.envs import Compose, GymEnv, RewardSum, StepCounter, TransformedEnv

    return TransformedEnv(GymEnv("CartPole-v1"), Compose(StepCounter(), RewardSum()))


def _gymenv_vec_cartpole(num_envs=16):
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1", num_envs=num_envs)


def _gym_vec_cartpole(num_envs=16):
    import gymnasium as gym

    return gym.vector.SyncVectorEnv([_gym_cartpole] * num_envs)


def _gym_sleep():
    return SleepPixelGym(0.002)


def _gymwrapper_sleep():
    from torchrl.envs import GymWrapper

    return GymWrapper(SleepPixelGym(0.002))


def _torchrl_sleep():
    from torchrl_asyncpool.testing import SleepPixelEnv

    return SleepPixelEnv(0.002)


# workload -> (obs key, obs dim, actions, envs, {impl: (factories(n), one-hot actions)})
WORKLOADS = {
    "cartpole": ("observation", 4, 2, 32, {
        "gym": (lambda n: [_gym_cartpole] * n, False),
        "gymenv": (lambda n: [_gymenv_cartpole] * n, True),
        "gymenv_cat": (lambda n: [_gymenv_cartpole_categorical] * n, False),
        "transformed": (lambda n: [_transformed_cartpole] * n, True),
        "gymenv_vec": (lambda n: [functools.partial(_gymenv_vec_cartpole, n // 2)] * 2, True),
        "gymenv_slow": (lambda n: [_gymenv_cartpole_slow] * n, True),
        "gym_vec": (lambda n: [functools.partial(_gym_vec_cartpole, n // 2)] * 2, False),
    }),
    "sleep2ms": ("vector", 4, 4, 16, {
        "gym": (lambda n: [_gym_sleep] * n, False),
        "gymwrapper": (lambda n: [_gymwrapper_sleep] * n, True),
        "torchrl_env": (lambda n: [_torchrl_sleep] * n, False),
    }),
}


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and all its descendants still
    running (the fork server, the pool's workers, an inference process), from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parent[int(pid)] = int(fields[1])
        cpu[int(pid)] = (int(fields[11]) + int(fields[12])) / tick
    me, total = os.getpid(), 0.0
    for pid in cpu:
        p = pid
        while p > 1 and p != me:
            p = parent.get(p, 0)
        if p == me:
            total += cpu[pid]
    return total


def run_cell(workload, impl, seconds, fpb, envs=None):
    """``(frames/s, constructor-to-first-batch s, frames per CPU second)`` of one collector run.

    Frames per CPU second (of this process and its descendants) is the efficiency a busy
    machine disturbs least: frames/s also measures how much of the cores others left us."""
    from torchrl_asyncpool import AsyncPoolCollector
    from torchrl_asyncpool.envs.torchrl_vector_hosting import synchronous_vector_envs

    key, dim, na, n, impls = WORKLOADS[workload]
    n = envs or n
    factories, one_hot = impls[impl]
    t0 = time.perf_counter()
    # the spec env the pool builds here would start GymEnv(num_envs=k)'s k processes only to be
    # read (the workers build theirs synchronously anyway)
    with synchronous_vector_envs():
        c = AsyncPoolCollector(factories(n), policy=make_policy(key, dim, na, one_hot=one_hot), frames_per_batch=fpb)
    try:
        it = iter(c)
        next(it)
        startup = time.perf_counter() - t0
        t0, cpu0 = time.perf_counter(), _tree_cpu_s()
        frames = 0
        while time.perf_counter() - t0 < seconds:
            frames += next(it).numel()
        fps = frames / (time.perf_counter() - t0)
        fpcpu = frames / max(_tree_cpu_s() - cpu0, 1e-9)
    finally:
        c.shutdown()
    return fps, startup, fpcpu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--impls", nargs="+", default=None, help="a subset of each workload's implementations")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="one repeat of 2 s cells")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seconds, repeats = (2.0, 1) if args.quick else (args.seconds, args.repeats)
    rows = []
    for rep in range(repeats):
        for w in args.workloads:
            for impl in WORKLOADS[w][4]:
                if args.impls and impl not in args.impls and impl != "gym":
                    continue
                try:
                    fps, startup, fpcpu = run_cell(w, impl, seconds, args.frames_per_batch)
                    row = dict(workload=w, impl=impl, rep=rep, fps=fps, startup_s=startup, frames_per_cpu_s=fpcpu,
                               load_average=os.getloadavg()[0])
                except Exception as e:  # noqa: BLE001 - one failing cell must not hide the others
                    row = dict(workload=w, impl=impl, rep=rep, fps=float("nan"), startup_s=float("nan"),
                               frames_per_cpu_s=float("nan"), error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = summarize(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return summary


def summarize(rows):
    """Prints and returns one line per (workload, impl): median frames/s and the median of its
    per-repeat ratios to the ``gym`` cell of the same repeat."""
    ref = {(r["workload"], r["rep"]): r["fps"] for r in rows if r["impl"] == "gym"}
    ref_cpu = {(r["workload"], r["rep"]): r.get("frames_per_cpu_s") for r in rows if r["impl"] == "gym"}
    cells = {}
    for r in rows:
        cells.setdefault((r["workload"], r["impl"]), []).append(r)
    out = []
    print(f"\n{'workload':9} {'impl':12} {'frames/s':>9} {'x gym':>6} {'ratios':>22} {'target':>6} "
          f"{'frames/cpu-s x gym':>18} {'1st batch s':>11}")
    for (w, impl), rs in cells.items():
        ok = [r for r in rs if r["fps"] == r["fps"]]
        fps = statistics.median(r["fps"] for r in ok) if ok else float("nan")
        ratios = [r["fps"] / ref[(w, r["rep"])] for r in ok if ref.get((w, r["rep"]))]
        ratio = statistics.median(ratios) if ratios else float("nan")
        cpu_ratios = [r["frames_per_cpu_s"] / ref_cpu[(w, r["rep"])] for r in ok
                      if r.get("frames_per_cpu_s") and ref_cpu.get((w, r["rep"]))]
        cpu_ratio = statistics.median(cpu_ratios) if cpu_ratios else float("nan")
        target = TARGETS.get((w, impl))
        startup = statistics.median(r["startup_s"] for r in ok) if ok else float("nan")
        print(f"{w:9} {impl:12} {fps:>9.0f} {ratio:>6.2f} {' '.join(f'{x:.2f}' for x in ratios):>22} "
              f"{'' if target is None else f'{target:.2f}':>6} {cpu_ratio:>18.2f} {startup:>11.2f}"
              + ("".join(f"  ERROR {r['error']}" for r in rs if "error" in r)))
        out.append(dict(workload=w, impl=impl, fps=fps, ratio=ratio, ratios=ratios, target=target, startup_s=startup,
                        cpu_ratio=cpu_ratio, cpu_ratios=cpu_ratios))
    return out


if __name__ == "__main__":
    main()
