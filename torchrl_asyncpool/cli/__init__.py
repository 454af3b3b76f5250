"""The ``torchrl-asyncpool`` command: ``demo`` (train IMPALA on CartPole), ``eval``, ``bench`` and ``env-host``.

``torchrl-asyncpool demo`` is the package's main job in one command: it starts an
:class:`~torchrl_asyncpool.AsyncPoolCollector` over CartPole-v1 envs in worker processes,
trains an IMPALA (V-trace) actor-critic from the batches it yields, and prints the frames/s
reached and the final mean episode return. ``torchrl-asyncpool bench`` runs the repository's
side-by-side benchmark against TorchRL's stock collector. ``torchrl-asyncpool eval`` runs a
fixed set of episodes (a JSON manifest, or N seeds) with a policy and writes one result per
episode (see :mod:`torchrl_asyncpool.evaluation`).

The full training scripts (PPO, IMPALA, DQN) are in the repository's ``sota-implementations/``.
Each command lives in its own module of this package (``demo``, ``eval``, ``bench``,
``env_host``); this one holds the parser and :func:`main`.
"""
from __future__ import annotations

import argparse
import sys

from torchrl_asyncpool.cli import bench, demo, env_host
from torchrl_asyncpool.cli import eval as eval_command
from torchrl_asyncpool.cli.demo import train_impala_demo

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


# ----------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """An argument error is one line naming the option (``PROG: error: argument --flag: ...``) and
    exit status 2; ``--help`` has the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


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

        print(f"{parser.prog} {package_version} (exchange: {describe_exchange()})")  # stdout, as argparse's own
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchrl-asyncpool", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="{demo,eval,bench,env-host}")
    for command in (demo, eval_command, bench, env_host):
        command.add_parser(sub)
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
    except KeyboardInterrupt as exc:  # not handled by the command itself (e.g. while torch is imported)
        from torchrl_asyncpool.cli._common import Terminated

        terminated = isinstance(exc, Terminated)  # SIGTERM, for a command that stops on it as on Ctrl-C
        print(f"\ntorchrl-asyncpool{command}: {'terminated (SIGTERM)' if terminated else 'interrupted'}.",
              file=sys.stderr)
        code = 143 if terminated else 130
    if argv is None:
        # the command line: the command has closed what it started and printed its summary; the
        # process ends now, not after seconds of tearing torch down (callers passing argv get
        # the status back)
        from torchrl_asyncpool.cli._common import _exit_process

        _exit_process(code, command)
    return code
