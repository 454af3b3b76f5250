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
(bootstrapping from the value of the next observation).

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

import argparse
import copy
import dataclasses
import functools
import os
import re
import time
from collections import deque

import gymnasium
import torch
import torch.nn as nn
import tqdm
from tensordict import TensorDict
from torchrl.envs import GymEnv
from torchrl.objectives.value.functional import vtrace_advantage_estimate
from torchrl.record.loggers.csv import CSVLogger

from torchrl_asyncpool import AsyncPoolCollector


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
    seed: int = 0
    # logging
    log_dir: str = "runs"
    exp_name: str = ""                    # default: impala_cartpole_<time>
    plot_path: str = ""                   # default: <log_dir>/<exp_name>/impala_cartpole.png
    progress: bool = True


def parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def field_help() -> dict:
    """Each Config field's trailing comment (with its indented continuation lines), for --help."""
    with open(__file__) as f:  # this file's own Config block
        source = f.read().split("\nclass Config:\n", 1)[1].split("\n\n", 1)[0]
    out, last = {}, None
    for line in source.splitlines():
        field = re.match(r"    (\w+): [^=]+= .*?(?:#\s*(.*))?$", line)
        if field:
            last = field.group(1)
            out[last] = field.group(2) or ""
        elif last and re.match(r"\s{8,}#", line):  # a continuation, aligned under the comment
            out[last] += " " + line.split("#", 1)[1].strip()
        else:
            last = None
    return out


def parse_config(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    helps = field_help()
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.default == "" else f" (default: {f.default})"  # "": the comment says what it means
        text = (helps.get(f.name, "") + default).strip()
        if f.type in ("bool", bool):
            parser.add_argument(flag, type=parse_bool, default=f.default, metavar="BOOL", help=text)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type] if isinstance(f.type, str) else f.type
            parser.add_argument(flag, type=typ, default=f.default, help=text)
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
    return cfg


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
def mlp(n_in: int, n_out: int, hidden: int, out_std: float) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                        nn.Linear(hidden, n_out))
    for layer in net:
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, 2 ** 0.5)
            nn.init.zeros_(layer.bias)
    nn.init.orthogonal_(net[-1].weight, out_std)
    return net


class Agent(nn.Module):
    """Actor and critic. ``forward`` is the acting policy: ``TensorDict -> TensorDict``."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int):
        super().__init__()
        self.actor = mlp(obs_dim, n_actions, hidden, out_std=0.01)
        self.critic = mlp(obs_dim, 1, hidden, out_std=1.0)

    def forward(self, td: TensorDict) -> TensorDict:
        dist = torch.distributions.Categorical(logits=self.actor(td["observation"]))
        action = dist.sample()
        td.set("action", action)
        td.set("sample_log_prob", dist.log_prob(action))
        return td


# ----------------------------------------------------------------------------------------------
# Batch helpers
# ----------------------------------------------------------------------------------------------
def group_by_env(batch: TensorDict) -> TensorDict:
    """Stable sort by env index: each env's transitions become one contiguous, time-ordered run."""
    order = torch.sort(batch["env_index"], stable=True).indices
    return batch[order]


def segment_ends(batch: TensorDict) -> torch.Tensor:
    """``[N, 1]`` bool: the transition ends an episode or its env's run in this (grouped) batch."""
    env = batch["env_index"]
    last_of_env = torch.ones_like(env, dtype=torch.bool)
    last_of_env[:-1] = env[1:] != env[:-1]
    return batch["next", "done"] | last_of_env.unsqueeze(-1)


def normalize(adv: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit std; a batch of one (the last one, when total_frames is not a multiple of
    frames_per_batch) is only centred, as its std is undefined (NaN, which would reach the weights)."""
    if adv.numel() < 2:
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std() + 1e-8)


class EpisodeTracker:
    """Running per-env return; returns the returns of the episodes a (grouped) batch completes."""

    def __init__(self, num_envs: int):
        self.running = [0.0] * num_envs

    def update(self, batch: TensorDict) -> list[float]:
        finished = []
        rewards = batch["next", "reward"].flatten().tolist()
        dones = batch["next", "done"].flatten().tolist()
        for env, r, d in zip(batch["env_index"].tolist(), rewards, dones):
            self.running[env] += r
            if d:
                finished.append(self.running[env])
                self.running[env] = 0.0
        return finished


def plot_curve(frames: list[int], returns: list[float], window: int, target: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(frames, returns, ".", ms=3, alpha=0.4, label="episode return")
    if returns:
        r = torch.tensor(returns)
        smooth = [r[max(0, i - window + 1): i + 1].mean().item() for i in range(len(r))]
        ax.plot(frames, smooth, lw=2, label=f"mean of last {window}")
    ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xlabel("frames")
    ax.set_ylabel("return")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    agent = Agent(obs_dim, n_actions, cfg.hidden)   # the learner
    acting = copy.deepcopy(agent)                    # the actor, in the collector's policy thread
    optim = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)

    # TorchRL's GymEnv with categorical actions; workers step it on their fast path (gymnasium speed)
    collector = AsyncPoolCollector(
        [functools.partial(GymEnv, cfg.env_id, categorical_action_encoding=True)] * cfg.num_envs,
        policy=acting,
        frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.total_frames,
        seed=cfg.seed,  # env i's first reset: seed + i
        on_env_failure=cfg.on_env_failure,
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

            ends = segment_ends(batch)
            reward, terminated = batch["next", "reward"], batch["next", "terminated"]
            stats = []
            for _ in range(cfg.sgd_steps):
                dist = torch.distributions.Categorical(logits=agent.actor(batch["observation"]))
                log_pi = dist.log_prob(batch["action"]).unsqueeze(-1)
                value = agent.critic(batch["observation"])
                with torch.no_grad():
                    next_value = agent.critic(batch["next", "observation"])
                    # NB: TorchRL's argument names are swapped w.r.t. its docstring: the ratio is
                    # exp(log_pi - log_mu), so log_pi is the learner and log_mu the behaviour policy.
                    pg_adv, vs = vtrace_advantage_estimate(
                        cfg.gamma, log_pi.detach()[None], batch["sample_log_prob"].unsqueeze(-1)[None],
                        value.detach()[None], next_value[None], reward[None], ends[None], terminated[None],
                        rho_thresh=cfg.rho_bar, c_thresh=cfg.c_bar,
                    )
                    pg_adv, vs = pg_adv[0], vs[0]
                    rho = (log_pi - batch["sample_log_prob"].unsqueeze(-1)).exp()
                    if cfg.normalize_advantage:
                        pg_adv = normalize(pg_adv)
                loss_pi = -(log_pi * pg_adv).mean()
                loss_v = 0.5 * (value - vs).pow(2).mean()
                entropy = dist.entropy().mean()
                loss = loss_pi + cfg.vf_coef * loss_v - cfg.ent_coef * entropy
                optim.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
                optim.step()
                stats.append(torch.stack([loss_pi.detach(), loss_v.detach(), entropy.detach(), rho.mean(),
                                          (rho > cfg.rho_bar).float().mean()]))
            # A copy of the weights (a state dict is loaded in place), then a new policy version.
            collector.update_policy_weights_(agent.state_dict())

            # --- logging ------------------------------------------------------------------------
            elapsed = time.monotonic() - t0
            fps = frames / elapsed
            pool = collector.pool_metrics()
            mean_ret = sum(recent) / len(recent) if recent else float("nan")
            s = torch.stack(stats).mean(0).tolist()
            metrics = {
                "mean_return": mean_ret, "episodes": len(curve_returns), "frames": frames, "fps": fps,
                "env_fps": pool["fps"], "batch_fill_ratio": pool["batch_fill_ratio"],
                "policy_lag_mean": lag.mean().item(), "policy_lag_max": lag.max().item(),
                "loss_policy": s[0], "loss_value": s[1], "entropy": s[2], "rho_mean": s[3], "rho_clipped_frac": s[4],
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
