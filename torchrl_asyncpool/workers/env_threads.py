"""A threaded worker (``threaded=True``, for envs that block: sleep, I/O, a simulator that
releases the GIL): one thread per hosted slot, each with its own doorbell and its own
:class:`~torchrl_asyncpool.workers.stepper._Stepper`, so the slots' blocking steps overlap
inside one process (:func:`run_threaded`).

Each env is built, stepped and closed by its own thread: envs holding thread-bound resources
(an OpenGL context, a simulator handle) never see another thread. The worker's main thread
only waits: for the pool to close (the life pipe) or for a thread to fail, which it then
reports as the worker's failure.
"""
from __future__ import annotations

import os
import select
import threading
import traceback

from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.doorbell import BellWait
from torchrl_asyncpool.envs.adapters import remote_listener
from torchrl_asyncpool.workers.hosted_envs import close_reporting
from torchrl_asyncpool.workers.restarts import DeferredEnvError
from torchrl_asyncpool.workers.stepper import _Stepper

# The first env of a process is built alone: TorchRL sets some of its env classes' methods up on
# their first use (implement_for), and two threads doing it at once can leave a GymEnv without them
# ("'GymEnv' object has no attribute '_set_gym_default'"). Later builds run concurrently.
_FIRST_BUILD = threading.Lock()
_built_once = threading.Event()

__all__ = ["run_threaded"]


def run_threaded(worker) -> None:
    """Starts one thread per slot of ``worker.specs``, tells the pool the first records are out
    once every thread has published its own, and waits until the life pipe hangs up; raises
    the first failure a thread reports."""
    failed_r, failed_w = os.pipe()
    stop_r, worker.stop_w = os.pipe()
    worker.thread_fds = [failed_r, failed_w, stop_r]  # closed by close_envs once the threads are done
    failures = []  # (phase, env index, traceback) of the threads that raised
    firsts = []
    for spec, bell in zip(worker.specs, worker.bells):
        first = threading.Event()
        t = threading.Thread(target=_slot_thread, args=(worker, spec, bell, stop_r, first, failures, failed_w),
                             name=f"env-{spec[0]}", daemon=True)
        t.start()
        worker.threads.append(t)
        firsts.append(first)
    for first in firsts:
        first.wait()
    worker.pin()
    _raise_thread_failure(worker, failures)
    worker.conn.send(("ready", worker.worker_id, dict(worker.slot_paths), None))
    worker.started = True
    poller = select.poll()
    poller.register(worker.life_fd, select.POLLIN)
    poller.register(failed_r, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == worker.life_fd:
                return
            _raise_thread_failure(worker, failures)


def _raise_thread_failure(worker, failures):
    if failures:
        phase, current, tb = failures[0]
        worker.stepper.note(phase, current)
        raise DeferredEnvError(tb)


def _slot_thread(worker, spec, bell, stop_fd, first, failures, failed_w):
    """One hosted env, start to end, with its own stepper: build, reset, the pass loop of
    ``_Worker.run`` for its slot, close."""
    slot = None
    stepper = _Stepper(worker)
    writer = stepper.writer
    try:
        if _built_once.is_set():
            slot = stepper.build_slot(*spec)
        else:
            with _FIRST_BUILD:
                slot = stepper.build_slot(*spec)
            _built_once.set()
        worker.slot_paths[slot.index] = getattr(slot.adapter, "path", "unknown")  # a dict all threads share
        worker.pin()
        listen = remote_listener(slot.adapter.env)
        if listen is not None:  # a remote slot: its first record waits for a host to connect
            listen(slot.index, stop_fd)
            first.set()
        worker.first_records(stepper, [slot])
        first.set()
        if worker.resuming:  # the answer its dead worker left unserved rang a bell nobody drains now
            bell.ring()
        waiter = BellWait(bell, (worker.life_fd, stop_fd))  # one GIL hand-over per wait, drain included
        state, i = worker.state, slot.index
        while True:
            for fd in waiter.wait():
                if fd != bell.fd:
                    return
            if state[i] != S.ACTION_READY:
                continue
            ended = stepper.serve(slot)  # (a cut episode's truncation ends it too)
            writer.publish()
            if ended:
                stepper.eager_reset(slot)
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which reports it
        tb = exc.tb if isinstance(exc, DeferredEnvError) else traceback.format_exc()
        failures.append((stepper.phase, stepper.current if stepper.current is not None else spec[0], tb))
        first.set()
        os.write(failed_w, b"x")
    finally:
        if slot is not None:
            close_reporting(slot.adapter, slot.index)
