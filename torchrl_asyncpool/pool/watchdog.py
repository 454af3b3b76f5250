"""The watchdog of an :class:`~torchrl_asyncpool.AsyncEnvPool` whose workers may have to be
replaced: ``on_env_failure="restart"`` (a worker process that died is started again) and
``step_timeout`` (a worker stuck in a step or reset is killed, then restarted or reported).

It runs in the pool's own process, from the consumer's waits (``recv``, ``wait_ready``) and
from :meth:`~torchrl_asyncpool.AsyncEnvPool.check_workers` (which a collector calls about every
100 ms), about every 20 ms. What a watched worker writes for it, and how a replacement takes
over the slots of the worker it replaces, is in :mod:`~torchrl_asyncpool.workers.watch`.
"""
from __future__ import annotations

import select
import threading
import time

import numpy as np

from torchrl_asyncpool.errors import EnvError, WorkerDiedError
from torchrl_asyncpool.exchange import slot_states as S
from torchrl_asyncpool.exchange.arena import Arena
from torchrl_asyncpool._sys.descriptors import InheritedFd
from torchrl_asyncpool._sys.exit_begun import EXIT_CHECK_S, exit_begun
from torchrl_asyncpool._sys.forkserver import death_fd, exit_code
from torchrl_asyncpool.step_type import StepType
from torchrl_asyncpool.workers.restarts import DeferredEnvError
from torchrl_asyncpool.workers.watch import WorkerWatch, hung_slots

_ENDS = (int(StepType.TERMINATION), int(StepType.TRUNCATION))
#: the phase a restart caused by a worker's death is recorded under (``restart_info()``)
WORKER_DIED = "worker"
#: the phase of a rebuild killed for build_timeout
BUILD = "build"
#: build_timeout="auto": this many times the workers' start-up, and at least this many seconds
_AUTO_BUILD_FACTOR, _MIN_AUTO_BUILD_S = 10.0, 60.0
#: a worker this watchdog killed is replaced this long after its SIGKILL even if its exit has not
#: finished: a killed process runs no more of its own code, but the kernel's teardown of its
#: memory runs in whichever of its threads exits last, and when that is the SCHED_IDLE idle
#: poller (see exchange/doorbell.py) on a core the other workers keep busy, it got ~0.3 % of the
#: core and took over a minute (a worker killed for build_timeout on 2 cores, its exit seen in
#: /proc as its idle poller in D state in unlink_file_vma)
_KILLED_GRACE_S = 0.25


class _PoolWatchdog:
    """Mixed into :class:`~torchrl_asyncpool.AsyncEnvPool`; reads its ``_procs``, ``_arena``,
    ``_slot_worker``, ``_restart`` and starts replacements with its ``_start_worker``."""

    def _init_watchdog(self, step_timeout, threads: bool, build_timeout="auto"):
        """Decides whether the workers are watched (before they start) and sets up the shadow
        arena of the slots' last leased records when dead workers are to be replaced."""
        #: seconds an env's step (or reset) may take before its worker is killed (None: no limit)
        self.step_timeout = step_timeout
        #: seconds a rebuild of an env may take before its worker is killed (None: no limit;
        #: "auto" until the workers' start-up was measured)
        self.build_timeout = build_timeout
        #: worker processes replaced so far (on_env_failure="restart")
        self.worker_restarts = 0
        self._watched = not threads and (self._restart is not None or step_timeout is not None)
        self._shadow = None
        self._watch = None
        # when the pool started its first workers (set then): no mark of theirs is older
        self._arena_clock_floor = 0.0
        if not self._watched:
            return
        if self._restart is not None:
            self._shadow = Arena.create(self.layout, "torchrl_asyncpool_shadow")
        self._watch = WorkerWatch(InheritedFd(self._shadow.fd) if self._shadow is not None else None)
        self._watch_lock = threading.Lock()
        # the pool's own tracker of the restart policy, for the replacements it makes
        self._budget = self._restart.budget(self._arena, self.layout.num_slots) if self._restart is not None else None
        self._timed_out = {}  # worker -> (env, phase, seconds its step had run) of a kill for step_timeout
        self._killed_at = {}  # worker -> when this watchdog sent it SIGKILL (until it is replaced)
        self._exiting = []  # replaced processes whose exit had not finished: released once it has
        self._lingering = set()  # workers whose main thread exited while the process runs on
        self._last_exit_check = 0.0
        self._sentinel_poll = None
        # worker -> when its current process was started as a replacement: the marks its dead
        # predecessor left (which the replacement reads to take over) are not hung steps
        self._started_at = {}

    def _set_build_timeout(self, startup_s: float) -> None:
        """Resolves ``build_timeout="auto"`` from the workers' measured start-up (generous: a
        rebuild on a loaded machine may take several times what the first build took)."""
        if self.build_timeout == "auto":
            self.build_timeout = max(_MIN_AUTO_BUILD_S, _AUTO_BUILD_FACTOR * startup_s)

    def _close_watchdog(self):
        from torchrl_asyncpool.pool.processes import release_process

        for p in getattr(self, "_exiting", ()):  # killed already: their exit ends once the cores are free
            exit_code(p, 5.0)
            release_process(p)
        self._exiting = []
        if getattr(self, "_shadow", None) is not None:
            self._shadow.close()
            self._shadow = None

    def _refresh_sentinels(self):
        poller = select.poll()
        self._sentinel_fds = {}
        for w, p in enumerate(self._procs):
            fd = death_fd(p)  # not p.sentinel: a fork server's end is not its children's
            poller.register(fd, select.POLLIN)
            self._sentinel_fds[fd] = w
        self._sentinel_poll = poller

    def _watchdog(self) -> None:
        """Kills workers stuck past ``step_timeout`` and replaces (or reports) dead ones. Raises
        :class:`~torchrl_asyncpool.WorkerDiedError` or :class:`~torchrl_asyncpool.EnvError` when
        it may not replace one (``on_env_failure="raise"``, or past the restart budget)."""
        if not self._watched or self._closed or not self._watch_lock.acquire(blocking=False):
            return  # (another thread is at it)
        try:
            if self.step_timeout is not None:
                self._kill_hung(time.monotonic())
            if isinstance(self.build_timeout, (int, float)):
                self._kill_hung_builds(time.monotonic())
            if self._sentinel_poll is None:
                self._refresh_sentinels()
            dead = {self._sentinel_fds[fd] for fd, _ in self._sentinel_poll.poll(0)}
            now = time.monotonic()
            # killed here and not seen to end: gone all the same once the kill is delivered
            dead.update(w for w, t in self._killed_at.items() if now - t > _KILLED_GRACE_S)
            if now - self._last_exit_check >= EXIT_CHECK_S:
                self._last_exit_check = now
                dead.update(self._find_lingering(dead))
            for w in sorted(dead):
                self._replace(w)
            if self._exiting:
                self._release_exited()
        finally:
            self._watch_lock.release()

    def _find_lingering(self, dead) -> set:
        """Workers whose main thread has exited while their process runs on (see
        :mod:`~torchrl_asyncpool._sys.exit_begun`): dead to their envs, replaced without waiting
        for their end."""
        found = {w for w, p in enumerate(self._procs)
                 if w not in dead and w not in self._killed_at and exit_begun(p.pid) is not None}
        self._lingering.update(found)
        return found

    def _kill_hung(self, now: float) -> None:
        arena = self._arena
        for i in hung_slots(arena, self.step_timeout, now).tolist():
            w = int(self._slot_worker[i])
            # read again: the worker writes the word while this runs, and the step found hung may
            # have ended since (0, or a later step's start); a mark older than the worker is its
            # dead predecessor's; a rebuild that follows a failed step is build_timeout's
            began = float(arena.busy_since[i])
            if (w in self._timed_out or began == 0.0 or now - abs(began) <= self.step_timeout
                    or abs(began) < self._started_at.get(w, self._arena_clock_floor) or arena.build_since[i] > 0):
                continue
            # an eager reset (negative), or the reset an answered terminal record asked for
            phase = "reset" if began < 0 or int(arena.request["step_type"][i]) in _ENDS else "step"
            self._timed_out[w] = (i, phase, now - abs(began))
            self._kill(w, now)

    def _kill_hung_builds(self, now: float) -> None:
        marks = self._arena.build_since
        for i in np.flatnonzero((marks > 0) & (now - marks > self.build_timeout)).tolist():
            w = int(self._slot_worker[i])
            # read again: the worker writes the word while this runs, and the build found hung may
            # have ended since (0: a CI run once killed a worker for a build that "had run" the
            # machine's uptime, now - 0); a mark older than the worker is its dead predecessor's
            since = float(marks[i])
            if (w in self._timed_out or since <= 0.0 or now - since <= self.build_timeout
                    or since < self._started_at.get(w, self._arena_clock_floor)):
                continue
            self._timed_out[w] = (i, BUILD, now - since)
            self._kill(w, now)

    def _release_exited(self) -> None:
        from torchrl_asyncpool.pool.processes import release_process

        ended = [p for p in self._exiting if exit_code(p) is not None]
        for p in ended:
            release_process(p)
            self._exiting.remove(p)

    def _kill(self, w: int, now: float) -> None:
        """SIGKILLs worker ``w`` (its envs' processes go with its group, in :meth:`_replace`)."""
        p = self._procs[w]
        if exit_code(p) is None:
            p.kill()
        self._killed_at[w] = now

    def _replace(self, w: int) -> None:
        from torchrl_asyncpool.pool.processes import kill_process_group, release_process

        p = self._procs[w]
        killed = self._killed_at.pop(w, None) is not None
        lingering = w in self._lingering
        self._lingering.discard(w)
        # a process killed here, or whose main thread has exited, may still be tearing its memory
        # down (or run threads it left): no wait, and its group is still its own (its pid is not
        # free before it is reaped)
        ended = exit_code(p, 0.0 if killed or lingering else 1.0) is not None
        # how it ended, read before the kills below make it "killed by signal 9" (death_info reads
        # a lingering process's main thread)
        how = self.death_info(w) if lingering and not ended else None
        if lingering and not ended:
            p.kill()  # the threads it left (a worker that leads no group is not killed below)
        kill_process_group(p.pid, alive=not ended)  # what its envs started
        slots = np.flatnonzero(self._slot_worker == w).tolist()
        reported = [j for j in slots if int(self._arena.state[j]) == S.ERROR]
        if reported:  # it exited after reporting its env's fatal failure: that failure is the error
            self._timed_out.pop(w, None)
            phase, _, tb = self._arena.read_error(reported[0]).partition("\n")
            self._fail(EnvError(reported[0], phase, tb))
        timed = self._timed_out.pop(w, None)
        if timed is not None and timed[1] == BUILD:
            i, phase, secs = timed
            text = (f"env {i}'s factory hung: rebuilding the env took more than build_timeout="
                    f"{self.build_timeout:g}s (it had run {secs:.1f}s): its worker {w} (pid {p.pid}, hosting envs "
                    f"{slots}) was killed.")
        elif timed is not None:
            i, phase, secs = timed
            text = (f"env {i} took more than step_timeout={self.step_timeout:g}s in a {phase} (it had run "
                    f"{secs:.1f}s): its worker {w} (pid {p.pid}, hosting envs {slots}) was killed.")
        else:
            i, phase = slots[0], WORKER_DIED
            text = f"worker {w} (pid {p.pid}, hosting envs {slots}) died ({how or self.death_info(w)})."
        fail = (lambda msg: EnvError(i, phase, msg)) if timed is not None else (lambda msg: WorkerDiedError(msg, slots))
        if self._restart is None:
            self._fail(fail(text))
        arena = self._arena
        for j in slots:  # the replacement counts against each env's budget, as an env's own rebuild does
            try:
                r = self._budget.admit(j, phase, text)
            except DeferredEnvError as exc:  # past it: the text has the restart history
                self._fail(fail(exc.tb))
            arena.write_error(j, f"{phase}\n{text}")
            arena.restarts[j] = r  # after the text; also the seed of its env's next build
        arena.build_since[slots] = 0.0
        self._conns[w].close()
        if not release_process(p):  # (it may have ended since: the kill above, or on its own)
            self._exiting.append(p)
        self._started_at[w] = time.monotonic()
        self._procs[w], self._conns[w] = self._start_worker(w, self._watch.resumed())
        self._refresh_sentinels()
        self.worker_restarts += 1

    def _fail(self, error: BaseException) -> None:
        """Makes ``error`` the pool's (sticky, as an env error is) and raises it."""
        self._error = error
        if self._consumer_obj is not None:
            self._consumer_obj.error = error
        raise error

