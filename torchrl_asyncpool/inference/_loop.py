"""The serving loop: wait for a flush -> recv -> split by batch key -> stage -> policy -> send.

The same loop runs in a thread of the caller (``mode="thread"``) and in a server process
(``mode="process"``). It owns one :class:`~torchrl_asyncpool.exchange.consumer.SlotConsumer`
and nothing per env: recurrent state travels in the slots.

Flush rule. A batch is taken when at least ``min_get`` records are ready and either the
flush size is reached (``max_get``, or in self-sizing mode a fraction of the slots in
flight) or the oldest ready record has waited ``timeout`` seconds. The deadline runs from
when a record became ready (its slot's ``ready_time``), not from when the server started
waiting, so a record that arrived while the policy was busy is not made to wait twice.
Everything ready (up to the cap) is then leased in one ``recv`` and split by key.

With ``timeout="auto"`` waiting (:mod:`~torchrl_asyncpool.inference.flush_deadline`), the
deadline alone ends the wait: once a record is ready the loop sleeps until the deadline
without listening to the workers' doorbell, so a flush size reached meanwhile is served at
the deadline. On a VM each ring that wakes a blocked thread costs the ringing worker a
cross-core wake-up and the loop a pass; with the records of a batch each ringing, the serving
thread's CPU per Atari frame fell from ~43 to ~26 us at 64 envs (``benchmarks/README.md``).
Stops and worker deaths still end the sleep at once; an explicit ``timeout`` keeps the rule
above exactly.
"""
from __future__ import annotations

import time
from typing import List

import numpy as np
import torch

from torchrl_asyncpool.exchange.arena import as_key
from torchrl_asyncpool.exchange.doorbell import BellWait, Doorbell
from torchrl_asyncpool.exchange.metrics import record_wait
from torchrl_asyncpool.exchange.wait_loop import NOT_DUE, STOPPED, WaitLoop
from torchrl_asyncpool.inference._common import ServerSpec, auto_threshold
from torchrl_asyncpool.inference.flush_deadline import FlushDeadline
from torchrl_asyncpool.inference._runner import VALID_MASK, KeyRunner, PolicyFailure, format_exc

__all__ = ["ServingLoop"]

#: a busy loop (a batch due at every pass) looks at its stop descriptors at most this often;
#: a waiting one sees them in its poll at once
_STOP_CHECK_S = 0.001


class _Flight:
    # env_idx: the slots, an int64 numpy array; queue: summed ready->lease wait of its rows when
    # the flight is a whole lease (else None); lease_t: when its rows were leased
    __slots__ = ("runner", "pending", "env_idx", "whole", "queue", "lease_t")

    def __init__(self, runner, pending, env_idx, whole, queue=None, lease_t=None):
        self.runner, self.pending, self.env_idx, self.whole = runner, pending, env_idx, whole
        self.queue, self.lease_t = queue, lease_t


class ServingLoop:
    """See the module docstring.

    Args:
        consumer (SlotConsumer): the pool's consumer (this loop is its only user).
        runners (list of KeyRunner): one per batch key, indexed like ``spec.plans``.
        spec (ServerSpec): validated configuration.
        stats (StatsBlock): where the loop adds its sums.
        weights: ``LocalWeights`` or ``SharedWeights`` (polled before each batch).
        stop_fds (list of int): descriptors whose readability (or hang-up) means stop.
        on_batch (callable, optional): ``on_batch(name, request, response)`` after each send.
        hold_fd (int, optional): a descriptor whose readability releases the loop: until then
            :meth:`serve` leases nothing (records wait in their slots) but still stops when
            asked. Weights published meanwhile are applied before the first batch.
    """

    def __init__(self, consumer, runners: List[KeyRunner], spec: ServerSpec, stats, weights, stop_fds, on_batch=None,
                 hold_fd=None):
        self.consumer = consumer
        self.runners = runners
        self.by_name = {r.plan.name: (k, r) for k, r in enumerate(runners)}
        self.spec = spec
        self.stats = stats
        self.weights = weights
        self.on_batch = on_batch
        arena = consumer.arena
        self.ready_time = arena.ready_time
        self.num_envs = n = consumer.num_envs
        self.slot_key = np.asarray(spec.slot_key, dtype=np.int64)
        self.single_key = len(runners) == 1
        self.min_get = spec.min_get
        self.max_get = None if spec.max_get is None else min(spec.max_get, n)
        self.cap = self.max_get if self.max_get is not None else n
        self.timeout = float(spec.timeout)
        # timeout="auto": the deadline is tried against greedy on the env steps the workers
        # count (arena sums), see flush_deadline.py
        self.auto_timeout = bool(getattr(spec, "auto_timeout", False))
        self._step_time, self._step_count = arena.step_time, arena.step_count
        # envs a worker steps in turn: one doorbell per worker (k slots each), or per slot (env threads)
        envs_in_turn = n / max(1, len(set(consumer.handle.slot_bell)))
        #: the deadline's chooser (None: a fixed timeout)
        self.deadline = (FlushDeadline(envs_in_turn, time.monotonic(), self._step_sums(), self._policy_sums())
                         if self.auto_timeout else None)
        self.overlap = bool(spec.overlap)
        self.version_key = spec.policy_version_key if spec.stamp_version else None
        # per key: (buffer, the version it holds)
        self._version_bufs = [(torch.zeros(max(len(r.plan.slots), 1), dtype=torch.int64), None) for r in runners]
        self._bell = Doorbell(consumer.handle.consumer_bell.fd)  # not closed here: the handle owns it
        self._stop_fds = set(stop_fds)
        self._sentinels = {s.fd for s in consumer.handle.worker_sentinels}
        # one GIL hand-over per wait, the bell's drain included; the stop check keeps the GIL
        idle = bool(getattr(consumer.handle, "idle_poll", False))  # the pool's choice for its exchange
        self._wait = WaitLoop(self._bell, [*self._stop_fds, *self._sentinels], stop_fds=self._stop_fds,
                              max_wait=consumer.wait_bound(None), idle_poll=idle)
        self._stop_waiter = BellWait(None, self._stop_fds)
        self._hold_fd = hold_fd
        self._waited = 0.0
        self._last_stop_check = 0.0
        self._send_orders = {}
        self._pool_stats = memoryview(arena.consumer_stats)
        # one key served unpadded on CPU without double buffering: the leased batch itself is the
        # policy's input, and it gets its all-True "valid_mask" from the consumer's cached rows.
        # Otherwise the runners gather from the slots, and the consumer copies no record at lease
        # (built with spec.lease_keys(...)): one gather per record
        whole_ok = spec.feeds_leased_batch and runners[0].takes_whole
        self._extras = {VALID_MASK: torch.ones(n, dtype=torch.bool)} if whole_ok else None
        self.current_key = None
        for k, runner in enumerate(runners):
            stats.set_version(k, runner.version)

    # -- flush rule -------------------------------------------------------------------------
    def _due(self, now) -> float:
        """Seconds until a batch is due (``<= 0``: now; ``NOT_DUE`` while fewer than ``min_get``
        records are ready), from one counting pass over the state words."""
        deadline = self.deadline
        if deadline is not None and deadline.due(now):  # timeout="auto": a trial window ended
            deadline.look(now, self._step_sums(), self._policy_sums())
            self.timeout = deadline.timeout
        n, answered, errors, oldest = self.consumer.scan_states()
        if errors:
            self.consumer.raise_worker_errors()
        wait = self._wait
        if n < self.min_get:
            wait.deaf_until = 0.0
            return NOT_DUE
        if self.max_get is not None:
            threshold = self.max_get
        else:
            threshold = auto_threshold(n + answered, self.min_get, self.spec.flush_fraction)
        if n >= threshold or self.timeout <= 0.0:
            return 0.0
        # only this loop takes slots out of OBS_READY, so the ready set seen now holds at
        # least the n counted above (workers may have added some: their deadline is later)
        left = oldest + self.timeout - now
        # timeout="auto": the chosen deadline alone ends the wait, no wake-up per record (module docstring)
        wait.deaf_until = now + left if self.auto_timeout else 0.0
        return left

    def _step_sums(self) -> tuple:
        return float(self._step_time.sum()), int(self._step_count.sum())

    def _policy_sums(self) -> tuple:
        """``(policy seconds, records served, policy calls)`` so far: the policy's cost per record
        and per call."""
        return self.stats.policy_sums()

    @property
    def measured_step_s(self):
        """The mean env step behind the current deadline (``None``: not measured, or fixed)."""
        return None if self.deadline is None else self.deadline.measured_step_s

    def wait_flush(self) -> bool:
        """Blocks until a batch is due (``True``) or a stop was requested (``False``)."""
        t0 = time.monotonic()
        if t0 - self._last_stop_check > _STOP_CHECK_S:  # a busy server still stops
            self._last_stop_check = t0
            if self._stop_requested():
                return False
        consumer = self.consumer
        # the pool's watchdog, when it has one, runs before each wait (a clock check otherwise)
        if self._wait.run(self._due, None, consumer.watch, consumer.raise_worker_errors) == STOPPED:
            return False
        self._waited = self._wait.now - t0
        # the pool's consumer_busy_fraction counts waits inside recv only; this loop waits
        # before calling recv(timeout=0), so it adds its wait to the same (consumer-only) sum
        record_wait(self._pool_stats, self._waited)
        return True

    def _stop_requested(self) -> bool:
        return bool(self._stop_waiter.wait(0.0))

    # -- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        """Serves until a stop is requested; raises on a policy or pool failure."""
        if self._hold_fd is not None:  # held: wait for the release (or a stop) before any lease
            fired = BellWait(None, [self._hold_fd, *self._stop_fds]).wait(None)
            if self._hold_fd not in fired or any(fd in self._stop_fds for fd in fired):
                return
            self._hold_fd = None
        inflight: List[_Flight] = []
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # per thread: saves a no_grad context per batch (see KeyRunner._run_cpu)
        try:
            while True:
                if not inflight:
                    if not self.wait_flush():
                        return
                    self._recv_and_launch(inflight)
                    continue
                # A batch is on the device: form the next one now if it is due, then answer.
                previous = list(inflight)
                if not self._stop_requested():
                    self._bell.drain()
                    if self._due(time.monotonic()) <= 0.0:
                        self._waited = 0.0
                        self._recv_and_launch(inflight)
                for flight in previous:
                    if flight in inflight:
                        inflight.remove(flight)
                        self._finish(flight)
                if self._stop_requested() and inflight:
                    for flight in list(inflight):
                        inflight.remove(flight)
                        self._finish(flight)
        finally:
            self.current_key = None
            torch.set_grad_enabled(grad)

    def _apply_weights(self):
        for name, flat, version in self.weights.poll():
            k, runner = self.by_name[name]
            self.current_key = runner.key
            runner.apply_weights(flat, version)
            self.stats.set_version(k, version)
            self.stats.record_update()
            mark = getattr(self.weights, "mark_applied", None)
            if mark is not None:
                mark(name, version)

    def _recv_and_launch(self, inflight: List[_Flight]) -> None:
        self._apply_weights()
        td = self.consumer.lease_ready(self.cap, self._extras)
        if td is None:  # _due just counted them ready and only this loop leases: defensive
            return
        idx = td.env_indices.numpy().copy()  # the staging buffer is reused by the next recv
        queue, lease_t = self.consumer.last_dwell, self.consumer.last_lease_time
        self.stats.record_recv(self._waited, queue)
        self.stats.record_queue_times(lease_t - self.ready_time[idx])
        if self.single_key:
            groups = [(0, idx)]
        else:
            keys = self.slot_key[idx]
            groups = [(int(k), idx[keys == k]) for k in np.unique(keys)]
        for k, env_idx in groups:
            runner = self.runners[k]
            total, step = env_idx.size, runner.plan.max_rows
            for start in range(0, total, step):
                chunk = env_idx[start:start + step] if total > step else env_idx
                # the received batch itself feeds the policy (no copy) when it holds exactly these
                # records and the next recv cannot overwrite it before it is answered (see _extras)
                whole = td if (self._extras is not None and total <= step) else None
                # at most two batches of one key in flight (double buffering)
                mine = [f for f in inflight if f.runner is runner]
                while len(mine) >= 2:
                    oldest = mine.pop(0)
                    inflight.remove(oldest)
                    self._finish(oldest)
                self.current_key = runner.key
                try:
                    pending = runner.launch(torch.from_numpy(chunk), whole)
                except Exception as exc:  # noqa: BLE001 - reported with the key
                    raise PolicyFailure(runner.key, _failure_text(runner, exc, chunk), format_exc()) from exc
                one = chunk is idx
                flight = _Flight(runner, pending, chunk, whole, queue if one else None, lease_t)
                if self.overlap:
                    inflight.append(flight)
                else:
                    self._finish(flight)

    def _version_rows(self, k: int, b: int, version: int) -> torch.Tensor:
        """``b`` rows of ``version`` for key ``k`` (refilled only when the version changes)."""
        buf, filled = self._version_bufs[k]
        if buf.numel() < b:
            buf, filled = torch.zeros(b, dtype=torch.int64), None
        if filled != version:
            buf.fill_(version)
        self._version_bufs[k] = (buf, version)
        return buf[:b]

    def _in_send_order(self, outputs: dict, version: int):
        """The response values in the consumer's order (the stamped version as an ``int``, which
        fills every row), or ``None`` if the policy missed a key."""
        keys = tuple(outputs)
        order = self._send_orders.get(keys)
        if order is None:
            position = {as_key(k): i for i, k in enumerate(keys)}
            stamp = as_key(self.version_key) if self.version_key is not None else None
            order = []
            for key in map(as_key, self.consumer.response_keys):
                if key == stamp:
                    order.append(-1)  # the server's stamp wins over anything the policy wrote
                elif key in position:
                    order.append(position[key])
                else:
                    return None
            self._send_orders[keys] = order
        values = list(outputs.values())
        return [version if i < 0 else values[i] for i in order]

    def _finish(self, flight: _Flight) -> None:
        runner, pending = flight.runner, flight.pending
        self.current_key = runner.key
        try:
            outputs = runner.finish(pending)
        except Exception as exc:  # noqa: BLE001
            raise PolicyFailure(runner.key, _failure_text(runner, exc, flight.env_idx), format_exc()) from exc
        policy_s = time.perf_counter() - pending.t_launch
        b = pending.b
        k = self.by_name[runner.plan.name][0]
        env_idx = flight.env_idx
        now = time.monotonic()
        if flight.queue is not None:
            service = flight.queue + b * (now - flight.lease_t)
        else:
            service = float(now * b - self.ready_time[env_idx].sum())  # read before send frees the slot
        try:
            values = self._in_send_order(outputs, pending.version)
            if values is None:  # a key is missing: send() names it
                self._stamp(outputs, k, b, pending.version)
                self.consumer.send(_nest(outputs), torch.from_numpy(env_idx))
            else:
                self.consumer.send_rows(values, env_idx, flight.lease_t)
        except ValueError as exc:
            raise PolicyFailure(runner.key, _failure_text(runner, exc, env_idx), format_exc()) from exc
        self.stats.record_batch(k, b, pending.bucket, policy_s, service)
        if self.on_batch is not None:
            from tensordict import TensorDict

            self._stamp(outputs, k, b, pending.version)
            request = runner.request_view(pending, flight.whole)
            response = TensorDict(_nest(outputs), batch_size=[b])
            self.on_batch(runner.plan.name, request, response)

    def _stamp(self, outputs: dict, k: int, b: int, version: int) -> None:
        if self.version_key is not None:
            outputs[self.version_key] = self._version_rows(k, b, version)


def _failure_text(runner, exc, env_idx=None) -> str:
    where = ""
    rows = getattr(exc, "rows", None)  # an InvalidActionError names the batch rows it refused
    if rows is not None and env_idx is not None:
        rows = [r for r in rows.tolist() if r < len(env_idx)]  # padding rows repeat real ones
        where = f" [envs {sorted(set(env_idx[rows].tolist()))}]"
    return (
        f"policy {runner.plan.name!r} failed while serving{where}: "
        f"{type(exc).__name__}: {exc}"
    )


def _nest(outputs: dict) -> dict:
    out = {}
    for key, value in outputs.items():
        if isinstance(key, tuple) and len(key) > 1:
            d = out
            for part in key[:-1]:
                d = d.setdefault(part, {})
            d[key[-1]] = value
        else:
            out[key[0] if isinstance(key, tuple) else key] = value
    return out
