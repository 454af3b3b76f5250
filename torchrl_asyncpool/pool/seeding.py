"""How :class:`~torchrl_asyncpool.AsyncEnvPool` seeds its envs (``seed=``): env ``i`` (slot ``i``)
is reset first with ``seed + i``; a vector or batched env of ``k`` envs gets its first slot's seed."""
from __future__ import annotations

import numbers

from torchrl_asyncpool.envs.env_attrs import FIRST_SEED_ATTR


def _check_seed(seed):
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise ValueError(f"seed must be None or a non-negative int (gymnasium refuses negative seeds), got {seed!r}.")


class _SeededFactory:
    """Builds the user's env and marks its first reset's seed (read by the worker's env adapter).
    Picklable when the wrapped factory is."""

    def __init__(self, create_env_fn, seed: int):
        self.create_env_fn = create_env_fn
        self.seed = int(seed)

    def __call__(self, **kwargs):
        env = self.create_env_fn(**kwargs)
        setattr(env, FIRST_SEED_ATTR, self.seed)
        return env


def _seeded_factories(fns, seed, envs_per_factory):
    """``fns`` with factory ``i`` marking its env's first seed ``seed + i * envs_per_factory``
    (``seed=None``: ``fns`` as they are). Only the workers' envs are seeded, not the spec env."""
    if seed is None:
        return fns
    return [_SeededFactory(fn, seed + i * envs_per_factory) for i, fn in enumerate(fns)]


def _refuse_remote_seed(seed):
    """Remote env slots are not seeded here: their hosts own their envs."""
    if seed is not None:
        raise ValueError(
            "seed= seeds the envs that the workers build; a remote env slot's host owns its env and its "
            "resets. Seed the envs on the host side."
        )
