"""IMPALA (V-trace actor-critic) on ALE/Pong-v5 with :class:`torchrl_asyncpool.AsyncPoolCollector`.

The envs (gymnasium ``ALE/Pong-v5`` with ``frameskip=1, repeat_action_probability=0.0``,
``AtariPreprocessing(noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)``,
``FrameStackObservation(4)``; :func:`torchrl_asyncpool.examples.envs.make_atari_env`) run in the
collector's worker processes; the Nature CNN policy
(:class:`~torchrl_asyncpool.examples.nature_cnn.NatureCNNActorCritic`) is served centrally by the
collector's policy thread on batches of whatever observations are ready, and refreshed with
``collector.update_policy_weights_(...)`` after every learner step. The collector keeps stepping
the envs meanwhile, so a batch holds transitions of older policy versions: each transition
carries the version that acted (``"policy_version"``, the lag is logged) and the behaviour
log-probability (``"sample_log_prob"``), and V-trace corrects for the lag with truncated
importance ratios (``rho_bar = c_bar = 1``).

Each batch is grouped by env (``group_by_env``), and V-trace runs along each env's run, cut at
episode ends and at the end of the run (bootstrapping from the value of the next observation):
:func:`~torchrl_asyncpool.examples.nature_cnn.impala_cnn_update` (one torso pass for the whole
batch, rewards clipped to their sign). Hyper-parameters are those of TorchRL's
``sota-implementations/impala/config_single_node.yaml``: 12 envs, batches of 32 x 20 = 640
agent steps, RMSprop (lr 6e-4 annealed, alpha 0.99, eps 1e-8), gradient norm clipped at 40,
entropy 0.01, value 0.5, gamma 0.99, one learner step per batch. Frames here are agent steps
(transitions): one is 4 emulator frames, and TorchRL's ``total_frames`` of 200M emulator frames
is the 50M default below. Unlike TorchRL's recipe, no end-of-life signal and no observation
``VecNorm`` (pixels are scaled by 1/255).

``--collector torchrl`` runs the same learner on TorchRL's ``MultiAsyncCollector`` (one env per
worker process, each worker with its own copy of the policy, 20-step rollouts, 32 of them per
learner step), as TorchRL's ``impala_single_node.py`` does.

Threads: ``torch.set_num_threads(1)`` in the learner (the CNN's backward would take both cores
from the envs); the policy thread uses one thread (``policy_num_threads=1``); the env workers are
processes.

Run::

    python sota-implementations/impala_atari.py
    python sota-implementations/impala_atari.py --collector torchrl
    python sota-implementations/impala_atari.py --num-envs 8 --total-frames 2000000 --log-dir /tmp/runs
    python sota-implementations/impala_atari.py --max-minutes 60   # as many frames as fit in an hour
    python sota-implementations/impala_atari.py --remote-address 127.0.0.1:50051 --ray-hosts 4  # envs in Ray actors

What was measured (no GPU; commit, date and curve in ``benchmarks/README.md``): on a 2-core host,
one hour with the defaults trained 1.43M agent steps at 411 frames/s, and the return did not yet
rise above the random policy's (-20.6 over the last 20 episodes); Pong needs millions of agent
steps, hours on 2 cores. On 2 vCPUs of an AMD EPYC host (commit ``83d10b7``, 32,000 frames) the
training loop ran at 692 frames/s against 318 with TorchRL's ``MultiaSyncDataCollector`` (2.18x).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import time
from collections import deque

import torch
import tqdm
from tensordict.nn import TensorDictModule
from torchrl.record.loggers.csv import CSVLogger

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.examples.batches import EpisodeTracker, group_by_env
from torchrl_asyncpool.examples.eval_return import mean_eval_return
from torchrl_asyncpool.examples.envs import make_atari_env, make_torchrl_atari_env
from torchrl_asyncpool.examples.learner_process import prepare_learner_process
from torchrl_asyncpool.examples.nature_cnn import ActModule, NatureCNNActorCritic, impala_cnn_update
from torchrl_asyncpool.examples.plots import plot_curve
from torchrl_asyncpool.examples.ray_env_hosts import check_ray_flags, start_ray_env_hosts
from torchrl_asyncpool.examples.script_config import config_parser


# ----------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (``total_frames`` -> ``--total-frames``).
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    env_id: str = "ALE/Pong-v5"
    collector: str = "asyncpool"          # "asyncpool" (AsyncPoolCollector) or "torchrl" (MultiAsyncCollector)
    num_envs: int = 12
    frames_per_batch: int = 640           # agent steps per learner step (TorchRL: 32 rollouts x 20 steps)
    rollout_length: int = 20              # torchrl: steps per worker rollout (frames_per_batch / it rollouts per step)
    total_frames: int = 50_000_000        # agent steps (x4 emulator frames: TorchRL's 200M)
    max_minutes: float = 0.0              # stop training after this many minutes (0: at total_frames)
    target_return: float = 18.0           # drawn on the plot; the frames at which it is reached are reported
    window: int = 20                      # episodes in the moving mean of the return
    # IMPALA / V-trace (TorchRL's sota-implementations/impala/config_single_node.yaml)
    lr: float = 6e-4
    anneal_lr: bool = True
    rms_alpha: float = 0.99
    rms_eps: float = 1e-8
    gamma: float = 0.99
    rho_bar: float = 1.0                  # truncation of the importance weight in the V-trace target and PG
    c_bar: float = 1.0                    # truncation of the trace-cutting coefficients
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 40.0
    clip_rewards: bool = True             # the learner sees sign(reward) (returns are logged unclipped)
    # evaluation at the end (torchrl_asyncpool.evaluation.evaluate, greedy actions)
    eval_episodes: int = 3
    eval_max_steps: int = 27_000          # agent steps after which an evaluation episode is cut
    on_env_failure: str = "raise"         # asyncpool: "restart": an env that raises is rebuilt and training goes on
    step_timeout: float = 0.0             # asyncpool: seconds an env step may take before its worker is killed
    remote_address: str = ""              # asyncpool: "HOST:PORT": the envs run in env hosts that connect there
    ray_hosts: int = 0                    # with remote_address: start the hosts as this many Ray actors
                                          # (num_envs / ray_hosts envs each), on RAY_ADDRESS's cluster or a local one
    seed: int = 0
    # logging
    log_dir: str = "runs"
    exp_name: str = ""                    # default: impala_atari_<collector>_<time>
    plot_path: str = ""                   # default: <log_dir>/<exp_name>/impala_atari.png
    progress: bool = True


def parse_config(argv=None) -> Config:
    parser = config_parser(Config, __file__, __doc__)  # one flag per field, its comment as help
    cfg = Config(**vars(parser.parse_args(argv)))
    for name in ("num_envs", "frames_per_batch", "rollout_length", "total_frames", "window"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}.")
    if not 0.0 <= cfg.gamma <= 1.0 or cfg.rho_bar <= 0 or cfg.c_bar <= 0:
        parser.error("--gamma must be in [0, 1], --rho-bar and --c-bar > 0.")
    if cfg.collector not in ("asyncpool", "torchrl"):
        parser.error(f"--collector must be 'asyncpool' or 'torchrl', got {cfg.collector!r}.")
    if cfg.collector == "torchrl" and (cfg.frames_per_batch % cfg.rollout_length or cfg.on_env_failure != "raise"
                                       or cfg.step_timeout):
        parser.error("--collector torchrl: --frames-per-batch must be a multiple of --rollout-length; "
                     "--on-env-failure and --step-timeout are AsyncPoolCollector options.")
    if cfg.on_env_failure not in ("raise", "restart"):
        parser.error(f"--on-env-failure must be 'raise' or 'restart', got {cfg.on_env_failure!r}.")
    if cfg.max_minutes < 0:
        parser.error(f"--max-minutes must be >= 0 (0: no limit), got {cfg.max_minutes}.")
    if cfg.step_timeout < 0:
        parser.error(f"--step-timeout must be >= 0 (0: no limit), got {cfg.step_timeout}.")
    check_ray_flags(parser, cfg)  # --remote-address / --ray-hosts
    if cfg.eval_episodes < 0 or cfg.eval_max_steps < 1:
        parser.error("--eval-episodes must be >= 0 and --eval-max-steps >= 1.")
    return cfg


def make_collector(cfg: Config, policy):
    """This package's collector acting with a copy of ``policy``, and the Ray env hosts it reads
    from (``None`` without ``--ray-hosts``)."""
    factories = [functools.partial(make_atari_env, cfg.env_id)] * cfg.num_envs
    ray_hosts = None
    if cfg.remote_address:  # slots fed by env hosts in Ray actors (torchrl_asyncpool.remote)
        factories, ray_hosts = start_ray_env_hosts(functools.partial(make_atari_env, cfg.env_id),
                                                   cfg.remote_address, cfg.num_envs, cfg.ray_hosts)
    try:
        collector = AsyncPoolCollector(
            factories,
            policy=copy.deepcopy(policy),  # the acting copy, in the collector's policy thread
            frames_per_batch=cfg.frames_per_batch,
            total_frames=cfg.total_frames,
            seed=None if cfg.remote_address else cfg.seed,  # env i's first reset: seed + i (hosts seed their own)
            on_env_failure=cfg.on_env_failure,
            step_timeout=cfg.step_timeout or None,
        )
    except BaseException:
        if ray_hosts is not None:
            ray_hosts.stop()
        raise
    return collector, ray_hosts


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    cfg = parse_config(argv)
    prepare_learner_process(1)  # the same learner process with either collector
    torch.manual_seed(cfg.seed)
    exp_name = cfg.exp_name or time.strftime(f"impala_atari_{cfg.collector}_%Y%m%d-%H%M%S")
    logger = CSVLogger(exp_name=exp_name, log_dir=cfg.log_dir)
    logger.log_hparams(dataclasses.asdict(cfg))
    plot_path = cfg.plot_path or os.path.join(cfg.log_dir, exp_name, "impala_atari.png")

    probe = make_atari_env(cfg.env_id)
    n_actions = int(probe.action_space.n)
    probe.close()
    net = NatureCNNActorCritic(n_actions)  # the learner
    # observation -> ("action", "sample_log_prob"); the same module acts in either collector
    policy = TensorDictModule(ActModule(net), in_keys=["observation"], out_keys=["action", "sample_log_prob"])
    optim = torch.optim.RMSprop(net.parameters(), lr=cfg.lr, alpha=cfg.rms_alpha, eps=cfg.rms_eps)
    total_updates = max(1, cfg.total_frames // cfg.frames_per_batch)

    ray_hosts = None
    if cfg.collector == "torchrl":
        from torchrl.collectors import MultiAsyncCollector

        collector = MultiAsyncCollector(
            [functools.partial(make_torchrl_atari_env, cfg.env_id)] * cfg.num_envs, policy,
            frames_per_batch=cfg.rollout_length, total_frames=cfg.total_frames, update_at_each_batch=True,
        )
        collector.set_seed(cfg.seed)
        rollouts_per_batch = cfg.frames_per_batch // cfg.rollout_length
    else:
        collector, ray_hosts = make_collector(cfg, policy)

    tracker = EpisodeTracker(cfg.num_envs)  # asyncpool: returns per env index
    running = {}  # torchrl: returns per trajectory id
    recent = deque(maxlen=cfg.window)
    curve_frames, curve_returns = [], []
    frames, updates, wait_s, reached_at, rollout_id = 0, 0, 0.0, None, 0
    stopped_by_time = False
    pbar = tqdm.tqdm(total=cfg.total_frames, unit="frames", disable=not cfg.progress, dynamic_ncols=True)
    t0 = time.monotonic()
    batches = iter(collector)
    try:
        while True:
            t_wait = time.monotonic()  # the learner waits for data here
            if cfg.collector == "torchrl":  # a batch: `rollouts_per_batch` rollouts, each of one worker's env
                parts = []
                for _ in range(rollouts_per_batch):
                    part = next(batches, None)
                    if part is None:
                        break
                    part = part.reshape(-1)
                    # env_index: one per rollout, so that V-trace runs along each rollout (group_by_env +
                    # segment_ends cut at its end); episode returns are tracked by TorchRL's trajectory id
                    part["env_index"] = torch.full(part.shape, rollout_id)
                    rollout_id += 1
                    parts.append(part)
                batch = torch.cat(parts) if parts else None
            else:
                batch = next(batches, None)
            wait_s += time.monotonic() - t_wait
            if batch is None:
                break
            n = batch.numel()
            frames += n
            if cfg.collector == "torchrl":
                lag = float("nan")
                new_returns = []
                rewards, dones = batch["next", "reward"].flatten().tolist(), batch["next", "done"].flatten().tolist()
                for traj, r, d in zip(batch["collector", "traj_ids"].tolist(), rewards, dones):
                    running[traj] = running.get(traj, 0.0) + r
                    if d:
                        new_returns.append(running.pop(traj))
                batch = batch.exclude("collector")
            else:
                lag = (collector.policy_version - batch["policy_version"]).float().mean().item()
                batch = group_by_env(batch)
                new_returns = tracker.update(batch)
            recent.extend(new_returns)
            curve_frames += [frames] * len(new_returns)
            curve_returns += new_returns

            if cfg.anneal_lr:
                optim.param_groups[0]["lr"] = cfg.lr * max(0.0, 1.0 - updates / total_updates)
            stats = impala_cnn_update(net, optim, batch, gamma=cfg.gamma, rho_bar=cfg.rho_bar, c_bar=cfg.c_bar,
                                      vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, max_grad_norm=cfg.max_grad_norm,
                                      clip_rewards=cfg.clip_rewards)
            updates += 1
            if cfg.collector == "torchrl":
                collector.update_policy_weights_()  # the workers' copies get the weights of `policy`
            else:
                collector.update_policy_weights_(policy.state_dict())  # a copy, then a new policy version

            # --- logging ------------------------------------------------------------------------
            elapsed = time.monotonic() - t0
            mean_ret = sum(recent) / len(recent) if recent else float("nan")
            metrics = {
                "mean_return": mean_ret, "episodes": len(curve_returns), "frames": frames,
                "emulator_frames": 4 * frames, "fps": frames / elapsed, "updates": updates,
                "updates_per_s": updates / elapsed, "learner_wait_share": wait_s / elapsed, "policy_lag": lag,
                **stats, "lr": optim.param_groups[0]["lr"], "time_s": elapsed,
            }
            if new_returns:
                metrics["batch_return"] = sum(new_returns) / len(new_returns)
            for k, v in metrics.items():
                logger.log_scalar(k, v, step=frames)
            postfix = {"ret": f"{mean_ret:.1f}", "fps": f"{frames / elapsed:.0f}", "wait": f"{wait_s / elapsed:.2f}"}
            if cfg.collector == "asyncpool":
                collector.log_metrics(logger, step=frames)  # collector/pool/... and collector/server/...
                pool = collector.pool_metrics()
                postfix.update(fill=f"{pool['batch_fill_ratio']:.2f}", lag=f"{lag:.1f}")
                if pool.get("env_restarts"):
                    postfix["restarts"] = pool["env_restarts"]
            pbar.update(n)
            pbar.set_postfix(**postfix)
            if reached_at is None and len(recent) == cfg.window and mean_ret >= cfg.target_return:
                reached_at = (frames, elapsed)
            if cfg.max_minutes and elapsed >= 60 * cfg.max_minutes:
                stopped_by_time = True
                break
    finally:
        pbar.close()
        collector.shutdown()
        if ray_hosts is not None:
            ray_hosts.stop()
    elapsed = time.monotonic() - t0
    mean_ret = sum(recent) / len(recent) if recent else float("nan")

    eval_return = float("nan")
    if cfg.eval_episodes:
        eval_return = mean_eval_return(functools.partial(make_atari_env, cfg.env_id), policy,
                                       episodes=cfg.eval_episodes, seed=cfg.seed, max_steps=cfg.eval_max_steps)
        logger.log_scalar("eval_return", eval_return, step=frames)

    plot_curve(curve_frames, curve_returns, cfg.window, cfg.target_return, plot_path,
               f"IMPALA (V-trace) {cfg.env_id} ({cfg.num_envs} envs, {cfg.collector})")
    if reached_at is not None:
        print(f"Mean return of {cfg.window} episodes reached {cfg.target_return:g} after {reached_at[0]} frames "
              f"in {reached_at[1]:.1f}s.")
    if stopped_by_time:
        print(f"Stopped at the --max-minutes budget ({cfg.max_minutes:g} min).")
    print(f"{frames} agent steps ({4 * frames} emulator frames), {updates} updates in {elapsed:.1f}s: "
          f"{frames / elapsed:.0f} frames/s, {updates / elapsed:.2f} updates/s, learner waited "
          f"{100 * wait_s / elapsed:.0f}% of the time; mean return of the last {len(recent)} episodes {mean_ret:.1f}, "
          f"evaluation {eval_return:.1f}.")
    print(f"Logs: {os.path.join(cfg.log_dir, exp_name)}  Curve: {plot_path}")
    return {"frames": frames, "updates": updates, "time_s": elapsed, "fps": frames / elapsed,
            "learner_wait_share": wait_s / elapsed, "mean_return": mean_ret, "eval_return": eval_return,
            "reached_at": reached_at, "stopped_by_time": stopped_by_time,
            "log_dir": os.path.join(cfg.log_dir, exp_name), "plot_path": plot_path}


if __name__ == "__main__":
    main()
