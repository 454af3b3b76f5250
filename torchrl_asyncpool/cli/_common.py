"""What several commands of ``torchrl-asyncpool`` share: the fork server's start, option types."""
from __future__ import annotations

import argparse


def _start_fork_server() -> None:
    """Starts the fork server that env workers fork from, with Ctrl-C ignored in it.

    A terminal's Ctrl-C reaches every process of the command. ``multiprocessing``'s fork server
    ignores it only once it has imported its preload list (torch, TorchRL: seconds, longer on a
    busy machine); a Ctrl-C before that killed it with a traceback of its own, and the command
    then failed with ``BrokenPipeError``/``EOFError`` instead of stopping. Started here with
    ``SIGINT`` ignored (inherited across its ``exec``), it never takes one: the command owns the
    shutdown of everything it started.
    """
    import signal
    from multiprocessing import forkserver

    from torchrl_asyncpool.forkserver import forkserver_context

    forkserver_context("torchrl-asyncpool")  # sets the preload list
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _positive_int(text: str) -> int:
    """An ``int`` >= 1 (argparse names the option when this raises)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
