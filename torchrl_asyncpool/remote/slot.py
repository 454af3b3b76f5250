"""Server side of the env-host protocol: pool slots that remote env hosts claim over gRPC.

A :class:`RemoteEnvSlot` is what a pool factory returns for an env that lives elsewhere. It is
a :class:`gymnasium.Env` with declared spaces, so the pool lays out its slot like any other
env's; the worker hosting it listens on the slot's address (one gRPC server per address and
worker process, shared by the slots hosted there) and hands every host that connects to a
free slot. From then on the slot's ``reset`` and ``step`` are the host's records: the consumer
loop, the inference server and the collector see an ordinary env.
"""
from __future__ import annotations

import collections
import hmac
import logging
import queue
import select
import threading
import time
from concurrent import futures

import gymnasium as gym

from torchrl_asyncpool.remote import protocol as P
from torchrl_asyncpool.step_type import StepType

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
        _check_address(address)
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
        self._ingress = _Ingress.join(self, stop_fd)

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
                    raise _ProtocolError(f"a record answering a reset has step type {st}; expected 0 (FIRST)")
                stream.sent_first = True
            except _HostLost as exc:
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
                raise _HostLost("no host holds the slot")
            stream.send(self._codec.pack_action(action))
            st, reward, obs = self._read(stream)
            if st == _FIRST:
                raise _ProtocolError("a record answering an action has step type 0 (FIRST); resets are the pool's")
        except _HostLost as exc:
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
            while self._stream is None:
                if self._closed:
                    raise RuntimeError(f"{self._where()} was closed while waiting for a host.")
                self._cond.wait()
            return self._stream

    def _read(self, stream):
        if self.step_timeout is not None:  # the ingress's watchdog cancels the call past it
            stream.deadline = time.monotonic() + self.step_timeout
        try:
            data = next(stream.requests)
        except StopIteration:
            raise _HostLost("the host ended its stream") from None
        except Exception as exc:  # noqa: BLE001 - grpc raises its RpcError (cancelled, reset) here
            why = (f"no answer within step_timeout={self.step_timeout:g}s" if stream.timed_out
                   else f"the host's stream failed ({type(exc).__name__}: {exc})")
            raise _HostLost(why) from None
        finally:
            stream.deadline = None
        try:
            return self._codec.unpack_record(data)
        except ValueError as exc:
            raise _ProtocolError(str(exc)) from None

    def _lose(self, stream, exc):
        """Frees the slot after its host dropped or broke the protocol."""
        with self._cond:
            if self._stream is stream:
                self._stream = None
        if stream is not None:
            self.hosts_lost += 1
            _end_stream(stream, exc, self._closed, self._where())


def _end_stream(stream, exc, closed: bool, where: str) -> None:
    """Ends a lost host's stream: quietly when the pool is closing (the host did nothing wrong),
    with ``INVALID_ARGUMENT`` and a warning when it broke the protocol, else with a warning."""
    if closed:
        stream.end()
    elif isinstance(exc, _ProtocolError):
        _log.warning("%s: host %s broke the protocol: %s", where, stream.peer, exc)
        stream.end(P.import_grpc().StatusCode.INVALID_ARGUMENT, f"{where}: {exc}")
    else:
        _log.warning("%s: host %s lost: %s", where, stream.peer, exc)
        stream.end()


class _HostLost(Exception):
    """The slot's host dropped; its episode ends truncated."""


class _ProtocolError(_HostLost):
    """The slot's host sent something the protocol does not allow; the stream is ended with
    ``INVALID_ARGUMENT`` and its episode truncated."""


class _HostStream:
    """One connected host: the slot reads its records, the handler's generator yields commands."""

    def __init__(self, requests, context):
        self.requests, self.context = requests, context
        self.peer = context.peer()
        self.sent_first = False
        self.ended = False
        self.deadline = None  # monotonic time by which the host must answer (step_timeout)
        self.timed_out = False
        self.counted = False  # counted in its ingress's streams served at once
        self._out = queue.SimpleQueue()

    def check_deadline(self, now: float) -> None:
        """Cancels the call of a host past its deadline (the ingress's watchdog calls it)."""
        deadline = self.deadline
        if deadline is not None and now > deadline and not self.timed_out:
            self.timed_out = True
            self.context.cancel()

    def send(self, msg: bytes) -> None:
        if self.ended:
            raise _HostLost("the host's call ended")
        self._out.put(msg)

    def end(self, code=None, details: str | None = None) -> None:
        """Ends the call (with ``code`` and ``details`` when given)."""
        if code is not None and not self.ended:
            self.context.set_code(code)
            self.context.set_details(details)
        self.ended = True
        self._out.put(None)

    def responses(self):
        """The messages to the host. A tuple sent is one env's command (protocol-2 envs stepped
        one by one): every command waiting is packed into one message by ``self.pack``."""
        get, get_nowait, empty = self._out.get, self._out.get_nowait, queue.Empty
        msg = get()
        while msg is not None:
            if not isinstance(msg, tuple):
                yield msg
                msg = get()
                continue
            commands = [msg]
            while True:
                try:
                    msg = get_nowait()
                except empty:
                    msg = get
                    break
                if not isinstance(msg, tuple):
                    break
                commands.append(msg)
            yield self.pack(commands)
            if msg is get:
                msg = get()


class _BoundedExecutor(futures.Executor):
    """The gRPC server's handler threads: at most ``limit()`` at once (read at each submit, as
    slots join the address one by one), more work waits in a queue; a thread idle for
    :data:`_IDLE_THREAD_S` exits, so the threads a burst of connections made do not stay."""

    def __init__(self, limit, name: str):
        self._limit, self._name = limit, name
        self._cond = threading.Condition()
        self._work = collections.deque()
        self._threads = self._idle = self.peak_threads = 0
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs):
        future = futures.Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._work.append((future, fn, args, kwargs))
            if self._idle >= len(self._work):
                self._cond.notify()
            elif self._threads < self._limit():
                self._threads += 1
                self.peak_threads = max(self.peak_threads, self._threads)
                threading.Thread(target=self._run, name=f"{self._name}-{self._threads}", daemon=True).start()
        return future

    def _run(self):
        while True:
            with self._cond:
                while not self._work and not self._shutdown:
                    self._idle += 1
                    woken = self._cond.wait(_IDLE_THREAD_S)
                    self._idle -= 1
                    if not woken and not self._work:
                        break
                if not self._work:
                    self._threads -= 1
                    return
                future, fn, args, kwargs = self._work.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                future.set_exception(exc)
            del future, fn, args, kwargs

    def shutdown(self, wait=True, *, cancel_futures=False):
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while self._work:
                    self._work.popleft()[0].cancel()
            self._cond.notify_all()


def _check_address(address) -> None:
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}.")
    port = address.rsplit(":", 1)[1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: the port must be a number in 1..65535 (0 is not accepted: "
                         "hosts must know where to connect).")


#: seconds a client has to send its hello once connected
_HELLO_TIMEOUT_S = 10.0

#: streams of one address beyond one per slot, for connections saying hello: the address serves
#: at most ``slots + HELLO_MARGIN`` streams at a time, in as many threads (plus
#: :data:`_SPARE_THREADS`). A connection arriving at that cap cancels the one that has waited
#: longest without a hello while a slot is free (a real host says hello at once: only silent
#: clients lose), and is refused with RESOURCE_EXHAUSTED when every slot is held
HELLO_MARGIN = 8
#: handler threads beyond ``slots + HELLO_MARGIN``: a new stream's handler runs while the silent
#: stream it evicts is still being cancelled
_SPARE_THREADS = 2
#: seconds an idle handler thread lives before it exits (threads a flood made do not stay)
_IDLE_THREAD_S = 5.0

#: gRPC server options: keepalive pings find dead hosts (a host that vanished without closing
#: its connection) within ~20 s; no SO_REUSEPORT, so a second listener on the port fails
#: loudly instead of sharing the connections.
_KEEPALIVE = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


class _Ingress:
    """The gRPC server of one address in one process; hands each accepted host to a free slot."""

    _by_address: dict = {}
    _lock = threading.Lock()

    @classmethod
    def join(cls, slot: RemoteEnvSlot, stop_fd: int | None = None) -> "_Ingress":
        with cls._lock:
            ingress = cls._by_address.get(slot.address)
            if ingress is None:
                ingress = cls._by_address[slot.address] = cls(slot.address, slot._token, slot._codec, stop_fd)
            elif ingress.token != slot._token:
                raise ValueError(f"{slot._where()}: slots listening on {slot.address} must share one token.")
            ingress.slots.append(slot)
            return ingress

    def __init__(self, address, token, codec, stop_fd=None):
        grpc = P.import_grpc()
        self.address, self.token = address, token
        self.slots = []
        self._handshakes = {}  # streams that have not sent their hello yet -> None, oldest first
        self._active = 0  # stream handlers running: holding a slot, waiting for a hello, or in between
        self.streams_evicted = self.streams_refused = 0
        limit = max(4 << 20, 2 * codec.max_message_bytes)
        #: streams served at once: one per slot, HELLO_MARGIN more waiting for their hello
        self._executor = _BoundedExecutor(lambda: self.max_streams + _SPARE_THREADS, "env-host-stream")
        self.server = grpc.server(
            self._executor,
            options=_KEEPALIVE + P.window_options(codec.max_message_bytes)
            + [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        service, method = P.METHOD.strip("/").split("/")
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            service, {method: grpc.stream_stream_rpc_method_handler(self._handle)}
        ),))
        try:
            port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            port, why = 0, str(exc)
        else:
            why = ""
        if not port:
            raise OSError(f"remote env slots cannot listen on {address}: the port is taken or the address is not "
                          f"local ({why or 'bind failed'}).")
        self.server.start()
        _log.info("remote env slots listening on %s", address)
        self._stop = threading.Event()
        threading.Thread(target=self._watchdog, args=(stop_fd,), name="env-host-watchdog", daemon=True).start()

    def _watchdog(self, stop_fd):
        """Drops hosts that exceed their slot's ``step_timeout`` (checked 10 times per timeout,
        at least once a second) and closes every slot when ``stop_fd`` hangs up."""
        poller = select.poll()
        if stop_fd is not None:
            poller.register(stop_fd, select.POLLIN)
        while not self._stop.is_set():
            with self._lock:
                timeouts = [s.step_timeout for s in self.slots if s.step_timeout is not None]
            # at most 1 s between checks, whatever the step timeouts: the hello deadline
            # (_HELLO_TIMEOUT_S) is checked here too, and a step_timeout of 100 s must not
            # let a silent client hold its server thread for 10 s more
            if poller.poll(1000 * min(timeouts + [10.0]) / 10):  # the worker is stopping
                for slot in list(self.slots):
                    slot.close()
                return
            now = time.monotonic()
            with self._lock:
                streams = [st for slot in self.slots for st in slot._host_streams()] + list(self._handshakes)
            for stream in streams:
                if stream is not None:
                    stream.check_deadline(now)

    @property
    def max_streams(self) -> int:
        """Streams this address serves at once: one per slot plus :data:`HELLO_MARGIN`."""
        return sum(slot._streams_wanted for slot in self.slots) + HELLO_MARGIN

    def leave(self, slot) -> None:
        with self._lock:
            if slot in self.slots:
                self.slots.remove(slot)
            if self.slots:
                return
            self._by_address.pop(self.address, None)
        self._stop.set()
        self.server.stop(grace=None)
        self._executor.shutdown(wait=False)

    def _admit(self, stream) -> bool:
        """Counts a new stream in and registers it as waiting for its hello. At
        :attr:`max_streams` streams, the one that has waited longest for its hello is cancelled
        to make room while a slot is free (a real host says hello at once: only silent clients
        lose their place); with every slot held, the new stream is refused instead (False:
        ``RESOURCE_EXHAUSTED``). Hellos may use every stream the held slots leave: ``k`` hosts
        connecting at once to ``k`` free slots all get in."""
        evicted = None
        with self._lock:
            if self._active >= self.max_streams:
                free = any(st is None for slot in self.slots for st in slot._host_streams())
                if not free or not self._handshakes:
                    self.streams_refused += 1
                    return False
                evicted = next(iter(self._handshakes))
                del self._handshakes[evicted]
                evicted.counted = False  # on its way out: no longer counted (its thread is, by the executor)
                self._active -= 1
                self.streams_evicted += 1
                if self.streams_evicted & (self.streams_evicted - 1) == 0:  # logged at 1, 2, 4, 8, ... evictions
                    _log.warning("remote env slots on %s: %d streams at once (the cap); cancelling the one "
                                 "silent longest (%s; %d so far)", self.address, self.max_streams, evicted.peer,
                                 self.streams_evicted)
            self._active += 1
            self._handshakes[stream] = None
            stream.counted = True
        if evicted is not None:
            evicted.timed_out = True
            evicted.context.cancel()
        return True

    def _handle(self, requests, context):
        grpc = P.import_grpc()
        if self.token is not None:
            got = dict(context.invocation_metadata()).get(P.TOKEN_METADATA, "")
            if not hmac.compare_digest(str(got).encode(), self.token.encode()):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              f"wrong or missing token (metadata {P.TOKEN_METADATA!r}) for {self.address}.")
        stream = _HostStream(requests, context)
        stream.deadline = time.monotonic() + _HELLO_TIMEOUT_S  # a silent client must not keep a thread
        if not self._admit(stream):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.address} serves at most {self.max_streams} streams at once (one per slot plus "
                          f"{HELLO_MARGIN} saying hello), all in use, and no slot is free; try again later.")
        try:
            yield from self._serve_stream(stream, requests, context, grpc)
        finally:
            with self._lock:
                if stream.counted:
                    self._active -= 1
                self._handshakes.pop(stream, None)

    def _serve_stream(self, stream, requests, context, grpc):
        try:
            hello = P.decode_hello(next(requests))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.address}: {exc}")
        except Exception:  # noqa: BLE001 - StopIteration, or the call was cancelled (hello timeout, evicted)
            return
        finally:
            with self._lock:
                self._handshakes.pop(stream, None)
            stream.deadline = None
        with self._lock:
            slots = sorted(self.slots, key=lambda s: s.index)
        if not slots:  # the last slot left and the server is stopping: no spec to compare with
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the pool listening on {self.address} is closing: no remote env slot is left; "
                          "try again later.")
        num_envs = hello.pop("num_envs", None)  # None: a protocol-1 host (one env)
        mismatch, matched = None, 0
        for slot in slots:
            k = slot._envs_per_stream  # None: a RemoteEnvSlot, k: a RemoteVectorSlot taking hosts of k envs
            if k != num_envs:
                mismatch = mismatch or (
                    f"{slot._where()} takes a host of {k} envs over one stream (protocol {P.BATCHED_PROTOCOL}); "
                    f"the host declared {'one env (protocol 1)' if num_envs is None else f'{num_envs} envs'}"
                    if k is not None else
                    f"{slot._where()} takes one env per stream (protocol 1); the host declared {num_envs} envs "
                    f"(protocol {P.BATCHED_PROTOCOL})")
                continue
            diff = P.spec_difference(slot._spec, hello)
            if diff is not None:
                mismatch = mismatch or f"{slot._where()}: {diff}"
                continue
            matched += 1
            if slot._attach(stream):
                break
        else:
            if not matched:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the host's spec does not fit: {mismatch}.")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"all {matched} remote env slots on {self.address} are taken; try again later.")
        if not context.add_callback(stream.end):  # the call ended already
            stream.end()
        yield P.encode_accept(getattr(stream, "accept_index", slot.index), num_envs)
        yield from stream.responses()
