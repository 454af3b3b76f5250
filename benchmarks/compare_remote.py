"""Remote env hosts against local workers: records/s through the pool, same envs, one run.

For each workload and env count, a consumer loop (``recv`` whatever is ready, answer it with
random actions, nothing else) runs for ``--seconds`` against

* ``local``   an AsyncEnvPool of the envs in its own worker processes (default grouping);
* ``remote``  an AsyncEnvPool of :class:`~torchrl_asyncpool.remote.RemoteEnvSlot` slots fed by
              env hosts over gRPC on this machine (``--host-procs`` processes, each running
              ``num_envs / host_procs`` :class:`~torchrl_asyncpool.remote.EnvHost` threads):
              protocol 1, one stream per env, all slots on one address (one ingress worker);
* ``remote2`` an AsyncEnvPool of :class:`~torchrl_asyncpool.remote.RemoteVectorSlot` factories of
              ``--host-envs`` envs each (one address and ingress worker each), each fed by one
              host process running a :class:`~torchrl_asyncpool.remote.VectorEnvHost` of that many
              envs over one stream (protocol 2; the host's envs are a gymnasium vector env,
              ``--p2-vector-mode``: CartPole's own vectorized env by default, ``sync`` for a
              SyncVectorEnv of the same single envs protocol 1 hosts step).

* ``ray``     as ``remote``, the hosts started as ``--host-procs`` Ray actors
              (:class:`~torchrl_asyncpool.remote.ray.RayEnvHosts`, protocol 1) on a local Ray
              cluster instead of processes (needs ``ray``).
* ``ray2``    as ``remote2``, each host a Ray actor (``RayEnvHosts(protocol=2)``, the pool's
              factories from its ``pool_factories``) instead of a process: CartPole's own vector
              env of ``--host-envs`` envs (``--p2-vector-mode vector_entry_point``) or that many
              threaded envs (``threads``). ``--ray-kill`` then kills the first actor and reports the
              seconds until the pool saw its envs truncated and until its restarted host
              delivered its first record.

* ``remote2e``, ``ray2e``: as ``remote2`` and ``ray2``, the pool's side made of single-env slots
              (:meth:`RemoteVectorSlot.per_env <torchrl_asyncpool.remote.RemoteVectorSlot.per_env>`:
              one thread per env in the address's worker, each env's record published as soon as
              its host sent it) instead of one RemoteVectorSlot stepped in lockstep; ``threads``
              hosts step their envs one by one.

``--driver collector`` drives an :class:`~torchrl_asyncpool.AsyncPoolCollector` (the MLP policy,
``--frames-per-batch``) instead of the bare consumer loop: frames/s of a collector fed by the
hosts. ``--impls remote2 ray2 --host-envs 8 --envs 32 --driver collector`` is the issue's
"4 Ray-launched hosts of 8 envs against the same hosts started as processes".

``--impls remote remote2 --envs 32`` compares the protocols through one ingress worker with
the same 32 envs (the ingress CPU per record is the "pool workers" column); ``--impls remote
ray`` the same hosts started as processes or by Ray.

Workloads: CartPole-v1, the 2 ms env of ``compare_collectors.py`` (84x84x3 uint8 pixels and a
4-vector per record, 21 KB), and ``uneven``, that env with steps of 1 ms and, one in ten at
random, 20 ms (mean 2.9 ms: envs whose step time varies, where a lockstep pass waits for the
slowest env). Reports records/s, the percentage of N/latency for the 2 ms env and
the mean cycle of one env (N / rate) and the CPU each side spends per record (from /proc).
Run with nothing else busy::

    python benchmarks/compare_remote.py
    python benchmarks/compare_remote.py --envs 4 16 --seconds 5 --json out.json
    python benchmarks/compare_remote.py --workloads cartpole --envs 32 --impls remote remote2 --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import socket
import subprocess
import sys
import time

import gymnasium as gym
import torch
from tensordict import TensorDict

from compare_collectors import SleepPixelGym, make_cartpole, make_sleep

from torchrl_asyncpool import AsyncEnvPool, StepType
from torchrl_asyncpool.remote import RemoteEnvSlot, RemoteVectorSlot

class UnevenSleepPixelGym(SleepPixelGym):
    """The pixel env with uneven steps: 1 ms, and 20 ms for one step in ten at random (mean 2.9 ms)."""

    def step(self, action):
        self.step_s = 0.020 if random.random() < 0.1 else 0.001
        return super().step(action)


def make_uneven():
    return UnevenSleepPixelGym()


P2 = ("remote2", "remote2e", "ray2", "ray2e")  # the protocol-2 impls
WORKLOADS = {"cartpole": (make_cartpole, None), "sleep2ms": (make_sleep, 0.002), "uneven": (make_uneven, 0.0029)}

_HOST = """
import sys, threading
sys.path.insert(0, {here!r})
from compare_remote import WORKLOADS
from torchrl_asyncpool.remote import EnvHost
make = WORKLOADS[sys.argv[1]][0]
hosts = [EnvHost(make(), sys.argv[2]) for _ in range(int(sys.argv[3]))]
threads = [threading.Thread(target=h.run) for h in hosts]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""

_VECTOR_HOST = """
import sys
sys.path.insert(0, {here!r})
import gymnasium as gym
from compare_remote import WORKLOADS
from torchrl_asyncpool.remote import VectorEnvHost
workload, address, k, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
make = WORKLOADS[workload][0]
if workload == "cartpole" and mode == "vector_entry_point":
    envs = gym.make_vec("CartPole-v1", num_envs=k, vectorization_mode="vector_entry_point")
elif mode == "threads":
    envs = [make for _ in range(k)]
else:
    envs = gym.vector.SyncVectorEnv([make] * k)
VectorEnvHost(envs, address).run()
"""


def _address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _cpu_s(pids):
    """User + system CPU seconds of processes ``pids`` (from /proc; 0 for ones that are gone)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def round_trip(pool, timeout=30.0) -> int:
    """One consumer round trip: ``recv`` whatever is ready, answer it with random actions;
    returns the records answered. (``recv(min_get=1, timeout=t)`` would wait up to ``t`` for
    every env, its ``max_get`` being all of them: ``wait_ready`` bounds the wait instead.)"""
    if pool.wait_ready(1, timeout) < 1:
        raise TimeoutError(f"no record within {timeout} s")
    td = pool.recv(min_get=1)
    b = td.shape[0]
    pool.send(TensorDict({"action": torch.randint(0, 2, (b,))}, [b]), td.env_indices)
    return b


def wait_all_started(pool, n):
    """Answers records until all ``n`` envs have published once (remote: every host connected)."""
    got = 0
    while got < n:
        got += round_trip(pool, timeout=120)


def _drive(pool, seconds, n, host_pids=()):
    """Answers everything ready for ``seconds`` after all ``n`` envs have published once;
    returns ``(records/s, {who: CPU microseconds per record})``."""
    wait_all_started(pool, n)
    who = {"driver": None, "workers": pool.worker_pids, "hosts": list(host_pids)}
    cpu0 = {k: time.process_time() if v is None else _cpu_s(v) for k, v in who.items()}
    records, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        records += round_trip(pool)
    elapsed = time.perf_counter() - t0
    cpu = {k: 1e6 * ((time.process_time() if v is None else _cpu_s(v)) - cpu0[k]) / records for k, v in who.items()}
    return records / elapsed, cpu


@contextlib.contextmanager
def local_pool(workload, n):
    make, _ = WORKLOADS[workload]
    with AsyncEnvPool([make] * n, envs_per_worker="auto") as pool:
        yield pool, []


@contextlib.contextmanager
def remote_pool(workload, n, host_procs):
    """A pool of ``n`` remote slots fed by ``host_procs`` env-host processes; yields
    ``(pool, host processes)``; the hosts exit after the pool closes."""
    make, _ = WORKLOADS[workload]
    address = _address()
    slot = functools.partial(RemoteEnvSlot.like, make(), address)
    here = os.path.dirname(os.path.abspath(__file__))
    procs = []
    try:
        with AsyncEnvPool([slot] * n) as pool:
            per = [n // host_procs + (i < n % host_procs) for i in range(host_procs)]
            for k in filter(None, per):
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", _HOST.format(here=here), workload, address, str(k)],
                    stderr=subprocess.DEVNULL,
                ))
            yield pool, procs
    finally:
        for p in procs:  # the pool closed: the hosts' streams end and they exit
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _threaded_host_envs(workload, k):
    """The envs of a threaded protocol-2 host (a module-level function: Ray sends it by reference)."""
    make, _ = WORKLOADS[workload]
    return [make for _ in range(k)]


def _p2_envs_factory(workload, host_envs, mode):
    """What a Ray actor's protocol-2 host serves, as ``remote2``'s host processes build it."""
    if workload == "cartpole" and mode == "vector_entry_point":
        return functools.partial(gym.make_vec, "CartPole-v1", num_envs=host_envs, vectorization_mode=mode)
    if mode == "threads":
        return functools.partial(_threaded_host_envs, workload, host_envs)
    return functools.partial(gym.vector.SyncVectorEnv, [WORKLOADS[workload][0]] * host_envs)


@contextlib.contextmanager
def _p2_consumer(slots, driver, frames_per_batch):
    """An AsyncEnvPool (``driver="pool"``) or an AsyncPoolCollector of the slot factories;
    ``idle_poll=False``: the worker of a vector slot waits on the network, not on a core of its
    own (idle-polling it measured 13-16 us of ingress CPU per record against 9, and fewer records/s)."""
    if driver == "pool":
        with AsyncEnvPool(slots, start_timeout=120, idle_poll=False) as pool:
            yield pool
        return
    from torchrl_asyncpool import AsyncPoolCollector

    collector = AsyncPoolCollector(slots, policy=_policy(), frames_per_batch=frames_per_batch, total_frames=-1,
                                   idle_poll=False)
    try:
        yield collector
    finally:
        collector.shutdown()


def _policy():
    from torchrl_asyncpool.inference.examples import MLPPolicy

    return MLPPolicy(obs_dim=4, num_actions=2, dtype=torch.float32)


@contextlib.contextmanager
def remote2_pool(workload, n, host_envs, mode, hosts_per_slot=1, driver="pool", frames_per_batch=256, per_env=False):
    """A pool (or collector) of ``n`` envs in RemoteVectorSlot factories of ``hosts_per_slot``
    hosts of ``host_envs`` envs (one address and ingress worker each), each host a protocol-2
    process; yields ``(pool or collector, host processes)``."""
    make, _ = WORKLOADS[workload]
    per_slot = host_envs * hosts_per_slot
    if n % per_slot:
        raise SystemExit(f"--envs {n} is not a multiple of --host-envs {host_envs} x --hosts-per-slot {hosts_per_slot}")
    addresses = [_address() for _ in range(n // per_slot)]
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", _VECTOR_HOST.format(here=here), workload, a, str(host_envs), mode],
                              stderr=subprocess.DEVNULL) for a in addresses for _ in range(hosts_per_slot)]
    try:
        # a vector slot's worker starts once its hosts connected (the hosts retry until the pool listens)
        if per_env:  # each address's envs as single slots, one thread each in the address's worker
            slots = [f for a in addresses
                     for f in RemoteVectorSlot.per_env(make(), a, num_envs=per_slot, host_envs=host_envs)]
        else:
            slots = [functools.partial(RemoteVectorSlot.like, make(), a, num_envs=per_slot, host_envs=host_envs)
                     for a in addresses]
        with _p2_consumer(slots, driver, frames_per_batch) as consumer:
            yield consumer, procs
    finally:
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _init_ray(num_cpus):
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)


@contextlib.contextmanager
def ray2_pool(workload, n, host_envs, mode, driver="pool", frames_per_batch=256, per_env=False):
    """As :func:`remote2_pool` with one host per address, each host a Ray actor
    (``RayEnvHosts(protocol=2)``, the pool's factories from ``pool_factories``); yields
    ``(pool or collector, hosts)``."""
    from torchrl_asyncpool.remote.ray import RayEnvHosts

    if n % host_envs:
        raise SystemExit(f"--envs {n} is not a multiple of --host-envs {host_envs}")
    make, _ = WORKLOADS[workload]
    _init_ray(max(2, n // host_envs))
    hosts = RayEnvHosts(_p2_envs_factory(workload, host_envs, mode), [_address() for _ in range(n // host_envs)],
                        num_cpus=1, max_restarts=-1, retry_s=0.2)
    slots = hosts.pool_factories(make(), host_envs=host_envs, listen="127.0.0.1", per_env=per_env)
    try:
        hosts.start()  # the actors' hosts connect once the pool listens
        with _p2_consumer(slots, driver, frames_per_batch) as consumer:
            yield consumer, hosts
    finally:
        hosts.stop()


def _drive_collector(collector, seconds, host_pids=()):
    """Frames/s of ``collector`` for ``seconds`` after its first batch, and the CPU per frame
    of the driver process (collector, policy thread), the pool workers and the hosts."""
    it = iter(collector)
    next(it)
    who = {"driver": None, "workers": collector.env.worker_pids, "hosts": list(host_pids)}
    cpu0 = {k: time.process_time() if v is None else _cpu_s(v) for k, v in who.items()}
    frames, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        frames += next(it).numel()
    elapsed = time.perf_counter() - t0
    cpu = {k: 1e6 * ((time.process_time() if v is None else _cpu_s(v)) - cpu0[k]) / frames for k, v in who.items()}
    return frames / elapsed, cpu


def time_to_come_back(pool, hosts, actor=0, host_envs=8, timeout=60.0):
    """Kills Ray actor ``actor`` (Ray restarts it) while answering every record; returns
    ``(seconds to the pool's first TRUNCATION of its envs, seconds to the first FIRST record of
    its envs after that)``, both from the kill. Its envs are the pool's
    ``actor * host_envs ..`` (one address per actor, in order)."""
    import ray

    lo, hi = actor * host_envs, (actor + 1) * host_envs
    ray.kill(hosts.actors[actor], no_restart=False)
    t0 = time.perf_counter()
    lost_at = None
    while time.perf_counter() - t0 < timeout:
        # what is ready now: a recv with a timeout would wait for every env, the killed host's too
        if pool.wait_ready(1, timeout) < 1:
            break
        td = pool.recv(min_get=1)
        idx, st = td.env_indices, td["step_type"].reshape(-1)
        mine = (idx >= lo) & (idx < hi)
        now = time.perf_counter() - t0
        if lost_at is None and (mine & (st == int(StepType.TRUNCATION))).any():
            lost_at = now
        back = lost_at is not None and (mine & (st == int(StepType.FIRST))).any()
        pool.send(TensorDict({"action": torch.randint(0, 2, (td.shape[0],))}, [td.shape[0]]), idx)
        if back:
            return lost_at, now
    return lost_at, None


def run_ray2(workload, n, seconds, host_envs, mode, driver="pool", frames_per_batch=256, kill=False, per_env=False):
    with ray2_pool(workload, n, host_envs, mode, driver, frames_per_batch, per_env) as (consumer, hosts):
        pids = [st["pid"] for st in hosts.status()]
        if driver == "pool":
            rate, cpu = _drive(consumer, seconds, n, pids)
        else:
            rate, cpu = _drive_collector(consumer, seconds, pids)
        back = time_to_come_back(consumer, hosts, 0, host_envs) if kill and driver == "pool" else None
        return rate, cpu, back


@contextlib.contextmanager
def ray_pool(workload, n, host_procs):
    """As :func:`remote_pool`, the hosts started as Ray actors (protocol 1)."""

    from torchrl_asyncpool.remote.ray import RayEnvHosts

    _init_ray(host_procs)
    make, _ = WORKLOADS[workload]
    address = _address()
    slot = functools.partial(RemoteEnvSlot.like, make(), address)
    hosts = RayEnvHosts(make, [address] * host_procs, protocol=1, envs_per_host=n // host_procs, num_cpus=1)
    try:
        with AsyncEnvPool([slot] * n) as pool:
            hosts.start()  # the actors' hosts connect once the pool listens
            yield pool, hosts
    finally:  # the pool closed first, as the process hosts see it
        hosts.stop()


def run_ray(workload, n, seconds, host_procs):
    with ray_pool(workload, n, host_procs) as (pool, hosts):
        pids = [st["pid"] for st in hosts.status()]
        return _drive(pool, seconds, n, pids)


def run_local(workload, n, seconds):
    with local_pool(workload, n) as (pool, _):
        return _drive(pool, seconds, n)


def run_remote2(workload, n, seconds, host_envs, mode, hosts_per_slot=1, driver="pool", frames_per_batch=256,
                per_env=False):
    with remote2_pool(workload, n, host_envs, mode, hosts_per_slot, driver, frames_per_batch, per_env) as (
            consumer, procs):
        if driver == "pool":
            return _drive(consumer, seconds, n, [p.pid for p in procs])
        return _drive_collector(consumer, seconds, [p.pid for p in procs])


def run_remote(workload, n, seconds, host_procs):
    with remote_pool(workload, n, host_procs) as (pool, procs):
        return _drive(pool, seconds, n, [p.pid for p in procs])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--envs", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--host-procs", type=int, default=2, help="env host processes (default: 2)")
    parser.add_argument("--impls", nargs="+", default=["local", "remote"],
                        choices=["local", "remote", "remote2", "remote2e", "ray", "ray2", "ray2e"],
                        help="run in this order within each repeat (default: local remote)")
    parser.add_argument("--host-envs", type=int, default=32, help="envs per protocol-2 host (default: 32)")
    parser.add_argument("--hosts-per-slot", type=int, default=1,
                        help="protocol-2 hosts per RemoteVectorSlot, i.e. per address and ingress worker (default: 1)")
    parser.add_argument("--p2-vector-mode", default="vector_entry_point",
                        choices=["vector_entry_point", "sync", "threads"],
                        help="how a protocol-2 host steps its envs (default: vector_entry_point, CartPole's own "
                             "vector env; sync: a SyncVectorEnv of single envs)")
    parser.add_argument("--driver", default="pool", choices=["pool", "collector"],
                        help="remote2/ray2: a bare consumer loop on the pool (default) or an AsyncPoolCollector with "
                             "the MLP policy (CartPole)")
    parser.add_argument("--frames-per-batch", type=int, default=256, help="--driver collector (default: 256)")
    parser.add_argument("--ray-kill", action="store_true",
                        help="ray2 with --driver pool: after each run, kill the first actor and time its comeback")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.driver == "collector" and any(impl not in P2 for impl in args.impls):
        parser.error("--driver collector applies to remote2, remote2e, ray2 and ray2e only")
    torch.set_num_threads(1)
    rows = []
    print(f"{'workload':10} {'envs':>4} {'impl':7} {'records/s':>10} {'% N/lat':>8} {'cycle ms':>9}   "
          "CPU us per record: driver / pool workers / hosts")
    for workload in args.workloads:
        latency = WORKLOADS[workload][1]
        for n in args.envs:
            for rep in range(args.repeats):
                for impl in args.impls:
                    back = None
                    if impl == "local":
                        rate, cpu = run_local(workload, n, args.seconds)
                    elif impl == "remote":
                        rate, cpu = run_remote(workload, n, args.seconds, args.host_procs)
                    elif impl == "ray":
                        rate, cpu = run_ray(workload, n, args.seconds, args.host_procs)
                    elif impl in ("ray2", "ray2e"):
                        rate, cpu, back = run_ray2(workload, n, args.seconds, args.host_envs, args.p2_vector_mode,
                                                   args.driver, args.frames_per_batch, args.ray_kill,
                                                   per_env=impl == "ray2e")
                    else:
                        rate, cpu = run_remote2(workload, n, args.seconds, args.host_envs, args.p2_vector_mode,
                                                args.hosts_per_slot, args.driver, args.frames_per_batch,
                                                per_env=impl == "remote2e")
                    pct = None if latency is None else 100 * rate / (n / latency)
                    row = {"workload": workload, "envs": n, "impl": impl, "repeat": rep, "records_per_s": rate,
                           "pct_n_over_latency": pct, "cycle_ms": 1e3 * n / rate,
                           "host_procs": args.host_procs if impl in ("remote", "ray") else None,
                           "host_envs": args.host_envs if impl in P2 else None,
                           "hosts_per_slot": args.hosts_per_slot if impl in ("remote2", "remote2e") else (
                               1 if impl in P2 else None),
                           "p2_vector_mode": args.p2_vector_mode if impl in P2 else None,
                           "per_env": impl.endswith("e") if impl in P2 else None,
                           "driver": args.driver if impl in P2 else "pool",
                           "cpu_us_per_record": cpu}
                    if back is not None:
                        row["kill_to_truncation_s"], row["kill_to_first_record_s"] = back
                    rows.append(row)
                    print(f"{workload:10} {n:>4} {impl:7} {rate:>10.0f} {'' if pct is None else f'{pct:.1f}':>8} "
                          f"{row['cycle_ms']:>9.3f}   {cpu['driver']:.0f} / {cpu['workers']:.0f} / {cpu['hosts']:.0f}"
                          + ("" if back is None else f"   killed actor: truncated at {back[0]} s, back at {back[1]} s"),
                          flush=True)
    if args.json:
        write_json(args.json, rows)


def write_json(path: str, rows: list) -> None:
    """Writes a run's ``rows`` with the date, core count, command line and load average."""
    with open(path, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(), "argv": sys.argv[1:],
                   "load_average": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    gym.logger.min_level = 40
    main()
