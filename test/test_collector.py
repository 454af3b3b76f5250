"""AsyncPoolCollector: exactly-once, in-order delivery through iteration, replay buffers and start()."""
import time

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import AsyncBatchedCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer

from conftest import oracle_factories
from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.testing import OracleChecker, oracle_action


def oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def test_is_an_async_batched_collector_and_iterates_exactly(dev_shm_guard):
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_factories(8), policy=oracle_policy, frames_per_batch=50, total_frames=230,
                           envs_per_worker=4, transition_chunk_size=7)
    try:
        assert isinstance(c, AsyncBatchedCollector)
        sizes = []
        for batch in c:
            sizes.append(batch.shape[0])
            checker.observe_transitions(batch)
            assert batch["policy_version"].eq(0).all()
            assert ("next", "done") in batch.keys(True) and ("next", "terminated") in batch.keys(True)
        assert sizes == [50, 50, 50, 50, 30]  # the total frame count is exact
        assert checker.records == 230
    finally:
        c.shutdown()


def test_replay_buffer_iteration_yields_none_and_writes_everything():
    checker = OracleChecker()
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=40, total_frames=200,
                           replay_buffer=rb, transition_chunk_size=5)
    try:
        assert all(b is None for b in c)
        assert len(rb) == 200
        checker.observe_transitions(rb[:200])  # storage order = delivery order
    finally:
        c.shutdown()


def test_start_fills_replay_buffer_in_background():
    checker = OracleChecker()
    rb = ReplayBuffer(storage=LazyTensorStorage(2000))
    c = AsyncPoolCollector(oracle_factories(4), policy=oracle_policy, frames_per_batch=32, total_frames=320,
                           replay_buffer=rb, transition_chunk_size=8)
    try:
        c.start()
        deadline = time.monotonic() + 60
        while len(rb) < 320 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(rb) == 320
        checker.observe_transitions(rb[:320])
    finally:
        c.shutdown()


def test_yield_completed_trajectories():
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_factories(3), policy=oracle_policy, frames_per_batch=16, total_frames=60,
                           yield_completed_trajectories=True, transition_chunk_size=4)
    try:
        n = 0
        for traj in c:
            assert traj["next", "done"][-1].all() and not traj["next", "done"][:-1].any()
            assert traj["env_index"].unique().numel() == 1
            assert traj["tag"][0, 2] == 0  # starts an episode
            n += traj.shape[0]
        assert n >= 60
    finally:
        c.shutdown()


def test_weight_update_bumps_stamped_version():
    policy = torch.nn.Linear(2, 1)

    def act(td):
        score = policy(td["observation"])
        return td.set("action", oracle_action(td["tag"])).set("score", score)

    c = AsyncPoolCollector(oracle_factories(2), policy=act, frames_per_batch=20, total_frames=200, transition_chunk_size=2)
    try:
        it = iter(c)
        first = next(it)
        assert first["policy_version"].eq(0).all()
        assert first["score"].shape == (20, 1)
        c.update_policy_weights_()
        assert c.policy_version == 1
        seen = set()
        for _ in range(5):
            seen |= set(next(it)["policy_version"].tolist())
        assert 1 in seen
    finally:
        c.shutdown()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="env_backend"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, env_backend="threading")
    with pytest.raises(ValueError, match="unknown keyword"):
        AsyncPoolCollector(oracle_factories(1), policy=oracle_policy, frames_per_batch=4, no_such_option=1)
    with pytest.raises(ValueError, match="exactly one"):
        AsyncPoolCollector(oracle_factories(1), frames_per_batch=4)
    with pytest.raises(ValueError, match="action key"):
        AsyncPoolCollector(oracle_factories(1), policy=lambda td: td, frames_per_batch=4)


def test_torchrl_docstring_example_runs_unchanged():
    """TorchRL's first AsyncBatchedCollector example, with the class swapped."""
    import torch.nn as nn
    from tensordict.nn import TensorDictModule
    from torchrl.envs import GymEnv

    policy = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])
    collector = AsyncPoolCollector(
        create_env_fn=[lambda: GymEnv("CartPole-v1")] * 4,
        policy=policy,
        frames_per_batch=200,
        total_frames=1000,
        env_backend="multiprocessing",
    )
    for batch in collector:
        assert batch.shape == (200,)
        break
    collector.shutdown()


def test_process_server_with_policy_factory_and_weight_update():
    """policy_factory= serves from a dedicated process; weights travel without a restart."""
    from torchrl_asyncpool.inference.examples import OracleTagPolicy

    c = AsyncPoolCollector(oracle_factories(4), policy_factory=OracleTagPolicy, frames_per_batch=16,
                           total_frames=400, envs_per_worker=2, transition_chunk_size=4)
    try:
        assert c.server_backend == "process"
        checker = OracleChecker()
        it = iter(c)
        checker.observe_transitions(next(it))
        c.update_policy_weights_(OracleTagPolicy(offset=0))
        seen = set()
        for batch in it:
            checker.observe_transitions(batch)
            seen |= set(batch["policy_version"].tolist())
        assert 1 in seen and checker.records == 400
    finally:
        c.shutdown()


def test_pause_keeps_the_policy_idle():
    calls = {"n": 0}

    def counting(td):
        calls["n"] += 1
        return oracle_policy(td)

    c = AsyncPoolCollector(oracle_factories(2), policy=counting, frames_per_batch=8, transition_chunk_size=2)
    try:
        it = iter(c)
        next(it)
        with c.pause():
            n = calls["n"]
            time.sleep(0.3)
            assert calls["n"] == n
        next(it)
        assert calls["n"] > n
    finally:
        c.shutdown()
