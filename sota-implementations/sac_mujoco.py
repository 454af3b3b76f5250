"""SAC on HalfCheetah-v5 (MuJoCo) with :class:`torchrl_asyncpool.AsyncPoolCollector` filling a replay buffer.

Off-policy loop: ``collector.start()`` collects in a background thread and writes every batch
to a TorchRL ``TensorDictReplayBuffer`` (the collector's ``replay_buffer=`` argument), while the
learner samples minibatches of 256 from it and takes SAC steps (TorchRL's ``SACLoss``: two Q
networks, target Q networks by Polyak averaging (0.995), learned temperature, 256x256 ReLU
networks, ``TanhNormal`` actor; TorchRL's ``sota-implementations/sac`` defaults: lr 3e-4,
25,000 random frames first, 1M frames, 1M-transition buffer).

The learner keeps the update-to-data ratio at ``utd`` gradient steps per collected frame
(after ``init_random_frames``), so the result does not depend on the machine's speed: it waits
when it is ahead of the data (``learner_wait_share``: the share of wall-clock time spent
waiting), and pauses the collector (``with collector.pause():``) when it falls more than
``max_lead_frames`` behind (``collector_idle_share``: the share of wall-clock time the
collector was paused). The acting policy is a copy of the actor served by the collector's
policy thread, acting uniformly at random until ``init_random_frames`` (as TorchRL's
``init_random_frames``) and refreshed every ``actor_update_interval`` gradient steps.

``--collector torchrl`` interleaves TorchRL's ``Collector(ParallelEnv(8, ...))`` batches of
1,000 frames and ``1000 * utd`` updates, as TorchRL's ``sac.py`` does: there the learner waits
while the envs step (``learner_wait_share``: the collection time) and the envs wait while the
learner trains (``collector_idle_share``: the training time).

Collecting and learning in turns (``max_lead_frames=0``, the default) on a CPU: at ``utd=1`` a
SAC gradient step (batch 256, 256x256 networks, two Q networks) costs 11-13 ms on 2 vCPUs of an
AMD EPYC host (~50 ms on one core of a slower 2-core host), while this collector delivers a frame
in ~0.1 ms, so the learner decides the wall-clock. Collecting while the learner trains
did not pay on the slower host: the envs and the policy thread then took the learner's second core
and, the policy thread living in the learner's process, its interpreter lock, and the gradient
steps slowed from ~50 to ~62 ms, which lost more than the collection time it hid. So the collector runs only while the
learner has no update due (a 1,000-frame batch, a fraction of a second), and is paused while the
learner trains with every core (``learner_threads=0``: one torch thread per CPU the process may
use; the env workers and the paused policy thread then sleep). Where the learner runs on a GPU,
``--max-lead-frames N`` lets collection overlap training: the collector is paused only when the
learner falls ``N`` frames behind. ``--collector torchrl`` uses the same learner threads.

Run::

    python sota-implementations/sac_mujoco.py                          # 8 envs, utd 1, 1M frames
    python sota-implementations/sac_mujoco.py --collector torchrl      # TorchRL's Collector(ParallelEnv(8))
    python sota-implementations/sac_mujoco.py --total-frames 50000 --init-random-frames 5000 --log-dir /tmp/runs
    python sota-implementations/sac_mujoco.py --remote-address 127.0.0.1:50051 --ray-hosts 4  # envs in Ray actors

What was measured (commit ``6b223b7``, 2026-12-05, 2 vCPUs of an AMD EPYC host, no GPU, nothing
else running; tables in ``benchmarks/README.md``): 10,000 frames of which 2,000 random, seed 0, the
two collectors alternated, two runs each: 91-109 s for 8,000 updates with this collector (the
learner waiting 1 % of the time) against 117-128 s for 9,000 with ``--collector torchrl`` (TorchRL's
recipe also trains after the batch that reaches the random frames; the learner waiting 11 %): 0.88x
and 0.96x its wall-clock per update, the gradient step itself the same (11-13 ms) beside either. To
a mean return of 3,000 (2026-12-05, ``benchmarks/results_training_sac.json``): 81,000 frames and
671 s with seed 0, 65,000 and 490 s with seed 1, 65,000 and 550 s with seed 2, against 64,000 / 540
s, 80,000 / 798 s and 64,000 / 543 s with ``--collector torchrl`` (median 1.01x its time).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import threading
import time

import torch
import torch.nn as nn
import tqdm
from tensordict import TensorDict
from tensordict.nn import InteractionType, NormalParamExtractor, TensorDictModule
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate
from torchrl.record.loggers.csv import CSVLogger

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.examples.batches import EpisodeTracker
from torchrl_asyncpool.examples.eval_return import mean_eval_return
from torchrl_asyncpool.examples.envs import make_mujoco_env, make_torchrl_mujoco_env
from torchrl_asyncpool.examples.learner_process import prepare_learner_process
from torchrl_asyncpool.examples.plots import plot_curve
from torchrl_asyncpool.examples.ray_env_hosts import check_ray_flags, start_ray_env_hosts
from torchrl_asyncpool.examples.script_config import config_parser


# ----------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (``total_frames`` -> ``--total-frames``).
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    env_id: str = "HalfCheetah-v5"
    collector: str = "asyncpool"          # "asyncpool" (AsyncPoolCollector.start()) or "torchrl"
                                          # (TorchRL's Collector(ParallelEnv), batches and updates interleaved)
    num_envs: int = 8
    frames_per_batch: int = 1000          # transitions per replay-buffer write
    total_frames: int = 1_000_000
    init_random_frames: int = 25_000      # uniformly random actions, no update, until then
    target_return: float = 3000.0         # drawn on the plot; the frames at which the mean of the last `window`
                                          # episodes reaches it are reported
    stop_at_target: bool = False          # end training (then evaluate) once the mean return reaches the target
    window: int = 10                      # episodes in the moving mean of the return
    # SAC (TorchRL's sota-implementations/sac/config.yaml)
    buffer_size: int = 1_000_000
    batch_size: int = 256
    utd: float = 1.0                      # gradient steps per collected frame (after init_random_frames)
    max_lead_frames: int = 0              # asyncpool: the collector pauses when the learner falls this many frames
                                          # behind; 0: whenever updates are due (collect and learn in turns)
    learner_threads: int = 0              # torch threads of the learner; 0: one per CPU this process may use
    actor_update_interval: int = 25       # asyncpool: gradient steps between acting-policy weight pushes
    lr: float = 3e-4
    gamma: float = 0.99
    polyak: float = 0.995                 # target <- polyak * target + (1 - polyak) * online
    alpha_init: float = 1.0
    hidden: int = 256
    # evaluation at the end (torchrl_asyncpool.evaluation.evaluate, deterministic actions)
    eval_episodes: int = 5
    eval_max_steps: int = 1000            # steps after which an evaluation episode is cut
    on_env_failure: str = "raise"         # asyncpool: "restart": an env that raises is rebuilt and training goes on
    step_timeout: float = 0.0             # asyncpool: seconds an env step may take before its worker is killed
    remote_address: str = ""              # asyncpool: "HOST:PORT": the envs run in env hosts that connect there
    ray_hosts: int = 0                    # with remote_address: start the hosts as this many Ray actors
                                          # (num_envs / ray_hosts envs each), on RAY_ADDRESS's cluster or a local one
    seed: int = 0
    # logging
    log_interval: int = 1000              # frames between log lines (and the progress bar's updates)
    log_dir: str = "runs"
    exp_name: str = ""                    # default: sac_mujoco_<collector>_<time>
    plot_path: str = ""                   # default: <log_dir>/<exp_name>/sac_mujoco.png
    progress: bool = True


def parse_config(argv=None) -> Config:
    parser = config_parser(Config, __file__, __doc__)  # one flag per field, its comment as help
    cfg = Config(**vars(parser.parse_args(argv)))
    for name in ("num_envs", "frames_per_batch", "total_frames", "window", "buffer_size", "batch_size",
                 "actor_update_interval", "hidden", "log_interval"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}.")
    for name in ("max_lead_frames", "learner_threads"):
        if getattr(cfg, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}.")
    if not 0.0 <= cfg.gamma <= 1.0 or not 0.0 <= cfg.polyak < 1.0:
        parser.error("--gamma must be in [0, 1] and --polyak in [0, 1).")
    if cfg.utd <= 0 or cfg.init_random_frames < 0:
        parser.error("--utd must be > 0 and --init-random-frames >= 0.")
    if cfg.collector not in ("asyncpool", "torchrl"):
        parser.error(f"--collector must be 'asyncpool' or 'torchrl', got {cfg.collector!r}.")
    if cfg.collector == "torchrl" and (cfg.frames_per_batch % cfg.num_envs or cfg.on_env_failure != "raise"
                                       or cfg.step_timeout):
        parser.error("--collector torchrl: --frames-per-batch must be a multiple of --num-envs; "
                     "--on-env-failure and --step-timeout are AsyncPoolCollector options.")
    if cfg.on_env_failure not in ("raise", "restart"):
        parser.error(f"--on-env-failure must be 'raise' or 'restart', got {cfg.on_env_failure!r}.")
    if cfg.step_timeout < 0:
        parser.error(f"--step-timeout must be >= 0 (0: no limit), got {cfg.step_timeout}.")
    check_ray_flags(parser, cfg)  # --remote-address / --ray-hosts
    if cfg.eval_episodes < 0 or cfg.eval_max_steps < 1:
        parser.error("--eval-episodes must be >= 0 and --eval-max-steps >= 1.")
    return cfg


# ----------------------------------------------------------------------------------------------
# Model (TorchRL's sac/utils.py)
# ----------------------------------------------------------------------------------------------
def make_sac_models(obs_dim: int, action_spec, hidden: int):
    n_act = action_spec.shape[-1]
    actor_net = nn.Sequential(
        MLP(in_features=obs_dim, out_features=2 * n_act, num_cells=[hidden, hidden], activation_class=nn.ReLU),
        NormalParamExtractor(scale_mapping="biased_softplus_1.0", scale_lb=0.1),
    )
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], spec=action_spec, distribution_class=TanhNormal,
        distribution_kwargs={"low": action_spec.space.low, "high": action_spec.space.high, "tanh_loc": False},
        default_interaction_type=InteractionType.RANDOM, return_log_prob=False,
    )
    qvalue = ValueOperator(MLP(in_features=obs_dim + n_act, out_features=1, num_cells=[hidden, hidden],
                               activation_class=nn.ReLU), in_keys=["action", "observation"])
    return actor, qvalue


class SACActing(nn.Module):
    """The acting policy (``TensorDict -> TensorDict``, writes ``"action"`` only): uniform in the
    action box while ``random`` (the learner clears it after ``init_random_frames``), else a sample
    of the actor."""

    def __init__(self, actor: nn.Module, low: torch.Tensor, high: torch.Tensor):
        super().__init__()
        self.actor = actor
        self.low, self.high = low.clone(), high.clone()  # not buffers: the weights pushed are the actor's
        self.random = True  # a flag the learner overwrites; read by the collector's policy thread

    def forward(self, td: TensorDict) -> TensorDict:
        if self.random:
            u = torch.rand(*td.batch_size, *self.low.shape)
            return td.set("action", self.low + (self.high - self.low) * u)
        return td.set("action", self.actor(td.select("observation"))["action"])


class Stats:
    """What the collection reports to the learner (written in the collector's thread)."""

    def __init__(self, num_envs: int):
        self.lock = threading.Lock()
        self.frames = 0
        self.tracker = EpisodeTracker(num_envs)
        self.curve_frames: list[int] = []
        self.curve_returns: list[float] = []

    def __call__(self, batch: TensorDict) -> None:  # AsyncPoolCollector's post_collect_hook
        returns = self.tracker.update(batch)
        with self.lock:
            self.frames += batch.numel()
            self.curve_frames += [self.frames] * len(returns)
            self.curve_returns += returns


# ----------------------------------------------------------------------------------------------
# The learner, the two collection loops, the evaluation
# ----------------------------------------------------------------------------------------------
class Learner:
    """SAC's gradient steps (TorchRL's ``SACLoss``, three Adam optimizers, Polyak target updates)
    on minibatches of ``rb``, and the run's counters and log line.

    ``updates``: gradient steps so far; ``wait_s``: seconds the learner waited for data;
    ``idle_s``: seconds the collector was paused (or, with TorchRL's collector, waited for the
    learner); ``pauses``: how many times it was paused.
    """

    def __init__(self, cfg: Config, actor, qvalue, rb, stats: Stats, logger, pbar):
        self.cfg, self.rb, self.stats, self.logger, self.pbar = cfg, rb, stats, logger, pbar
        self.loss_module = SACLoss(actor_network=actor, qvalue_network=qvalue, num_qvalue_nets=2,
                                   loss_function="l2", delay_actor=False, delay_qvalue=True,
                                   alpha_init=cfg.alpha_init)
        self.loss_module.make_value_estimator(gamma=cfg.gamma)
        self.target_updater = SoftUpdate(self.loss_module, eps=cfg.polyak)
        self.optims = (
            torch.optim.Adam(self.loss_module.actor_network_params.flatten_keys().values(), lr=cfg.lr),
            torch.optim.Adam(self.loss_module.qvalue_network_params.flatten_keys().values(), lr=cfg.lr),
            torch.optim.Adam([self.loss_module.log_alpha], lr=3e-4),
        )
        self.updates, self.wait_s, self.idle_s, self.pauses = 0, 0.0, 0.0, 0
        self.losses = []

    def step(self) -> None:
        """One gradient step on a minibatch sampled from the replay buffer."""
        loss = self.loss_module(self.rb.sample())
        total = loss["loss_actor"] + loss["loss_qvalue"] + loss["loss_alpha"]
        for opt in self.optims:
            opt.zero_grad()
        total.backward()
        for opt in self.optims:
            opt.step()
        self.target_updater.step()
        self.updates += 1
        self.losses.append(torch.stack([loss[k].detach() for k in _LOSS_KEYS]))

    def log(self, t0: float, collector=None) -> tuple[int, bool]:
        """Logs one line; returns the frames and whether ``stop_at_target`` ends the run here."""
        cfg, stats = self.cfg, self.stats
        with stats.lock:
            frames = stats.frames
            recent = stats.curve_returns[-cfg.window:]
            n_episodes = len(stats.curve_returns)
        mean_ret = sum(recent) / len(recent) if recent else float("nan")
        elapsed = time.monotonic() - t0
        updates, wait, idle = self.updates, self.wait_s / elapsed, self.idle_s / elapsed
        metrics = {
            "mean_return": mean_ret, "episodes": n_episodes, "frames": frames, "fps": frames / elapsed,
            "updates": updates, "updates_per_s": updates / elapsed, "utd_measured": updates / max(1, frames),
            "learner_wait_share": wait, "collector_idle_share": idle, "collector_pauses": self.pauses,
            "buffer_size": len(self.rb), "time_s": elapsed,
        }
        if self.losses:
            metrics.update(zip(_LOSS_KEYS, torch.stack(self.losses).mean(0).tolist()))
            self.losses.clear()
        for k, v in metrics.items():
            self.logger.log_scalar(k, v, step=frames)
        if isinstance(collector, AsyncPoolCollector):
            collector.log_metrics(self.logger, step=frames)  # collector/pool/... and collector/server/...
        self.pbar.update(frames - self.pbar.n)
        self.pbar.set_postfix(ret=f"{mean_ret:.0f}", fps=f"{frames / elapsed:.0f}", ups=f"{updates / elapsed:.0f}",
                              wait=f"{wait:.2f}", idle=f"{idle:.2f}")
        return frames, cfg.stop_at_target and len(recent) == cfg.window and mean_ret >= cfg.target_return


#: the SACLoss entries averaged into each log line
_LOSS_KEYS = ("loss_actor", "loss_qvalue", "loss_alpha", "alpha", "entropy")


def train_torchrl(cfg: Config, learner: Learner, actor, learner_threads: int) -> float:
    """TorchRL's ``sac.py`` loop: ``Collector(ParallelEnv)`` batches and ``batch * utd`` gradient
    steps in turns. Returns the start time."""
    from torchrl.collectors import Collector
    from torchrl.envs import EnvCreator, ParallelEnv

    env = ParallelEnv(cfg.num_envs, EnvCreator(functools.partial(make_torchrl_mujoco_env, cfg.env_id)))
    collector = Collector(env, actor, frames_per_batch=cfg.frames_per_batch, total_frames=cfg.total_frames,
                          init_random_frames=cfg.init_random_frames, auto_register_policy_transforms=False)
    collector.set_seed(cfg.seed)
    t0 = time.monotonic()
    batches = iter(collector)
    try:
        while True:
            t_wait = time.monotonic()
            batch = next(batches, None)  # the learner waits while the envs step
            learner.wait_s += time.monotonic() - t_wait
            if batch is None:
                break
            if torch.get_num_threads() != learner_threads:
                # ParallelEnv sets its process to max(1, threads - workers) when its workers start:
                # the learner gets the threads it has under this package's collector
                torch.set_num_threads(learner_threads)
            t_train = time.monotonic()  # the envs wait while the learner trains
            n = batch.numel()
            batch = batch.reshape(-1)  # [num_envs, T] -> env by env
            batch["env_index"] = torch.arange(cfg.num_envs).repeat_interleave(n // cfg.num_envs)
            learner.stats(batch)
            learner.rb.extend(batch)
            if learner.stats.frames >= cfg.init_random_frames:
                for _ in range(int(n * cfg.utd)):
                    learner.step()
            collector.update_policy_weights_()  # the collector holds `actor` itself
            learner.idle_s += time.monotonic() - t_train
            if learner.log(t0, collector)[1]:
                break
    finally:
        collector.shutdown()
    return t0


def train_asyncpool(cfg: Config, learner: Learner, actor, action_spec) -> float:
    """``collector.start()`` fills the replay buffer in the background; the learner holds the
    update-to-data ratio, waiting when ahead of the data and pausing the collector when more than
    ``max_lead_frames`` behind (see the module docstring). Returns the start time."""
    acting = SACActing(copy.deepcopy(actor), action_spec.space.low, action_spec.space.high)
    factories = [functools.partial(make_mujoco_env, cfg.env_id)] * cfg.num_envs
    ray_hosts = None
    if cfg.remote_address:  # slots fed by env hosts in Ray actors (torchrl_asyncpool.remote)
        factories, ray_hosts = start_ray_env_hosts(functools.partial(make_mujoco_env, cfg.env_id),
                                                   cfg.remote_address, cfg.num_envs, cfg.ray_hosts)
    try:
        collector = AsyncPoolCollector(
            factories,
            policy=acting,
            frames_per_batch=cfg.frames_per_batch,
            total_frames=cfg.total_frames,
            replay_buffer=learner.rb,
            post_collect_hook=learner.stats,
            seed=None if cfg.remote_address else cfg.seed,  # env i's first reset: seed + i (hosts seed their own)
            on_env_failure=cfg.on_env_failure,
            step_timeout=cfg.step_timeout or None,
        )
    except BaseException:
        if ray_hosts is not None:
            ray_hosts.stop()
        raise

    def push_weights() -> None:  # a copy of the actor's weights to the acting policy's "actor" submodule
        collector.update_policy_weights_({"actor." + k: v for k, v in actor.state_dict().items()})

    next_log = cfg.log_interval
    t0 = time.monotonic()
    collector.start()
    try:
        while True:
            collector.check_errors()  # a crashed worker or a policy error stops the run here
            frames = learner.stats.frames
            if acting.random and frames >= cfg.init_random_frames:
                acting.random = False
            due = int((frames - cfg.init_random_frames) * cfg.utd) if frames >= cfg.init_random_frames else 0
            if frames >= next_log:
                next_log = frames + cfg.log_interval
                if learner.log(t0, collector)[1]:
                    break
            if learner.updates >= due:
                if frames >= cfg.total_frames:
                    break
                t_wait = time.monotonic()
                time.sleep(0.001)  # ahead of the data: wait for the collector
                learner.wait_s += time.monotonic() - t_wait
                continue
            if (due - learner.updates) / cfg.utd > cfg.max_lead_frames:  # (>= 1 update due when max_lead_frames=0)
                t_pause = time.monotonic()
                with collector.pause():  # behind: stop the envs while the learner catches up
                    learner.pauses += 1
                    while learner.updates < due:
                        learner.step()
                        if learner.updates % cfg.actor_update_interval == 0:
                            push_weights()
                learner.idle_s += time.monotonic() - t_pause
            else:
                learner.step()
            if learner.updates % cfg.actor_update_interval == 0:
                push_weights()
    finally:
        collector.shutdown()
        if ray_hosts is not None:
            ray_hosts.stop()
    return t0


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    cfg = parse_config(argv)
    learner_threads = cfg.learner_threads or len(os.sched_getaffinity(0))
    prepare_learner_process(learner_threads)  # the same learner process with either collector
    torch.manual_seed(cfg.seed)
    exp_name = cfg.exp_name or time.strftime(f"sac_mujoco_{cfg.collector}_%Y%m%d-%H%M%S")
    logger = CSVLogger(exp_name=exp_name, log_dir=cfg.log_dir)
    logger.log_hparams(dataclasses.asdict(cfg))
    plot_path = cfg.plot_path or os.path.join(cfg.log_dir, exp_name, "sac_mujoco.png")

    probe = make_torchrl_mujoco_env(cfg.env_id)
    obs_dim = probe.observation_spec["observation"].shape[-1]
    action_spec = probe.full_action_spec_unbatched["action"]
    probe.close()
    actor, qvalue = make_sac_models(obs_dim, action_spec, cfg.hidden)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(cfg.buffer_size), batch_size=cfg.batch_size)
    stats = Stats(cfg.num_envs)
    pbar = tqdm.tqdm(total=cfg.total_frames, unit="frames", disable=not cfg.progress, dynamic_ncols=True)
    learner = Learner(cfg, actor, qvalue, rb, stats, logger, pbar)
    try:
        if cfg.collector == "torchrl":
            t0 = train_torchrl(cfg, learner, actor, learner_threads)
        else:
            t0 = train_asyncpool(cfg, learner, actor, action_spec)
    finally:
        pbar.close()
    frames, _ = learner.log(t0)  # the last line: the frames and updates at the end
    elapsed = time.monotonic() - t0
    updates, wait_s, idle_s = learner.updates, learner.wait_s, learner.idle_s
    recent = stats.curve_returns[-cfg.window:]
    mean_ret = sum(recent) / len(recent) if recent else float("nan")
    reached_at = None
    for i in range(cfg.window - 1, len(stats.curve_returns)):
        if sum(stats.curve_returns[i - cfg.window + 1: i + 1]) / cfg.window >= cfg.target_return:
            reached_at = stats.curve_frames[i]
            break

    eval_return = float("nan")
    if cfg.eval_episodes:
        eval_return = mean_eval_return(functools.partial(make_mujoco_env, cfg.env_id), actor,
                                       episodes=cfg.eval_episodes, seed=cfg.seed, max_steps=cfg.eval_max_steps)
        logger.log_scalar("eval_return", eval_return, step=frames)

    plot_curve(stats.curve_frames, stats.curve_returns, cfg.window, cfg.target_return, plot_path,
               f"SAC {cfg.env_id} ({cfg.num_envs} envs, {cfg.collector}, utd {cfg.utd:g})")
    if reached_at is not None:
        print(f"Mean return of {cfg.window} episodes reached {cfg.target_return:g} after {reached_at} frames.")
    print(f"{frames} frames, {updates} updates in {elapsed:.1f}s: {frames / elapsed:.0f} frames/s, "
          f"{updates / elapsed:.1f} updates/s; learner waited {100 * wait_s / elapsed:.0f}% of the time, collector "
          f"idle {100 * idle_s / elapsed:.0f}% ({learner.pauses} pauses); mean return of the last {len(recent)} "
          f"episodes {mean_ret:.1f}, evaluation {eval_return:.1f}.")
    print(f"Logs: {os.path.join(cfg.log_dir, exp_name)}  Curve: {plot_path}")
    return {"frames": frames, "updates": updates, "time_s": elapsed, "fps": frames / elapsed,
            "learner_wait_share": wait_s / elapsed, "collector_idle_share": idle_s / elapsed,
            "mean_return": mean_ret, "eval_return": eval_return, "reached_at": reached_at,
            "log_dir": os.path.join(cfg.log_dir, exp_name), "plot_path": plot_path}


if __name__ == "__main__":
    main()
