"""EnvPool's gymnasium-API envs (``envpool.make_gymnasium(task, num_envs=k)``) hosted as vector
envs: ``k`` slots of one worker, stepped in lockstep (:class:`EnvPoolVectorAdapter`).

An EnvPool env is both a ``gymnasium.vector.VectorEnv`` and a ``gymnasium.Env`` (its
``observation_space``/``action_space`` are one env's, its ``reset``/``step`` batched), so it is
recognized before the single-env adapter could take it. Its synchronous mode
(``batch_size == num_envs``, the default) autoresets in gymnasium's ``NEXT_STEP`` mode, the
pool's episode contract: the step after an env ended ignores that env's action and returns its
reset observation (reward 0, not done), published as a ``FIRST`` record.

EnvPool fixes its seeds when it is built (``seed=s`` seeds env ``j`` with ``s + j``; its
``reset(seed=...)`` only warns). When the pool asks for a first seed (``AsyncEnvPool(seed=...)``)
that the env was not built with, the adapter builds the env once more from the same config with
that seed, so sub-env ``j`` starts from ``seed + j`` as a seeded gymnasium vector env does.
"""
from __future__ import annotations

import sys
from typing import Dict

from torchrl_asyncpool.envs.env_attrs import FIRST_SEED_ATTR, env_where, own_attr, plan_of
from torchrl_asyncpool.envs.gymnasium_adapters import GymnasiumVectorAdapter

__all__ = ["EnvPoolVectorAdapter", "is_envpool"]

_INT32_MAX = 2**31  # EnvPool's seeds are C++ ints


def is_envpool(env) -> bool:
    """True for an EnvPool gymnasium-API env (``envpool.make_gymnasium``), possibly inside
    gymnasium vector wrappers.

    Args:
        env: what an env factory returned.

    Returns:
        Whether ``env.unwrapped`` is an EnvPool env.

    Examples:
        >>> import envpool
        >>> from torchrl_asyncpool.envs.envpool_adapter import is_envpool
        >>> env = envpool.make_gymnasium("CartPole-v1", num_envs=2)
        >>> is_envpool(env)
        True
        >>> env.close()
    """
    # an env of a module never imported cannot be EnvPool's: no import of envpool here
    module = sys.modules.get("envpool.python.gymnasium_envpool")
    if module is None:
        return False
    return isinstance(getattr(env, "unwrapped", env), module.GymnasiumEnvPoolMixin)


def _built_seeds(pool) -> list:
    """The seeds EnvPool gave its envs: ``env_seed`` when set, else ``seed + j``."""
    config = pool.config
    return list(config["env_seed"]) or [config["seed"] + j for j in range(config["num_envs"])]


def _reseeded(env, seed: int, where: str):
    """``env`` (an EnvPool env, closed here) built again from its config with ``seed=seed``."""
    if not 0 <= seed < _INT32_MAX - env.num_envs:
        raise ValueError(f"{where}: the pool's seed {seed} (+ up to {env.num_envs - 1} for its envs) is out "
                         "of EnvPool's range of seeds (a C++ int); seed the pool with a smaller seed.")
    if env.unwrapped is not env:
        raise ValueError(
            f"{where} is an EnvPool env inside gymnasium wrappers, built with seeds {_built_seeds(env.unwrapped)}; "
            f"the pool asks for {seed} + j for env j. EnvPool fixes its seeds when it is built and the pool "
            "cannot rebuild a wrapped one: build it with envpool.make_gymnasium(..., seed=...) in the factory "
            "(through create_env_kwargs), or seed the pool with seed=None."
        )
    spec = env.spec
    config = dict(env.config, seed=int(seed), env_seed=[])
    new_spec = type(spec)(type(spec).gen_config(**config))
    env.close()
    return type(env)(new_spec)


class EnvPoolVectorAdapter(GymnasiumVectorAdapter):
    """Runs an EnvPool gymnasium-API env of ``k`` envs in ``k`` consecutive slots, in lockstep.

    The slots' fields are those of :class:`~torchrl_asyncpool.envs.gymnasium_adapters.GymnasiumEnvAdapter`
    for EnvPool's (single-env) ``observation_space`` and ``action_space``: a ``Discrete`` action
    is an ``int64`` slot entry, which EnvPool casts to its own action dtype (``int32`` for Atari)
    when stepped. :meth:`reset` and :meth:`step` work on all ``k`` envs at once, in ``env_id``
    order (EnvPool's synchronous mode); the asynchronous mode (``batch_size < num_envs``), whose
    steps return only some of the envs, is refused: the pool already overlaps the stepping with
    inference.

    Args:
        env: an ``envpool.make_gymnasium(...)`` env (optionally inside gymnasium vector wrappers).
        env_index (int, optional): the pool's index of its first env, for error messages.

    Examples:
        >>> import envpool
        >>> import numpy as np
        >>> from torchrl_asyncpool.envs.envpool_adapter import EnvPoolVectorAdapter
        >>> adapter = EnvPoolVectorAdapter(envpool.make_gymnasium("CartPole-v1", num_envs=4))
        >>> adapter.num_envs, adapter.path
        (4, 'envpool')
        >>> obs = adapter.reset()
        >>> obs["observation"].shape
        (4, 4)
        >>> obs, reward, terminated, truncated = adapter.step({"action": np.zeros(4, np.int64)})
        >>> reward.shape, terminated.dtype
        ((4,), dtype('bool'))
        >>> adapter.close()
    """

    path = "envpool"

    def __init__(self, env, env_index: int | None = None):
        where = f"{env_where(env_index)} (an EnvPool env)"
        pool = env.unwrapped
        try:
            if pool.is_async:
                raise TypeError(
                    f"{where} runs in EnvPool's asynchronous mode (batch_size={pool.config['batch_size']} < "
                    f"num_envs={pool.num_envs}), whose steps return only some of its envs; the pool steps all of "
                    "a vector env's envs together and overlaps that with inference itself. Build it without "
                    "batch_size (or with batch_size=num_envs)."
                )
            if plan_of(env) is not None:
                raise TypeError(f"{where}: fixed episode plans (evaluate()) need single envs, not a vector env.")
            seed = own_attr(env, FIRST_SEED_ATTR)
            if seed is not None and _built_seeds(pool) != [seed + j for j in range(pool.num_envs)]:
                env = _reseeded(env, int(seed), where)
        except BaseException:
            env.close()
            raise
        # what GymnasiumVectorAdapter checks besides (NEXT_STEP mode, not an AsyncVectorEnv) holds
        # for every EnvPool env in synchronous mode
        self.env = env
        self.num_envs = int(env.num_envs)
        self._read_spaces(env.single_observation_space, env.single_action_space, where)
        self._first_seed = None  # seeded when built (above); EnvPool's reset(seed=) only warns

    def reset(self):
        """Resets all ``k`` envs (seeded as they were built); returns the observations, each with a
        leading ``k``."""
        obs, _ = self.env.reset()
        return self._obs(obs)

    def step(self, actions: Dict):
        """Steps all ``k`` envs with ``actions["action"]`` (``[k, ...]``, numpy); returns
        ``(obs, reward, terminated, truncated)``, each with a leading ``k``. EnvPool copies the
        actions into its own buffers (casting them to its action dtype), so the slot rows are
        handed over as they are."""
        obs, reward, terminated, truncated, _ = self.env.step(actions["action"])
        return self._obs(obs), reward, terminated, truncated
