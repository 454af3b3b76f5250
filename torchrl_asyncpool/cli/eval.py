"""``torchrl-asyncpool eval``: a fixed set of episodes with a policy, one result each
(see :mod:`torchrl_asyncpool.evaluation`)."""
from __future__ import annotations

import argparse
import functools
import sys
import time

from torchrl_asyncpool.cli._common import (
    Terminated,
    _import_callable,
    _raise_terminated,
    _start_fork_server,
    _wait_fork_server_ready,
)

#: the env ``torchrl-asyncpool eval`` runs without ``--env-id`` or ``--env-factory``
_DEFAULT_ENV_ID = "CartPole-v1"


def _random_policy(env):
    """Uniform random actions for ``env``: a gymnasium env's ``Discrete`` or ``Box`` action
    space, or a TorchRL env's action spec."""
    import gymnasium as gym
    import torch

    action_space = getattr(env, "action_space", None)
    if not isinstance(action_space, gym.spaces.Space):  # a TorchRL env: its own spec draws
        spec = env.full_action_spec
        return lambda td: td.update(spec.expand(*td.batch_size).rand())
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


def _load_policy(spec: str, env):
    """The policy ``--policy`` names: ``"random"`` (for ``env``'s actions) or ``MODULE:FACTORY``
    called with no arguments."""
    if spec == "random":
        return _random_policy(env)
    return _import_callable(spec, "--policy", "'random' or MODULE:FACTORY")()


def _env_kwargs(text: str | None) -> dict:
    """``--env-kwargs`` parsed: a JSON object (``ValueError`` naming what is wrong)."""
    if text is None:
        return {}
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--env-kwargs must be a JSON object, e.g. '{{\"env_id\": \"ALE/Pong-v5\"}}'; got {text!r}, "
                         f"which is not valid JSON ({exc}).") from None
    if not isinstance(value, dict):
        raise ValueError(f"--env-kwargs must be a JSON object (keyword arguments), got a {type(value).__name__}: "
                         f"{text!r}.")
    return value


def _env_name(args: argparse.Namespace) -> str:
    """The env's name in the episode ids and messages (no import: the episodes come first)."""
    if args.env_factory:
        kwargs = _env_kwargs(args.env_kwargs)
        return str(kwargs.get("env_id") or args.env_factory.partition(":")[2] or args.env_factory)
    return args.env_id or _DEFAULT_ENV_ID


def _env_maker(args: argparse.Namespace):
    """A picklable no-argument env factory: ``gym.make(--env-id, **--env-kwargs)``, or the
    ``--env-factory`` function called with ``--env-kwargs`` (none: no arguments)."""
    kwargs = _env_kwargs(args.env_kwargs)
    if not args.env_factory:
        import gymnasium as gym

        return functools.partial(gym.make, args.env_id or _DEFAULT_ENV_ID, **kwargs)
    return functools.partial(_import_callable(args.env_factory, "--env-factory"), **kwargs)


def _build_env(make, args: argparse.Namespace):
    """One env from ``make``, in this process; a factory's own error becomes a usage error
    (``ValueError``) naming the factory (gymnasium's errors for an unknown id pass as they are)."""
    gym = sys.modules.get("gymnasium")
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - reported with what was called
        if gym is not None and isinstance(exc, gym.error.Error) and not args.env_factory:
            raise
        env_id = args.env_id or _DEFAULT_ENV_ID
        what = f"--env-factory {args.env_factory}" if args.env_factory else f"gymnasium.make({env_id!r})"
        kwargs = f" with --env-kwargs {args.env_kwargs}" if args.env_kwargs else ""
        raise ValueError(f"{what}{kwargs} failed: {type(exc).__name__}: {exc}") from exc


def _close_env(env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - the env was built to check it; its close is not the point
        pass


def _dtype_hint(request: dict, obs_keys, policy) -> str:
    """:func:`~torchrl_asyncpool.inference.dtype_hint.dtype_mismatch_hint` for the env's
    observations, with this command's own fix for MuJoCo; empty when the dtypes agree."""
    from torchrl_asyncpool.inference.dtype_hint import dtype_mismatch_hint

    hint = dtype_mismatch_hint({k: request[k][1] for k in obs_keys}, policy)
    if not hint:
        return ""
    return (f" {hint} For MuJoCo, --env-factory torchrl_asyncpool.examples.envs:make_mujoco_env casts them "
            "to float32.")


def _act_once(env, policy, device) -> str:
    """Resets ``env`` (in this process), builds the record the pool would hand the policy (the
    env's observation entries in their slot dtypes, zero reward, ``FIRST``), runs ``policy`` on
    it as :func:`~torchrl_asyncpool.evaluation.evaluate` would and checks its actions against
    the env's action spec; ``ValueError`` says what failed. Returns a description of the action."""
    import torch
    from tensordict import TensorDict
    from torchrl.envs.utils import ExplorationType

    from torchrl_asyncpool.collector.acting_policy import ActingPolicy
    from torchrl_asyncpool.collector.action_checks import ActionCheck
    from torchrl_asyncpool.envs.adapters import make_adapter
    from torchrl_asyncpool.exchange.arena import layout_repr
    from torchrl_asyncpool.evaluation.episode_run import policy_answers

    adapter = make_adapter(env)
    request, response = adapter.fields()
    action_spec = adapter.specs()["full_action_spec"]
    obs = adapter.reset()
    record = TensorDict({}, [1])
    for key, (shape, dtype) in request.items():
        value = obs[key] if key in adapter.obs_keys else torch.zeros(shape, dtype=dtype)
        record.set(key, torch.as_tensor(value).to(dtype).reshape(1, *shape))
    record.set("env_index", torch.zeros(1, dtype=torch.int64))
    checks = {k: ActionCheck(k, dtype, action_spec[k]) for k, (_, dtype) in response.items()}
    acting = ActingPolicy(policy, ExplorationType.DETERMINISTIC, action_checks=checks)
    observed = layout_repr((k, *request[k]) for k in adapter.obs_keys)
    where = f"the policy, run once on a real observation of the env ({observed})"
    try:
        with torch.no_grad():
            out = acting(record.to(device))
    except Exception as exc:  # noqa: BLE001 - the policy's own error, with what it was given
        raise ValueError(f"{where}, raised {type(exc).__name__}: {str(exc).strip()}."
                         f"{_dtype_hint(request, adapter.obs_keys, policy)}") from exc
    try:  # what evaluate() sends: the action entries (a missing one is named with what was written)
        actions = policy_answers(out, list(response), torch.arange(1), None)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    for key, (shape, dtype) in response.items():
        if tuple(actions[key].shape) != (1, *shape):
            raise ValueError(f"{where}, wrote {key!r} of shape {tuple(actions[key].shape)}; the env takes "
                             f"{tuple(shape)} per env, so a batch of one is {(1, *shape)}.")
    return layout_repr((k, *v) for k, v in response.items())


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


def _check_env_and_policy(make, args: argparse.Namespace):
    """Builds one env (an unknown id or a failing factory fails here, before any worker starts),
    loads the policy and finds its device; with ``--validate-only``, runs the policy once on the
    env's first observation (:func:`_act_once`). Returns ``(policy, device, action description
    or None)``."""
    from torchrl_asyncpool.evaluation.runner import resolve_policy_device  # imports torch

    env = _build_env(make, args)
    try:
        policy = _load_policy(args.policy, env)
        device = resolve_policy_device(policy, args.device)
        acted = _act_once(env, policy, device) if args.validate_only else None
    finally:
        _close_env(env)
    return policy, device, acted


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
    from torchrl_asyncpool.evaluation.episodes import Episode, check_output_path, load_manifest

    episodes = None
    try:
        _check_eval_args(args)
        if args.manifest:
            episodes = load_manifest(args.manifest)
        else:
            name = _env_name(args)
            episodes = [Episode(f"{name}-{args.seed + i}", seed=args.seed + i) for i in range(args.episodes)]
        if not args.capacity_smoke:  # found now, not after the whole run
            check_output_path(args.output)
        make = _env_maker(args)
        policy, device, acted = _check_env_and_policy(make, args)
    except _usage_errors() as exc:
        print(f"torchrl-asyncpool eval: {exc}", file=sys.stderr)
        return _EVAL_USAGE
    except KeyboardInterrupt as exc:  # before the run: a real run still writes every episode, none started
        if episodes is None or args.validate_only or args.capacity_smoke:
            raise
        return _stopped_before_the_first_episode(exc, episodes, args)
    if args.validate_only:
        print(f"{len(episodes)} episodes of {_env_name(args)} are valid; the policy acted on one real observation "
              f"of the env ({acted}); nothing else was run.")
        return _EVAL_OK
    try:
        _start_fork_server()
        # a Ctrl-C while the fork server imports torch stops here at once; the pool's start would
        # wait for the fork server's first answer, seconds (tens of seconds on a busy machine)
        _wait_fork_server_ready()
    except KeyboardInterrupt as exc:
        if args.capacity_smoke:
            raise
        return _stopped_before_the_first_episode(exc, episodes, args)
    if args.capacity_smoke:
        return _capacity_smoke(make, episodes, args)
    return _run_and_write(make, policy, device, episodes, args)


def _stopped_before_the_first_episode(exc: KeyboardInterrupt, episodes, args: argparse.Namespace) -> int:
    """Ctrl-C or SIGTERM before any episode started: every episode is written, none started."""
    from torchrl_asyncpool.evaluation.episodes import EpisodeResult, write_results

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


def _capacity_smoke(make, episodes, args: argparse.Namespace) -> int:
    """``--capacity-smoke``: builds and resets ``--num-envs`` envs at once, steps none."""
    from torchrl_asyncpool.errors import EnvError, WorkerDiedError
    from torchrl_asyncpool.evaluation import check_capacity

    try:
        r = check_capacity(make, episodes, num_envs=args.num_envs, timeout_s=args.episode_timeout_s)
    except (EnvError, WorkerDiedError, TimeoutError) as exc:
        print(f"torchrl-asyncpool eval --capacity-smoke: {exc}", file=sys.stderr)
        return _EVAL_EPISODE_FAILED
    print(f"capacity smoke: {r['envs']} envs of {_env_name(args)} built and reset (seeds of the first "
          f"{r['envs']} episodes) in {r['workers']} worker processes in {r['start_s']:.2f} s, closed in "
          f"{r['close_s']:.2f} s; nothing was stepped.")
    return _EVAL_OK


class _Signals:
    """The first Ctrl-C or SIGTERM drains (running episodes finish, no new one starts, a pool
    that is starting is abandoned); the second aborts (the results so far are still written);
    more, or any once the evaluation is over, are ignored: the pool is closing (about a second)
    and the results are being written."""

    def __init__(self):
        import threading

        self.stop = threading.Event()
        self.evaluated = threading.Event()  # evaluate() has returned or raised: only the writing is left
        self.received = []  # the signals that asked to stop, in order

    def __call__(self, signum, frame):
        import signal

        self.received.append(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.evaluated.is_set():
            return
        if len(self.received) == 1:
            self.stop.set()
            print(f"\ntorchrl-asyncpool eval: {name}: stopping: the running episodes finish, no new one starts "
                  "(Ctrl-C or SIGTERM again to abort: the finished results are still written)", file=sys.stderr)
        elif len(self.received) == 2:
            print(f"\ntorchrl-asyncpool eval: {name} again: aborting: the running episodes are cut, the finished "
                  "results are written", file=sys.stderr)
            raise KeyboardInterrupt

    def abort_status(self) -> int:
        """130 or 143, after the signal that aborted (a policy's own KeyboardInterrupt: 130)."""
        import signal

        return 128 + (self.received[1] if len(self.received) > 1 else signal.SIGINT)


def _run_and_write(make, policy, device, episodes, args: argparse.Namespace) -> int:
    """Runs the evaluation under the command's signal handling, writes the results, reports."""
    import signal
    import traceback

    from torchrl_asyncpool.evaluation.episodes import write_results
    from torchrl_asyncpool.evaluation.runner import EvaluationError, EvaluationInterrupted, evaluate

    signals = _Signals()
    previous = {sig: signal.signal(sig, signals) for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    failure = results = None
    aborted = False
    try:
        try:
            results = evaluate(make, policy, episodes, num_envs=args.num_envs, max_steps=args.max_steps,
                               episode_timeout_s=args.episode_timeout_s, stop=signals.stop,
                               progress=not args.no_progress, device=device)
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
            signals.evaluated.set()
        if failure is not None:  # the policy's own traceback, once (the summary line below says the rest)
            traceback.print_exception(failure.__cause__ or failure)
        if results is None:  # the abort came as evaluate() returned, before its results were received
            print("torchrl-asyncpool eval: aborted; no results written.", file=sys.stderr)
            return signals.abort_status()
        try:
            write_results(results, args.output)  # atomic: the previous file or every result, never a part
        except OSError as exc:
            print(f"torchrl-asyncpool eval: could not write the results: {exc}", file=sys.stderr)
            return _EVAL_FAILED
    finally:  # the handlers stay until the results are written: a third signal cannot cut that short
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _report(results, failure, aborted, signals, time.monotonic() - t0, args)


def _report(results, failure, aborted: bool, signals: _Signals, elapsed_s: float, args: argparse.Namespace) -> int:
    """Prints the summary line (and why the run ended early); returns the exit status."""
    from torchrl_asyncpool.evaluation.episodes import summarize

    summary = summarize(results)
    mean = "n/a" if summary["mean_return"] is None else f"{summary['mean_return']:.2f}"
    print(f"{summary['episodes']} episodes in {elapsed_s:.1f} s: {summary['completed']} completed, "
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
        return signals.abort_status()
    if signals.received:
        return 128 + signals.received[0]  # 130 (Ctrl-C) or 143 (SIGTERM): the unstarted are reported failed
    return _EVAL_EPISODE_FAILED if summary["failed"] else _EVAL_OK


def add_parser(sub) -> None:
    """Registers the command and its options on the ``torchrl-asyncpool`` subparsers ``sub``."""
    ev = sub.add_parser(
        "eval", help="run a fixed set of episodes with a policy; write one result per episode",
        description="Run a fixed set of episodes of a gymnasium env (or one from --env-factory) on AsyncEnvPool "
                    "workers and write one "
                    "result per episode (completed, timeout or failed), in manifest order, as JSON. The first "
                    "Ctrl-C or SIGTERM drains: the running episodes finish (a pool still starting is abandoned at "
                    "once), the others are reported failed ('not started'), the results are written; a second one "
                    "aborts: the running episodes are cut (failed, 'did not finish'), the results are still written.",
        epilog="exit status: 0 every episode completed or timed out; 1 an episode failed (or the capacity smoke "
               "failed); 2 bad arguments or input (no episode ran; with --validate-only, also a policy that fails on "
               "the env's first observation); 3 the evaluation itself failed (the policy raised "
               "or wrote no action, the results could not be written): the finished episodes' results are "
               "written, the others failed with the cause; 130 / 143 stopped by Ctrl-C / SIGTERM (results "
               "written).",
    )
    envs = ev.add_mutually_exclusive_group()
    envs.add_argument("--env-id", default=None, help=f"gymnasium env id (default: {_DEFAULT_ENV_ID})")
    envs.add_argument("--env-factory", default=None, metavar="MODULE:FUNCTION",
                      help="a function that builds one env (gymnasium or TorchRL), called in each worker with "
                           "--env-kwargs (or no arguments), e.g. torchrl_asyncpool.examples.envs:make_atari_env "
                           "(ALE/Pong-v5, standard preprocessing); MODULE on the Python path or in the current "
                           "directory")
    ev.add_argument("--env-kwargs", default=None, metavar="JSON",
                    help="a JSON object of keyword arguments for gymnasium.make(--env-id, ...) or for the "
                         "--env-factory function, e.g. '{\"env_id\": \"HalfCheetah-v5\"}'")
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
                      help="check the arguments, the manifest, the env, the policy and the --output location, "
                           "and run the policy once on a real observation of one env (in this process: a dtype "
                           "mismatch or a missing action is found here); run no episode")
    mode.add_argument("--capacity-smoke", action="store_true",
                      help="build and reset --num-envs envs at once (seeds of the first episodes), close them, "
                           "report the times; step nothing, write no --output (--episode-timeout-s bounds the "
                           "start-up)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=_cmd_eval)
