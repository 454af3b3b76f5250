"""worker_affinity / driver_affinity: masks validated at the boundary, applied to the right
threads and processes (read back from the kernel), the constructing thread left alone."""
import os
import threading

import pytest

from conftest import oracle_factories
from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool._sys.affinity import check_cpu_mask, resolve_worker_affinity
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


def test_running_workers_move_to_new_masks_and_back():
    """``set_worker_affinity`` moves every thread of each running worker, ``worker_affinity`` says
    which masks are in force, ``None`` gives back every CPU; threads backend: refused."""
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2, worker_affinity=[[FIRST], [FIRST]]) as pool:
        pool.set_worker_affinity([[LAST], [FIRST]])
        assert pool.worker_affinity == [(LAST,), (FIRST,)]
        for pid, mask in zip(pool.worker_pids, ({LAST}, {FIRST})):
            assert all(m == mask for m in _task_masks(pid).values())
        td = pool.recv(min_get=4)  # the moved workers still step
        pool.send({"action": oracle_action(td["tag"])}, td.env_indices)
        assert pool.recv(min_get=1).numel() >= 1
        pool.set_worker_affinity(None)
        assert pool.worker_affinity is None
        assert all(m == set(CPUS) for pid in pool.worker_pids for m in _task_masks(pid).values())
        with pytest.raises(ValueError, match="worker_affinity has 1 masks for 2 worker processes"):
            pool.set_worker_affinity([[FIRST]])
    with AsyncEnvPool(oracle_factories(2), backend="threading") as pool:
        with pytest.raises(ValueError, match="set_worker_affinity needs worker processes"):
            pool.set_worker_affinity(None)


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


def _oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def _serving_threads():
    return [t for t in threading.enumerate() if t.name.startswith("torchrl_asyncpool-inference")]


@pytest.mark.skipif(len(CPUS) < 2, reason="the default partition needs two CPUs")
def test_collector_default_partition_policy_first_cpu_workers_the_rest():
    before = os.sched_getaffinity(0)
    c = AsyncPoolCollector(oracle_factories(4), policy=_oracle_policy, frames_per_batch=8, total_frames=32,
                           envs_per_worker=2)
    try:
        assert os.sched_getaffinity(0) == before
        serving = _serving_threads()
        assert serving and all(os.sched_getaffinity(t.native_id) == {FIRST} for t in serving)
        for pid in c.env.worker_pids:
            assert all(m == set(CPUS[1:]) for m in _task_masks(pid).values())
        assert sum(b.numel() for b in c) == 32
    finally:
        c.shutdown()


@pytest.mark.skipif(len(CPUS) < 2, reason="the default partition needs two CPUs")
@pytest.mark.parametrize("kwargs, during", [
    (dict(), {FIRST}),  # the default partition: the policy's CPU
    (dict(driver_affinity=[LAST]), {LAST}),
    (dict(worker_affinity=None, driver_affinity=None), set(CPUS)),  # nothing pinned: the caller's mask
])
def test_iterating_thread_takes_batches_on_the_policy_cpus_and_gets_its_mask_back(kwargs, during):
    c = AsyncPoolCollector(oracle_factories(4), policy=_oracle_policy, frames_per_batch=8, total_frames=32,
                           envs_per_worker=2, **kwargs)
    seen = []
    take = c.env.take_transitions

    def recording_take(*args, **kw):  # the pool's own take, with the calling thread's mask noted
        seen.append(os.sched_getaffinity(0))
        return take(*args, **kw)

    c.env.take_transitions = recording_take
    before = os.sched_getaffinity(0)
    try:
        frames = 0
        for batch in c:
            assert os.sched_getaffinity(0) == before  # the training loop's code runs on its own mask
            frames += batch.numel()
        assert frames == 32
        assert seen and all(mask == during for mask in seen), seen
    finally:
        c.shutdown()


@pytest.mark.parametrize("kwargs", [
    dict(worker_affinity=None, driver_affinity=None),
    dict(policy_num_threads=2),
    dict(envs_per_worker=2, env_threads=True),  # env threads (blocking envs) want every core
    dict(worker_affinity=lambda w: CPUS),  # explicit worker masks: the policy's CPU is not reserved
])
def test_collector_partition_is_off_when_asked_or_the_policy_wants_threads(kwargs):
    kwargs.setdefault("envs_per_worker", 1)
    c = AsyncPoolCollector(oracle_factories(2), policy=_oracle_policy, frames_per_batch=8, total_frames=8, **kwargs)
    try:
        assert all(os.sched_getaffinity(t.native_id) == set(CPUS) for t in _serving_threads())
        for pid in c.env.worker_pids:
            assert all(m == set(CPUS) for m in _task_masks(pid).values())
        assert sum(b.numel() for b in c) == 8
    finally:
        c.shutdown()


def test_bad_affinity_strings_are_refused():
    with pytest.raises(ValueError, match="worker_affinity must be 'auto', None or CPU indices, got 'all'"):
        AsyncPoolCollector(oracle_factories(1), policy=_oracle_policy, frames_per_batch=4, worker_affinity="all")
    with pytest.raises(ValueError, match="driver_affinity must be 'auto', None or CPU indices"):
        AsyncPoolCollector(oracle_factories(1), policy=_oracle_policy, frames_per_batch=4, driver_affinity="first")


def test_process_server_runs_on_driver_affinity():
    from torchrl_asyncpool.testing.policies import OracleTagPolicy

    c = AsyncPoolCollector(oracle_factories(2), policy_factory=OracleTagPolicy, frames_per_batch=8, total_frames=16,
                           envs_per_worker=1, driver_affinity=[LAST], worker_affinity=None)
    try:
        pid = c._server.pid
        assert pid is not None
        assert all(m == {LAST} for m in _task_masks(pid).values())
        assert sum(b.numel() for b in c) == 16
    finally:
        c.shutdown()


def test_inference_server_cpu_affinity_is_validated_and_applied():
    from torchrl_asyncpool import InferenceServer

    with pytest.raises(ValueError, match=r"cpu_affinity=\[4096\] names CPUs"):
        InferenceServer(_oracle_policy, cpu_affinity=[4096])
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        with InferenceServer(_oracle_policy, cpu_affinity=[LAST], timeout=0.0).start(pool) as server:
            assert all(os.sched_getaffinity(t.native_id) == {LAST} for t in _serving_threads())
            server.check()
            server.set_cpu_affinity([FIRST])  # moved while it serves
            assert os.sched_getaffinity(server.serving_thread_id) == {FIRST}
            server.set_cpu_affinity(None)  # every CPU its creator could use
            assert os.sched_getaffinity(server.serving_thread_id) == set(CPUS)
            with pytest.raises(ValueError, match=r"cpu_affinity=\[4096\] names CPUs"):
                server.set_cpu_affinity([4096])
            server.check()
        server.set_cpu_affinity([LAST])  # after stop: nothing to move, no error


def test_auto_partition_follows_the_environment_variable(monkeypatch):
    from torchrl_asyncpool._sys.affinity import auto_partition, resolve_collector_affinity

    monkeypatch.setenv("TORCHRL_ASYNCPOOL_AFFINITY", "none")
    assert auto_partition() == (None, None)
    assert resolve_collector_affinity("auto", "auto", 1) == (None, None, None)
    monkeypatch.setenv("TORCHRL_ASYNCPOOL_AFFINITY", "auto")
    policy, workers = auto_partition()
    if len(CPUS) >= 2:
        assert policy == (FIRST,) and workers == tuple(CPUS[1:])
        assert resolve_collector_affinity("auto", "auto", 1) == ("auto", None, (FIRST,))
    assert resolve_collector_affinity("auto", "auto", 2) == (None, None, None)
    assert resolve_collector_affinity(None, "auto", 1) == (None, None, None)
    assert resolve_collector_affinity(None, [LAST], 1) == (None, (LAST,), None)
    monkeypatch.setenv("TORCHRL_ASYNCPOOL_AFFINITY", "first")
    with pytest.raises(ValueError, match="TORCHRL_ASYNCPOOL_AFFINITY must be 'auto' or 'none', got 'first'"):
        auto_partition()


def test_pool_auto_affinity_partitions_only_workers_without_threads():
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2, worker_affinity="auto") as pool:
        expected = [tuple(CPUS[1:])] * 2 if len(CPUS) >= 2 else None
        assert pool.worker_affinity == expected
        if expected is not None:
            for pid in pool.worker_pids:
                assert all(m == set(CPUS[1:]) for m in _task_masks(pid).values())
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2, env_threads=True, worker_affinity="auto") as pool:
        assert pool.worker_affinity is None
    with pytest.raises(ValueError, match="worker_affinity must be 'auto', None or CPU masks, got 'all'"):
        AsyncEnvPool(oracle_factories(2), worker_affinity="all")


def _env_recording_its_build_mask(path, env_id):
    from torchrl_asyncpool.testing import OracleEnv

    with open(path, "w") as f:
        f.write(",".join(map(str, sorted(os.sched_getaffinity(0)))))
    return OracleEnv(env_id=env_id)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell the masks apart")
@pytest.mark.parametrize("env_threads", [False, True])
def test_envs_are_built_on_every_cpu_and_stepped_on_the_mask(tmp_path, env_threads):
    import functools

    paths = [tmp_path / f"env{i}.txt" for i in range(2)]
    fns = [functools.partial(_env_recording_its_build_mask, str(p), i) for i, p in enumerate(paths)]
    with AsyncEnvPool(fns, envs_per_worker=2, env_threads=env_threads, worker_affinity=[[FIRST]]) as pool:
        for p in paths:  # built before the worker pinned itself
            assert set(map(int, p.read_text().split(","))) == set(CPUS)
        for tid, got in _task_masks(pool.worker_pids[0]).items():
            assert got == {FIRST}, f"thread {tid}: {sorted(got)}"
