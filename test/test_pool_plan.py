"""The pool's start-up plan (``PoolPlan``): one place that checks the options, builds the spec
env once and decides grouping, seeding, CPU masks, idle polling and restarts; the pool, the
collector and ``evaluate()`` build from it."""
import functools
import math
import os

import gymnasium as gym
import pytest
import torch

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool.evaluation import Episode, evaluate
from torchrl_asyncpool.pool.layout import SpecEnv
from torchrl_asyncpool.pool.plan import OPTIONS, PoolPlan, restart_policy
from torchrl_asyncpool.testing import SleepPixelEnv, ZeroLatencyEnv

CPUS = sorted(os.sched_getaffinity(0))
#: spec envs built in this process (the workers are other processes, or threads that count too)
BUILT = []


def _cartpole():
    return gym.make("CartPole-v1")


def _counted_cartpole():
    BUILT.append(os.getpid())
    return gym.make("CartPole-v1")


def _vector_cartpole(k=3):
    return gym.vector.SyncVectorEnv([_cartpole] * k, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)


def _zero_action(td):
    return td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))


def test_a_cheap_env_is_timed_and_grouped_about_one_worker_per_core():
    plan = PoolPlan.build([_cartpole] * 8, envs_per_worker="auto", worker_affinity="auto")
    m = plan.measured
    assert m["blocking"] is False and m["probe_steps"] > 0 and 0 < m["probe_step_s"] < 0.05, m
    assert plan.envs_per_worker == math.ceil(8 / len(CPUS)) and plan.env_threads is False
    assert plan.groups == tuple(tuple(range(i, min(i + plan.envs_per_worker, 8)))
                                for i in range(0, 8, plan.envs_per_worker))
    # CPU-bound workers take the worker side of the default partition
    expected = None if len(CPUS) < 2 else [tuple(CPUS[1:])] * plan.num_workers
    assert plan.worker_affinity == expected
    assert plan.decided["envs_per_worker"] == plan.decided["worker_affinity"] == "auto"
    assert m["record_bytes"] > 0 and m["spec_env_build_s"] >= 0


def test_a_blocking_env_is_grouped_in_threads_two_workers_per_core():
    plan = PoolPlan.build([functools.partial(SleepPixelEnv, step_s=0.002)] * 8, envs_per_worker="auto",
                          worker_affinity="auto")
    assert plan.measured["blocking"] is True
    assert plan.env_threads is True and plan.envs_per_worker == math.ceil(8 / (2 * len(CPUS)))
    assert plan.worker_affinity is None  # threaded workers stay unpinned
    assert plan.idle_poll is False  # threaded workers do not idle-poll
    assert plan.measured["record_bytes"] >= 84 * 84 * 3


def test_vector_env_factories_fill_one_worker_each():
    plan = PoolPlan.build([_vector_cartpole] * 2, envs_per_worker="auto", seed=10)
    assert (plan.envs_per_factory, plan.num_envs, plan.num_workers) == (3, 6, 2)
    assert plan.groups == ((0, 1, 2), (3, 4, 5)) and plan.env_threads is False
    assert "probe_step_s" not in plan.measured  # a vector env is not timed: one per worker anyway
    # seeding: factory i's envs start from seed + i * k
    assert [fn.seed for fn in plan.create_env_fn] == [10, 13]


def test_explicit_keywords_win_and_nothing_is_timed():
    masks = [[CPUS[0]], [CPUS[-1]]]
    plan = PoolPlan.build([_cartpole] * 4, envs_per_worker=2, env_threads=True, worker_affinity=masks,
                          idle_poll=False, exchange="python", build_timeout=None, on_env_failure="restart",
                          restart_window_s=math.inf, max_restarts=0)
    assert (plan.envs_per_worker, plan.env_threads, plan.idle_poll, plan.exchange) == (2, True, False, "python")
    assert plan.worker_affinity == [(CPUS[0],), (CPUS[-1],)]
    assert (plan.restart.per_env, plan.restart.window_s, plan.restart.total) == (3, math.inf, 0)
    assert "probe_step_s" not in plan.measured
    assert {name: plan.decided[name] for name in ("envs_per_worker", "env_threads", "worker_affinity",
                                                  "idle_poll", "exchange", "build_timeout")} == dict.fromkeys(
        ("envs_per_worker", "env_threads", "worker_affinity", "idle_poll", "exchange", "build_timeout"), "given")


def test_repr_and_describe_show_the_decisions_and_the_measurements():
    plan = PoolPlan.build([_cartpole] * 4, envs_per_worker="auto", seed=3, batching={"min_batch_size": 2})
    text = repr(plan)
    assert text.startswith("PoolPlan(num_envs=4, ") and "envs_per_worker=" in text and "(auto)" in text
    assert "probe: " in text and "blocking=False" in text and "seed=3" in text
    d = plan.describe()
    assert d["num_envs"] == 4 and d["num_workers"] == plan.num_workers and d["seed"] == 3
    assert d["batching"] == {"min_batch_size": 2} and d["decided"]["envs_per_worker"] == "auto"
    assert set(d["measured"]) >= {"probe_step_s", "blocking", "record_bytes", "spec_env_build_s"}
    assert d["max_restarts_per_env"] is None  # on_env_failure="raise": no restart policy
    m = plan.metrics()
    assert m["plan_blocking"] == 0.0 and m["plan_probe_step_s"] == plan.measured["probe_step_s"]


def test_the_pool_builds_its_plan_and_takes_a_prebuilt_one():
    with AsyncEnvPool([ZeroLatencyEnv] * 4, envs_per_worker=2, backend="threading") as pool:
        assert pool.plan.num_workers == pool.num_workers == 2 and pool.plan.backend == "threading"
        text = repr(pool)
        assert "num_workers=2" in text and "envs_per_worker=2" in text and "auto=[" in text
        m = pool.metrics()
        assert m["plan_record_bytes"] == pool.plan.measured["record_bytes"] and m["plan_pinned_workers"] == 0
        assert math.isnan(m["plan_probe_step_s"]) and math.isnan(m["plan_blocking"])  # not timed
    plan = PoolPlan.build([ZeroLatencyEnv] * 2, envs_per_worker="auto", backend="threading")
    for _ in range(2):  # a plan may build several pools
        with AsyncEnvPool(plan=plan) as pool:
            assert pool.plan is plan and pool.num_envs == 2
            td = pool.recv(min_get=2)
            pool.send(_zero_action(td.clone()), td.env_indices)


def test_options_next_to_a_plan_are_refused():
    plan = PoolPlan.build([ZeroLatencyEnv] * 2, envs_per_worker=2, backend="threading")
    with pytest.raises(TypeError, match=r"\['seed'\]"):
        AsyncEnvPool(plan=plan, seed=3)
    with pytest.raises(TypeError, match="create_env_fn"):
        AsyncEnvPool([ZeroLatencyEnv] * 2, plan=plan)
    with pytest.raises(TypeError, match="plan must be a PoolPlan"):
        AsyncEnvPool(plan={"envs_per_worker": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'cancel_start'"):
        PoolPlan.build([ZeroLatencyEnv], cancel_start=lambda: False)
    with SpecEnv.open([ZeroLatencyEnv] * 2) as spec_env:
        with pytest.raises(TypeError, match="from the spec env"):
            PoolPlan.build([ZeroLatencyEnv] * 2, spec_env=spec_env)
        plan = PoolPlan.build(spec_env=spec_env, envs_per_worker="auto")  # its factories, checked
        assert plan.num_envs == 2 and "probe_step_s" in plan.measured and not spec_env.closed
    assert spec_env.closed


def test_the_plan_defaults_are_the_pool_defaults():
    import inspect

    import torchrl_asyncpool.pool

    assert torchrl_asyncpool.pool.PoolPlan is PoolPlan

    params = inspect.signature(AsyncEnvPool.__init__).parameters
    assert {name: params[name].default for name in OPTIONS} == OPTIONS


@pytest.mark.parametrize("options, error", [
    (dict(exchange="shm"), "exchange must be one of"),
    (dict(idle_poll="sometimes"), "idle_poll must be"),
    (dict(on_env_failure="retry"), "on_env_failure must be"),
    (dict(max_restarts_per_env=0), "max_restarts_per_env must be a positive int"),
    (dict(step_timeout=-1), "step_timeout must be None or a positive"),
    (dict(build_timeout="soon"), "build_timeout must be"),
    (dict(worker_affinity="spread"), "worker_affinity must be"),
    (dict(seed=-1), "seed must be None or a non-negative int"),
    (dict(envs_per_worker=0), "envs_per_worker must be a positive int"),
])
def test_bad_options_raise_the_pools_errors_before_any_env_is_built(options, error):
    BUILT.clear()
    with pytest.raises(ValueError, match=error):
        PoolPlan.build([_counted_cartpole] * 2, **options)
    with pytest.raises(ValueError, match=error):
        AsyncEnvPool([_counted_cartpole] * 2, **options)
    if "envs_per_worker" not in options:  # grouping is checked once the spec env tells what it hosts
        assert BUILT == []


def test_restart_policy_is_the_one_rule_of_the_pool_and_evaluate():
    assert restart_policy("raise", 3, 60.0, 100) is None
    with pytest.raises(ValueError, match="restart_window_s must be") as pool_error:
        PoolPlan.build([_cartpole], on_env_failure="restart", restart_window_s=0)
    with pytest.raises(ValueError, match="restart_window_s must be") as eval_error:
        evaluate(_cartpole, _zero_action, [Episode("a", seed=0)], restart_window_s=0)
    assert str(pool_error.value) == str(eval_error.value)
    # both accept an infinite window and no overall budget left
    results = evaluate(_cartpole, _zero_action, [Episode("a", seed=0, max_steps=5)], num_envs=1,
                       restart_window_s=math.inf, max_restarts=0)
    assert results[0].status in ("completed", "timeout")


def test_evaluate_builds_its_pools_from_a_plan():
    # a grouping the plan refuses fails evaluate() with the pool's own error
    with pytest.raises(ValueError, match="envs_per_worker must be a positive int") as eval_error:
        evaluate(_cartpole, _zero_action, [Episode("a", seed=0, max_steps=3)], num_envs=1, envs_per_worker=0)
    with pytest.raises(ValueError) as pool_error:
        AsyncEnvPool([_cartpole], envs_per_worker=0)
    assert str(eval_error.value) == str(pool_error.value)


def test_the_collector_builds_the_spec_env_once_and_reports_the_plan():
    BUILT.clear()
    collector = AsyncPoolCollector([_counted_cartpole] * 4, policy=_zero_action, frames_per_batch=8, total_frames=8,
                                   min_batch_size=1, server_timeout=0.0)
    try:
        assert BUILT == [os.getpid()]  # the policy's layout and the pool's plan read one env
        plan = collector.env.plan
        startup = collector.plan()["startup"]
        assert startup["num_workers"] == collector.env.num_workers == plan.num_workers
        assert startup["decided"]["envs_per_worker"] == "auto" and "probe_step_s" in startup["measured"]
        assert startup["batching"]["min_batch_size"] == 1 and startup["batching"]["server_timeout"] == 0.0
        assert "policy_affinity" in startup
        for batch in collector:
            assert batch.numel() == 8
    finally:
        collector.shutdown()


def _rooms_that_see(target, build) -> tuple:
    """The package modules ("rooms") whose functions see ``target`` (a local, or the first item of a
    list or tuple local) while ``build()`` runs, as ``([room, visits], ...)`` in order of first
    entry, and what ``build()`` returned. A visit lasts while a frame of its room that saw
    ``target`` runs: a room that calls a lower one and carries on after it returns is still on its
    one visit, and so is a lower room called again by the same visit (once per item of a loop).
    Entering a room again from anywhere else is a second visit."""
    import sys

    import torchrl_asyncpool

    root = os.path.dirname(torchrl_asyncpool.__file__) + os.sep
    frame_visit, visit_of_call, visits = {}, {}, {}

    def sees(value):
        return value is target or (isinstance(value, (list, tuple)) and len(value) and value[0] is target)

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        if not any(sees(v) for v in frame.f_locals.values()):
            return
        room = os.path.relpath(frame.f_code.co_filename, root)
        up = frame.f_back
        while up is not None and frame_visit.get(id(up), (None,))[0] is not up:
            up = up.f_back
        parent = None if up is None else frame_visit[id(up)][1]
        if parent is not None and parent[0] == room:
            visit = parent  # a call within the room's own visit
        else:
            visit = visit_of_call.get((room, parent))
            if visit is None:
                visits[room] = visits.get(room, 0) + 1
                visit = visit_of_call[room, parent] = (room, len(visit_of_call))
        frame_visit[id(frame)] = (frame, visit)  # the frame kept: its id is not reused while this runs

    sys.setprofile(profile)
    try:
        result = build()
    finally:
        sys.setprofile(None)
    return [[room, n] for room, n in visits.items()], result


def test_the_collectors_start_up_visits_each_room_once_in_one_direction():
    # following the factories (and the policy) from the collector's constructor: checked once
    # (config, by the pool's rules), the spec env built once, then the plan's rooms, then the build
    rooms, collector = _rooms_that_see(_cartpole, lambda: AsyncPoolCollector(
        [_cartpole] * 4, policy=_zero_action, frames_per_batch=64, total_frames=64))
    collector.shutdown()
    assert [n for _, n in rooms] == [1] * len(rooms), rooms
    order = [room for room, _ in rooms]
    assert order[:4] == ["collector/collector.py", "collector/config.py", "pool/arguments.py", "pool/layout.py"]
    assert order.index("pool/plan.py") < order.index("pool/seeding.py") < order.index("pool/processes.py"), order
    policy_rooms, collector = _rooms_that_see(_zero_action, lambda: AsyncPoolCollector(
        [_cartpole] * 2, policy=_zero_action, frames_per_batch=64, total_frames=64))
    collector.shutdown()
    assert [n for _, n in policy_rooms] == [1] * len(policy_rooms), policy_rooms
