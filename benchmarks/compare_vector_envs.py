"""Vector env factories: AsyncPoolCollector hosting gymnasium vector envs against in-process loops.

A factory may return a ``gymnasium.vector.VectorEnv`` of ``k`` envs; each worker steps its
vector env with one call once all ``k`` are answered. Two workloads, both measured as
frames/s delivered to the learner (``frames_per_batch`` transitions per batch, TorchRL
layout) against a single-process loop that steps the same vector envs and calls the same
policy's MLP on the bare observations (no TensorDict, nothing stored: an upper bound for
that loop):

* ``cartpole_vec``  gymnasium's numpy-vectorized CartPole (``vectorization_mode=
                    "vector_entry_point"``), ``W`` workers x ``k`` envs; the loop steps one
                    vector env of ``W * k``. Cheap: the in-process loop is the one to beat.
* ``sleep2ms_vec``  a batched simulator whose step call takes 2 ms for all its ``k`` envs
                    (what a physics engine or a GPU simulator call costs), ``W`` vector envs;
                    the loop steps them in turn. Reports % of the ``W * k / 2 ms`` limit.

Run with nothing else busy::

    python benchmarks/compare_vector_envs.py                  # both workloads, 2 repeats
    python benchmarks/compare_vector_envs.py --seconds 2 --repeats 1 --json out.json
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import gymnasium as gym
import numpy as np
import torch
from compare_collectors import GymLoop, make_policy

from torchrl_asyncpool import AsyncPoolCollector


class SleepVectorGym(gym.vector.VectorEnv):
    """``k`` envs stepped by one call that takes ``latency`` seconds; 4-float observations,
    2 actions, episodes truncated after ``episode_len`` steps (NEXT_STEP autoreset)."""

    def __init__(self, k: int = 16, latency: float = 0.002, episode_len: int = 200):
        self.num_envs, self.latency, self.episode_len = k, latency, episode_len
        self.single_observation_space = gym.spaces.Box(-10, 10, (4,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, k)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, k)
        self.metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}
        self._t = np.zeros(k, np.int64)
        self._ended = np.zeros(k, bool)
        self._rng = np.random.default_rng(0)

    def reset(self, *, seed=None, options=None):
        self._t[:] = 0
        self._ended[:] = False
        return self._rng.standard_normal((self.num_envs, 4)).astype(np.float32), {}

    def step(self, actions):
        time.sleep(self.latency)
        self._t[self._ended] = 0  # NEXT_STEP: these envs return their reset observation
        reward = np.where(self._ended, 0.0, 1.0)
        self._t[~self._ended] += 1
        truncated = self._t >= self.episode_len
        self._ended = truncated.copy()
        obs = self._rng.standard_normal((self.num_envs, 4)).astype(np.float32)
        return obs, reward, np.zeros(self.num_envs, bool), truncated, {}


def _cartpole_vec(k):
    return gym.make_vec("CartPole-v1", num_envs=k, vectorization_mode="vector_entry_point")


WORKLOADS = {
    # name: (vector env factory of k envs, latency of a step call or None, (workers, k) cells)
    "cartpole_vec": (_cartpole_vec, None, ((2, 16), (2, 32), (2, 64))),
    "sleep2ms_vec": (SleepVectorGym, 0.002, ((4, 16), (8, 16))),
}


def build_asyncpool(name, workers, k, frames_per_batch):
    """The collector of one cell: ``workers`` vector envs of ``k`` envs, default settings."""
    make = WORKLOADS[name][0]
    return AsyncPoolCollector([functools.partial(make, k)] * workers, policy=make_policy("observation", 4, 2),
                              frames_per_batch=frames_per_batch, total_frames=-1)


def run_ours(name, workers, k, seconds, frames_per_batch):
    t0 = time.perf_counter()
    c = build_asyncpool(name, workers, k, frames_per_batch)
    try:
        it = iter(c)
        next(it)
        first = time.perf_counter() - t0
        for _ in range(2):
            next(it)
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            n += next(it).numel()
        return n / (time.perf_counter() - t), first
    finally:
        c.shutdown()


def run_loop(make, workers, k, seconds, name):
    """One process: the cheap workload as one vector env of workers * k envs, the slow one as
    ``workers`` vector envs of ``k`` stepped in turn; each batch goes through
    ``compare_collectors.GymLoop`` (the bare MLP on the observations, as for the gymnasium
    baselines there: both workloads have CartPole's 4-float observation and 2 actions)."""
    envs = [make(workers * k)] if name == "cartpole_vec" else [make(k) for _ in range(workers)]
    loops = [GymLoop(env, "cartpole") for env in envs]
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        for loop in loops:
            n += loop.step()
    for env in envs:
        env.close()
    return n / (time.perf_counter() - t)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell, the implementations interleaved")
    parser.add_argument("--json", default=None, help="write every record to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    records = []
    print(f"{'workload':14s} {'cell':>6s} {'asyncpool':>10s} {'loop':>10s} {'ratio':>6s} {'% limit':>8s} "
          f"{'1st batch s':>11s}")
    for name in args.workloads:
        make, latency, cells = WORKLOADS[name]
        for workers, k in cells:
            for rep in range(args.repeats):
                fps, first = run_ours(name, workers, k, args.seconds, max(1024, 16 * workers * k))
                loop = run_loop(make, workers, k, args.seconds, name)
                limit = workers * k / latency if latency else None
                rec = dict(workload=name, workers=workers, k=k, repeat=rep, asyncpool_fps=fps, loop_fps=loop,
                           ratio=fps / loop, pct_limit=100 * fps / limit if limit else None, first_batch_s=first)
                records.append(rec)
                pct = f"{rec['pct_limit']:.1f}" if limit else "-"
                print(f"{name:14s} {workers:>2d}x{k:<3d} {fps:10.0f} {loop:10.0f} {fps / loop:5.2f}x {pct:>8s} "
                      f"{first:11.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
