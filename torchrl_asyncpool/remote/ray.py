"""Env hosts placed, restarted and stopped by Ray: each host is a Ray actor that connects to a
pool's address and serves its envs (``pip install 'torchrl-asyncpool[ray]'``).

Ray does the placing (``num_cpus``, custom resources, any other actor option), the restarting
(``max_restarts``: a host whose process died is started again, reconnects and takes a free
slot; the pool ended its open episodes as ``TRUNCATION`` meanwhile) and the scaling (more
actors); this module only supplies the actor. ``ray`` is imported here and nowhere else in the
package.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Sequence

__all__ = ["RayEnvHosts"]


class _HostActor:
    """The body of one Ray actor: hosts that serve ``address`` in threads of the actor, started
    by the constructor (so that an actor Ray restarts serves again by itself)."""

    def __init__(self, make_envs, address, protocol, envs_per_host, token, connect_timeout, retry_s):
        from torchrl_asyncpool.remote import EnvHost, VectorEnvHost

        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        if protocol == 2:
            self.hosts = [VectorEnvHost(make_envs, address, token=token, connect_timeout=connect_timeout)]
        else:
            self.hosts = [EnvHost(make_envs, address, token=token, connect_timeout=connect_timeout)
                          for _ in range(envs_per_host)]
        self.errors = []
        self.threads = [threading.Thread(target=self._serve, args=(h, retry_s), daemon=True) for h in self.hosts]
        for t in self.threads:
            t.start()

    def _serve(self, host, retry_s):
        import sys
        import traceback

        from torchrl_asyncpool.remote import RemoteHostError

        try:
            host.run_forever(retry_s=retry_s)
        except RemoteHostError as exc:  # the pool refused the host (token, spec): a restart would not help
            self.errors.append(f"{type(exc).__name__}: {exc}")
        except BaseException:  # noqa: BLE001 - the env failed: end the process, so that Ray restarts the actor
            sys.stderr.write(f"torchrl_asyncpool env host actor (pid {os.getpid()}) failed; exiting for Ray to "
                             f"restart it:\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)

    def status(self) -> dict:
        """``{"pid", "steps", "slots", "errors"}`` of this actor's hosts."""
        return {"pid": os.getpid(), "steps": sum(h.steps for h in self.hosts),
                "slots": [h.slot for h in self.hosts], "errors": list(self.errors)}

    def stop(self) -> None:
        """Stops the hosts (their streams end: the pool truncates their open episodes)."""
        for h in self.hosts:
            h.stop()
        for t in self.threads:
            t.join(10)
        for h in self.hosts:
            close = getattr(h, "close", None)
            if close is not None:
                close()


class RayEnvHosts:
    """Env hosts started as Ray actors against a pool's addresses and token.

    One actor per entry of ``addresses`` (repeat an address for several protocol-1 actors on
    it). With ``protocol=2`` each actor runs one :class:`~torchrl_asyncpool.remote.VectorEnvHost`
    of ``make_envs()`` (a gymnasium ``VectorEnv``, a TorchRL env with ``batch_size=[k]`` or a
    list of ``k`` envs or factories) for the pool's
    :class:`~torchrl_asyncpool.remote.RemoteVectorSlot` on that address; with ``protocol=1`` it
    runs ``envs_per_host`` :class:`~torchrl_asyncpool.remote.EnvHost` threads, each stepping
    its own ``make_envs()`` (a single env) for one of the
    :class:`~torchrl_asyncpool.remote.RemoteEnvSlot` slots there. Every host serves pool after
    pool (:meth:`~torchrl_asyncpool.remote.EnvHost.run_forever`): it waits for the pool to
    listen, retries while no slot is free, and comes back after the pool closed.

    Ray must be initialised (``ray.init(...)``, or ``ray.init(address="auto")`` on a cluster
    node) before :meth:`start`. ``make_envs`` is sent to the actors with Ray's serializer: a
    function of an importable module, or a :func:`functools.partial` of one.

    Args:
        make_envs (callable or sequence of callables): zero-argument factory, called inside each
            actor (see above), or one factory per address.
        addresses (str or sequence of str): the pool's ``"host:port"`` of each actor, as the
            actors' nodes reach it.

    Keyword Args:
        protocol (int): ``2`` (one stream for a host's envs) or ``1`` (one stream per env).
            Defaults to ``2``.
        envs_per_host (int): protocol 1: env host threads per actor. Defaults to ``1``.
        token (str, optional): the pool's token. Defaults to ``None``.
        num_cpus (float): CPUs Ray reserves for each actor. Defaults to ``1``.
        resources (dict, optional): custom Ray resources of each actor (``{"simulator": 1}``).
        max_restarts (int): how many times Ray restarts an actor whose process died (``-1``:
            always). An env that raises ends its actor's process, so Ray restarts it too; a
            pool that refuses a host (token, spec) does not (the actor stays up and
            :meth:`status` reports the refusal). Defaults to ``3``.
        connect_timeout (float): seconds a host waits for the pool per attempt. Defaults to ``30``.
        retry_s (float): seconds between attempts. Defaults to ``1``.
        **actor_options: any other option of Ray's ``.options()`` (``runtime_env``,
            ``scheduling_strategy``, ``memory``, ...).

    Attributes:
        actors (list): the Ray actor handles, once started (``ray.kill`` one to see it
            restarted).

    Examples:
        >>> from torchrl_asyncpool.remote.ray import RayEnvHosts
        >>> hosts = RayEnvHosts(print, ["pool:50061"], num_cpus=0.5, resources={"sim": 1})
        >>> hosts.options["num_cpus"], hosts.options["resources"], hosts.options["max_restarts"]
        (0.5, {'sim': 1}, 3)

        On a cluster (``make_vec`` is a picklable factory of a gymnasium vector env of 32 envs)::

            ray.init(address="auto")
            hosts = RayEnvHosts(make_vec, [f"{POOL_IP}:{50061 + i}" for i in range(8)], token=TOKEN)
            with hosts:
                collector = AsyncPoolCollector(hosts.pool_factories(env, host_envs=32), policy=policy,
                                               frames_per_batch=8192)
                ...
    """

    def __init__(self, make_envs: Callable, addresses: str | Sequence[str], *, protocol: int = 2,
                 envs_per_host: int = 1, token: str | None = None, num_cpus: float = 1,
                 resources: dict | None = None, max_restarts: int = 3, connect_timeout: float = 30.0,
                 retry_s: float = 1.0, **actor_options):
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("addresses is empty: give the pool's 'host:port' of each actor.")
        from torchrl_asyncpool.remote.ingress import check_address

        for address in self.addresses:  # here, not in each actor after its connect_timeout
            check_address(address)
        factories = list(make_envs) if isinstance(make_envs, (list, tuple)) else [make_envs] * len(self.addresses)
        if len(factories) != len(self.addresses) or not all(callable(f) for f in factories):
            raise TypeError(f"make_envs must be a zero-argument factory, or one per address ({len(self.addresses)}).")
        if protocol not in (1, 2):
            raise ValueError(f"protocol must be 1 or 2, got {protocol!r}.")
        if isinstance(envs_per_host, bool) or not isinstance(envs_per_host, int) or envs_per_host < 1:
            raise ValueError(f"envs_per_host must be an int >= 1, got {envs_per_host!r}.")
        if protocol == 2 and envs_per_host != 1:
            raise ValueError("envs_per_host is for protocol 1; a protocol-2 actor serves the envs make_envs returns.")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
            raise ValueError(f"max_restarts must be an int >= -1, got {max_restarts!r}.")
        self.make_envs, self.protocol, self.envs_per_host = factories, protocol, envs_per_host
        self.token, self.connect_timeout, self.retry_s = token, float(connect_timeout), float(retry_s)
        self.options = {"num_cpus": num_cpus, "resources": dict(resources or {}), "max_restarts": max_restarts,
                        **actor_options}
        self.actors = []

    def pool_factories(self, env, host_envs: int | None = None, *, listen: str = "0.0.0.0", per_env: bool = False,
                       **slot_kwargs) -> list:
        """The pool's side of these hosts: factories for an :class:`~torchrl_asyncpool.AsyncEnvPool`
        or :class:`~torchrl_asyncpool.AsyncPoolCollector`, one group per address, listening on
        ``listen`` at the address's port, with the hosts' token.

        Protocol 2: one :class:`~torchrl_asyncpool.remote.RemoteVectorSlot` per address, for
        all the actors given that address (``host_envs`` envs each, which this side cannot
        know before the actors built their envs). Protocol 1: ``envs_per_host`` x (actors on
        the address) :class:`~torchrl_asyncpool.remote.RemoteEnvSlot` factories per address.

        Args:
            env: an env with the per-env layout (gymnasium, or TorchRL with an empty batch
                size; only read), as for ``RemoteVectorSlot.like``.
            host_envs (int, optional): protocol 2: the envs of each host. Required there.

        Keyword Args:
            listen (str): the interface the pool listens on. Defaults to ``"0.0.0.0"`` (every
                interface; ``"localhost"`` for hosts on this machine only).
            per_env (bool): protocol 2: the envs of each address as single-env factories
                (:meth:`RemoteVectorSlot.per_env <torchrl_asyncpool.remote.RemoteVectorSlot.per_env>`:
                each env's record published as soon as it comes, for envs of uneven step time)
                instead of one ``RemoteVectorSlot`` stepped in lockstep. Defaults to ``False``.
            **slot_kwargs: more keyword arguments of the slots (``step_timeout``).
        """
        import functools

        from torchrl_asyncpool.remote import RemoteEnvSlot, RemoteVectorSlot

        if self.protocol == 2 and not (isinstance(host_envs, int) and host_envs > 0):
            raise ValueError("protocol 2: pass host_envs, the envs of each host (make_envs builds them in the "
                             "actors).")
        counts = {}
        for address in self.addresses:  # in order, each address once
            counts[address] = counts.get(address, 0) + 1
        out = []
        for address, actors in counts.items():
            local = f"{listen}:{address.rsplit(':', 1)[1]}"
            if self.protocol == 2 and per_env:
                out += RemoteVectorSlot.per_env(env, local, num_envs=host_envs * actors, host_envs=host_envs,
                                                token=self.token, **slot_kwargs)
            elif self.protocol == 2:
                out.append(functools.partial(RemoteVectorSlot.like, env, local, num_envs=host_envs * actors,
                                             host_envs=host_envs, token=self.token, **slot_kwargs))
            else:
                out += [functools.partial(RemoteEnvSlot.like, env, local, token=self.token, **slot_kwargs)] * (
                    self.envs_per_host * actors)
        return out

    def start(self) -> "RayEnvHosts":
        """Creates the actors (their hosts start connecting at once); returns ``self``.

        Raises:
            ImportError: ray is not installed.
            RuntimeError: Ray is not initialised, or the hosts were started already.
        """
        try:
            import ray
        except ImportError:
            raise ImportError("RayEnvHosts needs ray: pip install 'torchrl-asyncpool[ray]'.") from None
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call ray.init(...) (ray.init(address='auto') on a cluster "
                               "node) before RayEnvHosts.start().")
        if self.actors:
            raise RuntimeError("these env hosts are started already; stop() them first.")
        actor = ray.remote(_HostActor).options(**self.options)
        self.actors = [actor.remote(make, address, self.protocol, self.envs_per_host, self.token,
                                    self.connect_timeout, self.retry_s)
                       for make, address in zip(self.make_envs, self.addresses)]
        return self

    def status(self, timeout: float = 30.0) -> list:
        """Each actor's ``{"pid", "steps", "slots", "errors"}`` (steps and slots of its current
        process: a restarted actor counts from zero)."""
        import ray

        return ray.get([a.status.remote() for a in self.actors], timeout=timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the hosts and ends the actors (no restart). Idempotent."""
        import ray

        actors, self.actors = self.actors, []
        if not actors:
            return
        try:
            ray.get([a.stop.remote() for a in actors], timeout=timeout)
        except Exception:  # noqa: BLE001 - an actor that died or hangs is killed below all the same
            pass
        for a in actors:
            ray.kill(a, no_restart=True)

    def __enter__(self) -> "RayEnvHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
