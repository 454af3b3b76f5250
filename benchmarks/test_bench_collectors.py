"""pytest-benchmark suite: frames delivered to the learner, collectors against gymnasium loops.

Not part of the main test run (``testpaths = ["test"]``); run it explicitly::

    pytest benchmarks/test_bench_collectors.py                  # ours and the gymnasium loops
    pytest benchmarks/test_bench_collectors.py -m torchrl       # TorchRL's collectors (minutes of start-up)
    pytest benchmarks/test_bench_collectors.py --benchmark-json bench.json

Same workloads and policy as ``compare_collectors.py`` (CartPole-v1 with 32 envs, the 2 ms
pixel env with 16 envs). One benchmark round delivers ``BATCHES`` batches of
``FRAMES_PER_BATCH`` transitions to the learner (a gymnasium loop: the same number of
transitions, one ``step`` of every env at a time), so the time per round compares directly
within a group; ``extra_info`` carries ``frames_per_s`` and, for the 2 ms env, the share of
the N/latency limit. Collectors and vector envs are built once per test (start-up is not
timed) and shut down at the end. ``compare_collectors.py`` is the side-by-side script with
start-up/shutdown times and repeats; this suite is its pytest-benchmark form.
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("pytest_benchmark")

import compare_collectors as cc  # noqa: E402  (benchmarks/ is put on sys.path by conftest.py)
import compare_vector_envs as cv  # noqa: E402

FRAMES_PER_BATCH = 1024
BATCHES = 8
ROUNDS = 5
CELLS = [("cartpole", 32), ("sleep2ms", 16)]


def _record(benchmark, impl, w, n, timed):
    frames = sum(f for f, _ in timed)
    fps = frames / sum(dt for _, dt in timed)
    benchmark.group = f"{w}, {n} envs"
    benchmark.extra_info.update({"impl": impl, "workload": w, "num_envs": n, "frames_per_s": fps})
    if w.startswith("sleep2ms"):
        benchmark.extra_info["pct_of_n_over_latency"] = 100.0 * fps / (n / 0.002)
    # One entry in ``timed`` per call of the benchmarked function: ROUNDS calls when timed, a
    # single one under --benchmark-disable (pedantic then runs it once), so count what ran.
    assert frames == len(timed) * BATCHES * FRAMES_PER_BATCH  # nothing lost, nothing extra


def _bench_collector(benchmark, build, impl, w, n):
    collector = build(w, n, FRAMES_PER_BATCH)
    it = None
    try:
        it = iter(collector)
        for _ in range(2):  # start-up and the first, unrepresentative batches are not timed
            next(it)
        timed = []

        def batches():
            t0 = time.perf_counter()
            frames = sum(next(it).numel() for _ in range(BATCHES))
            timed.append((frames, time.perf_counter() - t0))

        benchmark.pedantic(batches, rounds=ROUNDS, iterations=1)
        _record(benchmark, impl, w, n, timed)
    finally:
        if it is not None:
            it.close()  # its own clean-up now, not from a finalizer at interpreter exit
        collector.shutdown()


def _bench_gym(benchmark, build, impl, w, n):
    venv = build(w, n)
    try:
        loop = cc.GymLoop(venv, w)
        for _ in range(10):
            loop.step()
        steps = BATCHES * FRAMES_PER_BATCH // n
        timed = []

        def batches():
            t0 = time.perf_counter()
            frames = sum(loop.step() for _ in range(steps))
            timed.append((frames, time.perf_counter() - t0))

        benchmark.pedantic(batches, rounds=ROUNDS, iterations=1)
        _record(benchmark, impl, w, n, timed)
    finally:
        venv.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("w,n", CELLS)
def test_asyncpool(benchmark, w, n):
    _bench_collector(benchmark, cc.build_asyncpool, "asyncpool", w, n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("w,n", CELLS)
def test_asyncpool_python_exchange(benchmark, w, n):
    _bench_collector(benchmark, cc.build_asyncpool_py, "asyncpool_py", w, n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("w,n", CELLS)
def test_asyncpool_unpinned(benchmark, w, n):
    _bench_collector(benchmark, cc.build_asyncpool_unpinned, "asyncpool_unpinned", w, n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("w,n", CELLS)
def test_asyncpool_no_idle_poll(benchmark, w, n):
    _bench_collector(benchmark, cc.build_asyncpool_no_idle, "asyncpool_no_idle", w, n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("w,n", CELLS)
def test_gym_async_fork(benchmark, w, n):
    _bench_gym(benchmark, cc.build_gym_async, "gym_async", w, n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("w,n", CELLS[:1])  # on the 2 ms env it steps 16 sleeps in a row: 20 s a round
def test_gym_sync(benchmark, w, n):
    _bench_gym(benchmark, cc.build_gym_sync, "gym_sync", w, n)


@pytest.mark.torchrl
@pytest.mark.timeout(900)
@pytest.mark.parametrize("w,n", CELLS)
def test_torchrl_async(benchmark, w, n):
    _bench_collector(benchmark, cc.build_torchrl_async, "torchrl_async", w, n)


@pytest.mark.torchrl
@pytest.mark.timeout(900)
@pytest.mark.parametrize("w,n", CELLS)
def test_torchrl_sync(benchmark, w, n):
    _bench_collector(benchmark, cc.build_torchrl_sync, "torchrl_sync", w, n)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("w,workers,k", [("cartpole_vec", 2, 32), ("sleep2ms_vec", 8, 16)])
def test_asyncpool_vector_envs(benchmark, w, workers, k):
    """Vector env factories (``compare_vector_envs.py``): ``workers`` vector envs of ``k``."""
    _bench_collector(benchmark, lambda w, n, fpb: cv.build_asyncpool(w, workers, k, fpb), "asyncpool", w, workers * k)
