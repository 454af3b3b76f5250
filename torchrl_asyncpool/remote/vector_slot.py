"""Pool side of protocol 2: ``k`` slots fed by env hosts of ``h`` envs each, one stream per host.

A :class:`RemoteVectorSlot` is a :class:`gymnasium.vector.VectorEnv` of ``k`` envs, so a pool
factory that returns one gets ``k`` consecutive slots in one worker (see "Vectorized
simulators" in the quickstart), stepped block by block: each of its ``k / h`` hosts gets the
commands of its ``h`` envs in one message once the pool has answered them all, and its
records, decoded from the message's bytes as numpy views, are copied into the slots' rows as
soon as they have all come (:meth:`RemoteVectorSlot.step_some`; a reader thread per host
files them). Per record, the ingress costs a share of one gRPC message and a few numpy
operations instead of a message of its own, and a slow or lost host holds only its block.
"""
from __future__ import annotations

import collections
import logging
import os
import threading

import gymnasium as gym
import numpy as np

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.remote.ingress import (
    BlockIngress, HostLost, Ingress, ProtocolError, check_slot_arguments, end_stream, wait_for_host,
)
from torchrl_asyncpool.step_type import StepType

__all__ = ["RemoteVectorSlot"]

_log = logging.getLogger("torchrl_asyncpool.remote")
_FIRST, _MID, _TERM, _TRUNC = (int(s) for s in StepType)
_LOST = "lost"  # a block's event: its host was lost


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
    lasts until every block has a host. Each block goes at its own pace (partial steps, see
    :meth:`step_some`): a slow, silent or lost host holds only its own envs. Episodes follow
    the pool's contract: a host that drops mid-episode ends every open episode of its block
    at once with a ``TRUNCATION`` record (last observation, reward 0), and the next host that
    connects takes the block over, every env of it starting with that host's ``FIRST``
    record. Records that answer no command end the host with ``INVALID_ARGUMENT``. Nothing
    received is unpickled.

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
            ``None``: a host is never dropped for being slow, and one that has owed an
            answer for :data:`~torchrl_asyncpool.remote.ingress.SILENT_HOST_WARN_S` seconds is
            reported by a warning.

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

    # partial steps: a step returns the blocks whose hosts answered (info["answered"]), so a
    # slow, silent or lost host holds only its own envs
    metadata = {"render_modes": [], "autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP, "partial_steps": True}

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
        self._signal = None  # (read, write) ends of the pipe behind fileno()
        self._signalled = False

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
        :class:`RemoteVectorSlot` steps a host's block together: a pass waits for the slowest
        env of the host). Same hosts, same wire: for envs of uneven step time (simulators,
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
        with self._cond:
            for block in self._blocks:
                while True:  # a host lost before its FIRST records: the next one's
                    wait_for_host(self._cond, lambda: bool(block.events) or self._closed, self._where(),
                                  self.address, connected=lambda: block.stream is not None)
                    if not block.events:
                        self._wait()  # closed: raises
                    event = block.events.popleft()
                    if event is not _LOST:
                        break
                parts.append(self._take(block, event)[0])
        return self._out(self._join(parts)), {}

    def step(self, actions):
        """Sends each host whose last records were taken one command per env of its block
        (``actions``' row, or a reset for an env whose last record was terminal), waits until
        at least one block has answered or lost its host, and returns the records of those
        blocks ``(obs, reward, terminated, truncated, info)``; ``info["answered"]`` marks their
        envs (the other rows hold no record: theirs come in a later step, and their actions
        are not sent again until then). A host lost meanwhile ends the open episodes of its
        block truncated (``info["host_lost"]``); its envs' next records are the next host's
        ``FIRST`` records."""
        with self._cond:
            self._command_free(actions, None)
            while not any(block.events for block in self._blocks):
                self._wait()
            return self._collect(None)

    def step_some(self, actions, ready):
        """The pool's step, which never waits. ``ready`` (bool ``[num_envs]``) marks the envs
        whose last record the pool has answered (their row of ``actions`` is that answer).
        Sends the commands of each free host whose envs are all ready, then returns the records
        that have come for envs that are ready, as :meth:`step` does (``info["answered"]`` marks
        them; it may mark none). :meth:`fileno` becomes readable when more records come."""
        with self._cond:
            if self._signalled:
                os.read(self._signal[0], 4096)
                self._signalled = False
            self._command_free(actions, ready)
            return self._collect(ready)

    def fileno(self) -> int:
        """A descriptor that becomes readable when a host's records (or its loss) are ready for
        :meth:`step_some`; the pool's worker waits on it next to its doorbell."""
        with self._cond:
            if self._signal is None:
                self._signal = os.pipe()
                for fd in self._signal:
                    os.set_blocking(fd, False)
                self._signalled = False
                if any(block.events for block in self._blocks):
                    self._ring()
            return self._signal[0]

    def close(self, **kwargs):
        """Lets go of the hosts (their streams end) and stops listening. Idempotent."""
        with self._cond:
            self._closed = True
            streams = [block.stream for block in self._blocks]
            for block in self._blocks:
                block.stream = None
            self._cond.notify_all()
            signal, self._signal = self._signal, None
        for fd in signal or ():
            os.close(fd)
        for stream in streams:
            if stream is not None:
                stream.end()
        if self._ingress is not None:
            self._ingress.leave(self)
            self._ingress = None

    # -- internals (the caller holds self._cond where a method waits or reads a block) ------------
    def _where(self) -> str:
        return f"the remote vector slot of {self.num_envs} envs on {self.address}"

    def _out(self, obs):
        return obs if self._dict_obs else obs["observation"]

    def _join(self, parts):
        if len(parts) == 1:
            return parts[0]
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def _wait(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._where()} was closed while waiting for its hosts.")
        self._cond.wait()

    def _command_free(self, actions, ready) -> None:
        """Commands every free host (its last records taken) whose envs all have an action
        (``ready``; ``None``: all do)."""
        for block in self._blocks:  # every free host steps while the pool waits for the first one
            if block.stream is None or block.events or block.pending.any():
                continue
            if ready is None or ready[block.start:block.stop].all():
                self._command(block, actions[block.start:block.stop])

    def _ring(self) -> None:
        """Makes :meth:`fileno` readable (once until :meth:`step_some` drains it)."""
        if self._signal is not None and not self._signalled:
            os.write(self._signal[1], b"x")
            self._signalled = True

    def _command(self, block, actions) -> None:
        """Sends ``block``'s host one command per env (a reset where its last record ended)."""
        stream = block.stream
        block.pending[:] = True  # before sending: the answer may come at once
        block.resets = block.ended.copy()
        stream.expect(self.step_timeout)
        try:
            stream.send(self._codec.pack_commands(block.everyone, block.resets, actions))
        except HostLost:
            pass  # the call has ended: its reader loses the host

    def _take(self, block, event):
        """A complete pass of ``block`` (``(obs, rewards, step types)``), as the pool takes it."""
        obs, rewards, sts = event
        block.ended = (sts == _TERM) | (sts == _TRUNC)
        block.last_obs = obs
        return obs, rewards, sts

    def _collect(self, ready):
        """The step's records: every block that answered or lost its host and whose envs are
        all ``ready`` (``None``: all are; see :meth:`step_some`)."""
        k = self.num_envs
        answered, lost = np.zeros(k, bool), False
        rewards, sts = np.zeros(k), np.full(k, _MID, np.uint8)
        parts = []
        for block in self._blocks:
            rows = slice(block.start, block.stop)
            take = block.events and (ready is None or ready[rows].all())
            event = block.events.popleft() if take else None
            if event is _LOST:
                obs, sts[rows], answered[rows] = self._lost(block)
                lost = True
            elif event is not None:  # a host's records, even if it was lost since (they stand)
                obs, rewards[rows], sts[rows] = self._take(block, event)
                answered[rows] = True
            else:
                obs = block.last_obs  # no record: rows the pool ignores
            parts.append(obs)
        info = {"answered": answered}
        if lost:
            info["host_lost"] = True
        return self._out(self._join(parts)), rewards, sts == _TERM, sts == _TRUNC, info

    def _lost(self, block):
        """A block's records after its host was lost: its open episodes end TRUNCATION (last
        observation, reward 0); the envs whose last record ended wait for the next host's
        ``FIRST`` records, as every env of the block does after this step.
        Returns ``(obs, step types, answered)``."""
        truncated = ~block.ended
        block.ended = np.ones(self.host_envs, bool)
        return block.last_obs, np.where(truncated, _TRUNC, _MID).astype(np.uint8), truncated

    def _attach(self, stream) -> bool:
        with self._cond:
            if self._closed:
                return False
            block = next((b for b in self._blocks if b.stream is None), None)
            if block is None:
                return False
            block.stream = stream
            stream.accept_index = block.start  # the accept says where the host's envs start
            block.pending[:] = block.resets[:] = True  # its FIRST records come unasked
            stream.expect(self.step_timeout)
            self.hosts_connected += 1
        _log.info("%s: host %s connected (envs %d..%d)", self._where(), stream.peer, block.start, block.stop - 1)
        threading.Thread(target=self._read_loop, args=(block, stream), name="env-host-reader", daemon=True).start()
        return True

    def _read_loop(self, block, stream) -> None:
        """Reads the host's record batches into ``block`` until the stream ends; then the host is lost."""
        exc = HostLost("the host ended its stream")
        try:
            for data in stream.requests:
                try:
                    envs, st, rew, part = self._codec.unpack_records(data)
                except ValueError as err:
                    raise ProtocolError(str(err)) from None
                with self._cond:
                    if block.stream is not stream:
                        return
                    self._receive(block, stream, envs, st, rew, part)
        except ProtocolError as err:
            exc = err
        except Exception as err:  # noqa: BLE001 - grpc raises its RpcError (cancelled, reset) here
            exc = HostLost(f"no answer within step_timeout={self.step_timeout:g}s" if stream.timed_out
                           else f"the host's stream failed ({type(err).__name__}: {err})")
        self._lose(block, stream, exc)

    def _receive(self, block, stream, envs, st, rew, part) -> None:
        """Files one record batch of ``block``'s host; a pass that every env answered becomes
        an event of the block. Records that answer no command are refused (ProtocolError)."""
        pending = block.pending
        if len(np.unique(envs)) != len(envs) or not pending[envs].all():
            raise ProtocolError("a record for an env with no command to answer (sent before its command, or a "
                                "second answer to one)")
        k = self.host_envs
        if pending.all() and len(envs) == k and (envs == block.everyone).all():
            block.buffer = part, rew, st  # the usual pass: views of the message, no copy
        else:
            if pending.all():
                block.buffer = ({key: np.empty((k, *v.shape[1:]), v.dtype) for key, v in part.items()},
                                np.zeros(k), np.zeros(k, np.uint8))
            obs, rewards, sts = block.buffer
            for key, v in part.items():
                obs[key][envs] = v
            rewards[envs], sts[envs] = rew, st
        pending[envs] = False
        if pending.any():
            return
        obs, rewards, sts = block.buffer
        block.buffer = None
        wrong = (sts == _FIRST) != block.resets
        if wrong.any():
            j = int(np.flatnonzero(wrong)[0])
            raise ProtocolError(f"env {j}: a record answering {'a reset' if block.resets[j] else 'an action'} has "
                                f"step type {int(sts[j])}; {'only' if block.resets[j] else 'not'} FIRST (0) answers "
                                "a reset")
        stream.answered()
        block.events.append((obs, rewards, sts))
        self._cond.notify_all()
        self._ring()

    def _lose(self, block, stream, exc) -> None:
        with self._cond:
            if block.stream is not stream:
                return
            block.stream = None
            block.pending[:] = False
            block.buffer = None
            if not self._closed:
                block.events.append(_LOST)
                self._ring()
            self.hosts_lost += 1
            self._cond.notify_all()
        end_stream(stream, exc, self._closed, self._where())


class _Block:
    """The envs ``start .. start + n - 1`` of a vector slot, fed by one host at a time; its
    fields change under the slot's lock."""

    def __init__(self, start: int, n: int):
        self.start, self.stop = start, start + n
        self.everyone = np.arange(n)
        self.stream = None
        self.ended = np.ones(n, bool)  # the env's last record was terminal: its next one is FIRST
        self.last_obs = None
        self.pending = np.zeros(n, bool)  # the env owes a record (its command, or the FIRST of a new host)
        self.resets = np.ones(n, bool)  # the env's pending record answers a reset: it must be FIRST
        self.buffer = None  # the pass being received
        # what the pool has not taken yet, in order: complete passes (obs, rewards, step types)
        # and _LOST (the host was lost: the open episodes end); at most one per step
        self.events = collections.deque()
