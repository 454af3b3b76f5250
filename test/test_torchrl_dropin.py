"""AsyncPoolCollector as a drop-in for TorchRL's AsyncBatchedCollector: the threading env backend,
TorchRL's construction errors, its stats keys, repr of a half-built collector, and the checks of
the actions a policy writes. Our own tests of each behaviour TorchRL's test suite relies on."""
import os
import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import AsyncBatchedCollector

from conftest import oracle_factories
from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, EnvError
from torchrl_asyncpool.inference import InferenceServerError
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, oracle_action

#: TorchRL 0.14.1's InferenceServer.stats() keys
TORCHRL_STAT_KEYS = {"requests", "batches", "requests_per_s", "batches_per_s", "avg_batch_size", "p50_queue_ms",
                     "p95_queue_ms", "p50_forward_ms", "p95_forward_ms", "policy_version", "weight_updates"}


def oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def _children():
    """Pids of this process's live children."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


# -- the threading env backend ------------------------------------------------------------------
@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (4, False), (4, True)])
def test_threading_pool_is_exactly_once_in_order_and_spawns_nothing(envs_per_worker, env_threads, dev_shm_guard):
    checker = OracleChecker()
    before = _children()
    t0 = time.monotonic()
    with AsyncEnvPool(oracle_factories(8, step_delay=0.0005), envs_per_worker=envs_per_worker,
                      env_threads=env_threads, backend="threading") as pool:
        assert pool.backend == "threading" and pool.idle_poll is False
        assert pool.worker_pids == [None] * pool.num_workers
        assert _children() == before  # nothing was forked or spawned
        names = {t.name for t in threading.enumerate()}
        assert {f"torchrl_asyncpool-worker-{w}" for w in range(pool.num_workers)} <= names
        for _ in range(300):
            td = pool.recv(min_get=1)
            checker.observe_batch(td)
            pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
    assert checker.records >= 300 and checker.episodes_done > 8
    # the workers' threads are gone with the pool
    deadline = time.monotonic() + 10
    while any(t.name.startswith("torchrl_asyncpool-worker") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "worker threads outlived close()"
        time.sleep(0.01)
    assert time.monotonic() - t0 < 60


def test_threading_pool_reports_env_errors_by_env():
    with AsyncEnvPool(oracle_factories(2, fail_at_step=3), backend="threading") as pool:
        with pytest.raises(EnvError, match="env [01]") as info:
            for _ in range(50):
                td = pool.recv(min_get=1, timeout=10)
                pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
        assert "RuntimeError" in str(info.value)


def test_threading_backend_takes_unpicklable_factories_and_refuses_idle_poll():
    made = []

    def factory(i=0):  # a closure over local state: the process backend would have to pickle it
        env = OracleEnv(env_id=len(made))
        made.append(env)
        return env

    with AsyncEnvPool([factory] * 3, backend="threading") as pool:
        assert pool.recv(min_get=3).batch_size == (3,)
    assert len(made) == 4  # the spec env and one per slot, all in this process
    with pytest.raises(ValueError, match="backend must be one of"):
        AsyncEnvPool(oracle_factories(1), backend="ray")
    with pytest.raises(ValueError, match="idle_poll=True"):
        AsyncEnvPool(oracle_factories(1), backend="threading", idle_poll=True)


@pytest.mark.parametrize("backend_kw", [{"env_backend": "threading"}, {"backend": "threading"}])
def test_threading_collector_is_exact_and_starts_without_processes(backend_kw, dev_shm_guard):
    checker = OracleChecker()
    before = _children()
    c = AsyncPoolCollector(oracle_factories(6), policy=oracle_policy, frames_per_batch=40, total_frames=200,
                           **backend_kw)
    try:
        assert c.env_backend == "threading" and c.server_backend == "thread"
        assert _children() == before
        assert all(w.is_alive() for w in c._workers) and c._workers
        sizes = []
        for batch in c:
            sizes.append(batch.shape[0])
            checker.observe_transitions(batch)
        assert sizes == [40] * 5 and checker.records == 200
    finally:
        c.shutdown()
    assert c._workers == []


def test_threading_collector_with_policy_factory_serves_from_this_process():
    before = _children()
    c = AsyncPoolCollector(oracle_factories(2), policy_factory=lambda: oracle_policy, frames_per_batch=10,
                           total_frames=20, env_backend="threading")
    try:
        assert c.server_backend == "thread" and _children() == before
        assert sum(b.numel() for b in c) == 20
    finally:
        c.shutdown()


def test_env_backend_keywords_follow_torchrl():
    kw = dict(policy=oracle_policy, frames_per_batch=4)
    with pytest.raises(ValueError, match="env_backend='monarch' is not supported"):
        AsyncPoolCollector(oracle_factories(1), backend="monarch", **kw)
    with pytest.raises(ValueError, match="env_exchange='shm' requires env_backend='multiprocessing'"):
        AsyncPoolCollector(oracle_factories(1), env_backend="threading", env_exchange="shm", **kw)
    with pytest.raises(ValueError, match="worker_affinity is only supported with env_backend='multiprocessing'"):
        AsyncPoolCollector(oracle_factories(1), env_backend="threading", worker_affinity=[[0]], **kw)
    with pytest.raises(ValueError, match="transport must be"):
        AsyncPoolCollector(oracle_factories(1), transport="bogus", **kw)
    # transport="driver": the policy is served from this process, also with policy_factory
    c = AsyncPoolCollector(oracle_factories(1), policy_factory=lambda: oracle_policy, frames_per_batch=4,
                           total_frames=4, transport="driver")
    try:
        assert c.server_backend == "thread" and c.env_backend == "multiprocessing"
        assert next(iter(c)).shape == (4,)
    finally:
        c.shutdown()


# -- construction errors, repr, stats -------------------------------------------------------------
def test_policy_arguments_raise_torchrl_type_errors_that_are_also_value_errors():
    for kwargs, match in (({"policy": oracle_policy, "policy_factory": lambda: oracle_policy}, "mutually exclusive"),
                          ({}, "must be provided")):
        for cls in (AsyncBatchedCollector, AsyncPoolCollector):
            with pytest.raises(TypeError, match=match):
                cls(create_env_fn=oracle_factories(1), frames_per_batch=4, env_backend="threading", **kwargs)
        with pytest.raises(ValueError, match=match):
            AsyncPoolCollector(oracle_factories(1), frames_per_batch=4, **kwargs)


def test_repr_of_a_collector_whose_construction_failed():
    c = AsyncPoolCollector.__new__(AsyncPoolCollector)
    with pytest.raises(TypeError):
        c.__init__(oracle_factories(1), frames_per_batch=4)  # neither policy nor policy_factory
    assert repr(c).startswith("AsyncPoolCollector(") and "not started" in repr(c)
    c = AsyncPoolCollector.__new__(AsyncPoolCollector)
    with pytest.raises(ValueError):
        c.__init__(oracle_factories(2), policy=oracle_policy, frames_per_batch=0)
    assert "num_envs=2" in repr(c)


def test_server_stats_hold_torchrl_keys_with_torchrl_meaning():
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=32, total_frames=64,
                           env_backend="threading")
    try:
        for _ in c:
            pass
        stats = c.server_stats()
        assert TORCHRL_STAT_KEYS <= set(stats)
        assert {"frames", "mean_batch_size", "queueing_time_s", "inference_time_s"} <= set(stats)  # ours stay
        assert stats["requests"] == stats["frames"] >= 64
        assert stats["avg_batch_size"] == pytest.approx(stats["requests"] / stats["batches"])
        assert stats["requests_per_s"] > 0 and stats["policy_version"] == 0
        assert 0 <= stats["p50_queue_ms"] <= stats["p95_queue_ms"]
        assert 0 < stats["p50_forward_ms"] <= stats["p95_forward_ms"]
        # the envs keep stepping after the last batch (until shutdown) and the server keeps
        # answering them: paused, it answers nothing, so the window restarted stays empty (a
        # batch whose call ended as the pause began is recorded within microseconds: the sleep)
        with c.pause():
            c.update_policy_weights_()
            time.sleep(0.05)
            assert c.server_stats(reset=True)["policy_version"] == 1
            after = c.server_stats()
        assert after["requests"] == 0 and after["p95_forward_ms"] == 0.0  # the window restarted
    finally:
        c.shutdown()


def test_a_killed_server_process_says_the_inference_server_died_and_stops_the_workers():
    from torchrl.modules.inference_server import InferenceServerConfig

    c = AsyncPoolCollector(oracle_factories(2), policy_factory=lambda: oracle_policy, frames_per_batch=10,
                           env_backend="threading", server_config=InferenceServerConfig(service_backend="process"))
    it = iter(c)
    try:
        next(it)
        workers = list(c._workers)
        assert workers and c._server._process is not None
        c._server._process.kill()
        with pytest.raises(RuntimeError, match="inference server died"):
            for _ in range(100):
                next(it)
        for w in workers:
            w.join(10)
        assert not any(w.is_alive() for w in workers)
    finally:
        c.shutdown(timeout=0.5)


# -- actions --------------------------------------------------------------------------------------
def _cartpole():
    import gymnasium as gym

    return gym.make("CartPole-v1")


def _fill(value, dtype=None):
    def policy(td):
        return td.set("action", torch.full(td.batch_size, value, dtype=dtype))
    return policy


@pytest.mark.parametrize("backend", ["threading", "multiprocessing"])
@pytest.mark.parametrize("policy,match", [
    (_fill(0.7), r"'action' is torch.float32 with fractional values .*Categorical.*torch.int64"),
    (_fill(float("nan")), "NaN or infinite"),
    (_fill(2, torch.int64), r"outside the Categorical spec: .*0 <= action < 2"),
    (_fill(-1, torch.int32), r"outside the Categorical spec"),
])
def test_bad_actions_are_refused_at_construction(backend, policy, match):
    with pytest.raises(ValueError, match=match) as info:
        AsyncPoolCollector([_cartpole] * 2, policy=policy, frames_per_batch=8, env_backend=backend)
    assert "policy 'policy'" in str(info.value)


def test_a_bad_action_at_run_time_names_the_env():
    def nan_for_env_1(td):
        action = torch.zeros(td.batch_size)
        action[td["env_index"] == 1] = float("inf")
        return td.set("action", action)

    c = AsyncPoolCollector([_cartpole] * 3, policy=nan_for_env_1, frames_per_batch=8, env_backend="threading")
    try:
        with pytest.raises(InferenceServerError, match=r"\[envs \[1\]\].*NaN or infinite"):
            for _ in range(20):
                next(iter(c))
    finally:
        c.shutdown()


def test_whole_number_actions_are_cast_and_cast_actions_opts_into_truncation():
    c = AsyncPoolCollector([_cartpole] * 2, policy=_fill(1.0), frames_per_batch=8, total_frames=8,
                           env_backend="threading")
    try:
        batch = next(iter(c))
        assert batch["action"].dtype == torch.int64 and batch["action"].eq(1).all()
    finally:
        c.shutdown()
    c = AsyncPoolCollector([_cartpole] * 2, policy=_fill(0.7), frames_per_batch=8, total_frames=8,
                           env_backend="threading", cast_actions=True)
    try:
        assert next(iter(c))["action"].eq(0).all()  # Tensor.to's truncation, asked for
    finally:
        c.shutdown()
    with pytest.raises(ValueError, match="NaN"):  # never cast
        AsyncPoolCollector([_cartpole] * 2, policy=_fill(float("nan")), frames_per_batch=8, cast_actions=True)
    with pytest.raises(TypeError, match="cast_actions must be a bool"):
        AsyncPoolCollector([_cartpole] * 2, policy=_fill(1), frames_per_batch=8, cast_actions="yes")


def test_bounds_check_can_be_turned_off_and_integer_casts_must_fit():
    from torchrl.testing.mocking_classes import CountingEnv

    # TorchRL's CountingEnv: int32 observations, an int8 Binary action; an int32 policy output is cast
    def ones(td):
        return td.set("action", torch.ones_like(td["observation"]))

    c = AsyncPoolCollector([CountingEnv] * 2, policy=ones, frames_per_batch=6, total_frames=6, env_backend="threading")
    try:
        batch = next(iter(c))
        assert batch["action"].dtype == torch.int8 and batch["action"].eq(1).all()
    finally:
        c.shutdown()

    def twos(td):
        return td.set("action", torch.full_like(td["observation"], 2))

    with pytest.raises(ValueError, match="outside the Binary spec"):
        AsyncPoolCollector([CountingEnv] * 2, policy=twos, frames_per_batch=6, env_backend="threading")
    c = AsyncPoolCollector([CountingEnv] * 2, policy=twos, frames_per_batch=6, total_frames=6, env_backend="threading",
                           check_action_bounds=False)
    c.shutdown()


def test_start_after_shutdown_says_the_collector_was_shut_down():
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = AsyncPoolCollector(oracle_factories(2), policy=oracle_policy, frames_per_batch=8, total_frames=16,
                           replay_buffer=rb, env_backend="threading")
    c.start()
    c.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        c.start()


def test_a_worker_thread_stuck_in_a_step_is_reported_and_left_behind_at_close():
    import warnings

    gate = threading.Event()

    class Stuck(OracleEnv):
        def _step(self, td):
            gate.wait(30)  # until the test lets it go
            return super()._step(td)

    pool = AsyncEnvPool([Stuck], backend="threading")
    td = pool.recv(min_get=1)
    pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
    time.sleep(0.1)  # the worker thread is inside the step now
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool.close(timeout=0.2)
    assert time.monotonic() - t0 < 10  # no hang: the bound plus a margin
    assert any("did not stop within 0.2s" in str(w.message) for w in caught)
    gate.set()  # the step returns, the thread sees the closed life pipe and ends
    deadline = time.monotonic() + 10
    while any(t.name == "torchrl_asyncpool-worker-0" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
