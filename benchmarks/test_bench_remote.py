"""pytest-benchmark suite: recv/send round trips through remote env hosts against local workers.

Not part of the main test run; run it explicitly (needs grpcio)::

    pytest benchmarks/test_bench_remote.py
    pytest benchmarks/test_bench_remote.py --benchmark-json bench.json

Four CartPole envs, stepped by the pool's own workers (``local``) or by one env-host process
connected over gRPC (``remote``, see ``compare_remote.py``). One round = ``ROUND_TRIPS``
consumer round trips; ``extra_info`` carries the records/s over the timed rounds. Pools are
module-scoped: built once (start-up and host connection are not timed).
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("pytest_benchmark")
pytest.importorskip("grpc")

import compare_remote as cr  # noqa: E402  (benchmarks/ is put on sys.path by conftest.py)

NUM_ENVS = 4
ROUND_TRIPS = 200
ROUNDS = 5


@pytest.fixture(scope="module")
def local():
    with cr.local_pool("cartpole", NUM_ENVS) as (pool, _):
        cr.wait_all_started(pool, NUM_ENVS)
        yield pool


@pytest.fixture(scope="module")
def remote():
    with cr.remote_pool("cartpole", NUM_ENVS, host_procs=1) as (pool, _):
        cr.wait_all_started(pool, NUM_ENVS)
        yield pool


def _bench(benchmark, pool):
    timed = []

    def round_trips():
        t0 = time.perf_counter()
        records = sum(cr.round_trip(pool) for _ in range(ROUND_TRIPS))
        timed.append((records, time.perf_counter() - t0))
        return records

    benchmark.pedantic(round_trips, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    timed = timed[-ROUNDS:]  # the last calls are the timed rounds (one call under --benchmark-disable)
    records, seconds = sum(r for r, _ in timed), sum(t for _, t in timed)
    assert records >= ROUND_TRIPS * len(timed)  # every round trip answered at least one record
    benchmark.extra_info["records_per_s"] = records / seconds
    benchmark.extra_info["mean_batch"] = records / (ROUND_TRIPS * len(timed))


def test_local_workers(benchmark, local):
    _bench(benchmark, local)


def test_remote_env_hosts(benchmark, remote):
    _bench(benchmark, remote)
