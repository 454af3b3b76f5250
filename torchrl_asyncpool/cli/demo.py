"""``torchrl-asyncpool demo``: train IMPALA on CartPole with AsyncPoolCollector.

A compact loop around the learner step of ``sota-implementations/impala_cartpole.py``
(:func:`torchrl_asyncpool.examples.impala.impala_update`, the same model and batch helpers): no
logging, plot or flags beyond the command's own; one learner step per batch.
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from collections import deque

from torchrl_asyncpool.cli._common import _positive_int, _start_fork_server

__all__ = ["train_impala_demo"]


def train_impala_demo(
    *,
    env_id: str = "CartPole-v1",
    total_frames: int = 500_000,
    num_envs: int = 8,
    frames_per_batch: int = 256,
    target_return: float = 475.0,
    window: int = 20,
    lr: float = 1e-3,
    gamma: float = 0.99,
    ent_coef: float = 0.01,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Trains IMPALA on ``env_id`` with :class:`~torchrl_asyncpool.AsyncPoolCollector`.

    Returns a dict with ``frames``, ``time_s``, ``fps`` (end-to-end frames/s, learning
    included), ``env_fps`` (the pool's), ``batch_fill_ratio``, ``mean_return`` (last
    ``window`` episodes), ``episodes``, ``reached``, ``mean_policy_lag`` and ``last_loss``
    (the last update's loss). Errors in env workers or in the policy propagate.
    """
    import tqdm

    from torchrl_asyncpool.examples.batches import EpisodeTracker, group_by_env
    from torchrl_asyncpool.examples.impala import impala_update

    agent, acting, optim = _demo_agent(env_id, lr=lr, seed=seed)
    collector = _demo_collector(env_id, acting, num_envs=num_envs, frames_per_batch=frames_per_batch,
                                total_frames=total_frames, seed=seed)
    tracker = EpisodeTracker(num_envs)
    recent: deque = deque(maxlen=window)
    frames = episodes = 0
    lag_sum = 0.0
    last_loss = float("nan")
    reached = False
    pool = {"fps": float("nan"), "batch_fill_ratio": float("nan")}
    # one rate on the bar: tqdm's own, averaged since the start (smoothing=0), the same
    # end-to-end frames/s as the final summary
    pbar = tqdm.tqdm(total=total_frames, unit="frames", disable=not progress, dynamic_ncols=True, smoothing=0)
    t0 = time.monotonic()
    try:
        try:
            for it, batch in enumerate(collector):
                frames += batch.numel()
                batch = group_by_env(batch)  # each env's transitions: one contiguous, time-ordered run
                returns = tracker.update(batch)
                recent.extend(returns)
                episodes += len(returns)
                lag_sum += (collector.policy_version - batch["policy_version"]).float().mean().item()
                # V-trace targets, the loss and one gradient step, as impala_cartpole.py's learner
                last_loss = impala_update(agent, optim, batch, gamma=gamma, ent_coef=ent_coef)["loss"]
                collector.update_policy_weights_(agent.state_dict())  # copied into the acting policy

                pool = collector.pool_metrics()
                mean_ret = sum(recent) / len(recent) if recent else float("nan")
                pbar.update(batch.numel())
                pbar.set_postfix(ret=f"{mean_ret:.1f}", fill=f"{pool['batch_fill_ratio']:.2f}")
                if len(recent) == window and mean_ret >= target_return:
                    reached = True
                    break
        finally:
            pbar.close()
            collector.shutdown()
    except KeyboardInterrupt as exc:  # what was reached so far travels with it (the CLI's summary line),
        # also when it came while the collector was shutting down after the last batch
        exc.demo_progress = {"frames": frames, "time_s": time.monotonic() - t0, "episodes": episodes,
                             "mean_return": sum(recent) / len(recent) if recent else float("nan")}
        raise
    elapsed = time.monotonic() - t0
    return {
        "frames": frames,
        "time_s": elapsed,
        "fps": frames / elapsed if elapsed > 0 else float("nan"),
        "env_fps": pool["fps"],
        "batch_fill_ratio": pool["batch_fill_ratio"],
        "mean_return": sum(recent) / len(recent) if recent else float("nan"),
        "episodes": episodes,
        "reached": reached,
        "mean_policy_lag": lag_sum / max(it + 1, 1) if frames else float("nan"),
        "startup_s": collector.startup_time_s,
        "last_loss": last_loss,
    }


def _demo_agent(env_id: str, *, lr: float, seed: int) -> tuple:
    """``(learner, acting copy, optimizer)``: an actor-critic sized for ``env_id``'s observation
    and action spaces, seeded with ``seed``."""
    import gymnasium
    import torch

    from torchrl_asyncpool.examples.actor_critic import ActorCritic

    torch.manual_seed(seed)
    probe = gymnasium.make(env_id)
    obs_dim, n_actions = probe.observation_space.shape[0], int(probe.action_space.n)
    probe.close()
    agent = ActorCritic(obs_dim, n_actions)
    acting = copy.deepcopy(agent)
    optim = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    return agent, acting, optim


def _demo_collector(env_id: str, acting, *, num_envs: int, frames_per_batch: int, total_frames: int, seed: int):
    """The demo's :class:`~torchrl_asyncpool.AsyncPoolCollector`: ``num_envs`` TorchRL ``GymEnv``
    of ``env_id`` served by ``acting``, at most one batch ahead of the learner."""
    from torchrl.envs import GymEnv

    from torchrl_asyncpool.collector.collector import AsyncPoolCollector

    # TorchRL's GymEnv, as a TorchRL user writes it; the workers step it on their fast path
    return AsyncPoolCollector(
        [functools.partial(GymEnv, env_id, categorical_action_encoding=True)] * num_envs,
        policy=acting,
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        # envs run at most one batch ahead of the learner: IMPALA's V-trace corrects for a lag
        # of a version or two, but this learner (one step per batch, lr 1e-3)
        # stalled or collapsed in 2 of ~20 runs whose mean lag reached 1.8-1.9 versions
        transition_chunk_size=max(1, frames_per_batch // num_envs),
        chunks_per_env=1,
        seed=seed,  # env i's first reset: seed + i
    )


def _check_demo_env(env_id: str) -> None:
    """Refuses (``ValueError``, one line) an env id gymnasium does not know, or an env the demo's
    learner cannot train (a flat observation vector and a discrete action are needed)."""
    import gymnasium as gym

    try:
        env = gym.make(env_id)
    except gym.error.Error as exc:
        raise ValueError(f"--env-id {env_id!r}: {exc}") from None
    try:
        obs, act = env.observation_space, env.action_space
        if not (isinstance(act, gym.spaces.Discrete) and isinstance(obs, gym.spaces.Box) and len(obs.shape) == 1):
            raise ValueError(f"--env-id {env_id!r}: the demo trains envs with a flat Box observation and a "
                             f"Discrete action; this one has {obs} and {act}.")
    finally:
        env.close()


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)  # env workers are processes; the learner and policy share few cores
    from torchrl_asyncpool.exchange.native import describe_exchange

    try:
        _check_demo_env(args.env_id)
    except ValueError as exc:
        print(f"torchrl-asyncpool demo: {exc}", file=sys.stderr)
        return 2
    _start_fork_server()
    engine = describe_exchange()
    print(f"Training IMPALA on {args.env_id} with AsyncPoolCollector ({args.num_envs} envs, "
          f"up to {args.total_frames} frames, target return {args.target_return:g}; exchange: {engine})...",
          flush=True)
    try:
        res = train_impala_demo(
            env_id=args.env_id, total_frames=args.total_frames, num_envs=args.num_envs,
            frames_per_batch=args.frames_per_batch, target_return=args.target_return, seed=args.seed,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt as exc:
        got = getattr(exc, "demo_progress", None)
        if got is None:  # before the first batch
            print("\ntorchrl-asyncpool demo: interrupted before training started.", file=sys.stderr)
        else:
            rate = got["frames"] / got["time_s"] if got["time_s"] > 0 else float("nan")
            print(f"\ntorchrl-asyncpool demo: interrupted after {got['frames']} frames in {got['time_s']:.1f} s "
                  f"({rate:.0f} frames/s); mean return of the last 20 episodes: {got['mean_return']:.1f} "
                  f"({got['episodes']} episodes).", file=sys.stderr)
        return 130
    status = "reached" if res["reached"] else "not reached"
    print(f"frames: {res['frames']}  time: {res['time_s']:.1f}s  (collector start-up {res['startup_s']:.1f}s)")
    print(f"frames/s reached: {res['fps']:.0f} end-to-end with learning "
          f"(env pool {res['env_fps']:.0f}, batch fill ratio {res['batch_fill_ratio']:.2f}, "
          f"mean policy lag {res['mean_policy_lag']:.2f} versions)")
    print(f"final return (mean of the last 20 episodes): {res['mean_return']:.1f}  "
          f"[target {args.target_return:g} {status}; {res['episodes']} episodes]")
    return 0



def add_parser(sub) -> None:
    """Registers the command and its options on the ``torchrl-asyncpool`` subparsers ``sub``."""
    demo = sub.add_parser(
        "demo", help="train IMPALA on CartPole with AsyncPoolCollector; print frames/s and final return",
        description="Train IMPALA (V-trace) on CartPole-v1 with AsyncPoolCollector and print the frames/s "
                    "reached and the final mean return. Stops at --target-return or --total-frames.",
    )
    demo.add_argument("--total-frames", type=_positive_int, default=500_000, help="frame budget (default: 500000)")
    demo.add_argument("--num-envs", type=_positive_int, default=8, help="environments (default: 8)")
    demo.add_argument("--frames-per-batch", type=_positive_int, default=256,
                      help="frames per learner step (default: 256)")
    demo.add_argument("--target-return", type=float, default=475.0,
                      help="stop when the mean return of the last 20 episodes reaches it (default: 475)")
    demo.add_argument("--env-id", default="CartPole-v1",
                      help="gymnasium env with a discrete action (default: CartPole-v1)")
    demo.add_argument("--seed", type=int, default=0, help="torch seed; env i's first reset gets seed + i")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_cmd_demo)
