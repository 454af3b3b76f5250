"""``torchrl-asyncpool eval``: a fixed set of episodes with a policy, one result each
(see :mod:`torchrl_asyncpool.evaluation`)."""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

from torchrl_asyncpool.cli._common import Terminated, _raise_terminated, _start_fork_server, _wait_fork_server_ready


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
    import signal

    # SIGTERM stops as Ctrl-C does from the start (the help promises both write every result);
    # it used to kill the command, with no results and no word, until the episodes were running
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _eval(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _usage_errors() -> tuple:
    """The exceptions that mean bad arguments or input (exit status 2): gymnasium's own errors
    once gymnasium is imported."""
    gym = sys.modules.get("gymnasium")
    return (ValueError, OSError, ImportError, AttributeError) + ((gym.error.Error,) if gym is not None else ())


def _eval(args: argparse.Namespace) -> int:
    # the episodes, their results and the results file need no torch (nor numpy): they come first,
    # so a Ctrl-C while torch is imported (seconds, longer on a busy machine) still writes every
    # episode's result, none started
    from torchrl_asyncpool.evaluation.episodes import (
        Episode,
        EpisodeResult,
        check_output_path,
        load_manifest,
        summarize,
        write_results,
    )

    episodes = None

    def stopped_before_the_first_episode(exc: KeyboardInterrupt) -> int:  # every episode is written, none started
        stopped, code = ("terminated (SIGTERM)", 143) if isinstance(exc, Terminated) else ("interrupted", 130)
        results = [EpisodeResult(e.episode_id, "failed", seed=e.seed, error="not started: the evaluation was stopped")
                   for e in episodes]
        try:
            write_results(results, args.output)
        except OSError as err:
            print(f"\ntorchrl-asyncpool eval: {stopped} before the first episode started; could not write the "
                  f"results: {err}", file=sys.stderr)
            return code
        print(f"\ntorchrl-asyncpool eval: {stopped} before the first episode started; {len(results)} episodes "
              f"reported not started in {args.output}.", file=sys.stderr)
        return code

    try:
        _check_eval_args(args)
        if args.manifest:
            episodes = load_manifest(args.manifest)
        else:
            episodes = [Episode(f"{args.env_id}-{args.seed + i}", seed=args.seed + i) for i in range(args.episodes)]
        if not args.capacity_smoke:  # found now, not after the whole run
            check_output_path(args.output)
        import gymnasium as gym

        from torchrl_asyncpool.evaluation.runner import resolve_policy_device  # imports torch

        make = functools.partial(gym.make, args.env_id)
        make().close()  # an unknown id fails here, with gymnasium's message
        policy = _load_policy(args.policy, args.env_id)
        device = resolve_policy_device(policy, args.device)
    except _usage_errors() as exc:
        print(f"torchrl-asyncpool eval: {exc}", file=sys.stderr)
        return _EVAL_USAGE
    except KeyboardInterrupt as exc:  # before the run: a real run still writes every episode, none started
        if episodes is None or args.validate_only or args.capacity_smoke:
            raise
        return stopped_before_the_first_episode(exc)
    if args.validate_only:
        print(f"{len(episodes)} episodes of {args.env_id} are valid; nothing was run.")
        return _EVAL_OK
    try:
        _start_fork_server()
        # a Ctrl-C while the fork server imports torch stops here at once; the pool's start would
        # wait for the fork server's first answer, seconds (tens of seconds on a busy machine)
        _wait_fork_server_ready()
    except KeyboardInterrupt as exc:
        if args.capacity_smoke:
            raise
        return stopped_before_the_first_episode(exc)
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

    from torchrl_asyncpool.evaluation.runner import EvaluationError, EvaluationInterrupted, evaluate

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



def add_parser(sub) -> None:
    """Registers the command and its options on the ``torchrl-asyncpool`` subparsers ``sub``."""
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
                    help="'random' (default) or MODULE:FACTORY, a function returning a TensorDict -> TensorDict policy "
                         "(MODULE on the Python path or in the current directory)")
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
