"""Scale: nothing caps the number of envs below what memory allows.

A fork server's start message carries at most ~250 descriptors, and a threaded worker (one
doorbell per env) or an inference server (the consumer handle names every doorbell) used to
carry one per env: pools stopped starting near 250 envs (``ValueError: too many fds``). These
tests start more than 256 envs in one worker and serve them from a server process, and check
how descriptors are shipped and how the descriptor limit is raised or reported.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from tensordict import TensorDict

from conftest import oracle_factories, served
from torchrl_asyncpool import AsyncEnvPool, InferenceServer
from torchrl_asyncpool.exchange import Doorbell
from torchrl_asyncpool._sys.forkserver import exit_code, forkserver_context
from torchrl_asyncpool._sys.descriptors import ship_fds
from torchrl_asyncpool.inference.examples import JsonlRecorder, read_jsonl
from torchrl_asyncpool.testing.policies import OracleTagPolicy
from torchrl_asyncpool.testing import OracleChecker, oracle_action

#: more envs than a fork server start message holds descriptors (CPython's MAXFDS_TO_SEND = 256)
_MANY = 300


def _ring_each(fds, values):
    """Child: adds ``values[i]`` to eventfd ``fds[i]``."""
    for fd, v in zip(fds, values):
        os.eventfd_write(fd.fd, v)


@pytest.mark.parametrize("shipped", [True, False])
def test_more_descriptors_than_a_start_message_holds(shipped):
    """600 eventfds reach a fork server child, each the right one: after the start in batches
    (``ship_fds``), or without it through the resource sharer past the start message's room."""
    bells = [Doorbell() for _ in range(600)]
    try:
        p = forkserver_context().Process(target=_ring_each, args=([b.inheritable() for b in bells],
                                                                  list(range(1, 601))))
        if shipped:
            with ship_fds():
                p.start()
        else:
            p.start()
        assert exit_code(p, timeout=60) == 0
        assert [b.drain() for b in bells] == list(range(1, 601))
    finally:
        for b in bells:
            b.close()


def test_ship_fds_nothing_to_ship_and_nested():
    """A block whose start carries no InheritedFd sends nothing; a nested block ships with the
    outer one."""
    p = forkserver_context().Process(target=time.sleep, args=(0,))
    with ship_fds():
        p.start()
    assert exit_code(p, timeout=60) == 0
    bell = Doorbell()
    try:
        p = forkserver_context().Process(target=_ring_each, args=([bell.inheritable()], [5]))
        with ship_fds(), ship_fds():
            p.start()
        assert exit_code(p, timeout=60) == 0
        assert bell.drain() == 5
    finally:
        bell.close()


def _drive_until_all_seen(pool, checker, n, timeout=60.0):
    seen = set()
    deadline = time.monotonic() + timeout
    while len(seen) < n:
        assert time.monotonic() < deadline, f"records from {len(seen)} of {n} envs in {timeout}s"
        td = pool.recv(min_get=1, timeout=timeout)
        checker.observe_batch(td)
        seen.update(td.env_indices.tolist())
        b = td.batch_size[0]
        pool.send(TensorDict({"action": oracle_action(td["tag"])}, [b]), td.env_indices)
    return seen


def test_pool_of_more_than_256_threaded_envs_in_one_worker():
    """One worker process hosting 300 envs in threads: 300 doorbells (plus the arena and the
    pipes) cross to it; every env delivers records, exactly once and in order."""
    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(_MANY), envs_per_worker=_MANY, env_threads=True) as pool:
        assert pool.num_workers == 1 and pool.env_threads
        assert len(pool._bells) == _MANY
        assert _drive_until_all_seen(pool, checker, _MANY) == set(range(_MANY))
    assert checker.records >= _MANY


def test_transitions_of_more_than_256_envs_many_chunks_per_batch():
    """300 envs in two threaded workers, chunks of 2 transitions: a batch is made of ~150
    chunks, and one split chunk is carried to the next batch; every transition arrives
    exactly once, in order per env, and every env's do (within 40 batches: on a loaded
    machine an env thread can fall behind for a few batches, nothing promises fairness)."""
    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(_MANY), envs_per_worker=_MANY // 2, env_threads=True,
                      transition_chunk_size=2) as pool, served(pool):
        envs, batches = set(), 0
        while batches < 5 or (envs != set(range(_MANY)) and batches < 40):
            batch = pool.take_transitions(301, timeout=60)
            assert batch is not None and batch.batch_size == (301,)
            checker.observe_transitions(batch)
            envs.update(batch["env_index"].tolist())
            batches += 1
    assert checker.records == batches * 301
    assert envs == set(range(_MANY))


def test_process_inference_server_serves_more_than_256_threaded_envs(tmp_path):
    """The consumer handle an inference server process gets names 300 doorbells (one per env):
    the server starts and answers every env."""
    path = str(tmp_path / "log.jsonl")
    with AsyncEnvPool(oracle_factories(_MANY), envs_per_worker=150, env_threads=True) as pool:
        assert len(pool.consumer_handle().bells) == _MANY
        with InferenceServer(policy_factory=OracleTagPolicy, on_batch=JsonlRecorder(path)).start(pool) as server:
            assert server.mode == "process"
            deadline = time.monotonic() + 60
            while server.stats()["frames"] < 3 * _MANY:
                assert time.monotonic() < deadline, server.stats()
                server.check()
                time.sleep(0.01)
    rows = read_jsonl(path)
    assert {r["env_index"] for r in rows} == set(range(_MANY))
    for row in rows:
        assert row["action"] == int(oracle_action(torch.tensor(row["tag"])))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_soft_fd_limit_is_raised_to_the_hard_one_or_named_when_too_low():
    """A pool needing more descriptors than the soft RLIMIT_NOFILE raises it to the hard one (the
    fork server and workers started afterwards inherit it); when even the hard limit is too low,
    the error says which limit and what to do. In a child interpreter: limits are per process."""
    out = _run("""
        import functools, resource
        from torchrl_asyncpool import AsyncEnvPool
        from torchrl_asyncpool.testing import OracleEnv
        fns = [functools.partial(OracleEnv, env_id=i) for i in range(200)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 4096))
        with AsyncEnvPool(fns, envs_per_worker=200, env_threads=True, backend="threading") as pool:
            pool.recv(min_get=200)
        print(resource.getrlimit(resource.RLIMIT_NOFILE))
        # worker threads own a duplicate of each of their descriptors: 2 x 200 bells do not fit in 300
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
        try:
            AsyncEnvPool(fns, envs_per_worker=200, env_threads=True, backend="threading")
        except OSError as exc:
            print("OSError", exc)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        try:
            AsyncEnvPool(fns, envs_per_worker=200, env_threads=True, backend="threading")
        except OSError as exc:
            print("OSError", exc)
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "(4096, 4096)", out.stdout
    assert "RLIMIT_NOFILE" in lines[1] and "hard 300" in lines[1], out.stdout
    assert "RLIMIT_NOFILE" in lines[2] and "hard 128" in lines[2], out.stdout
