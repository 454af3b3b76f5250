"""Client side of the env-host protocol: serve a gymnasium env to a pool's remote slot."""
from __future__ import annotations

import logging
import queue
import threading
import time

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.remote.host_call import HostCallEnded, open_host_call
from torchrl_asyncpool.step_type import StepType

__all__ = ["EnvHost", "RemoteHostError"]

_log = logging.getLogger("torchrl_asyncpool.remote")
_FIRST, _MID, _TERM, _TRUNC = (int(s) for s in StepType)


class RemoteHostError(RuntimeError):
    """The pool refused the host or ended its stream with an error.

    Attributes:
        code (str): the gRPC status name (``"UNAUTHENTICATED"``, ``"INVALID_ARGUMENT"``,
            ``"RESOURCE_EXHAUSTED"``, ...).
        details (str): the pool's explanation.
    """

    def __init__(self, address: str, code: str, details: str):
        super().__init__(f"{address}: {code}: {details}")
        self.code, self.details = code, details

    def __reduce__(self):
        return _rebuild_error, (str(self), self.code, self.details)


def _rebuild_error(msg, code, details):
    err = RemoteHostError.__new__(RemoteHostError)
    RuntimeError.__init__(err, msg)
    err.code, err.details = code, details
    return err


class _Outbox:
    """A host's request stream: the messages put, in order, until ``None``."""

    def __init__(self):
        self._q = queue.SimpleQueue()
        self.put = self._q.put

    def __iter__(self):
        return iter(self._q.get, None)


class EnvHost:
    """Steps one gymnasium env for a pool's :class:`~torchrl_asyncpool.remote.RemoteEnvSlot`.

    The host connects to ``address``, sends its env's spec, takes a free slot and then answers
    the pool's commands (an action, or a reset after a terminal record) with records, until the
    pool goes away, :meth:`stop` is called or ``max_steps`` is reached. The env stays local:
    only observations, rewards and step types travel, as raw bytes.

    Args:
        env (gymnasium.Env, EnvBase or callable): the env (a gymnasium env, or a TorchRL env
            with an empty batch size, flat observation keys and an ``"action"`` entry), or a
            zero-argument factory (an env class included) called once at the first :meth:`run`.
        address (str): the pool's ``"host:port"``.

    Keyword Args:
        token (str, optional): the pool's token. Defaults to ``None``.
        connect_timeout (float): seconds to wait for the pool to accept connections.
            Defaults to ``30``.

    Attributes:
        slot (int): the pool slot this host holds (``None`` before it is accepted).
        steps (int): env steps taken (resets not counted).

    Examples:
        >>> import gymnasium as gym
        >>> from torchrl_asyncpool.remote import EnvHost
        >>> host = EnvHost(lambda: gym.make("CartPole-v1"), "localhost:50051", connect_timeout=0.5)
        >>> host.run()  # nothing listens there: a clear error instead of a hang
        Traceback (most recent call last):
          ...
        ConnectionError: no pool accepts connections on localhost:50051 (waited 0.5 s).
    """

    def __init__(self, env, address: str, *, token: str | None = None, connect_timeout: float = 30.0):
        from torchrl_asyncpool.remote.ingress import check_address

        check_address(address)  # a malformed address fails here, not after connect_timeout
        self._env = env
        self.address = address
        self.token = token
        self.connect_timeout = float(connect_timeout)
        self.slot = None
        self.steps = 0
        self._call = None
        self._stopping = threading.Event()

    @property
    def env(self):
        """The served env, seen through the gymnasium API (built on first use from a factory)."""
        from torchrl_asyncpool.remote.torchrl_env import as_gymnasium

        # a class is a factory too (EnvHost(MyEnv, ...)), though it has a ``step`` attribute
        if isinstance(self._env, type) or (callable(self._env) and not hasattr(self._env, "step")):
            self._env = self._env()
        self._env = as_gymnasium(self._env)
        return self._env

    def stop(self) -> None:
        """Ends the stream from another thread; :meth:`run` returns (the pool truncates the
        episode in progress and frees the slot). A host still waiting for a pool to accept
        connections stops waiting within 0.1 s."""
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()

    def run(self, max_steps: int | None = None) -> int:
        """Serves the env until the pool ends the stream, :meth:`stop` or ``max_steps`` env
        steps (then the host leaves, as if it dropped); returns the steps taken.

        Raises:
            ConnectionError: nothing accepts connections at ``address`` within ``connect_timeout``.
            RemoteHostError: the pool refused the host (token, spec, no free slot) or ended its
                stream with an error.
        """
        import gymnasium as gym

        # the slot of an earlier run is not held now; and "accepted in this run" is what tells a
        # pool that went away (a normal end) from a refusal (see _stream)
        self.slot = None
        env = self.env
        spec = P.spec_of_spaces(env.observation_space, env.action_space)
        codec = P.RecordCodec(spec)
        dict_obs = isinstance(env.observation_space, gym.spaces.Dict)

        def serve(responses, send):
            def record(st, reward, obs):
                send(codec.pack_record(st, reward, obs if dict_obs else {"observation": obs}))

            _log.info("env host: holding slot %d of %s", self.slot, self.address)
            obs, _ = env.reset()
            record(_FIRST, 0.0, obs)
            for cmd in responses:
                action = codec.unpack_command(cmd)
                if action is None:
                    obs, _ = env.reset()
                    record(_FIRST, 0.0, obs)
                    continue
                if max_steps is not None and self.steps >= max_steps:
                    break
                obs, reward, terminated, truncated, _ = env.step(action)
                self.steps += 1
                record(_TERM if terminated else (_TRUNC if truncated else _MID), reward, obs)

        return self._stream(P.encode_hello(spec), serve)

    def _stream(self, hello: bytes, serve, channel_options=(), outbox=None) -> int:
        """The life of one stream, whatever the host serves over it: connects, sends ``hello``,
        and once the pool accepts (``self.slot``) calls ``serve(responses, send)``, which answers
        the pool's messages until they end (or returns to leave). A pool that goes away after
        accepting, or :meth:`stop`, ends it normally; returns the steps taken.

        ``outbox``: for envs that answer from threads of their own, what ``send`` takes from any
        thread (an object with ``put(item)``, ``pack(items) -> bytes`` and iterating the messages
        to send until a ``None`` is put); ``None``: ``send`` takes each message, from the thread
        that runs ``serve``.

        Raises:
            ConnectionError: nothing accepts connections at ``address`` within ``connect_timeout``.
            RemoteHostError: the pool refused the host or ended its stream with an error.
        """
        grpc = P.import_grpc()
        channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000), *channel_options,
        ])
        try:
            if not self._wait_connected(grpc, channel):
                return self.steps  # stop() while connecting
            metadata = ((P.TOKEN_METADATA, self.token),) if self.token is not None else None
            # the stream driven from this thread (see host_call.py) where grpcio allows it
            call = open_host_call(channel, P.METHOD, metadata)
            if call is not None:
                return self._serve_call(call, hello, serve, None if outbox is None else outbox.pack)
            out = _Outbox() if outbox is None else outbox  # the request stream: messages until a None ends it
            out.put(hello)
            self._call = responses = channel.stream_stream(P.METHOD)(iter(out), metadata=metadata)
            if self._stopping.is_set():
                responses.cancel()
            try:
                self.slot = P.decode_accept(next(responses))
                serve(responses, out.put)
            except StopIteration:  # the pool ended the stream before accepting
                pass
            except grpc.RpcError as exc:
                return self._ended(exc.code(), exc.details())
            finally:
                out.put(None)
                if self._call is not None:
                    self._call.cancel()
            return self.steps
        finally:
            channel.close()

    def _serve_call(self, call, hello: bytes, serve, pack=None) -> int:
        """:meth:`_stream` over a :class:`~torchrl_asyncpool.remote.host_call.HostCall`
        (``pack``: the outbox's, for ``send`` from any thread)."""
        self._call = call
        if self._stopping.is_set():
            call.cancel()
        try:
            call.send(hello)
            accept = call.recv()
            if accept is not None:  # None: the pool ended the stream before accepting
                self.slot = P.decode_accept(accept)
                if pack is not None:
                    call.posting(pack)
                serve(call, call.send if pack is None else call.post)
        except HostCallEnded as exc:
            return self._ended(exc.code, exc.details())
        finally:
            self._call = None
            call.close()
        return self.steps

    def _ended(self, code, details) -> int:
        """The stream ended with ``code`` (a ``grpc.StatusCode``): the steps taken where that is
        a normal end (:meth:`stop`, or the pool going away after accepting the host), else
        :class:`RemoteHostError`."""
        import grpc

        if code == grpc.StatusCode.CANCELLED and self._stopping.is_set():
            return self.steps
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and self.slot is not None:
            _log.info("env host: the pool at %s went away (%s)", self.address, code.name)
            return self.steps  # the pool closed: the normal end of a host's life
        raise RemoteHostError(self.address, code.name, details or "") from None

    def _wait_connected(self, grpc, channel) -> bool:
        """Waits for ``channel`` to connect, in short rounds so that :meth:`stop` ends the wait
        (a host between pools spends most of its life here); ``False`` if stopped."""
        ready = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + self.connect_timeout
        try:
            while not self._stopping.is_set():
                try:
                    ready.result(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
                    return True
                except grpc.FutureTimeoutError:
                    if time.monotonic() >= deadline:
                        raise ConnectionError(
                            f"no pool accepts connections on {self.address} "
                            f"(waited {self.connect_timeout:g} s)."
                        ) from None
            return False
        finally:
            ready.cancel()

    def run_forever(self, retry_s: float = 1.0) -> None:
        """:meth:`run` again whenever the pool goes away or refuses the host for lack of a free
        slot, until :meth:`stop` (an env host that outlives pools)."""
        while not self._stopping.is_set():
            try:
                self.run()
            except ConnectionError:
                pass
            except RemoteHostError as exc:
                if exc.code != "RESOURCE_EXHAUSTED":
                    raise
            self.slot = None
            self._stopping.wait(retry_s)

