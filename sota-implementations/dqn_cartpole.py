"""DQN on CartPole-v1 with :class:`torchrl_asyncpool.AsyncPoolCollector` filling a replay buffer.

Off-policy loop: ``collector.start()`` collects in a background thread and writes every batch to
a :class:`torchrl.data.ReplayBuffer`, while the learner samples from the buffer. The acting
policy is an epsilon-greedy copy of the Q-network served by the collector's policy thread; the
learner pushes its weights with ``collector.update_policy_weights_(...)`` every few steps and
anneals epsilon. Double DQN targets come from a target network that follows the online one by
Polyak averaging (``tau`` every ``target_update_interval`` steps; ``--tau 1`` gives hard copies).

The learner keeps the update-to-data ratio at ``utd`` gradient steps per collected frame
(so the frames needed do not depend on the machine's speed): it waits for data when it is
ahead, and pauses the collector (``with collector.pause():``) when it falls more than
``max_lead_frames`` behind.

Errors in the background collection (a crashed env or worker, a policy error) are re-raised in
the learner by ``collector.check_errors()``, which runs every loop iteration (and by
``update_policy_weights_``, which checks the inference server).

Run::

    python sota-implementations/dqn_cartpole.py
    python sota-implementations/dqn_cartpole.py --utd 0.5 --hidden 256 --log-dir /tmp/runs

Result on the 2-core development machine (heavily loaded by other jobs, see
``sota-implementations/README.md``): mean return of the last 20 episodes >= 475 after
76,288 frames (18,822 gradient steps) and
57.6 s of training (65 s wall time including start-up) in the run that produced
``docs/source/_static/dqn_cartpole.png``; 64k-206k frames and 58-223 s over four runs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import threading
import time

import gymnasium
import torch
import torch.nn as nn
import tqdm
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.record.loggers.csv import CSVLogger

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.examples.batches import EpisodeTracker
from torchrl_asyncpool.examples.plots import plot_curve
from torchrl_asyncpool.examples.script_config import config_parser


# ----------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (``total_frames`` -> ``--total-frames``).
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    env_id: str = "CartPole-v1"
    num_envs: int = 8
    frames_per_batch: int = 128           # transitions per replay-buffer write
    total_frames: int = 300_000           # hard stop
    target_return: float = 475.0          # stop early when the mean of the last `window` episodes reaches it
    window: int = 20                      # episodes in the moving mean of the return
    # DQN
    buffer_size: int = 100_000
    batch_size: int = 128
    lr: float = 1e-3
    gamma: float = 0.99
    learning_starts: int = 1_000          # frames in the buffer before the first update
    utd: float = 0.25                     # gradient steps per collected frame
    max_lead_frames: int = 2_000          # collector pauses when it is this far ahead of the learner
    double_dqn: bool = True               # next action chosen by the online net, valued by the target net
    target_update_interval: int = 1       # gradient steps between target-network updates
    tau: float = 0.01                     # target <- tau * online + (1 - tau) * target (1.0: hard copy)
    actor_update_interval: int = 10       # gradient steps between acting-policy weight pushes
    eps_start: float = 1.0
    eps_end: float = 0.02
    eps_decay_frames: int = 15_000
    max_grad_norm: float = 10.0
    hidden: int = 128
    on_env_failure: str = "raise"         # "restart": an env that raises is rebuilt and training goes on
                                          # (its episode ends in a truncation; docs: Failures and recovery)
    step_timeout: float = 0.0             # seconds an env step may take before its worker is killed
                                          # (then replaced with --on-env-failure restart); 0: no limit
    seed: int = 0
    # logging
    log_interval: int = 250               # gradient steps between log lines
    log_dir: str = "runs"
    exp_name: str = ""                    # default: dqn_cartpole_<time>
    plot_path: str = ""                   # default: <log_dir>/<exp_name>/dqn_cartpole.png
    progress: bool = True


def parse_config(argv=None) -> Config:
    parser = config_parser(Config, __file__, __doc__)  # one flag per field, its comment as help
    cfg = Config(**vars(parser.parse_args(argv)))
    # bad input: exit 2 with the flag's name (argparse's usage error) instead of a crash or a silent no-op
    for name in ("num_envs", "frames_per_batch", "total_frames", "window", "buffer_size", "batch_size",
                 "target_update_interval", "actor_update_interval", "eps_decay_frames", "hidden", "log_interval"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}.")
    for name in ("gamma", "eps_start", "eps_end"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(cfg, name)}.")
    if not 0.0 < cfg.tau <= 1.0:
        parser.error(f"--tau must be in (0, 1], got {cfg.tau}.")
    if cfg.utd <= 0:
        parser.error(f"--utd must be > 0 (gradient steps per collected frame), got {cfg.utd}.")
    if cfg.learning_starts < 0:
        parser.error(f"--learning-starts must be >= 0, got {cfg.learning_starts}.")
    if cfg.on_env_failure not in ("raise", "restart"):
        parser.error(f"--on-env-failure must be 'raise' or 'restart', got {cfg.on_env_failure!r}.")
    if cfg.step_timeout < 0:
        parser.error(f"--step-timeout must be >= 0 (0: no limit), got {cfg.step_timeout}.")
    return cfg


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
def qnet(obs_dim: int, n_actions: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, n_actions))


class EpsilonGreedy(nn.Module):
    """The acting policy (``TensorDict -> TensorDict``): greedy in Q with probability ``1 - eps``."""

    def __init__(self, net: nn.Module, n_actions: int, eps: float):
        super().__init__()
        self.net = net
        self.n_actions = n_actions
        self.eps = eps  # a float the learner overwrites; read by the collector's policy thread

    def forward(self, td: TensorDict) -> TensorDict:
        greedy = self.net(td["observation"]).argmax(-1)
        explore = torch.rand(greedy.shape) < self.eps
        td.set("action", torch.where(explore, torch.randint_like(greedy, self.n_actions), greedy))
        return td


# ----------------------------------------------------------------------------------------------
# Episode returns
# ----------------------------------------------------------------------------------------------
class Stats:
    """What the background collection reports to the learner (written in the collector's thread)."""

    def __init__(self, num_envs: int):
        self.lock = threading.Lock()
        self.frames = 0
        self.tracker = EpisodeTracker(num_envs)
        self.curve_frames: list[int] = []
        self.curve_returns: list[float] = []

    def __call__(self, batch: TensorDict) -> None:  # the collector's post_collect_hook
        returns = self.tracker.update(batch)
        with self.lock:
            self.frames += batch.numel()
            self.curve_frames += [self.frames] * len(returns)
            self.curve_returns += returns


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    cfg = parse_config(argv)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    exp_name = cfg.exp_name or time.strftime("dqn_cartpole_%Y%m%d-%H%M%S")
    logger = CSVLogger(exp_name=exp_name, log_dir=cfg.log_dir)
    logger.log_hparams(dataclasses.asdict(cfg))
    plot_path = cfg.plot_path or os.path.join(cfg.log_dir, exp_name, "dqn_cartpole.png")

    probe = gymnasium.make(cfg.env_id)
    obs_dim, n_actions = probe.observation_space.shape[0], int(probe.action_space.n)
    probe.close()
    q = qnet(obs_dim, n_actions, cfg.hidden)
    q_target = copy.deepcopy(q).requires_grad_(False)
    acting = EpsilonGreedy(copy.deepcopy(q), n_actions, cfg.eps_start)
    optim = torch.optim.Adam(q.parameters(), lr=cfg.lr)

    rb = ReplayBuffer(storage=LazyTensorStorage(cfg.buffer_size), batch_size=cfg.batch_size)
    stats = Stats(cfg.num_envs)
    # TorchRL's GymEnv with categorical actions; workers step it on their fast path (gymnasium speed)
    collector = AsyncPoolCollector(
        [functools.partial(GymEnv, cfg.env_id, categorical_action_encoding=True)] * cfg.num_envs,
        policy=acting,
        frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.total_frames,
        replay_buffer=rb,
        post_collect_hook=stats,
        seed=cfg.seed,  # env i's first reset: seed + i
        on_env_failure=cfg.on_env_failure,
        step_timeout=cfg.step_timeout or None,
    )
    pbar = tqdm.tqdm(total=cfg.total_frames, unit="frames", disable=not cfg.progress, dynamic_ncols=True)
    updates, pauses, reached_at, next_log = 0, 0, None, cfg.log_interval
    losses, qs = [], []
    t0 = time.monotonic()

    def gradient_step() -> None:
        nonlocal updates
        batch = rb.sample()
        with torch.no_grad():
            next_obs = batch["next", "observation"]
            if cfg.double_dqn:
                next_q = q_target(next_obs).gather(-1, q(next_obs).argmax(-1, keepdim=True))
            else:
                next_q = q_target(next_obs).max(-1, keepdim=True).values
            # bootstrap unless the episode terminated (a time-limit truncation still bootstraps)
            target = batch["next", "reward"] + cfg.gamma * (~batch["next", "terminated"]) * next_q
        q_taken = q(batch["observation"]).gather(-1, batch["action"].unsqueeze(-1))
        loss = nn.functional.smooth_l1_loss(q_taken, target)
        optim.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(q.parameters(), cfg.max_grad_norm)
        optim.step()
        updates += 1
        losses.append(loss.detach())
        qs.append(q_taken.detach().mean())
        if updates % cfg.target_update_interval == 0:
            with torch.no_grad():
                for p_target, p in zip(q_target.parameters(), q.parameters()):
                    p_target.lerp_(p, cfg.tau)
        if updates % cfg.actor_update_interval == 0:
            # a copy of the weights goes to the acting policy (whose Q-net is its "net" submodule)
            collector.update_policy_weights_({"net." + k: v for k, v in q.state_dict().items()})

    def log() -> tuple[int, float, int]:
        with stats.lock:
            frames = stats.frames
            recent = stats.curve_returns[-cfg.window:]
            n_episodes = len(stats.curve_returns)
        mean_ret = sum(recent) / len(recent) if recent else float("nan")
        elapsed = time.monotonic() - t0
        pool = collector.pool_metrics()
        metrics = {
            "mean_return": mean_ret, "episodes": n_episodes, "frames": frames, "fps": frames / elapsed,
            "env_fps": pool["fps"], "batch_fill_ratio": pool["batch_fill_ratio"], "updates": updates,
            "updates_per_s": updates / elapsed, "epsilon": acting.eps, "collector_pauses": pauses,
            "buffer_size": len(rb), "time_s": elapsed,
        }
        if losses:
            metrics["loss"] = torch.stack(losses).mean().item()
            metrics["q_mean"] = torch.stack(qs).mean().item()
        losses.clear()
        qs.clear()
        for k, v in metrics.items():
            logger.log_scalar(k, v, step=frames)
        collector.log_metrics(logger, step=frames)  # collector/pool/... and collector/server/...
        pbar.update(frames - pbar.n)
        pbar.set_postfix(ret=f"{mean_ret:.1f}", fps=f"{frames / elapsed:.0f}",
                         fill=f"{pool['batch_fill_ratio']:.2f}", eps=f"{acting.eps:.2f}",
                         **({"restarts": pool["env_restarts"]} if pool.get("env_restarts") else {}))
        return frames, mean_ret, len(recent)

    collector.start()
    try:
        while True:
            collector.check_errors()  # a crashed worker or a policy error stops the run here
            frames = stats.frames
            acting.eps = max(cfg.eps_end, cfg.eps_start - (cfg.eps_start - cfg.eps_end) * frames / cfg.eps_decay_frames)
            if frames >= cfg.total_frames:
                break
            due = int((frames - cfg.learning_starts) * cfg.utd) if frames >= cfg.learning_starts else 0
            if updates >= due:
                time.sleep(0.001)  # ahead of the data: wait for the collector
                continue
            if (due - updates) / cfg.utd > cfg.max_lead_frames:
                with collector.pause():  # far behind: stop the envs while the learner catches up
                    pauses += 1
                    while updates < due:
                        gradient_step()
            else:
                gradient_step()
            if updates >= next_log:
                next_log = updates + cfg.log_interval
                frames, mean_ret, n = log()
                if n == cfg.window and mean_ret >= cfg.target_return:
                    reached_at = (frames, time.monotonic() - t0)
                    break
        if reached_at is None:
            frames, mean_ret, n = log()
    finally:
        pbar.close()
        collector.shutdown()

    elapsed = time.monotonic() - t0
    frames = stats.frames
    plot_curve(stats.curve_frames, stats.curve_returns, cfg.window, cfg.target_return, plot_path,
               f"DQN {cfg.env_id} ({cfg.num_envs} envs, AsyncPoolCollector + replay buffer)")
    if reached_at is not None:
        print(f"Target {cfg.target_return:g} reached: mean return of the last {cfg.window} episodes "
              f"{mean_ret:.1f} after {reached_at[0]} frames ({updates} gradient steps) in {reached_at[1]:.1f}s.")
    else:
        print(f"Target {cfg.target_return:g} not reached: mean return of the last {cfg.window} episodes "
              f"{mean_ret:.1f} after {frames} frames ({updates} gradient steps) in {elapsed:.1f}s.")
    print(f"Frames/s {frames / elapsed:.0f}. Logs: {os.path.join(cfg.log_dir, exp_name)}  Curve: {plot_path}")
    return {"frames": frames, "time_s": elapsed, "mean_return": mean_ret, "reached": reached_at is not None,
            "log_dir": os.path.join(cfg.log_dir, exp_name), "plot_path": plot_path}


if __name__ == "__main__":
    main()
