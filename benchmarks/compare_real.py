"""Side-by-side benchmark on the real workloads: frames/s delivered to the training loop.

Workloads (``--workloads``), 16 and 64 envs each (``--envs``), 1,024 frames per batch:

* ``atari``   ``ALE/Pong-v5`` (``frameskip=1, repeat_action_probability=0``) wrapped in
              ``AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)``
              and ``FrameStackObservation(4)``: 4x84x84 uint8 observations, 6 actions. The
              vector-env peers (ale-py's ``AtariVectorEnv``, EnvPool's ``Pong-v5``) are set to the
              same preprocessing (no reward clipping, no fire on reset, no life-loss episodes).
* ``mujoco``  ``HalfCheetah-v5`` (17 float64 observations, 6 continuous actions); EnvPool's
              counterpart is its ``HalfCheetah-v4`` (same model and dynamics, EnvPool has no v5).

Policies (``--policies``): ``mean``, a cheap policy that reads the whole observation (its mean
picks the action), on both workloads; ``cnn``, the Nature DQN CNN (3 conv layers + 512 unit
layer, ~10 M multiply-adds per frame), on Atari only. One intra-op torch thread everywhere.

Systems (``--systems``; each one cell per workload, policy and env count):

* ``ours_gym``        ``AsyncPoolCollector`` of gymnasium factories, default settings
* ``ours_torchrl``    the same with TorchRL factories: ``GymWrapper`` of the same gymnasium stack
                      (Atari), ``TransformedEnv(GymEnv("HalfCheetah-v5"), DoubleToFloat, StepCounter,
                      RewardSum)`` (MuJoCo)
* ``ours_torchrl_idiom`` (Atari) TorchRL's own Atari idiom, as its IMPALA recipe builds each env:
                      ``GymEnv("ALE/Pong-v5", frame_skip=4, from_pixels=True, pixels_only=False)``
                      (``frameskip=1``, no sticky actions) with ``NoopResetEnv(30)``,
                      ``ToTensorImage``, ``GrayScale``, ``Resize(84, 84)`` and ``CatFrames(4)``:
                      4x84x84 float32 ``"pixels"`` in [0, 1], the frame skip in Python without
                      max-pooling. ``Resize`` is a subclass that makes the call torchvision's tensor
                      resize makes (``interpolate(..., "bilinear", align_corners=False,
                      antialias=True)``): the torchvision wheels on PyPI link CUDA libraries that
                      the CPU torch wheel lacks, so ``import torchvision`` fails there
* ``ours_ale_vec``    the collector hosting ``gym.make_vec("ALE/Pong-v5", num_envs=k,
                      vectorization_mode="vector_entry_point")`` factories (ale-py's
                      ``AtariVectorEnv``), one factory per core (``--vec-factories``), Atari only
* ``ours_envpool``    the collector hosting ``envpool.make_gymnasium(...)`` factories (EnvPool's
                      ``Pong-v5`` on Atari, its ``HalfCheetah-v4`` vector env on MuJoCo, synchronous
                      mode, one thread each), one factory per core (``--vec-factories``)
* ``ours_envpool_async`` the same factories in EnvPool's asynchronous mode (``batch_size=k/2``,
                      ``cores / factories`` threads each): each env is stepped as soon as the policy
                      has answered it (``EnvPoolAsyncAdapter``)
* ``ours_gym_unpinned`` (diagnostic, only when named) ``ours_gym`` with ``worker_affinity=None,
                      driver_affinity=None``: nothing pinned, against the default CPU partition
* ``ours_gym_shared`` (diagnostic, only when named) ``ours_gym`` with two workers a core
                      (``envs_per_worker = N // (2 * cores)``), where the CPU plan may move a share
                      of the workers onto the policy's core (the ``"shared"`` layout)
* ``gym_async``       a hand-written ``gymnasium.vector.AsyncVectorEnv(shared_memory=True, fork)``
                      loop, the policy called on each batch, nothing stored
* ``gym_sync``        the same loop over a ``SyncVectorEnv`` (one process)
* ``envpool_async``   EnvPool's asynchronous mode: ``num_envs=N, batch_size=N/2``, one thread per
                      core, ``recv``/policy/``send``
* ``ale_async``       ale-py's ``AtariVectorEnv`` in its asynchronous mode (``batch_size=N/2``,
                      ``recv``/``send``, one thread per core), Atari only
* ``torchrl_sync``    TorchRL 0.14.1 ``Collector(ParallelEnv(N, torchrl factory), policy)``   } only with
* ``torchrl_async``   TorchRL 0.14.1 ``AsyncBatchedCollector`` (process env workers,         } ``--torchrl``:
                      ``transport="auto"``, ``policy_factory``): its documented fast setup   } minutes of start-up

Env-only ceilings (not collectors: the same envs split over one bare process per core, random
actions drawn in advance, no policy, nothing stored):

* ``env_only``          the gymnasium envs (``ours_gym``/``gym_*``'s stack)
* ``env_only_torchrl_idiom`` TorchRL's Atari idiom (``ours_torchrl_idiom``'s envs), each stepped
                        with ``step_and_maybe_reset`` as TorchRL's collectors step them, Atari only
* ``env_only_ale``      one ``AtariVectorEnv`` of N/cores envs per process (synchronous), Atari only
* ``env_only_envpool``  one EnvPool of N/cores envs (one thread) per process

Each cell: constructor, first batch, ``--warmup`` seconds not counted, then ``--seconds`` (or
``--frames``) measured. Repeats are interleaved: every system of a cell runs once per repeat,
the order rotated by one each repeat, and the table shows medians; the ratios are medians of
per-repeat ratios (neighbours in time), which drift less than either number. The collector
cells also record what the collector chose (``pool_metrics()``: workers, envs per worker,
threads, idle polling, step paths; ``server_stats()``: mean policy batch; ``plan()``) and the CPU affinity
of its worker processes and of this process's threads. Run with nothing else busy::

    python benchmarks/compare_real.py --json /tmp/real.json      # fast systems, 2 repeats
    python benchmarks/compare_real.py --torchrl                  # plus TorchRL's collectors (long); prints only
    python benchmarks/compare_real.py --quick --workloads atari --systems ours_gym gym_sync env_only
    python benchmarks/compare_real.py --help
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_collectors import _ShieldedCell  # noqa: E402
from machine import cpu_model  # noqa: E402

HERE = Path(__file__).resolve().parent
COLLECTOR_SYSTEMS = ("ours_gym", "ours_torchrl", "ours_torchrl_idiom", "ours_ale_vec", "ours_envpool",
                     "ours_envpool_async", "gym_async", "gym_sync", "envpool_async", "ale_async")
CEILING_SYSTEMS = ("env_only", "env_only_torchrl_idiom", "env_only_ale", "env_only_envpool")
FAST_SYSTEMS = COLLECTOR_SYSTEMS + CEILING_SYSTEMS
TORCHRL_SYSTEMS = ("torchrl_sync", "torchrl_async")
DIAGNOSTIC_SYSTEMS = ("ours_gym_unpinned", "ours_gym_shared")
SYSTEMS = COLLECTOR_SYSTEMS + TORCHRL_SYSTEMS + CEILING_SYSTEMS + DIAGNOSTIC_SYSTEMS
CEILINGS = set(CEILING_SYSTEMS)
# the ceiling each system is set against: its own env stack's
STACK_CEILING = {"ours_torchrl_idiom": "env_only_torchrl_idiom", "ours_ale_vec": "env_only_ale",
                 "ale_async": "env_only_ale", "ours_envpool": "env_only_envpool",
                 "ours_envpool_async": "env_only_envpool", "envpool_async": "env_only_envpool"}
ATARI_ONLY = {"ours_torchrl_idiom", "ours_ale_vec", "ale_async", "env_only_torchrl_idiom", "env_only_ale"}
TITLES = {"atari": "Atari", "mujoco": "MuJoCo"}
ATARI_ACTIONS, MUJOCO_OBS, MUJOCO_ACT = 6, 17, 6


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# -- env factories ---------------------------------------------------------------------------
def make_atari():
    """The gymnasium Atari stack (the issue's): Pong, no sticky actions, DQN preprocessing, 4 frames."""
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)
    return gym.wrappers.FrameStackObservation(env, 4)


def make_mujoco():
    return gym.make("HalfCheetah-v5")


def make_torchrl_atari():
    from torchrl.envs import GymWrapper

    return GymWrapper(make_atari())


def make_torchrl_idiom_atari():
    """TorchRL's own Atari idiom (its IMPALA recipe's ``make_env``, without the training-only
    transforms: life-loss episodes, reward sign, reward sum, step counter, VecNorm) on the same
    Pong: the frame skip in ``GymEnv``, the preprocessing in TorchRL transforms."""
    from torchrl.envs import CatFrames, Compose, GrayScale, GymEnv, NoopResetEnv, ToTensorImage, TransformedEnv

    import ale_py

    gym.register_envs(ale_py)
    env = GymEnv("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0, frame_skip=4, from_pixels=True,
                 pixels_only=False)
    return TransformedEnv(env, Compose(NoopResetEnv(noops=30, random=True), ToTensorImage(), GrayScale(),
                                       _interpolate_resize(84, 84), CatFrames(N=4, dim=-3)))


def _interpolate_resize(w, h):
    """TorchRL's ``Resize(w, h)`` whose resize is the call torchvision's tensor ``resize`` makes
    (bilinear, ``align_corners=False``, ``antialias=True``): ``Resize`` refuses to exist without
    torchvision, and PyPI's torchvision wheels do not import beside the CPU torch wheel."""
    from torchrl.envs import Transform
    from torchrl.envs.transforms import Resize

    class InterpolateResize(Resize):
        def __init__(self, w, h):
            Transform.__init__(self, in_keys=["pixels"], out_keys=["pixels"])  # Resize's own refuses
            self.w, self.h, self.interpolation = int(w), int(h), "bilinear"

        def _apply_transform(self, obs):
            if obs.shape[-2:] == torch.Size([self.w, self.h]):
                return obs
            lead = obs.shape[:-3]
            flat = obs.reshape(-1, *obs.shape[-3:])
            out = torch.nn.functional.interpolate(flat, size=[self.w, self.h], mode="bilinear", align_corners=False,
                                                  antialias=True)
            return out.reshape(*lead, *out.shape[-3:])

    return InterpolateResize(w, h)


def make_torchrl_mujoco():
    from torchrl.envs import Compose, DoubleToFloat, GymEnv, RewardSum, StepCounter, TransformedEnv

    return TransformedEnv(GymEnv("HalfCheetah-v5"), Compose(DoubleToFloat(), StepCounter(), RewardSum()))


# ale-py's AtariVectorEnv set to the gymnasium stack's preprocessing (its defaults clip rewards and
# press FIRE on reset; frame skip 4 with max-pooling, 30 no-ops, 84x84 grey, 4 frames are its defaults)
ALE_VEC_KWARGS = dict(repeat_action_probability=0.0, frameskip=4, noop_max=30, img_height=84, img_width=84,
                      grayscale=True, stack_num=4, reward_clipping=False, use_fire_reset=False, episodic_life=False)
ENVPOOL_ATARI_KWARGS = dict(stack_num=4, frame_skip=4, noop_max=30, img_height=84, img_width=84, gray_scale=True,
                            reward_clip=False, use_fire_reset=False, episodic_life=False,
                            repeat_action_probability=0.0)


def make_ale_vec(k, num_threads=1, batch_size=0):
    """``gym.make_vec`` of ale-py's vector entry point (its C++ ``AtariVectorEnv``) with ``k`` envs."""
    import ale_py

    gym.register_envs(ale_py)
    return gym.make_vec("ALE/Pong-v5", num_envs=k, vectorization_mode="vector_entry_point",
                        num_threads=num_threads, batch_size=batch_size, **ALE_VEC_KWARGS)


def make_envpool(workload, k, num_threads=1, batch_size=None, seed=0):
    import envpool

    if workload == "atari":
        return envpool.make_gymnasium("Pong-v5", num_envs=k, batch_size=batch_size or k, num_threads=num_threads,
                                      seed=seed, **ENVPOOL_ATARI_KWARGS)
    return envpool.make_gymnasium("HalfCheetah-v4", num_envs=k, batch_size=batch_size or k, num_threads=num_threads,
                                  seed=seed)


GYM_FACTORY = {"atari": make_atari, "mujoco": make_mujoco}
TORCHRL_FACTORY = {"atari": make_torchrl_atari, "mujoco": make_torchrl_mujoco}
POLICIES = {"atari": ("mean", "cnn"), "mujoco": ("mean",)}


# -- policies --------------------------------------------------------------------------------
class MeanAtari(nn.Module):
    """The cheap Atari policy: the mean of every pixel of the 4 frames picks one of 6 actions."""

    def forward(self, obs):
        return (obs.flatten(1).float().mean(1) * 1000).long() % ATARI_ACTIONS


class NatureCNN(nn.Module):
    """The Nature DQN network (Mnih et al. 2015) on 4x84x84 uint8 frames, greedy action."""

    def __init__(self, n=ATARI_ACTIONS):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(), nn.Conv2d(64, 64, 3, 1), nn.ReLU(),
            nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, n))

    def forward(self, obs):
        return self.net(obs.float() / 255.0).argmax(-1)


class MeanMuJoCo(nn.Module):
    """The cheap MuJoCo policy: tanh of the observation's mean, for all 6 joints."""

    def forward(self, obs):
        return torch.tanh(obs.mean(-1, keepdim=True)).expand(obs.shape[0], MUJOCO_ACT)


def make_net(workload, policy):
    torch.manual_seed(0)
    if workload == "mujoco":
        return MeanMuJoCo()
    return NatureCNN() if policy == "cnn" else MeanAtari()


class _TDAct(nn.Module):
    """The net on ``td["observation"]`` -> ``td["action"]`` (one-hot for TorchRL's Atari specs,
    cast to the action spec's dtype for MuJoCo)."""

    def __init__(self, net, one_hot=0, dtype=None):
        super().__init__()
        self.net, self.one_hot, self.dtype = net, one_hot, dtype

    def forward(self, obs):
        a = self.net(obs)
        if self.one_hot:
            a = torch.nn.functional.one_hot(a, self.one_hot)
        return a.to(self.dtype) if self.dtype is not None else a


def make_td_policy(workload, policy, torchrl_specs=False, obs_key="observation"):
    """A ``TensorDictModule`` (observation -> action): what the collectors take. Its actions have
    the dtype of the action spec the collector reads from the envs: one-hot for TorchRL's Atari
    specs, float32 after ``DoubleToFloat``, int64 for a gymnasium ``Discrete`` space (EnvPool's
    too: the pool casts nothing, EnvPool casts to its int32 when stepped; the collector checks
    the dtype: ``cast_actions=False`` by default). ``obs_key``: ``"pixels"`` for TorchRL's Atari
    idiom, whose frames are float32 in [0, 1] (the CNN's ``/ 255`` then scales them once more: the
    same cost, another greedy action)."""
    from tensordict.nn import TensorDictModule

    one_hot = ATARI_ACTIONS if (torchrl_specs and workload == "atari") else 0
    if workload == "mujoco":
        dtype = torch.float32 if torchrl_specs else torch.float64
    else:
        dtype = None
    return TensorDictModule(_TDAct(make_net(workload, policy), one_hot, dtype), in_keys=[obs_key],
                            out_keys=["action"])


def np_actions(net, obs, dtype):
    """The net on a numpy batch (the loops' policy call): numpy actions of ``dtype``."""
    with torch.no_grad():
        return net(torch.as_tensor(obs)).numpy().astype(dtype, copy=False)


# -- measuring -------------------------------------------------------------------------------
class _Skip(Exception):
    """This system has no counterpart for this cell (not an error)."""


def _measure(step, warmup_s, seconds, frames, on_start=None):
    """Runs ``step()`` (returns the frames it made) for ``warmup_s`` unmeasured, then for ``frames``
    frames if given, else ``seconds``; returns (frames/s, frames, seconds) of the measured part.
    ``on_start()`` is called when the measured part starts."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        step()
    if on_start is not None:
        on_start()
    n, t0 = 0, time.perf_counter()
    if frames:
        while n < frames:
            n += step()
    else:
        while time.perf_counter() - t0 < seconds:
            n += step()
    dt = time.perf_counter() - t0
    return n / dt, n, dt


def _thread_affinities() -> list:
    """The distinct CPU sets this process's threads may run on (the collector's driver pinning)."""
    out = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            out.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except OSError:
            pass
    return sorted(list(s) for s in out)


def _collector_info(c) -> dict:
    """What the collector chose, read through its public surface."""
    info = {}
    try:
        pm = c.pool_metrics()
        info["pool"] = {k: v for k, v in pm.items() if isinstance(v, (int, float))}
    except Exception as e:  # noqa: BLE001 - informative only
        info["pool"] = f"{type(e).__name__}: {e}"
    try:
        st = c.server_stats()
        info["server"] = {k: st[k] for k in ("mean_batch_size", "batches_per_s", "inference_time_s", "padding_fraction",
                                             "queueing_time_s") if k in st}
    except Exception as e:  # noqa: BLE001
        info["server"] = f"{type(e).__name__}: {e}"
    try:
        info["plan"] = c.plan()  # the partition and the flush deadline, with their trials
    except Exception as e:  # noqa: BLE001
        info["plan"] = f"{type(e).__name__}: {e}"
    try:
        pids = list(c.env.worker_pids)
        info["worker_affinity"] = [sorted(os.sched_getaffinity(p)) for p in pids]
    except Exception as e:  # noqa: BLE001
        info["worker_affinity"] = f"{type(e).__name__}: {e}"
    info["driver_thread_affinity"] = _thread_affinities()
    return info


def _run_collector(build, warmup_s, seconds, frames, ours):
    """(frames/s, info) of a collector: constructor and first batch timed apart, the warm-up not measured."""
    with _ShieldedCell() as cell:
        c = None
        t0 = time.perf_counter()
        try:
            c = build()
            it = iter(c)
            next(it)
            first = time.perf_counter() - t0
            reset = (lambda: (c.pool_metrics(reset=True), c.server_stats(reset=True))) if ours else None
            fps, n, dt = _measure(lambda: next(it).numel(), warmup_s, seconds, frames, on_start=reset)
            info = dict(first_batch_s=first, frames=n, measured_s=dt)
            if ours:  # the metrics' windows: the measured part
                info.update(_collector_info(c))
        except BaseException:
            cell.stop_processes()
            if c is not None:
                try:
                    c.shutdown(timeout=0.5, raise_on_error=False)
                except Exception:  # noqa: BLE001
                    pass
            raise
        t1 = time.perf_counter()
        c.shutdown()
        info["shutdown_s"] = time.perf_counter() - t1
    return fps, info


def _run_loop(build, step_of, warmup_s, seconds, frames, close=lambda x: x.close()):
    """(frames/s, info) of an in-process loop over ``build()``'s object, stepped by ``step_of(obj)()``."""
    with _ShieldedCell() as cell:
        obj = None
        t0 = time.perf_counter()
        try:
            obj = build()
            step = step_of(obj)
            step()
            first = time.perf_counter() - t0
            fps, n, dt = _measure(step, warmup_s, seconds, frames)
        except BaseException:
            try:
                if obj is not None:
                    close(obj)
            finally:
                cell.stop_processes()
            raise
        t1 = time.perf_counter()
        close(obj)
        return fps, dict(first_batch_s=first, frames=n, measured_s=dt, shutdown_s=time.perf_counter() - t1)


# -- systems ---------------------------------------------------------------------------------
def _split(n, parts):
    """``n`` envs over ``parts`` factories (as even as possible)."""
    parts = max(1, min(parts, n))
    return [len(range(i, n, parts)) for i in range(parts)]


def build_ours(w, p, n, fpb, system, vec_factories=None):
    from torchrl_asyncpool import AsyncPoolCollector

    kwargs = {}
    if system in ("ours_gym", "ours_gym_unpinned", "ours_gym_shared"):
        fns = [GYM_FACTORY[w]] * n
        if system == "ours_gym_unpinned":
            kwargs = dict(worker_affinity=None, driver_affinity=None)
        elif system == "ours_gym_shared":
            kwargs = dict(envs_per_worker=max(1, n // (2 * _cores())))
    elif system == "ours_torchrl":
        fns = [TORCHRL_FACTORY[w]] * n
    elif system == "ours_torchrl_idiom":
        if w != "atari":
            raise _Skip("MuJoCo's TorchRL factory already is TorchRL's idiom (ours_torchrl)")
        fns = [make_torchrl_idiom_atari] * n
    elif system == "ours_ale_vec":
        if w != "atari":
            raise _Skip("ale-py has no MuJoCo")
        fns = [functools.partial(make_ale_vec, k) for k in _split(n, vec_factories or _cores())]
    elif system == "ours_envpool":
        _need_envpool()
        fns = [functools.partial(make_envpool, w, k) for k in _split(n, vec_factories or _cores())]
    elif system == "ours_envpool_async":
        _need_envpool()
        sizes = _split(n, vec_factories or _cores())
        threads = max(1, _cores() // len(sizes))
        fns = [functools.partial(make_envpool, w, k, num_threads=threads, batch_size=max(1, k // 2)) for k in sizes]
    else:
        raise ValueError(system)
    policy = make_td_policy(w, p, torchrl_specs=system in ("ours_torchrl", "ours_torchrl_idiom"),
                            obs_key="pixels" if system == "ours_torchrl_idiom" else "observation")
    return AsyncPoolCollector(fns, policy=policy, frames_per_batch=fpb, total_frames=-1, **kwargs)


def _need_envpool():
    try:
        import envpool  # noqa: F401
    except ImportError:
        raise _Skip("envpool is not installed") from None


def _gym_loop_step(w, p):
    net = make_net(w, p)
    dtype = np.int64 if w == "atari" else np.float64

    def step_of(venv):
        state = {"obs": venv.reset(seed=0)[0]}

        def step():
            state["obs"] = venv.step(np_actions(net, state["obs"], dtype))[0]
            return venv.num_envs

        return step

    return step_of


def run_gym_async(w, p, n, fpb, a):
    import multiprocessing as mp

    ctx = "fork" if "fork" in mp.get_all_start_methods() else None  # torchrl sets "spawn" globally
    return _run_loop(lambda: gym.vector.AsyncVectorEnv([GYM_FACTORY[w]] * n, shared_memory=True, context=ctx),
                     _gym_loop_step(w, p), a.warmup, a.seconds, a.frames, close=lambda v: v.close(terminate=True))


def run_gym_sync(w, p, n, fpb, a):
    return _run_loop(lambda: gym.vector.SyncVectorEnv([GYM_FACTORY[w]] * n), _gym_loop_step(w, p),
                     a.warmup, a.seconds, a.frames)


def _envpool_step(w, p):
    """EnvPool's asynchronous loop: ``recv`` a batch, the policy on it, ``send`` its actions to its env ids."""
    net = make_net(w, p)
    dtype = np.int32 if w == "atari" else np.float64

    def step_of(env):
        env.async_reset()

        def step():
            obs, _, _, _, info = env.recv()
            env.send(np_actions(net, obs, dtype), info["env_id"])
            return len(obs)

        return step

    return step_of


def run_envpool_async(w, p, n, fpb, a):
    _need_envpool()
    cores = _cores()
    return _run_loop(lambda: make_envpool(w, n, num_threads=cores, batch_size=max(1, n // 2)),
                     _envpool_step(w, p), a.warmup, a.seconds, a.frames)


def _ale_async_env(n):
    from ale_py.vector_env import AtariVectorEnv

    env = AtariVectorEnv("pong", n, batch_size=max(1, n // 2), num_threads=_cores(), **ALE_VEC_KWARGS)
    return env


def run_ale_async(w, p, n, fpb, a):
    if w != "atari":
        raise _Skip("ale-py has no MuJoCo")
    net = make_net(w, p)

    def step_of(env):
        state = {"batch": env.reset(seed=0)}  # in async mode: the first batch_size observations

        def step():
            if state["batch"] is not None:
                obs, info = state["batch"]
                state["batch"] = None
            else:
                obs, _, _, _, info = env.recv()
            env.send(np_actions(net, obs, np.int64))
            return len(obs)

        return step

    return _run_loop(lambda: _ale_async_env(n), step_of, a.warmup, a.seconds, a.frames)


def run_ours(system):
    def run(w, p, n, fpb, a):
        return _run_collector(lambda: build_ours(w, p, n, fpb, system, a.vec_factories), a.warmup, a.seconds,
                              a.frames, ours=True)

    return run


def _torchrl_policy_factory(w, p):
    return make_td_policy(w, p, torchrl_specs=True)


def run_torchrl_sync(w, p, n, fpb, a):
    from torchrl.collectors import Collector
    from torchrl.envs import ParallelEnv

    return _run_collector(lambda: Collector(ParallelEnv(n, TORCHRL_FACTORY[w]), make_td_policy(w, p, True),
                                            frames_per_batch=fpb, total_frames=-1),
                          a.warmup, a.seconds, a.frames, ours=False)


def run_torchrl_async(w, p, n, fpb, a):
    from torchrl.collectors import AsyncBatchedCollector

    return _run_collector(lambda: AsyncBatchedCollector(
        create_env_fn=[TORCHRL_FACTORY[w]] * n, policy_factory=functools.partial(_torchrl_policy_factory, w, p),
        frames_per_batch=fpb, env_backend="multiprocessing", transport="auto", transition_chunk_size="auto"),
        a.warmup, a.seconds, a.frames, ours=False)


# -- env-only ceilings -------------------------------------------------------------------------
def _random_actions(w, k, count=4096):
    rng = np.random.default_rng(0)
    if w == "atari":
        return rng.integers(0, ATARI_ACTIONS, (count, k))
    return rng.uniform(-1, 1, (count, k, MUJOCO_ACT))


def _env_only_process(kind, w, k, conn) -> None:
    """Steps ``k`` envs of one stack with random actions until told to stop; answers each
    ``"count"`` with the frames made so far."""
    try:
        torch.set_num_threads(1)
        acts = _random_actions(w, k)
        count = [0]
        stop = threading.Event()
        if kind in ("env_only", "env_only_torchrl_idiom"):
            if kind == "env_only":
                envs = [GYM_FACTORY[w]() for _ in range(k)]
                for i, e in enumerate(envs):
                    e.reset(seed=i)

                def step_env(i, a):
                    _, _, term, trunc, _ = envs[i].step(a)
                    if term or trunc:
                        envs[i].reset()
            else:
                envs = [make_torchrl_idiom_atari() for _ in range(k)]
                tds = [e.reset() for e in envs]
                acts = torch.nn.functional.one_hot(torch.as_tensor(acts), ATARI_ACTIONS)

                def step_env(i, a):
                    tds[i]["action"] = a
                    _, tds[i] = envs[i].step_and_maybe_reset(tds[i])

            def loop():
                j = 0
                while not stop.is_set():
                    a = acts[j % len(acts)]
                    j += 1
                    for i in range(k):
                        step_env(i, a[i])
                    count[0] += k
        else:
            if kind == "env_only_ale":
                venv = make_ale_vec(k, num_threads=1)
                acts = acts.astype(np.int64)
            else:
                venv = make_envpool(w, k, num_threads=1)
                acts = acts.astype(np.int32 if w == "atari" else np.float64)
            venv.reset()  # EnvPool's seed is fixed at creation; ale-py's vector env seeds itself

            def loop():
                j = 0
                while not stop.is_set():
                    venv.step(acts[j % len(acts)])  # both autoreset (NEXT_STEP) inside
                    j += 1
                    count[0] += k

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        conn.send("ready")
        while conn.recv() == "count":
            conn.send(count[0])
        stop.set()
        t.join()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(f"error {type(e).__name__}: {e}")


def run_env_only(kind):
    def run(w, p, n, fpb, a):
        import multiprocessing as mp

        if kind == "env_only_ale" and w != "atari":
            raise _Skip("ale-py has no MuJoCo")
        if kind == "env_only_torchrl_idiom" and w != "atari":
            raise _Skip("MuJoCo's TorchRL factory already is TorchRL's idiom (ours_torchrl)")
        if kind == "env_only_envpool":
            _need_envpool()
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
        procs, conns = [], []
        with _ShieldedCell() as cell:
            try:
                t0 = time.perf_counter()
                for k in _split(n, _cores()):
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(target=_env_only_process, args=(kind, w, k, child), daemon=True)
                    proc.start()
                    procs.append(proc)
                    conns.append(parent)
                for c in conns:
                    msg = c.recv()
                    if msg != "ready":
                        raise RuntimeError(msg)
                first = time.perf_counter() - t0
                time.sleep(a.warmup)

                def total():
                    for c in conns:
                        c.send("count")
                    out = [c.recv() for c in conns]
                    bad = [m for m in out if isinstance(m, str)]
                    if bad:
                        raise RuntimeError(bad[0])
                    return sum(out)

                c0, t0 = total(), time.perf_counter()
                if a.frames:
                    while total() - c0 < a.frames:
                        time.sleep(0.05)
                else:
                    time.sleep(a.seconds)
                n_frames = total() - c0
                dt = time.perf_counter() - t0
                for c in conns:
                    c.send("stop")
                for proc in procs:
                    proc.join(5)
                return n_frames / dt, dict(first_batch_s=first, frames=n_frames, measured_s=dt,
                                           processes=len(procs))
            finally:
                cell.stop_processes()

    return run


RUNNERS = {
    "ours_gym": run_ours("ours_gym"),
    "ours_torchrl": run_ours("ours_torchrl"),
    "ours_torchrl_idiom": run_ours("ours_torchrl_idiom"),
    "ours_ale_vec": run_ours("ours_ale_vec"),
    "ours_envpool": run_ours("ours_envpool"),
    "ours_envpool_async": run_ours("ours_envpool_async"),
    "ours_gym_unpinned": run_ours("ours_gym_unpinned"),
    "ours_gym_shared": run_ours("ours_gym_shared"),
    "gym_async": run_gym_async,
    "gym_sync": run_gym_sync,
    "envpool_async": run_envpool_async,
    "ale_async": run_ale_async,
    "torchrl_sync": run_torchrl_sync,
    "torchrl_async": run_torchrl_async,
    "env_only": run_env_only("env_only"),
    "env_only_torchrl_idiom": run_env_only("env_only_torchrl_idiom"),
    "env_only_ale": run_env_only("env_only_ale"),
    "env_only_envpool": run_env_only("env_only_envpool"),
}


# -- the run -----------------------------------------------------------------------------------
def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def _versions():
    out = {"python": platform.python_version(), "torch": torch.__version__, "gymnasium": gym.__version__,
           "numpy": np.__version__}
    for mod in ("torchrl", "tensordict", "ale_py", "mujoco", "envpool"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def _cell_label(w, p, n):
    return f"{TITLES[w]} {n}" + (" (Nature CNN)" if p == "cnn" else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["atari", "mujoco"], choices=["atari", "mujoco"])
    ap.add_argument("--envs", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--policies", nargs="+", default=["mean", "cnn"], choices=["mean", "cnn"],
                    help="cnn applies to Atari only")
    ap.add_argument("--cnn-envs", nargs="+", type=int, default=None,
                    help="the env counts at which the Nature CNN runs (default: every --envs)")
    ap.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                    help=f"default: {' '.join(FAST_SYSTEMS)} (plus {' '.join(TORCHRL_SYSTEMS)} with --torchrl)")
    ap.add_argument("--torchrl", action="store_true", help="add TorchRL's collectors (minutes of start-up per cell)")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per cell")
    ap.add_argument("--frames", type=int, default=0, help="measure this many frames per cell instead of --seconds")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds run after the first batch, not measured")
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell, systems interleaved, order rotated")
    ap.add_argument("--frames-per-batch", type=int, default=1024)
    ap.add_argument("--vec-factories", type=int, default=0,
                    help="vector-env factories hosted by the collector (default: one per core)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: one repeat, 0.5 s cells, 0.2 s warm-up, the first env count, no TorchRL, "
                         "at most 5 s of waiting for the CPUs to go quiet before each system (else 60 s)")
    ap.add_argument("--json", default=None, help="where to write the rows, the cells and the table (default: nowhere; "
                                                 "the committed results files are named in benchmarks/README.md)")
    ap.add_argument("--note", default="", help="free text stored in the JSON (what else ran on the machine)")
    a = ap.parse_args(argv)
    systems = list(a.systems or (COLLECTOR_SYSTEMS + (TORCHRL_SYSTEMS if a.torchrl else ()) + CEILING_SYSTEMS))
    if a.quick:
        a.repeats, a.seconds, a.warmup, a.frames = 1, 0.5, 0.2, 0
        a.envs = a.envs[:1]
        systems = [s for s in systems if s not in TORCHRL_SYSTEMS]
    json_path = a.json  # never a committed file by default: a diagnostic run once overwrote one
    torch.set_num_threads(1)
    meta = dict(commit=_git("rev-parse", "HEAD"), commit_dirty=bool(_git("status", "--porcelain", "--", "..")),
                date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
                machine=dict(cores=_cores(), cpu_count=os.cpu_count(), cpu_model=cpu_model(),
                             platform=platform.platform(),
                             load_average_before=os.getloadavg()),
                versions=_versions(), args=vars(a), systems=systems, note=a.note)
    rows = []
    for w in a.workloads:
        for p in [p for p in a.policies if p in POLICIES[w]]:
            for n in a.envs:
                if p == "cnn" and a.cnn_envs and n not in a.cnn_envs:
                    continue
                cell_systems = [s for s in systems if not (w != "atari" and s in ATARI_ONLY)]
                if not cell_systems:
                    print(f"{_cell_label(w, p, n)}: every system named is Atari only, cell left out", flush=True)
                    continue
                for rep in range(a.repeats):
                    k = rep % len(cell_systems)
                    for s in cell_systems[k:] + cell_systems[:k]:
                        # e.g. TorchRL's workers still exiting after their run; a --quick smoke run does not
                        # wait a minute per system on a machine that something else keeps busy
                        settle_s = _wait_quiet(max_s=5.0 if a.quick else 60.0)
                        row = dict(workload=w, policy=p, envs=n, system=s, rep=rep, load_average=os.getloadavg()[0],
                                   settle_s=settle_s)
                        try:
                            fps, info = RUNNERS[s](w, p, n, a.frames_per_batch, a)
                            row.update(fps=fps, **info)
                        except _Skip as e:
                            row.update(fps=None, skipped=str(e))
                        except Exception as e:  # noqa: BLE001 - one failing system must not hide the others
                            row.update(fps=None, error=f"{type(e).__name__}: {e}"[:400])
                        rows.append(row)
                        print(json.dumps(row, default=str), flush=True)
    meta["machine"]["load_average_after"] = os.getloadavg()
    meta["date_end_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    cells = summarize(rows, systems)
    table = markdown(cells, systems, meta)
    print("\n" + table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=meta, cells=cells, rows=rows, table_markdown=table), f, indent=1, default=str)
    else:
        print("(rows not written: pass --json PATH to keep them)")
    return dict(meta=meta, cells=cells, rows=rows)


def _cpu_busy(seconds: float) -> float:
    """The machine's CPU busy fraction over ``seconds`` (all cores, from ``/proc/stat``; 0 elsewhere)."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def _wait_quiet(busy: float = 0.15, max_s: float = 60.0) -> float:
    """Waits until the CPUs are at most ``busy`` busy over half a second (the previous system's
    processes have exited; at most ``max_s`` seconds) so that no run, the env-only ceiling
    especially, is measured against another's shutdown; returns the seconds waited."""
    t0 = time.monotonic()
    while _cpu_busy(0.5) > busy and time.monotonic() - t0 < max_s:
        pass
    return time.monotonic() - t0


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(rows, systems):
    """One entry per (workload, policy, envs): each system's frames/s per repeat, median, errors,
    and the medians of its per-repeat ratios to every other system of the cell and to the ceilings."""
    cells = {}
    for r in rows:
        cells.setdefault((r["workload"], r["policy"], r["envs"]), []).append(r)
    out = []
    for (w, p, n), rs in cells.items():
        by = {}
        for r in rs:
            by.setdefault(r["system"], []).append(r)
        entry = dict(cell=_cell_label(w, p, n), workload=w, policy=p, envs=n, systems={})
        for s, srs in by.items():
            fps = {r["rep"]: r["fps"] for r in srs if r.get("fps")}
            e = dict(fps=[fps.get(r["rep"]) for r in srs], median=_median(list(fps.values())))
            if any("error" in r for r in srs):
                e["error"] = next(r["error"] for r in srs if "error" in r)
            if any("skipped" in r for r in srs):
                e["skipped"] = next(r["skipped"] for r in srs if "skipped" in r)
            vs = {}
            for peer, prs in by.items():
                if peer == s:
                    continue
                pf = {r["rep"]: r["fps"] for r in prs if r.get("fps")}
                ratios = [fps[k] / pf[k] for k in fps if k in pf]
                if ratios:
                    vs[peer] = dict(median=_median(ratios), per_repeat=ratios)
            e["vs"] = vs
            ceiling = STACK_CEILING.get(s, "env_only")
            if s not in CEILINGS and ceiling in vs:
                e["vs_ceiling"] = dict(ceiling=ceiling, **vs[ceiling])
            extra = [r for r in srs if "pool" in r or "first_batch_s" in r]
            if extra:
                e["first_batch_s"] = _median([r["first_batch_s"] for r in extra if "first_batch_s" in r])
                if any("pool" in r for r in extra):
                    last = [r for r in extra if "pool" in r][-1]
                    e["collector"] = {k: last.get(k) for k in ("pool", "server", "worker_affinity",
                                                               "driver_thread_affinity")}
            entry["systems"][s] = e
        out.append(entry)
    return out


def _fmt(e):
    if e is None:
        return ""
    if e.get("median"):
        m = e["median"]
        fps = [x for x in e["fps"] if x]
        rng = f" ({min(fps):,.0f}-{max(fps):,.0f})" if len(fps) > 1 else ""
        return f"{m:,.0f}{rng}" + (" (some repeats failed)" if "error" in e else "")
    if "error" in e:
        return "fails: " + e["error"].split("\n")[0][:80].replace("|", "/")
    if "skipped" in e:
        return "n/a"
    return ""


def markdown(cells, systems, meta):
    """The issue's layout: rows = cells, columns = systems (median frames/s, range over repeats),
    then ours (gymnasium factories) as a ratio of each peer and of the ceilings."""
    cols = [s for s in systems if any(s in c["systems"] for c in cells)]
    dirty = " (+ uncommitted changes)" if meta.get("commit_dirty") else ""
    lines = [f"commit `{(meta.get('commit') or '?')[:7]}`{dirty}, {meta['date_utc']} UTC, "
             f"{meta['machine']['cores']} cores"
             + (f" ({meta['machine']['cpu_model']})" if meta["machine"].get("cpu_model") else "")
             + ", load average "
             f"{', '.join(f'{x:.1f}' for x in meta['machine']['load_average_before'])} before"
             + (f" / {', '.join(f'{x:.1f}' for x in meta['machine']['load_average_after'])} after"
                if "load_average_after" in meta["machine"] else "")
             + f", {meta['args']['repeats']} repeat(s) of "
             + (f"{meta['args']['frames']} frames" if meta["args"]["frames"] else f"{meta['args']['seconds']:g} s")
             + " per system and cell; frames/s delivered to the training loop, median (range)", ""]
    lines.append("| cell | " + " | ".join(cols) + " |")
    lines.append("|---|" + "---|" * len(cols))
    for c in cells:
        lines.append(f"| {c['cell']} | " + " | ".join(_fmt(c["systems"].get(s)) for s in cols) + " |")
    ref = "ours_gym"
    peers = [s for s in cols if s != ref]
    if any(ref in c["systems"] for c in cells) and peers:
        lines += ["", f"`{ref}` as a ratio of each (median of per-repeat ratios):", ""]
        lines.append("| cell | " + " | ".join(f"x {s}" for s in peers) + " |")
        lines.append("|---|" + "---|" * len(peers))
        for c in cells:
            vs = (c["systems"].get(ref) or {}).get("vs", {})
            lines.append(f"| {c['cell']} | " + " | ".join(f"{vs[s]['median']:.2f}" if s in vs else "" for s in peers)
                         + " |")
    shares = [(c["cell"], s, e["vs_ceiling"]) for c in cells for s, e in c["systems"].items() if "vs_ceiling" in e]
    if shares:
        lines += ["", "share of the env-only ceiling of its own stack (median of per-repeat ratios):", ""]
        lines.append("| cell | " + " | ".join(s for s in cols if s not in CEILINGS) + " |")
        lines.append("|---|" + "---|" * len([s for s in cols if s not in CEILINGS]))
        for c in cells:
            cs = [c["systems"].get(s, {}).get("vs_ceiling") for s in cols if s not in CEILINGS]
            lines.append(f"| {c['cell']} | " + " | ".join(f"{x['median']:.2f} of {x['ceiling']}" if x else ""
                                                           for x in cs) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
