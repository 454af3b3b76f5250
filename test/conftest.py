"""Shared fixtures: oracle env factories and a guard that no test leaks processes or /dev/shm files."""
import functools
import os

import pytest

from torchrl_asyncpool.testing import OracleEnv


def oracle_factories(n, **kwargs):
    """One OracleEnv factory per slot; env ids equal slot indices, as OracleChecker expects."""
    return [functools.partial(OracleEnv, env_id=i, **kwargs) for i in range(n)]


@pytest.fixture
def dev_shm_guard():
    """No new /dev/shm file survives the test. The pool's memory is memfd-backed, so it never
    creates one; multiprocessing semaphores (``sem.mp-*``) that unrelated processes on the
    machine create and drop meanwhile are not ours and are ignored."""
    before = set(os.listdir("/dev/shm"))
    yield
    leaked = {f for f in set(os.listdir("/dev/shm")) - before if not f.startswith("sem.mp-")}
    assert not leaked, f"shared-memory segments leaked into /dev/shm: {sorted(leaked)}"
