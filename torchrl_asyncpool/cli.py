"""The ``torchrl-asyncpool`` command: ``demo`` (train IMPALA on CartPole), ``eval``, ``bench`` and ``env-host``.

``torchrl-asyncpool demo`` is the package's main job in one command: it starts an
:class:`~torchrl_asyncpool.AsyncPoolCollector` over CartPole-v1 envs in worker processes,
trains an IMPALA (V-trace) actor-critic from the batches it yields, and prints the frames/s
reached and the final mean episode return. ``torchrl-asyncpool bench`` runs the repository's
side-by-side benchmark against TorchRL's stock collector. ``torchrl-asyncpool eval`` runs a
fixed set of episodes (a JSON manifest, or N seeds) with a policy and writes one result per
episode (see :mod:`torchrl_asyncpool.evaluation`).

The full training scripts (PPO, IMPALA, DQN) are in the repository's ``sota-implementations/``.
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import runpy
import sys
import time
from collections import deque
from pathlib import Path

__all__ = ["main", "train_impala_demo"]

_DESCRIPTION = """\
torchrl-asyncpool: high-throughput asynchronous data collection for TorchRL.

commands:
  demo    Train IMPALA (V-trace) on CartPole-v1 with AsyncPoolCollector: env workers in
          separate processes, one central policy in a thread, batches of transitions for
          the learner. Shows a progress bar (mean return, frames/s, batch fill ratio), stops
          when the mean return of the last 20 episodes reaches --target-return (default 475)
          or after --total-frames, and prints the frames/s reached and the final return.
          Takes about a minute on a 2-core CPU machine (longer when it is busy).
  eval    Run a fixed set of episodes of a gymnasium env (--manifest FILE, or --episodes N
          seeded --seed, --seed+1, ...) with a policy (--policy MODULE:FACTORY, a function
          returning a TensorDict -> TensorDict policy; default: uniform random actions) and
          write one result per episode, in manifest order, to --output (JSON: completed,
          timeout or failed, return, length). --validate-only checks the arguments, the
          manifest and the output location and builds one env without running anything;
          --capacity-smoke builds and resets --num-envs envs at once and closes them,
          stepping nothing. Exits with 1 when an episode failed, 3 when the evaluation itself
          failed (the policy raised: the finished results are still written). Ctrl-C or
          SIGTERM drains: running episodes finish, the others are reported failed ("not
          started"), the results are written, exit status 130 (143 after SIGTERM); a pool
          still starting is abandoned at once. A second Ctrl-C or SIGTERM aborts: the running
          episodes are cut (failed, "did not finish"), the results are still written.
  bench   Run the side-by-side collector benchmark (benchmarks/compare_collectors.py in a
          source checkout): AsyncPoolCollector against TorchRL's stock collectors and
          gymnasium's vector envs; prints the table and writes a PNG plot (--plot, default
          compare_collectors.png; needs matplotlib: pip install 'torchrl-asyncpool[benchmarks]',
          or --plot '' for none). Other arguments go to the benchmark script (--quick for a
          short run; "torchrl-asyncpool bench -- --help" lists them). The full table takes
          several minutes; run it with nothing else busy.

  env-host
          Step gymnasium envs (--env-id, --num-envs) for a pool whose factories return
          torchrl_asyncpool.remote.RemoteEnvSlot listening on --address HOST:PORT: each
          env takes a free slot, sends records over a gRPC stream and answers the pool's
          actions until the pool goes away (--reconnect: then waits for the next pool).
          Needs grpcio (pip install 'torchrl-asyncpool[remote]').

examples:
  torchrl-asyncpool demo
  torchrl-asyncpool demo --total-frames 50000 --num-envs 4
  torchrl-asyncpool eval --env-id CartPole-v1 --episodes 20 --max-steps 200 --output results.json
  torchrl-asyncpool bench --quick
  TORCHRL_ASYNCPOOL_TOKEN=secret torchrl-asyncpool env-host --env-id CartPole-v1 --address pool-host:50051
"""


def _start_fork_server() -> None:
    """Starts the fork server that env workers fork from, with Ctrl-C ignored in it.

    A terminal's Ctrl-C reaches every process of the command. ``multiprocessing``'s fork server
    ignores it only once it has imported its preload list (torch, TorchRL: seconds, longer on a
    busy machine); a Ctrl-C before that killed it with a traceback of its own, and the command
    then failed with ``BrokenPipeError``/``EOFError`` instead of stopping. Started here with
    ``SIGINT`` ignored (inherited across its ``exec``), it never takes one: the command owns the
    shutdown of everything it started.
    """
    import signal
    from multiprocessing import forkserver

    from torchrl_asyncpool.forkserver import forkserver_context

    forkserver_context("torchrl-asyncpool")  # sets the preload list
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


# ----------------------------------------------------------------------------------------------
# demo: a compact IMPALA learner (the full script is sota-implementations/impala_cartpole.py)
# ----------------------------------------------------------------------------------------------
def _make_agent(obs_dim: int, n_actions: int, hidden: int = 64):
    import torch
    import torch.nn as nn

    def mlp(n_out, out_std):
        net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                            nn.Linear(hidden, n_out))
        for layer in net:
            if isinstance(layer, nn.Linear):
                nn.init.orthogonal_(layer.weight, 2 ** 0.5)
                nn.init.zeros_(layer.bias)
        nn.init.orthogonal_(net[-1].weight, out_std)
        return net

    class Agent(nn.Module):
        """Actor-critic; ``forward`` is the acting policy (writes action and its log-prob)."""

        def __init__(self):
            super().__init__()
            self.actor = mlp(n_actions, 0.01)
            self.critic = mlp(1, 1.0)

        def forward(self, td):
            dist = torch.distributions.Categorical(logits=self.actor(td["observation"]))
            action = dist.sample()
            td.set("action", action)
            td.set("sample_log_prob", dist.log_prob(action))
            return td

    return Agent()


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
    import gymnasium
    import torch
    import torch.nn as nn
    import tqdm
    from torchrl.objectives.value.functional import vtrace_advantage_estimate

    from torchrl_asyncpool.collector import AsyncPoolCollector

    torch.manual_seed(seed)
    probe = gymnasium.make(env_id)
    obs_dim, n_actions = probe.observation_space.shape[0], int(probe.action_space.n)
    probe.close()
    agent = _make_agent(obs_dim, n_actions)
    acting = copy.deepcopy(agent)
    optim = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)

    collector = AsyncPoolCollector(
        [functools.partial(gymnasium.make, env_id)] * num_envs,
        policy=acting,
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        # envs run at most one batch ahead of the learner: IMPALA's V-trace corrects for a lag
        # of a version or two, but the compact learner above (one step per batch, lr 1e-3)
        # stalled or collapsed in 2 of ~20 runs whose mean lag reached 1.8-1.9 versions
        transition_chunk_size=max(1, frames_per_batch // num_envs),
        chunks_per_env=1,
        seed=seed,  # env i's first reset: seed + i
    )
    running = [0.0] * num_envs
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
        for it, batch in enumerate(collector):
            frames += batch.numel()
            # group each env's transitions into one contiguous, time-ordered run
            batch = batch[torch.sort(batch["env_index"], stable=True).indices]
            for env, r, d in zip(batch["env_index"].tolist(), batch["next", "reward"].flatten().tolist(),
                                 batch["next", "done"].flatten().tolist()):
                running[env] += r
                if d:
                    recent.append(running[env])
                    running[env] = 0.0
                    episodes += 1
            lag_sum += (collector.policy_version - batch["policy_version"]).float().mean().item()

            env = batch["env_index"]
            run_end = torch.ones_like(env, dtype=torch.bool)
            run_end[:-1] = env[1:] != env[:-1]
            ends = batch["next", "done"] | run_end.unsqueeze(-1)
            dist = torch.distributions.Categorical(logits=agent.actor(batch["observation"]))
            log_pi = dist.log_prob(batch["action"]).unsqueeze(-1)
            value = agent.critic(batch["observation"])
            with torch.no_grad():
                next_value = agent.critic(batch["next", "observation"])
                # ratio = exp(log_pi - log_mu): learner over behaviour ("sample_log_prob")
                adv, vs = vtrace_advantage_estimate(
                    gamma, log_pi.detach()[None], batch["sample_log_prob"].unsqueeze(-1)[None], value.detach()[None],
                    next_value[None], batch["next", "reward"][None], ends[None], batch["next", "terminated"][None],
                )
                adv, vs = adv[0], vs[0]
                # a 1-frame batch (the last one, when total_frames is not a multiple of the batch) is
                # only centred: the std of one value is NaN, which would reach the weights
                adv = adv - adv.mean() if adv.numel() < 2 else (adv - adv.mean()) / (adv.std() + 1e-8)
            loss = -(log_pi * adv).mean() + 0.25 * (value - vs).pow(2).mean() - ent_coef * dist.entropy().mean()
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optim.step()
            last_loss = loss.item()
            collector.update_policy_weights_(agent.state_dict())  # copied into the acting policy

            pool = collector.pool_metrics()
            mean_ret = sum(recent) / len(recent) if recent else float("nan")
            pbar.update(batch.numel())
            pbar.set_postfix(ret=f"{mean_ret:.1f}", fill=f"{pool['batch_fill_ratio']:.2f}")
            if len(recent) == window and mean_ret >= target_return:
                reached = True
                break
    except KeyboardInterrupt as exc:  # what was reached so far travels with it (the CLI's summary line)
        exc.demo_progress = {"frames": frames, "time_s": time.monotonic() - t0, "episodes": episodes,
                             "mean_return": sum(recent) / len(recent) if recent else float("nan")}
        raise
    finally:
        pbar.close()
        collector.shutdown()
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


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------
def _default_benchmark() -> Path:
    return Path(__file__).resolve().parent.parent / "benchmarks" / "compare_collectors.py"


# ----------------------------------------------------------------------------------------------
# eval: a fixed set of episodes, one result each
# ----------------------------------------------------------------------------------------------
def _random_policy(action_space):
    """Uniform random actions for a gymnasium ``Discrete`` or ``Box`` action space."""
    import gymnasium as gym
    import torch

    if isinstance(action_space, gym.spaces.Discrete):
        n, start = int(action_space.n), int(action_space.start)
        return lambda td: td.set("action", torch.randint(start, start + n, (td.batch_size[0],)))
    if isinstance(action_space, gym.spaces.Box):
        low = torch.as_tensor(action_space.low, dtype=torch.float32)
        high = torch.as_tensor(action_space.high, dtype=torch.float32)
        dtype = torch.from_numpy(action_space.sample()).dtype
        return lambda td: td.set(
            "action", (low + (high - low) * torch.rand(td.batch_size[0], *low.shape)).to(dtype)
        )
    raise ValueError(f"--policy random supports Discrete and Box action spaces, not {action_space!r}.")


def _load_policy(spec: str, env_id: str):
    if spec == "random":
        import gymnasium as gym

        env = gym.make(env_id)
        try:
            return _random_policy(env.action_space)
        finally:
            env.close()
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--policy must be 'random' or MODULE:FACTORY, got {spec!r}.")
    import importlib

    # modules in the current directory import, as with `python -m` (a console script's
    # sys.path starts with its own bin/ folder instead)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())

    factory = getattr(importlib.import_module(module), attr)
    return factory()


#: exit statuses of ``torchrl-asyncpool eval`` (see its ``--help``)
_EVAL_OK, _EVAL_EPISODE_FAILED, _EVAL_USAGE, _EVAL_FAILED = 0, 1, 2, 3


def _check_eval_args(args: argparse.Namespace) -> None:
    """Refuses (``ValueError``, naming the option, the value and what is expected) the numeric
    options a real run would fail on, so that ``--validate-only`` refuses them too."""
    import math

    if args.num_envs < 1:
        raise ValueError(f"--num-envs must be >= 1, got {args.num_envs}.")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1 (or left out: no limit), got {args.max_steps}.")
    timeout = args.episode_timeout_s
    if timeout is not None and not 0 < timeout < math.inf:
        raise ValueError(f"--episode-timeout-s must be a number of seconds > 0 (or left out: no limit), got {timeout}.")
    if not args.manifest and args.episodes < 1:
        raise ValueError(f"--episodes must be >= 1, got {args.episodes}.")


def _cmd_eval(args: argparse.Namespace) -> int:
    import gymnasium as gym

    from torchrl_asyncpool.evaluation import (
        Episode,
        EvaluationError,
        EvaluationInterrupted,
        evaluate,
        load_manifest,
        summarize,
        write_results,
    )
    from torchrl_asyncpool.evaluation.episodes import EpisodeResult, check_output_path
    from torchrl_asyncpool.evaluation.runner import resolve_policy_device

    episodes = None
    try:
        _check_eval_args(args)
        if args.manifest:
            episodes = load_manifest(args.manifest)
        else:
            episodes = [Episode(f"{args.env_id}-{args.seed + i}", seed=args.seed + i) for i in range(args.episodes)]
        if not args.capacity_smoke:  # found now, not after the whole run
            check_output_path(args.output)
        make = functools.partial(gym.make, args.env_id)
        make().close()  # an unknown id fails here, with gymnasium's message
        policy = _load_policy(args.policy, args.env_id)
        device = resolve_policy_device(policy, args.device)
    except (ValueError, OSError, gym.error.Error, ImportError, AttributeError) as exc:
        print(f"torchrl-asyncpool eval: {exc}", file=sys.stderr)
        return _EVAL_USAGE
    except KeyboardInterrupt:  # before the run: a real run still writes every episode, none started
        if episodes is None or args.validate_only or args.capacity_smoke:
            raise
        results = [EpisodeResult(e.episode_id, "failed", seed=e.seed, error="not started: the evaluation was stopped")
                   for e in episodes]
        write_results(results, args.output)
        print(f"\ntorchrl-asyncpool eval: interrupted before the first episode started; {len(results)} episodes "
              f"reported not started in {args.output}.", file=sys.stderr)
        return 130
    if args.validate_only:
        print(f"{len(episodes)} episodes of {args.env_id} are valid; nothing was run.")
        return _EVAL_OK
    _start_fork_server()
    if args.capacity_smoke:
        from torchrl_asyncpool.errors import EnvError, WorkerDiedError
        from torchrl_asyncpool.evaluation import check_capacity

        try:
            r = check_capacity(make, episodes, num_envs=args.num_envs, timeout_s=args.episode_timeout_s)
        except (EnvError, WorkerDiedError, TimeoutError) as exc:
            print(f"torchrl-asyncpool eval --capacity-smoke: {exc}", file=sys.stderr)
            return _EVAL_EPISODE_FAILED
        print(f"capacity smoke: {r['envs']} envs of {args.env_id} built and reset (seeds of the first "
              f"{r['envs']} episodes) in {r['workers']} worker processes in {r['start_s']:.2f} s, closed in "
              f"{r['close_s']:.2f} s; nothing was stepped.")
        return _EVAL_OK
    import signal
    import threading
    import traceback

    stop = threading.Event()
    evaluated = threading.Event()  # evaluate() has returned or raised: only the writing is left
    received = []  # the signals that asked to stop, in order

    def on_signal(signum, frame):
        # the first Ctrl-C or SIGTERM drains (running episodes finish, no new one starts, a pool that
        # is starting is abandoned); the second aborts (the results so far are still written); more,
        # or any once the evaluation is over, are ignored: the pool is closing (about a second) and
        # the results are being written
        received.append(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if evaluated.is_set():
            return
        if len(received) == 1:
            stop.set()
            print(f"\ntorchrl-asyncpool eval: {name}: stopping: the running episodes finish, no new one starts "
                  "(Ctrl-C or SIGTERM again to abort: the finished results are still written)", file=sys.stderr)
        elif len(received) == 2:
            print(f"\ntorchrl-asyncpool eval: {name} again: aborting: the running episodes are cut, the finished "
                  "results are written", file=sys.stderr)
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    failure = results = None
    aborted = False

    def abort_status():  # 130 or 143, after the signal that aborted (a policy's own KeyboardInterrupt: 130)
        return 128 + (received[1] if len(received) > 1 else signal.SIGINT)

    try:
        try:
            results = evaluate(make, policy, episodes, num_envs=args.num_envs, max_steps=args.max_steps,
                               episode_timeout_s=args.episode_timeout_s, stop=stop, progress=not args.no_progress,
                               device=device)
        except EvaluationInterrupted as exc:  # the second signal: what ended is kept, the rest failed
            aborted, results = True, exc.results
        except KeyboardInterrupt:  # the second signal as evaluate() returned (with or without its results)
            aborted = True
        except EvaluationError as exc:  # the policy failed, ...: the finished episodes are kept
            failure = exc
            results = exc.results
        except Exception:  # noqa: BLE001 - a failure of the evaluation itself: its own exit status
            traceback.print_exc()
            print("torchrl-asyncpool eval: the evaluation failed (above); no results written.", file=sys.stderr)
            return _EVAL_FAILED
        finally:
            evaluated.set()
        if failure is not None:  # the policy's own traceback, once (the summary line below says the rest)
            traceback.print_exception(failure.__cause__ or failure)
        if results is None:  # the abort came as evaluate() returned, before its results were received
            print("torchrl-asyncpool eval: aborted; no results written.", file=sys.stderr)
            return abort_status()
        try:
            write_results(results, args.output)  # atomic: the previous file or every result, never a part
        except OSError as exc:
            print(f"torchrl-asyncpool eval: could not write the results: {exc}", file=sys.stderr)
            return _EVAL_FAILED
    finally:  # the handlers stay until the results are written: a third signal cannot cut that short
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = summarize(results)
    mean = "n/a" if summary["mean_return"] is None else f"{summary['mean_return']:.2f}"
    print(f"{summary['episodes']} episodes in {time.monotonic() - t0:.1f} s: {summary['completed']} completed, "
          f"{summary['timeout']} timeout, {summary['failed']} failed; mean return of the completed: {mean}; "
          f"results in {args.output}")
    if failure is not None:
        cause = failure.__cause__
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(failure)
        print(f"torchrl-asyncpool eval: the evaluation failed ({what.rstrip('.')}); the results of the "
              f"finished episodes are in {args.output}, the others are reported failed.", file=sys.stderr)
        return _EVAL_FAILED
    if aborted:
        print("torchrl-asyncpool eval: aborted: the episodes that were running are reported failed "
              "(\"did not finish\"), the others \"not started\".", file=sys.stderr)
        return abort_status()
    if received:
        return 128 + received[0]  # 130 (Ctrl-C) or 143 (SIGTERM): the unstarted are reported failed
    return _EVAL_EPISODE_FAILED if summary["failed"] else _EVAL_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    script = Path(args.script) if args.script else _default_benchmark()
    if not script.is_file():
        print(
            f"torchrl-asyncpool bench: the benchmark script {script} was not found.\n"
            "It ships with the source repository, not with the installed package: run this command "
            "from an editable install of a clone (pip install -e .), or pass --script PATH.",
            file=sys.stderr,
        )
        return 2
    extra = list(args.bench_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.script is None and args.plot and not any(a == "--plot" or a.startswith("--plot=") for a in extra):
        extra += ["--plot", args.plot]
    plot = next((extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--plot"), None)
    plot = next((a.split("=", 1)[1] for a in extra if a.startswith("--plot=")), plot)
    if plot and "-h" not in extra and "--help" not in extra:
        try:
            import matplotlib  # noqa: F401 - only whether it is there
        except ImportError:
            print("torchrl-asyncpool bench: the plot needs matplotlib, which is not installed: "
                  "pip install 'torchrl-asyncpool[benchmarks]' (or --plot '' for no plot).", file=sys.stderr)
            return 2
    if args.script is None:
        _start_fork_server()
    print(f"Running {script} {' '.join(extra)}".rstrip(), flush=True)
    # run it as `python SCRIPT ARGS` would: its folder first on sys.path, its own argv
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *extra]
    sys.path.insert(0, str(script.resolve().parent))
    t0 = time.monotonic()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:  # the script's own exit status
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:  # the script's own cleanup (its finally blocks) has run
        print(f"\ntorchrl-asyncpool bench: interrupted after {time.monotonic() - t0:.1f} s; the rows printed "
              "above are complete, no plot or JSON was written.", file=sys.stderr)
        return 130
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return 0


def _cmd_env_host(args: argparse.Namespace) -> int:
    import os
    import threading

    import gymnasium as gym
    import tqdm

    try:
        import grpc  # noqa: F401 - only whether it is there: the hosts' threads need it
    except ImportError:
        print("torchrl-asyncpool env-host: needs grpcio, which is not installed: "
              "pip install 'torchrl-asyncpool[remote]'.", file=sys.stderr)
        return 2
    from torchrl_asyncpool.remote import EnvHost, RemoteHostError

    if args.protocol == 2:  # one stream for all --num-envs envs (a pool's RemoteVectorSlot)
        from torchrl_asyncpool.remote.vector_host import serve_from_command_line

        return serve_from_command_line(args)
    # gRPC's C core logs every connection the pool closes at INFO level; a host has nothing to do about it
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    token = args.token if args.token is not None else os.environ.get("TORCHRL_ASYNCPOOL_TOKEN")
    if args.num_envs < 1:
        print(f"torchrl-asyncpool env-host: --num-envs must be >= 1, got {args.num_envs}.", file=sys.stderr)
        return 2
    if args.reconnect and args.max_steps is not None:  # run_forever serves pool after pool, with no step limit
        print("torchrl-asyncpool env-host: --max-steps does not apply with --reconnect (a host that reconnects "
              "serves until it is stopped); give one of them.", file=sys.stderr)
        return 2
    try:
        envs = [gym.make(args.env_id) for _ in range(args.num_envs)]
    except gym.error.Error as exc:
        print(f"torchrl-asyncpool env-host: {exc}", file=sys.stderr)
        return 2
    hosts = [EnvHost(env, args.address, token=token, connect_timeout=args.connect_timeout) for env in envs]
    errors = []

    def serve(host):
        try:
            if args.reconnect:
                host.run_forever()
            else:
                host.run(max_steps=args.max_steps)
                tqdm.tqdm.write(f"env host: {host.steps} steps of {args.env_id} served to slot {host.slot} of "
                                f"{args.address}", file=sys.stdout)
        except (ConnectionError, RemoteHostError) as exc:
            errors.append(exc)
            for other in hosts:  # one refusal (token, spec, no free slot) ends the command
                other.stop()

    # one env per thread, each with its own stream: their steps overlap while others wait
    threads = [threading.Thread(target=serve, args=(h,), daemon=True) for h in hosts]
    bar = tqdm.tqdm(unit=" steps", disable=args.no_progress, dynamic_ncols=True,
                    desc=f"{args.env_id} -> {args.address}")
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)  # wakes for Ctrl-C, and for the progress bar
                bar.update(sum(h.steps for h in hosts) - bar.n)
                bar.set_postfix(slots=sum(h.slot is not None for h in hosts), refresh=False)
    except KeyboardInterrupt:
        for h in hosts:
            h.stop()
        bar.close()
        print(f"\ntorchrl-asyncpool env-host: interrupted; {sum(h.steps for h in hosts)} steps of {args.env_id} "
              f"served to {args.address}.", file=sys.stderr)
        return 130
    finally:
        bar.close()
        for env in envs:
            env.close()
    if errors:
        print(f"torchrl-asyncpool env-host: {errors[0]}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the option (``PROG: error: argument --flag: ...``) and
    exit status 2; ``--help`` has the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _positive_int(text: str) -> int:
    """An ``int`` >= 1 (argparse names the option when this raises)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


class _VersionAction(argparse.Action):
    """``--version``: the package version and which exchange runs (found only when asked: it
    imports torch, which would make every command slow to take a Ctrl-C while it starts)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and the exchange in use, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            from importlib.metadata import version

            package_version = version("torchrl-asyncpool")
        except Exception:  # noqa: BLE001 - not installed (source tree on sys.path)
            package_version = "unknown"
        from torchrl_asyncpool.exchange.native import describe_exchange

        parser.exit(message=f"{parser.prog} {package_version} (exchange: {describe_exchange()})\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchrl-asyncpool", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="{demo,eval,bench,env-host}")

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

    ev = sub.add_parser(
        "eval", help="run a fixed set of episodes with a policy; write one result per episode",
        description="Run a fixed set of episodes of a gymnasium env on AsyncEnvPool workers and write one "
                    "result per episode (completed, timeout or failed), in manifest order, as JSON. The first "
                    "Ctrl-C or SIGTERM drains: the running episodes finish (a pool still starting is abandoned at "
                    "once), the others are reported failed ('not started'), the results are written; a second one "
                    "aborts: the running episodes are cut (failed, 'did not finish'), the results are still written.",
        epilog="exit status: 0 every episode completed or timed out; 1 an episode failed (or the capacity smoke "
               "failed); 2 bad arguments or input (nothing ran); 3 the evaluation itself failed (the policy raised "
               "or wrote no action, the results could not be written): the finished episodes' results are "
               "written, the others failed with the cause; 130 / 143 stopped by Ctrl-C / SIGTERM (results "
               "written).",
    )
    ev.add_argument("--env-id", default="CartPole-v1", help="gymnasium env id (default: CartPole-v1)")
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--manifest", default=None,
                       help="JSON list of {episode_id, seed, max_steps} (or {'episodes': [...]})")
    which.add_argument("--episodes", type=int, default=10, help="without a manifest: N episodes (default: 10)")
    ev.add_argument("--seed", type=int, default=0, help="without a manifest: seed of the first episode")
    ev.add_argument("--policy", default="random",
                    help="'random' (default) or MODULE:FACTORY, a function returning a TensorDict -> TensorDict policy")
    ev.add_argument("--num-envs", type=int, default=8, help="episodes run at once (default: 8)")
    ev.add_argument("--device", default=None,
                    help="where the policy runs, e.g. cuda:0 (default: its parameters' device, else cpu)")
    ev.add_argument("--max-steps", type=int, default=None, help="step limit (>= 1) of episodes that set none")
    ev.add_argument("--episode-timeout-s", type=float, default=None,
                    help="wall-clock limit per episode (> 0), its env's creation or reset included: a hung env "
                         "times the episode out and its worker is replaced")
    ev.add_argument("--output", default="eval_results.json",
                    help="results file (default: eval_results.json), checked before the run, written at once "
                         "(a temporary file renamed over it); returns that are not finite are written as null")
    mode = ev.add_mutually_exclusive_group()
    mode.add_argument("--validate-only", action="store_true",
                      help="check the arguments, the manifest, the env, the policy and the --output location; "
                           "run nothing")
    mode.add_argument("--capacity-smoke", action="store_true",
                      help="build and reset --num-envs envs at once (seeds of the first episodes), close them, "
                           "report the times; step nothing, write no --output (--episode-timeout-s bounds the "
                           "start-up)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=_cmd_eval)

    bench = sub.add_parser(
        "bench", help="run the side-by-side benchmark against TorchRL's stock collector",
        description="Run benchmarks/compare_collectors.py from the source checkout (AsyncPoolCollector vs "
                    "TorchRL's stock collectors): prints the table and writes a PNG plot. Other arguments "
                    "are passed to the script, e.g. 'torchrl-asyncpool bench --quick'; "
                    "'torchrl-asyncpool bench -- --help' lists them.",
    )
    bench.add_argument("--script", default=None, help=f"benchmark script (default: {_default_benchmark()})")
    bench.add_argument("--plot", default="compare_collectors.png",
                       help="PNG plot written by the default benchmark script (default: compare_collectors.png; "
                            "'' for none); needs matplotlib: pip install 'torchrl-asyncpool[benchmarks]'")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    bench.set_defaults(func=_cmd_bench)

    host = sub.add_parser(
        "env-host", help="serve a gymnasium env to a pool's remote env slots over gRPC",
        description="Connect to a pool whose factories return RemoteEnvSlot, take a free slot and step a "
                    "gymnasium env for it until the pool goes away (see torchrl_asyncpool.remote).",
    )
    host.add_argument("--env-id", default="CartPole-v1", help="gymnasium env id (default: CartPole-v1)")
    host.add_argument("--num-envs", type=int, default=1,
                      help="envs served by this process, each in its own thread and slot (default: 1)")
    host.add_argument("--address", required=True, help="the pool's HOST:PORT")
    host.add_argument("--token", default=None,
                      help="the pool's token (default: $TORCHRL_ASYNCPOOL_TOKEN; prefer the variable, "
                           "command lines are visible to other users)")
    host.add_argument("--connect-timeout", type=float, default=30.0,
                      help="seconds to wait for the pool (default: 30)")
    host.add_argument("--max-steps", type=int, default=None, help="leave after this many env steps")
    host.add_argument("--no-progress", action="store_true", help="no progress bar (steps served, slots held)")
    host.add_argument("--reconnect", action="store_true",
                      help="serve pool after pool: reconnect when the pool goes away or has no free slot")
    host.add_argument("--protocol", type=int, choices=(1, 2), default=1,
                      help="1: one stream and slot per env (RemoteEnvSlot); 2: all --num-envs envs over one stream "
                           "(a pool's RemoteVectorSlot of that many envs) (default: 1)")
    host.add_argument("--vector-mode", choices=("threads", "sync", "vector_entry_point"), default="threads",
                      help="with --protocol 2: step the envs in threads of their own, or as a gymnasium vector env "
                           "(gymnasium.make_vec's vectorization_mode) (default: threads)")
    host.set_defaults(func=_cmd_env_host)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``torchrl-asyncpool`` console script."""
    command = ""
    try:
        parser = _parser()
        args, unknown = parser.parse_known_args(argv)
        command = f" {args.command}" if getattr(args, "command", None) else ""
        if unknown:
            if getattr(args, "command", None) != "bench":
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            args.bench_args = [*unknown, *args.bench_args]  # options meant for the benchmark script
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        code = args.func(args)
    except KeyboardInterrupt:  # not handled by the command itself (e.g. while torch is imported)
        print(f"\ntorchrl-asyncpool{command}: interrupted.", file=sys.stderr)
        code = 130
    if argv is None and code in (130, 143):
        # the command line after Ctrl-C / SIGTERM: the command has closed what it started and
        # printed its summary; tearing the interpreter down (torch's modules) took seconds on a
        # busy machine, so the process ends here. (Callers passing argv get the status back.)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
