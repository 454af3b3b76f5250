"""worker_affinity / driver_affinity: masks validated at the boundary, applied to the right
threads and processes (read back from the kernel), the constructing thread left alone."""
import os
import threading

import pytest

from conftest import oracle_factories
from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool.affinity import check_cpu_mask, resolve_worker_affinity
from torchrl_asyncpool.testing import oracle_action

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
FIRST, LAST = CPUS[0], CPUS[-1]


def _task_masks(pid):
    """The affinity of every thread of process ``pid``."""
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_masks_are_validated_with_clear_errors():
    assert check_cpu_mask([LAST, FIRST, FIRST], "m") == tuple(sorted({FIRST, LAST}))
    with pytest.raises(TypeError, match="driver_affinity must be a sequence of CPU indices"):
        check_cpu_mask("0", "driver_affinity")
    with pytest.raises(ValueError, match="non-empty sequence of int CPU indices"):
        check_cpu_mask([], "m")
    with pytest.raises(ValueError, match="non-empty sequence of int CPU indices"):
        check_cpu_mask([True], "m")
    with pytest.raises(ValueError, match=r"names CPUs \[4096\] this process may not run on"):
        check_cpu_mask([FIRST, 4096], "m")
    with pytest.raises(ValueError, match="worker_affinity has 1 masks for 2 worker processes"):
        resolve_worker_affinity([[FIRST]], 2)
    assert resolve_worker_affinity(lambda w: [CPUS[w % len(CPUS)]], 2) == [(CPUS[0],), (CPUS[1 % len(CPUS)],)]
    assert resolve_worker_affinity(None, 3) is None


@pytest.mark.parametrize("env_threads", [False, True])
def test_each_worker_and_its_env_threads_run_on_their_mask(env_threads):
    masks = [[FIRST], [LAST]]
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2, env_threads=env_threads,
                      worker_affinity=masks) as pool:
        for pid, mask in zip(pool.worker_pids, masks):
            for tid, got in _task_masks(pid).items():
                assert got == set(mask), f"worker {pid} thread {tid}: {sorted(got)}, expected {mask}"
        td = pool.recv(min_get=4)  # and the pinned workers work
        pool.send({"action": oracle_action(td["tag"])}, td.env_indices)
        pool.recv(min_get=1)
    with pytest.raises(ValueError, match="worker_affinity has 1 masks for 2 worker processes"):
        AsyncEnvPool(oracle_factories(4), envs_per_worker=2, worker_affinity=[[FIRST]])


def test_collector_pins_its_threads_not_the_caller():
    def policy(td):
        return td.set("action", oracle_action(td["tag"]))

    before = os.sched_getaffinity(0)
    c = AsyncPoolCollector(oracle_factories(2), policy=policy, frames_per_batch=8, total_frames=16,
                           envs_per_worker=1, driver_affinity=[LAST], worker_affinity=lambda w: [FIRST])
    try:
        assert os.sched_getaffinity(0) == before  # the constructing thread keeps its mask
        serving = [t for t in threading.enumerate() if t.name.startswith("torchrl_asyncpool-inference")]
        assert serving, [t.name for t in threading.enumerate()]
        assert all(os.sched_getaffinity(t.native_id) == {LAST} for t in serving)
        for pid in c.env.worker_pids:
            assert all(m == {FIRST} for m in _task_masks(pid).values())
        assert sum(b.numel() for b in c) == 16
    finally:
        c.shutdown()
    with pytest.raises(ValueError, match="driver_affinity.*names CPUs"):
        AsyncPoolCollector(oracle_factories(1), policy=policy, frames_per_batch=4, driver_affinity=[4096])
