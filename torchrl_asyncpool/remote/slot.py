"""Server side of the env-host protocol: pool slots that remote env hosts claim over gRPC.

A :class:`RemoteEnvSlot` is what a pool factory returns for an env that lives elsewhere. It is
a :class:`gymnasium.Env` with declared spaces, so the pool lays out its slot like any other
env's; the worker hosting it listens on the slot's address (one gRPC server per address and
worker process, shared by the slots hosted there) and hands every host that connects to a
free slot. From then on the slot's ``reset`` and ``step`` are the host's records: the consumer
loop, the inference server and the collector see an ordinary env.
"""
from __future__ import annotations

import logging
import threading

import gymnasium as gym

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.remote.ingress import HostLost, Ingress, ProtocolError, check_address, end_stream, wait_for_host

__all__ = ["RemoteEnvSlot"]

_log = logging.getLogger("torchrl_asyncpool.remote")
_FIRST, _TERM, _TRUNC = int(StepType.FIRST), int(StepType.TERMINATION), int(StepType.TRUNCATION)


class RemoteEnvSlot(gym.Env):
    """An env slot stepped by a remote env host that connects over gRPC.

    Return one from each ``create_env_fn`` factory of an :class:`~torchrl_asyncpool.AsyncEnvPool`
    (or :class:`~torchrl_asyncpool.AsyncPoolCollector`) to let env hosts anywhere (another
    machine, a container, another language) feed the pool: the worker hosting the slots listens
    on ``address``; each host that connects (:class:`~torchrl_asyncpool.remote.EnvHost`, or any
    client of :mod:`torchrl_asyncpool.remote.protocol`) sends its spec, which must equal the
    slot's, and takes the first free slot. The pool is built before any host connects; a slot
    delivers its first record once a host has claimed it.

    Episodes follow the pool's contract: the host owns its env and its resets and sends FIRST,
    MID, TERMINATION and TRUNCATION records; after a terminal record the slot tells the host to
    reset. A host that drops (or breaks the protocol) mid-episode ends that episode with a
    TRUNCATION record carrying its last observation and reward 0, and the slot waits for the
    next host: nothing the pool delivered is lost or duplicated, and the learner sees an
    ordinary truncated episode. A host whose machine vanished is noticed by gRPC keepalive
    (about 20 s); a host that hangs with its connection open holds its slot unless
    ``step_timeout`` is set.

    The pool hosts the slots of each address in one worker process (one gRPC server), each slot
    in its own thread; factories of one address must be consecutive, and ``envs_per_worker`` /
    ``env_threads`` stay at their defaults. One worker ingests a few thousand records per
    second (gRPC's Python stack costs ~0.25 ms of CPU per record): spread many slots over
    several addresses to use more cores. The listening port is not encrypted: use it on a
    trusted network, or behind a TLS proxy; a ``token`` keeps stray clients out. Nothing
    received is unpickled: records are raw bytes checked against the negotiated layout.

    Args:
        address (str): ``"host:port"`` to listen on, e.g. ``"0.0.0.0:50051"`` or
            ``"localhost:50051"``.
        observation_space (gymnasium.spaces.Space): ``Box``, ``Discrete``, ``MultiDiscrete``,
            ``MultiBinary`` or a ``Dict`` of them: what every host's env must produce.
        action_space (gymnasium.spaces.Space): ``Box``, ``Discrete``, ``MultiDiscrete`` or
            ``MultiBinary``.

    Keyword Args:
        token (str, optional): hosts must send it (metadata ``x-torchrl-asyncpool-token``).
            Defaults to ``None`` (no check); an empty string is refused (it would admit hosts
            that send no token, e.g. ``token=os.environ.get("TOKEN", "")`` with the variable unset).
        step_timeout (float, optional): seconds a host may take to answer a command (and to
            send its first record); a host that takes longer is dropped as if it had
            disconnected (its call is cancelled, its episode truncated, the slot freed).
            Defaults to ``None``: a host that hangs without dropping holds its slot.

    Attributes:
        index (int): the pool slot, once the hosting worker listens (``None`` before).
        hosts_connected (int): hosts that claimed this slot so far.
        hosts_lost (int): hosts that dropped, hung or broke the protocol while holding it.
            Both are kept by the slot object in the worker process hosting it (each change is
            also logged there, on the ``torchrl_asyncpool.remote`` logger).

    Examples:
        >>> import gymnasium as gym
        >>> from torchrl_asyncpool.remote import RemoteEnvSlot
        >>> slot = RemoteEnvSlot.like(gym.make("CartPole-v1"), "localhost:50051")
        >>> slot.observation_space.shape, slot.action_space
        ((4,), Discrete(2))

        In a pool (the hosts run ``torchrl-asyncpool env-host --env-id CartPole-v1
        --address POOL_MACHINE:50051`` anywhere)::

            pool = AsyncEnvPool([functools.partial(RemoteEnvSlot, "0.0.0.0:50051", obs_space, act_space)] * 16)
    """

    metadata = {"render_modes": []}

    def __init__(self, address: str, observation_space, action_space, *, token: str | None = None,
                 step_timeout: float | None = None):
        check_address(address)
        if token is not None and not isinstance(token, str):
            raise TypeError(f"token must be a str or None, got {type(token).__name__}.")
        if token == "":  # a host that sends none matches it: an unset variable must not turn auth off
            raise ValueError("token='' would accept hosts that send no token; pass a non-empty token, or None "
                             "for no check.")
        if step_timeout is not None and (isinstance(step_timeout, bool) or not step_timeout > 0):
            raise ValueError(f"step_timeout must be a positive number of seconds or None, got {step_timeout!r}.")
        self.step_timeout = None if step_timeout is None else float(step_timeout)
        self.address = address
        self.observation_space = observation_space
        self.action_space = action_space
        self._spec = P.spec_of_spaces(observation_space, action_space)  # refuses unsupported spaces
        self._codec = P.RecordCodec(self._spec)
        self._dict_obs = isinstance(observation_space, gym.spaces.Dict)
        self._token = token
        self.index = None
        self.hosts_connected = self.hosts_lost = 0
        self._cond = threading.Condition()
        self._stream = None
        self._ingress = None
        self._closed = False
        self._last_obs = None

    @classmethod
    def like(cls, env, address: str, **kwargs) -> "RemoteEnvSlot":
        """A slot with the layout of ``env``: a gymnasium env (its spaces), or a TorchRL env with
        an empty batch size (its specs, see :mod:`torchrl_asyncpool.remote.torchrl_env`); the
        env is only read. ``kwargs`` are the constructor's keyword arguments."""
        from torchrl_asyncpool.remote.torchrl_env import as_gymnasium

        env = as_gymnasium(env)
        return cls(address, env.observation_space, env.action_space, **kwargs)

    # -- called by the pool worker hosting the slot ----------------------------------------------
    def _pool_listen(self, index: int, stop_fd: int | None = None) -> None:
        """Starts accepting hosts for pool slot ``index`` (the worker calls it after building the
        slot and before the first reset, which waits for a host). ``stop_fd``: a descriptor
        that hangs up when the worker stops; the slots of the address are then closed at once
        (a slot waiting for a host would otherwise hold the worker's shutdown)."""
        self.index = index
        self._ingress = Ingress.join(self, stop_fd)

    # -- gymnasium API ----------------------------------------------------------------------------
    def reset(self, *, seed=None, options=None):
        """Waits for a host if none holds the slot, tells it to reset when it sent a record
        before, and returns ``(its FIRST record's observation, {})``.

        Raises:
            ValueError: for a ``seed`` or ``options``: the host owns its env and its resets.
            RuntimeError: for a slot that a pool worker steps (it listens in the worker).
        """
        if seed is not None or options:
            raise ValueError(
                f"{self._where()}: a remote host owns its env and its resets; a seed or reset options cannot be "
                "applied from the pool (fixed episode sets need local envs)."
            )
        if self._ingress is None:
            raise RuntimeError(
                f"{self._where()} is stepped by a pool worker, which listens on {self.address}; it cannot be reset "
                "on its own. Return it from an AsyncEnvPool / AsyncPoolCollector factory."
            )
        while True:
            stream = self._wait_host()
            try:
                if stream.sent_first:
                    stream.send(P.RESET_COMMAND)
                st, _, obs = self._read(stream)
                if st != _FIRST:
                    raise ProtocolError(f"a record answering a reset has step type {st}; expected 0 (FIRST)")
                stream.sent_first = True
            except HostLost as exc:
                self._lose(stream, exc)
                continue
            self._last_obs = obs
            return self._out(obs), {}

    def step(self, action):
        """Sends ``action`` to the host and returns its next record; a host lost meanwhile ends
        the episode as truncated (last observation, reward 0; ``info["host_lost"]``)."""
        stream = self._stream
        try:
            if stream is None:
                raise HostLost("no host holds the slot")
            stream.send(self._codec.pack_action(action))
            st, reward, obs = self._read(stream)
            if st == _FIRST:
                raise ProtocolError("a record answering an action has step type 0 (FIRST); resets are the pool's")
        except HostLost as exc:
            self._lose(stream, exc)
            return self._out(self._last_obs), 0.0, False, True, {"host_lost": True}
        self._last_obs = obs
        return self._out(obs), reward, st == _TERM, st == _TRUNC, {}

    def close(self):
        """Lets go of the slot's host (its stream ends) and stops waiting for one. Idempotent."""
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
        return f"remote env slot {self.index}" if self.index is not None else "a remote env slot"

    #: streams this slot takes (the ingress's cap counts them)
    _streams_wanted = 1
    #: envs a host declares to take it: None for one env per stream (protocol 1)
    _envs_per_stream = None

    def _host_streams(self) -> list:
        """The streams of the hosts holding the slot (None where none does)."""
        return [self._stream]

    def _out(self, obs):
        return obs if self._dict_obs else obs["observation"]

    def _attach(self, stream) -> bool:
        """Gives the slot to ``stream`` if it is free (the ingress calls it for each host)."""
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
            wait_for_host(self._cond, lambda: self._stream is not None or self._closed, self._where(), self.address)
            if self._stream is None:
                raise RuntimeError(f"{self._where()} was closed while waiting for a host.")
            return self._stream

    def _read(self, stream):
        stream.expect(self.step_timeout)  # the ingress's watchdog cancels the call past it
        try:
            data = next(stream.requests)
        except StopIteration:
            raise HostLost("the host ended its stream") from None
        except Exception as exc:  # noqa: BLE001 - grpc raises its RpcError (cancelled, reset) here
            why = (f"no answer within step_timeout={self.step_timeout:g}s" if stream.timed_out
                   else f"the host's stream failed ({type(exc).__name__}: {exc})")
            raise HostLost(why) from None
        finally:
            stream.answered()
        try:
            return self._codec.unpack_record(data)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None

    def _lose(self, stream, exc):
        """Frees the slot after its host dropped or broke the protocol."""
        with self._cond:
            if self._stream is stream:
                self._stream = None
        if stream is not None:
            self.hosts_lost += 1
            end_stream(stream, exc, self._closed, self._where())
