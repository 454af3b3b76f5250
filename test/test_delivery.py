"""Dense per-env chunk delivery: exactly once, in order, with back-pressure instead of loss."""
import time

import pytest

from conftest import oracle_factories, served
from torchrl_asyncpool import AsyncEnvPool
from torchrl_asyncpool.testing import OracleChecker

try:
    from torchrl_asyncpool.exchange import _native
except ImportError:  # installed without its C extension
    _native = None


@pytest.mark.parametrize(
    "num_envs,envs_per_worker,env_threads,chunk,frames",
    [(1, 1, False, 4, 10), (8, 4, False, 5, 64), (8, 4, True, 5, 64), (8, 1, False, 16, 50), (2, 1, False, 3, 100)],
)
def test_chunks_exactly_once_in_order(num_envs, envs_per_worker, env_threads, chunk, frames, dev_shm_guard):
    _check_chunks(num_envs, envs_per_worker, env_threads, chunk, frames)


@pytest.mark.skipif(_native is None, reason="idle polling needs the C extension")
def test_chunks_exactly_once_in_order_with_idle_polled_waits(dev_shm_guard):
    # the learner's waits for full chunks park for the idle poller instead of blocking in poll(2)
    _check_chunks(8, 4, False, 5, 64, idle_poll=True)
    with AsyncEnvPool(oracle_factories(2), transition_chunk_size=4, idle_poll=True) as pool:
        t0 = time.monotonic()
        assert pool.take_transitions(8, timeout=0.2) is None  # no consumer: no steps, and the timeout holds
        assert time.monotonic() - t0 < 10


def _check_chunks(num_envs, envs_per_worker, env_threads, chunk, frames, **pool_kwargs):
    checker = OracleChecker()
    with AsyncEnvPool(oracle_factories(num_envs), envs_per_worker=envs_per_worker, env_threads=env_threads,
                      transition_chunk_size=chunk, **pool_kwargs) as pool, served(pool):
        total = 0
        for _ in range(6):
            batch = pool.take_transitions(frames, timeout=30)
            assert batch is not None and batch.batch_size == (frames,)
            checker.observe_transitions(batch)
            total += frames
            time.sleep(0.01)  # a slow learner: workers must wait, not drop
        # the learner's waits follow the pool's idle_poll
        assert pool._chunk_reader._wait.waiter.idle == int(bool(pool.idle_poll))
        # it measured how fast the chunks fill, which lets its waits sleep through the rings
        assert pool._chunk_reader.rate is not None and pool._chunk_reader.rate > 0
    assert checker.records == total
    assert checker.episodes_done > 0


def test_take_transitions_times_out_without_consuming():
    with AsyncEnvPool(oracle_factories(2), transition_chunk_size=4) as pool:
        assert pool.take_transitions(8, timeout=0.1) is None  # no consumer: no steps
    with AsyncEnvPool(oracle_factories(1)) as pool:
        with pytest.raises(RuntimeError, match="transition_chunk_size"):
            pool.take_transitions(4)
