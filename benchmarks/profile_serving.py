"""The serving path's own cost per batch, against the policy's: where a thread inference server's
time goes between leasing records and answering them.

The collector's thread inference server, per batch: leases the ready records
(``SlotConsumer.lease_ready``: the engine's lease and a TensorDict over the staging rows), runs
the runner (``KeyRunner.launch``) which calls the collector's acting policy (``ActingPolicy``:
exploration type, pause gate, recurrent carry) around the user's TensorDictModule, checks the
actions (``ActionCheck``: dtype, finiteness, bounds, cast), then answers the records
(``ServingLoop._finish``: send order, the engine's answer, stats). This script measures, for
batch sizes 1, 16 and 64 on CartPole-v1 (gymnasium) with a 2x64 MLP policy:

* **synthetic** (one in-process batch, nothing else running between repeats): the MLP alone on
  the observation tensor (``mlp``), the user's TensorDictModule on the leased batch
  (``module``), the action check alone (``check``), the acting policy's ``forward``
  (``acting``: module + wrapper + check) and the runner's launch (``launch``: acting + output
  collection);
* **real** (the same objects a collector builds, on a live ``AsyncEnvPool`` of CartPoles whose
  workers step between batches, driven by hand from this thread while the server's own thread
  is held): ``lease``, ``stats`` (the loop's per-lease bookkeeping), ``launch`` and ``answer``,
  and their sum ``total``;
* ``overhead = total - module``: what the serving path adds to the policy call, also as a
  fraction of ``module`` and of ``mlp``;
* ``cpu.lnch`` and ``cpu.tot``: the real ``launch`` and ``total`` in this thread's CPU time
  (``time.thread_time``), which a preemption does not inflate: a real stage that costs more CPU
  than the same code in the warm synthetic loop pays for cold caches (the env workers ran on the
  same cores since the last batch), not for waiting its turn.

Every figure is the **minimum over many repeats** (``--repeats``), not a mean: on a loaded
machine a minimum is the repeatable number (what the code costs when it is not preempted), a
mean mostly measures the load. ``--profile SECONDS`` also runs a real ``AsyncPoolCollector``
for that long with the serving thread under ``cProfile`` and prints its top functions.
``--actor categorical`` swaps the argmax MLP for a TorchRL ``ProbabilisticActor`` with a
``Categorical`` distribution and ``return_log_prob=True`` (what TorchRL's PPO sota scripts use on
discrete actions), which writes ``logits``, ``action`` and ``action_log_prob``.

Examples::

    python benchmarks/profile_serving.py
    python benchmarks/profile_serving.py --actor categorical --repeats 3000
    python benchmarks/profile_serving.py --profile 5 --json /tmp/serving.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import gymnasium as gym
import torch
from tensordict.nn import TensorDictModule
from torch import nn

NUM_ENVS = 64
BATCH_SIZES = (1, 16, 64)


def make_cartpole():
    return gym.make("CartPole-v1")


class _ArgmaxMLP(nn.Module):
    """A 2x64 MLP from the 4-float observation to an int64 action (argmax of 2 scores)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, obs):
        return self.net(obs).argmax(-1)


def make_policy(actor: str):
    """``(TensorDictModule policy, mlp: obs -> action tensor)`` for ``actor`` ("mlp" or "categorical")."""
    torch.manual_seed(0)
    if actor == "mlp":
        net = _ArgmaxMLP()
        return TensorDictModule(net, in_keys=["observation"], out_keys=["action"]), net
    from torchrl.modules import ProbabilisticActor
    from torch.distributions import Categorical

    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    policy = ProbabilisticActor(module, in_keys=["logits"], out_keys=["action"], distribution_class=Categorical,
                                return_log_prob=True)

    def mlp(obs):  # the same work without TensorDicts: scores, a sample and its log-probability
        dist = Categorical(logits=net(obs))
        action = dist.sample()
        return action, dist.log_prob(action)

    return policy, mlp


def min_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if dt < best:
            best = dt
    return best * 1e6


def build_server(actor: str):
    """A CartPole pool and a held thread ``InferenceServer`` serving the collector's acting policy
    for it, assembled as ``AsyncPoolCollector`` assembles them (``PolicyLayout.probe``,
    ``action_checks``, ``ActingPolicy``, default server arguments); ``(pool, server, net)``."""
    from torchrl.envs.utils import ExplorationType

    from torchrl_asyncpool import AsyncEnvPool, InferenceServer
    from torchrl_asyncpool.collector.acting_policy import ActingPolicy
    from torchrl_asyncpool.collector.action_checks import action_checks
    from torchrl_asyncpool.collector.policy_layout import PolicyLayout

    policy, net = make_policy(actor)
    acting = ActingPolicy(policy, ExplorationType.RANDOM)
    layout = PolicyLayout.probe(acting, [make_cartpole], None, version_key=None, device=torch.device("cpu"))
    # idle_poll=False: workers that wait for their action sleep instead of spinning, so that this
    # (unpinned) thread is not timed against 64 spinning workers on a small machine; a collector
    # keeps its serving thread off the workers' CPUs instead (its "auto" partition)
    pool = AsyncEnvPool([make_cartpole] * NUM_ENVS, policy_output_spec=layout.outputs,
                        recurrent_state=layout.recurrent, seed=0, idle_poll=False,
                         envs_per_worker="auto")
    dtypes = {k: pool.layout_dtype(k) for k in pool.action_keys}
    acting.action_checks = action_checks(pool.full_action_spec, dtypes)
    acting.carry = layout.recurrent_keys
    # the collector's arguments on CPU: no bucket ladder (padding buys nothing there), one thread
    server = InferenceServer(acting, mode="thread", max_get=None, min_get=1, bucket_sizes=None, num_threads=1)
    server.start(pool, hold=True)  # held: its thread leases nothing; this thread drives its loop
    return pool, server, net


def measure(actor: str, repeats: int) -> list:
    """One row per batch size: the synthetic and real stage minima (see the module docstring)."""
    from torchrl_asyncpool.inference._loop import _Flight

    pool, server, net = build_server(actor)
    rows = []
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # as the serving loop does for its thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = server._backend
        loop, runner = backend.loop, backend.runners[0]
        consumer, acting = loop.consumer, runner.policy
        check = next(iter(acting.action_checks.values()))
        target = acting._target()
        for b in BATCH_SIZES:
            real = {"lease": [], "stats": [], "launch": [], "answer": [], "total": []}
            cpu = {"launch": [], "total": []}  # this thread's CPU time (preemption not counted)
            keep = None
            for _ in range(repeats):
                consumer.wait_ready(b, timeout=10.0)
                c0, t0 = time.thread_time(), time.perf_counter()
                td = consumer.lease_ready(b, loop._extras)
                t1 = time.perf_counter()
                idx = td.env_indices.numpy().copy()
                queue, lease_t = consumer.last_dwell, consumer.last_lease_time
                loop.stats.record_recv(0.0, queue)
                loop.stats.record_queue_times(lease_t - loop.ready_time[idx])
                c2, t2 = time.thread_time(), time.perf_counter()
                pending = runner.launch(torch.from_numpy(idx), td if loop._extras is not None else None)
                t3, c3 = time.perf_counter(), time.thread_time()
                loop._finish(_Flight(runner, pending, idx, td, queue, lease_t))
                t4, c4 = time.perf_counter(), time.thread_time()
                for name, dt in zip(real, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                    real[name].append(dt * 1e6)
                cpu["launch"].append((c3 - c2) * 1e6)
                cpu["total"].append((c4 - c0) * 1e6)
                if keep is None and td.batch_size[0] == b:
                    keep = td.clone()  # a leased batch of b records, for the synthetic timings
            obs = keep.get("observation")
            action = acting.forward(keep.copy()).get("action")
            idx_t = keep.env_indices if hasattr(keep, "env_indices") else torch.arange(b)
            synth = {
                "mlp": min_time(lambda: net(obs), repeats),
                "module": min_time(lambda: target(keep.copy()), repeats),
                "check": min_time(lambda: check(action), repeats),
                "acting": min_time(lambda: acting.forward(keep.copy()), repeats),
                "launch": min_time(lambda: runner.launch(idx_t, keep.copy()), repeats),
                "td_copy": min_time(lambda: keep.copy(), repeats),
            }
            real_min = {k: min(v) for k, v in real.items()}
            # the module's time measured as the synthetic run does, minus its td.copy()
            module = synth["module"] - synth["td_copy"]
            rows.append({
                "batch": b, "actor": actor, "synthetic_us": synth, "real_us": real_min,
                "real_cpu_us": {k: min(v) for k, v in cpu.items()},
                "overhead_us": real_min["total"] - module,
                "overhead_per_module": (real_min["total"] - module) / module,
                "overhead_per_mlp": (real_min["total"] - synth["mlp"]) / synth["mlp"],
            })
    finally:
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        server.stop()
        pool.close()
    return rows


def profile_collector(actor: str, seconds: float, top: int) -> str:
    """Runs an ``AsyncPoolCollector`` for ``seconds`` with its serving thread under cProfile; the
    top functions by own time, and the mean batch size."""
    from torchrl_asyncpool import AsyncPoolCollector
    from torchrl_asyncpool.inference import _loop

    profiles = []
    serve = _loop.ServingLoop.serve

    def profiled(self):  # cProfile follows one thread: start it in the serving thread itself
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.enable()
        try:
            return serve(self)
        finally:
            prof.disable()

    _loop.ServingLoop.serve = profiled
    try:
        policy, _ = make_policy(actor)
        collector = AsyncPoolCollector([make_cartpole] * NUM_ENVS, policy=policy, frames_per_batch=1024,
                                       total_frames=-1)
        try:
            t_end = None
            for _ in collector:
                if t_end is None:
                    t_end = time.monotonic() + seconds
                elif time.monotonic() > t_end:
                    break
            served = collector.server_stats()
        finally:
            collector.shutdown()
    finally:
        _loop.ServingLoop.serve = serve
    out = io.StringIO()
    out.write(f"mean batch size {served['mean_batch_size']:.1f}, {served['batches']} batches\n")
    stats = pstats.Stats(profiles[0], stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("torchrl_asyncpool", top)  # this package's stages
    return out.getvalue()


def print_table(rows) -> None:
    print("minimum over the repeats, microseconds per batch")
    head = ("batch", "mlp", "module", "check", "acting", "s.launch", "lease", "stats", "launch", "answer", "total",
            "cpu.lnch", "cpu.tot", "overhead", "/module", "/mlp")
    print(" ".join(f"{h:>8}" for h in head))
    for r in rows:
        s, q = r["synthetic_us"], r["real_us"]
        vals = (r["batch"], s["mlp"], s["module"] - s["td_copy"], s["check"], s["acting"] - s["td_copy"],
                s["launch"] - s["td_copy"], q["lease"], q["stats"], q["launch"], q["answer"], q["total"],
                r["real_cpu_us"]["launch"], r["real_cpu_us"]["total"], r["overhead_us"])
        print(" ".join(f"{v:8.1f}" if isinstance(v, float) else f"{v:8d}" for v in vals),
              f"{r['overhead_per_module']:8.2f} {r['overhead_per_mlp']:8.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actor", choices=("mlp", "categorical"), default="mlp")
    parser.add_argument("--repeats", type=int, default=2000, help="repeats per figure (the minimum is reported)")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="also profile a real collector run this long (0: skip)")
    parser.add_argument("--top", type=int, default=25, help="functions the profile lists")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = measure(args.actor, args.repeats)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.profile > 0:
        print(profile_collector(args.actor, args.profile, args.top))


if __name__ == "__main__":
    main()
