"""Inference throughput and latency: torchrl_asyncpool.InferenceServer vs TorchRL 0.14.1's InferenceServer.

Same work on both sides, in the same run:

* ``N`` env processes, one env each (:class:`~torchrl_asyncpool.testing.ZeroLatencyEnv`,
  stepped through ``EnvBase._step``), each with exactly one request in flight: publish the
  observation, wait for the action, step, repeat;
* the same policy (a float32 MLP 4 -> 64 -> 64 -> 2, argmax action, one intra-op thread in
  the server) and the same batch cap (``max_get`` here, ``max_batch_size`` there) and
  flush timeout.

Ours: :class:`~torchrl_asyncpool.AsyncEnvPool` (``envs_per_worker=1``) served by
:class:`~torchrl_asyncpool.InferenceServer` in thread mode (server in the driver process) and
in process mode (its own process), with and without bucket padding.
TorchRL: ``ProcessSlotTransport`` (fixed shared-memory slots, its fastest process transport)
with ``N`` client processes running the same env loop, served by TorchRL's
``InferenceServer`` in a thread of the driver (``service_backend="thread"``) and, when it
accepts that transport, in its own process (``service_backend="process"``).

Reported per configuration: throughput (answered requests per second over the measurement
window) and mean round-trip latency by Little's law (``N / throughput``: each env has one
request outstanding, so this is the mean time from publishing an observation to having
stepped with its action), plus each server's own mean batch size where it reports one.

CUDA path (pinned staging, async H2D, CUDA graphs): measured only with ``--device cuda`` on
a machine with a GPU; otherwise reported as "not measured: no GPU on this machine".

Usage::

    python benchmarks/compare_inference.py --envs 8 16 --duration 3
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import torch
from tensordict import TensorDict
from torch import nn

OBS_DIM, NUM_ACTIONS, HIDDEN = 4, 2, 64


class BenchPolicy(nn.Module):
    """The shared policy: a seeded float32 MLP on ``"observation"``, argmax ``"action"``."""

    in_keys = ["observation"]

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(OBS_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, NUM_ACTIONS))

    def forward(self, td):
        td.set("action", self.net(td.get("observation")).argmax(-1))
        return td


# -- ours -----------------------------------------------------------------------------------------
def run_ours(n, max_get, timeout, duration, warmup, mode, buckets, device="cpu", cuda_graphs=False):
    from torchrl_asyncpool import AsyncEnvPool, InferenceServer
    from torchrl_asyncpool.testing import ZeroLatencyEnv

    with AsyncEnvPool([ZeroLatencyEnv] * n, envs_per_worker=1) as pool:
        kwargs = dict(max_get=max_get, timeout=timeout, bucket_sizes=buckets, device=device, mode=mode)
        if cuda_graphs:
            kwargs["cuda_graphs"] = True
        if mode == "thread":
            server = InferenceServer(BenchPolicy(), **kwargs)
        else:
            server = InferenceServer(policy_factory=BenchPolicy, num_threads=1, **kwargs)
        with server.start(pool):
            time.sleep(warmup)
            server.stats(reset=True)
            time.sleep(duration)
            s = server.stats()
    fps = s["frames"] / s["elapsed_s"]
    return {"throughput": fps, "latency_ms": 1e3 * n / max(fps, 1e-9), "mean_batch": s["mean_batch_size"],
            "padding": s["padding_fraction"], "inference_ms": 1e3 * s["inference_time_s"]}


# -- TorchRL --------------------------------------------------------------------------------------
def _torchrl_client(client, stop, counts, slot, ready):
    from torchrl_asyncpool.testing import ZeroLatencyEnv

    torch.set_num_threads(1)
    env = ZeroLatencyEnv()
    obs = env._reset()["observation"]
    action_td = TensorDict({"action": torch.zeros((), dtype=torch.int64)}, [])
    ready.release()
    count = 0
    while not stop.is_set():
        out = client(TensorDict({"observation": obs}, []))
        action_td.set("action", out["action"])
        step = env._step(action_td)
        obs = step["observation"]
        if step["truncated"].any():
            obs = env._reset()["observation"]
        count += 1
        counts[slot] = count  # one writer per entry: no lock


def run_torchrl(n, max_get, timeout, duration, warmup, backend, device="cpu"):
    from torchrl.modules.inference_server import InferenceServer, ProcessSlotTransport

    ctx = mp.get_context("forkserver")
    request = TensorDict({"observation": torch.zeros(OBS_DIM)}, [])
    response = TensorDict({"action": torch.zeros((), dtype=torch.int64),
                           "policy_version": torch.zeros((), dtype=torch.int64)}, [])
    transport = ProcessSlotTransport(request, response, num_slots=n, ctx=ctx)
    clients = [transport.client() for _ in range(n)]
    common = dict(max_batch_size=max_get, timeout=timeout, min_batch_size=1)
    if backend == "thread":
        server = InferenceServer(BenchPolicy(), transport, **common)
    else:
        server = InferenceServer(policy_factory=BenchPolicy, transport=transport, service_backend="process",
                                 service_backend_options={"mp_context": ctx}, **common)
    stop, counts, ready = ctx.Event(), ctx.Array("q", n, lock=False), ctx.Semaphore(0)
    procs = []
    server.start()
    try:
        for i, c in enumerate(clients):
            p = ctx.Process(target=_torchrl_client, args=(c, stop, counts, i, ready), daemon=True)
            p.start()
            procs.append(p)
        for _ in procs:
            ready.acquire(timeout=120)
        time.sleep(warmup)
        c0, t0 = sum(counts), time.monotonic()
        stats0 = _torchrl_stats(server)
        time.sleep(duration)
        c1, t1 = sum(counts), time.monotonic()
        stats1 = _torchrl_stats(server)
    finally:
        stop.set()
        for p in procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
        server.shutdown()
    fps = (c1 - c0) / (t1 - t0)
    batches = stats1.get("batches", 0) - stats0.get("batches", 0)
    reqs = stats1.get("requests", 0) - stats0.get("requests", 0)
    return {"throughput": fps, "latency_ms": 1e3 * n / max(fps, 1e-9),
            "mean_batch": reqs / batches if batches else float("nan"), "padding": 0.0,
            "inference_ms": stats1.get("p50_forward_ms", float("nan"))}


def _torchrl_stats(server):
    try:
        return server.stats()
    except Exception:  # noqa: BLE001 - a backend without stats
        return {}


# -- main -----------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--batch", type=str, default="full", help="'full' (= num envs), 'half', or an int")
    parser.add_argument("--timeout", type=float, default=0.002)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--skip", nargs="*", default=[], help="configuration names to skip")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.platform()}")
    import torchrl

    print(f"# torchrl {torchrl.__version__}; flush timeout {args.timeout}s; window {args.duration}s")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("# CUDA path: not measured: no GPU on this machine")
        args.device = "cpu"
    elif not args.device.startswith("cuda"):
        print("# CUDA path (pinned staging, async H2D, CUDA graphs): not measured: no GPU on this machine"
              if not torch.cuda.is_available() else "# CUDA path: pass --device cuda to measure it")

    configs = [
        ("ours/thread/buckets", functools.partial(run_ours, mode="thread", buckets="auto")),
        ("ours/thread/no-pad", functools.partial(run_ours, mode="thread", buckets=None)),
        ("ours/process/buckets", functools.partial(run_ours, mode="process", buckets="auto")),
        *([("ours/thread/cuda-graphs", functools.partial(run_ours, mode="thread", buckets="auto", cuda_graphs=True)),
           ("ours/process/cuda-graphs", functools.partial(run_ours, mode="process", buckets="auto", cuda_graphs=True))]
          if args.device.startswith("cuda") else []),
        ("torchrl/thread", functools.partial(run_torchrl, backend="thread")),
        ("torchrl/process", functools.partial(run_torchrl, backend="process")),
    ]
    results = []
    header = (
        f"{'config':<22} {'envs':>4} {'batch':>5} {'req/s':>10} {'latency ms':>11} "
        f"{'mean batch':>10} {'pad':>5} {'fwd ms':>7}"
    )
    print(header)
    for n in args.envs:
        batch = n if args.batch == "full" else (max(1, n // 2) if args.batch == "half" else int(args.batch))
        for name, fn in configs:
            if name in args.skip:
                continue
            try:
                r = fn(n, batch, args.timeout, args.duration, args.warmup, device=args.device)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{name:<22} {n:>4} {batch:>5}  failed: {type(exc).__name__}: {str(exc)[:120]}")
                results.append({"config": name, "envs": n, "batch": batch, "error": repr(exc)})
                continue
            results.append({"config": name, "envs": n, "batch": batch, **r})
            print(f"{name:<22} {n:>4} {batch:>5} {r['throughput']:>10.0f} {r['latency_ms']:>11.3f} "
                  f"{r['mean_batch']:>10.2f} {r['padding']:>5.2f} {r['inference_ms']:>7.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
