"""Shared fixtures: oracle env factories and a guard that no test leaks processes or /dev/shm files."""
import functools
import os
import time

import pytest

from torchrl_asyncpool.testing import OracleEnv


def oracle_factories(n, **kwargs):
    """One OracleEnv factory per slot; env ids equal slot indices, as OracleChecker expects."""
    return [functools.partial(OracleEnv, env_id=i, **kwargs) for i in range(n)]


def free_address(host: str = "localhost") -> str:
    """``"host:port"`` with a port nothing listens on right now (for remote env slots)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def start_and_check(collector, rb, frames, timeout=60.0):
    """``collector.start()``, waits until ``rb`` holds ``frames`` transitions, checks them with
    the oracle and shuts the collector down."""
    from torchrl_asyncpool.testing import OracleChecker

    try:
        collector.start()
        deadline = time.monotonic() + timeout
        while len(rb) < frames and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(rb) == frames
        OracleChecker().observe_transitions(rb[:frames])
    finally:
        collector.shutdown()


@pytest.fixture
def dev_shm_guard():
    """No new /dev/shm file survives the test. The pool's memory is memfd-backed, so it never
    creates one; multiprocessing semaphores (``sem.mp-*``) that unrelated processes on the
    machine create and drop meanwhile are not ours and are ignored."""
    before = set(os.listdir("/dev/shm"))
    yield
    leaked = {f for f in set(os.listdir("/dev/shm")) - before if not f.startswith("sem.mp-")}
    assert not leaked, f"shared-memory segments leaked into /dev/shm: {sorted(leaked)}"


def thread_names(pid):
    """The names of process ``pid``'s threads (``/proc/PID/task/*/comm``)."""
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names
