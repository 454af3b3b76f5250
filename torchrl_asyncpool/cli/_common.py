"""What several commands of ``torchrl-asyncpool`` share: the fork server's start, option types,
the end of the process."""
from __future__ import annotations

import argparse
import os
import sys


def _start_fork_server() -> None:
    """Starts the fork server that env workers fork from, deaf to Ctrl-C.

    A terminal's Ctrl-C reaches every process of the command. ``multiprocessing``'s fork server
    ignores it only once it has imported its preload list (torch, TorchRL: seconds, longer on a
    busy machine); a Ctrl-C before that killed it with a traceback of its own, and the command
    then failed with ``BrokenPipeError``/``EOFError`` instead of stopping. It is started here
    with ``SIGINT`` blocked (a signal mask survives its ``fork`` and ``exec``; it then ignores the
    signal for good), so it never takes one: the command owns the shutdown of everything it
    started. Blocked, not ignored, in this process: a Ctrl-C that comes meanwhile is delivered
    here once the start returns.
    """
    import signal
    from multiprocessing import forkserver, resource_tracker

    from torchrl_asyncpool._sys.forkserver import forkserver_context

    forkserver_context("torchrl-asyncpool")  # sets the preload list
    # the resource tracker first: starting it unblocks SIGINT in this thread when it is done
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _wait_fork_server_ready(poll_s: float = 0.05) -> None:
    """Returns once the fork server started by :func:`_start_fork_server` has imported its
    preload list (or is gone); a Ctrl-C meanwhile raises ``KeyboardInterrupt`` here at once.

    A pool that starts before then waits, inside ``multiprocessing``, for the fork server to
    answer its first start request, a wait that nothing can cut short: seconds on an idle
    machine, tens of seconds on a busy one. A command that has work to abandon cleanly on Ctrl-C
    (``eval`` writes every episode's result) waits here instead. Ready is seen in
    ``/proc/PID/status``: the fork server installs its ``SIGCHLD`` handler once its preload is
    imported, right before it serves its first request.
    """
    import signal
    import time
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if not pid:
        return
    bit = 1 << (signal.SIGCHLD - 1)
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # gone (or no /proc): the pool's start reports what happened
            return
        if fields.get("State", "").split()[:1] in (["Z"], ["X"]) or int(fields.get("SigCgt", "0"), 16) & bit:
            return
        time.sleep(poll_s)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises ``KeyboardInterrupt`` by a command that stops on both
    alike (``eval``); the command line's exit status is then 143 instead of 130."""


def _raise_terminated(signum, frame):
    raise Terminated


def _import_callable(spec: str, option: str, what: str = "MODULE:FUNCTION"):
    """The callable that ``spec`` (``"module.path:name"``) names, imported for the command-line
    ``option``; ``ValueError`` (naming the option, what was given and what is expected) for a
    malformed string, a module that cannot be imported, a missing or non-callable attribute.

    Modules in the current directory import, as with ``python -m`` (a console script's
    ``sys.path`` starts with its own ``bin/`` folder instead).

    Examples:
        >>> _import_callable("json:dumps", "--env-factory")({"a": 1})
        '{"a": 1}'
        >>> _import_callable("json", "--env-factory")
        Traceback (most recent call last):
        ...
        ValueError: --env-factory must be MODULE:FUNCTION (e.g. mypkg.envs:make_env), got 'json'.
    """
    import importlib

    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr or ":" in attr:
        raise ValueError(f"{option} must be {what} (e.g. mypkg.envs:make_env), got {spec!r}.")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{option} {spec!r}: cannot import the module {module!r} ({type(exc).__name__}: {exc}); "
                         "it must be on the Python path or in the current directory.") from exc
    target = mod
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            public = sorted(n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n, None)))
            raise ValueError(f"{option} {spec!r}: the module {module!r} has no attribute {attr!r} (its callables: "
                             f"{', '.join(public[:12]) or 'none'}{', ...' if len(public) > 12 else ''}).") from None
    if not callable(target):
        raise ValueError(f"{option} {spec!r}: {attr!r} is a {type(target).__name__}, not a function.")
    return target


def _positive_int(text: str) -> int:
    """An ``int`` >= 1 (argparse names the option when this raises)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _stop_fork_server() -> None:
    """Ends the fork server now (``SIGTERM``), for a command that stops on Ctrl-C after closing
    what it started: a fork server still importing its preload list would otherwise outlive the
    command by as long as that takes (it notices its parent's exit only once done)."""
    import signal
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:  # already gone
            pass


def _release_semaphores() -> None:
    """Unlinks the named semaphores this process created (``multiprocessing`` locks, e.g.
    tqdm's), as a normal exit does; after ``os._exit`` the resource tracker would find them
    and print a "leaked semaphore objects" warning below the command's summary line."""
    from multiprocessing import synchronize, util

    for finalizer in list(getattr(util, "_finalizer_registry", {}).values()):
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            try:
                finalizer()
            except Exception:  # noqa: BLE001 - already unlinked: nothing left to release
                pass


def _exit_process(code: int, command: str) -> None:
    """Ends the ``torchrl-asyncpool`` process with ``code`` once its command has returned; never
    returns.

    The command has closed what it started and printed its summary. Python's own exit then
    spends seconds in torch's and TorchRL's C++ destructors (2-3 s on an idle 2-core machine,
    more on a busy one), and a Ctrl-C in that time killed the process by SIGINT, with no word.
    Here the exit is immediate: the threads that are not daemons are joined and the ``atexit``
    functions run, as Python's exit would (after Ctrl-C or SIGTERM, status 130 or 143, only the
    semaphores are released), the fork server is stopped, then ``os._exit``. A Ctrl-C meanwhile
    ends the process at once with status 130 and one line.
    """
    import signal
    import threading

    def flush():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing more to say
                pass

    def late_ctrl_c(signum, frame):
        if code not in (130, 143):  # it had finished: say so, once
            print(f"\ntorchrl-asyncpool{command}: interrupted while exiting; the command had finished "
                  "(its output is above).", file=sys.stderr)
        flush()
        os._exit(130 if code not in (130, 143) else code)

    signal.signal(signal.SIGINT, late_ctrl_c)
    try:
        if code in (130, 143):
            _release_semaphores()
        else:
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
            import atexit

            atexit._run_exitfuncs()
        # its children are gone; left alone, it would tear torch down for a second or more once it
        # notices this process's exit, holding the command's stdout and stderr open meanwhile
        _stop_fork_server()
    finally:
        flush()
        os._exit(code)
