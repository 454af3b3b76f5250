"""PPO on CartPole-v1 with :class:`torchrl_asyncpool.AsyncPoolCollector` (cleanrl style, one file).

On-policy loop: ``for batch in collector:`` -> GAE per env -> a few epochs of clipped PPO ->
``collector.update_policy_weights_(...)``. The collector's ``batch_layout="env_major"`` gives
``[num_envs, T]`` batches (each row one env's consecutive transitions, left-padded), along whose
rows TorchRL's GAE runs as on ``Collector(ParallelEnv)``'s; the PPO epochs then take the real
transitions, ``batch[batch["collector", "mask"]]``. The acting policy is a separate copy of the actor
that runs in the collector's policy thread; it writes ``"action"`` and the behaviour
log-probability ``"sample_log_prob"``. The collector keeps stepping the envs while the learner
trains, so a batch may have been collected by the previous policy version: the PPO ratio is
taken against the stored behaviour log-probs, and the lag (from the stamped
``"policy_version"``) is logged.

Run::

    python sota-implementations/ppo_cartpole.py                      # defaults below
    python sota-implementations/ppo_cartpole.py --num-envs 16 --lr 5e-4 --log-dir /tmp/runs
    python sota-implementations/ppo_cartpole.py --num-envs 64 --vector-envs 32   # 2 vector envs of 32
    python sota-implementations/ppo_cartpole.py --remote-address 127.0.0.1:50051 --spawn-hosts true  # gRPC hosts
    python sota-implementations/ppo_cartpole.py --remote-address 127.0.0.1:50051 --ray-hosts 4  # hosts as Ray actors

Result on the 2-core development machine (heavily loaded by other jobs, see
``sota-implementations/README.md``): mean return of the last 20 episodes >= 475 after
37,888 frames and 16.7 s of training
(27 s wall time including start-up) in the run that produced
``docs/source/_static/ppo_cartpole.png``; 38k-52k frames and 17-30 s over five runs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import subprocess
import sys
import time
from collections import deque

import gymnasium
import torch
import torch.nn as nn
import tqdm
from torchrl.envs import GymEnv
from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
from torchrl.record.loggers.csv import CSVLogger

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.examples.actor_critic import ActorCritic
from torchrl_asyncpool.examples.batches import EpisodeTracker, normalize
from torchrl_asyncpool.examples.plots import plot_curve
from torchrl_asyncpool.examples.script_config import config_parser
from torchrl_asyncpool.remote import RemoteEnvSlot


# ----------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (``total_frames`` -> ``--total-frames``).
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    env_id: str = "CartPole-v1"
    num_envs: int = 8
    vector_envs: int = 0                  # > 0: each factory is gymnasium.make_vec(env_id, num_envs=vector_envs),
                                          # num_envs / vector_envs of them, each stepped in lockstep by one worker
    remote_address: str = ""              # "HOST:PORT": the envs run in env hosts that connect there over gRPC
                                          # (`torchrl-asyncpool env-host --address HOST:PORT --num-envs N`)
    spawn_hosts: bool = False             # with remote_address: start those hosts here, one process
    ray_hosts: int = 0                    # with remote_address: start the hosts as this many Ray actors
                                          # (num_envs / ray_hosts envs each; torchrl_asyncpool.remote.ray),
                                          # on the Ray cluster RAY_ADDRESS names, else on a local one
    frames_per_batch: int = 1024          # transitions per collector batch (= per PPO iteration)
    total_frames: int = 500_000           # hard stop
    target_return: float = 475.0          # stop early when the mean of the last `window` episodes reaches it
    window: int = 20                      # episodes in the moving mean of the return
    # PPO
    lr: float = 1e-3
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    epochs: int = 10
    minibatch_size: int = 256
    clip_eps: float = 0.2
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    on_env_failure: str = "raise"         # "restart": an env that raises is rebuilt and training goes on
                                          # (its episode ends in a truncation; docs: Failures and recovery)
    step_timeout: float = 0.0             # seconds an env step may take before its worker is killed
                                          # (then replaced with --on-env-failure restart); 0: no limit
    seed: int = 0
    # logging
    log_dir: str = "runs"
    exp_name: str = ""                    # default: ppo_cartpole_<time>
    plot_path: str = ""                   # default: <log_dir>/<exp_name>/ppo_cartpole.png
    progress: bool = True


def parse_config(argv=None) -> Config:
    parser = config_parser(Config, __file__, __doc__)  # one flag per field, its comment as help
    cfg = Config(**vars(parser.parse_args(argv)))
    # bad input: exit 2 with the flag's name (argparse's usage error) instead of a crash or a silent no-op
    for name in ("num_envs", "frames_per_batch", "total_frames", "window", "epochs", "minibatch_size", "hidden"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}.")
    for name in ("gamma", "gae_lambda"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(cfg, name)}.")
    if cfg.vector_envs < 0 or (cfg.vector_envs and cfg.num_envs % cfg.vector_envs):
        parser.error(f"--num-envs {cfg.num_envs} must be a multiple of --vector-envs {cfg.vector_envs} (> 0).")
    if cfg.vector_envs and cfg.remote_address:
        parser.error("--vector-envs builds local vector envs: it cannot be combined with --remote-address.")
    if cfg.spawn_hosts and not cfg.remote_address:
        parser.error("--spawn-hosts true needs --remote-address HOST:PORT.")
    if cfg.ray_hosts and (not cfg.remote_address or cfg.spawn_hosts or cfg.ray_hosts < 0
                          or cfg.num_envs % cfg.ray_hosts):
        parser.error(f"--ray-hosts {cfg.ray_hosts} needs --remote-address HOST:PORT, no --spawn-hosts, and a "
                     f"--num-envs ({cfg.num_envs}) it divides.")
    if cfg.on_env_failure not in ("raise", "restart"):
        parser.error(f"--on-env-failure must be 'raise' or 'restart', got {cfg.on_env_failure!r}.")
    if cfg.step_timeout < 0:
        parser.error(f"--step-timeout must be >= 0 (0: no limit), got {cfg.step_timeout}.")
    if cfg.on_env_failure == "restart" and cfg.remote_address:
        parser.error("--on-env-failure restart rebuilds local envs: not with --remote-address (hosts reconnect).")
    if cfg.step_timeout and cfg.remote_address:
        parser.error("--step-timeout kills local workers: not with --remote-address.")
    return cfg


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    cfg = parse_config(argv)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    exp_name = cfg.exp_name or time.strftime("ppo_cartpole_%Y%m%d-%H%M%S")
    logger = CSVLogger(exp_name=exp_name, log_dir=cfg.log_dir)
    logger.log_hparams(dataclasses.asdict(cfg))
    plot_path = cfg.plot_path or os.path.join(cfg.log_dir, exp_name, "ppo_cartpole.png")

    probe = gymnasium.make(cfg.env_id)
    obs_dim, n_actions = probe.observation_space.shape[0], int(probe.action_space.n)
    agent = ActorCritic(obs_dim, n_actions, cfg.hidden)
    acting = copy.deepcopy(agent)  # runs in the collector's policy thread
    optim = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)

    # TorchRL's GymEnv, categorical actions (the policy samples an index); workers step it on
    # their fast path, at the speed of the gymnasium env inside (torchrl_asyncpool.envs.torchrl_fast).
    # --vector-envs keeps gymnasium.make_vec: CartPole's natively vectorized env steps 32 envs in
    # one numpy call, where GymEnv(num_envs=k) steps k CartPoles one by one.
    if cfg.vector_envs:  # a batched simulator: one factory builds vector_envs envs
        factories = [functools.partial(gymnasium.make_vec, cfg.env_id, num_envs=cfg.vector_envs)]
        factories *= cfg.num_envs // cfg.vector_envs
    elif cfg.remote_address:  # slots fed by env hosts anywhere (torchrl_asyncpool.remote)
        factories = [functools.partial(RemoteEnvSlot, cfg.remote_address, probe.observation_space,
                                       probe.action_space)] * cfg.num_envs
    else:
        factories = [functools.partial(GymEnv, cfg.env_id, categorical_action_encoding=True)] * cfg.num_envs
    hosts = ray_hosts = None
    if cfg.spawn_hosts:
        hosts = subprocess.Popen([sys.executable, "-m", "torchrl_asyncpool.cli", "env-host", "--env-id", cfg.env_id,
                                  "--num-envs", str(cfg.num_envs), "--address", cfg.remote_address, "--no-progress"])
    if cfg.ray_hosts:  # protocol-1 hosts (RemoteEnvSlot slots above) in Ray actors, restarted by Ray if they die
        import ray

        from torchrl_asyncpool.remote.ray import RayEnvHosts

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        ray_hosts = RayEnvHosts(functools.partial(gymnasium.make, cfg.env_id), [cfg.remote_address] * cfg.ray_hosts,
                                protocol=1, envs_per_host=cfg.num_envs // cfg.ray_hosts, num_cpus=0).start()
    try:
        collector = AsyncPoolCollector(
            factories,
            policy=acting,
            frames_per_batch=cfg.frames_per_batch,
            total_frames=cfg.total_frames,
            seed=None if cfg.remote_address else cfg.seed,  # env i's first reset: seed + i (hosts seed their own)
            on_env_failure=cfg.on_env_failure,
            step_timeout=cfg.step_timeout or None,
            batch_layout="env_major",  # [num_envs, T]: GAE along each env's row
        )
    except BaseException:
        if hosts is not None:  # no pool for them: do not leave them waiting for one
            hosts.kill()
        if ray_hosts is not None:
            ray_hosts.stop()
        raise
    tracker = EpisodeTracker(cfg.num_envs)
    recent = deque(maxlen=cfg.window)
    curve_frames, curve_returns = [], []
    frames, reached_at = 0, None
    pbar = tqdm.tqdm(total=cfg.total_frames, unit="frames", disable=not cfg.progress, dynamic_ncols=True)
    t0 = time.monotonic()
    try:
        for it, batch in enumerate(collector):
            # --- GAE along each env's row (episode ends cut the recursion; the padding before a
            # row's first real step never reaches a real one) -------------------------------------
            with torch.no_grad():
                value = agent.critic(batch["observation"])
                next_value = agent.critic(batch["next", "observation"])
                adv, value_target = vec_generalized_advantage_estimate(
                    cfg.gamma, cfg.gae_lambda, value, next_value, batch["next", "reward"],
                    batch["next", "done"], batch["next", "terminated"], time_dim=-2,
                )
            batch["advantage"], batch["value_target"] = adv, value_target
            batch = batch[batch["collector", "mask"]]  # the real transitions, env by env, in time order
            frames += batch.numel()
            new_returns = tracker.update(batch)
            recent.extend(new_returns)
            curve_frames += [frames] * len(new_returns)
            curve_returns += new_returns
            lag = (collector.policy_version - batch["policy_version"]).float().mean().item()

            if cfg.anneal_lr:  # linear to 0 over total_frames, from the frames before this batch (cleanrl)
                optim.param_groups[0]["lr"] = cfg.lr * (1.0 - (frames - batch.numel()) / cfg.total_frames)

            # --- PPO epochs ---------------------------------------------------------------------
            stats = []
            for _ in range(cfg.epochs):
                for idx in torch.randperm(batch.numel()).split(cfg.minibatch_size):
                    mb = batch[idx]
                    dist = torch.distributions.Categorical(logits=agent.actor(mb["observation"]))
                    log_prob = dist.log_prob(mb["action"])
                    ratio = (log_prob - mb["sample_log_prob"]).exp()
                    a = normalize(mb["advantage"].squeeze(-1))
                    loss_pi = -torch.min(ratio * a, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a).mean()
                    loss_v = 0.5 * (agent.critic(mb["observation"]) - mb["value_target"]).pow(2).mean()
                    entropy = dist.entropy().mean()
                    loss = loss_pi + cfg.vf_coef * loss_v - cfg.ent_coef * entropy
                    optim.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
                    optim.step()
                    with torch.no_grad():
                        log_ratio = log_prob - mb["sample_log_prob"]
                        stats.append(torch.stack([
                            loss_pi, loss_v, entropy, ((ratio - 1) - log_ratio).mean(),
                            ((ratio - 1).abs() > cfg.clip_eps).float().mean(),
                        ]))
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
                "env_fps": pool["fps"], "batch_fill_ratio": pool["batch_fill_ratio"], "policy_lag": lag,
                "loss_policy": s[0], "loss_value": s[1], "entropy": s[2], "approx_kl": s[3], "clip_fraction": s[4],
                "lr": optim.param_groups[0]["lr"], "time_s": elapsed,
            }
            if new_returns:
                metrics["batch_return"] = sum(new_returns) / len(new_returns)
            for k, v in metrics.items():
                logger.log_scalar(k, v, step=frames)
            collector.log_metrics(logger, step=frames)  # collector/pool/... and collector/server/...
            pbar.update(batch.numel())
            pbar.set_postfix(ret=f"{mean_ret:.1f}", fps=f"{fps:.0f}", fill=f"{pool['batch_fill_ratio']:.2f}",
                             lag=f"{lag:.1f}",
                             **({"restarts": pool["env_restarts"]} if pool.get("env_restarts") else {}))
            if len(recent) == cfg.window and mean_ret >= cfg.target_return:
                reached_at = (frames, elapsed)
                break
    finally:
        pbar.close()
        collector.shutdown()
        if hosts is not None:  # the pool is gone: the hosts' streams end and they exit
            try:
                hosts.wait(10)
            except subprocess.TimeoutExpired:
                hosts.kill()
        if ray_hosts is not None:  # they would serve the next pool on the address: end the actors
            ray_hosts.stop()

    elapsed = time.monotonic() - t0
    plot_curve(curve_frames, curve_returns, cfg.window, cfg.target_return, plot_path,
               f"PPO {cfg.env_id} ({cfg.num_envs} envs, AsyncPoolCollector)")
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
