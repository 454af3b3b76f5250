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
