"""Pool side of protocol 2: ``k`` slots fed by one env host of ``k`` envs over one stream.

A :class:`RemoteVectorSlot` is a :class:`gymnasium.vector.VectorEnv` of ``k`` envs, so a pool
factory that returns one gets ``k`` consecutive slots in one worker, stepped in lockstep (see
"Vectorized simulators" in the quickstart): one ``step`` sends the host the ``k`` commands in
one message and returns its ``k`` records, decoded from the message's bytes as numpy views that
the worker copies straight into the slots' rows. Per record, the ingress costs a share of one
gRPC message and a few numpy operations instead of a message of its own.
"""
from __future__ import annotations

import logging
import threading
import time

import gymnasium as gym
import numpy as np

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.remote.slot import _check_address, _HostLost, _Ingress, _ProtocolError
from torchrl_asyncpool.step_type import StepType

__all__ = ["RemoteVectorSlot"]

_log = logging.getLogger("torchrl_asyncpool.remote")
_FIRST, _MID, _TERM, _TRUNC = (int(s) for s in StepType)


class RemoteVectorSlot(gym.vector.VectorEnv):
    """``num_envs`` pool slots fed by one remote env host of ``num_envs`` envs (protocol 2).

    Return one from a ``create_env_fn`` factory of an :class:`~torchrl_asyncpool.AsyncEnvPool`
    or :class:`~torchrl_asyncpool.AsyncPoolCollector`: the pool sees a vector env of
    ``num_envs`` envs, hosted by one worker in ``num_envs`` consecutive slots. That worker
    listens on ``address``; a host that connects (:class:`~torchrl_asyncpool.remote.VectorEnvHost`,
    ``torchrl-asyncpool env-host --protocol 2 --num-envs K``, or any client of ``env_host.proto``)
    declares ``num_envs`` envs and the per-env spec, which must equal this slot's. Each pass of
    the worker sends the host one message with a command per env (its action, or a reset after a
    terminal record) and returns the host's records of all ``num_envs`` envs.

    Each factory needs an address of its own (one worker, one gRPC server per address); a
    worker's first reset waits for its host, so the pool's start-up (``start_timeout``) lasts
    until every address has a host. Episodes follow the pool's contract: a host that drops
    mid-episode ends every open episode with a ``TRUNCATION`` record (last observation, reward
    0; envs whose record was terminal get the next host's ``FIRST`` instead), and the next host
    that connects takes the slots over. Nothing received is unpickled.

    Args:
        address (str): ``"host:port"`` to listen on.
        observation_space (gymnasium.spaces.Space): one env's observation space.
        action_space (gymnasium.spaces.Space): one env's action space.
        num_envs (int): the envs of the host this slot takes.

    Keyword Args:
        token (str, optional): as :class:`~torchrl_asyncpool.remote.RemoteEnvSlot`'s.
        step_timeout (float, optional): seconds the host may take to answer a pass (all its
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
                 token: str | None = None, step_timeout: float | None = None):
        _check_address(address)
        if token is not None and not isinstance(token, str):
            raise TypeError(f"token must be a str or None, got {type(token).__name__}.")
        if token == "":
            raise ValueError("token='' would accept hosts that send no token; pass a non-empty token, or None "
                             "for no check.")
        if step_timeout is not None and (isinstance(step_timeout, bool) or not step_timeout > 0):
            raise ValueError(f"step_timeout must be a positive number of seconds or None, got {step_timeout!r}.")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or not 0 < num_envs <= P.MAX_BATCH_ENVS:
            raise ValueError(f"num_envs must be an int in 1..{P.MAX_BATCH_ENVS}, got {num_envs!r}.")
        self.address = address
        self.step_timeout = None if step_timeout is None else float(step_timeout)
        self.num_envs = num_envs
        self.single_observation_space = observation_space
        self.single_action_space = action_space
        self.observation_space = gym.vector.utils.batch_space(observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(action_space, num_envs)
        self._spec = P.spec_of_spaces(observation_space, action_space)
        self._codec = P.BatchCodec(self._spec, num_envs)
        self._keys = list(self._spec["observation"])
        self._dict_obs = isinstance(observation_space, gym.spaces.Dict)
        self._token = token
        self.index = -1  # the pool's slot indices are not known here; the accept says -1
        self.hosts_connected = self.hosts_lost = 0
        self._cond = threading.Condition()
        self._stream = None
        self._ingress = None
        self._closed = False
        self._ended = np.zeros(num_envs, bool)  # the env's last record was terminal: its next one is FIRST
        self._last_obs = None
        self._everyone = np.arange(num_envs)

    @classmethod
    def like(cls, env, address: str, num_envs: int, **kwargs) -> "RemoteVectorSlot":
        """A slot of ``num_envs`` envs laid out as ``env`` (a gymnasium env or a TorchRL env with
        an empty batch size; only read). ``kwargs`` are the constructor's keyword arguments."""
        from torchrl_asyncpool.remote.torchrl_env import as_gymnasium

        env = as_gymnasium(env)
        return cls(address, env.observation_space, env.action_space, num_envs, **kwargs)

    # -- gymnasium vector API -------------------------------------------------------------------
    def reset(self, *, seed=None, options=None):
        """Starts listening (first call), waits for a host and returns its ``FIRST`` records of
        all ``num_envs`` envs.

        Raises:
            ValueError: for a ``seed`` or ``options``: the host owns its envs and their resets.
        """
        if seed is not None or options:
            raise ValueError(f"{self._where()}: a remote host owns its envs and their resets; a seed or reset "
                             "options cannot be applied from the pool (seed the envs on the host).")
        if self._ingress is None:
            self._ingress = _Ingress.join(self)
        obs = self._first_records()
        self._ended[:] = False
        return self._out(obs), {}

    def step(self, actions):
        """Sends the host one command per env (``actions``' row, or a reset for an env whose last
        record was terminal) and returns its records ``(obs, reward, terminated, truncated,
        info)``; a host lost meanwhile ends the open episodes truncated (``info["host_lost"]``)."""
        ended = self._ended
        stream = self._stream
        if stream is None:  # lost at the last pass: every env ended there, the next host's FIRST records follow
            obs = self._first_records()
            self._ended = np.zeros(self.num_envs, bool)
            zeros = np.zeros(self.num_envs, bool)
            return self._out(obs), np.zeros(self.num_envs), zeros, zeros, {}
        try:
            stream.send(self._codec.pack_commands(self._everyone, ended, actions))
            obs, rewards, sts = self._read_pass(stream, ended)
        except _HostLost as exc:
            self._lose(stream, exc)
            return self._lost(ended)
        self._ended = (sts == _TERM) | (sts == _TRUNC)
        self._last_obs = obs
        return self._out(obs), rewards, sts == _TERM, sts == _TRUNC, {}

    def close(self, **kwargs):
        """Lets go of the host (its stream ends) and stops listening. Idempotent."""
        with self._cond:
            self._closed = True
            stream, self._stream = self._stream, None
            self._cond.notify_all()
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

    def _attach(self, stream) -> bool:
        with self._cond:
            if self._stream is not None or self._closed:
                return False
            self._stream = stream
            self.hosts_connected += 1
            self._cond.notify_all()
        _log.info("%s: host %s connected", self._where(), stream.peer)
        return True

    def _wait_host(self):
        with self._cond:
            while self._stream is None:
                if self._closed:
                    raise RuntimeError(f"{self._where()} was closed while waiting for a host.")
                self._cond.wait()
            return self._stream

    def _first_records(self):
        """The FIRST records of all envs from the host holding the slot, or the next one."""
        while True:
            stream = self._wait_host()
            try:
                obs, _, _ = self._read_pass(stream, np.ones(self.num_envs, bool))
            except _HostLost as exc:
                self._lose(stream, exc)
                continue
            self._last_obs = obs
            return obs

    def _lost(self, ended):
        """The pass's records after the host was lost: the open episodes end TRUNCATION (last
        observation, reward 0); envs whose last record was terminal need a FIRST record, which
        only the next host can give (waited for here)."""
        k = self.num_envs
        obs = {key: np.array(v) for key, v in self._last_obs.items()}
        if ended.any():
            first = self._first_records()
            for key in obs:
                obs[key][ended] = first[key][ended]
        truncated = ~ended
        self._ended = truncated  # the truncated envs' next records are FIRST (a reset to the next host)
        self._last_obs = obs
        return self._out(obs), np.zeros(k), np.zeros(k, bool), truncated, {"host_lost": True}

    def _read_pass(self, stream, resets):
        """Reads record batches until every env has answered its command; returns ``(obs,
        rewards, step types)`` in env order."""
        k = self.num_envs
        got = None
        obs = rewards = sts = None
        while True:
            data = self._next(stream)
            try:
                envs, st, rew, part = self._codec.unpack_records(data)
            except ValueError as exc:
                raise _ProtocolError(str(exc)) from None
            if got is None and len(envs) == k and (envs == self._everyone).all():
                obs, rewards, sts = part, rew, st  # the usual pass: views of the message, no copy
                break
            if got is None:
                got = np.zeros(k, bool)
                obs = {key: np.empty((k, *v.shape[1:]), v.dtype) for key, v in part.items()}
                rewards, sts = np.zeros(k), np.zeros(k, np.uint8)
            if got[envs].any() or len(np.unique(envs)) != len(envs):
                raise _ProtocolError(f"a second record for env {int(envs[got[envs]][0]) if got[envs].any() else envs}"
                                     " before its next command")
            got[envs] = True
            for key, v in part.items():
                obs[key][envs] = v
            rewards[envs], sts[envs] = rew, st
            if got.all():
                break
        first = sts == _FIRST
        if (first != resets).any():
            j = int(np.flatnonzero(first != resets)[0])
            raise _ProtocolError(f"env {j}: a record answering {'a reset' if resets[j] else 'an action'} has step "
                                 f"type {int(sts[j])}; {'only' if resets[j] else 'not'} FIRST (0) answers a reset")
        return obs, rewards, sts

    def _next(self, stream):
        if self.step_timeout is not None:  # the ingress's watchdog cancels the call past it
            stream.deadline = time.monotonic() + self.step_timeout
        try:
            return next(stream.requests)
        except StopIteration:
            raise _HostLost("the host ended its stream") from None
        except Exception as exc:  # noqa: BLE001 - grpc raises its RpcError (cancelled, reset) here
            why = (f"no answer within step_timeout={self.step_timeout:g}s" if stream.timed_out
                   else f"the host's stream failed ({type(exc).__name__}: {exc})")
            raise _HostLost(why) from None
        finally:
            stream.deadline = None

    def _lose(self, stream, exc):
        with self._cond:
            if self._stream is stream:
                self._stream = None
        if stream is not None:
            self.hosts_lost += 1
            if self._closed:
                stream.end()
            elif isinstance(exc, _ProtocolError):
                _log.warning("%s: host %s broke the protocol: %s", self._where(), stream.peer, exc)
                stream.end(P.import_grpc().StatusCode.INVALID_ARGUMENT, f"{self._where()}: {exc}")
            else:
                _log.warning("%s: host %s lost: %s", self._where(), stream.peer, exc)
                stream.end()
