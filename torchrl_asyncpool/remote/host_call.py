"""A host's stream to a pool, driven by the one thread that uses it.

grpcio's public client runs a bidirectional stream on three threads: the caller, a thread that
pulls the request iterator and writes each message, and the channel's thread that polls the
completion queue and wakes the other two. A host answers one message with the next, so every
round trip pays those hand-offs (with the GIL) twice. Driving the call from the calling thread
about halves the client's CPU per round trip (see :doc:`remote`, "How a host drives its
stream").

:class:`HostCall` is that second way: grpcio's own single-threaded call object (the one behind
its ``SingleThreadedUnaryStream`` option, ``cygrpc.SegregatedCall``: a completion queue of the
call's own, polled by whoever waits on it, the GIL released while it blocks) opened for a
stream-stream method. Its API is not public: :func:`open_host_call` returns ``None`` where the
installed grpcio lacks it, and the host then uses the public stream (same wire, same messages).
"""
from __future__ import annotations

import collections
import threading

__all__ = ["HostCall", "HostCallEnded", "open_host_call"]

#: the tags of the call's batches of operations (one completion event each)
_METADATA_OUT, _METADATA_IN, _STATUS, _SEND, _RECV = "metadata-out", "metadata-in", "status", "send", "recv"


class HostCallEnded(Exception):
    """The pool ended the stream with a status other than OK (``code``: a ``grpc.StatusCode``)."""

    def __init__(self, code, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details_text = code, details

    def details(self) -> str:
        return self.details_text


def open_host_call(channel, method: str, metadata=None):
    """Starts a stream-stream call of ``method`` on ``channel`` (a ``grpc.Channel``) sending
    ``metadata``; a :class:`HostCall`, or ``None`` where grpcio's single-threaded call is not
    available (the caller then uses ``channel.stream_stream``)."""
    try:
        from grpc import _common
        from grpc._cython import cygrpc

        core = channel._channel
        codes = dict(_common.CYGRPC_STATUS_CODE_TO_STATUS_CODE)
        metadata = tuple(metadata or ())
        ops = (
            ((cygrpc.SendInitialMetadataOperation(metadata, 0),), _METADATA_OUT),
            ((cygrpc.ReceiveInitialMetadataOperation(0),), _METADATA_IN),
            ((cygrpc.ReceiveStatusOnClientOperation(0),), _STATUS),
        )
        args = (cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method.encode(), None, None, metadata, None,
                ops, cygrpc.build_census_context())
        try:
            call = core.segregated_call(*args, None)  # grpcio >= 1.62: a registered-method handle
        except TypeError:
            call = core.segregated_call(*args)
    except (ImportError, AttributeError, TypeError):
        return None
    return HostCall(call, cygrpc, codes)


class HostCall:
    """One bidirectional stream, its messages sent and received by the thread that calls
    :meth:`send` and :meth:`recv` (see the module's docstring); :meth:`cancel` may come from any
    thread. Iterating it yields the pool's messages until the pool ends the stream.

    A host whose envs answer from threads of their own hands their records to :meth:`post`
    (any thread, never blocks) while its main thread waits in :meth:`recv`: a record posted
    while a message is in flight waits, and when gRPC takes that message, the thread polling the
    call sends every record waiting as one message (``pack``).

    Every batch of operations started on the call has one completion event, collected by the
    polling thread; :meth:`close` collects them all (grpcio frees the call's queue with the
    last one, after which the queue must not be polled again).
    """

    def __init__(self, call, cygrpc, codes):
        self._call = call
        self._send_op, self._recv_op = cygrpc.SendMessageOperation, cygrpc.ReceiveMessageOperation
        self._cancelled_code, self._unknown_code = cygrpc.StatusCode.cancelled, cygrpc.StatusCode.unknown
        self._codes = codes
        self._lock = threading.Lock()  # what posting threads share with the polling one (below)
        self._due = {_METADATA_OUT, _METADATA_IN, _STATUS}  # batches started, their event not collected
        self._sending = False  # a send started or reserved by a poster (one message at a time)
        self._posted = collections.deque()  # items posted while a message was in flight
        self._closing = False
        self._pack = None
        self._received = None  # the last receive's message (None: the stream ended)
        self._status = None  # (grpc.StatusCode, details) once the call ended

    def _next_event(self) -> None:
        """Collects one completion event (only while a batch is due: see the class docstring)."""
        event = self._call.next_event()
        tag = event.tag
        if tag == _RECV:
            self._received = event.batch_operations[0].message() if event.success else None
        elif tag == _STATUS:
            op = event.batch_operations[0]
            details = op.details()
            code = self._codes.get(op.code(), self._codes[self._unknown_code])
            status = (code, details.decode() if isinstance(details, bytes) else details)
        items = None
        with self._lock:
            self._due.discard(tag)
            if tag == _STATUS:
                self._status = status
            elif tag == _SEND:  # gRPC took the message: what was posted meanwhile goes now, as one
                items = list(self._posted) if self._status is None and not self._closing else []
                self._posted.clear()
                self._sending = bool(items)
        if items:
            self._start_send(self._pack(items))

    def _start_send(self, message: bytes) -> bool:
        """Starts sending ``message`` (the caller reserved ``_sending``); False if the call is
        over or closing (the reservation is dropped)."""
        with self._lock:
            if self._status is None and not self._closing and self._call.operate(
                    (self._send_op(message, 0),), _SEND):
                self._due.add(_SEND)
                return True
            self._sending = False
            return False

    def _ended(self):
        """The stream is over: waits for its status; ``None`` if OK, else the error to raise."""
        while self._status is None:
            self._next_event()
        code, details = self._status
        if code.name == "OK":
            return None
        return HostCallEnded(code, details or "")

    def send(self, message: bytes) -> None:
        """Sends ``message`` (waits until gRPC took the previous one).

        Raises:
            HostCallEnded: the pool already ended the stream with an error.
        """
        while True:
            with self._lock:
                if self._status is not None:
                    break
                if not self._sending:
                    self._sending = True
                    break
            self._next_event()  # the status is due: safe to wait
        if self._status is not None or not self._start_send(message):
            error = self._ended()
            if error is not None:
                raise error  # else the pool ended the stream: what it answers says so (recv: None)

    def posting(self, pack) -> None:
        """Makes :meth:`post` available: ``pack(items)`` turns the items posted while a message
        was in flight into the next message (called by the thread polling the call)."""
        self._pack = pack

    def post(self, item) -> None:
        """Sends ``item`` (packed alone) now if no message is in flight, else with the others
        waiting once gRPC takes it; from any thread, never blocks. Dropped once the stream
        ended or is closing (the thread in :meth:`recv` reports why)."""
        with self._lock:
            if self._status is not None or self._closing:
                return
            if self._sending:
                self._posted.append(item)
                return
            self._sending = True
        self._start_send(self._pack([item]))

    def recv(self):
        """The pool's next message, ``None`` once it ended the stream normally.

        Raises:
            HostCallEnded: the stream ended with an error (cancelled, the pool gone, refused).
        """
        with self._lock:
            started = self._status is None and self._call.operate((self._recv_op(0),), _RECV)
            if started:
                self._due.add(_RECV)
        if started:
            while _RECV in self._due:
                self._next_event()
            if self._received is not None:
                return self._received
        error = self._ended()
        if error is not None:
            raise error
        return None

    def __iter__(self):
        while True:
            message = self.recv()
            if message is None:
                return
            yield message

    def cancel(self) -> None:
        """Ends the stream (from any thread): a waiting :meth:`recv` raises ``CANCELLED``."""
        self._call.cancel(self._cancelled_code, "cancelled by the host")

    def close(self) -> None:
        """Cancels the stream if it is still open and collects every event still due (nothing
        of the call is left in gRPC; posts from now on are dropped)."""
        with self._lock:
            self._closing = True
            self._posted.clear()
            open_ = self._status is None
        if open_:
            self.cancel()
        while True:
            with self._lock:
                if not self._due:
                    return
            self._next_event()
