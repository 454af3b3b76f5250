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


def _ptr(batch):
    return batch["observation"].data_ptr()


def test_a_new_batch_reuses_the_memory_of_one_nothing_references_any_more(dev_shm_guard):
    # a for loop holds batch N while N+1 is taken: N+1 goes into N-1's memory, once nothing
    # (no tensor, view, numpy array or autograd graph) holds N-1; every batch stays exact
    import torch

    checker = OracleChecker()

    def take():
        out = pool.take_transitions(16, timeout=30)
        checker.observe_transitions(out)
        return out

    with AsyncEnvPool(oracle_factories(4), transition_chunk_size=4) as pool, served(pool):
        first = take()
        seen = [_ptr(first)]
        del first
        batch = None
        for _ in range(6):
            batch = take()  # the previous batch is still bound to the name while this one is taken
            seen.append(_ptr(batch))
        assert seen[1] == seen[0] and seen[2] != seen[1], seen  # dropped: its memory serves the next batch
        assert all(seen[k] == seen[k - 2] for k in range(3, len(seen))), seen  # then two buffers in turn

        # anything still over a batch keeps its memory out of the next batches
        keep = take()
        kept = keep.clone()
        view = take()
        view_part, view_copy = view["observation"][2:5], view["observation"][2:5].clone()
        numpy_view = take()
        as_numpy, numpy_copy = numpy_view["observation"].numpy(), numpy_view["observation"].clone()
        graph = take()
        obs = graph["observation"]
        assert obs.dtype == torch.float32
        w = torch.ones(obs.shape[-1], requires_grad=True)
        loss = (obs * w).sum()  # saves the observation itself for its backward
        expected_grad = obs.sum(0)
        ptrs = {_ptr(keep), _ptr(view), _ptr(numpy_view), _ptr(graph)}
        del view, numpy_view, graph, obs
        for _ in range(6):
            batch = take()
            assert _ptr(batch) not in ptrs
        loss.backward()
        assert torch.equal(w.grad, expected_grad)
        assert (keep == kept).all() and torch.equal(view_part, view_copy)
        assert torch.equal(torch.from_numpy(as_numpy), numpy_copy)
    assert checker.records == 16 * 17
