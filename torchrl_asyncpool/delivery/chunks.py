"""Dense per-env transition chunks in shared memory.

Each env owns ``chunks_per_env`` chunks of ``T`` consecutive transitions (TorchRL layout:
root observation, done flags and policy entries, ``("next", obs..., "reward", "done",
"terminated", "truncated")``, ``"env_index"``). The root done flags are those of the record
the action answered, which never ended an episode (the action answering a terminal record is
discarded and the next record starts the next one), so they are ``False``, as in TorchRL's
collectors: workers never write them and the (zeroed) chunk memory holds them.

The chunk buffers are an :class:`~torchrl_asyncpool.exchange.Arena` whose "slots" are chunks,
so the same memfd/mmap code and the same one-writer-per-word rule apply. Chunk state words:

``FREE -> FILLING`` (worker takes it) ``-> FULL`` (worker, after the data; rings the driver)
``-> HELD`` (driver, while copying it into a batch) ``-> FREE`` (driver; rings the worker).

A chunk is never refilled before the driver released it: a worker whose env has no free
chunk leaves that env's action pending (back-pressure) instead of dropping data.
"""
from __future__ import annotations

import math

import time
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

from torchrl_asyncpool.exchange.arena import Arena, ArenaLayout, as_key, key_repr
from torchrl_asyncpool.exchange.doorbell import Doorbell
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool.exchange.gather import RowGather
from torchrl_asyncpool.exchange.wait_loop import NOT_DUE, TIMED_OUT, WaitLoop

__all__ = [
    "ChunkBuffers", "ChunkHandle", "ChunkReader", "transition_fields", "delivered_keys", "FREE", "FILLING", "FULL",
    "HELD", "transition_bytes", "available_memory", "check_fits",
]

#: chunk state words (see the module docstring for who moves a chunk from one to the next)
FREE, FILLING, FULL, HELD = 0, 1, 2, 3
_STEP_KEYS = ("reward", "done", "terminated", "truncated")
_DONE_KEYS = ("done", "terminated", "truncated")


def transition_bytes(layout: ArenaLayout) -> int:
    """Bytes of one transition in TorchRL's layout (what a chunk row and a batch row hold)."""
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in transition_fields(layout).values())


def available_memory() -> int | None:
    """Bytes this machine can still give (``MemAvailable`` of ``/proc/meminfo``), ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(nbytes: int, what: str, available: int | None = None) -> None:
    """Refuses (``ValueError``, before anything is allocated) ``nbytes`` of buffers that this
    machine's available memory cannot hold; ``what`` names the options that asked for them.

    Examples:
        >>> from torchrl_asyncpool.delivery.chunks import check_fits
        >>> check_fits(2**20, "a test")
        >>> check_fits(2**40, "a big batch", available=2**30)
        Traceback (most recent call last):
        ...
        ValueError: a big batch needs 1024.0 GiB of memory, and this machine has 1.0 GiB available; ask for less.
    """
    available = available_memory() if available is None else available
    if available is not None and nbytes > available:
        raise ValueError(f"{what} needs {nbytes / 2**30:.1f} GiB of memory, and this machine has "
                         f"{available / 2**30:.1f} GiB available; ask for less.")


def transition_fields(layout: ArenaLayout) -> dict:
    """Per-transition fields ``{key: (shape, dtype)}`` derived from a pool's slot layout."""
    fields = {}
    for f in layout.request:
        name = f.key[0]
        if name in _STEP_KEYS:
            if name in _DONE_KEYS:  # the answered record's flags: never written, always False
                fields[f.key] = (f.shape, f.dtype)
            fields[("next",) + f.key] = (f.shape, f.dtype)
        elif name != "step_type":
            fields[f.key] = (f.shape, f.dtype)
            fields[("next",) + f.key] = (f.shape, f.dtype)
    for f in layout.response:
        fields[f.key] = (f.shape, f.dtype)
    fields[("env_index",)] = ((), torch.int64)
    return fields


def delivered_keys(layout: ArenaLayout) -> dict:
    """``{chunk key: batch key or None}`` where a delivered batch names a chunk field otherwise
    than the chunk does (``None``: left out of the batch); keys not listed keep their names.

    A recurrent state in TorchRL's convention (``{hidden_in: ("next", *key)}`` with ``key`` an
    env observation, see :func:`~torchrl_asyncpool.collector.acting_policy.torchrl_recurrent_state`) is
    delivered where TorchRL's collectors put it: ``key`` holds the state the policy read
    (``hidden_in``, zeros on ``FIRST``) and ``("next", key)`` the one it wrote (the next
    record's ``hidden_in``), in place of the env's own entries.
    """
    observed = {f.key for f in layout.request}
    out = {}
    for hidden_in, hidden_out in layout.recurrent.items():
        if len(hidden_out) > 1 and hidden_out[0] == "next" and hidden_out[1:] in observed:
            root = hidden_out[1:]
            out[root] = out[("next",) + root] = None
            out[hidden_in] = root
            out[("next",) + hidden_in] = ("next",) + root
    return out


@dataclass
class ChunkHandle:
    """What a worker needs to write chunks: layout, memory and the driver's doorbell."""

    layout: ArenaLayout
    fd: InheritedFd
    driver_bell: InheritedFd
    chunk_size: int
    chunks_per_env: int


class ChunkBuffers:
    """Allocates the chunk arena for a pool (driver side) and describes it for the workers.

    Args:
        pool_layout (ArenaLayout): the pool's slot layout.
        chunk_size (int): transitions per chunk (``T``).
        chunks_per_env (int): chunks per env; 2 or more lets a worker fill one while the
            driver copies another.
    """

    def __init__(self, pool_layout: ArenaLayout, chunk_size: int, chunks_per_env: int = 2):
        for name, value in (("transition_chunk_size", chunk_size), ("chunks_per_env", chunks_per_env)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        n = pool_layout.num_slots
        check_fits(n * chunks_per_env * chunk_size * transition_bytes(pool_layout),
                   f"transition_chunk_size={chunk_size} with chunks_per_env={chunks_per_env} ({n} envs x "
                   f"{chunks_per_env} chunks x {chunk_size} transitions of {transition_bytes(pool_layout):,} bytes)")
        self.num_envs = n
        #: ``{chunk key: batch key or None}`` (see :func:`delivered_keys`)
        self.renamed = delivered_keys(pool_layout)
        self.chunk_size = int(chunk_size)
        self.chunks_per_env = int(chunks_per_env)
        fields = {k: ((self.chunk_size, *shape), dtype) for k, (shape, dtype) in transition_fields(pool_layout).items()}
        self.layout = ArenaLayout(self.num_envs * self.chunks_per_env, fields, {}, error_text_bytes=0)
        self.arena = Arena.create(self.layout, name="torchrl_asyncpool_chunks")
        env_index = self.arena.request.get("env_index")
        env_index.copy_(
            torch.arange(self.num_envs).repeat_interleave(self.chunks_per_env)[:, None].expand_as(env_index)
        )
        self.driver_bell = Doorbell()

    def handle(self) -> ChunkHandle:
        """What a worker needs to attach to these buffers (picklable at start-up; descriptors inherited)."""
        return ChunkHandle(self.layout, InheritedFd(self.arena.fd), self.driver_bell.inheritable(),
                           self.chunk_size, self.chunks_per_env)

    def close(self) -> None:
        """Closes the driver's doorbell and the chunk arena's descriptor (the mapping goes with its last view)."""
        self.driver_bell.close()
        self.arena.close()


#: how often :meth:`ChunkReader.take` runs its ``check`` while it waits (seconds)
_CHECK_EVERY_S = 0.1
#: after copying what was due, :meth:`ChunkReader.take` sleeps through the workers' rings for
#: this fraction of the time the rest of its batch (or half the chunk buffers, if less) takes
#: to fill at the rate the chunks were filling, at most _MAX_DEAF_S. Each ring that wakes the
#: driver costs the ringing worker a cross-core wake-up (1.6 % of an Atari worker's time at 64
#: envs with 8-transition chunks, 128 rings a batch) and the driver a pass of its wait, while a
#: few chunks copied per wake-up instead of one change nothing else. Half the buffers at most:
#: the workers do not run out of free chunks while the rate holds
_DEAF_FRACTION = 0.5
_MAX_DEAF_S = 0.05


def _storage_use_count(storage) -> int:
    """How many references a tensor storage has (tensors over it, Python storage objects)."""
    return torch._C._storage_Use_Count(storage._cdata)


class ChunkReader:
    """Driver side: concatenates full chunks into dense batches of exactly ``frames`` transitions.

    Chunks are taken oldest first; per env they complete in order, and only the last chunk of
    a batch may be split (its remainder opens the next batch), so every env's transitions
    stay in order across batches.

    Args:
        buffers (ChunkBuffers): the chunk arena.
        release (callable): ``env_indices -> None`` (an int64 array), wakes the workers
            hosting those envs after chunks of theirs were freed; called once per batch of
            freed chunks, so a worker whose envs freed many chunks is rung once.

    Keyword Args:
        idle_poll (bool, optional): whether the waits for full chunks idle-poll (the pool's
            :attr:`~torchrl_asyncpool.AsyncEnvPool.idle_poll`; see
            :mod:`~torchrl_asyncpool.exchange.doorbell`). A worker that fills a chunk rings the
            driver's doorbell; with a blocking wait that ring is a cross-core wake-up of the
            learner's thread, which cost the ringing worker 30-100 us on the benchmark VM
            against a few for an idle-polled wait. Defaults to ``False``.
    """

    def __init__(self, buffers: ChunkBuffers, release, *, idle_poll: bool = False):
        self.buffers = buffers
        self._release = release
        arena = buffers.arena
        self._state = arena.state
        self._ready_time = arena.ready_time
        # (batch key, the chunk field flattened to rows), for every field a batch holds
        renamed = getattr(buffers, "renamed", {})
        self._flat = []
        for k, v in arena.request.items(include_nested=True, leaves_only=True):
            key = renamed.get(as_key(k), as_key(k))
            if key is not None:
                self._flat.append((key_repr(key), v.reshape(-1, *v.shape[2:])))
        self._carry = None  # (chunk id, offset) of a partly consumed chunk
        self._pending = None  # (batch, filled) of a call that timed out
        self._last, self._last_leaves = None, []  # the last batch allocated, for take(reuse=True)
        # the storages of the last two new batches, reused for the next one once nothing else
        # holds them (see _new_leaves): a for loop holds the batch it is on while the next one is taken
        self._spares: list = []
        self._wait = WaitLoop(buffers.driver_bell, max_wait=_CHECK_EVERY_S, idle_poll=bool(idle_poll))
        self._check, self._checked, self._full = None, 0.0, None  # the running take's check and full chunks
        # the rate the chunks fill at (transitions per second, None: not measured yet): how long
        # take() may sleep through the workers' rings (see _DEAF_FRACTION)
        self.rate: float | None = None
        self._half_buffers = max(1, buffers.num_envs * buffers.chunks_per_env * buffers.chunk_size // 2)

    def full_chunks(self) -> int:
        """How many chunks are full and not yet taken by the driver."""
        return int((self._state == FULL).sum())

    def _reusable(self, frames: int) -> bool:
        """Whether the last batch can be written over: same size, and the caller has not
        swapped any of its tensors for others (an in-place postproc may have added keys)."""
        last = self._last
        if last is None or last.batch_size != torch.Size([frames]):
            return False
        return all(last.get(k, None) is leaf for (k, _), leaf in zip(self._flat, self._last_leaves))

    def take(self, frames: int, timeout: float | None = None, check=None, reuse: bool = False) -> TensorDict | None:
        """Returns the next ``frames`` transitions as one new dense TensorDict.

        Full chunks are copied out and released as they arrive, so ``frames`` may exceed what
        the chunk buffers hold at once. If ``timeout`` passes first, ``None`` is returned and
        the transitions copied so far are kept for the next call (nothing is lost).

        Args:
            frames (int): exact number of transitions.
            timeout (float, optional): seconds to wait at most.
            check (callable, optional): called about every 100 ms while waiting; raise from it
                to abort (a dead worker or server).
            reuse (bool, optional): return the batch the previous call returned, written over,
                when it holds ``frames`` transitions and still holds the tensors this reader put
                in it (TorchRL's ``return_same_td``): no allocation and no page faults on first
                touch per batch (with 84x84x3 pixels, 42 KB per transition). Else a new batch,
                whose memory may be that of an earlier batch nothing references any more (no
                tensor, view, numpy array or autograd graph of it is alive: the caller cannot
                tell the difference, and the kernel does not fault and zero the pages again).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._pending is None or self._pending[0].batch_size[0] != frames:
            if self._pending is not None:
                raise ValueError("take() resumed with a different frame count than the timed-out call.")
            out = self._last if reuse and self._reusable(frames) else None
            if out is None:
                out = TensorDict(self._new_leaves(frames), batch_size=[frames])
                if reuse:
                    self._last, self._last_leaves = out, [out.get(k) for k, _ in self._flat]
            self._pending = (out, 0)
        out, pos = self._pending
        gathers = [RowGather(src, out.get(k)) for k, src in self._flat]
        self._check, self._checked = check, time.monotonic()
        health = None if check is None else self._check_due
        copied_at = None  # when this call last copied: the rate is measured between its copies
        try:
            while pos < frames:
                if self.rate:  # sleep through the rings (see _DEAF_FRACTION); not measured yet: listen
                    gap = _DEAF_FRACTION * min(frames - pos, self._half_buffers) / self.rate
                    self._wait.deaf_until = time.monotonic() + min(gap, _MAX_DEAF_S)
                if self._wait.run(self._chunks_due, deadline, health) == TIMED_OUT:
                    if health is not None:
                        health(self._wait.now)  # as at every wait: a caller that always times out still checks
                    self._pending = (out, pos)
                    return None
                before, pos = pos, self._copy_due(gathers, frames, pos)
                now = self._wait.now
                # the chunks copied now were filled since the last copy (not so for the first
                # copy of a call: the caller's own time between calls is in it)
                if copied_at is not None and now > copied_at:
                    rate = (pos - before) / (now - copied_at)
                    self.rate = rate if self.rate is None else 0.5 * (self.rate + rate)
                copied_at = now
        finally:
            self._check, self._full = None, None  # nothing of the caller's is kept
            self._wait.deaf_until = 0.0
        self._pending = None
        return out

    def _new_leaves(self, frames: int) -> dict:
        """The leaves of a new batch of ``frames`` transitions: on the storages of an earlier
        batch that nothing else holds now, else new ones (then remembered as spares)."""
        shapes = [(k, (frames, *v.shape[1:]), v.dtype) for k, v in self._flat]
        for n, (size, storages) in enumerate(self._spares):
            # 1: the spare's own reference; any tensor, view or autograd graph over it adds one
            if size == frames and all(_storage_use_count(s) == 1 for s in storages):
                self._spares.append(self._spares.pop(n))  # the newest spare now
                return {k: torch.empty(0, dtype=dtype).set_(s, 0, shape)
                        for (k, shape, dtype), s in zip(shapes, storages)}
        leaves = {k: torch.empty(shape, dtype=dtype) for k, shape, dtype in shapes}
        self._spares = self._spares[-1:] + [(frames, [t.untyped_storage() for t in leaves.values()])]
        return leaves

    def _chunks_due(self, now: float) -> float:
        """``take``'s readiness test: due while a chunk is full or partly consumed (keeps the
        full chunks' ids for the copy)."""
        full = self._full = np.flatnonzero(self._state == FULL)
        return 0.0 if (full.size or self._carry is not None) else NOT_DUE

    def _check_due(self, now: float) -> bool:
        """Runs ``take``'s ``check`` every :data:`_CHECK_EVERY_S`, not at every wake-up: a batch
        of small chunks waits dozens of times (its pool's check costs ~15 us each time).
        Returns whether it ran (and so took time)."""
        if now - self._checked < _CHECK_EVERY_S:
            return False
        self._check()
        self._checked = time.monotonic()
        return True

    def _copy_due(self, gathers, frames: int, pos: int) -> int:
        """Copies what is due (the carried chunk's rest, then the full chunks, oldest first)
        into the batch from row ``pos``, up to ``frames``; frees the chunks it emptied and
        returns the new ``pos``."""
        T, full = self.buffers.chunk_size, self._full
        # the rows to copy, oldest chunk first, without a Python step per chunk (a batch of
        # 1,024 envs' one-transition chunks is 1,024 chunks): the partly consumed chunk, the
        # whole chunks that fit, then the first rows of one more (carried to the next call)
        rows, used, need = [], [], frames - pos
        if self._carry is not None:
            c, off = self._carry
            n = min(T - off, need)
            rows.append(np.arange(c * T + off, c * T + off + n))
            need -= n
            self._carry = (c, off + n) if off + n < T else None
            if self._carry is None:
                used.append(np.array([c]))
        if need and full.size:
            order = full[np.argsort(self._ready_time[full], kind="stable")]
            whole = order[: need // T]
            self._state[whole] = HELD
            rows.append((whole[:, None] * T + np.arange(T)).reshape(-1))
            used.append(whole)
            need -= whole.size * T
            if need and order.size > whole.size:
                c = int(order[whole.size])
                self._state[c] = HELD
                rows.append(np.arange(c * T, c * T + need))
                self._carry = (c, need)
        idx = np.concatenate(rows) if len(rows) > 1 else rows[0]
        for gather in gathers:
            gather(idx, pos)
        used = np.concatenate(used) if used else used
        if len(used):
            self._state[used] = FREE
            self._release(used // self.buffers.chunks_per_env)
        return pos + idx.size
