"""Sizes that the machine cannot hold are refused at construction, naming the option, before any
large buffer is allocated; counts get range checks with TorchRL-style messages."""
import time

import gymnasium as gym
import pytest
import torch

from torchrl_asyncpool import AsyncEnvPool, AsyncPoolCollector
from torchrl_asyncpool.delivery.chunks import available_memory, check_fits
from torchrl_asyncpool.inference.examples import MLPPolicy


def _cartpole():
    return gym.make("CartPole-v1")


def _collector(**kwargs):
    args = dict(policy=MLPPolicy(obs_dim=4, num_actions=2, dtype=torch.float32), frames_per_batch=64,
                total_frames=128)
    args.update(kwargs)
    return AsyncPoolCollector([_cartpole] * 2, **args)


@pytest.mark.parametrize("kwargs, option", [
    ({"transition_chunk_size": 10**9}, "transition_chunk_size=1000000000"),
    ({"frames_per_batch": 10**12}, "frames_per_batch=1000000000000"),
])
def test_a_size_beyond_the_machine_fails_at_construction_naming_the_option(kwargs, option):
    if available_memory() is None:
        pytest.skip("no /proc/meminfo here")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=option) as info:
        _collector(**kwargs)
    assert time.monotonic() - t0 < 30  # refused from the layout, not after an allocation (OOM or swap)
    assert "GiB of memory" in str(info.value) and "available" in str(info.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"chunks_per_env": 0}, "chunks_per_env must be a positive int, got 0"),
    ({"chunks_per_env": 1.5}, "chunks_per_env must be a positive int"),
    ({"transition_chunk_size": 0}, "transition_chunk_size must be a positive int or 'auto', got 0"),
    ({"transition_chunk_size": "big"}, "transition_chunk_size must be a positive int or 'auto'"),
    ({"frames_per_batch": 0}, "frames_per_batch must be a positive int"),
])
def test_counts_out_of_range_are_refused_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _collector(**kwargs)


def test_the_pool_refuses_chunk_buffers_beyond_the_machine():
    if available_memory() is None:
        pytest.skip("no /proc/meminfo here")
    with pytest.raises(ValueError, match="transition_chunk_size=10000000000 with chunks_per_env=2"):
        AsyncEnvPool([_cartpole] * 2, transition_chunk_size=10**10)
    with pytest.raises(ValueError, match="chunks_per_env must be a positive int, got 0"):
        AsyncEnvPool([_cartpole] * 2, transition_chunk_size=8, chunks_per_env=0)


def test_check_fits_compares_with_what_is_available():
    check_fits(10, "ten bytes", available=10)
    with pytest.raises(ValueError, match="eleven bytes needs 0.0 GiB of memory"):
        check_fits(11, "eleven bytes", available=10)
