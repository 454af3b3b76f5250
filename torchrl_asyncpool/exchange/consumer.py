"""The consumer side of the exchange: the deadline batch former (``recv``) and ``send``.

A :class:`SlotConsumer` can live in the pool's own process (``AsyncEnvPool.recv``) or in
another one (an inference server): everything it needs travels in a picklable
:class:`ConsumerHandle` of file descriptors, so attaching costs one ``mmap`` and nothing
is pickled per step. Exactly one consumer may drive a pool at a time.
"""
from __future__ import annotations

import select
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from torchrl_asyncpool.errors import EnvError, PoolClosedError, WorkerDiedError
from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.arena import Arena, ArenaLayout
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool._sys.exit_begun import EXIT_CHECK_S, describe_exit, exit_begun
from torchrl_asyncpool.exchange.gather import numpy_or_none
from torchrl_asyncpool.exchange.metrics import record_wait
from torchrl_asyncpool.exchange.native import build_engine
from torchrl_asyncpool.exchange.wait_loop import NOT_DUE, TIMED_OUT, WaitLoop

__all__ = ["ConsumerHandle", "SlotConsumer"]

#: how often a consumer that does not block looks for dead workers (see ``_check_sentinels``)
_SENTINEL_PERIOD_S = 0.005
#: how often a consumer with a ``watchdog`` runs it, blocked or not
_WATCH_PERIOD_S = 0.02
#: seconds a ``recv`` waits before it warns that too few envs can publish (every other env awaits
#: its action: records recv returned and nobody answered with ``send``), which only another
#: thread's ``send`` can end
RECV_STALL_WARN_S = 10.0


@dataclass
class ConsumerHandle:
    """What a process needs to consume a pool's slots: layout and descriptors, no tensors."""

    layout: ArenaLayout
    arena_fd: InheritedFd
    consumer_bell: InheritedFd
    bells: List[InheritedFd]  # the workers' doorbells: one per worker, or one per slot (threaded workers)
    slot_bell: List[int]  # slot -> index in bells
    worker_sentinels: List[InheritedFd]
    slot_worker: List[int]
    worker_pids: List[int]
    action_keys: list = field(default_factory=list)
    exchange: str = "python"  # resolved by the pool: "auto", "native" or "python" (see exchange.native)
    idle_poll: bool = False  # resolved by the pool: whether a serving loop's waits idle-poll


class SlotConsumer:
    """Forms batches from ready slots and answers them.

    Args:
        handle (ConsumerHandle): from :meth:`AsyncEnvPool.consumer_handle
            <torchrl_asyncpool.AsyncEnvPool.consumer_handle>`.

    Keyword Args:
        pin_memory (bool): allocate the staging buffer in pinned memory.
        arena (Arena, optional): an existing mapping to reuse (same process as the pool).
        death_info (callable, optional): ``worker -> str`` describing how a worker died.
        keys (sequence of keys, optional): the request entries batches carry (all by default).
        watchdog (callable, optional): ``() -> None``, run about every 20 ms while this
            consumer waits or leases (a pool that replaces dead or hung workers passes its own,
            which raises when it cannot; see :mod:`~torchrl_asyncpool.workers.watch`).
    """

    def __init__(self, handle: ConsumerHandle, *, pin_memory: bool = False, arena: Optional[Arena] = None,
                 death_info: Optional[Callable[[int], str]] = None, keys: Optional[Sequence[tuple]] = None,
                 watchdog: Optional[Callable[[], None]] = None):
        self.handle = handle
        self.arena = arena if arena is not None else Arena.attach(handle.layout, handle.arena_fd.fd)
        n = self.num_envs = handle.layout.num_slots
        self.action_keys = list(handle.action_keys)
        self.response_keys = [f.key if len(f.key) > 1 else f.key[0] for f in handle.layout.response]
        self._bell = Doorbell(handle.consumer_bell.fd)
        self._slot_worker = np.asarray(handle.slot_worker)
        self._last_sentinel_check = 0.0
        self._last_exit_check = 0.0
        self._death_info = death_info
        self._watchdog = watchdog
        self._last_watch = 0.0
        self._sentinels = {}
        self._sentinel_poller = select.poll()
        for w, s in enumerate(handle.worker_sentinels):
            self._sentinel_poller.register(s.fd, select.POLLIN)
            self._sentinels[s.fd] = w
        # recv's and wait_ready's waits: the doorbell and the sentinels (a death is noticed at
        # once), blocking in poll(2), at most a watchdog period (or an exit check's) at a time
        self._wait = WaitLoop(self._bell, list(self._sentinels), max_wait=self.wait_bound(None), idle_poll=False)
        self._want = (1, 1, None)  # what the running wait needs: (min_get or count, cap, deadline)
        self._recv_since, self._stall_warned = 0.0, False  # the running recv's start, its warning given
        self.closed_by_owner = False  # set by the pool's close(): workers that exit are not faults
        self._ready = 0  # records ready at the running wait's last look
        # keys: the request entries batches carry (all by default); a serving loop whose policies
        # declare what they read leaves the others in the slots instead of copying them per batch
        request = self.arena.request if keys is None else self.arena.request.select(*keys)
        staging = TensorDict(
            {**request.clone().to_dict(), "env_index": torch.zeros(n, dtype=torch.int64)}, batch_size=[n]
        )
        self._staging = staging.pin_memory() if pin_memory else staging
        keys = list(request.keys(True, True))
        self._staging_env_index_np = self._staging.get("env_index").numpy()
        self._batch_rows = {}  # (b, extras given) -> nested dict of the staging rows [:b] (and extras)
        self._response = [(k, self.arena.response.get(k)) for k in self.response_keys]
        # numpy views of the response fields (None for dtypes numpy lacks): a fancy-index store
        # costs a few us less than torch's index_copy_ dispatch, once per key and batch
        self._response_np = [numpy_or_none(dst) for _, dst in self._response]
        self._fills = {}  # response field -> (int value, one row of it)
        # lease, answer and scan: the C engine or the pure-Python reference (exchange.native), one
        # interface; the consumer never asks which
        engine_args = (
            self.arena, self._staging_env_index_np,
            [(k, self.arena.request.get(k), self._staging.get(k)) for k in keys],
            self._response, [b.fd for b in handle.bells], np.asarray(handle.slot_bell),
        )
        self._engine = build_engine(handle.exchange, *engine_args)
        self._reference_args = engine_args  # close() swaps in the Python engine over the same buffers
        # a memoryview adds a Python float to an element in half the time numpy's scalar += takes
        self._stats = memoryview(self.arena.consumer_stats)
        self._last_exit = None
        self.last_lease_time, self.last_dwell = 0.0, 0.0
        self.error = None

    # -- batch former -----------------------------------------------------------------------
    def recv(self, min_get: int = 1, max_get: int | None = None, timeout: float | None = None) -> TensorDictBase:
        """See :meth:`torchrl_asyncpool.AsyncEnvPool.recv`.

        Lifetime of a batch: the returned TensorDict is new for every call, so keys a policy
        adds to it (or removes) stay with that batch only, but its tensors are views of rows of
        this consumer's staging buffer, which the next ``recv`` or :meth:`lease_ready` overwrites
        (row ``i`` of every batch of ``B`` records is staging row ``i``). Read them, or pass them
        to the policy, before the next call; ``clone()`` what must live longer. Workers never
        write the staging buffer, so nothing changes under a batch before that call, and
        answering a batch with :meth:`send` does not invalidate it.
        """
        t_enter = time.monotonic()
        if self.error is not None:
            raise self.error
        n = self.num_envs
        if isinstance(min_get, bool) or not isinstance(min_get, int) or not 1 <= min_get <= n:
            raise ValueError(f"min_get must be an int in [1, num_envs={n}], got {min_get!r}.")
        if max_get is not None and (isinstance(max_get, bool) or not isinstance(max_get, int) or max_get < min_get):
            raise ValueError(f"max_get must be None or an int >= min_get={min_get}, got {max_get!r}.")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or >= 0, got {timeout!r}.")
        deadline = None if timeout is None else t_enter + timeout
        cap = n if max_get is None else min(max_get, n)
        self._want = (min_get, cap, deadline)
        self._recv_since, self._stall_warned = t_enter, False
        wait = self._wait
        if self._run(self._recv_due, deadline, self._recv_health) == TIMED_OUT:
            leased = self._leased_past(min_get)
            stalled = (f" ({leased} of the {n} envs await their actions: answer the records recv returned with "
                       "send, or fewer than min_get envs can publish)" if leased is not None else "")
            raise TimeoutError(
                f"recv timed out after {timeout}s with {self._ready}/{min_get} envs ready{stalled}; "
                "nothing was consumed, ready records stay available to the next call."
            )
        self._check_sentinels(wait.now)  # a dead worker is reported, not skipped
        return self._lease(cap, wait.waited)

    def _recv_due(self, now: float) -> float:
        """``recv``'s readiness test (see :class:`~torchrl_asyncpool.exchange.wait_loop.WaitLoop`):
        due once ``min_get`` records are ready and either ``cap`` are or the deadline passed."""
        ready, _, errors, _ = self._engine.scan()  # counts only: no array per look
        if errors:
            self.raise_worker_errors()
        self._ready = ready
        min_get, cap, deadline = self._want
        if ready < min_get:
            return NOT_DUE
        if deadline is None or ready >= cap:
            return 0.0
        return deadline - now

    def lease_ready(self, cap: int, extras: Optional[dict] = None) -> Optional[TensorDictBase]:
        """Leases what is ready now (oldest first, at most ``cap``) for a serving loop that has
        already waited for it; ``None`` when nothing is. No argument checks and no blocking.

        ``extras``: ``{key: tensor}`` of constant rows (at least ``cap``) that every batch of
        this loop carries besides the records, e.g. a ``"valid_mask"`` of ones; their first
        ``b`` rows join the batch without a validated ``set``. Pass the same dict every call.
        """
        if self.error is not None:
            raise self.error
        self._check_sentinels(time.monotonic())
        return self._lease(cap, 0.0, extras)

    def scan_states(self):
        """``(obs_ready, action_ready, errors, oldest_ready_time)``: slots in ``OBS_READY``,
        ``ACTION_READY`` and ``ERROR``, and the earliest ``ready_time`` of the ready ones
        (``inf`` when none), in one pass over the slots."""
        return self._engine.scan()

    def _recv_health(self, now: float) -> None:
        """``recv``'s health hook: :meth:`_check_sentinels`, and past :data:`RECV_STALL_WARN_S`
        a warning (once a call) when fewer envs than ``min_get`` can publish."""
        self._check_sentinels(now)
        if not self._stall_warned and now - self._recv_since > RECV_STALL_WARN_S:
            min_get = self._want[0]
            leased = self._leased_past(min_get)
            if leased is not None:
                self._stall_warned = True
                warnings.warn(
                    f"recv(min_get={min_get}) has waited {now - self._recv_since:.0f} s while {leased} of the pool's "
                    f"{self.num_envs} envs await their actions: an env steps again only once send(actions, "
                    "env_indices) answers the record recv returned for it, so fewer than min_get envs can publish. "
                    "Answer them (from another thread, if this one waits), or this recv waits forever.",
                    RuntimeWarning, stacklevel=5,  # the caller of AsyncEnvPool.recv
                )

    def _leased_past(self, min_get: int) -> Optional[int]:
        """How many envs await their actions (records leased, not answered), when so many that
        fewer than ``min_get`` can publish: a recv for ``min_get`` then waits for a ``send``
        only; ``None`` otherwise."""
        leased = int((self.arena.state == S.LEASED).sum())
        return leased if self.num_envs - leased < min_get else None

    def _pool_closed(self) -> PoolClosedError:
        return PoolClosedError("the pool was closed while this call waited for its envs.")

    def _check_sentinels(self, now: float) -> None:
        """Raises if a worker died, looking at most every :data:`_SENTINEL_PERIOD_S`: a consumer
        that never blocks in ``poll`` (where deaths are noticed at once) would otherwise pay one
        extra system call per batch. A dead worker's slots never become ready, so the delay
        loses nothing."""
        self.watch(now)
        if now - self._last_sentinel_check > _SENTINEL_PERIOD_S:
            self._last_sentinel_check = now
            if self._sentinel_poller.poll(0):
                self.raise_worker_errors()

    def _raise_lingering(self) -> None:
        """Raises :class:`~torchrl_asyncpool.WorkerDiedError` for a worker whose main thread has
        exited while its process runs on: its death descriptor stays quiet until the process
        ends, which can take minutes (see :mod:`~torchrl_asyncpool._sys.exit_begun`)."""
        for w in sorted(self._sentinels.values()):
            code = exit_begun(self.handle.worker_pids[w])
            if code is not None:
                self._raise_died(w, describe_exit(code))

    def watch(self, now: float) -> None:
        """Runs the watchdog if it has one and its period has passed, and raises for a worker
        whose main thread has exited (see :meth:`_raise_lingering`): for a serving loop that
        waits on its own (see ``inference/_loop.py``)."""
        if self._watchdog is not None and now - self._last_watch > _WATCH_PERIOD_S:
            self._last_watch = now
            self._watchdog()
        if self._sentinels and now - self._last_exit_check >= EXIT_CHECK_S:
            self._last_exit_check = now
            self._raise_lingering()

    def wait_bound(self, remaining):
        """A wait's timeout: ``remaining`` (seconds or ``None``), at most the watchdog's period
        when there is one, else at most :data:`~torchrl_asyncpool._sys.exit_begun.EXIT_CHECK_S`
        where worker processes are watched for deaths (a worker whose main thread exited wakes
        no descriptor)."""
        bound = _WATCH_PERIOD_S if self._watchdog is not None else EXIT_CHECK_S if self._sentinels else None
        if bound is None:
            return remaining
        return bound if remaining is None else min(remaining, bound)

    def wait_ready(self, count: int = 1, timeout: float | None = None) -> int:
        """Blocks until ``count`` records are ready or ``timeout`` passes; leases nothing.

        Returns how many records are ready. Lets a serving loop wait for work in long,
        interruptible steps and then start its (short) flush deadline from the first record.
        """
        if self.error is not None:
            raise self.error
        deadline = None if timeout is None else time.monotonic() + timeout
        self._want = (count, 0, None)
        wait = self._wait
        try:
            self._run(self._count_due, deadline, self._check_sentinels)
        finally:  # the wait before a fault counts too
            record_wait(self._stats, wait.waited)
        return self._ready

    def _run(self, due, deadline, health) -> str:
        """One wait of ``recv`` or ``wait_ready``; a wait the pool's ``close()`` (in another
        thread) cut short, its descriptors closed under it, ends in :class:`PoolClosedError`."""
        try:
            return self._wait.run(due, deadline, health, self.raise_worker_errors)
        except (OSError, ValueError) as exc:
            if self.closed_by_owner:
                raise self._pool_closed() from exc
            raise

    def _count_due(self, now: float) -> float:
        """``wait_ready``'s readiness test: due once ``count`` records are ready (env errors
        raise only while fewer are)."""
        ready, _, errors, _ = self._engine.scan()
        self._ready = ready
        if ready >= self._want[0]:
            return 0.0
        if errors:
            self.raise_worker_errors()
        return NOT_DUE

    def _lease(self, cap: int, waited: float, extras: Optional[dict] = None) -> Optional[TensorDictBase]:
        """Leases up to ``cap`` of the oldest ready slots (the engine scans for itself and adds
        the batch to the stats); ``None`` if it found none."""
        now = time.monotonic()
        b, dwell = self._engine.lease(cap, now, waited)
        if b == 0:
            return None
        self.last_lease_time, self.last_dwell = now, dwell  # a serving loop's stats reuse them
        rows = self._batch_rows.get((b, extras is not None))
        if rows is None:
            rows = _leaf_tree(self._staging[:b])
            rows.update({k: v[:b] for k, v in (extras or {}).items()})
            self._batch_rows[(b, extras is not None)] = rows
        out = _fresh_td(rows, b)  # a new TensorDict each batch: a policy may add keys to it
        out.env_indices = rows["env_index"]
        return out

    # -- answers ----------------------------------------------------------------------------
    def send(self, actions: TensorDictBase | Mapping, env_indices) -> None:
        """See :meth:`torchrl_asyncpool.AsyncEnvPool.send`."""
        if self.error is not None:
            raise self.error
        idx = as_index(env_indices, self.num_envs)
        b = idx.numel()
        idx_np = idx.numpy()
        states = self.arena.state[idx_np]
        if (states != S.LEASED).any():  # one check on the fast path; the cause only on failure
            if (states == S.ERROR).any():
                self.raise_worker_errors()
            not_leased = idx_np[states != S.LEASED]
            raise ValueError(
                f"send got env indices {not_leased.tolist()} that are not awaiting an action "
                "(each index must come from recv(...).env_indices and be answered once)."
            )
        values = []
        for key, dst in self._response:
            value = actions.get(key, None) if isinstance(actions, TensorDictBase) else _mapping_get(actions, key)
            if value is None:
                raise ValueError(
                    f"send: actions miss the key {key!r}; expected keys {self.response_keys} "
                    f"(given {_keys_of(actions)})."
                )
            _check_rows(key, dst, value, b)
            values.append(value)
        self._write(values, idx_np, None)

    def send_rows(self, values: Sequence, idx, lease_time: Optional[float] = None) -> None:
        """:meth:`send` for the caller that leased ``idx`` itself (a serving loop).

        ``values`` are the response leaves in :attr:`response_keys` order (a Python ``int``
        fills every row, e.g. a policy version), ``idx`` the ``env_indices`` of a batch this
        consumer leased and has not answered (a ``LongTensor`` or an int64 numpy array): the
        indices and slot states are trusted, only shapes and dtypes are checked
        (``ValueError`` naming the key, before anything is written). ``lease_time``: when
        every row was leased, if that was one lease (saves reading the slots' lease times back).
        """
        if self.error is not None:
            raise self.error
        idx_np = idx if idx.__class__ is np.ndarray else idx.numpy()
        if idx_np.dtype != np.int64 or not idx_np.flags.c_contiguous:
            idx_np = np.ascontiguousarray(idx_np, np.int64)
        self._write(values, idx_np, lease_time)

    def _write(self, values, idx_np: np.ndarray, lease_time: Optional[float]) -> None:
        """Writes answers into their slots, hands the slots back and rings their workers (the
        engine's ``answer``, which also adds them to the stats). Each value is checked here."""
        b = idx_np.size
        rows = [self._fill_row(k, v) if v.__class__ is int else self._row_array(k, v, b)
                for k, v in enumerate(values)]
        self._engine.answer(idx_np, rows, time.monotonic(), -1.0 if lease_time is None else lease_time)

    def _row_array(self, k: int, value, b: int):
        """``value`` as ``b`` C-contiguous numpy rows of response field ``k`` (a contiguous CPU
        tensor for a field numpy cannot view, which only the Python engine serves); ``ValueError``
        naming the key unless it is a tensor of the field's row shape and dtype."""
        dst = self._response_np[k]
        if dst is None:
            key, dst_t = self._response[k]
            _check_rows(key, dst_t, value, b)
            return value.detach().cpu().contiguous()
        try:
            arr = value.numpy()  # fails for non-tensors, device tensors and tensors that need grad
        except (AttributeError, TypeError, RuntimeError):
            arr = None
        if (arr is None or arr.dtype != dst.dtype or arr.ndim != dst.ndim or arr.shape[0] != b
                or arr.shape[1:] != dst.shape[1:] or not arr.flags.c_contiguous):
            key, dst_t = self._response[k]
            _check_rows(key, dst_t, value, b)  # raises on a wrong shape or dtype
            arr = value.detach().cpu().contiguous().numpy()
        return arr

    def _fill_row(self, k: int, value: int):
        """One row of response field ``k`` filled with ``value`` (cached for the last value):
        bytes, or a tensor for a field numpy cannot view."""
        cached = self._fills.get(k)
        if cached is None or cached[0] != value:
            dst = self._response_np[k]
            if dst is None:
                dst_t = self._response[k][1]
                row = torch.full(dst_t.shape[1:], value, dtype=dst_t.dtype)
            else:
                row = np.full(dst.shape[1:], value, dst.dtype).tobytes()
            cached = self._fills[k] = (value, row)
        return cached[1]

    # -- faults -----------------------------------------------------------------------------
    def raise_worker_errors(self) -> None:
        """Raises (and remembers) the first env error or worker death, if any."""
        if self.error is not None:
            raise self.error
        errored = np.flatnonzero(self.arena.state == S.ERROR)
        if errored.size:
            i = int(errored[0])
            text = self.arena.read_error(i)
            phase, _, tb = text.partition("\n")
            self.error = EnvError(i, phase, tb)
            raise self.error
        # a fresh poll object: this runs from other threads too (a driver's health check) and
        # poll objects refuse concurrent use; the recv thread's own poller is not shared
        dead = _poll_now(list(self._sentinels))
        if dead:
            w = min(self._sentinels[fd] for fd in dead)
            self._raise_died(w, self._death_info(w) if self._death_info is not None else "exit status unknown here")

    def _raise_died(self, w: int, how: str) -> None:
        if self.closed_by_owner:  # the workers exit because the pool is closing, not by a fault
            raise self._pool_closed()
        slots = np.flatnonzero(self._slot_worker == w).tolist()
        self.error = WorkerDiedError(
            f"worker {w} (pid {self.handle.worker_pids[w]}, hosting envs {slots}) died ({how}).", slots
        )
        raise self.error

    def close(self) -> None:
        """Drops this process's mapping (descriptors belong to the handle's owner)."""
        self._batch_rows.clear()
        # the C engine holds exports of the arena's buffers: let them go; a later call (a serving
        # thread finishing its batch) runs on the Python engine over the same arrays
        self._engine = build_engine("python", *self._reference_args)


def _leaf_tree(td: TensorDictBase) -> dict:
    """``td`` as a nested dict of its (view) tensors."""
    return {k: (_leaf_tree(v) if isinstance(v, TensorDictBase) else v) for k, v in td.items()}


#: tensordict's unvalidated constructor (private API, present in the 0.14 line TorchRL 0.14 pins);
#: ``None`` falls back to the public, validating one
_NEW_UNSAFE = getattr(TensorDict, "_new_unsafe", None)


def _fresh_td(tree: dict, b: int) -> TensorDictBase:
    """A new TensorDict over the tensors of ``tree`` (no copy of data, no re-validation: they
    are staging rows of batch size ``b``). ``TensorDict.copy()`` re-checked every leaf and cost
    ~3x more, once per batch on the serving loop's hot path."""
    if _NEW_UNSAFE is None:
        return TensorDict(tree, batch_size=[b])
    return _NEW_UNSAFE(source=tree, batch_size=torch.Size([b]))


def _poll_now(fds) -> list:
    """The descriptors among ``fds`` that are readable right now."""
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    return [fd for fd, _ in p.poll(0)]


_INDEX_RULE = "env_indices must be Python ints or a 1-D integer tensor or array (as in recv(...).env_indices)"


def as_index(env_indices, n) -> torch.Tensor:
    """Validates ``env_indices`` into a contiguous CPU ``LongTensor``.

    Accepted: a 1-D integer tensor or numpy array, or a sequence of Python (or numpy) ints.
    Anything else (floats, bools, a tensor of another rank, ``None``, strings) is a
    ``ValueError`` naming what was given: no value is rounded or flattened.
    """
    if isinstance(env_indices, (torch.Tensor, np.ndarray)):
        dtype = env_indices.dtype
        integer = (
            not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
            if isinstance(env_indices, torch.Tensor)
            else np.issubdtype(dtype, np.integer)
        )
        if not integer or env_indices.ndim != 1:
            kind = "tensor" if isinstance(env_indices, torch.Tensor) else "array"
            raise ValueError(
                f"{_INDEX_RULE}; got a {env_indices.ndim}-D {kind} of dtype {dtype} "
                f"and shape {tuple(env_indices.shape)}."
            )
        idx = env_indices if isinstance(env_indices, torch.Tensor) else torch.from_numpy(env_indices)
        if idx.dtype != torch.int64 or idx.device.type != "cpu":
            idx = idx.to("cpu", torch.int64)
    else:
        if isinstance(env_indices, (str, bytes, Mapping)) or not hasattr(env_indices, "__iter__"):  # None too
            raise ValueError(f"{_INDEX_RULE}; got {type(env_indices).__name__} {env_indices!r}.")
        values = list(env_indices)
        for i, v in enumerate(values):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                if isinstance(v, torch.Tensor) and v.ndim == 0 and not (v.dtype.is_floating_point or v.dtype.is_complex
                                                                         or v.dtype == torch.bool):
                    values[i] = int(v)  # an element of an integer tensor
                    continue
                raise ValueError(f"{_INDEX_RULE}; got {type(v).__name__} {v!r} at position {i} of {env_indices!r}.")
        idx = torch.tensor(values, dtype=torch.int64)
    idx = idx.contiguous()
    a = idx.numpy()
    if a.size == 0:
        raise ValueError("send got no env indices.")
    if a.min() < 0 or a.max() >= n:
        raise ValueError(f"env_indices must lie in [0, {n}), got {a.tolist()}.")
    if a.size > 1 and np.bincount(a, minlength=n).max() > 1:
        raise ValueError(f"env_indices must not repeat, got {a.tolist()}.")
    return idx


def _check_rows(key, dst: torch.Tensor, value, b: int) -> None:
    """Raises ``ValueError`` unless ``value`` is a ``[b, *dst.shape[1:]]`` tensor of ``dst``'s dtype."""
    expected = (b, *dst.shape[1:])
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected or value.dtype != dst.dtype:
        given = (
            f"shape {tuple(value.shape)} and dtype {value.dtype}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(f"send: {key!r} must be a tensor of shape {expected} and dtype {dst.dtype}; given {given}.")


def _keys_of(actions):
    if isinstance(actions, TensorDictBase):
        return list(actions.keys(True, True))
    return list(actions) if isinstance(actions, Mapping) else type(actions).__name__


def _mapping_get(mapping, key):
    if not isinstance(mapping, Mapping):
        raise ValueError(f"send: actions must be a TensorDict or a mapping of tensors, got {type(mapping).__name__}.")
    key = key if isinstance(key, tuple) else (key,)
    if key in mapping:  # a flat mapping of nested keys, as ``dict(td.items(True, True))`` gives
        return mapping[key]
    value = mapping
    for k in key:
        if not isinstance(value, Mapping) or k not in value:
            return None
        value = value[k]
    return value
