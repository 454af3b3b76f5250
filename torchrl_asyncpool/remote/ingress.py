"""The gRPC ingress that every remote slot shares: one server per address, the streams of the
hosts connected to it, and the checks all slots share.

An :class:`Ingress` listens on one address for the slots created with it
(:class:`~torchrl_asyncpool.remote.RemoteEnvSlot`, :class:`~torchrl_asyncpool.remote.RemoteVectorSlot`
and the per-env slots of :mod:`~torchrl_asyncpool.remote.env_of_host`), hands each hello to a free
slot and bounds its threads; a slot that serves blocks of envs (protocol 2) is a
:class:`BlockIngress`. A host that goes away raises :class:`HostLost` in the slot that waited on it.
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

from torchrl_asyncpool.remote import protocol as P

__all__ = ["Ingress", "BlockIngress", "HostLost", "ProtocolError", "HELLO_MARGIN", "SILENT_HOST_WARN_S",
           "NO_HOST_WARN_S", "wait_for_host", "end_stream", "check_address", "check_slot_arguments"]

_log = logging.getLogger("torchrl_asyncpool.remote")


def end_stream(stream, exc, closed: bool, where: str) -> None:
    """Ends a lost host's stream: quietly when the pool is closing (the host did nothing wrong),
    with ``INVALID_ARGUMENT`` and a warning when it broke the protocol, else with a warning."""
    if closed:
        stream.end()
    elif isinstance(exc, ProtocolError):
        _log.warning("%s: host %s broke the protocol: %s", where, stream.peer, exc)
        stream.end(P.import_grpc().StatusCode.INVALID_ARGUMENT, f"{where}: {exc}")
    else:
        _log.warning("%s: host %s lost: %s", where, stream.peer, exc)
        stream.end()


class HostLost(Exception):
    """The slot's host dropped; its episode ends truncated."""


class ProtocolError(HostLost):
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
        self.asked_at = None  # monotonic time of the oldest command (or hello) the host has not answered
        self.silence_warned = False
        self.timed_out = False
        self.counted = False  # counted in its ingress's streams served at once
        self._out = queue.SimpleQueue()

    def expect(self, step_timeout: float | None) -> None:
        """The host owes an answer from now: past ``step_timeout`` (``None``: no limit) the
        watchdog cancels its call; past :data:`SILENT_HOST_WARN_S` it logs a warning either way."""
        now = time.monotonic()
        if step_timeout is not None:
            self.deadline = now + step_timeout
        if self.asked_at is None:
            self.asked_at = now

    def answered(self) -> None:
        """The host answered everything it was asked."""
        self.deadline = self.asked_at = None
        self.silence_warned = False

    def check_deadline(self, now: float) -> None:
        """Cancels the call of a host past its deadline, and warns (once per silence) about a host
        that has owed an answer for :data:`SILENT_HOST_WARN_S` (the ingress's watchdog calls it)."""
        deadline, asked_at = self.deadline, self.asked_at
        if deadline is not None and now > deadline and not self.timed_out:
            self.timed_out = True
            self.context.cancel()
        elif asked_at is not None and now - asked_at > SILENT_HOST_WARN_S and not self.silence_warned:
            self.silence_warned = True
            _log.warning("remote env host %s has not answered for %.0f s and no step_timeout drops it: its envs "
                         "deliver nothing meanwhile (the other hosts go on); set the slot's step_timeout to drop "
                         "a host that hangs.", self.peer, now - asked_at)

    def send(self, msg: bytes) -> None:
        if self.ended:
            raise HostLost("the host's call ended")
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


def check_address(address) -> None:
    """Raises ``ValueError`` unless ``address`` is a ``"host:port"`` string with a port in
    1..65535 (a pool's listening address, which hosts must be able to connect to)."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}.")
    port = address.rsplit(":", 1)[1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: the port must be a number in 1..65535 (0 is not accepted: "
                         "hosts must know where to connect).")


#: seconds a connected host may owe an answer before the ingress warns about it (when no
#: ``step_timeout`` drops it first): a silent host holds its envs, and only its envs
SILENT_HOST_WARN_S = 30.0

#: seconds a remote slot waits for a host (its first, or a new one after it lost one) before it
#: warns that none connected: the pool waits for hosts for as long as it takes
NO_HOST_WARN_S = 30.0


def wait_for_host(cond, done, where: str, address: str, connected=None) -> None:
    """``cond.wait()`` (``cond`` held by the caller) until ``done()``; past :data:`NO_HOST_WARN_S`
    logs a warning, once, that no env host connected to ``address`` (hosts the user forgot to
    start, or that connect elsewhere, would otherwise leave the pool waiting without a word).
    ``connected`` (optional): whether a host is there though not done yet (one building its
    envs), which is no reason to warn."""
    since, warned = time.monotonic(), False
    while not done():
        left = NO_HOST_WARN_S - (time.monotonic() - since)
        cond.wait(None if warned else max(left, 0.0))
        if (not warned and not done() and time.monotonic() - since >= NO_HOST_WARN_S
                and not (connected is not None and connected())):
            warned = True
            _log.warning("%s: no env host has connected to %s for %.0f s; the pool waits for one. Start hosts that "
                         "connect there (`torchrl-asyncpool env-host --address %s`, EnvHost, RayEnvHosts).",
                         where, address, time.monotonic() - since, address)

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


class Ingress:
    """The gRPC server of one address in one process; hands each accepted host to a free slot."""

    _by_address: dict = {}
    _lock = threading.Lock()

    @classmethod
    def join(cls, slot, stop_fd: int | None = None) -> "Ingress":
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


class BlockIngress:
    """What an :class:`~torchrl_asyncpool.remote.ingress.Ingress` asks of the protocol-2 slots it
    serves (a :class:`RemoteVectorSlot`, or the group of an address's ``per_env`` slots): one
    stream per block of ``host_envs`` envs (``self._blocks``, each with its ``stream``)."""

    @property
    def _streams_wanted(self) -> int:
        return len(self._blocks)

    @property
    def _envs_per_stream(self) -> int:
        return self.host_envs

    def _host_streams(self) -> list:
        return [block.stream for block in self._blocks]


def check_slot_arguments(address, token, step_timeout, num_envs, host_envs) -> int:
    """Validates the arguments the protocol-2 slots share; returns ``host_envs`` resolved."""
    check_address(address)
    if token is not None and not isinstance(token, str):
        raise TypeError(f"token must be a str or None, got {type(token).__name__}.")
    if token == "":
        raise ValueError("token='' would accept hosts that send no token; pass a non-empty token, or None "
                         "for no check.")
    if step_timeout is not None and (isinstance(step_timeout, bool) or not step_timeout > 0):
        raise ValueError(f"step_timeout must be a positive number of seconds or None, got {step_timeout!r}.")
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or not 0 < num_envs <= P.MAX_BATCH_ENVS:
        raise ValueError(f"num_envs must be an int in 1..{P.MAX_BATCH_ENVS}, got {num_envs!r}.")
    host_envs = num_envs if host_envs is None else host_envs
    if isinstance(host_envs, bool) or not isinstance(host_envs, int) or host_envs < 1 or num_envs % host_envs:
        raise ValueError(f"host_envs must be an int >= 1 dividing num_envs={num_envs}, got {host_envs!r}.")
    return host_envs
