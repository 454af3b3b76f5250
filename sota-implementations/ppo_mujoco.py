"""PPO on HalfCheetah-v5 (MuJoCo) with :class:`torchrl_asyncpool.AsyncPoolCollector` (cleanrl style, one file).

On-policy loop, as TorchRL's ``sota-implementations/ppo/ppo_mujoco.py``: ``for batch in
collector:`` -> GAE -> ``epochs`` x (``frames_per_batch / minibatch_size``) steps of TorchRL's
``ClipPPOLoss`` -> ``collector.update_policy_weights_(...)``. The policy is a TorchRL
``ProbabilisticActor`` with a ``TanhNormal`` (state-independent scale), the critic a
``ValueOperator``, both 64x64 tanh MLPs with TorchRL's recipe initialisation and
hyper-parameters (lr 3e-4 annealed, 2048 frames per batch, 10 epochs of minibatches of 64,
clip 0.2, critic coefficient 0.25, no entropy bonus, advantages normalised per minibatch).

The collector is built with ``batch_layout="env_major"``: every batch is ``[16, T]``, one row per
env (its consecutive transitions, left-padded, ``("collector", "mask")`` marking the 2048 real
ones), the layout of TorchRL's ``Collector(ParallelEnv)``, so TorchRL's ``GAE`` runs on the batch
as it comes, as in TorchRL's recipe, and advantages never leak from one env into another; only
``terminated`` stops the bootstrap (the 1000-step time limit does not). The minibatches are then
drawn from ``batch[batch["collector", "mask"]]``.

Deviation from TorchRL's recipe: observations are normalised by running statistics that live in
the model (:class:`~torchrl_asyncpool.examples.obs_norm.RunningObsNorm`, shared by the actor and
the critic, updated by the learner from each batch after its PPO epochs and shipped to the acting
copy with the weights) instead of a ``VecNorm`` transform inside one env, so that 16 envs in
worker processes share one set of statistics; the stored observations are raw, which keeps the
PPO ratio exact when the statistics move. The collector acts with :class:`TanhNormalActing`: the
actor's own network and ``TanhNormal`` draw written in plain torch (the same action for the same
random state, and the log-prob ``ClipPPOLoss`` recomputes for it), ~0.7 ms per call against
~1.6-2.0 ms for the ``ProbabilisticActor``, whose distribution objects cost more than its 64x64
MLP; ``--acting actor`` acts with the ``ProbabilisticActor`` itself. Both collectors act with
the same module. Our collector serves a copy in its policy thread; a batch may hold actions of
the previous policy version (those taken before the collector paused, or all of them with
``--collect-while-training true``): the ratio is taken against the stored behaviour log-probs
(``"action_log_prob"``), and the lag is logged.

The loss is ``torch.compile``-d (:class:`CompiledLoss`, ``--compile false`` for the eager one):
a minibatch step of TorchRL's ``ClipPPOLoss`` on these small networks is mostly Python, and
compiled it takes ~3.7 ms instead of ~6.8 ms here, for 15-45 s of compiling at the first
minibatch; both collectors train with it.

``--collector torchrl`` runs the same learner on TorchRL's own ``Collector(ParallelEnv(16,
...))`` (synchronous: the envs wait while the learner trains, and the learner waits while they
step); its ``[16, 128]`` batches go through the same GAE call and are flattened env by env.

Threads: ``torch.set_num_threads(1)`` in the learner; the collector's policy thread uses one
thread too (``policy_num_threads=1``, its default); the env workers are processes.

By default the collector is paused (``with collector.pause():``) from the moment a batch arrives
until the end of its epochs (the advantages and the updates), and the new weights reach it before
it resumes: a batch then comes almost entirely from the current policy
(mean policy lag ~0.3 versions), and the learner has the cores to itself while it trains; it waits
for each batch ~27 % of its time (~0.45 s of collection against ~1.2 s of updates per batch).
``--collect-while-training true`` lets the collector gather the next batch during the epochs
instead: the learner barely waits, but each batch is about one policy version behind. On 2 cores
the two schedules ran at the same speed within noise (100k frames,
seed 0, ABBA on 2026-12-04: 573 and 600 frames/s collecting while training, 603 and 609 in turns),
and with seed 1 only the paused schedule reached 1,500 (below), hence the default.

Run::

    python sota-implementations/ppo_mujoco.py                       # 16 envs, 1M frames
    python sota-implementations/ppo_mujoco.py --collector torchrl   # TorchRL's Collector(ParallelEnv(16))
    python sota-implementations/ppo_mujoco.py --total-frames 200000 --stop-at-target true --log-dir /tmp/runs
    python sota-implementations/ppo_mujoco.py --remote-address 127.0.0.1:50051 --ray-hosts 4  # envs in Ray actors

What was measured (2 vCPUs of an AMD EPYC host, no GPU, one run after another; commit, date and
curves in ``sota-implementations/README.md`` and ``benchmarks/README.md``), mean training return of
1,500, commit ``83d10b7``, 2026-12-05: seed 0 after 305,152 frames and 76 s (TorchRL's
``Collector(ParallelEnv(16))``: 401,408 frames and 265 s), seed 1 after 753,664 frames and 157 s
(TorchRL's: 1,489 after 1M frames and 637 s); 2.6-3.0x TorchRL's frames/s. Again at commit
``6b223b7`` (the collector's threads no longer slow the learner's): 66 s and 110 s. Collecting while
training (an earlier version of this script, on a slower host), seed 1 stayed below 1,500 in two
runs of 1M frames (best 1,432 and 1,409).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import time
import warnings
from collections import deque

import torch
import tqdm
from tensordict.nn import AddStateIndependentNormalScale, TensorDictModule
from torchrl.envs import ExplorationType
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE
from torchrl.record.loggers.csv import CSVLogger

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.examples.batches import EpisodeTracker
from torchrl_asyncpool.examples.eval_return import mean_eval_return
from torchrl_asyncpool.examples.envs import make_mujoco_env, make_torchrl_mujoco_env
from torchrl_asyncpool.examples.learner_process import prepare_learner_process
from torchrl_asyncpool.examples.obs_norm import RunningObsNorm
from torchrl_asyncpool.examples.plots import plot_curve
from torchrl_asyncpool.examples.ray_env_hosts import check_ray_flags, start_ray_env_hosts
from torchrl_asyncpool.examples.script_config import config_parser


# ----------------------------------------------------------------------------------------------
# Config: every field is a command-line flag (``total_frames`` -> ``--total-frames``).
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    env_id: str = "HalfCheetah-v5"
    collector: str = "asyncpool"          # "asyncpool" (AsyncPoolCollector) or "torchrl" (Collector(ParallelEnv))
    num_envs: int = 16
    frames_per_batch: int = 2048          # transitions per collector batch (= per PPO iteration)
    total_frames: int = 1_000_000
    target_return: float = 1500.0         # the frames at which the mean of the last `window` episodes reaches it
                                          # are reported (and training stops there with --stop-at-target true)
    stop_at_target: bool = False
    window: int = 20                      # episodes in the moving mean of the return
    # PPO (TorchRL's sota-implementations/ppo/config_mujoco.yaml)
    lr: float = 3e-4
    anneal_lr: bool = True                # linear to 0 over the network updates of total_frames
    gamma: float = 0.99
    gae_lambda: float = 0.95
    epochs: int = 10
    minibatch_size: int = 64
    clip_eps: float = 0.2
    critic_coef: float = 0.25
    ent_coef: float = 0.0
    max_grad_norm: float = 0.0            # > 0: clip the gradient norm (TorchRL's recipe does not)
    hidden: int = 64
    normalize_obs: bool = True            # running observation statistics in the model (see the docstring)
    compile: bool = True                  # torch.compile the loss (both collectors; eager if compiling fails)
    acting: str = "plain"                 # what the collector acts with: "plain" (the actor's TanhNormal in plain
                                          # torch, TanhNormalActing) or "actor" (the ProbabilisticActor itself)
    # evaluation at the end (torchrl_asyncpool.evaluation.evaluate, deterministic actions)
    eval_episodes: int = 5
    eval_max_steps: int = 1000            # steps after which an evaluation episode is cut
    # collector options (--collector asyncpool)
    remote_address: str = ""              # "HOST:PORT": the envs run in env hosts that connect there over gRPC
    ray_hosts: int = 0                    # with remote_address: start the hosts as this many Ray actors
                                          # (num_envs / ray_hosts envs each), on RAY_ADDRESS's cluster or a local one
    on_env_failure: str = "raise"         # "restart": an env that raises is rebuilt and training goes on
    step_timeout: float = 0.0             # seconds an env step may take before its worker is killed; 0: no limit
    collect_while_training: bool = False  # true: the collector gathers the next batch during the PPO epochs
    seed: int = 0
    # logging
    log_dir: str = "runs"
    exp_name: str = ""                    # default: ppo_mujoco_<collector>_<time>
    plot_path: str = ""                   # default: <log_dir>/<exp_name>/ppo_mujoco.png
    progress: bool = True


def parse_config(argv=None) -> Config:
    parser = config_parser(Config, __file__, __doc__)  # one flag per field, its comment as help
    cfg = Config(**vars(parser.parse_args(argv)))
    for name in ("num_envs", "frames_per_batch", "total_frames", "window", "epochs", "minibatch_size", "hidden"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}.")
    for name in ("gamma", "gae_lambda"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(cfg, name)}.")
    if cfg.collector not in ("asyncpool", "torchrl"):
        parser.error(f"--collector must be 'asyncpool' or 'torchrl', got {cfg.collector!r}.")
    if cfg.collector == "torchrl" and cfg.frames_per_batch % cfg.num_envs:
        parser.error(f"--collector torchrl: --frames-per-batch {cfg.frames_per_batch} must be a multiple of "
                     f"--num-envs {cfg.num_envs}.")
    if cfg.collector == "torchrl" and (cfg.on_env_failure != "raise" or cfg.step_timeout):
        parser.error("--on-env-failure and --step-timeout are AsyncPoolCollector options.")
    if cfg.acting not in ("plain", "actor"):
        parser.error(f"--acting must be 'plain' or 'actor', got {cfg.acting!r}.")
    if cfg.on_env_failure not in ("raise", "restart"):
        parser.error(f"--on-env-failure must be 'raise' or 'restart', got {cfg.on_env_failure!r}.")
    if cfg.step_timeout < 0:
        parser.error(f"--step-timeout must be >= 0 (0: no limit), got {cfg.step_timeout}.")
    check_ray_flags(parser, cfg)  # --remote-address / --ray-hosts
    if cfg.eval_episodes < 0 or cfg.eval_max_steps < 1:
        parser.error("--eval-episodes must be >= 0 and --eval-max-steps >= 1.")
    return cfg


# ----------------------------------------------------------------------------------------------
# Model (TorchRL's ppo/utils_mujoco.py, plus the observation normaliser)
# ----------------------------------------------------------------------------------------------
def make_ppo_models(obs_dim: int, action_spec, hidden: int, normalize_obs: bool):
    norm = RunningObsNorm(obs_dim) if normalize_obs else torch.nn.Identity()
    n_act = action_spec.shape[-1]
    policy_mlp = MLP(in_features=obs_dim, out_features=n_act, num_cells=[hidden, hidden],
                     activation_class=torch.nn.Tanh)
    for layer in policy_mlp.modules():
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.orthogonal_(layer.weight, 1.0)
            layer.bias.data.zero_()
    actor = ProbabilisticActor(
        TensorDictModule(torch.nn.Sequential(norm, policy_mlp, AddStateIndependentNormalScale(n_act, scale_lb=1e-8)),
                         in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], spec=action_spec, distribution_class=TanhNormal,
        distribution_kwargs={"low": action_spec.space.low, "high": action_spec.space.high, "tanh_loc": False},
        return_log_prob=True, default_interaction_type=ExplorationType.RANDOM,
    )
    value_mlp = MLP(in_features=obs_dim, out_features=1, num_cells=[hidden, hidden], activation_class=torch.nn.Tanh)
    for layer in value_mlp.modules():
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.orthogonal_(layer.weight, 0.01)
            layer.bias.data.zero_()
    critic = ValueOperator(torch.nn.Sequential(norm, value_mlp), in_keys=["observation"])
    return actor, critic, norm


class TanhNormalActing(torch.nn.Module):
    """The actor's ``TanhNormal`` draw and its log-prob in plain torch, for collection only.

    The same ``Sequential(norm, MLP, scale)`` as the actor (shared, not copied), a reparametrised
    Normal draw, TorchRL's safe tanh (clamped to ``1 - eps``), the affine map to ``[low, high]``,
    and the log-prob TorchRL's ``TanhNormal`` gives that action (the Normal's at ``atanh`` of
    the action minus the tanh and affine log-determinants): the PPO ratio's denominator is the
    one the learner's ``ClipPPOLoss`` computes. Its call costs ~0.7 ms against ~1.6-2.0 ms for the
    ``ProbabilisticActor`` (8-16 envs, one thread): building the distribution objects costs more
    than the 64x64 MLP.
    """

    def __init__(self, net: torch.nn.Module, low: torch.Tensor, high: torch.Tensor):
        super().__init__()
        self.net = net
        self.register_buffer("half_range", (high - low) / 2)
        self.register_buffer("mid", (high + low) / 2)
        self._lim = 1.0 - torch.finfo(low.dtype).resolution  # TorchRL's safetanh_noeps clamp
        # the Normal's constant and the affine map's log-determinant, summed over the action dims
        self._log_norm = 0.5 * math.log(2 * math.pi) * low.shape[-1] + self.half_range.log().sum().item()

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, scale = self.net(observation)
        y = torch.tanh(loc + scale * torch.randn_like(loc)).clamp(-self._lim, self._lim)
        x = torch.atanh(y)  # the pre-tanh value TorchRL's log_prob recovers from the action
        log_prob = (-0.5 * ((x - loc) / scale).pow(2) - scale.log()
                    - 2 * (math.log(2) - x - torch.nn.functional.softplus(-2 * x))).sum(-1)
        return self.mid + self.half_range * y, log_prob - self._log_norm


class CompiledLoss:
    """``torch.compile`` of a TorchRL loss module, falling back to the module itself (with a
    warning) when compiling fails (no C++ compiler, an unsupported platform).

    The ``ClipPPOLoss`` step of TorchRL's recipe on a 64x64 MLP and minibatches of 64 is mostly
    Python (distribution objects, TensorDict keys): compiled, a step (loss, backward, fused Adam)
    takes ~3.7 ms instead of ~6.8 ms in the training runs on a 2-core CPU (2.9 against 6.4 ms
    alone), for ~15-45 s of compiling at the first minibatch. Both collectors get it: the learner
    is the same in both runs.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._call = torch.compile(module)

    def __getattr__(self, name):  # tensor_keys, actor_network, parameters(), ...: the module's
        if name in ("module", "_call"):  # not set yet (a copy in the making)
            raise AttributeError(name)
        return getattr(self.module, name)

    def __call__(self, tensordict):
        try:
            return self._call(tensordict)
        except Exception as err:  # noqa: BLE001 - a real loss error is raised again by the eager call
            if self._call is self.module:
                raise
            warnings.warn(f"torch.compile of the loss failed ({type(err).__name__}: {str(err)[:200]}); "
                          "training with the eager loss.", RuntimeWarning, stacklevel=2)
            self._call = self.module
            return self.module(tensordict)


def make_acting_policy(actor, action_spec) -> TensorDictModule:
    """What the collector acts with: ``actor``'s distribution through :class:`TanhNormalActing`,
    sharing ``actor``'s parameters (``acting.state_dict()`` is what the collector's copy loads)."""
    net = actor.module[0].module
    return TensorDictModule(TanhNormalActing(net, action_spec.space.low, action_spec.space.high),
                            in_keys=["observation"], out_keys=["action", "action_log_prob"])


# ----------------------------------------------------------------------------------------------
# The collector, advantages, the PPO epochs, the evaluation
# ----------------------------------------------------------------------------------------------
def make_collector(cfg: Config, acting):
    """The collector ``cfg.collector`` names, acting with ``acting`` (:func:`make_acting_policy`),
    and the Ray env hosts it reads from (``None`` without ``--ray-hosts``)."""
    ray_hosts = None
    if cfg.collector == "torchrl":
        from torchrl.collectors import Collector
        from torchrl.envs import EnvCreator, ParallelEnv

        env = ParallelEnv(cfg.num_envs, EnvCreator(functools.partial(make_torchrl_mujoco_env, cfg.env_id)))
        collector = Collector(env, acting, frames_per_batch=cfg.frames_per_batch, total_frames=cfg.total_frames,
                              auto_register_policy_transforms=False)
        collector.set_seed(cfg.seed)
    else:
        factories = [functools.partial(make_mujoco_env, cfg.env_id)] * cfg.num_envs
        if cfg.remote_address:  # slots fed by env hosts in Ray actors (torchrl_asyncpool.remote)
            factories, ray_hosts = start_ray_env_hosts(functools.partial(make_mujoco_env, cfg.env_id),
                                                       cfg.remote_address, cfg.num_envs, cfg.ray_hosts)
        try:
            collector = AsyncPoolCollector(
                factories,
                policy=copy.deepcopy(acting),  # the acting copy, in the collector's policy thread
                frames_per_batch=cfg.frames_per_batch,
                total_frames=cfg.total_frames,
                seed=None if cfg.remote_address else cfg.seed,  # env i's first reset: seed + i
                on_env_failure=cfg.on_env_failure,
                step_timeout=cfg.step_timeout or None,
                batch_layout="env_major",  # [num_envs, T]: TorchRL's GAE is exact on it
            )
        except BaseException:
            if ray_hosts is not None:
                ray_hosts.stop()
            raise
    return collector, ray_hosts


def advantages(cfg: Config, batch, adv_module, collector) -> tuple:
    """GAE along each env's row of a ``[num_envs, T]`` batch, as TorchRL's recipe runs it; returns
    the real transitions flattened env by env (each env's in time order) and the mean policy lag."""
    with torch.no_grad():
        adv_module(batch)
    mask = batch.get(("collector", "mask"), None)  # ours: rows left-padded to the longest
    if mask is None:  # TorchRL's Collector(ParallelEnv): no padding, no env index, no lag
        batch["env_index"] = torch.arange(cfg.num_envs).unsqueeze(-1).expand(batch.shape)
        return batch.reshape(-1), 0.0
    batch = batch[mask]
    return batch, (collector.policy_version - batch["policy_version"]).float().mean().item()


def ppo_epochs(cfg: Config, batch, loss_module, optim, updates: int, total_updates: int) -> tuple[int, list]:
    """``cfg.epochs`` passes of ``ClipPPOLoss`` steps over shuffled minibatches of ``batch`` (the
    learning rate annealed by the update count); returns the update count and the mean of
    ``[loss_objective, loss_critic, kl_approx, clip_fraction]`` over the steps.

    Only the entries the loss reads are kept, and each epoch shuffles them once and steps over
    contiguous slices: indexing the whole batch (its ``"next"`` entries, the collector's) with a
    random index for every minibatch cost ~5 % of a step."""
    keys = loss_module.tensor_keys
    data = batch.select(keys.action, keys.sample_log_prob, keys.advantage, keys.value_target,
                        *loss_module.actor_network.in_keys, *loss_module.critic_network.in_keys, strict=False)
    stats = []
    for _ in range(cfg.epochs):
        shuffled = data[torch.randperm(data.numel())]
        for start in range(0, data.numel(), cfg.minibatch_size):
            minibatch = shuffled[start:start + cfg.minibatch_size]
            if minibatch.numel() < 2:  # a minibatch of one (a short last batch): its advantage std is NaN
                continue
            if cfg.anneal_lr:
                optim.param_groups[0]["lr"] = cfg.lr * max(0.0, 1.0 - updates / total_updates)
            loss = loss_module(minibatch)
            total = loss["loss_objective"] + loss["loss_critic"]
            if "loss_entropy" in loss.keys():
                total = total + loss["loss_entropy"]
            optim.zero_grad()
            total.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(loss_module.parameters(), cfg.max_grad_norm)
            optim.step()
            updates += 1
            stats.append(torch.stack([loss[k].detach().mean() for k in
                                      ("loss_objective", "loss_critic", "kl_approx", "clip_fraction")]))
    if not stats:  # every minibatch had one transition
        return updates, [float("nan")] * 4
    return updates, torch.stack(stats).mean(0).tolist()


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    cfg = parse_config(argv)
    prepare_learner_process(1)  # the same learner process with either collector
    torch.manual_seed(cfg.seed)
    exp_name = cfg.exp_name or time.strftime(f"ppo_mujoco_{cfg.collector}_%Y%m%d-%H%M%S")
    logger = CSVLogger(exp_name=exp_name, log_dir=cfg.log_dir)
    logger.log_hparams(dataclasses.asdict(cfg))
    plot_path = cfg.plot_path or os.path.join(cfg.log_dir, exp_name, "ppo_mujoco.png")

    probe = make_torchrl_mujoco_env(cfg.env_id)
    obs_dim = probe.observation_spec["observation"].shape[-1]
    action_spec = probe.full_action_spec_unbatched["action"]
    probe.close()
    actor, critic, norm = make_ppo_models(obs_dim, action_spec, cfg.hidden, cfg.normalize_obs)
    # functional=False (no target networks in PPO) and the fused Adam step: the same updates,
    # ~25 % less time per minibatch step on a 2-core CPU (5.9 -> 4.3 ms), for either collector
    loss_module = ClipPPOLoss(actor, critic, clip_epsilon=cfg.clip_eps, entropy_bonus=cfg.ent_coef > 0,
                              entropy_coeff=cfg.ent_coef, critic_coeff=cfg.critic_coef, loss_critic_type="l2",
                              normalize_advantage=True, functional=False)
    # GAE along each env's row of a [num_envs, T] batch (both collectors' layout here)
    adv_module = GAE(gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=critic, average_gae=False)
    optim = torch.optim.Adam(loss_module.parameters(), lr=cfg.lr, eps=1e-5, fused=True)
    updates_per_batch = cfg.epochs * -(-cfg.frames_per_batch // cfg.minibatch_size)
    total_updates = -(-cfg.total_frames // cfg.frames_per_batch) * updates_per_batch

    if cfg.compile:
        loss_module = CompiledLoss(loss_module)
    # either collector acts with the same module (by default the actor's TanhNormal in plain torch)
    acting = make_acting_policy(actor, action_spec) if cfg.acting == "plain" else actor
    collector, ray_hosts = make_collector(cfg, acting)

    tracker = EpisodeTracker(cfg.num_envs)
    recent = deque(maxlen=cfg.window)
    curve_frames, curve_returns = [], []
    frames, updates, wait_s, idle_s, learn_s, reached_at = 0, 0, 0.0, 0.0, 0.0, None
    pbar = tqdm.tqdm(total=cfg.total_frames, unit="frames", disable=not cfg.progress, dynamic_ncols=True)
    t0 = time.monotonic()
    batches = iter(collector)
    try:
        while True:
            t_wait = time.monotonic()
            batch = next(batches, None)  # the learner waits for data here
            wait_s += time.monotonic() - t_wait
            if batch is None:
                break
            # paused from here (not only for the epochs): what the envs would step meanwhile is
            # the previous policy's
            paused = cfg.collector == "asyncpool" and not cfg.collect_while_training
            pause = collector.pause() if paused else contextlib.nullcontext()
            t_pause = time.monotonic()
            with pause:
                batch, lag = advantages(cfg, batch, adv_module, collector)
                n = batch.numel()
                frames += n
                new_returns = tracker.update(batch)
                recent.extend(new_returns)
                curve_frames += [frames] * len(new_returns)
                curve_returns += new_returns

                # --- PPO epochs -----------------------------------------------------------------
                t_learn = time.monotonic()
                updates, stats = ppo_epochs(cfg, batch, loss_module, optim, updates, total_updates)
                learn_s += time.monotonic() - t_learn
                if cfg.normalize_obs:  # after the epochs: the statistics the next batch is collected with
                    norm.update(batch["observation"])
                if cfg.collector == "torchrl":
                    collector.update_policy_weights_()  # the collector holds `acting` itself
                else:  # a copy, then a new policy version (before a paused collector resumes)
                    collector.update_policy_weights_(acting.state_dict())
            if paused:
                idle_s += time.monotonic() - t_pause

            # --- logging ------------------------------------------------------------------------
            elapsed = time.monotonic() - t0
            mean_ret = sum(recent) / len(recent) if recent else float("nan")
            metrics = {
                "mean_return": mean_ret, "episodes": len(curve_returns), "frames": frames, "fps": frames / elapsed,
                "updates": updates, "updates_per_s": updates / elapsed, "learner_wait_share": wait_s / elapsed,
                "collector_idle_share": idle_s / elapsed,
                "ms_per_update": 1000 * learn_s / max(updates, 1),  # the PPO steps alone, all batches so far
                "policy_lag": lag, "loss_policy": stats[0], "loss_value": stats[1], "approx_kl": stats[2],
                "clip_fraction": stats[3],
                "lr": optim.param_groups[0]["lr"], "time_s": elapsed,
            }
            if new_returns:
                metrics["batch_return"] = sum(new_returns) / len(new_returns)
            for k, v in metrics.items():
                logger.log_scalar(k, v, step=frames)
            postfix = {"ret": f"{mean_ret:.0f}", "fps": f"{frames / elapsed:.0f}", "wait": f"{wait_s / elapsed:.2f}"}
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
                if cfg.stop_at_target:
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
        eval_return = mean_eval_return(functools.partial(make_mujoco_env, cfg.env_id), actor,
                                       episodes=cfg.eval_episodes, seed=cfg.seed, max_steps=cfg.eval_max_steps)
        logger.log_scalar("eval_return", eval_return, step=frames)

    plot_curve(curve_frames, curve_returns, cfg.window, cfg.target_return, plot_path,
               f"PPO {cfg.env_id} ({cfg.num_envs} envs, {cfg.collector})")
    if reached_at is not None:
        print(f"Target {cfg.target_return:g} reached: mean return of the last {cfg.window} episodes "
              f">= {cfg.target_return:g} after {reached_at[0]} frames in {reached_at[1]:.1f}s.")
    print(f"{frames} frames, {updates} updates in {elapsed:.1f}s: {frames / elapsed:.0f} frames/s, "
          f"{updates / elapsed:.1f} updates/s, learner waited {100 * wait_s / elapsed:.0f}% of the time; "
          f"mean return of the last {len(recent)} episodes {mean_ret:.1f}, evaluation {eval_return:.1f}.")
    print(f"Logs: {os.path.join(cfg.log_dir, exp_name)}  Curve: {plot_path}")
    return {"frames": frames, "updates": updates, "time_s": elapsed, "fps": frames / elapsed,
            "learner_wait_share": wait_s / elapsed, "mean_return": mean_ret, "eval_return": eval_return,
            "reached": reached_at is not None, "reached_at": reached_at,
            "log_dir": os.path.join(cfg.log_dir, exp_name), "plot_path": plot_path}


if __name__ == "__main__":
    main()
