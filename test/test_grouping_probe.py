"""The "auto" grouping's probe judges an env blocking (stepped in threads, several workers per
core) from how it steps, not from how loaded the machine is at that moment."""
import time

from torchrl_asyncpool.pool.grouping import _probe_blocking


class _FakeAdapter:
    """Steps as given: ``compute_s`` of CPU work, then ``wait_s`` of waiting in the steps
    ``waits(i)`` says (waiting off the CPU, as a preempted or blocked step does)."""

    def __init__(self, compute_s, wait_s, waits):
        self.compute_s, self.wait_s, self.waits, self.i = compute_s, wait_s, waits, 0

    def reset(self):
        return {}

    def random_action(self):
        return 0

    def step(self, action):
        end = time.thread_time() + self.compute_s
        while time.thread_time() < end:
            pass
        if self.waits(self.i):
            time.sleep(self.wait_s)
        self.i += 1
        return {}, 0.0, False, False


def test_a_cpu_bound_env_on_a_busy_machine_is_not_taken_for_a_blocking_one():
    # 1 ms of compute, and in 3 steps of 4 a wait of 3 ms (preempted by other jobs): the sum of
    # wall times is over twice the CPU time, but some steps ran undisturbed
    assert not _probe_blocking(_FakeAdapter(1e-3, 3e-3, lambda i: i % 4 != 0))


def test_an_env_that_waits_in_every_step_is_blocking():
    assert _probe_blocking(_FakeAdapter(5e-5, 2e-3, lambda i: True))


def test_a_cheap_env_is_never_blocking():
    assert not _probe_blocking(_FakeAdapter(1e-5, 0.0, lambda i: False))


def test_the_probe_reports_the_cpu_a_step_computes_and_groups_one_worker_a_core():
    import math
    import os

    from torchrl_asyncpool.pool.grouping import _resolve_grouping

    cores = len(os.sched_getaffinity(0))
    for compute_s in (5e-6, 80e-6, 1e-3):  # CartPole-, MuJoCo- and Atari-like
        measured = {}
        k, threaded = _resolve_grouping("auto", "auto", _FakeAdapter(compute_s, 0.0, lambda i: False), 16,
                                        measured=measured)
        assert k == math.ceil(16 / cores) and threaded is False, (compute_s, k, measured)
        assert measured["probe_step_cpu_s"] >= compute_s  # CPU time: what the step computed
        assert measured["probe_step_cpu_s"] <= measured["probe_step_s"] * 1.05
    # an explicit envs_per_worker is never changed
    assert _resolve_grouping(8, "auto", _FakeAdapter(80e-6, 0.0, lambda i: False), 16) == (8, False)
