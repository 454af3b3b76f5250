"""The env worker process: hosts one or more env slots, serves them until the pool closes, and
reports its failures. Its entry points are :func:`worker_main` (a worker process) and
:func:`run_worker` (its life, also run as a thread by
:class:`~torchrl_asyncpool.workers.thread_worker.ThreadWorker`).

The pass loop (:meth:`_Worker.run`, per wake-up of the worker's doorbell)::

    drain doorbell -> the hosted slots in ACTION_READY, in slot order: each served by the
        per-slot episode state machine (:class:`~torchrl_asyncpool.workers.stepper._Stepper`)
    -> publish what the pass staged: ready times, then state words, one store each; one ring
    -> reset the envs that just ended (eagerly, while the consumer computes the discarded action)
    -> block in poll(doorbell, parent life pipe)

A pass publishes its records together so that the consumer leases them as one batch (see
``stepper._HOLD_S`` for the bounds); slots hosted by the same worker are otherwise stepped as
their actions arrive, not in lockstep. Nothing here allocates shared memory or pickles a tensor.

A worker whose factory returned a vector env (``k`` slots, one adapter) runs the lockstep loop
of :mod:`~torchrl_asyncpool.workers.lockstep` instead; a threaded worker (``threaded=True``, for
envs that block) runs one thread per hosted slot (:mod:`~torchrl_asyncpool.workers.env_threads`).
The :class:`_Worker` holds what they share.
"""
from __future__ import annotations

import os
import signal
import time
import traceback

import torch

from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.arena import Arena
from torchrl_asyncpool.exchange.doorbell import BellWait, Doorbell, set_process_idle_poll
from torchrl_asyncpool.envs.adapters import make_adapter
from torchrl_asyncpool.workers.chunk_writer import _Delivery
from torchrl_asyncpool.workers.env_threads import run_threaded
from torchrl_asyncpool.workers.hosted_envs import close_reporting, expected_fields
from torchrl_asyncpool.workers.lockstep import run_lockstep
from torchrl_asyncpool.workers.restarts import DeferredEnvError
from torchrl_asyncpool.workers.stepper import _Stepper

__all__ = ["worker_main", "run_worker"]


class _Worker:
    """What a worker's slots share: the arena, the doorbells, the chunk buffers, the hosted slots
    and the restart budget. The per-slot work (stepping, resetting, rebuilding, writing records)
    is a :class:`~torchrl_asyncpool.workers.stepper._Stepper`'s: the pass loop has one for all
    the slots, each env thread of a threaded worker its own."""

    def __init__(self, worker_id, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn, delivery, threaded=False,
                 exchange="python", affinity=None, restart=None, watch=None):
        self.worker_id = worker_id
        self.threaded = threaded
        self.affinity = affinity
        self.layout = layout
        self.exchange = exchange
        self.started = False
        self.conn = conn
        self.arena = a = Arena.attach(layout, arena_fd)
        self.bells = [Doorbell(fd) for fd in bell_fds]  # one, or one per slot when threaded
        self.consumer_fd = consumer_fd
        self.consumer = Doorbell(consumer_fd)
        self.life_fd = life_fd
        self.state = a.state
        self.delivery = _Delivery(delivery, a, exchange) if delivery is not None else None
        # on_env_failure="restart": the budget of env rebuilds (None: a failing env fails the worker)
        self.restarts = None if restart is None else restart.budget(a, layout.num_slots)
        # watched by the pool (worker restarts, step_timeout): see workers/watch.py
        self.watch = watch
        self.resuming = watch is not None and watch.resume
        if self.resuming:  # a failure is reported through the slots at once: the pool does not wait for a start
            self.started = True
        self.expected = expected_fields(layout)  # the fields every env must declare
        self.stepper = _Stepper(self)  # the pass loop's (and the start-up's)
        self.slots = []  # hosted slots (empty when threaded: each thread holds its own)
        self.specs = []  # (index, factory, kwargs) of each slot a threaded worker's threads build
        self.threads = []  # a threaded worker's env threads
        self.stop_w = -1  # a threaded worker's stop pipe (its threads see it hang up)
        self.thread_fds = []  # a threaded worker's other pipe ends, closed once its threads are done
        self.vector = None  # the adapter of a vector env hosting all the slots (stepped in lockstep)
        self.vector_factory = None  # (factory, kwargs) that built it, to rebuild it after a failure
        self.slot_paths = {}  # slot index -> the path its env is stepped on (threaded workers)

    # where the worker is, for its failure report: the pass loop's stepper's (threads report their own)
    @property
    def _phase(self):
        return self.stepper.phase

    @property
    def _current(self):
        return self.stepper.current

    def build(self, slot_ids, env_fns, env_kwargs):
        stepper = self.stepper
        if self.delivery is not None and self.watch is not None:
            self.delivery.persist = True  # a replacement worker goes on filling the chunks where this one stops
        if len(env_fns) == 1 and not self.threaded:
            if self.resuming:  # the replacement of a worker that died: its env's next rebuild
                adapter = stepper.rebuilt_adapter(slot_ids[0], (env_fns[0], env_kwargs[0]),
                                                  num_envs=len(slot_ids) if len(slot_ids) > 1 else None)
            else:
                stepper.note("construction", slot_ids[0])
                adapter = make_adapter(env_fns[0](**env_kwargs[0]), slot_ids[0])
            if hasattr(adapter, "num_envs") or len(slot_ids) > 1:  # a vector env: all the slots, one adapter
                self._build_vector(slot_ids, adapter)
                self.vector_factory = (env_fns[0], env_kwargs[0])
                # sub-envs that make the same records stepped on their own, in slots of the pass
                # loop: no pass waits for the slowest answer (not with restarts: a sub-env's
                # failure must rebuild the whole vector env, which the lockstep loop does)
                subs = adapter.split() if hasattr(adapter, "split") and self.restarts is None else None
                if subs is not None:
                    self.slots = [stepper.add_slot(index, sub) for index, sub in zip(slot_ids, subs)]
                    self.vector = None
                return
            slot = stepper.add_slot(slot_ids[0], adapter)
            slot.factory = (env_fns[0], env_kwargs[0])
            self.slots.append(slot)
            return
        specs = list(zip(slot_ids, env_fns, env_kwargs))
        if self.threaded:
            # each env is built, stepped and closed by its own thread: envs holding thread-bound
            # resources (an OpenGL context, a simulator handle) never see another thread
            self.specs = specs
            return
        for spec in specs:
            self.slots.append(stepper.build_slot(*spec))

    def first_records(self, stepper, slots):
        """A new worker resets its envs and publishes their FIRST records; a replacement takes
        over its slots as its dead worker left them (see ``_Stepper.resume_slot``) and publishes
        nothing until they are answered."""
        if self.resuming:
            for slot in slots:
                stepper.resume_slot(slot)
            return
        for slot in slots:
            stepper.record_first(slot, stepper.timed_reset(slot))
        stepper.writer.publish()

    def _build_vector(self, slot_ids, adapter):
        if not hasattr(adapter, "num_envs"):
            adapter.close()
            raise ValueError(
                f"env {slot_ids[0]}: the factory returned a single env, but the first factory returned a gymnasium "
                f"vector env of {len(slot_ids)} envs (all factories must return the same kind)."
            )
        if adapter.num_envs != len(slot_ids):
            adapter.close()
            raise ValueError(
                f"env {slot_ids[0]}: the factory returned a vector env of {adapter.num_envs} envs; the pool "
                f"expects {len(slot_ids)} (slots {slot_ids[0]}..{slot_ids[-1]}), as the first factory returned "
                "(every factory must return the same number of envs)."
            )
        for index in slot_ids:
            self.slots.append(self.stepper.add_slot(index, adapter))
        self.vector = adapter

    def close_envs(self, timeout: float = 30.0):
        """Closes the hosted envs; a threaded worker's threads close their own (waited for at
        most ``timeout`` seconds in all: a thread may be inside a long step). The pool's
        ``close(timeout)`` kills the worker sooner when it asks for less; this bound only
        keeps a worker whose parent is gone from waiting forever on a hung thread, and leaves
        an env's own close (a simulator stopping its processes) the time it needs."""
        if not self.threaded:
            for slot in {id(slot.adapter): slot for slot in self.slots}.values():
                close_reporting(slot.adapter, slot.index)
            return
        if self.stop_w >= 0:
            os.close(self.stop_w)  # every slot thread's poll sees the hang-up
            self.stop_w = -1
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        # a worker thread of this process (backend="threading") would leave them open for good;
        # a thread still alive may yet write to them, so they stay then (the number not reused)
        if not any(t.is_alive() for t in self.threads):
            for fd in self.thread_fds:
                os.close(fd)
            self.thread_fds = []

    def _paths(self) -> dict:
        """``{slot index: the path its env is stepped on}`` (``adapter.path``: ``"torchrl-fast"``,
        ``"torchrl"``, ``"gymnasium"``, ...), reported to the pool with the worker's first records."""
        return {slot.index: getattr(slot.adapter, "path", "unknown") for slot in self.slots}

    def pin(self):
        """Applies the worker's CPU mask to the calling thread (pid 0: this thread only).

        Called once the envs are built, not at process start: building envs (imports,
        simulators loading assets) then runs on every core, which matters when the default
        partition puts every worker on one core of two."""
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)

    # -- main loop ----------------------------------------------------------------------------
    def announce_ready(self):
        """Tells the parent the first records are out; returns the :class:`BellWait` to wait on."""
        self.conn.send(("ready", self.worker_id, self._paths(), None))
        self.started = True
        if self.resuming:  # the answers its dead worker left unserved rang a bell nobody drains now
            self.bells[0].ring()
        # drains the bell in the wait, before the scan: a ring after that wakes the next wait
        return BellWait(self.bells[0], (self.life_fd,))

    def run(self):
        """Serves the hosted slots until the life pipe hangs up: the pass loop, or the lockstep
        loop of a vector env, or a threaded worker's env threads."""
        if self.threaded:
            return run_threaded(self)
        if self.vector is not None:
            return run_lockstep(self)
        stepper, writer = self.stepper, self.stepper.writer
        self.first_records(stepper, self.slots)
        waiter = self.announce_ready()
        state, slots, delivery = self.state, self.slots, self.delivery
        while True:
            for fd in waiter.wait():
                if fd == self.life_fd:
                    return
            ready = [slot for slot in slots if state[slot.index] == S.ACTION_READY]
            if not ready:
                continue
            stepping = []
            cut = []
            for slot in ready:
                if slot.ended:
                    stepper.serve(slot)  # a FIRST record: no step, nothing to deliver
                elif slot.cut:  # a dead worker's open episode: its truncation, no step
                    if stepper.serve(slot):
                        cut.append(slot)
                elif delivery is None or delivery.claim(slot):
                    stepping.append(slot)
                # else back-pressure: the driver holds every chunk of this env; the action waits
            if len(stepping) > 1:
                ended = stepper.step_pass(stepping)
            else:  # one env to step (a slow env's usual pass): the per-slot path costs less
                ended = [slot for slot in stepping if stepper.serve(slot)]
            writer.publish()  # what is left of the pass: its last group, the FIRST records
            for slot in ended + cut:
                stepper.eager_reset(slot)



def _end_own_group():
    """SIGTERMs what the envs started and left in this worker's process group (it leads one, see
    ``worker_main``): a parent that died without closing the pool, by a signal's default action
    or a hang-up, never kills the group itself. The worker ignores the signal; its own group only
    (never the parent's, if it could not lead one)."""
    try:
        if os.getpgrp() != os.getpid():
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
    except (OSError, ValueError):  # nothing left to signal, or not the main thread
        pass


def _batch_scheduling():
    """SCHED_BATCH: a worker woken by the consumer's doorbell does not preempt the consumer.

    Without it, on few cores every ``send`` costs the consumer a context switch per worker it
    wakes (the woken worker has slept, so the scheduler runs it at once), which is exactly the
    "waker waits for the woken" cost the doorbell exists to avoid.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not permitted: plain scheduling
        pass


def worker_main(worker_id, slot_ids, env_fns, env_kwargs, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn,
                num_threads, delivery=None, threaded=False, affinity=None, exchange="python", idle_poll=False,
                restart=None, watch=None):
    """Entry point of a worker process (see the module docstring)."""
    # The parent owns shutdown (the life pipe; a dead parent closes it too): a terminal's Ctrl-C
    # reaches the whole process group, and it is the parent's to handle (evaluate() drains on it,
    # the collector shuts down). As the inference server process does, a worker ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A process group of its own, which the processes its envs start (a simulator, a browser)
    # join: the pool kills the whole group when it kills or reaps this worker, so they are not
    # orphaned, and a terminal's Ctrl-C no longer reaches them behind the parent's back.
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover - already a group leader (or not allowed): the pool kills the pid
        pass
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    set_process_idle_poll(idle_poll)  # every wait of this worker follows its pool's choice
    _batch_scheduling()
    try:
        run_worker(worker_id, slot_ids, env_fns, env_kwargs, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn,
                   delivery, threaded, affinity, exchange, restart, watch)
    finally:
        _end_own_group()
        os._exit(0)


def run_worker(worker_id, slot_ids, env_fns, env_kwargs, layout, arena_fd, bell_fds, consumer_fd, life_fd, conn,
               delivery=None, threaded=False, affinity=None, exchange="python", restart=None, watch=None):
    """One worker's life, in whatever runs it: builds its envs, serves their slots until the life
    pipe hangs up, reports a failure to the consumer (through the pipe ``conn`` before the first
    records, through the slot's error block after), and closes the envs. Never raises.

    A worker process runs it from :func:`worker_main`; a pool with ``backend="threading"`` runs it
    in a thread of the pool's own process (:class:`~torchrl_asyncpool.workers.thread_worker.ThreadWorker`).
    """
    worker = None
    try:
        env_fns = [getattr(fn, "fn", fn) for fn in env_fns]
        worker = _Worker(worker_id, layout, arena_fd.fd, [b.fd for b in bell_fds], consumer_fd.fd, life_fd.fd, conn,
                         delivery, threaded, exchange, affinity, restart, watch)
        worker.build(slot_ids, env_fns, env_kwargs)
        if not threaded:  # a threaded worker's env threads pin themselves once built
            worker.pin()
        worker.run()
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the consumer, then we exit
        tb = exc.tb if isinstance(exc, DeferredEnvError) else traceback.format_exc()
        phase = worker._phase if worker is not None else "start-up"
        index = worker._current if worker is not None and worker._current is not None else slot_ids[0]
        index = getattr(exc, "env_slot", index)  # a record's error names its own env (RewardError)
        try:
            if worker is not None and worker.started:
                worker.arena.write_error(index, f"{phase}\n{tb}")
                worker.state[index] = S.ERROR  # after the text
            else:
                conn.send(("error", worker_id, index, (phase, tb)))
            Doorbell(consumer_fd.fd).ring()
        except BaseException:  # noqa: BLE001 - the parent may be gone already
            pass
    finally:
        try:
            if worker is not None:
                worker.close_envs()
        except BaseException:  # noqa: BLE001 - an env failing to close must not keep the worker alive
            pass
