"""Pool side of protocol 2: ``k`` slots fed by env hosts of ``h`` envs each, one stream per host.

A :class:`RemoteVectorSlot` is a :class:`gymnasium.vector.VectorEnv` of ``k`` envs, so a pool
factory that returns one gets ``k`` consecutive slots in one worker, stepped in lockstep (see
"Vectorized simulators" in the quickstart): one ``step`` sends each of its ``k / h`` hosts the
commands of its ``h`` envs in one message and returns their records, decoded from the messages'
bytes as numpy views that the worker copies into the slots' rows (one host: straight from the
message; several: through one concatenation). Per record, the ingress costs a share of one
gRPC message and a few numpy operations instead of a message of its own.
"""
from __future__ import annotations

import logging
import threading
import time

import gymnasium as gym
import numpy as np

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.remote.ingress import (
    BlockIngress, HostLost, Ingress, ProtocolError, check_slot_arguments, end_stream,
)
from torchrl_asyncpool.step_type import StepType

__all__ = ["RemoteVectorSlot"]

_log = logging.getLogger("torchrl_asyncpool.remote")
_FIRST, _MID, _TERM, _TRUNC = (int(s) for s in StepType)


class RemoteVectorSlot(BlockIngress, gym.vector.VectorEnv):
    """``num_envs`` pool slots fed by remote env hosts of ``host_envs`` envs each (protocol 2).

    Return one from a ``create_env_fn`` factory of an :class:`~torchrl_asyncpool.AsyncEnvPool`
    or :class:`~torchrl_asyncpool.AsyncPoolCollector`: the pool sees a vector env of
    ``num_envs`` envs, hosted by one worker in ``num_envs`` consecutive slots. That worker
    listens on ``address`` for ``num_envs / host_envs`` hosts; each host that connects
    (:class:`~torchrl_asyncpool.remote.VectorEnvHost`, ``torchrl-asyncpool env-host --protocol 2
    --num-envs K``, or any client of ``env_host.proto``) declares ``host_envs`` envs and the
    per-env spec, which must equal this slot's, and takes the first free block of ``host_envs``
    consecutive envs. Each pass of the worker sends every host one message with a command per
    env (its action, or a reset after a terminal record) and returns all hosts' records: the
    hosts step at the same time, so several hosts per slot add records per pass, not latency.

    Each factory needs an address of its own (one worker, one gRPC server per address); a
    worker's first reset waits for all its hosts, so the pool's start-up (``start_timeout``)
    lasts until every block has a host. Episodes follow the pool's contract: a host that drops
    mid-episode ends every open episode of its block with a ``TRUNCATION`` record (last
    observation, reward 0; envs whose record was terminal get the next host's ``FIRST``
    instead), and the next host that connects takes the block over. Nothing received is
    unpickled.

    Args:
        address (str): ``"host:port"`` to listen on.
        observation_space (gymnasium.spaces.Space): one env's observation space.
        action_space (gymnasium.spaces.Space): one env's action space.
        num_envs (int): the envs of this slot (pool slots).

    Keyword Args:
        host_envs (int, optional): the envs of each host; ``num_envs`` must be a multiple.
            Defaults to ``num_envs`` (one host).
        token (str, optional): as :class:`~torchrl_asyncpool.remote.RemoteEnvSlot`'s.
        step_timeout (float, optional): seconds a host may take to answer a pass (all its
            envs) or to send its first records; past it, the host is dropped. Defaults to
            ``None``.

    Attributes:
        hosts_connected (int): hosts that took this slot so far (in the worker process).
        hosts_lost (int): hosts that dropped, hung or broke the protocol while holding it.

    Examples:
        >>> import gymnasium as gym
        >>> from torchrl_asyncpool.remote import RemoteVectorSlot
        >>> slot = RemoteVectorSlot.like(gym.make("CartPole-v1"), "localhost:50061", num_envs=32)
        >>> slot.num_envs, slot.single_action_space
        (32, Discrete(2))

        In a pool (each host runs ``torchrl-asyncpool env-host --protocol 2 --num-envs 32
        --env-id CartPole-v1 --address POOL_MACHINE:5006i``)::

            make = [functools.partial(RemoteVectorSlot.like, gym.make("CartPole-v1"), f"0.0.0.0:{50061 + i}",
                                      num_envs=32) for i in range(4)]
            collector = AsyncPoolCollector(make, policy=policy, frames_per_batch=4096)  # 128 envs
    """

    metadata = {"render_modes": [], "autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(self, address: str, observation_space, action_space, num_envs: int, *,
                 host_envs: int | None = None, token: str | None = None, step_timeout: float | None = None):
        host_envs = check_slot_arguments(address, token, step_timeout, num_envs, host_envs)
        self.address = address
        self.step_timeout = None if step_timeout is None else float(step_timeout)
        self.num_envs, self.host_envs = num_envs, host_envs
        self.single_observation_space = observation_space
        self.single_action_space = action_space
        self.observation_space = gym.vector.utils.batch_space(observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(action_space, num_envs)
        self._spec = P.spec_of_spaces(observation_space, action_space)
        self._codec = P.BatchCodec(self._spec, host_envs)
        self._keys = list(self._spec["observation"])
        self._dict_obs = isinstance(observation_space, gym.spaces.Dict)
        self._token = token
        self.index = -1  # for the ingress's ordering and messages; the pool's slot indices are not known here
        self.hosts_connected = self.hosts_lost = 0
        self._cond = threading.Condition()
        self._blocks = [_Block(b * host_envs, host_envs) for b in range(num_envs // host_envs)]
        self._ingress = None
        self._closed = False

    @classmethod
    def like(cls, env, address: str, num_envs: int, **kwargs) -> "RemoteVectorSlot":
        """A slot of ``num_envs`` envs laid out as ``env`` (a gymnasium env or a TorchRL env with
        an empty batch size; only read). ``kwargs`` are the constructor's keyword arguments."""
        from torchrl_asyncpool.remote.torchrl_env import as_gymnasium

        env = as_gymnasium(env)
        return cls(address, env.observation_space, env.action_space, num_envs, **kwargs)

    @classmethod
    def per_env(cls, env, address: str, num_envs: int, **kwargs) -> list:
        """The same envs as ``like(env, address, num_envs, **kwargs)``, as ``num_envs`` pool
        factories of single envs instead of one vector env: the pool hosts them in one worker,
        one thread each, and publishes each env's record as soon as its host sent it (a
        :class:`RemoteVectorSlot` is stepped in lockstep: a pass waits for the slowest env of
        all its hosts). Same hosts, same wire: for envs of uneven step time (simulators,
        envs that sleep or wait on I/O) whose hosts step their envs one by one (a
        :class:`~torchrl_asyncpool.remote.VectorEnvHost` of a list of envs; a host stepping a
        vector env together gathers a command for each of its envs first). ``kwargs``:
        ``host_envs``, ``token``, ``step_timeout`` (per env).

        Examples:
            >>> import gymnasium as gym
            >>> from torchrl_asyncpool.remote import RemoteVectorSlot
            >>> make = RemoteVectorSlot.per_env(gym.make("CartPole-v1"), "localhost:50061", num_envs=32, host_envs=16)
            >>> len(make), make[5]().position
            (32, 5)
        """
        import functools

        from torchrl_asyncpool.remote.env_of_host import RemoteEnvOfHost

        RemoteEnvOfHost.like(env, address, 0, num_envs, **kwargs)  # checks the arguments once, here
        return [functools.partial(RemoteEnvOfHost.like, env, address, j, num_envs, **kwargs) for j in range(num_envs)]

    # -- gymnasium vector API -------------------------------------------------------------------
    def reset(self, *, seed=None, options=None):
        """Starts listening (first call), waits for a host of every block and returns their
        ``FIRST`` records of all ``num_envs`` envs.

        Raises:
            ValueError: for a ``seed`` or ``options``: the hosts own their envs and their resets.
        """
        if seed is not None or options:
            raise ValueError(f"{self._where()}: a remote host owns its envs and their resets; a seed or reset "
                             "options cannot be applied from the pool (seed the envs on the host).")
        if self._ingress is None:
            self._ingress = Ingress.join(self)
            # the worker stepping this slot waits on the network, not on a core of its own: its
            # waits must block (a pool idle-polls the workers of vector envs on machines whose
            # idle cores wake slowly, which here only burnt ingress CPU: 13-16 us per record, not 9)
            from torchrl_asyncpool.exchange.doorbell import set_process_idle_poll

            set_process_idle_poll(False)
        parts = []
        for block in self._blocks:
            parts.append(self._first_records(block))
            block.ended[:] = False
        return self._out(self._join([p for p in parts])), {}

    def step(self, actions):
        """Sends each host one command per env of its block (``actions``' row, or a reset for an
        env whose last record was terminal) and returns all records ``(obs, reward,
        terminated, truncated, info)``; a host lost meanwhile ends the open episodes of its
        block truncated (``info["host_lost"]``)."""
        for block in self._blocks:  # every host steps while the pool waits for the first one's records
            block.sent = False
            # a host that took the block since the last pass has sent its FIRST records unasked: they
            # answer this pass (every env of the block ended at the last one), it gets no command now
            if block.stream is not None and block.stream.greeted:
                try:
                    block.stream.send(self._codec.pack_commands(block.everyone, block.ended,
                                                                actions[block.start:block.stop]))
                    block.sent = True
                except HostLost as exc:
                    block.lost = exc
        obs, rewards, terminated, truncated, lost = [], [], [], [], False
        for block in self._blocks:
            part = self._block_step(block)
            lost = lost or part[4]
            for out, value in zip((obs, rewards, terminated, truncated), part):
                out.append(value)
        info = {"host_lost": True} if lost else {}
        if len(self._blocks) == 1:
            return self._out(obs[0]), rewards[0], terminated[0], truncated[0], info
        return (self._out(self._join(obs)), np.concatenate(rewards), np.concatenate(terminated),
                np.concatenate(truncated), info)

    def close(self, **kwargs):
        """Lets go of the hosts (their streams end) and stops listening. Idempotent."""
        with self._cond:
            self._closed = True
            streams = [block.stream for block in self._blocks]
            for block in self._blocks:
                block.stream = None
            self._cond.notify_all()
        for stream in streams:
            if stream is not None:
                stream.end()
        if self._ingress is not None:
            self._ingress.leave(self)
            self._ingress = None

    # -- internals --------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"the remote vector slot of {self.num_envs} envs on {self.address}"

    def _out(self, obs):
        return obs if self._dict_obs else obs["observation"]

    def _join(self, parts):
        if len(parts) == 1:
            return parts[0]
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def _block_step(self, block):
        """``(obs, rewards, terminated, truncated, lost)`` of one block's pass."""
        h = self.host_envs
        zeros = np.zeros(h, bool)
        if not block.sent and block.lost is None:
            # lost at the last pass: every env of the block ended there; the next host's FIRST records follow
            obs = self._first_records(block)
            block.ended = np.zeros(h, bool)
            return obs, np.zeros(h), zeros, zeros, False
        ended = block.ended
        try:
            if block.lost is not None:
                raise block.lost
            obs, rewards, sts = self._read_pass(block.stream, ended)
        except HostLost as exc:
            block.lost = None
            self._lose(block, block.stream, exc)
            return self._lost(block, ended)
        block.ended = (sts == _TERM) | (sts == _TRUNC)
        block.last_obs = obs
        return obs, rewards, sts == _TERM, sts == _TRUNC, False

    def _attach(self, stream) -> bool:
        with self._cond:
            if self._closed:
                return False
            for block in self._blocks:
                if block.stream is None:
                    block.stream = stream
                    stream.accept_index = block.start  # the accept says where the host's envs start
                    stream.greeted = False  # its FIRST records, sent unasked, are not read yet
                    self.hosts_connected += 1
                    self._cond.notify_all()
                    break
            else:
                return False
        _log.info("%s: host %s connected (envs %d..%d)", self._where(), stream.peer, block.start, block.stop - 1)
        return True

    def _wait_host(self, block):
        with self._cond:
            while block.stream is None:
                if self._closed:
                    raise RuntimeError(f"{self._where()} was closed while waiting for a host.")
                self._cond.wait()
            return block.stream

    def _first_records(self, block):
        """The FIRST records of a block's envs from the host holding it, or the next one."""
        while True:
            stream = self._wait_host(block)
            try:
                obs, _, _ = self._read_pass(stream, np.ones(self.host_envs, bool))
            except HostLost as exc:
                self._lose(block, stream, exc)
                continue
            stream.greeted = True
            block.last_obs = obs
            return obs

    def _lost(self, block, ended):
        """A block's records after its host was lost: the open episodes end TRUNCATION (last
        observation, reward 0); envs whose last record was terminal need a FIRST record, which
        only the next host can give (waited for here)."""
        h = self.host_envs
        obs = {key: np.array(v) for key, v in block.last_obs.items()}
        if ended.any():
            first = self._first_records(block)
            for key in obs:
                obs[key][ended] = first[key][ended]
        truncated = ~ended
        block.ended = truncated  # the truncated envs' next records are FIRST (a reset to the next host)
        block.last_obs = obs
        return obs, np.zeros(h), np.zeros(h, bool), truncated, True

    def _read_pass(self, stream, resets):
        """Reads record batches until every env of the host has answered its command; returns
        ``(obs, rewards, step types)`` in env order."""
        k = self.host_envs
        everyone = self._blocks[0].everyone
        got = None
        obs = rewards = sts = None
        while True:
            data = self._next(stream)
            try:
                envs, st, rew, part = self._codec.unpack_records(data)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            if got is None and len(envs) == k and (envs == everyone).all():
                obs, rewards, sts = part, rew, st  # the usual pass: views of the message, no copy
                break
            if got is None:
                got = np.zeros(k, bool)
                obs = {key: np.empty((k, *v.shape[1:]), v.dtype) for key, v in part.items()}
                rewards, sts = np.zeros(k), np.zeros(k, np.uint8)
            if got[envs].any() or len(np.unique(envs)) != len(envs):
                raise ProtocolError("a second record for an env before its next command")
            got[envs] = True
            for key, v in part.items():
                obs[key][envs] = v
            rewards[envs], sts[envs] = rew, st
            if got.all():
                break
        first = sts == _FIRST
        if (first != resets).any():
            j = int(np.flatnonzero(first != resets)[0])
            raise ProtocolError(f"env {j}: a record answering {'a reset' if resets[j] else 'an action'} has step "
                                 f"type {int(sts[j])}; {'only' if resets[j] else 'not'} FIRST (0) answers a reset")
        return obs, rewards, sts

    def _next(self, stream):
        if self.step_timeout is not None:  # the ingress's watchdog cancels the call past it
            stream.deadline = time.monotonic() + self.step_timeout
        try:
            return next(stream.requests)
        except StopIteration:
            raise HostLost("the host ended its stream") from None
        except Exception as exc:  # noqa: BLE001 - grpc raises its RpcError (cancelled, reset) here
            why = (f"no answer within step_timeout={self.step_timeout:g}s" if stream.timed_out
                   else f"the host's stream failed ({type(exc).__name__}: {exc})")
            raise HostLost(why) from None
        finally:
            stream.deadline = None

    def _lose(self, block, stream, exc):
        with self._cond:
            if block.stream is stream:
                block.stream = None
        if stream is not None:
            self.hosts_lost += 1
            end_stream(stream, exc, self._closed, self._where())


class _Block:
    """The envs ``start .. start + n - 1`` of a vector slot, fed by one host."""

    def __init__(self, start: int, n: int):
        self.start, self.stop = start, start + n
        self.everyone = np.arange(n)
        self.stream = None
        self.ended = np.zeros(n, bool)  # the env's last record was terminal: its next one is FIRST
        self.last_obs = None
        self.sent = False  # the commands of the pass in progress went out
        self.lost = None  # the HostLost met while sending them
