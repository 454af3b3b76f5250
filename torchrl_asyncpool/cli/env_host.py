"""``torchrl-asyncpool env-host``: step gymnasium envs for a pool's remote env slots over gRPC
(see :mod:`torchrl_asyncpool.remote`)."""
from __future__ import annotations

import argparse
import sys


def _refusal(args: argparse.Namespace):
    """Why the command cannot start (grpcio missing, a malformed ``--address``), or ``None``."""
    try:
        import grpc  # noqa: F401 - only whether it is there: the hosts' threads need it
    except ImportError:
        return "needs grpcio, which is not installed: pip install 'torchrl-asyncpool[remote]'."
    from torchrl_asyncpool.remote.ingress import check_address

    try:
        check_address(args.address)
    except ValueError as exc:
        return f"--address: {exc}"
    return None


def _cmd_env_host(args: argparse.Namespace) -> int:
    import os
    import threading

    import gymnasium as gym
    import tqdm

    refusal = _refusal(args)
    if refusal is not None:
        print(f"torchrl-asyncpool env-host: {refusal}", file=sys.stderr)
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



def add_parser(sub) -> None:
    """Registers the command and its options on the ``torchrl-asyncpool`` subparsers ``sub``."""
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
