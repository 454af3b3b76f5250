"""Interleaved A/B of one collector cell between a git revision and the working tree.

On a noisy machine (this project's 2-core VM drifts 10-30 % from one minute to the next) only
interleaved pairs say anything, and the order within a pair matters too: in one sitting the
first run of each pair won 4 of 5 pairs whichever code it ran. This script therefore runs the
pairs in ABBA order (base first, then new first, ...), each run a fresh
``profile_collector.py`` process on the same workload, and reports frames/s per run, the
median of each side, the per-pair ratios and the CPU per frame of the env workers, the
serving thread and the thread that takes the batches (the learner)::

    python benchmarks/ab_commits.py --base bcf5c07 --workload sleep2ms --envs 64 --pairs 4
    python benchmarks/ab_commits.py --base HEAD~1 --workload cartpole --envs 32 --set worker_affinity=None
    python benchmarks/ab_commits.py --base HEAD~1 --workload mujoco --envs 64 --stack torchrl

The base revision is checked out into a temporary git worktree, its C extension built in place
(``setup.py build_ext --inplace``), and run with ``PYTHONPATH`` pointing there (the worker
processes inherit it); the worktree is removed afterwards. The new side is this checkout as it
is (build its extension first: ``pip install -e . --no-deps``). Run it with nothing else busy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _run(tree: str, args, out_json: str) -> dict:
    """One ``profile_collector.py`` run of ``tree`` (a checkout root); its ``--json`` result."""
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "profile_collector.py"), "--workload", args.workload,
           "--envs", str(args.envs), "--seconds", str(args.seconds), "--json", out_json]
    if args.stack != "gym":  # a base before the option existed still runs the gymnasium stack
        cmd += ["--stack", args.stack]
    for kv in args.kwargs:
        cmd += ["--set", kv]
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=os.path.join(tree, "benchmarks"), env=env, capture_output=True, text=True,
                          timeout=args.seconds + 240)
    if proc.returncode != 0:
        raise RuntimeError(f"profile_collector.py failed in {tree}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(out_json) as f:
        return json.load(f)


def _cpu(result: dict, what: str) -> float:
    return sum(r["user_us_per_frame"] + r["system_us_per_frame"] for r in result["cpu"] if what in r["what"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the git revision to compare against (e.g. HEAD~1, a hash)")
    p.add_argument("--workload", default="sleep2ms", choices=("cartpole", "sleep2ms", "atari", "mujoco"))
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--stack", default="gym", choices=("gym", "envpool", "torchrl"),
                   help="the env stack of the real workloads, as profile_collector.py takes it (default gym)")
    p.add_argument("--pairs", type=int, default=4, help="pairs of runs, in ABBA order (default 4)")
    p.add_argument("--seconds", type=float, default=8.0, help="measurement time per run")
    p.add_argument("--set", dest="kwargs", action="append", default=[],
                   help="collector keyword for both sides, as profile_collector.py takes it (repeatable)")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.seconds <= 0:
        p.error(f"--pairs must be >= 1 and --seconds > 0, got {args.pairs} and {args.seconds}.")
    base_rev = _git("rev-parse", "--short", args.base)
    with tempfile.TemporaryDirectory(prefix="ab_commits_") as tmp:
        base_tree = os.path.join(tmp, "base")
        _git("worktree", "add", "--detach", base_tree, base_rev)
        try:
            build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=base_tree,
                                   capture_output=True, text=True)
            if build.returncode != 0:
                print(f"note: the base's C extension did not build; it runs without it\n{build.stderr[-500:]}")
            runs = {"base": [], "new": []}
            for i in range(args.pairs):
                order = ("base", "new") if i % 2 == 0 else ("new", "base")
                for side in order:
                    tree = base_tree if side == "base" else ROOT
                    r = _run(tree, args, os.path.join(tmp, f"{side}_{i}.json"))
                    runs[side].append(r)
                    flush = r.get("flush", {}).get("flush_choice")  # timeout="auto": the deadline's decision
                    print(f"pair {i + 1} {side:4s} ({'first' if side == order[0] else 'second'}): "
                          f"{r['frames_per_s']:9,.0f} frames/s  workers {_cpu(r, 'worker'):5.1f} "
                          f"serving {_cpu(r, 'inference'):5.1f} learner {_cpu(r, 'main thread'):5.1f} us CPU/frame  "
                          f"batch {r['mean_batch_size']:.1f}" + ("" if flush is None else f" ({flush})"),
                          flush=True)
        finally:
            _git("worktree", "remove", "--force", base_tree)
    base = [r["frames_per_s"] for r in runs["base"]]
    new = [r["frames_per_s"] for r in runs["new"]]
    ratios = [n / b for n, b in zip(new, base)]
    stack = "" if args.stack == "gym" else f" ({args.stack} stack)"
    print(f"\n{args.workload}{stack}, {args.envs} envs, {args.pairs} pairs (ABBA), base {base_rev} vs the working tree")
    print(f"  median frames/s: base {statistics.median(base):,.0f}  new {statistics.median(new):,.0f}")
    print(f"  new/base per pair: {' '.join(f'{x:.3f}' for x in ratios)}  (median {statistics.median(ratios):.3f})")
    threads = (("worker", "workers"), ("inference", "serving thread"), ("main thread", "learner (main thread)"))
    for what, label in threads:
        b = statistics.median(_cpu(r, what) for r in runs["base"])
        n = statistics.median(_cpu(r, what) for r in runs["new"])
        print(f"  median CPU per frame, {label}: base {b:.1f}  new {n:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
