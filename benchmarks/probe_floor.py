"""The floor under "% of N/latency" on this machine: what one env's cycle costs with no pipeline at all.

The 2 ms env's target is a share of ``N / step_s`` (every env stepping back to back). Each env's
cycle is its step plus the wait for its action, so no collector can beat a loop that steps one
env and calls the policy in the same thread, with nothing between them. This script measures
that loop and the pieces a pipeline adds to it, on the workload of ``compare_collectors.py``
(its sleeping pixel env and its MLP policy):

* ``time.sleep(step_s)`` alone, and the env's step alone (the sleep, then the pixel fill);
* the policy on a batch of one, in a hot loop and right after a ``step_s`` sleep (cold caches);
* one env and the policy in one thread: the in-thread ceiling, as a share of ``1 / step_s``
  (the policy's network called on the observation directly, as the gymnasium baseline loop
  of ``compare_collectors.py`` calls it), and the same with the whole policy on a TensorDict,
  as a collector calls it;
* an ``eventfd`` round trip between two processes, on one core and across two, hot and after
  a ``step_s`` sleep: the least that handing a record to another process and its answer back
  can cost (a collector makes at least one such round trip per cycle: worker -> policy -> worker),
  and what the write that wakes the other side costs the writer; across two cores also with
  both sides' waits idle-polled (``BellWait(idle_poll=True)``, C extension: each process's
  ``SCHED_IDLE`` poller sees the ring and wakes its waiter on its own core).

It then says how many microseconds a target share leaves beyond the in-thread loop::

    python benchmarks/probe_floor.py                 # 2 ms env, 500 rounds each, target 85 %
    python benchmarks/probe_floor.py --json floor.json

Run it with nothing else busy on the machine; Linux only (``os.eventfd``, CPU affinity).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import time

import torch
from tensordict import TensorDict

from torchrl_asyncpool.exchange import BellWait, Doorbell
from torchrl_asyncpool.exchange import doorbell as doorbell_module

# run as a script, this folder is sys.path[0] (as for profile_collector.py)
from compare_collectors import make_policy, make_sleep  # noqa: E402

#: the child of a round-trip probe gives up after this long without a ping (its parent died)
_CHILD_PATIENCE_S = 5.0


def _summary(seconds: list) -> dict:
    """Median and mean of a list of durations, in microseconds."""
    return {"median_us": 1e6 * statistics.median(seconds), "mean_us": 1e6 * statistics.fmean(seconds)}


class _PlainWait:
    """``poll(2)`` on one eventfd, then its read: the round trip with plain blocking waits."""

    def __init__(self, fd: int):
        self.fd, self.poller = fd, select.poll()
        self.poller.register(fd, select.POLLIN)

    def wait(self, timeout_s: float) -> bool:
        if not self.poller.poll(int(1000 * timeout_s)):
            return False
        os.eventfd_read(self.fd)
        return True


class _IdlePolledWait:
    """The same wait parked for the process's idle poller (:class:`BellWait`, which drains)."""

    def __init__(self, fd: int):
        self.waiter = BellWait(Doorbell(fd), idle_poll=True)

    def wait(self, timeout_s: float) -> bool:
        return bool(self.waiter.wait(timeout_s))


def idle_poll_available() -> bool:
    """Whether the C extension that idle-polls waits is built."""
    return doorbell_module._c is not None


def round_trips(cpu_a: int, cpu_b: int, gap_s: float, rounds: int, idle_poll: bool = False) -> dict:
    """An ``eventfd`` ping-pong between this process (on ``cpu_a``) and a forked child (on
    ``cpu_b``); ``gap_s``: how long this side sleeps before each ping (the child waits meanwhile);
    ``idle_poll``: both sides' waits idle-polled. ``ring_median_us``: the ping's
    ``eventfd_write`` alone, what waking the child costs the waker."""
    flags = os.EFD_NONBLOCK if idle_poll else 0  # BellWait drains without blocking
    ping, pong = os.eventfd(0, flags), os.eventfd(0, flags)
    wait_on = _IdlePolledWait if idle_poll else _PlainWait
    previous = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit (no torch, no atexit handlers)
        code = 0
        try:
            os.sched_setaffinity(0, {cpu_b})
            waiter = wait_on(ping)
            for _ in range(rounds):
                if not waiter.wait(_CHILD_PATIENCE_S):
                    code = 1
                    break
                os.eventfd_write(pong, 1)
        finally:
            os._exit(code)
    times, rings = [], []  # the whole round trip; the ping's write alone (the waker's share)
    try:
        os.sched_setaffinity(0, {cpu_a})
        waiter = wait_on(pong)
        time.sleep(0.05)  # the child reaches its first wait
        for _ in range(rounds):
            if gap_s:
                time.sleep(gap_s)
            t = time.perf_counter()
            os.eventfd_write(ping, 1)
            rings.append(time.perf_counter() - t)
            if not waiter.wait(_CHILD_PATIENCE_S):
                raise RuntimeError(f"the round-trip child (pid {pid}) stopped answering")
            times.append(time.perf_counter() - t)
    finally:
        os.sched_setaffinity(0, previous)
        if len(times) < rounds:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(ping)
        os.close(pong)
    return {**_summary(times), "ring_median_us": 1e6 * statistics.median(rings)}


def _timed(fn, rounds: int, gap_s: float = 0.0) -> dict:
    times = []
    for _ in range(rounds):
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return _summary(times)


def _in_thread(env, act, rounds: int) -> dict:
    """Cycle times of ``obs -> act(obs) -> env.step`` in this thread (resets included)."""
    obs, _ = env.reset(seed=0)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        obs, _, terminated, truncated, _ = env.step(act(obs))
        if terminated or truncated:
            obs, _ = env.reset()
        times.append(time.perf_counter() - t)
    return _summary(times)


def measure(step_s: float = 0.002, rounds: int = 500, target: float = 0.85) -> dict:
    """Every number the script prints, as a dict (durations in microseconds)."""
    cpus = sorted(os.sched_getaffinity(0))
    r = {"step_s": step_s, "rounds": rounds, "target": target, "cpus": len(cpus)}
    # the round trips first, before torch has started any thread that a fork would not copy
    r["round_trip"] = {"same_core_hot": round_trips(cpus[0], cpus[0], 0.0, rounds),
                       "same_core_after_sleep": round_trips(cpus[0], cpus[0], step_s, rounds)}
    if len(cpus) > 1:
        r["round_trip"]["cross_core_hot"] = round_trips(cpus[0], cpus[1], 0.0, rounds)
        r["round_trip"]["cross_core_after_sleep"] = round_trips(cpus[0], cpus[1], step_s, rounds)
        if idle_poll_available():
            r["round_trip"]["cross_core_idle_poll_hot"] = round_trips(cpus[0], cpus[1], 0.0, rounds, True)
            r["round_trip"]["cross_core_idle_poll_after_sleep"] = round_trips(cpus[0], cpus[1], step_s, rounds, True)

    torch.set_num_threads(1)
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        env = make_sleep()
        env.step_s = step_s
        policy = make_policy("vector", 4, 4)
        td = TensorDict({"vector": torch.zeros(1, 4)}, [1])
        r["sleep"] = _timed(lambda: time.sleep(step_s), rounds)
        env.reset(seed=0)
        r["env_step"] = _timed(lambda: env.step(0), rounds)
        r["policy_hot"] = _timed(lambda: policy(td), rounds)
        r["policy_after_sleep"] = _timed(lambda: policy(td), rounds, gap_s=step_s)

        # one env and the policy, nothing between them: the network on the observation as the
        # gymnasium baseline loop calls it, and the whole policy on a TensorDict as a collector does
        def net(obs):
            return policy.net(torch.as_tensor(obs["vector"])).argmax(-1).numpy()

        def whole(obs):
            td = TensorDict(vector=torch.as_tensor(obs["vector"]).unsqueeze(0), batch_size=[1])
            return policy(td)["action"][0].numpy()

        r["in_thread_cycle"] = _in_thread(env, net, rounds)
        r["in_thread_cycle_td"] = _in_thread(env, whole, rounds)
    finally:
        torch.set_grad_enabled(grad)
    r["in_thread_share"] = 1e6 * step_s / r["in_thread_cycle"]["mean_us"]
    r["in_thread_share_td"] = 1e6 * step_s / r["in_thread_cycle_td"]["mean_us"]
    r["target_cycle_us"] = 1e6 * step_s / target
    r["budget_beyond_in_thread_us"] = r["target_cycle_us"] - r["in_thread_cycle"]["mean_us"]
    return r


def _print(r: dict) -> None:
    med = lambda d: f"{d['median_us']:,.0f}"  # noqa: E731
    row = lambda label, value: print(f"  {label:<57s}{value}")  # noqa: E731
    print(f"{1e3 * r['step_s']:g} ms env on this machine ({r['rounds']} rounds each; medians, the cycle's mean):")
    row(f"time.sleep({r['step_s']:g})", f"{med(r['sleep'])} us")
    row("the env's step alone", f"{med(r['env_step'])} us")
    row("the policy, batch 1: hot / after a sleep", f"{med(r['policy_hot'])} / {med(r['policy_after_sleep'])} us")
    row("one env + the network in one thread", f"{r['in_thread_cycle']['mean_us']:,.0f} us -> "
        f"{100 * r['in_thread_share']:.1f} % of N/latency (the in-thread ceiling)")
    row("one env + the TensorDict policy in one thread", f"{r['in_thread_cycle_td']['mean_us']:,.0f} us -> "
        f"{100 * r['in_thread_share_td']:.1f} % of N/latency")
    rt = r["round_trip"]
    for where, hot, slept in (("one core", "same_core_hot", "same_core_after_sleep"),
                              ("two cores", "cross_core_hot", "cross_core_after_sleep"),
                              ("two cores, idle-polled", "cross_core_idle_poll_hot",
                               "cross_core_idle_poll_after_sleep")):
        if hot in rt:
            row(f"eventfd round trip, {where}: hot / slept", f"{med(rt[hot])} / {med(rt[slept])} us "
                f"(the waking write alone: {rt[hot]['ring_median_us']:,.1f} / {rt[slept]['ring_median_us']:,.1f} us)")
    budget = r["budget_beyond_in_thread_us"]
    print(f"{100 * r['target']:.0f} % of N/latency needs a cycle of {r['target_cycle_us']:,.0f} us: "
          + (f"{budget:,.0f} us beyond the in-thread loop for everything a pipeline adds."
             if budget >= 0 else f"{-budget:,.0f} us less than the in-thread loop takes."))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=2.0, help="the env's sleep per step (default 2)")
    p.add_argument("--rounds", type=int, default=500, help="repetitions of each measurement (default 500)")
    p.add_argument("--target", type=float, default=85.0, help="the target share of N/latency, in %% (default 85)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}.")
    if args.step_ms <= 0:
        p.error(f"--step-ms must be positive, got {args.step_ms}.")
    if not 0 < args.target <= 100:
        p.error(f"--target is a share of N/latency in %, in (0, 100]; got {args.target}.")
    if not hasattr(os, "eventfd") or not hasattr(os, "sched_getaffinity"):
        p.error("this probe needs Linux (os.eventfd and CPU affinity).")
    r = measure(args.step_ms / 1e3, args.rounds, args.target / 100)
    _print(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
