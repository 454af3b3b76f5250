"""The worker processes of an :class:`~torchrl_asyncpool.AsyncEnvPool` (or its worker threads,
``backend="threading"``): their start-up (started one by one, then awaited until each has built its
envs and published its first record), the errors of a start-up (an env that raised, a worker that
died, a timeout, a cancel), and their end: the life pipe closed, stragglers killed and what their
envs started reaped."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings
import weakref

import numpy as np

from torchrl_asyncpool.errors import EnvError, PoolStartCancelled, WorkerDiedError
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool._sys.exit_begun import describe_exit, exit_begun
from torchrl_asyncpool._sys.forkserver import death_fd, exit_code, forkserver_context, picklable, release_death_fd
from torchrl_asyncpool._sys.descriptors import ship_fds
from torchrl_asyncpool.workers.worker import run_worker, worker_main
from torchrl_asyncpool.workers.thread_worker import ThreadWorker

#: how often a start-up with ``cancel_start`` asks it
_CANCEL_POLL_S = 0.1


class _PoolWorkers:
    """The worker lifecycle of :class:`~torchrl_asyncpool.AsyncEnvPool`, which it inherits. It
    reads what the pool set up before the workers start (``layout``, ``_arena``, ``_consumer``,
    ``_bells``, ``_slot_bell``, ``_slot_worker``, ``_chunks``, ``_restart``, ``_cancel_start``
    and the resolved options), and keeps ``_procs`` (the workers), ``_conns`` (their start-up
    pipes) and the life pipe (``_life_r``, ``_life_box``) whose closing tells them to exit."""

    def _open_life_pipe(self):
        """The pipe whose write end the pool holds: the workers exit when it closes (the pool's
        close, or its process's end)."""
        self._life_r, self._life_w = os.pipe()

    def _arm_shutdown(self):
        """From here on, the workers are stopped when the pool is garbage-collected unclosed."""
        self._life_box = [self._life_w]
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._life_box, 0.0)

    def _life_r_close(self):
        if self._life_r >= 0:
            os.close(self._life_r)
            self._life_r = -1

    def _start_workers(self, method, groups, fns, kwargs, num_threads, affinity=None):
        threads = self.backend == "threading"
        ctx = (mp if threads else forkserver_context("AsyncEnvPool") if method == "forkserver"
               else mp.get_context(method))
        # what a worker's start needs, kept: a pool that replaces dead workers starts them again
        # (the factories in the form that crosses to a child, converted once for every start)
        fns = list(fns) if threads else [picklable(fn) for fn in fns]
        self._worker_start = (ctx, groups, fns, kwargs, num_threads, affinity)
        for w in range(len(groups)):
            self._check_cancel()  # between starts (the fork server's own first start is not cut short)
            p, parent_conn = self._start_worker(w, getattr(self, "_watch", None))
            self._procs.append(p)
            self._conns.append(parent_conn)

    def _start_worker(self, w, watch):
        """Starts worker ``w`` (a process, or a thread with ``backend="threading"``); returns it
        and the parent's end of its start-up pipe."""
        ctx, groups, fns, kwargs, num_threads, affinity = self._worker_start
        slots = groups[w]
        arena_fd, consumer_fd, life_fd = (
            InheritedFd(self._arena.fd), self._consumer.inheritable(), InheritedFd(self._life_r)
        )
        parent_conn, child_conn = ctx.Pipe()
        # the factories it builds: one per slot, or the one vector env of its slots
        made = sorted({i // self.envs_per_factory for i in slots})
        bells = [self._bells[b].inheritable() for b in sorted(set(self._slot_bell[slots].tolist()))]
        delivery = self._chunks.handle() if self._chunks is not None else None
        mask = None if affinity is None else affinity[w]
        if self.backend == "threading":  # the same worker loop, in a thread of this process (nothing to pickle)
            p = ThreadWorker(
                run_worker,
                (w, slots, [fns[i] for i in made], [kwargs[i] for i in made], self.layout, arena_fd, bells,
                 consumer_fd, life_fd, child_conn, delivery, self.env_threads, mask, self.exchange, self._restart),
                name=f"torchrl_asyncpool-worker-{w}",
            )
            p.start()
            return p, parent_conn
        p = ctx.Process(
            target=worker_main,
            args=(
                w, slots, [fns[i] for i in made], [kwargs[i] for i in made], self.layout,
                arena_fd, bells, consumer_fd, life_fd, child_conn, num_threads, delivery, self.env_threads,
                mask, self.exchange, self.idle_poll, self._restart, watch,
            ),
            name=f"torchrl_asyncpool-worker-{w}",
            daemon=True,
        )
        with ship_fds():  # the bells (one per env for threaded workers) go after the start message
            p.start()
        child_conn.close()
        return p, parent_conn

    def _check_cancel(self):
        if self._cancel_start is not None and self._cancel_start():
            raise PoolStartCancelled("the pool's start-up was cancelled (cancel_start returned true).")

    def _await_ready(self, timeout):
        from multiprocessing.connection import wait

        deadline = None if timeout is None else time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                slots = np.flatnonzero(np.isin(self._slot_worker, sorted(pending))).tolist()
                err = TimeoutError(
                    f"workers {sorted(pending)} (hosting envs {slots}) did not finish start-up within "
                    f"start_timeout={timeout}s."
                )
                err.env_indices = slots  # which envs may hang (evaluate() times out their episodes)
                raise err
            sentinels = {death_fd(self._procs[w]): w for w in pending}
            if self._cancel_start is not None:  # looked at again every 0.1 s
                remaining = _CANCEL_POLL_S if remaining is None else min(remaining, _CANCEL_POLL_S)
            for obj in wait(list(pending.values()) + list(sentinels), remaining):
                w = sentinels[obj] if obj in sentinels else self._conns.index(obj)
                if w not in pending:
                    continue
                try:
                    if obj in sentinels and not pending[w].poll():
                        raise EOFError
                    msg = pending[w].recv()
                except (EOFError, OSError):
                    raise self._start_death(w) from None
                if msg[0] == "error":
                    raise self._start_error(msg)
                self.slot_paths.update(msg[2] or {})
                pending.pop(w, None)
            if pending:
                self._check_cancel()  # after what arrived was read: a worker's error is not hidden by it

    def death_info(self, w) -> str:
        """How worker ``w`` (a worker index) ended, for error messages: ``"killed by signal N"``
        or ``"exit code N"`` (``"exit code None"`` while it still runs)."""
        p = self._procs[w]
        code = exit_code(p, 0.05)
        if code is None:  # its main thread may have exited while the process lingers
            code = exit_begun(p.pid)
        return describe_exit(code)

    def _start_error(self, msg):
        _, _, index, (phase, tb) = msg
        self._error = EnvError(index, phase, tb)
        return self._error

    def _start_death(self, w):
        slots = np.flatnonzero(self._slot_worker == w).tolist()
        self._error = WorkerDiedError(
            f"worker {w} (pid {self._procs[w].pid}, hosting envs {slots}) died during start-up ({self.death_info(w)}). "
            "Workers start from a fork server that re-imports the main module: a script that builds a pool "
            "outside an `if __name__ == \"__main__\":` guard fails this way, and so does one read from standard "
            "input (`python - <<EOF`), which cannot be re-imported: save it to a file.",
            slots,
        )
        return self._error

    def _stop_workers(self, timeout):
        """Tells the workers to exit, kills those still running after ``timeout`` seconds, and
        closes their pipes (the first half of :meth:`~torchrl_asyncpool.AsyncEnvPool.close`)."""
        if hasattr(self, "_life_box"):
            _shutdown(self._procs, self._life_box, timeout, stacklevel=4)  # close()'s caller, as before
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        self._life_r_close()
        for c in getattr(self, "_conns", []):
            c.close()
        self._closed_pids = [p.pid for p in self._procs]  # worker_pids after close (a closed Process has none)
        for p in self._procs:
            release_process(p)


def release_process(p) -> bool:
    """Frees what a worker that has exited still holds in this process (a process's sentinel
    and start-up pipes, a thread worker's descriptors) now, not when it is garbage collected;
    a worker still running keeps them. Returns whether it was released (its process object is
    closed then)."""
    if isinstance(p, ThreadWorker):
        p.close()
        return True
    if exit_code(p) is None:
        return False
    release_death_fd(p)
    try:
        p.close()
    except ValueError:  # closed already
        pass
    return True


def _shutdown(procs, life_w_box, timeout, stacklevel=3):
    """Closes the life pipe (workers exit at their next wake-up), then kills stragglers.
    ``stacklevel``: of the warning about worker threads that did not stop (the pool's caller)."""
    if life_w_box[0] >= 0:
        os.close(life_w_box[0])
        life_w_box[0] = -1
    deadline = time.monotonic() + timeout
    for p in procs:
        exit_code(p, max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if isinstance(p, ThreadWorker) and exit_code(p) is None]
    if hung and timeout > 0:  # a thread cannot be killed: it is left to end with its step (or with the process)
        warnings.warn(
            f"AsyncEnvPool(backend='threading'): worker threads {[p.name for p in hung]} did not stop within "
            f"{timeout}s (an env step that does not return?); they are daemon threads and keep running until "
            "their step returns or the process exits.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    procs = [p for p in procs if not isinstance(p, ThreadWorker)]
    for p in procs:
        if exit_code(p) is None:
            p.kill()
    for p in procs:
        exit_code(p, 1.0)
    # what the envs started and left behind, a killed worker's above all
    killed = [p.pid for p in procs if kill_process_group(p.pid, alive=exit_code(p) is None)]
    until = time.monotonic() + 0.5  # gone (or zombies) before close() returns, ports and devices freed
    while killed and time.monotonic() < until:
        killed = [g for g in killed if _group_alive(g)]
        if killed:
            time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True


def kill_process_group(pid: int | None, *, alive: bool) -> bool:
    """SIGKILLs what is left of worker ``pid``'s process group (a worker leads one, which the
    processes its envs start join; see ``worker_main``); True if there was a group to kill.

    ``alive``: the worker process has not been seen to end. A process group id is never given to
    a new process while the group exists, so for a worker that ended, a live process with its
    pid is someone else (the pid was reused) and nothing is killed; with no such process, a
    group of that id is the worker's. A live worker that does not lead a group (it could not
    make one) is not killed here either."""
    if pid is None:
        return False
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:  # no process with that pid: a group of that id is the worker's
        pgid = pid
    except OSError:
        return False
    else:
        if not alive or pgid != pid:
            return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True
