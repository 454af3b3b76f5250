"""The ``--remote-address HOST:PORT --ray-hosts N`` flags of the MuJoCo and Atari training scripts:
their envs stepped in env hosts that Ray places (and restarts) as actors, connected to the
collector's pool over gRPC (:mod:`torchrl_asyncpool.remote`).

Each actor builds ``num_envs / N`` envs with the script's own env factory (the same wrappers,
dtypes and preprocessing as its local envs) and serves them to ``HOST:PORT`` with protocol 1,
one env a slot. Ray runs on ``RAY_ADDRESS``'s cluster when that variable is set, else on a local
one it starts. The hosts own their envs and their resets, so the collector is built with
``seed=None``; restarts and step timeouts are the hosts' business (a lost host's open episodes
end with a ``TRUNCATION`` and its actor is restarted by Ray), so ``--on-env-failure restart`` and
``--step-timeout`` are refused with these flags.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Tuple

__all__ = ["check_ray_flags", "start_ray_env_hosts"]


def check_ray_flags(parser, cfg) -> None:
    """Exits through ``parser.error`` (status 2, the flag's name in the message) unless the
    script's ``cfg.remote_address`` and ``cfg.ray_hosts`` make sense together: both or neither,
    ``ray_hosts`` dividing ``num_envs``, this package's collector, and neither
    ``on_env_failure="restart"`` nor a ``step_timeout`` (those act on local envs).

    Args:
        parser (argparse.ArgumentParser): the script's parser.
        cfg: the script's config, with ``remote_address``, ``ray_hosts``, ``num_envs``,
            ``collector``, ``on_env_failure`` and ``step_timeout``.

    Examples:
        >>> import argparse, types
        >>> cfg = types.SimpleNamespace(remote_address="127.0.0.1:50051", ray_hosts=2, num_envs=8,
        ...                             collector="asyncpool", on_env_failure="raise", step_timeout=0.0)
        >>> check_ray_flags(argparse.ArgumentParser(), cfg)  # valid: nothing happens
    """
    if not cfg.remote_address and not cfg.ray_hosts:
        return
    if cfg.collector != "asyncpool":
        parser.error("--remote-address and --ray-hosts are AsyncPoolCollector options (--collector asyncpool).")
    if cfg.ray_hosts < 0 or (cfg.ray_hosts and (not cfg.remote_address or cfg.num_envs % cfg.ray_hosts)):
        parser.error(f"--ray-hosts {cfg.ray_hosts} needs --remote-address HOST:PORT and a --num-envs "
                     f"({cfg.num_envs}) it divides.")
    if not cfg.ray_hosts:
        parser.error("--remote-address needs --ray-hosts N: the hosts must build this script's env, with its "
                     "wrappers (`torchrl-asyncpool env-host` serves a plain gymnasium.make(env_id)).")
    from torchrl_asyncpool.remote.ingress import check_address

    try:
        check_address(cfg.remote_address)
    except ValueError as exc:
        parser.error(f"--remote-address: {exc}")
    if cfg.on_env_failure == "restart" or cfg.step_timeout:
        parser.error("--on-env-failure restart and --step-timeout act on local envs: not with --remote-address "
                     "(Ray restarts a lost host's actor).")


def start_ray_env_hosts(make_env: Callable, address: str, num_envs: int, ray_hosts: int) -> Tuple[list, object]:
    """Starts ``ray_hosts`` Ray actors serving ``num_envs`` envs of ``make_env`` to ``address``;
    returns ``(factories, hosts)``: the pool's ``num_envs`` slot factories
    (:class:`~torchrl_asyncpool.remote.RemoteEnvSlot`, listening at ``address``) for the
    collector, and the started :class:`~torchrl_asyncpool.remote.ray.RayEnvHosts`, to ``stop()``
    when the collector is shut down.

    ``make_env`` must be picklable (a module-level function or a ``functools.partial`` of one):
    each actor calls it. It is also called once here, to read the env's spaces.

    Args:
        make_env (callable): builds one gymnasium env.
        address (str): ``"HOST:PORT"`` the pool listens on and the hosts connect to.
        num_envs (int): envs in all; a multiple of ``ray_hosts``.
        ray_hosts (int): actors, ``num_envs / ray_hosts`` envs each.
    """
    import ray

    from torchrl_asyncpool.remote import RemoteEnvSlot
    from torchrl_asyncpool.remote.ray import RayEnvHosts

    if ray_hosts < 1 or num_envs % ray_hosts:
        raise ValueError(f"ray_hosts must be >= 1 and divide num_envs, got ray_hosts={ray_hosts}, "
                         f"num_envs={num_envs}.")
    probe = make_env()
    try:  # the spaces alone travel to the pool's workers, not the env
        factories = [functools.partial(RemoteEnvSlot, address, probe.observation_space,
                                       probe.action_space)] * num_envs
    finally:
        probe.close()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    # num_cpus=0: the hosts share the machine's cores with the pool instead of reserving them
    hosts = RayEnvHosts(make_env, [address] * ray_hosts, protocol=1, envs_per_host=num_envs // ray_hosts,
                        num_cpus=0).start()
    return factories, hosts
