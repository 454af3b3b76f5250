"""Exactly-once, in-order delivery through AsyncEnvPool, proven with the oracle env."""
import os
import time

import pytest
import torch
from tensordict import TensorDict

from conftest import oracle_factories, thread_names
from torchrl_asyncpool import AsyncEnvPool, StepType
from torchrl_asyncpool.testing import OracleChecker, oracle_action


def _drive(pool, checker, steps, min_get=1, max_get=None, timeout=None):
    for _ in range(steps):
        td = pool.recv(min_get=min_get, max_get=max_get, timeout=timeout)
        checker.observe_batch(td)
        b = td.batch_size[0]
        assert td.env_indices.shape == (b,)
        assert torch.equal(td.env_indices, td["env_index"])
        pool.send(TensorDict({"action": oracle_action(td["tag"])}, [b]), td.env_indices)


@pytest.mark.parametrize(
    "num_envs,envs_per_worker,env_threads",
    [(1, 1, False), (8, 1, False), (8, 4, False), (8, 4, True), (32, 4, False), (32, 8, True),
     pytest.param(32, 1, False, marks=pytest.mark.slow)],
)
def test_oracle_exactly_once_in_order(num_envs, envs_per_worker, env_threads, dev_shm_guard):
    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(num_envs), envs_per_worker=envs_per_worker, env_threads=env_threads) as pool:
        assert pool.num_workers == -(-num_envs // envs_per_worker)
        assert pool.env_threads is env_threads
        _drive(pool, checker, steps=300)
    assert checker.records >= 300
    # every env made progress through several episodes, both ending kinds were exercised
    assert len({checker.last_step(i) for i in range(num_envs)}) == num_envs
    assert checker.episodes_done > num_envs


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (4, False), (4, True)])
def test_oracle_with_jittered_slow_envs_and_batching(envs_per_worker, env_threads):
    """Envs drift apart (per-step delays), batches are capped and deadline-bound."""
    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(8, step_delay=0.002), envs_per_worker=envs_per_worker,
                      env_threads=env_threads) as pool:
        assert pool.env_threads is env_threads
        _drive(pool, checker, steps=120, min_get=2, max_get=4, timeout=0.05)
    assert checker.records >= 240


def test_terminal_action_is_discarded_and_next_is_first():
    """The action answering a terminal record never reaches the env; FIRST has reward 0."""
    with AsyncEnvPool(oracle_factories(1)) as pool:
        td = pool.recv()
        assert td["step_type"].tolist() == [StepType.FIRST]
        assert td["reward"].tolist() == [[0.0]]
        # env 0's first episode has length 1 and is truncated (see oracle_episode)
        pool.send(TensorDict({"action": torch.tensor([5])}, [1]), td.env_indices)
        td = pool.recv()
        assert td["step_type"].tolist() == [StepType.TRUNCATION]
        assert td["echo"].tolist() == [5]
        assert td["truncated"].all() and td["done"].all() and not td["terminated"].any()
        assert td["tag"].tolist() == [[0, 0, 1]]
        pool.send(TensorDict({"action": torch.tensor([777])}, [1]), td.env_indices)
        td = pool.recv()
        assert td["step_type"].tolist() == [StepType.FIRST]
        assert td["echo"].tolist() == [-1], "the action sent for the terminal record reached the env"
        assert td["tag"].tolist() == [[0, 1, 0]]
        assert not td["done"].any()


def test_recv_semantics_min_max_timeout():
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2) as pool:
        # wait for all four FIRST records
        td = pool.recv(min_get=4)
        assert sorted(td.env_indices.tolist()) == [0, 1, 2, 3]
        # nothing is ready: a poll raises TimeoutError at once, a deadline raises after it
        with pytest.raises(TimeoutError):
            pool.recv(timeout=0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            pool.recv(min_get=1, timeout=0.2)
        assert time.monotonic() - t0 >= 0.19
        # answer all; max_get caps the batch and the rest stays ready
        pool.send(TensorDict({"action": torch.zeros(4, dtype=torch.int64)}, [4]), td.env_indices)
        got = pool.recv(min_get=2, max_get=2, timeout=5.0)
        assert got.batch_size[0] == 2
        first = got.env_indices.clone()
        rest = pool.recv(min_get=2, max_get=2, timeout=5.0)
        assert set(first.tolist()) | set(rest.env_indices.tolist()) == {0, 1, 2, 3}


def test_recv_returns_at_deadline_with_partial_batch():
    """Once min_get is met, the deadline ends the call with what is ready."""
    with AsyncEnvPool(oracle_factories(2, step_delay=0.5), envs_per_worker=1) as pool:
        td = pool.recv(min_get=2)
        # env 0 steps instantly (delay factor 0 at t=0, episode 0), env 1 is slow
        pool.send(TensorDict({"action": torch.zeros(2, dtype=torch.int64)}, [2]), td.env_indices)
        t0 = time.monotonic()
        td = pool.recv(min_get=1, max_get=2, timeout=0.2)
        elapsed = time.monotonic() - t0
        assert td.batch_size[0] == 1 and td.env_indices.tolist() == [0]
        assert 0.15 <= elapsed < 2.0


def test_wait_ready_counts_without_leasing():
    with AsyncEnvPool(oracle_factories(3), envs_per_worker=1) as pool:
        assert pool.wait_ready(3) == 3  # the three FIRST records
        assert pool.wait_ready(1, timeout=0) == 3  # still there: nothing was leased
        td = pool.recv(min_get=3)
        t0 = time.monotonic()
        assert pool.wait_ready(1, timeout=0.2) == 0  # all leased: times out, returns the count
        assert 0.15 <= time.monotonic() - t0 < 5.0
        pool.send(TensorDict({"action": torch.zeros(3, dtype=torch.int64)}, [3]), td.env_indices)
        assert pool.wait_ready(3, timeout=10) == 3
        for bad in (0, 4, True, 1.0):
            with pytest.raises(ValueError, match="count"):
                pool.wait_ready(bad)
        with pytest.raises(ValueError, match="timeout"):
            pool.wait_ready(1, timeout=-1)


def test_received_batch_is_not_overwritten_by_workers():
    """Data handed out stays put while workers step again (staging, not slot views)."""
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2) as pool:
        td = pool.recv(min_get=2)
        keep = td["tag"].clone()
        pool.send(TensorDict({"action": torch.zeros(2, dtype=torch.int64)}, [2]), td.env_indices)
        assert pool.wait_ready(2, timeout=30) == 2  # both workers have written their next records
        assert torch.equal(td["tag"], keep)
        # ... into the same slots, with new tags (so a view of the slots would have changed)
        nxt = pool.recv(min_get=2)
        order, nxt_order = td.env_indices.argsort(), nxt.env_indices.argsort()
        assert not torch.equal(nxt["tag"][nxt_order], keep[order])
        pool.send(TensorDict({"action": torch.zeros(2, dtype=torch.int64)}, [2]), nxt.env_indices)


def test_metrics_keys_and_values():
    from torchrl_asyncpool.exchange.metrics import METRIC_KEYS

    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2) as pool:
        _drive(pool, checker, steps=50)
        m = pool.metrics(reset=True)
        # every key always, but env_restarts and worker_restarts (with restarts only) and one
        # slots_<path> per path in use
        assert set(m) == (set(METRIC_KEYS) - {"env_restarts", "worker_restarts", "slots_<path>"}) | {"slots_torchrl"}
        assert m["slots_torchrl"] == 4
        assert (m["num_workers"], m["envs_per_worker"], m["env_threads"]) == (2, 2, 0) and m["idle_poll"] in (0, 1)
        assert m["frames"] == checker.records
        assert m["batches"] == 50
        assert 0 < m["batch_fill_ratio"] <= 1
        assert 0 <= m["partial_batch_fraction"] <= 1
        assert m["fps"] > 0 and m["env_steps"] > 0 and m["env_step_time_s"] > 0
        assert 0 <= m["consumer_busy_fraction"] <= 1
        assert m["obs_to_batch_dwell_s"] >= 0 and m["batch_to_action_dwell_s"] >= 0
        assert pool.metrics()["frames"] == 0  # reset started a new window


def test_auto_envs_per_worker_groups_cheap_envs():
    from torchrl_asyncpool.testing import SleepPixelEnv, ZeroLatencyEnv

    with AsyncEnvPool([ZeroLatencyEnv] * 8, envs_per_worker="auto") as pool:
        assert pool.envs_per_worker > 1
    # blocking envs: about two workers per core, their envs stepped in threads
    cores = len(os.sched_getaffinity(0))
    n = 8 * cores
    with AsyncEnvPool([lambda: SleepPixelEnv(step_s=0.005)] * n, envs_per_worker="auto") as pool:
        assert (pool.envs_per_worker, pool.env_threads, pool.num_workers) == (4, True, 2 * cores)
    # ... or, without threads, a process each
    with AsyncEnvPool([lambda: SleepPixelEnv(step_s=0.005)] * 4, envs_per_worker="auto", env_threads=False) as pool:
        assert (pool.envs_per_worker, pool.env_threads) == (1, False)
    # an explicit grouping is not probed: "auto" threads nothing there
    with AsyncEnvPool([lambda: SleepPixelEnv(step_s=0.005)] * 4, envs_per_worker=2) as pool:
        assert pool.env_threads is False


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="list of callables"):
        AsyncEnvPool(lambda: None)
    with pytest.raises(ValueError, match="envs_per_worker"):
        AsyncEnvPool(oracle_factories(2), envs_per_worker=0)
    with pytest.raises(ValueError, match="env_threads must be True, False or 'auto', got 'yes'"):
        AsyncEnvPool(oracle_factories(2), env_threads="yes")
    with pytest.raises(ValueError, match="create_env_kwargs"):
        AsyncEnvPool(oracle_factories(2), create_env_kwargs=[{}])
    with pytest.raises(ValueError, match="mp_start_method"):
        AsyncEnvPool(oracle_factories(2), mp_start_method="fork")


@pytest.mark.parametrize("envs_per_worker,env_threads", [(1, False), (2, False), (2, True)])
def test_recurrent_state_is_carried_and_reset_on_first(envs_per_worker, env_threads):
    """hidden_out = hidden_in + 1, so hidden_in must equal the step id inside the episode."""
    checker = OracleChecker()
    with AsyncEnvPool(
        oracle_factories(4),
        envs_per_worker=envs_per_worker, env_threads=env_threads,
        policy_output_spec={"hidden_out": ((3,), torch.float32), "logp": ((), torch.float32)},
        recurrent_state={"hidden_in": "hidden_out"},
    ) as pool:
        assert pool.policy_output_keys == ["hidden_out", "logp"]
        for _ in range(200):
            td = pool.recv()
            checker.observe_batch(td)
            steps = td["tag"][:, 2].float()
            assert torch.equal(td["hidden_in"], steps[:, None].expand(-1, 3)), (td["tag"], td["hidden_in"])
            b = td.batch_size[0]
            pool.send(
                TensorDict(
                    {"action": oracle_action(td["tag"]), "hidden_out": td["hidden_in"] + 1, "logp": torch.zeros(b)}, [b]
                ),
                td.env_indices,
            )


def test_policy_outputs_are_required_in_send_and_recurrent_keys_validated():
    with pytest.raises(ValueError, match="not declared in policy_output_spec"):
        AsyncEnvPool(oracle_factories(1), recurrent_state={"h_in": "h_out"})
    with AsyncEnvPool(oracle_factories(1), policy_output_spec={"logp": ((), torch.float32)}) as pool:
        td = pool.recv()
        with pytest.raises(ValueError, match="logp"):
            pool.send(TensorDict({"action": torch.zeros(1, dtype=torch.int64)}, [1]), td.env_indices)
        pool.send(
            TensorDict({"action": torch.zeros(1, dtype=torch.int64), "logp": torch.zeros(1)}, [1]), td.env_indices
        )
        assert pool.recv()["tag"].tolist() == [[0, 0, 1]]


def test_send_takes_nested_and_flat_tuple_key_mappings():
    spec = {("agent", "logp"): ((), torch.float32)}
    with AsyncEnvPool(oracle_factories(1), policy_output_spec=spec) as pool:
        td = pool.recv()
        action = torch.zeros(1, dtype=torch.int64)

        def follows(before, after):  # the next step of the episode, or the next episode's first
            env, episode, step = before
            return after in ([env, episode, step + 1], [env, episode + 1, 0])

        for answer in ({"action": action, "agent": {"logp": torch.full((1,), 0.5)}},
                       {"action": action, ("agent", "logp"): torch.full((1,), 0.25)}):
            before = td["tag"][0].tolist()
            pool.send(answer, td.env_indices)
            td = pool.recv()
            assert follows(before, td["tag"][0].tolist()), (before, td["tag"][0].tolist())
        with pytest.raises(ValueError, match=r"miss the key \('agent', 'logp'\)"):
            pool.send({"action": action, "logp": torch.zeros(1)}, td.env_indices)
        pool.send({"action": action, ("agent", "logp"): torch.zeros(1)}, td.env_indices)  # still leased


def test_a_policy_output_in_place_of_the_next_observation_is_refused_with_transitions():
    """``("next", "echo")`` is where a transition holds the env's next ``echo``: as a policy
    output it would silently replace it, so a pool that delivers transitions refuses it, also
    declared as a recurrent state (the env's observation is still the env's); only TorchRL's
    primer convention as the collector maps it is delivered in the entry's place."""
    from torchrl_asyncpool.collector.acting_policy import CARRY_KEY

    spec = {("next", "echo"): ((), torch.int64)}
    refused = r"\('next', 'echo'\) is where the transitions hold the env's own next 'echo'; rename the output"
    with pytest.raises(ValueError, match=refused):
        AsyncEnvPool(oracle_factories(1), policy_output_spec=spec, transition_chunk_size=4)
    with pytest.raises(ValueError, match=refused):
        AsyncEnvPool(oracle_factories(1), policy_output_spec=spec, recurrent_state={"h": ("next", "echo")},
                     transition_chunk_size=4)
    with pytest.raises(ValueError, match=r"the env's own next 'reward'"):
        AsyncEnvPool(oracle_factories(1), policy_output_spec={("next", "reward"): ((1,), torch.float32)},
                     transition_chunk_size=4)
    # without transitions the output is a field like any other
    with AsyncEnvPool(oracle_factories(1), policy_output_spec=spec) as pool:
        assert ("next", "echo") in pool.policy_output_keys
    AsyncEnvPool(oracle_factories(1), policy_output_spec=spec, recurrent_state={(CARRY_KEY, "echo"): ("next", "echo")},
                 transition_chunk_size=4).close()


@pytest.mark.parametrize("env_threads", [False, True])
@pytest.mark.parametrize("idle_poll", [True, False])
def test_idle_poll_reaches_the_workers_and_delivery_stays_exactly_once(idle_poll, env_threads):
    from torchrl_asyncpool.exchange import doorbell

    if doorbell._c is None:
        pytest.skip("idle polling is in the C extension")
    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(4), envs_per_worker=2, env_threads=env_threads, idle_poll=idle_poll) as pool:
        assert pool.idle_poll is idle_poll
        _drive(pool, checker, steps=200)
        assert pool.consumer_handle().idle_poll is idle_poll  # what a serving loop follows
        # a worker that idle-polls has started its poller thread at its first blocking wait
        for pid in pool.worker_pids:
            assert ("asyncpool-idle" in thread_names(pid)) is idle_poll, thread_names(pid)
    assert checker.records >= 200 and checker.episodes_done > 4


def test_idle_poll_auto_is_off_for_threaded_workers_and_bad_values_are_refused(monkeypatch):
    from torchrl_asyncpool.exchange import doorbell

    monkeypatch.delenv(doorbell.IDLE_POLL_ENV, raising=False)
    with AsyncEnvPool(oracle_factories(2), envs_per_worker=2, env_threads=True) as pool:
        assert pool.idle_poll is False
    with pytest.raises(ValueError, match="idle_poll must be True, False or 'auto', got 1"):
        AsyncEnvPool(oracle_factories(1), idle_poll=1)
