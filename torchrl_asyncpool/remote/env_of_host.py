"""Pool side of protocol 2, one pool env at a time: the envs of protocol-2 hosts as single
slots, each stepped by its own thread of the worker listening on the address.

:class:`~torchrl_asyncpool.remote.RemoteVectorSlot` steps a host's envs in lockstep (a pass
waits for the slowest env). The slots made by :meth:`RemoteVectorSlot.per_env
<torchrl_asyncpool.remote.RemoteVectorSlot.per_env>` are single envs instead: the pool hosts the
envs of one address in one worker, one thread each (as for
:class:`~torchrl_asyncpool.remote.RemoteEnvSlot`), and an env's record is published as soon as
its host sent it. On the wire nothing changes: one stream per host, each message carrying the
records (or the commands) that were ready when it was sent, so envs that finish together still
share a message.
"""
from __future__ import annotations

import logging
import queue
import threading

import gymnasium as gym
import numpy as np

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.remote.ingress import (
    BlockIngress, HostLost, Ingress, ProtocolError, check_slot_arguments, end_stream, wait_for_host,
)
from torchrl_asyncpool.step_type import StepType

_log = logging.getLogger("torchrl_asyncpool.remote")
_FIRST, _TERM, _TRUNC = int(StepType.FIRST), int(StepType.TERMINATION), int(StepType.TRUNCATION)


class RemoteEnvOfHost(gym.Env):
    """One env of a protocol-2 host as a pool slot of its own (see the module).

    Made by :meth:`RemoteVectorSlot.per_env <torchrl_asyncpool.remote.RemoteVectorSlot.per_env>`,
    which gives the ``num_envs`` factories of one address (``position`` ``0 .. num_envs - 1``);
    the pool hosts them in one worker, one thread each. Hosts of ``host_envs`` envs take the
    first free block of ``host_envs`` positions, as with a
    :class:`~torchrl_asyncpool.remote.RemoteVectorSlot`, and may step their envs together or one
    by one. A host that drops ends the open episode of each of its envs with a ``TRUNCATION``
    record (last observation, reward 0); each env's next episode starts with the next host's
    ``FIRST`` record.

    Args:
        address (str): ``"host:port"`` to listen on (shared by the ``num_envs`` slots).
        observation_space, action_space: one env's spaces.
        position (int): this env among the address's ``num_envs``.
        num_envs (int): the envs of the address.

    Keyword Args:
        host_envs (int, optional): the envs of each host (divides ``num_envs``). Defaults to
            ``num_envs``.
        token (str, optional): as :class:`~torchrl_asyncpool.remote.RemoteEnvSlot`'s.
        step_timeout (float, optional): seconds the host may take to answer this env; past
            it, the host is dropped (all its envs truncated). Defaults to ``None``.
    """

    metadata = {"render_modes": []}

    def __init__(self, address: str, observation_space, action_space, position: int, num_envs: int, *,
                 host_envs: int | None = None, token: str | None = None, step_timeout: float | None = None):
        host_envs = check_slot_arguments(address, token, step_timeout, num_envs, host_envs)
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < num_envs:
            raise ValueError(f"position must be an int in 0..{num_envs - 1}, got {position!r}.")
        self.address, self.position, self.num_envs, self.host_envs = address, position, num_envs, host_envs
        self.step_timeout = None if step_timeout is None else float(step_timeout)
        self.observation_space, self.action_space = observation_space, action_space
        self._spec = P.spec_of_spaces(observation_space, action_space)
        self._dict_obs = isinstance(observation_space, gym.spaces.Dict)
        self._token = token
        self.index = None
        self._group = None
        self._stream = None  # the stream of the episode in progress
        self._last_obs = None
        self._j = position % host_envs  # the env's index on its host

    @classmethod
    def like(cls, env, address: str, position: int, num_envs: int, **kwargs) -> "RemoteEnvOfHost":
        """A slot laid out as ``env`` (gymnasium, or TorchRL with an empty batch size; only read)."""
        from torchrl_asyncpool.remote.torchrl_env import as_gymnasium

        env = as_gymnasium(env)
        return cls(address, env.observation_space, env.action_space, position, num_envs, **kwargs)

    @property
    def hosts_connected(self) -> int:
        """Hosts that took a block of this address so far (in the worker process)."""
        return 0 if self._group is None else self._group.hosts_connected

    @property
    def hosts_lost(self) -> int:
        """Hosts of this address that dropped, hung or broke the protocol."""
        return 0 if self._group is None else self._group.hosts_lost

    # -- called by the pool worker hosting the slot ----------------------------------------------
    def _pool_listen(self, index: int, stop_fd: int | None = None) -> None:
        self.index = index
        self._group = _Group.join(self, stop_fd)
        self._block = self._group._blocks[self.position // self.host_envs]

    # -- gymnasium API ----------------------------------------------------------------------------
    def reset(self, *, seed=None, options=None):
        """The next ``FIRST`` record of this env: the one its host sent unasked when it took
        the block, else the answer to a reset command (waits for a host if none holds the block).

        Raises:
            ValueError: for a ``seed`` or ``options``: the host owns its envs and their resets.
            RuntimeError: for a slot that no pool worker steps.
        """
        if seed is not None or options:
            raise ValueError(f"{self._where()}: a remote host owns its envs and their resets; a seed or reset "
                             "options cannot be applied from the pool.")
        if self._group is None:
            raise RuntimeError(f"{self._where()} is stepped by a pool worker, which listens on {self.address}; it "
                               "cannot be reset on its own. Return it from an AsyncEnvPool / AsyncPoolCollector "
                               "factory.")
        j = self._j
        while True:
            stream = self._group.wait_host(self._block)
            try:
                if stream.first_taken[j]:
                    stream.command(j, True, None)
                else:  # the FIRST record the host sent when it took the block answers this reset
                    stream.first_taken[j] = True
                st, _, obs = self._read(stream)
                if st != _FIRST:
                    raise ProtocolError(f"env {j}: a record answering a reset has step type {st}; expected 0 "
                                         "(FIRST)")
            except HostLost as exc:
                self._group.lose(self._block, stream, exc)
                continue
            self._stream, self._last_obs = stream, obs
            return self._out(obs), {}

    def step(self, action):
        """Sends ``action`` to the host and returns this env's next record; a host lost
        meanwhile ends the episode as truncated (last observation, reward 0;
        ``info["host_lost"]``)."""
        stream = self._stream
        try:
            if stream is None or stream.lost is not None:
                raise HostLost("no host holds the env")
            stream.command(self._j, False, action)
            st, reward, obs = self._read(stream)
            if st == _FIRST:
                raise ProtocolError(f"env {self._j}: a record answering an action has step type 0 (FIRST)")
        except HostLost as exc:
            self._stream = None
            if stream is not None:
                self._group.lose(self._block, stream, exc)
            return self._out(self._last_obs), 0.0, False, True, {"host_lost": True}
        self._last_obs = obs
        return self._out(obs), reward, st == _TERM, st == _TRUNC, {}

    def close(self):
        """Leaves the address's group (the last env to leave ends the hosts' streams and stops
        listening). Idempotent."""
        group, self._group = self._group, None
        if group is not None:
            group.leave(self)

    # -- internals --------------------------------------------------------------------------------
    def _where(self) -> str:
        where = f"remote env {self.position} of {self.address}"
        return where if self.index is None else f"{where} (pool slot {self.index})"

    def _out(self, obs):
        return obs if self._dict_obs else obs["observation"]

    def _read(self, stream):
        """This env's next record from ``stream``: ``(step type, reward, obs)``."""
        inbox = self._block.inbox[self._j]
        while True:
            try:
                item = inbox.get(timeout=self.step_timeout)
            except queue.Empty:
                stream.timed_out = True
                stream.context.cancel()
                raise HostLost(f"no answer within step_timeout={self.step_timeout:g}s") from None
            if item[0] is not stream:
                continue  # from a stream this env has left
            if item[1] is None:
                raise stream.lost
            return item[1], item[2], item[3]


class _Block:
    """The positions ``start .. start + n - 1`` of an address, fed by one host."""

    def __init__(self, start: int, n: int):
        self.start, self.stop = start, start + n
        self.stream = None
        self.inbox = [queue.SimpleQueue() for _ in range(n)]  # (stream, step type, reward, obs) per env


class _Group(BlockIngress):
    """The envs of one address in one worker process: what the ingress sees as one slot taking
    ``num_envs / host_envs`` hosts (their blocks), and the reader of each host's records."""

    _by_address: dict = {}
    _lock = threading.Lock()

    @classmethod
    def join(cls, env: RemoteEnvOfHost, stop_fd=None) -> "_Group":
        with cls._lock:
            group = cls._by_address.get(env.address)
            if group is None:
                group = cls._by_address[env.address] = cls(env)
            elif (group.num_envs, group.host_envs, group._spec, group._token) != (
                    env.num_envs, env.host_envs, env._spec, env._token):
                raise ValueError(f"{env._where()}: the envs listening on {env.address} must share one num_envs, "
                                 "host_envs, spec and token.")
            if group.members.get(env.position) is not None:
                raise ValueError(f"{env._where()}: position {env.position} of {env.address} is taken twice.")
            group.members[env.position] = env
            group.index = min(group.index, env.index)
            start, group._listening = not group._listening, True
        if start:  # the first env of the address in this process: listen
            group._ingress = Ingress.join(group, stop_fd)
        return group

    def __init__(self, env):
        self.address, self.num_envs, self.host_envs = env.address, env.num_envs, env.host_envs
        self._spec, self._token = env._spec, env._token
        self._codec = P.BatchCodec(self._spec, self.host_envs)
        self.index = env.index
        self.step_timeout = None  # each env times its own host's answers
        self.members = {}
        self._blocks = [_Block(b * self.host_envs, self.host_envs) for b in range(self.num_envs // self.host_envs)]
        self.hosts_connected = self.hosts_lost = 0
        self._cond = threading.Condition()
        self._closed = False
        self._listening = False
        self._ingress = None

    def _where(self) -> str:
        return f"the remote envs on {self.address}"

    def _attach(self, stream) -> bool:
        with self._cond:
            if self._closed:
                return False
            block = next((b for b in self._blocks if b.stream is None), None)
            if block is None:
                return False
            h = self.host_envs
            stream.lost = None
            stream.first_taken = np.zeros(h, bool)  # env j took the FIRST record sent unasked
            stream.waiting = np.ones(h, bool)  # env j has a record due (its FIRST, then one per command)
            stream.accept_index = block.start
            stream.command = self._commander(stream)
            block.stream = stream
            self.hosts_connected += 1
            self._cond.notify_all()
        _log.info("%s: host %s connected (envs %d..%d)", self._where(), stream.peer, block.start, block.stop - 1)
        threading.Thread(target=self._read_loop, args=(block, stream), name="env-host-reader", daemon=True).start()
        return True

    def _commander(self, stream):
        """``command(env, reset, action)`` for ``stream``: queued; the stream's sender packs
        all commands waiting into one message (see ``_HostStream.responses``)."""
        codec, waiting = self._codec, stream.waiting
        zero = np.zeros(codec.one.action_shape, codec.one.action_dtype)

        def pack(commands):
            envs = [c[0] for c in commands]
            resets = [c[1] for c in commands]
            actions = np.stack([zero if c[1] else np.asarray(c[2], codec.one.action_dtype).reshape(zero.shape)
                                for c in commands])
            return codec.pack_commands(envs, resets, actions)

        stream.pack = pack

        def command(j, reset, action):
            waiting[j] = True
            stream.expect(None)  # each env times its own answer; the ingress warns about a silent host
            stream.send((j, reset, action))

        return command

    def _read_loop(self, block, stream):
        """Reads the host's record batches and hands each record to its env, until the stream
        ends; then the host is lost."""
        codec, waiting, inbox = self._codec, stream.waiting, block.inbox
        exc = HostLost("the host ended its stream")
        try:
            for data in stream.requests:
                try:
                    envs, sts, rewards, obs = codec.unpack_records(data)
                except ValueError as err:
                    raise ProtocolError(str(err)) from None
                if not waiting[envs].all() or len(np.unique(envs)) != len(envs):
                    raise ProtocolError("a record for an env with no command to answer (sent before its command, or "
                                        "a second answer to one)")
                waiting[envs] = False
                if not waiting.any():
                    stream.answered()
                keys = list(obs)
                for i, j in enumerate(envs.tolist()):
                    inbox[j].put((stream, int(sts[i]), float(rewards[i]), {key: obs[key][i] for key in keys}))
        except ProtocolError as err:
            exc = err
        except Exception as err:  # noqa: BLE001 - grpc raises its RpcError (cancelled, reset) here
            exc = HostLost(f"the host's stream failed ({type(err).__name__}: {err})")
        self.lose(block, stream, exc)

    def wait_host(self, block):
        with self._cond:
            wait_for_host(self._cond, lambda: block.stream is not None or self._closed, self._where(), self.address)
            if block.stream is None:
                raise RuntimeError(f"{self._where()} were closed while waiting for a host.")
            return block.stream

    def lose(self, block, stream, exc) -> None:
        """Frees ``block`` from ``stream`` (once) and wakes its envs waiting for records."""
        with self._cond:
            if stream.lost is not None:
                return
            stream.lost = exc
            if block.stream is stream:
                block.stream = None
            self.hosts_lost += 1
        end_stream(stream, exc, self._closed, self._where())
        for inbox in block.inbox:
            inbox.put((stream, None, None, None))

    def close(self) -> None:
        """Ends the hosts' streams; envs waiting for a host raise. Idempotent."""
        with self._cond:
            self._closed = True
            held = [(block, block.stream) for block in self._blocks if block.stream is not None]
            self._cond.notify_all()
        for block, stream in held:
            self.lose(block, stream, HostLost("the pool closed"))

    def leave(self, env) -> None:
        with self._lock:
            if self.members.get(env.position) is env:
                del self.members[env.position]
            if self.members:
                return
            if self._by_address.get(self.address) is self:
                del self._by_address[self.address]
        self.close()
        if self._ingress is not None:
            self._ingress.leave(self)
            self._ingress = None
