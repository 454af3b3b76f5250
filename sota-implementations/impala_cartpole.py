"""IMPALA (V-trace actor-critic) on CartPole-v1 with :class:`torchrl_asyncpool.AsyncPoolCollector`.

Central asynchronous inference is IMPALA's natural setting: the envs never wait for the learner.
The acting policy is a separate copy of the actor, served by the collector's policy thread and
refreshed with ``collector.update_policy_weights_(...)`` after every learner step; the
collector keeps stepping the envs meanwhile, so a batch holds transitions from older policy
versions. Every transition carries the version that acted (``"policy_version"``) and the
behaviour log-probability ``"sample_log_prob"``: the learner measures the policy lag from the
first and corrects for it with V-trace importance ratios ``pi_learner(a|s) / mu_behaviour(a|s)``
from the second (truncated at ``rho_bar`` and ``c_bar``).

Each batch is grouped by env (stable sort by ``"env_index"`` keeps each env's transitions in
time order); V-trace runs along each env's run, cut at episode ends and at the run's end
(bootstrapping from the value of the next observation). That learner step (V-trace targets, the
loss, one gradient step) is :func:`torchrl_asyncpool.examples.impala.impala_update`, which the
``torchrl-asyncpool demo`` command runs too; the model and the batch helpers are in
:mod:`torchrl_asyncpool.examples`, shared with the other scripts.

Run::

    python sota-implementations/impala_cartpole.py
    python sota-implementations/impala_cartpole.py --num-envs 16 --lr 1e-3 --log-dir /tmp/runs

Result on the 2-core development machine (heavily loaded by other jobs, see
``sota-implementations/README.md``): mean return of the last 20 episodes >= 475 after
180,480 frames and 48.5 s of training
(57 s wall time including start-up) in the run that produced
``docs/source/_static/impala_cartpole.png``; 160k-180k frames and 49-101 s over four runs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import time
from collections import deque

import gymnasium
import torch
import tqdm
from torchrl.envs import GymEnv
from torchrl.record.loggers.csv import CSVLogger

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.examples.actor_critic import ActorCritic
from torchrl_asyncpool.examples.batches import EpisodeTracker, group_by_env
from torchrl_asyncpool.examples.impala import impala_update
from torchrl_asyncpool.examples.plots import plot_curve
from torchrl_asyncpool.examples.script_config import config_parser


# ----------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (``total_frames`` -> ``--total-frames``).
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    env_id: str = "CartPole-v1"
    num_envs: int = 8
    frames_per_batch: int = 256           # transitions per collector batch (= per learner step)
    total_frames: int = 1_000_000         # hard stop
    target_return: float = 475.0          # stop early when the mean of the last `window` episodes reaches it
    window: int = 20                      # episodes in the moving mean of the return
    # IMPALA / V-trace
    lr: float = 1e-3
    gamma: float = 0.99
    rho_bar: float = 1.0                  # truncation of the importance weight in the V-trace target and PG
    c_bar: float = 1.0                    # truncation of the trace-cutting coefficients
    sgd_steps: int = 1                    # learner steps per batch (V-trace recomputed before each)
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    normalize_advantage: bool = True
    hidden: int = 64
    on_env_failure: str = "raise"         # "restart": an env that raises is rebuilt and training goes on
                                          # (its episode ends in a truncation; docs: Failures and recovery)
    step_timeout: float = 0.0             # seconds an env step may take before its worker is killed
                                          # (then replaced with --on-env-failure restart); 0: no limit
    seed: int = 0
    # logging
    log_dir: str = "runs"
    exp_name: str = ""                    # default: impala_cartpole_<time>
    plot_path: str = ""                   # default: <log_dir>/<exp_name>/impala_cartpole.png
    progress: bool = True


def parse_config(argv=None) -> Config:
    parser = config_parser(Config, __file__, __doc__)  # one flag per field, its comment as help
    cfg = Config(**vars(parser.parse_args(argv)))
    # bad input: exit 2 with the flag's name (argparse's usage error) instead of a crash or a silent no-op
    for name in ("num_envs", "frames_per_batch", "total_frames", "window", "sgd_steps", "hidden"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}.")
    if not 0.0 <= cfg.gamma <= 1.0:
        parser.error(f"--gamma must be in [0, 1], got {cfg.gamma}.")
    for name in ("rho_bar", "c_bar"):
        if getattr(cfg, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}.")
    if cfg.on_env_failure not in ("raise", "restart"):
        parser.error(f"--on-env-failure must be 'raise' or 'restart', got {cfg.on_env_failure!r}.")
    if cfg.step_timeout < 0:
        parser.error(f"--step-timeout must be >= 0 (0: no limit), got {cfg.step_timeout}.")
    return cfg


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    cfg = parse_config(argv)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    exp_name = cfg.exp_name or time.strftime("impala_cartpole_%Y%m%d-%H%M%S")
    logger = CSVLogger(exp_name=exp_name, log_dir=cfg.log_dir)
    logger.log_hparams(dataclasses.asdict(cfg))
    plot_path = cfg.plot_path or os.path.join(cfg.log_dir, exp_name, "impala_cartpole.png")

    probe = gymnasium.make(cfg.env_id)
    obs_dim, n_actions = probe.observation_space.shape[0], int(probe.action_space.n)
    probe.close()
    agent = ActorCritic(obs_dim, n_actions, cfg.hidden)  # the learner
    acting = copy.deepcopy(agent)                         # the actor, in the collector's policy thread
    optim = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)

    # TorchRL's GymEnv with categorical actions; workers step it on their fast path (gymnasium speed)
    collector = AsyncPoolCollector(
        [functools.partial(GymEnv, cfg.env_id, categorical_action_encoding=True)] * cfg.num_envs,
        policy=acting,
        frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.total_frames,
        seed=cfg.seed,  # env i's first reset: seed + i
        on_env_failure=cfg.on_env_failure,
        step_timeout=cfg.step_timeout or None,
    )
    tracker = EpisodeTracker(cfg.num_envs)
    recent = deque(maxlen=cfg.window)
    curve_frames, curve_returns = [], []
    frames, reached_at = 0, None
    pbar = tqdm.tqdm(total=cfg.total_frames, unit="frames", disable=not cfg.progress, dynamic_ncols=True)
    t0 = time.monotonic()
    try:
        for it, batch in enumerate(collector):
            frames += batch.numel()
            batch = group_by_env(batch)
            new_returns = tracker.update(batch)
            recent.extend(new_returns)
            curve_frames += [frames] * len(new_returns)
            curve_returns += new_returns
            # Policy lag: learner version now minus the version that acted, per transition.
            lag = (collector.policy_version - batch["policy_version"]).float()

            # V-trace targets and one gradient step per sgd step (torchrl_asyncpool.examples.impala)
            stats = [impala_update(agent, optim, batch, gamma=cfg.gamma, rho_bar=cfg.rho_bar, c_bar=cfg.c_bar,
                                   vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, max_grad_norm=cfg.max_grad_norm,
                                   normalize_advantage=cfg.normalize_advantage)
                     for _ in range(cfg.sgd_steps)]
            # A copy of the weights (a state dict is loaded in place), then a new policy version.
            collector.update_policy_weights_(agent.state_dict())

            # --- logging ------------------------------------------------------------------------
            elapsed = time.monotonic() - t0
            fps = frames / elapsed
            pool = collector.pool_metrics()
            mean_ret = sum(recent) / len(recent) if recent else float("nan")
            metrics = {
                "mean_return": mean_ret, "episodes": len(curve_returns), "frames": frames, "fps": fps,
                "env_fps": pool["fps"], "batch_fill_ratio": pool["batch_fill_ratio"],
                "policy_lag_mean": lag.mean().item(), "policy_lag_max": lag.max().item(),
                **{k: sum(step[k] for step in stats) / len(stats) for k in stats[0]},  # loss_policy, rho_mean...
                "time_s": elapsed,
            }
            if new_returns:
                metrics["batch_return"] = sum(new_returns) / len(new_returns)
            for k, v in metrics.items():
                logger.log_scalar(k, v, step=frames)
            collector.log_metrics(logger, step=frames)  # collector/pool/... and collector/server/...
            pbar.update(batch.numel())
            pbar.set_postfix(ret=f"{mean_ret:.1f}", fps=f"{fps:.0f}", fill=f"{pool['batch_fill_ratio']:.2f}",
                             lag=f"{lag.mean().item():.1f}",
                             **({"restarts": pool["env_restarts"]} if pool.get("env_restarts") else {}))
            if len(recent) == cfg.window and mean_ret >= cfg.target_return:
                reached_at = (frames, elapsed)
                break
    finally:
        pbar.close()
        collector.shutdown()

    elapsed = time.monotonic() - t0
    plot_curve(curve_frames, curve_returns, cfg.window, cfg.target_return, plot_path,
               f"IMPALA (V-trace) {cfg.env_id} ({cfg.num_envs} envs, AsyncPoolCollector)")
    mean_ret = sum(recent) / len(recent) if recent else float("nan")
    if reached_at is not None:
        print(f"Target {cfg.target_return:g} reached: mean return of the last {cfg.window} episodes "
              f"{mean_ret:.1f} after {reached_at[0]} frames in {reached_at[1]:.1f}s.")
    else:
        print(f"Target {cfg.target_return:g} not reached: mean return of the last {cfg.window} episodes "
              f"{mean_ret:.1f} after {frames} frames in {elapsed:.1f}s.")
    print(f"Frames/s {frames / elapsed:.0f}. Logs: {os.path.join(cfg.log_dir, exp_name)}  Curve: {plot_path}")
    return {"frames": frames, "time_s": elapsed, "mean_return": mean_ret, "reached": reached_at is not None,
            "log_dir": os.path.join(cfg.log_dir, exp_name), "plot_path": plot_path}


if __name__ == "__main__":
    main()
