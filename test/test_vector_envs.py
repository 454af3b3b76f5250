"""Factories returning vector envs: k slots per vector env, stepped in lockstep.

The oracle runs inside ``gymnasium.vector.SyncVectorEnv`` (NEXT_STEP autoreset, gymnasium's
default) and inside TorchRL's ``SerialEnv`` (a batched ``EnvBase``, reset by partial resets),
so every record and transition is checked for loss, duplication, order, step type, autoreset
pairing and action routing, as for single envs.
"""
import functools
import os
import re
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase, SerialEnv

from conftest import start_and_check
from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector, EnvError, WorkerDiedError
from torchrl_asyncpool.testing import OracleChecker, OracleEnv, OracleGymEnv, oracle_action


def oracle_vector(base, k, **kwargs):
    """A vector env of the oracle envs ``base .. base + k - 1`` (ids equal slot indices)."""
    return gym.vector.SyncVectorEnv([functools.partial(OracleGymEnv, env_id=base + j, **kwargs) for j in range(k)])


def oracle_serial(base, k, **kwargs):
    """The same as a TorchRL batched env (``batch_size=[k]``)."""
    return SerialEnv(k, [functools.partial(OracleEnv, env_id=base + j, **kwargs) for j in range(k)])


def oracle_vectors(num_vectors, k, kind="gym", **kwargs):
    make = oracle_vector if kind == "gym" else oracle_serial
    return [functools.partial(make, f * k, k, **kwargs) for f in range(num_vectors)]


KINDS = ["gym", "torchrl"]


def oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 4])
def test_pool_records_pass_the_oracle(k, kind, dev_shm_guard):
    checker = OracleChecker()
    with AsyncEnvPool(oracle_vectors(2, k, kind)) as pool:
        assert (pool.num_envs, pool.num_workers, pool.envs_per_factory) == (2 * k, 2, k)
        for _ in range(150):
            td = pool.recv(min_get=1)
            checker.observe_batch(td)
            actions = oracle_action(td["tag"])
            pool.send(TensorDict({"action": actions}, td.batch_size), td.env_indices)
    # a TorchRL batched env spends a pass on each partial reset, publishing only the reset envs
    assert checker.records >= 150 * (k if kind == "gym" else 1)
    assert checker.episodes_done >= 10 * k


@pytest.mark.parametrize("kind", KINDS)
def test_recurrent_state_is_carried_and_reset_on_first(kind):
    """hidden_out = hidden_in + 1, so hidden_in must equal the step id inside the episode."""
    checker = OracleChecker()
    with AsyncEnvPool(oracle_vectors(2, 3, kind), policy_output_spec={"hidden_out": ((3,), torch.float32)},
                      recurrent_state={"hidden_in": "hidden_out"}) as pool:
        for _ in range(120):
            td = pool.recv()
            checker.observe_batch(td)
            steps = td["tag"][:, 2].float()
            assert torch.equal(td["hidden_in"], steps[:, None].expand(-1, 3)), (td["tag"], td["hidden_in"])
            pool.send(TensorDict({"action": oracle_action(td["tag"]), "hidden_out": td["hidden_in"] + 1},
                                 td.batch_size), td.env_indices)
    assert checker.episodes_done >= 20


@pytest.mark.parametrize("kind", KINDS)
def test_collector_transitions_pass_the_oracle(kind, dev_shm_guard):
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_vectors(3, 4, kind), policy=oracle_policy, frames_per_batch=50, total_frames=230,
                           transition_chunk_size=7)
    try:
        assert c.env.num_envs == 12
        sizes = []
        for batch in c:
            sizes.append(batch.shape[0])
            checker.observe_transitions(batch)
        assert sizes == [50, 50, 50, 50, 30]  # the total frame count is exact
        assert checker.records == 230
        assert len(checker._last_transition) == 12  # every env of every vector env delivered
    finally:
        c.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_start_fills_a_replay_buffer_with_small_inference_batches(kind):
    """The server leases at most 3 records at a time: a vector env of 4 still gets all its answers."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(2000))
    c = AsyncPoolCollector(oracle_vectors(2, 4, kind), policy=oracle_policy, frames_per_batch=32, total_frames=320,
                           replay_buffer=rb, transition_chunk_size=8, max_batch_size=3)
    start_and_check(c, rb, 320)


def test_cartpole_vector_env_transitions_follow_the_physics():
    """gymnasium's numpy-vectorized CartPole: each transition is replayed on a single CartPole."""

    class Alternate(torch.nn.Module):
        def forward(self, td):
            return td.set("action", (td["observation"][:, 2] > 0).long())  # push towards the pole

    make = functools.partial(gym.make_vec, "CartPole-v1", num_envs=8, vectorization_mode="vector_entry_point")
    c = AsyncPoolCollector([make] * 2, policy=Alternate(), frames_per_batch=256, total_frames=1024)
    sim = gym.make("CartPole-v1").unwrapped
    sim.reset(seed=0)
    try:
        n = 0
        for batch in c:
            obs, act, nxt = batch["observation"].numpy(), batch["action"].numpy(), batch["next", "observation"].numpy()
            for i in range(len(obs)):
                sim.state, sim.steps_beyond_terminated = obs[i].astype(np.float64), None
                expected, *_ = sim.step(int(act[i]))
                assert np.allclose(expected, nxt[i], atol=1e-4), f"transition {i} of env {int(batch['env_index'][i])}"
                n += 1
        assert n == 1024
    finally:
        c.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_an_env_raising_inside_a_vector_env_names_it(kind):
    with AsyncEnvPool(oracle_vectors(2, 3, kind, fail_at_step=4)) as pool:
        with pytest.raises(EnvError) as info:
            for _ in range(50):
                td = pool.recv(min_get=1)
                pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
    err = info.value
    assert err.phase == "step" and err.env_index in (0, 3), str(err)  # the vector env's first slot
    assert "scripted failure at step 4" in str(err)


def test_bad_vector_env_setups_raise_clear_errors():
    with pytest.raises(ValueError, match=r"envs_per_worker=2: the factories return vector envs .* of 4"):
        AsyncEnvPool(oracle_vectors(2, 4), envs_per_worker=2)
    with pytest.raises(ValueError, match="env_threads=True"):
        AsyncEnvPool(oracle_vectors(2, 4), env_threads=True)

    def same_step():
        return gym.vector.SyncVectorEnv([OracleGymEnv] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    with pytest.raises(ValueError, match="NEXT_STEP"):
        AsyncEnvPool([same_step])
    async_vec = functools.partial(gym.make_vec, "CartPole-v1", num_envs=2, vectorization_mode="async")
    with pytest.raises(TypeError, match="AsyncVectorEnv, which runs its envs in processes of its own"):
        AsyncEnvPool([async_vec])
    pytest.importorskip("ale_py")
    from ale_py.vector_env import AtariVectorEnv

    # ale-py's asynchronous mode: each step returns batch_size of the envs, and send() takes no env ids
    with pytest.raises(ValueError, match="returns 2 of its 4 envs per step"):
        AsyncEnvPool([functools.partial(AtariVectorEnv, "pong", 4, batch_size=2, num_threads=1)])
    # every factory must return the same number of envs, and the same kind of env
    with pytest.raises(EnvError, match="vector env of 2 envs; the pool expects 4"):
        AsyncEnvPool([functools.partial(oracle_vector, 0, 4), functools.partial(oracle_vector, 4, 2)])
    with pytest.raises(EnvError, match="returned a single env, but the first factory returned a gymnasium vector"):
        AsyncEnvPool([functools.partial(oracle_vector, 0, 2), functools.partial(OracleGymEnv, 2)])
    with pytest.raises(EnvError, match="returned a gymnasium vector env, but the first factory returned a single"):
        AsyncEnvPool([functools.partial(OracleGymEnv, 0), functools.partial(oracle_vector, 1, 2)],
                     envs_per_worker=2)


def test_a_killed_vector_env_worker_names_its_envs(dev_shm_guard):
    with AsyncEnvPool(oracle_vectors(2, 3)) as pool:
        pids = pool.worker_pids
        pool.recv(min_get=6)  # every env leased: only the death can end the next recv
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            pool.recv()
        assert time.monotonic() - t0 < 10.0  # prompt (generous bound: noisy machines)
        assert info.value.env_indices == (3, 4, 5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "workers not reaped after close()"


class _TwoD(EnvBase):
    """A batched TorchRL env with a 2-d batch size (only its specs matter here)."""

    def __init__(self):
        super().__init__(batch_size=torch.Size([2, 2]))
        self.observation_spec = Composite(observation=Unbounded(shape=(2, 2, 3)), shape=(2, 2))
        self.action_spec = Categorical(2, shape=(2, 2))
        self.reward_spec = Unbounded(shape=(2, 2, 1))

    def _reset(self, tensordict=None, **kwargs):
        raise NotImplementedError

    def _step(self, tensordict):
        raise NotImplementedError

    def _set_seed(self, seed):
        return seed


def test_a_batched_torchrl_env_must_have_a_1d_batch_size():
    with pytest.raises(ValueError, match=r"batch_size \(2, 2\).*1-d batch_size=\[k\]"):
        AsyncEnvPool([_TwoD])


@pytest.mark.parametrize("kind", KINDS)
def test_a_slow_learner_holds_back_vector_envs_without_loss(kind):
    """Two chunks of 4 per env and a learner that sleeps: workers wait on back-pressure."""
    checker = OracleChecker()
    c = AsyncPoolCollector(oracle_vectors(2, 4, kind), policy=oracle_policy, frames_per_batch=40, total_frames=200,
                           transition_chunk_size=4, chunks_per_env=2)
    try:
        for batch in c:
            checker.observe_transitions(batch)
            time.sleep(0.2)  # the envs fill their chunks meanwhile and must wait
        assert checker.records == 200
    finally:
        c.shutdown()


class _OneRowShort(gym.vector.VectorWrapper):
    """Its second step returns each observation entry for the first env only (``[1, ...]`` for
    ``[k, ...]``): numpy would have copied that row into all ``k`` slots."""

    def __init__(self, env):
        super().__init__(env)
        self.steps = 0

    def step(self, actions):
        obs, *rest = self.env.step(actions)
        self.steps += 1
        if self.steps == 2:
            obs = {key: value[:1] for key, value in obs.items()}
        return (obs, *rest)


def test_a_vector_env_observation_of_another_shape_is_its_error():
    factories = [lambda: _OneRowShort(oracle_vector(0, 3))]
    with AsyncEnvPool(factories) as pool:
        with pytest.raises(EnvError) as info:
            for _ in range(20):
                td = pool.recv(min_get=3, timeout=30)
                pool.send(TensorDict({"action": oracle_action(td["tag"])}, td.batch_size), td.env_indices)
    err = info.value
    assert err.phase == "step" and err.env_index == 0, str(err)
    assert re.search(r"the env returned '\w+' of shape \(1,?\) and dtype \w+ where its observation spec declares "
                     r"shape \(3,?", str(err)), str(err)
