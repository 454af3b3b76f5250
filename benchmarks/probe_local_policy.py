"""The ceiling of a policy copy in each env worker, on CartPole: what a design without the central
policy's round trip could reach on this machine.

``AsyncPoolCollector`` sends every record to one central policy and waits for its answer; on a
cheap env each worker pass then pays a cross-core wake-up round trip (``probe_floor.py``). A
worker that runs its own copy of the policy pays none: it is a ``SyncVectorEnv`` loop. This
script runs ``--procs`` processes, each stepping a ``SyncVectorEnv`` of ``envs / procs``
CartPoles with the benchmark MLP called in its loop (``compare_collectors.GymLoop``), against
one process stepping all ``envs`` (the stretch baseline of ``compare_collectors.py``), in ABBA
order. Nothing is delivered to a learner, so this is an upper bound for such a design, not a
collector::

    python benchmarks/probe_local_policy.py                 # 32 envs, 2 processes, 3 rounds of 5 s
    python benchmarks/probe_local_policy.py --json local.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import gymnasium as gym
import torch

# run as a script, this folder is sys.path[0]; imported here, so forked children have it already
from compare_collectors import GymLoop  # noqa: E402

#: how long the parent waits for a child's result beyond its measuring time
_RESULT_GRACE_S = 120.0


def _loop(n: int, seconds: float, results) -> None:
    """One process: a SyncVectorEnv of ``n`` CartPoles and the policy, for ``seconds``."""
    torch.set_num_threads(1)
    loop = GymLoop(gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n), "cartpole")
    for _ in range(50):  # warm-up
        loop.step()
    frames, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        frames += loop.step()
    results.put(frames / (time.perf_counter() - t0))


def measure_processes(procs: int, envs_each: int, seconds: float) -> float:
    """Summed frames/s of ``procs`` processes, each with its own vector env of ``envs_each``."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    results = ctx.Queue()
    children = [ctx.Process(target=_loop, args=(envs_each, seconds, results), daemon=True) for _ in range(procs)]
    for c in children:
        c.start()
    try:
        return sum(results.get(timeout=seconds + _RESULT_GRACE_S) for _ in children)
    finally:
        for c in children:
            c.join(timeout=5.0)
            if c.is_alive():
                c.kill()
                c.join()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", type=int, default=32, help="CartPoles in all (default 32)")
    p.add_argument("--procs", type=int, default=2, help="processes that share them (default 2)")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring time per run (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="ABBA rounds (default 3)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.procs < 2 or args.envs % args.procs:
        p.error(f"--procs must be at least 2 and divide --envs; got --procs {args.procs}, --envs {args.envs}.")
    if args.rounds < 1 or args.seconds <= 0:
        p.error(f"--rounds must be at least 1 and --seconds positive; got {args.rounds} and {args.seconds}.")
    one, split = [], []
    for _ in range(args.rounds):  # ABBA: the first run of a pair tends to win on this VM
        one.append(measure_processes(1, args.envs, args.seconds))
        split.append(measure_processes(args.procs, args.envs // args.procs, args.seconds))
        split.append(measure_processes(args.procs, args.envs // args.procs, args.seconds))
        one.append(measure_processes(1, args.envs, args.seconds))
    r = {"envs": args.envs, "procs": args.procs, "seconds": args.seconds, "one_process_fps": one,
         "split_fps": split, "ratio_of_medians": statistics.median(split) / statistics.median(one)}
    print(f"CartPole x {args.envs}, {args.rounds} ABBA rounds of {args.seconds:g} s, frames/s:")
    print(f"  one process, SyncVectorEnv({args.envs}) + policy:        "
          + " / ".join(f"{x:,.0f}" for x in one))
    print(f"  {args.procs} processes, SyncVectorEnv({args.envs // args.procs}) + policy each: "
          + " / ".join(f"{x:,.0f}" for x in split))
    print(f"  ratio of the medians: {r['ratio_of_medians']:.2f}x (nothing delivered to a learner: an upper bound)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
