"""The plan follows the workload: the flush deadline and the default CPU partition are decided
from the env step the workers measure while running (tests assert the decision, not a speed)."""
import os
import threading
import time

import pytest
import torch

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.collector.workload_plan import PIN_STEP_S, UNPIN_STEP_S, AffinityPlan
from torchrl_asyncpool.inference import auto_flush_timeout
from torchrl_asyncpool.testing import OracleEnv, oracle_action

CPUS = sorted(os.sched_getaffinity(0))


def test_the_flush_deadline_follows_the_env_step():
    assert auto_flush_timeout(12e-6) == 0.0  # CartPole: greedy
    assert auto_flush_timeout(130e-6) == 0.0  # a TorchRL-wrapped cheap env: greedy
    assert auto_flush_timeout(1.3e-3) == pytest.approx(0.25 * 1.3e-3)  # Atari through gymnasium
    assert auto_flush_timeout(1.3e-3, 8) == pytest.approx(0.25 * 8 * 1.3e-3)  # 8 envs a worker steps in turn
    assert auto_flush_timeout(1.3e-3, 64) == 0.005  # capped
    assert auto_flush_timeout(0.2) == 0.005  # a slow simulator: capped
    assert auto_flush_timeout(float("nan")) == 0.0


class _Steps:
    def __init__(self):
        self.total, self.count, self.moves = 0.0, 0, []

    def add(self, n, step_s):
        self.total += n * step_s
        self.count += n


def _plan(steps):
    return AffinityPlan(lambda: (steps.total, steps.count), steps.moves.append, partitioned=True)


def test_the_partition_is_lifted_for_costly_steps_and_restored_for_cheap_ones():
    steps = _Steps()
    plan = _plan(steps)
    t = plan.next_look
    steps.add(1000, 12e-6)  # CartPole-like: the partition stays
    plan.update(t)
    assert plan.partitioned and steps.moves == [] and plan.measured_step_s == pytest.approx(12e-6)
    steps.add(1000, 1.3e-3)  # Atari-like: lifted
    plan.update(t := t + 1.0)
    assert not plan.partitioned and steps.moves == [False]
    steps.add(1000, (PIN_STEP_S + UNPIN_STEP_S) / 2)  # between the lines: no change either way
    plan.update(t := t + 1.0)
    assert not plan.partitioned and steps.moves == [False]
    steps.add(1000, 10e-6)  # cheap again: restored
    plan.update(t := t + 1.0)
    assert plan.partitioned and steps.moves == [False, True] and plan.changes == 2


def test_the_plan_waits_for_enough_fresh_steps_and_its_period():
    steps = _Steps()
    plan = _plan(steps)
    steps.add(10, 1e-3)  # too few steps to trust
    plan.update(plan.next_look)
    assert plan.partitioned and plan.measured_step_s is None
    steps.add(1000, 1e-3)
    plan.update(plan.next_look - 0.5)  # not due yet
    assert plan.partitioned and steps.moves == []


def _oracle_policy(td):
    return td.set("action", oracle_action(td["tag"]))


def _cartpole():
    import gymnasium as gym

    return gym.make("CartPole-v1")


def _zero_action(td):
    return td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))


def _serving_threads():
    return [t for t in threading.enumerate() if t.name.startswith("torchrl_asyncpool-inference")]


def _run(collector, seconds):
    end = time.monotonic() + seconds
    for _ in collector:
        if time.monotonic() > end:
            break


@pytest.mark.skipif(len(CPUS) < 2, reason="the default partition needs two CPUs")
def test_a_slow_env_lifts_the_partition_and_gets_a_flush_deadline():
    # 2 ms steps (a simulator): the envs are the work, the policy needs a fraction of a core
    collector = AsyncPoolCollector([lambda: OracleEnv(step_delay=0.002)] * 4, policy=_oracle_policy,
                                   frames_per_batch=8, total_frames=-1, env_threads=False)
    try:
        assert collector.plan()["partitioned"] is True  # the default starts partitioned
        _run(collector, 3.5)
        plan = collector.plan()
        assert plan["partitioned"] is False and plan["measured_env_step_s"] >= 1e-3, plan  # resets are cheaper
        assert 0.0 < plan["flush_timeout_s"] <= 0.005, plan
        for pid in collector.env.worker_pids:
            assert os.sched_getaffinity(pid) == set(CPUS)
        assert all(os.sched_getaffinity(t.native_id) == set(CPUS) for t in _serving_threads())
        assert collector.env.worker_affinity is None  # replacement workers start unpinned too
    finally:
        collector.shutdown()


@pytest.mark.skipif(len(CPUS) < 2, reason="the default partition needs two CPUs")
def test_a_cheap_env_keeps_the_partition_and_greedy_batches():
    # gymnasium's CartPole: ~10 us a step, as cheap as serving it
    collector = AsyncPoolCollector([_cartpole] * 4, policy=_zero_action, frames_per_batch=8, total_frames=-1,
                                   env_threads=False)
    try:
        _run(collector, 3.5)
        plan = collector.plan()
        assert plan["partitioned"] is True and plan["partition_changes"] == 0, plan
        assert plan["flush_timeout_s"] == 0.0, plan
        for pid in collector.env.worker_pids:
            assert os.sched_getaffinity(pid) == set(CPUS[1:])
    finally:
        collector.shutdown()


def test_explicit_masks_and_timeouts_win():
    collector = AsyncPoolCollector([lambda: OracleEnv(step_delay=0.002)] * 2, policy=_oracle_policy,
                                   frames_per_batch=8, total_frames=-1, env_threads=False,
                                   worker_affinity=None, driver_affinity=None, server_timeout=0.0)
    try:
        _run(collector, 2.5)
        plan = collector.plan()
        assert plan["partitioned"] is None and plan["flush_timeout_s"] == 0.0, plan
    finally:
        collector.shutdown()
