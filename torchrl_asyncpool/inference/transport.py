"""ProcessSlotTransport: the env slots of an :class:`~torchrl_asyncpool.AsyncEnvPool`, served from another process."""
from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection
import os
import select
import threading
import time
from typing import Optional


from torchrl_asyncpool.exchange.consumer import ConsumerHandle
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool._sys.forkserver import START_METHODS, death_fd, exit_code, forkserver_context, picklable
from torchrl_asyncpool._sys.descriptors import ship_fds
from torchrl_asyncpool.inference._common import InferenceServerError, ServerSpec
from torchrl_asyncpool.inference._shared import SharedWeights, StatsBlock

__all__ = ["ProcessSlotTransport"]

# Exception types a start-up error may be re-raised as in the owner; anything else becomes
# InferenceServerError. Only names travel (as text), never pickled objects.
_STARTUP_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}


def _as_handle(pool) -> ConsumerHandle:
    if isinstance(pool, ConsumerHandle):
        return pool
    get = getattr(pool, "consumer_handle", None)
    if get is None:
        raise TypeError(
            f"expected an AsyncEnvPool (or its ConsumerHandle), got {type(pool).__name__}."
        )
    return get()


class ProcessSlotTransport:
    """Binds the env slots of an :class:`~torchrl_asyncpool.AsyncEnvPool` to an inference server process.

    The transport carries ``pool.consumer_handle()`` (the arena and doorbell descriptors, no
    tensors) into a server process started from the ``"forkserver"`` (default) or ``"spawn"``
    context. The policies are built there from their factories; records and actions never
    leave shared memory. Three more channels connect the owner and the server:

    * a *life pipe*: the server exits at its next wake-up when the owner closes it, or when the
      owner dies (no orphan server);
    * a *status pipe* carrying UTF-8 JSON text only (start-up, errors with their tracebacks);
      nothing the server sends is unpickled;
    * two shared-memory blocks: the weights (a sequence-locked parameter set per policy that
      the server checks before each batch) and the server's stats.

    A monitor thread in the owner watches the status pipe and the server's process sentinel:
    a server that raises or dies is reported by :meth:`check` within milliseconds.

    Usually created by :meth:`InferenceServer.start` (``mode="process"``); create it yourself
    to choose its options and pass it to ``start``.

    Args:
        pool (AsyncEnvPool or ConsumerHandle): the pool whose slots the server consumes. Once
            bound, do not call ``pool.recv``/``pool.send`` yourself.

    Keyword Args:
        mp_start_method (str, optional): ``"forkserver"`` (default) or ``"spawn"``.
        num_threads (int, optional): ``torch.set_num_threads`` in the server process.
            Defaults to ``1``; ``None`` keeps torch's default.
        start_timeout (float, optional): seconds to wait for the server to build its
            policies and validate them. Defaults to ``120``.

    Examples:
        >>> import functools, os, time
        >>> from torchrl_asyncpool import AsyncEnvPool, InferenceServer, ProcessSlotTransport
        >>> from torchrl_asyncpool.testing.policies import OracleTagPolicy
        >>> from torchrl_asyncpool.testing import OracleEnv
        >>> with AsyncEnvPool([functools.partial(OracleEnv, env_id=i) for i in range(2)],
        ...                   envs_per_worker=2) as pool:
        ...     transport = ProcessSlotTransport(pool)
        ...     with InferenceServer(policy_factory=OracleTagPolicy).start(transport) as server:
        ...         while server.stats()["frames"] < 20:
        ...             time.sleep(0.01)
        ...         print(server.mode, server.pid != os.getpid())
        process True
    """

    def __init__(self, pool, *, mp_start_method: str = "forkserver", num_threads: Optional[int] = 1,
                 start_timeout: Optional[float] = 120.0):
        if mp_start_method not in START_METHODS:
            raise ValueError(f"mp_start_method must be one of {START_METHODS}, got {mp_start_method!r}.")
        self.handle = _as_handle(pool)
        self.mp_start_method = mp_start_method
        self.num_threads = num_threads
        self.start_timeout = start_timeout
        self._proc = None
        self._conn = None
        self._life_w = -1
        self._weights_fd = self._stats_fd = -1
        self._weights: Optional[SharedWeights] = None
        self._stats: Optional[StatsBlock] = None
        self._monitor = None
        self._wake = None
        self._release = None  # rung once to let a held server serve (see start)
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def pid(self) -> Optional[int]:
        """The server process id (``None`` before start)."""
        return None if self._proc is None else self._proc.pid

    @property
    def is_alive(self) -> bool:
        """Whether the server process runs and has reported no error."""
        return self._running and self._error is None

    @property
    def _running(self) -> bool:
        # whether the server process may still touch the pool's slots (error reported or not)
        return self._proc is not None and exit_code(self._proc) is None

    @property
    def error(self) -> Optional[BaseException]:
        """The server's first error (:class:`InferenceServerError`) seen so far, or ``None``."""
        return self._error

    def start(self, spec: ServerSpec, names, hold: bool = False) -> None:
        """Starts the server process for ``spec`` and waits until it serves (or raises its start-up error).

        With ``hold=True`` the process builds and validates everything and reports ready, but leases
        no record until :meth:`release`: weights published meanwhile act from its first batch.
        """
        if self._proc is not None or self._closed:
            raise RuntimeError("this ProcessSlotTransport was already used; create a new one.")
        method = self.mp_start_method
        ctx = forkserver_context("ProcessSlotTransport") if method == "forkserver" else mp.get_context(method)
        spec.factories = {n: picklable(f) for n, f in spec.factories.items()}
        if spec.on_batch is not None:
            spec.on_batch = picklable(spec.on_batch)
        spec.num_threads = self.num_threads
        self._names = list(names)
        try:
            self._weights_fd = os.memfd_create("torchrl_asyncpool_weights", os.MFD_CLOEXEC)
            self._stats_fd = os.memfd_create("torchrl_asyncpool_server_stats", os.MFD_CLOEXEC)
            os.ftruncate(self._stats_fd, StatsBlock.nbytes_for(len(self._names)))
            self._stats = StatsBlock.from_fd(self._stats_fd, self._names)
            life_r, self._life_w = os.pipe()
            self._release = Doorbell()
            if not hold:
                self._release.ring()
            reader, writer = ctx.Pipe(duplex=False)
            self._conn = reader
            from torchrl_asyncpool.inference._process import server_main

            try:
                proc = ctx.Process(
                    target=server_main,
                    args=(self.handle, spec, InheritedFd(self._weights_fd), InheritedFd(self._stats_fd),
                          InheritedFd(life_r), writer, self._release.inheritable()),
                    name="torchrl_asyncpool-inference-server",
                    daemon=True,
                )
                with ship_fds():  # the handle's bells (one per env for threaded workers) go after the start
                    proc.start()
                self._proc = proc
            finally:
                writer.close()
                os.close(life_r)
            msg = self._await_ready()
            self._weights = SharedWeights.attach(self._weights_fd, msg["weights"])
        except BaseException:
            self.close()
            raise
        self._wake = Doorbell()
        self._monitor = threading.Thread(target=self._watch, name="torchrl_asyncpool-inference-monitor", daemon=True)
        self._monitor.start()

    def _await_ready(self) -> dict:
        deadline = None if self.start_timeout is None else time.monotonic() + self.start_timeout
        sentinel = death_fd(self._proc)  # not its sentinel: a fork server's end is not the server's
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"the inference server did not finish start-up within {self.start_timeout}s.")
            ready = multiprocessing.connection.wait([self._conn, sentinel], remaining)
            if self._conn in ready:
                try:
                    msg = _decode(self._conn.recv_bytes())
                except EOFError:
                    # closed without a word: the process died before server_main could report, e.g.
                    # unpickling its policy factory (an EOF stays readable: waiting again would spin)
                    exit_code(self._proc, 1.0)
                    raise InferenceServerError(
                        f"the inference server process (pid {self._proc.pid}) died during start-up "
                        f"({self._death()}) before it could report why; its traceback is on its standard "
                        "error. A policy_factory must be importable by the server process (defined in a "
                        "module, or under an `if __name__ == \"__main__\":` guard in a script file)."
                    ) from None
                if msg.get("event") == "ready":
                    return msg
                raise _startup_error(msg)
            if sentinel in ready and not self._conn.poll(0):
                raise InferenceServerError(
                    f"the inference server process (pid {self._proc.pid}) died during start-up ({self._death()})."
                )

    def _death(self) -> str:
        code = exit_code(self._proc, 0.2)
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _watch(self) -> None:
        """Monitor thread: records the server's errors and its death as they happen."""
        try:
            poller = select.poll()
            conn_fd, sentinel, wake_fd = self._conn.fileno(), death_fd(self._proc), self._wake.fd
            for fd in (conn_fd, sentinel, wake_fd):
                poller.register(fd, select.POLLIN)
            while not self._closed:
                events = poller.poll()
                fds = {fd for fd, _ in events}
                if wake_fd in fds or any(ev & select.POLLNVAL for _, ev in events):
                    return
                if conn_fd in fds or sentinel in fds:
                    self._drain_messages()
                if sentinel in fds:
                    if self._error is None and not self._stopping:
                        self._error = InferenceServerError(
                            f"the inference server died: its process (pid {self._proc.pid}) ended ({self._death()}); "
                            "its leased slots were not answered."
                        )
                    return
        except Exception:  # noqa: BLE001 - a monitor must never die noisily; check() still sees the sentinel
            return

    def _drain_messages(self) -> None:
        try:
            while self._conn.poll(0):
                msg = _decode(self._conn.recv_bytes())
                if msg.get("event") == "error" and self._error is None:
                    key = tuple(msg["key"]) if msg.get("key") else None
                    self._error = InferenceServerError(
                        msg.get("message", "server error"), key, msg.get("traceback", "")
                    )
        except (EOFError, OSError):
            pass

    # -- owner API --------------------------------------------------------------------------
    def check(self) -> None:
        """Raises the server's error (a policy that raised, a dead server or env worker), if any."""
        if self._error is not None:
            raise self._error
        if self._proc is not None and exit_code(self._proc) is not None and not self._stopping:
            self._drain_messages()
            if self._error is None:
                self._error = InferenceServerError(
                    f"the inference server died: its process (pid {self._proc.pid}) ended ({self._death()}); "
                    "its leased slots were not answered."
                )
            raise self._error

    def release(self) -> None:
        """Lets a server started with ``hold=True`` lease records (idempotent)."""
        if self._release is not None and not self._closed:
            self._release.ring()

    def publish_weights(self, name, flat, version) -> None:
        """Writes policy ``name``'s weights (``{parameter or buffer name: tensor}``, every name of
        :meth:`weight_names`) at ``version`` into the shared weight block; the server applies them
        before its next batch. Raises the server's error first, if it has one."""
        self.check()
        self._weights.publish(name, flat, version)

    def weight_names(self, name):
        """The parameter and buffer names of policy ``name`` that :meth:`publish_weights` expects."""
        return self._weights.names(name)

    @property
    def stats_block(self) -> Optional[StatsBlock]:
        """The server's shared statistics block (``None`` before :meth:`start`)."""
        return self._stats

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the server process exits or ``timeout`` passes; returns whether it exited."""
        if self._proc is None:
            return True
        if self._monitor is not None:
            self._monitor.join(timeout)
            return not self._monitor.is_alive()
        return exit_code(self._proc, timeout) is not None

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Stops the server (closing its life pipe), kills it after ``timeout`` seconds (``None``:
        waits for it to end). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        if self._life_w >= 0:
            os.close(self._life_w)
            self._life_w = -1
        if self._proc is not None:
            if exit_code(self._proc, timeout) is None:
                self._proc.kill()
                exit_code(self._proc, 2.0)
            if self._error is None and self._conn is not None:
                self._drain_messages()
        if self._wake is not None:
            self._wake.ring()
        if self._monitor is not None:
            self._monitor.join(2.0)
        if self._wake is not None:
            self._wake.close()
        if self._release is not None:
            self._release.close()
        if self._conn is not None:
            self._conn.close()
        if self._weights is not None:
            self._weights.close()
        for attr in ("_weights_fd", "_stats_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    def __repr__(self):
        return f"{type(self).__name__}(num_envs={self.handle.layout.num_slots}, pid={self.pid}, alive={self.is_alive})"



def _decode(data: bytes) -> dict:
    try:
        msg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"event": "error", "message": "undecodable status message from the inference server"}
    return msg if isinstance(msg, dict) else {"event": "error", "message": "malformed status message"}


def _startup_error(msg) -> BaseException:
    etype = _STARTUP_TYPES.get(msg.get("etype"))
    text = msg.get("message", "start-up failed")
    if etype is not None and msg.get("validation"):
        return etype(text)
    key = tuple(msg["key"]) if msg.get("key") else None
    return InferenceServerError(f"the inference server failed during start-up: {text}", key, msg.get("traceback", ""))

