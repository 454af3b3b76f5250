"""The "auto" grouping's probe judges an env blocking (stepped in threads, several workers per
core) from how it steps, not from how loaded the machine is at that moment."""
import time

from torchrl_asyncpool.pool.grouping import _probe_blocking


def _compute(seconds):
    """Spends ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _FakeAdapter:
    """Steps as given: ``compute_s`` of CPU work, then ``wait_s`` of waiting in the steps
    ``waits(i)`` says (waiting off the CPU, as a preempted or blocked step does); ``costly``
    ``(i, seconds)``: step ``i`` computes that much more (a cold or a descheduled step)."""

    def __init__(self, compute_s, wait_s, waits, costly=(-1, 0.0)):
        self.compute_s, self.wait_s, self.waits, self.i = compute_s, wait_s, waits, 0
        self.costly = costly

    def reset(self):
        return {}

    def random_action(self):
        return 0

    def step(self, action):
        _compute(self.compute_s + (self.costly[1] if self.i == self.costly[0] else 0.0))
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


def test_one_step_that_computes_does_not_make_a_waiting_env_cpu_bound():
    # a 2 ms wait in every step, and in one step of 32 (a cold or a descheduled one) 3 ms of CPU
    measured = {}
    assert _probe_blocking(_FakeAdapter(5e-5, 2e-3, lambda i: True, costly=(5, 3e-3)), measured=measured)
    assert measured["probe_cpu_ratio"] < 0.5 and measured["probe_steps"] >= 10


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
        assert compute_s <= measured["probe_step_cpu_median_s"] <= measured["probe_step_cpu_s"] * 1.5
    # an explicit envs_per_worker is never changed
    assert _resolve_grouping(8, "auto", _FakeAdapter(80e-6, 0.0, lambda i: False), 16) == (8, False)


def test_the_probe_reports_the_median_step_which_a_costly_first_step_does_not_move():
    # a fresh env's first step costs 200-700 us whatever the env (cold code paths and caches)
    first_costly = _FakeAdapter(10e-6, 0.0, lambda i: False, costly=(0, 1e-3))
    measured = {}
    assert not _probe_blocking(first_costly, measured=measured)
    assert measured["probe_step_cpu_s"] >= 10e-6 + 1e-3 / measured["probe_steps"]  # the mean carries it
    assert measured["probe_step_cpu_median_s"] < 10e-6 + 1e-3 / measured["probe_steps"]
    assert measured["probe_step_cpu_median_s"] >= 10e-6


def test_a_callers_rule_sets_the_workers_a_core_of_cpu_bound_envs_only():
    import math
    import os

    from torchrl_asyncpool.pool.grouping import _resolve_grouping

    cores = len(os.sched_getaffinity(0))
    seen = []

    def two_a_core(measured, n, c):
        seen.append((measured["probe_step_cpu_s"] > 0, n, c))
        return 2

    k, threaded = _resolve_grouping("auto", "auto", _FakeAdapter(80e-6, 0.0, lambda i: False), 16,
                                    workers_per_core=two_a_core)
    assert k == math.ceil(16 / (2 * cores)) and threaded is False and seen == [(True, 16, cores)]
    # not asked for an explicit envs_per_worker, nor for blocking envs (their own rule)
    assert _resolve_grouping(8, "auto", _FakeAdapter(80e-6, 0.0, lambda i: False), 16,
                             workers_per_core=two_a_core) == (8, False)
    _resolve_grouping("auto", "auto", _FakeAdapter(5e-5, 2e-3, lambda i: True), 16, workers_per_core=two_a_core)
    assert len(seen) == 1


def test_the_collectors_rule_groups_mid_cost_envs_two_a_core_where_the_policy_leaves_room():
    from torchrl_asyncpool.collector.workload_plan import MID_COST_PROBE_S, SHARE_GAIN, startup_workers_per_core

    cheap, costly = {1: 40e-6, 8: 40e-6, 16: 40e-6}, {1: 300e-6, 8: 330e-6, 16: 350e-6}
    mujoco = {"probe_step_cpu_s": 70e-6, "probe_step_cpu_median_s": 50e-6}
    assert startup_workers_per_core(cheap)(mujoco, 16, 2) == 2
    assert mujoco["predicted_share_ratio"] <= SHARE_GAIN  # 4 workers, one moved: max(s + 17.5, 52.5) / 70
    assert mujoco["predicted_serving_s"] == (40e-6 + 60e-6) / 4
    assert startup_workers_per_core(costly)(dict(mujoco), 16, 2) == 1
    # a faster host's HalfCheetah: max(22.5 + 8.25, 24.75) / 33 = 0.93, above the running plan's
    # margin and still predicted faster than the partition: two a core
    fast = {"probe_step_cpu_s": 33e-6, "probe_step_cpu_median_s": 31e-6}
    assert startup_workers_per_core({4: 30e-6})(fast, 16, 2) == 2
    assert SHARE_GAIN < fast["predicted_share_ratio"] < 1.0
    # predicted no faster (the serving thread already the busier CPU): one a core
    assert startup_workers_per_core({4: 60e-6})(dict(fast), 16, 2) == 1
    # CartPole's probe on a first build in a fresh process (22 us, predicted 0.82 here): below the
    # band, one a core (grouped, 4 workers of CartPole measured 0.62-0.81x 2)
    cartpole = {"probe_step_cpu_s": 22e-6, "probe_step_cpu_median_s": 12e-6}
    assert startup_workers_per_core(cheap)(cartpole, 32, 2) == 1 and "predicted_share_ratio" not in cartpole
    # a cheap step whose fresh env's first step (200-700 us) put the mean inside the band (Pendulum
    # probed a 37 us mean once, a 14 us median): the median decides, one a core
    pendulum = {"probe_step_cpu_s": 37e-6, "probe_step_cpu_median_s": 14e-6}
    assert startup_workers_per_core(cheap)(pendulum, 32, 2) == 1 and "predicted_share_ratio" not in pendulum
    for step in (MID_COST_PROBE_S[0] / 2, MID_COST_PROBE_S[1]):  # cheap (CartPole) and costly (Atari) steps
        measured = {"probe_step_cpu_s": step, "probe_step_cpu_median_s": step}
        assert startup_workers_per_core(cheap)(measured, 16, 2) == 1 and "predicted_share_ratio" not in measured
    assert startup_workers_per_core(cheap)({}, 16, 2) == 1  # not timed
    assert startup_workers_per_core({})(dict(mujoco), 16, 2) == 1  # a policy whose cost is unknown
    assert startup_workers_per_core(cheap)(dict(mujoco), 3, 2) == 1  # too few envs for 4 workers
    assert startup_workers_per_core(cheap)(dict(mujoco), 16, 1) == 1  # one CPU: nothing to share
    # 4 CPUs, 64 envs: 8 workers of 8, one moved: max(12.5 + 15, 35) against 40 us a CPU
    assert startup_workers_per_core(cheap)({"probe_step_cpu_s": 120e-6, "probe_step_cpu_median_s": 90e-6}, 64, 4) == 2
    # 8 CPUs: the workers' 7 CPUs each carry 10 us a frame, the policy's already 25: it keeps its CPU
    assert startup_workers_per_core(cheap)(dict(mujoco), 64, 8) == 1
