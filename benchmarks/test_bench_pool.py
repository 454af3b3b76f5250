"""pytest-benchmark suite: a fixed number of recv/send round trips on 8 zero-latency envs.

Not part of the main test run (``testpaths = ["test"]``); run it explicitly::

    pytest benchmarks/                                   # all implementations
    pytest benchmarks/ -k "ours"                         # ours only (skips TorchRL's slow start-up)
    pytest benchmarks/ --benchmark-json bench.json       # machine-readable results

One benchmark round = ``ROUND_TRIPS`` consumer round trips (``recv(min_get=1)`` then ``send``
of the whole batch), so the reported time per round is directly comparable between the
implementations; ``extra_info`` carries the transitions/s measured over the timed rounds and the
mean batch size. Pools are module-scoped: built once (start-up is not timed) and closed at the end.
Set ``TORCHRL_ASYNCPOOL_BENCH_TRIPS`` to change the number of round trips per round.
"""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("pytest_benchmark")

import compare_pool as cp  # noqa: E402  (benchmarks/ is put on sys.path by conftest.py)

NUM_ENVS = 8
ROUND_TRIPS = int(os.environ.get("TORCHRL_ASYNCPOOL_BENCH_TRIPS", "200"))
# TorchRL's queue exchange does ~20 round trips/s here: fewer rounds keep the suite short.
ROUNDS = {"ours": 5, "ours-auto": 5, "ours-auto-py": 5, "torchrl-shm": 5, "torchrl-queue": 2}


def _driver(impl):
    factories = cp.env_factories("zero", NUM_ENVS)
    driver = cp.make_driver(impl, factories, cp.action_sampler(factories[0]))
    try:
        driver.start()
        cp.drive_for(driver, 0.2)  # the first records after start-up are not representative
        yield driver
    finally:
        if driver.pool is not None:
            driver.close()
        leaked = cp.reap(driver.pids)
        assert not leaked, f"{impl} left worker processes {leaked} after close()"


@pytest.fixture(scope="module")
def ours_pool():
    yield from _driver("ours")


@pytest.fixture(scope="module")
def ours_auto_pool():
    yield from _driver("ours-auto")


@pytest.fixture(scope="module")
def ours_auto_py_pool():
    yield from _driver("ours-auto-py")


@pytest.fixture(scope="module")
def torchrl_shm_pool():
    yield from _driver("torchrl-shm")


@pytest.fixture(scope="module")
def torchrl_queue_pool():
    yield from _driver("torchrl-queue")


def _bench(benchmark, driver, impl):
    timed = []

    def round_trips():
        t0 = time.perf_counter()
        frames = 0
        for _ in range(ROUND_TRIPS):
            frames += driver.round_trip()
        timed.append((frames, time.perf_counter() - t0))
        return frames

    frames = benchmark.pedantic(round_trips, rounds=ROUNDS[impl], warmup_rounds=1, iterations=1)
    # The last rounds are the timed ones: pedantic runs the warm-up round first, except under
    # --benchmark-disable, where it makes a single call and no warm-up (nothing to drop then).
    timed = timed[-ROUNDS[impl]:]
    total_frames = sum(f for f, _ in timed)
    benchmark.extra_info.update(
        {
            "impl": impl,
            "num_envs": NUM_ENVS,
            "round_trips_per_round": ROUND_TRIPS,
            "transitions_per_s": total_frames / sum(dt for _, dt in timed),
            "mean_batch": total_frames / (ROUND_TRIPS * len(timed)),
        }
    )
    assert frames >= ROUND_TRIPS  # every round trip hands out at least one transition
    assert 1 <= benchmark.extra_info["mean_batch"] <= NUM_ENVS


@pytest.mark.timeout(600)
def test_ours_zero_latency_8(benchmark, ours_pool):
    benchmark.group = "zero-latency env, 8 envs"
    _bench(benchmark, ours_pool, "ours")


@pytest.mark.timeout(600)
def test_ours_auto_zero_latency_8(benchmark, ours_auto_pool):
    benchmark.group = "zero-latency env, 8 envs"
    _bench(benchmark, ours_auto_pool, "ours-auto")


@pytest.mark.timeout(600)
def test_ours_auto_python_exchange_zero_latency_8(benchmark, ours_auto_py_pool):
    benchmark.group = "zero-latency env, 8 envs"
    _bench(benchmark, ours_auto_py_pool, "ours-auto-py")


@pytest.mark.timeout(600)
def test_torchrl_shm_zero_latency_8(benchmark, torchrl_shm_pool):
    benchmark.group = "zero-latency env, 8 envs"
    _bench(benchmark, torchrl_shm_pool, "torchrl-shm")


@pytest.mark.timeout(600)
def test_torchrl_queue_zero_latency_8(benchmark, torchrl_queue_pool):
    benchmark.group = "zero-latency env, 8 envs"
    _bench(benchmark, torchrl_queue_pool, "torchrl-queue")
