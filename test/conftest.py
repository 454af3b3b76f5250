"""Shared fixtures: oracle env factories, a thread that answers a pool's records (``served``),
a guard that no test leaves a process behind (every test), and an opt-in guard that no test
leaves a /dev/shm file behind (``dev_shm_guard``)."""
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from tensordict import TensorDict

from torchrl_asyncpool.testing import OracleEnv, oracle_action

SCRIPTS = Path(__file__).resolve().parents[1] / "sota-implementations"

# A shell without job control starts its background commands with Ctrl-C ignored, and an ignored
# signal stays ignored across exec: the commands the Ctrl-C tests start would ignore it too. They
# test what a terminal user gets, so this process takes Ctrl-C as Python does by default (a
# caught signal is reset to the default in the processes it starts).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def oracle_factories(n, **kwargs):
    """One OracleEnv factory per slot; env ids equal slot indices, as OracleChecker expects."""
    return [functools.partial(OracleEnv, env_id=i, **kwargs) for i in range(n)]


@contextlib.contextmanager
def served(pool, answer=lambda td: oracle_action(td["tag"])):
    """Answers every record ``pool`` hands out, from a thread, while the block runs:
    ``answer(batch) -> action tensor`` (the oracle's action by default). Yields the list of the
    thread's errors; a block that ends without raising fails if the thread had one."""
    stop, errors = threading.Event(), []

    def run():
        try:
            while not stop.is_set():
                try:
                    td = pool.recv(timeout=0.05)
                except TimeoutError:
                    continue
                pool.send(TensorDict({"action": answer(td)}, [td.batch_size[0]]), td.env_indices)
        except Exception as e:  # noqa: BLE001 - surfaced below, or by the block's own error
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(5)
    assert not errors, errors


def free_address(host: str = "localhost") -> str:
    """``"host:port"`` with a port nothing listens on right now (for remote env slots)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def host_running(host, **run_kwargs):
    """Runs the env host ``host`` (``host.run(**run_kwargs)``) in a daemon thread; returns
    ``(thread, result)``, ``result`` holding ``"steps"`` (what ``run`` returned) or ``"error"``."""
    import threading

    result = {}

    def run():
        try:
            result["steps"] = host.run(**run_kwargs)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_for_a_host_that_never_comes(monkeypatch, caplog, slot, wait):
    """Runs ``wait()`` (a remote slot's wait for its host) in a thread with the no-host warning
    due after 0.2 s, lets it wait 0.8 s, closes ``slot``; returns the warnings it logged and
    what the wait raised. Asserts it was still waiting when closed and ended after."""
    import logging

    from torchrl_asyncpool.remote import ingress

    monkeypatch.setattr(ingress, "NO_HOST_WARN_S", 0.2)
    raised = []

    def run():
        try:
            wait()
        except RuntimeError as exc:
            raised.append(exc)

    with caplog.at_level(logging.WARNING, logger="torchrl_asyncpool.remote"):
        waiter = threading.Thread(target=run, daemon=True)
        waiter.start()
        time.sleep(0.8)
        assert waiter.is_alive()  # still waiting, after the warning
        slot.close()
        waiter.join(5)
    assert not waiter.is_alive()
    warned = [r.getMessage() for r in caplog.records if "no env host has connected" in r.getMessage()]
    return warned, raised


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


#: multiprocessing's helpers, started by the first test that needs them and kept for the run
_RUN_LONG = ("from multiprocessing.forkserver import main", "from multiprocessing.resource_tracker import main")


def _descendants() -> dict:
    """``{pid: process}`` of this process's living descendants (zombies excluded: already ended),
    but for multiprocessing's fork server and resource tracker (their children count)."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(p.cmdline()) for h in _RUN_LONG):
                out[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return out


#: seconds a test's processes get to exit after it returned (a pool's close reaps its workers;
#: a process started by the test may still be ending on a busy machine)
_PROCESS_GRACE_S = 10.0


@pytest.fixture(autouse=True)
def process_leak_guard(request):
    """Every test: no process it started (env workers, servers, fork-server children, subprocesses)
    is still alive once it ended. Processes that were there before the test, and the fork server
    and resource tracker multiprocessing keeps for the whole run, are not its own. Tests using the
    module-scoped Ray cluster are exempt: Ray keeps its worker processes between tests."""
    if "ray_cluster" in request.fixturenames:
        yield
        return
    before = set(_descendants())
    yield
    deadline = time.monotonic() + _PROCESS_GRACE_S
    while True:
        left = {pid: p for pid, p in _descendants().items() if pid not in before}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if left:
        described = []
        for p in left.values():
            try:
                described.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
                p.kill()  # so that one leak does not fail the tests after it
            except psutil.Error:
                pass
        pytest.fail(f"processes left behind by the test: {described}", pytrace=False)


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


def run_checked(cmd, timeout: float, cwd=None):
    """Runs ``cmd`` (unbuffered Python output) and fails the test with the tails of its stdout and
    stderr unless it exits 0; returns the completed process."""
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


def load_script(name: str):
    """Imports ``sota-implementations/<name>.py`` as a module (its ``main`` is not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"sota_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def load_benchmark_script(name: str):
    """Imports ``benchmarks/<name>.py`` as a module, as running it would (its folder on sys.path)."""
    import importlib.util

    # benchmarks/ on sys.path only while importing (the script may add it again itself): a fork
    # server started later would inherit it and find benchmarks/conftest.py where the tests'
    # factories live in test/conftest.py
    folder = SCRIPTS.parent / "benchmarks"
    saved = list(sys.path)
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
