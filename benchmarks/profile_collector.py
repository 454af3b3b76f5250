"""Where one collector cell's time goes: a single ``AsyncPoolCollector`` workload, measured from the
inside (Linux only: it reads ``/proc``).

``compare_collectors.py`` says how fast each implementation is; this script says why ours is as
fast as it is, on the same workloads and builders. For one workload and env count it reports:

* frames/s delivered to the learner and, for the 2 ms env, the share of the N/latency limit;
* one env's cycle split into the step itself (timed in the workers), ready -> leased by the
  serving loop, leased -> answered, and the rest (the worker's wake-up and copies), whose sum is
  ``envs / frames_per_s``;
* the serving loop's batch size, policy time and service time (``server_stats``);
* the flush deadline's decision (``timeout="auto"``: wait or greedy, the deadline and its candidate);
* CPU per frame of each thread of this process (serving thread, learner, ...) and of each child
  process (env workers, a server process), user and system apart, and minor page faults. A
  process's ``asyncpool-idle`` thread is its idle poller (``SCHED_IDLE``: it runs only when its
  core has nothing else to run), so its CPU is the time the cores would otherwise have idled: it
  is listed on a line of its own (``idle poller: of env worker 0 ...``) and left out of its
  process's line. An env worker's line also gives the frames of its own envs and its CPU over
  those (``[33,280 own frames, 60.4 us each]``): workers need not deliver the same share (one on
  the policy's CPU can step more often than those that share the other), so a worker's CPU per
  delivered frame says how much of the machine it took, and its CPU per own frame what a step
  costs it.

``--policy cnn`` serves the Nature CNN on ``atari`` (``compare_real.py``'s, the SEED case).
``--policy zero`` swaps the benchmark MLP for a policy that only writes a zero action: the
serving loop's own cost per batch, with the policy taken out. For example::

    python benchmarks/profile_collector.py --workload sleep2ms --envs 16
    python benchmarks/profile_collector.py --workload sleep2ms --envs 16 --policy zero
    python benchmarks/profile_collector.py --workload cartpole --envs 32 --set worker_affinity=None
    python benchmarks/profile_collector.py --workload mujoco --envs 16    # compare_real.py's HalfCheetah-v5 cell
    python benchmarks/profile_collector.py --workload mujoco --envs 16 --stack envpool   # its ours_envpool cell
    python benchmarks/profile_collector.py --workload mujoco --envs 16 --stack torchrl   # its ours_torchrl cell

``atari`` and ``mujoco`` are ``compare_real.py``'s gymnasium stacks with its cheap policy (the
``[benchmarks]`` extra installs ale-py and mujoco).

Run it with nothing else busy on the machine.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import threading
import time

import torch

# run as a script, this folder is sys.path[0]: the workers find compare_collectors' env
# factories by that module name, as they do for compare_collectors.py itself
from compare_collectors import WORKLOADS, build_asyncpool  # noqa: E402

#: compare_real.py's workloads: its gymnasium stacks and cheap policy
REAL_WORKLOADS = ("atari", "mujoco")

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path):
    """``(ppid, user s, system s, minor faults)`` from a ``/proc/.../stat`` file, or ``None``."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return None
    # fields[0] is the state (field 3 of proc(5)): ppid is field 4, minflt 10, utime 14, stime 15
    return int(fields[1]), int(fields[11]) / _TICK, int(fields[12]) / _TICK, int(fields[7])


_IDLE_POLLER = "asyncpool-idle"  # the kernel name of a process's idle poller thread (exchange/csrc/idle_poll.c)


def _comm(path: str):
    """The kernel name in ``path`` (a ``/proc/.../comm`` file), or None once it is gone."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _descendants(root: int) -> dict:
    """``{pid: name}`` of every process below ``root``."""
    parent, names = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(f"/proc/{entry}/stat")
            if st is not None:
                parent[int(entry)] = st[0]
                name = _comm(f"/proc/{entry}/comm")
                if name is not None:
                    names[int(entry)] = name
    out, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in out:
                out[child] = names.get(child, "?")
                frontier.append(child)
    return out


def _cpu_snapshot(pids) -> dict:
    """CPU seconds (user, system) and minor faults of this process's threads and of ``pids``."""
    me = os.getpid()
    snap = {}
    for tid in os.listdir(f"/proc/{me}/task"):
        st = _stat(f"/proc/{me}/task/{tid}/stat")
        if st is not None:
            snap[("thread", int(tid))] = st[1:]
    for pid in pids:
        st = _stat(f"/proc/{pid}/stat")
        if st is not None:
            snap[("process", pid)] = st[1:]
            idle = _idle_poller_cpu(pid)
            if idle is not None:
                snap[("idle poller", pid)] = idle
    return snap


def _idle_poller_cpu(pid: int):
    """(user, system, 0) CPU seconds of process ``pid``'s ``asyncpool-idle`` thread(s), or None."""
    found = None
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        st = _stat(f"/proc/{pid}/task/{tid}/stat") if _comm(f"/proc/{pid}/task/{tid}/comm") == _IDLE_POLLER else None
        if st is not None:
            user, system = (0.0, 0.0) if found is None else found[:2]
            found = (user + st[1], system + st[2], 0)
    return found


def _zero_policy(n, shape=(), dtype=torch.int64):
    zeros = torch.zeros(n, *shape, dtype=dtype)

    def act(td):
        return td.set("action", zeros[: td.batch_size[0]])

    return act


def profile(workload: str, envs: int, seconds: float, policy: str = "mlp", frames_per_batch: int = 1024,
            warmup_batches: int = 5, stack: str = "gym", **collector_kwargs) -> dict:
    """Runs one cell and returns the measurements described in the module docstring."""
    if workload not in WORKLOADS and workload not in REAL_WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS) + list(REAL_WORKLOADS)}, got {workload!r}.")
    if policy not in ("mlp", "zero", "cnn"):
        raise ValueError(f"policy must be 'mlp', 'zero' or 'cnn', got {policy!r}.")
    if policy == "cnn" and workload != "atari":
        raise ValueError(f"policy 'cnn' (the Nature CNN) is for the atari workload, got {workload!r}.")
    if stack not in ("gym", "envpool", "torchrl"):
        raise ValueError(f"stack must be 'gym', 'envpool' or 'torchrl', got {stack!r}.")
    if stack == "envpool" and workload not in REAL_WORKLOADS:
        raise ValueError(f"stack 'envpool' hosts EnvPool's own envs: atari or mujoco, got {workload!r}.")
    if stack == "torchrl" and (workload not in REAL_WORKLOADS or policy == "zero"):
        raise ValueError("stack 'torchrl' is compare_real.py's ours_torchrl cell: atari or mujoco with policy "
                         f"'mlp' or 'cnn', got {workload!r} with {policy!r}.")
    from torchrl_asyncpool import AsyncPoolCollector

    if workload in REAL_WORKLOADS:
        from compare_real import (GYM_FACTORY, MUJOCO_ACT, TORCHRL_FACTORY, _cores, _split, make_envpool,
                                  make_td_policy)

        if policy in ("mlp", "cnn"):  # TorchRL's specs: one-hot Atari actions, float32 MuJoCo ones
            act = make_td_policy(workload, "mean" if policy == "mlp" else "cnn", torchrl_specs=stack == "torchrl")
        elif workload == "mujoco":  # HalfCheetah's float64 Box action
            act = _zero_policy(envs, (MUJOCO_ACT,), torch.float64)
        else:
            act = _zero_policy(envs)
        if stack == "envpool":  # compare_real's ours_envpool: one EnvPool vector env per core, in lockstep
            fns = [functools.partial(make_envpool, workload, k) for k in _split(envs, _cores())]
        elif stack == "torchrl":  # compare_real's ours_torchrl: TorchRL factories of the same stack
            fns = [TORCHRL_FACTORY[workload]] * envs
        else:
            fns = [GYM_FACTORY[workload]] * envs
        collector = AsyncPoolCollector(fns, policy=act, frames_per_batch=frames_per_batch, **collector_kwargs)
    elif policy == "zero":
        collector = AsyncPoolCollector([WORKLOADS[workload][0]] * envs, policy=_zero_policy(envs),
                                       frames_per_batch=frames_per_batch, **collector_kwargs)
    else:
        collector = build_asyncpool(workload, envs, frames_per_batch, **collector_kwargs)
    try:
        it = iter(collector)
        for _ in range(warmup_batches):
            next(it)
        children = _descendants(os.getpid())
        collector.pool_metrics(reset=True)
        collector.server_stats(reset=True)
        before = _cpu_snapshot(children)
        t0 = time.perf_counter()
        frames = 0
        env_frames = torch.zeros(envs, dtype=torch.int64)  # per env: a worker's own frames
        while time.perf_counter() - t0 < seconds:
            batch = next(it)
            frames += frames_per_batch if batch is None else batch.numel()
            if batch is not None and "env_index" in batch.keys():
                env_frames += torch.bincount(batch["env_index"].reshape(-1), minlength=envs)[:envs]
        elapsed = time.perf_counter() - t0
        after = _cpu_snapshot(children)
        pool = collector.pool_metrics()
        server = collector.server_stats()
        plan = {k: v for k, v in collector.plan().items() if k.startswith("flush_")}
        # labels, read while the threads and processes still exist
        names = {t.native_id: t.name for t in threading.enumerate()}
        names[os.getpid()] = "main thread"
        for kind, ident in after:  # threads started in C (the idle poller): their kernel name
            if kind == "thread" and ident not in names:
                name = _comm(f"/proc/self/task/{ident}/comm")
                if name is not None:
                    names[ident] = f"{name} ({ident})"
        own_frames = {}  # worker pid -> the frames of the envs it hosts (a worker's share can differ)
        slot_workers = collector.env.slot_workers
        for w, pid in enumerate(collector.env.worker_pids):
            children[pid] = f"env worker {w}"
            own_frames[pid] = int(sum(int(env_frames[i]) for i, sw in enumerate(slot_workers) if sw == w))
        if collector.server.pid is not None:
            children[collector.server.pid] = "inference server"
    finally:
        collector.shutdown()
    cpu = []
    for key, (user1, sys1, flt1) in after.items():
        user0, sys0, flt0 = before.get(key, (0.0, 0.0, 0))
        kind, ident = key
        if kind == "process" and ("idle poller", ident) in after:  # its busy threads only
            (iu1, is1, _), (iu0, is0, _) = after["idle poller", ident], before.get(("idle poller", ident), (0, 0, 0))
            user1, sys1 = user1 - (iu1 - iu0), sys1 - (is1 - is0)
        if kind == "thread":
            label = names.get(ident, f"thread {ident}")
        elif kind == "idle poller":
            label = f"of {children.get(ident, '?')} (pid {ident})"
        else:
            label = f"{children.get(ident, '?')} (pid {ident}), idle poller apart"
        own = own_frames.get(ident) if kind == "process" else None
        cpu.append({
            "what": f"{kind}: {label}",
            "user_us_per_frame": 1e6 * (user1 - user0) / frames,
            "system_us_per_frame": 1e6 * (sys1 - sys0) / frames,
            "minor_faults_per_frame": (flt1 - flt0) / frames if kind == "process" else None,
            # an env worker's CPU over the frames of its own envs (its cost a step, whatever its share)
            "own_frames": own,
            "us_per_own_frame": 1e6 * (user1 - user0 + sys1 - sys0) / own if own else None,
        })
    cpu = [c for c in cpu if c["user_us_per_frame"] + c["system_us_per_frame"] > 0.05]
    cpu.sort(key=lambda c: -(c["user_us_per_frame"] + c["system_us_per_frame"]))
    fps = frames / elapsed
    cycle = envs / fps
    step, dwell, answer = pool["env_step_time_s"], pool["obs_to_batch_dwell_s"], pool["batch_to_action_dwell_s"]
    out = {
        "workload": workload, "envs": envs, "policy": policy, "stack": stack,
        "collector_kwargs": {k: repr(v) for k, v in collector_kwargs.items()},
        "frames_per_s": fps,
        "pct_of_n_over_latency": 100.0 * fps * 0.002 / envs if workload == "sleep2ms" else None,
        "cycle_us": {"env step": 1e6 * step, "ready -> leased": 1e6 * dwell, "leased -> answered": 1e6 * answer,
                     "rest (wake-up, copies)": 1e6 * (cycle - step - dwell - answer), "total": 1e6 * cycle},
        "mean_batch_size": server["mean_batch_size"],
        "policy_us_per_batch": 1e6 * server["inference_time_s"],
        "service_us_per_batch": 1e6 * server["service_time_s"],
        "consumer_busy_fraction": pool["consumer_busy_fraction"],
        "flush": plan,
        "cpu": cpu,
    }
    return out


def _print(r: dict) -> None:
    pct = "" if r["pct_of_n_over_latency"] is None else f", {r['pct_of_n_over_latency']:.1f} % of N/latency"
    extra = "".join(f", {k}={v}" for k, v in r["collector_kwargs"].items())
    stack = "" if r.get("stack", "gym") == "gym" else f" ({r['stack']} stack)"
    print(f"{r['workload']}{stack}, {r['envs']} envs, policy {r['policy']}{extra}: "
          f"{r['frames_per_s']:,.0f} frames/s{pct}")
    print("one env's cycle (us): " + ", ".join(f"{k} {v:,.0f}" for k, v in r["cycle_us"].items()))
    print(f"serving loop: mean batch {r['mean_batch_size']:.2f}, policy {r['policy_us_per_batch']:.0f} us "
          f"and service {r['service_us_per_batch']:.0f} us per batch, busy {100 * r['consumer_busy_fraction']:.0f} %")
    f = r["flush"]
    if f.get("flush_choice") is not None:  # timeout="auto": the deadline's decision (see docs/source/tuning.rst)
        print(f"flush deadline: {f['flush_choice']}, {1e3 * f['flush_timeout_s']:.2f} ms "
              f"(candidate {1e3 * (f.get('flush_candidate_s') or 0.0):.2f} ms)")
    print("CPU per frame (us, user + system):")
    for c in r["cpu"]:
        faults = "" if c["minor_faults_per_frame"] is None else f"  ({c['minor_faults_per_frame']:.2f} minor faults)"
        own = "" if not c.get("us_per_own_frame") else (f"  [{c['own_frames']:,} own frames, "
                                                         f"{c['us_per_own_frame']:.1f} us each]")
        print(f"  {c['what']:56s} {c['user_us_per_frame']:7.1f} + {c['system_us_per_frame']:6.1f}{faults}{own}")


def _kwarg(text: str):
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"--set takes NAME=VALUE (a Python literal), got {text!r}.")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a bare string, e.g. envs_per_worker=auto


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="sleep2ms", choices=list(WORKLOADS) + list(REAL_WORKLOADS))
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--policy", default="mlp", choices=("mlp", "zero", "cnn"))
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument("--stack", default="gym", choices=("gym", "envpool", "torchrl"),
                   help="atari/mujoco: gymnasium's envs, one per slot (default), EnvPool's own C++ envs hosted as "
                        "one vector env per core (compare_real.py's ours_envpool), or TorchRL factories of the "
                        "gymnasium stack (its ours_torchrl)")
    p.add_argument("--set", dest="kwargs", type=_kwarg, action="append", default=[],
                   help="a collector keyword, e.g. --set worker_affinity=None --set envs_per_worker=8")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if not os.path.isdir("/proc/self/task"):
        p.error("this profile reads /proc (Linux only).")
    torch.set_num_threads(1)
    r = profile(args.workload, args.envs, args.seconds, args.policy, args.frames_per_batch, stack=args.stack,
                **dict(args.kwargs))
    _print(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
