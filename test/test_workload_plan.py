"""The plan follows the workload: the flush deadline and the default CPU partition are decided
from the env step the workers measure while running (tests assert the decision, not a speed)."""
import functools
import os
import threading
import time

import pytest
import torch

from torchrl_asyncpool import AsyncPoolCollector
from torchrl_asyncpool.collector.workload_plan import (
    PIN_STEP_S, SHARE_GAIN, SHARE_STEP_S, SHARED_PIN_STEP_S, SHARED_UNPIN_STEP_S, START_UNPINNED_PROBE_S, UNPIN_STEP_S,
    UNSHARE_STEP_S,
    AffinityPlan, shared_split, shared_worker_masks,
)
from torchrl_asyncpool.inference import auto_flush_timeout
from torchrl_asyncpool.inference._common import AUTO_TIMEOUT_FRACTION
from torchrl_asyncpool.inference.flush_deadline import (
    HOLD_S, SETTLE_WINDOWS, TRIAL_ORDER, TRIAL_WINDOW_S, TRIAL_WINDOWS, UNSURE_HOLD_S, UNSURE_RETRIES, FlushDeadline,
)
from torchrl_asyncpool.testing import OracleEnv, oracle_action

CPUS = sorted(os.sched_getaffinity(0))


def test_the_flush_deadline_follows_the_env_step():
    assert auto_flush_timeout(12e-6) == 0.0  # CartPole: greedy
    assert auto_flush_timeout(60e-6) == 0.0  # a TorchRL-wrapped cheap env: greedy
    f = AUTO_TIMEOUT_FRACTION
    assert 0.0 < f < 0.5  # k = 2 envs in turn leave one step free: the deadline stays within it
    assert auto_flush_timeout(100e-6, 8) == pytest.approx(f * 8 * 100e-6)  # MuJoCo: a candidate to try
    assert auto_flush_timeout(1.3e-3) == pytest.approx(f * 1.3e-3)  # Atari through gymnasium
    assert auto_flush_timeout(1.3e-3, 8) == pytest.approx(f * 8 * 1.3e-3)  # 8 envs a worker steps in turn
    assert auto_flush_timeout(1.3e-3, 32) == pytest.approx(f * 32 * 1.3e-3)  # 64 envs in 2 workers
    assert auto_flush_timeout(0.2) == 0.005  # a slow simulator stepped alone: capped (it idles its worker)
    assert auto_flush_timeout(0.2, 8) == pytest.approx(8 * 0.005)  # capped per env stepped in turn
    for k in (2, 3, 8, 32):  # k envs in turn: the deadline stays within the k - 1 free steps
        for step in (1e-4, 1.3e-3, 0.02, 0.2):
            assert auto_flush_timeout(step, k) <= (k - 1) * step
    assert auto_flush_timeout(float("nan")) == 0.0


class _Clock:
    """Feeds a FlushDeadline windows of env steps at chosen rates (frames/s per option)."""

    def __init__(self, step_s, envs_in_turn=1):
        self.t, self.count, self.total, self.step_s = 0.0, 0, 0.0, step_s
        self.deadline = FlushDeadline(envs_in_turn, now=0.0, sums=(0.0, 0))

    def window(self, rate, seconds=TRIAL_WINDOW_S, step_s=None):
        self.step_s = self.step_s if step_s is None else step_s
        self.t += seconds
        self.count += int(rate * seconds)
        self.total += int(rate * seconds) * self.step_s
        self.deadline.look(self.t, (self.total, self.count))
        return self.deadline

    def start(self, rate=1_000):
        """The settling windows, then the window that starts the first round."""
        for _ in range(SETTLE_WINDOWS):
            d = self.window(rate)
            assert (d.choice, d.timeout) == ("settling", 0.0)  # served greedily meanwhile
        return self.window(rate)

    def round(self, wait_rate, greedy_rate):
        d = self.deadline
        for _ in range(TRIAL_WINDOWS):
            d = self.window(wait_rate if d.timeout > 0 else greedy_rate)
        return d


def test_cheap_envs_are_served_greedily_without_trials():
    d = _Clock(12e-6).window(50_000)
    assert (d.choice, d.timeout, d.rounds) == ("greedy", 0.0, 0)
    assert _Clock(12e-6).window(50_000).describe()["flush_trial_rates"] == {}


@pytest.mark.parametrize("wait_rate, greedy_rate, choice", [
    (1_800, 1_000, "wait"),  # Atari-like: serving takes the envs' CPU, fuller batches win
    (1_000, 1_150, "greedy"),  # 16 sleeping envs: the wait only adds latency
    (1_010, 1_000, "greedy"),  # within the margin: greedy, the lower latency
])
def test_a_costly_step_tries_both_and_keeps_the_faster(wait_rate, greedy_rate, choice):
    clock = _Clock(1.3e-3, envs_in_turn=8)
    d = clock.start()
    assert d.choice == "trial" and d.timeout == pytest.approx(auto_flush_timeout(1.3e-3, 8))  # waiting first
    d = clock.round(wait_rate, greedy_rate)
    assert d.choice == choice and d.rounds == 1
    assert d.timeout == (d.candidate_s if choice == "wait" else 0.0)
    rates = d.describe()["flush_trial_rates"]
    assert rates == {"wait": [wait_rate, wait_rate], "greedy": [greedy_rate, greedy_rate]}


def test_a_round_is_not_decided_by_the_warm_up_drift():
    # the pool gets faster window after window (start-up); waiting is truly 5 % faster. In the
    # order wait, greedy, greedy, wait both options sit at the same mean position, so the drift
    # cancels; alternating (wait, greedy, wait, greedy) would give greedy 1,200 against 1,155.
    assert TRIAL_ORDER == ("wait", "greedy", "greedy", "wait")
    clock = _Clock(1.3e-3, envs_in_turn=8)
    d = clock.start()
    base = 1_000
    for _ in range(TRIAL_WINDOWS):
        d = clock.window(base * (1.05 if d.timeout > 0 else 1.0))
        base += 100
    rates = d.describe()["flush_trial_rates"]
    assert rates["wait"] == [pytest.approx(1_050, abs=2), pytest.approx(1_365, abs=2)]
    assert rates["greedy"] == [pytest.approx(1_100, abs=2), pytest.approx(1_200, abs=2)]
    assert d.choice == "wait"


def test_the_first_round_starts_after_the_core_partition_is_looked_at():
    from torchrl_asyncpool.collector.workload_plan import PLAN_PERIOD_S

    # the window that starts the first round comes after the partition's first look
    assert SETTLE_WINDOWS * TRIAL_WINDOW_S >= PLAN_PERIOD_S + TRIAL_WINDOW_S


def test_a_costly_step_settles_before_the_first_round():
    clock = _Clock(1.3e-3, envs_in_turn=8)
    d = clock.window(1_000)
    assert (d.choice, d.timeout, d.rounds) == ("settling", 0.0, 0)
    assert d.measured_step_s == pytest.approx(1.3e-3)  # measured meanwhile
    for _ in range(SETTLE_WINDOWS - 1):
        d = clock.window(1_000)
    d = clock.window(1_000)
    assert d.choice == "trial" and d.timeout == pytest.approx(auto_flush_timeout(1.3e-3, 8))


def test_an_unsure_round_is_tried_again_soon_a_few_times():
    clock = _Clock(1.3e-3, envs_in_turn=8)
    d = clock.start()

    def noisy_round():  # waiting's first window met a slow moment: 540 and 1,220 against 1,100 and 1,170
        d = clock.deadline
        for wait_rate, greedy_rate in ((540, None), (None, 1_100), (None, 1_170), (1_220, None)):
            d = clock.window(wait_rate if d.timeout > 0 else greedy_rate)
        return d

    for _ in range(UNSURE_RETRIES):
        d = noisy_round()
        assert d.choice == "greedy" and d.describe()["flush_trial_sure"] is False
        for _ in range(int(UNSURE_HOLD_S / TRIAL_WINDOW_S) - 1):  # held briefly ...
            assert clock.window(1_100).choice == "greedy"
        assert clock.window(1_100).choice == "trial"  # ... then tried again
    d = noisy_round()  # still unsure after the retries: held for HOLD_S like a sure decision
    assert d.rounds == UNSURE_RETRIES + 1
    for _ in range(int(HOLD_S / TRIAL_WINDOW_S) - 1):
        assert clock.window(1_100).choice == "greedy"
    d = clock.window(1_100)
    assert d.choice == "trial"
    d = clock.round(1_300, 1_100)  # a clear round: waiting wins and is held
    assert d.choice == "wait" and d.describe()["flush_trial_sure"] is True
    for _ in range(int(HOLD_S / TRIAL_WINDOW_S) - 1):
        assert clock.window(1_300).choice == "wait"


def test_the_decision_holds_then_is_tried_again_and_can_change():
    clock = _Clock(2e-3)
    assert clock.start().describe()["flush_trial_reason"] == "the first round"
    d = clock.round(1_000, 1_200)
    assert d.choice == "greedy"
    windows = int(HOLD_S / TRIAL_WINDOW_S) - 1
    for _ in range(windows):  # held: the load of a moment does not decide for good
        assert clock.window(5_000).choice == "greedy"
    d = clock.window(1_000)
    assert d.choice == "trial"  # the hold is over: a new round
    assert d.describe()["flush_trial_reason"] == "the hold ended"
    d = clock.round(1_500, 1_000)  # the load went away: now waiting wins
    assert d.choice == "wait" and d.rounds == 2


def test_a_drifting_env_step_starts_a_round_at_once():
    clock = _Clock(2e-3)
    clock.start()
    assert clock.round(1_500, 1_000).choice == "wait"
    assert clock.window(1_000).choice == "wait"
    d = clock.window(1_000, step_s=5e-3)  # the env's steps got 2.5x slower
    assert d.choice == "trial"
    assert d.describe()["flush_trial_reason"] == "the env step moved from 2000 to 5000 us"
    d = clock.window(1_000, step_s=50e-6)  # ... or cheap: greedy at once, no deadline tried
    assert (d.choice, d.timeout) == ("greedy", 0.0)


def _policy_clock():
    """A :class:`_Clock` whose deadline also takes the server's ``(policy seconds, records served,
    policy calls)``; returns ``(clock, window)``, ``window(rate, policy_s, batch)`` one window of
    ``rate`` env steps/s served at ``policy_s`` a record in batches of ``batch``."""
    clock = _Clock(2e-3)
    policy = [0.0, 0, 0]
    clock.deadline = FlushDeadline(1, now=0.0, sums=(0.0, 0), policy_sums=tuple(policy))

    def window(rate, policy_s, batch=4):
        n = int(rate * TRIAL_WINDOW_S)
        policy[0] += n * policy_s
        policy[1] += n
        policy[2] += n // batch
        clock.t += TRIAL_WINDOW_S
        clock.count += n
        clock.total += n * clock.step_s
        clock.deadline.look(clock.t, (clock.total, clock.count), tuple(policy))
        return clock.deadline

    for _ in range(SETTLE_WINDOWS + 1):  # settling, then the window that starts the round
        window(1_000, 20e-6)
    for _ in range(TRIAL_WINDOWS):  # waiting wins; fuller batches cost less per record than greedy's
        d = window(1_500 if clock.deadline.timeout > 0 else 1_000, 10e-6 if clock.deadline.timeout > 0 else 30e-6)
    assert d.choice == "wait" and d.rounds == 1
    for _ in range(3):  # the decision's own batches: no drift (the reference is taken under it)
        assert window(1_500, 10e-6).choice == "wait"
    assert d.measured_policy_s == pytest.approx(10e-6) and d.measured_policy_call_s == pytest.approx(40e-6, rel=0.01)
    return clock, window


def test_a_policy_swapped_for_a_costlier_one_starts_a_round_at_once():
    clock, window = _policy_clock()
    d = window(1_500, 40e-6)  # the same envs and batches, a policy 4x costlier per record and per call
    assert d.choice == "trial" and d.measured_policy_s == pytest.approx(40e-6)
    assert d.describe()["flush_trial_reason"] == "the policy's cost per record moved from 10.0 to 40.0 us"


def test_fuller_batches_of_a_cheap_policy_are_no_drift():
    # a cheap policy costs about the same per call whatever the batch: batches of 10 instead of 4
    # (as a pool warming up under the decision to wait gives) cost it 2.5x less per record
    clock, window = _policy_clock()
    for _ in range(5):
        d = window(1_500, 4e-6, batch=10)
        assert d.choice == "wait", d.measured_policy_s
    assert d.measured_policy_s == pytest.approx(4e-6) and d.measured_policy_call_s == pytest.approx(40e-6, rel=0.01)
    # ... and a costly one costs the same per record: twice the batch is twice the call, no drift either
    d = window(1_500, 10e-6, batch=10)
    assert d.choice == "wait"


def test_without_its_calls_the_policy_drifts_by_its_cost_per_record():
    clock = _Clock(2e-3)
    policy = [0.0, 0]  # (policy seconds, records served): a server that counts no calls
    clock.deadline = FlushDeadline(1, now=0.0, sums=(0.0, 0), policy_sums=tuple(policy))

    def window(rate, policy_s):
        policy[0] += int(rate * TRIAL_WINDOW_S) * policy_s
        policy[1] += int(rate * TRIAL_WINDOW_S)
        clock.t += TRIAL_WINDOW_S
        clock.count += int(rate * TRIAL_WINDOW_S)
        clock.total += int(rate * TRIAL_WINDOW_S) * clock.step_s
        clock.deadline.look(clock.t, (clock.total, clock.count), tuple(policy))
        return clock.deadline

    for _ in range(SETTLE_WINDOWS + 1):
        window(1_000, 20e-6)
    for _ in range(TRIAL_WINDOWS):
        d = window(1_500 if clock.deadline.timeout > 0 else 1_000, 10e-6)
    assert d.choice == "wait"
    assert window(1_500, 10e-6).choice == "wait" and d.measured_policy_call_s is None
    assert window(1_500, 40e-6).choice == "trial"


def test_a_window_with_too_few_steps_stays_open():
    clock = _Clock(2e-3)
    d = clock.window(10)  # 5 steps in half a second: not enough to judge
    assert d.choice == "unmeasured" and d.measured_step_s is None
    d = clock.start()
    assert d.choice == "trial" and d.measured_step_s == pytest.approx(2e-3)


class _Steps:
    def __init__(self):
        self.total, self.count, self.moves = 0.0, 0, []

    def add(self, n, step_s):
        self.total += n * step_s
        self.count += n


def _plan(steps, can_share=False):
    if not can_share:  # the steps' wall time: the window opens at once, the first look a period later
        return AffinityPlan(lambda: (steps.total, steps.count), steps.moves.append)
    # the workers' CPU: what they ran before the first look (their envs' construction) is not counted
    plan = AffinityPlan(lambda: (steps.total, steps.count), steps.moves.append, can_share=True,
                        first_look_opens=True)
    steps.add(5, 0.5)
    plan.update(plan.next_look)  # the first look opens the window
    assert plan.measured_step_s is None and steps.moves == []
    return plan


def test_the_partition_is_lifted_for_costly_steps_and_restored_for_cheap_ones():
    steps = _Steps()
    plan = _plan(steps)
    t = plan.next_look
    steps.add(1000, 12e-6)  # CartPole-like: the partition stays
    plan.update(t)
    assert plan.partitioned and steps.moves == [] and plan.measured_step_s == pytest.approx(12e-6)
    steps.add(1000, 1.3e-3)  # Atari-like: lifted
    plan.update(t := t + 1.0)
    assert not plan.partitioned and steps.moves == ["unpinned"]
    steps.add(1000, (PIN_STEP_S + UNPIN_STEP_S) / 2)  # between the lines: no change either way
    plan.update(t := t + 1.0)
    assert not plan.partitioned and steps.moves == ["unpinned"]
    steps.add(1000, 10e-6)  # cheap again: restored
    plan.update(t := t + 1.0)
    assert plan.partitioned and steps.moves == ["unpinned", "partitioned"] and plan.changes == 2
    steps.add(1000, 45e-6)  # MuJoCo-like, one worker a CPU: nothing to share, the partition stays
    plan.update(t := t + 1.0)
    assert plan.layout == "partitioned" and plan.changes == 2


def test_mid_cost_steps_share_the_policy_cpu_when_the_pool_has_two_workers_a_cpu():
    steps = _Steps()
    plan = _plan(steps, can_share=True)
    t = plan.next_look
    steps.add(1000, 12e-6)  # CartPole-like: the partition stays
    plan.update(t)
    assert plan.layout == "partitioned" and steps.moves == []
    steps.add(1000, 45e-6)  # MuJoCo-like: a share of the workers joins the policy's CPU
    plan.update(t := t + 1.0)
    assert plan.layout == "shared" and plan.partitioned and steps.moves == ["shared"]
    assert plan.describe()["cpu_layout"] == "shared" and plan.describe()["partitioned"] is True
    steps.add(1000, (UNSHARE_STEP_S + SHARE_STEP_S) / 2)  # between the lines: stays shared
    plan.update(t := t + 1.0)
    assert plan.layout == "shared"
    steps.add(1000, 90e-6)  # a MuJoCo step in a slow phase of the machine: still shared
    plan.update(t := t + 1.0)
    assert plan.layout == "shared" and UNPIN_STEP_S < 90e-6 < SHARED_PIN_STEP_S
    steps.add(1000, 1.3e-3)  # Atari-like: lifted
    plan.update(t := t + 1.0)
    assert plan.layout == "unpinned" and not plan.partitioned
    steps.add(1000, (SHARED_PIN_STEP_S + SHARED_UNPIN_STEP_S) / 2)  # between the lines: stays unpinned
    plan.update(t := t + 1.0)
    assert plan.layout == "unpinned"
    steps.add(1000, (SHARE_STEP_S + SHARED_PIN_STEP_S) / 2)  # mid-cost again: back to shared
    plan.update(t := t + 1.0)
    assert plan.layout == "shared"
    steps.add(1000, UNSHARE_STEP_S / 2)  # cheap: the policy's CPU is the policy's alone again
    plan.update(t := t + 1.0)
    assert steps.moves == ["shared", "unpinned", "shared", "partitioned"] and plan.changes == 4
    steps.add(1000, 1.3e-3)
    plan.update(t := t + 1.0)
    steps.add(1000, UNSHARE_STEP_S / 2)  # from unpinned, a cheap step goes straight to the partition
    plan.update(t := t + 1.0)
    assert steps.moves[-2:] == ["unpinned", "partitioned"]


def _served_plan(steps, served, moved_fraction=0.25, cpus=2):
    plan = AffinityPlan(lambda: (steps.total, steps.count), steps.moves.append, can_share=True,
                        first_look_opens=True, serving=lambda: served[0], moved_fraction=moved_fraction, cpus=cpus)
    plan.update(plan.next_look)  # opens the window
    return plan


def _look(plan, steps, served, step_s, serving_s, n=1000):
    steps.add(n, step_s)
    served[0] += n * serving_s
    plan.update(plan.next_look)
    return plan.layout


def test_sharing_weighs_the_serving_threads_cpu_against_the_workers():
    steps, served = _Steps(), [0.0]
    plan = _served_plan(steps, served)
    # 2 CPUs, a quarter of the workers moved: partitioned the workers' CPU (60 us a step) is the
    # bottleneck; shared, max(s + 15, 45) us against 60: a cheap policy (20 us) gains 1.33x
    assert _look(plan, steps, served, 60e-6, 20e-6) == "shared"
    assert plan.measured_serving_s == pytest.approx(20e-6)
    assert plan.describe()["measured_serving_s"] == pytest.approx(20e-6)
    # a policy that serves for 44 us a step: shared max(59, 45) < 60 predicts a gain, too small to
    # move to but enough to stay
    assert 59e-6 > SHARE_GAIN * 60e-6
    assert _look(plan, steps, served, 60e-6, 44e-6) == "shared"
    # one that serves for 50 us: shared max(65, 45) against 60: the workers go back
    assert _look(plan, steps, served, 60e-6, 50e-6) == "partitioned"
    assert _look(plan, steps, served, 60e-6, 44e-6) == "partitioned"  # not enough to move again
    assert _look(plan, steps, served, 60e-6, 20e-6) == "shared"
    assert steps.moves == ["shared", "partitioned", "shared"]
    # Atari-like steps lift the partition whatever the policy costs; CartPole-like ones never share
    assert _look(plan, steps, served, 1.3e-3, 0.5e-3) == "unpinned"
    assert _look(plan, steps, served, 12e-6, 1e-6) == "partitioned"


def test_a_policy_as_costly_as_the_workers_keeps_its_cpu():
    steps, served = _Steps(), [0.0]
    plan = _served_plan(steps, served)
    # the PPO recipe's actor with 4 workers of 4 HalfCheetahs: ~70 us of serving, ~75 us of workers
    assert _look(plan, steps, served, 75e-6, 70e-6) == "partitioned"
    assert steps.moves == [] and plan.measured_step_s == pytest.approx(75e-6)
    # 4 CPUs, one worker of 8 moved: the other 3 CPUs each carry a third of the workers
    steps, served = _Steps(), [0.0]
    plan = _served_plan(steps, served, moved_fraction=1 / 8, cpus=4)
    assert _look(plan, steps, served, 90e-6, 10e-6) == "shared"  # max(21.25, 26.25) against 30
    steps, served = _Steps(), [0.0]
    plan = _served_plan(steps, served, moved_fraction=1 / 8, cpus=4)
    assert _look(plan, steps, served, 90e-6, 20e-6) == "partitioned"  # max(31.25, 26.25) against 30
    for bad in (dict(moved_fraction=0.0), dict(moved_fraction=1.0), dict(cpus=1)):
        with pytest.raises(ValueError, match="moved_fraction"):
            AffinityPlan(lambda: (0.0, 0), print, can_share=True, **bad)


def test_the_shared_layout_moves_about_a_third_of_a_cpu_share_of_workers():
    assert shared_worker_masks((0,), [(1,)] * 4) == [(1,), (1,), (1,), (0,)]
    assert shared_worker_masks((0,), [(1,)] * 3) is None  # fewer than 2 a CPU: the partition itself
    assert shared_worker_masks((0,), [(1,)] * 8) == [(1,)] * 5 + [(0,)] * 3  # round(8 / 3)
    assert shared_worker_masks((0,), [(1, 2, 3)] * 8) == [(1, 2, 3)] * 7 + [(0,)]  # 4 CPUs: round(8 / 7)
    assert shared_split((0,), [(1,)] * 8) == (3 / 8, 2) and shared_split((0,), [(1, 2, 3)] * 8) == (1 / 8, 4)
    with pytest.raises(ValueError, match="shared"):
        AffinityPlan(lambda: (0.0, 0), print, layout="shared", can_share=False)
    with pytest.raises(ValueError, match="layout"):
        AffinityPlan(lambda: (0.0, 0), print, layout="pinned")


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
    # 1 ms of computing a step (a simulator): the envs are the work, the policy needs a fraction of a core
    collector = AsyncPoolCollector([functools.partial(_ComputingEnv, step_s=1e-3)] * 4, policy=_zero_action,
                                   frames_per_batch=8, total_frames=-1)
    try:
        # a costly step by the start-up probe: one worker a CPU, and unpinned from the start
        assert collector.plan()["startup"]["envs_per_worker"] == -(-4 // len(CPUS))
        assert collector.plan()["startup"]["measured"]["probe_step_s"] >= START_UNPINNED_PROBE_S
        assert collector.plan()["cpu_layout"] == "unpinned" and collector.plan()["partition_changes"] == 0
        for pid in collector.env.worker_pids:
            assert os.sched_getaffinity(pid) == set(CPUS)
        _run(collector, 3.5)
        plan = collector.plan()
        assert plan["partitioned"] is False and plan["cpu_layout"] == "unpinned", plan
        assert plan["measured_env_step_s"] >= 0.8e-3, plan  # the workers' CPU a step: the step and the exchange
        # a deadline is a candidate: tried against greedy, the faster one kept (not asserted: a speed)
        assert 0.0 < plan["flush_candidate_s"] <= 0.005 and plan["flush_choice"] != "unmeasured", plan
        assert plan["flush_timeout_s"] in (0.0, plan["flush_candidate_s"]), plan
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
        if plan["partition_changes"]:
            # a loaded machine (a CI runner whose host steals time) measured CartPole at >= 80 us a
            # step once and lifted the partition (its rule, tested above); each change toggles it
            assert plan["partitioned"] is (plan["partition_changes"] % 2 == 0), plan
            return
        assert plan["partitioned"] is True, plan
        assert plan["flush_timeout_s"] == 0.0 and plan["flush_choice"] == "greedy", plan
        assert plan["flush_trial_rounds"] == 0, plan  # nothing to try: no deadline is a candidate
        for pid in collector.env.worker_pids:
            assert os.sched_getaffinity(pid) == set(CPUS[1:])
    finally:
        collector.shutdown()


def _compute(seconds):
    """Spends ``seconds`` of this thread's CPU (a step's or a policy call's cost)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _ComputingEnv:
    """A CPU-bound gymnasium env whose step computes for ``step_s`` (a MuJoCo-like cost)."""

    def __new__(cls, step_s=60e-6):
        import gymnasium as gym
        import numpy as np

        class Computing(gym.Env):
            observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
            action_space = gym.spaces.Discrete(2)

            def reset(self, *, seed=None, options=None):
                self.t = 0
                return np.zeros(4, np.float32), {}

            def step(self, action):
                _compute(step_s)
                self.t += 1
                return np.zeros(4, np.float32), 0.0, False, self.t >= 200, {}

        return Computing()


@pytest.mark.skipif(len(CPUS) < 2, reason="the default partition needs two CPUs")
def test_a_mid_cost_env_in_two_workers_a_cpu_shares_the_policy_cpu():
    per_worker = -(-8 // (2 * len(CPUS)))  # two workers a CPU
    collector = AsyncPoolCollector([_ComputingEnv] * 8, policy=_zero_action, frames_per_batch=8, total_frames=-1,
                                   envs_per_worker=per_worker)
    try:
        assert collector.plan()["cpu_layout"] == "partitioned"  # the default starts partitioned
        _run(collector, 3.5)
        plan = collector.plan()
        step = plan["measured_env_step_s"]
        if not SHARE_STEP_S <= step < SHARED_PIN_STEP_S:  # a machine so loaded that a step took 2x its CPU
            return
        assert plan["cpu_layout"] == "shared" and plan["partitioned"] is True, plan
        workers = len(collector.env.worker_pids)
        expected = shared_worker_masks((CPUS[0],), [tuple(CPUS[1:])] * workers)
        assert expected is not None and [tuple(sorted(os.sched_getaffinity(pid))) for pid in
                                         collector.env.worker_pids] == expected
        assert all(os.sched_getaffinity(t.native_id) == {CPUS[0]} for t in _serving_threads())
        assert 0 < plan["measured_serving_s"] < step  # the zero-action policy left its core room
    finally:
        collector.shutdown()


def _slow_zero_action(td):
    _compute(2e-3)  # 2 ms of CPU a batch: far more a step than the env's 60 us
    return td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))


@pytest.mark.skipif(len(CPUS) < 2, reason="the default partition needs two CPUs")
def test_a_costly_policy_keeps_its_cpu_from_mid_cost_envs():
    per_worker = -(-8 // (2 * len(CPUS)))  # two workers a CPU: the shared layout is on offer
    collector = AsyncPoolCollector([_ComputingEnv] * 8, policy=_slow_zero_action, frames_per_batch=8,
                                   total_frames=-1, envs_per_worker=per_worker)
    try:
        _run(collector, 3.5)
        plan = collector.plan()
        assert plan["measured_env_step_s"] is not None and plan["measured_serving_s"] is not None, plan
        # 2 ms a batch of at most 8 records serves for >= 250 us a step: the policy's CPU is the bottleneck
        assert plan["measured_serving_s"] > plan["measured_env_step_s"], plan
        assert plan["cpu_layout"] == "partitioned" and plan["partition_changes"] == 0, plan
        assert all(os.sched_getaffinity(pid) == set(CPUS[1:]) for pid in collector.env.worker_pids)
    finally:
        collector.shutdown()


class _ZeroNet(torch.nn.Module):
    """Action 0 for every record, after ``spin_s`` of computing a call (a policy's cost)."""

    def __init__(self, spin_s=0.0):
        super().__init__()
        self.spin_s = spin_s

    def forward(self, observation):
        _compute(self.spin_s)
        return torch.zeros(observation.shape[0], dtype=torch.int64)


def _module_policy(spin_s=0.0):
    from tensordict.nn import TensorDictModule

    return TensorDictModule(_ZeroNet(spin_s), in_keys=["observation"], out_keys=["action"])


@pytest.mark.skipif(len(CPUS) < 2, reason="the default partition needs two CPUs")
@pytest.mark.parametrize("spin_s, per_core", [(0.0, 2), (2e-3, 1)])
def test_the_default_grouping_weighs_the_policy_cost_against_a_mid_cost_env(spin_s, per_core):
    # a 60 us step (MuJoCo-like): two workers a core where the policy leaves its CPU room, one a
    # core where a call costs 2 ms (the predicted serving is then the busiest CPU's work)
    # (16 envs: a worker's 4 answered together; with 8, batches of 2 would cost the policy too much a frame)
    collector = AsyncPoolCollector([_ComputingEnv] * 16, policy=_module_policy(spin_s), frames_per_batch=16,
                                   total_frames=32)
    try:
        startup = collector.plan()["startup"]
        measured = startup["measured"]
        assert startup["decided"]["envs_per_worker"] == "auto" and startup["policy_cost_s"], startup
        per_worker = -(-16 // (per_core * len(CPUS)))
        assert startup["num_workers"] == -(-16 // per_worker), startup
        if per_core == 2:
            assert measured["predicted_share_ratio"] <= SHARE_GAIN, measured
        else:
            assert measured["predicted_share_ratio"] > 1.0 and measured["predicted_serving_s"] > 250e-6, measured
        frames = sum(batch.numel() for batch in collector)
        assert frames == 32
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


class _SleepingPolicy(torch.nn.Module):
    def __init__(self, per_call_s, per_record_s):
        super().__init__()
        self.per_call_s, self.per_record_s = per_call_s, per_record_s

    def forward(self, td):
        time.sleep(self.per_call_s + self.per_record_s * td.batch_size[0])
        return td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))


@pytest.mark.parametrize("per_call_s, per_record_s, gain", [
    (0.004, 0.0, (0.8, 1.0)),  # a fixed cost per call (a GPU launch, a remote call): fuller batches pay
    # a cost in step with the batch (a CNN on a CPU): they hardly do. 2 ms a record, so that sleep's own
    # overshoot per call (a fixed cost, 0.1-0.3 ms on a loaded 2-core machine) cannot pass for a gain
    (0.0, 0.002, (0.0, 0.3)),
])
def test_the_policy_cost_per_batch_size_is_measured_at_start_up(per_call_s, per_record_s, gain):
    collector = AsyncPoolCollector([lambda: OracleEnv()] * 16, policy=_SleepingPolicy(per_call_s, per_record_s),
                                   frames_per_batch=16, total_frames=16)
    try:
        startup = collector.plan()["startup"]
        cost = startup["policy_cost_s"]
        assert sorted(cost) == [1, 8, 16], cost
        assert cost[1] >= per_call_s + per_record_s and cost[16] >= per_call_s + 16 * per_record_s, cost
        assert gain[0] <= startup["policy_batch_gain"] <= gain[1], startup
    finally:
        collector.shutdown()


def test_a_plain_callable_policy_is_not_called_to_time_it():
    calls = []
    collector = AsyncPoolCollector([lambda: OracleEnv()] * 4, policy=lambda td: calls.append(1) or _oracle_policy(td),
                                   frames_per_batch=4, total_frames=4)
    try:
        assert collector.plan()["startup"]["policy_cost_s"] == {}  # it may count its calls
        assert collector.plan()["startup"]["policy_batch_gain"] is None
    finally:
        collector.shutdown()


def test_a_policy_that_refuses_zero_records_has_no_measured_cost():
    from torchrl_asyncpool.collector.policy_cost import batch_gain, measure_policy_cost

    def picky(td):
        if td.batch_size[0] > 1:
            raise RuntimeError("one record at a time")
        return td

    assert measure_policy_cost(picky, {"observation": ((4,), torch.float32)}, num_envs=8) == {}
    assert batch_gain({}) is None and batch_gain({8: 1e-3}) is None
