"""What several commands of ``torchrl-asyncpool`` share: the fork server's start, option types."""
from __future__ import annotations

import argparse
import os


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

    from torchrl_asyncpool.forkserver import forkserver_context

    forkserver_context("torchrl-asyncpool")  # sets the preload list
    # the resource tracker first: starting it unblocks SIGINT in this thread when it is done
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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
